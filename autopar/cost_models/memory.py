"""Memory per device: model states by precision and ZeRO stage, saved activations from the graph.

Model states (Ψ parameters, N data-parallel ranks, K bytes of optimizer state
per parameter; Rajbhandari et al. 2020, "ZeRO"):

    no ZeRO   params P·Ψ      grads G·Ψ      optimizer K·Ψ
    ZeRO-1    P·Ψ             G·Ψ            K·Ψ / N
    ZeRO-2    P·Ψ             G·Ψ / N        K·Ψ / N
    ZeRO-3    P·Ψ / N         G·Ψ / N        K·Ψ / N

With bf16-mixed precision and Adam, P = 2 (the bf16 copy the graph reads),
G = 4 (fp32 gradients of the fp32 masters, which the optimizer reads) and
K = 12 (fp32 master copy, momentum, variance): 18Ψ in all, Megatron-LM's
figure for bf16 with fp32 gradient accumulation (the ZeRO paper's 16Ψ keeps
fp16 gradients).  In fp32, P = G = 4 and K = 8.  Gradients are reduced in the
plan's ``reduce_dtype``: fp32 by default (Megatron-LM, FSDP2 in torchtitan),
or the compute dtype, which halves the bytes the gradient reductions move but
not the gradients held.

Saved activations are what the backward reads from the forward. They are
read off the captured joint graph, not a per-model formula: every tensor a
forward node produces that a backward node consumes is kept from the
forward to the backward, so its bytes count towards the activation memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.errors import PlanError


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor under a training precision."""

    name: str
    param_bytes: int  # the copy the forward uses
    grad_bytes: int  # gradients as the optimizer reads them (of the masters under mixed precision)
    master_bytes: int  # fp32 master copy kept by the optimizer (0 when params are already fp32)
    activation_bytes: int  # floating-point activations
    compute_dtype: str  # key into DeviceSpec.peak_flops
    reduce_dtype: str = "fp32"  # gradients are reduced in this dtype ("fp32", or the compute dtype)

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype]


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", 4, 4, 0, 4, "fp32"),
    "bf16-mixed": Precision("bf16-mixed", 2, 4, 4, 2, "bf16"),
    "fp16-mixed": Precision("fp16-mixed", 2, 4, 4, 2, "fp16"),
}

# fp32 state tensors the optimizer keeps per parameter.
OPTIMIZER_STATES: dict[str, int] = {
    "adamw": 2,  # exp_avg, exp_avg_sq
    "adam": 2,
    "sgd": 1,  # momentum buffer
    "sgd-nomomentum": 0,
    "adagrad": 1,
    "rmsprop": 1,
}


def precision_spec(name: str, reduce_dtype: str | None = None) -> Precision:
    """The precision ``name``, its gradients reduced in ``reduce_dtype`` (None: fp32, the default)."""
    try:
        spec = PRECISIONS[name]
    except KeyError:
        raise PlanError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}") from None
    if reduce_dtype is None or reduce_dtype == spec.reduce_dtype:
        return spec
    if reduce_dtype != spec.compute_dtype:
        allowed = sorted({spec.reduce_dtype, spec.compute_dtype})
        choices = " or ".join(map(repr, allowed))
        raise PlanError(f"{name} cannot reduce gradients in {reduce_dtype!r}; pass reduce_dtype={choices}")
    return replace(spec, reduce_dtype=reduce_dtype)


def optimizer_states(name: str) -> int:
    try:
        return OPTIMIZER_STATES[name.lower()]
    except KeyError:
        raise PlanError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZER_STATES)}") from None


@dataclass(frozen=True)
class ModelStates:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def optimizer_bytes_per_param(precision: Precision, optimizer: str) -> int:
    return precision.master_bytes + 4 * optimizer_states(optimizer)


def partition_copy_bytes(precision: Precision) -> int:
    """Bytes per parameter of the flat partition a ZeRO-1/2 optimizer steps, beyond its state.

    With mixed precision the partition is the fp32 master copy, already counted
    in the optimizer's bytes.  In fp32 there is no master copy, and the
    optimizer steps a copy of the rank's chunk of each parameter
    (:mod:`autopar.runtime.zero`) while the forward reads the whole parameter:
    ``P·Ψ/N`` more.
    """
    return precision.param_bytes if precision.master_bytes == 0 else 0


def model_state_bytes(
    num_params: float, precision: Precision, optimizer: str, zero: int, dp: int
) -> ModelStates:
    """Per-device bytes of parameters, gradients and optimizer state (the table above)."""
    if zero not in (0, 1, 2, 3):
        raise PlanError(f"ZeRO stage must be 0, 1, 2 or 3, not {zero!r}")
    k = optimizer_bytes_per_param(precision, optimizer)
    return ModelStates(
        params=precision.param_bytes * num_params / (dp if zero >= 3 else 1),
        grads=precision.grad_bytes * num_params / (dp if zero >= 2 else 1),
        optimizer=(k + (partition_copy_bytes(precision) if zero in (1, 2) else 0)) * num_params / (dp if zero >= 1 else 1),
    )


def saved_activation_bytes(gm, phase_of, is_view) -> tuple[int, int]:
    """(floating-point, other) bytes, at the traced dtypes, of tensors the backward reads from the forward.

    A saved view costs nothing of its own: it is followed to the node that
    owns the storage, and each storage is counted once. Storages owned by
    placeholders (parameters, buffers, inputs) are not activations; they are
    counted elsewhere.
    """
    counted: set[str] = set()
    float_bytes = other_bytes = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or phase_of(node) != "forward":
            continue
        if not any(phase_of(user) == "backward" for user in node.users):
            continue
        root = node
        while root.op == "call_function" and is_view(root) and root.args and hasattr(root.args[0], "op"):
            root = root.args[0]
        if root.op != "call_function" or root.name in counted:
            continue
        counted.add(root.name)
        for t in _tensors(root.meta.get("val")):
            nbytes = int(t.numel()) * t.element_size()
            if t.dtype.is_floating_point:
                float_bytes += nbytes
            else:
                other_bytes += nbytes
    return float_bytes, other_bytes


def _tensors(val):
    import torch

    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (list, tuple)):
        for v in val:
            yield from _tensors(v)
