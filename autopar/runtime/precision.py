"""Mixed precision at run time: the dtypes a plan trains in, master weights, and fp16's loss scaling.

The plan's ``precision`` says what the cost model assumed (:mod:`autopar.cost_models.memory`);
:class:`PrecisionPolicy` is the same choice in torch dtypes, and the runtime does
what FSDP2's ``MixedPrecisionPolicy`` and Megatron-LM's mixed-precision
optimizer do:

* the graph computes in the compute dtype (``param_dtype``): it was captured
  with the floating-point parameters and inputs in that dtype
  (:func:`autopar.capture.joint.capture`), and the runtime hands it
  parameters, frozen weights and inputs cast to it;
* the optimizer steps fp32 *master* weights and keeps fp32 state: each
  rank's shard of a parameter is fp32 and is cast to the compute dtype for each
  step; under ZeRO-1/2 the masters are the rank's flat chunks, and the whole
  local parameter the graph reads is kept in the compute dtype, re-gathered
  from the stepped chunks after each optimizer step, as Megatron-LM's
  distributed optimizer does;
* gradients leave the backward in the compute dtype and are reduced in
  ``reduce_dtype`` (fp32 by default, FSDP2's ``reduce_dtype`` and Megatron-LM's
  ``accumulate_allreduce_grads_in_fp32``), cast up before the reduction
  (:mod:`autopar.codegen.shard`), then summed into the fp32 gradients of the
  masters;
* fp16 adds dynamic loss scaling (:class:`LossScaler`, torch.amp.GradScaler's
  rule), the loss returned is the unscaled fp32 loss.

``"fp32"`` trains in the model's own dtypes, as before mixed precision existed.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.cost_models.memory import Precision, precision_spec

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes one plan trains in (see the module docstring)."""

    name: str
    param_dtype: torch.dtype | None  # the graph's compute dtype; None: the model's own (fp32 training)
    reduce_dtype: torch.dtype | None  # gradients are reduced in it; None: in the dtype they are computed in
    loss_scaling: bool  # fp16: dynamic loss scaling

    @classmethod
    def of(cls, precision: str, reduce_dtype: str | None = None) -> PrecisionPolicy:
        """The policy of a plan's ``precision`` and ``reduce_dtype`` (checked by the cost model's spec)."""
        return cls.from_spec(precision_spec(precision, reduce_dtype))

    @classmethod
    def from_spec(cls, spec: Precision) -> PrecisionPolicy:
        if not spec.master_bytes:
            return cls(spec.name, None, None, False)
        compute = DTYPES[spec.compute_dtype]
        reduce = DTYPES[spec.reduce_dtype]
        return cls(spec.name, compute, None if reduce == compute else reduce, compute == torch.float16)

    @property
    def mixed(self) -> bool:
        return self.param_dtype is not None


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (itself when it already is): what the graph reads of a stored tensor."""
    return t if t.dtype == dtype else t.to(dtype)


class LossScaler:
    """Dynamic loss scaling for fp16, torch.amp.GradScaler's rule, agreed on by every rank.

    The backward is seeded with ``scale`` instead of 1 so that small gradients
    survive fp16.  Before each optimizer step the gradients are divided by the
    scale and checked for inf / NaN; the verdict is all-reduced over ``group``
    (every rank of the job: under ZeRO or tensor parallelism each rank holds
    other gradients), so that all ranks skip an overflowing step together and
    halve the scale.  After ``growth_interval`` steps in a row without overflow
    the scale doubles.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.scale = float(init_scale)
        self.device = device  # where the overflow flag is reduced (the rank's device: NCCL reduces CUDA tensors)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.group = group
        self.good_steps = 0
        self.skipped = 0  # optimizer steps skipped for overflow so far

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; whether any on any rank of the group held inf or NaN.

        torch.amp's fused check-and-unscale, then one all-reduce (a collective when
        distributed) and one read of its result: a single device sync per step.
        """
        found = torch.zeros(1, device=self.device)
        for device, group in _by_device(grads).items():
            flag = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            found += flag.to(found.device)
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return bool(found.item())

    def update(self, overflow: bool) -> None:
        """The scale for the next step: halved after an overflow, doubled after ``growth_interval`` good steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            log.info("fp16 gradients overflowed: step skipped, loss scale now %g", self.scale)
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def scale_steps(optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
    """Make ``optimizer.step()`` a loss-scaled step: unscale, or skip it on every rank when any overflowed.

    As Megatron-LM's mixed-precision optimizer does it, inside ``step`` (the
    training loop stays ``opt.step(); opt.zero_grad()``). The step is replaced
    on the instance by a bound method, as LR schedulers expect to find it.
    """
    inner = optimizer.step

    def step(self: torch.optim.Optimizer, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        overflow = scaler.unscale_and_check(grads)
        result = None if overflow else inner(*args, **kwargs)
        scaler.update(overflow)
        return result

    optimizer.step = types.MethodType(step, optimizer)
