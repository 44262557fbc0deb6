"""Compute cost of a captured ATen graph: FLOPs, bytes moved, and a roofline time.

Why a roofline: a plan is made for devices the user may not have, so op
times are estimated analytically rather than profiled. Each op is bounded
either by the tensor cores (FLOPs / the FLOP/s its kernel reaches) or by HBM
(bytes / HBM bandwidth); its time is the larger of the two, each scaled by a
calibrated efficiency. Matmuls, convolutions and attention land on the
compute side; elementwise ops, norms, softmax, embedding lookups and
reductions land on the memory side, which is why ops without a FLOP formula
count 0 FLOPs.

The FLOP/s a kernel reaches is a measured figure of the device, not its
datasheet peak (:func:`kernel_flops`): a dense matmul reaches the device's
``matmul_fraction`` of peak (the best GEMM shapes, measured), a fused attention
kernel its ``attention_fraction`` (FlashAttention-2's forward + backward,
measured) times the speed of the runtime's own attention kernel relative to
that one (:data:`autopar.cost_models.overlap.RUNTIME`). A causal attention
kernel skips the blocks above the diagonal: it runs half the FLOPs the formula
counts (:func:`autopar.cost_models.attention.attention_work`); MFU still counts them all, as PyTorch's
``FlopCounterMode`` and Megatron-LM's formula do.

FLOPs come from ``torch.utils.flop_counter``'s registry, so autopar counts
what PyTorch's own ``FlopCounterMode`` counts (same conventions: a
multiply-add is 2 FLOPs, bias adds are free, causal masking does not halve
attention FLOPs, and the fused attention backward includes the recomputed
``q @ kᵀ``: 5 matmul-equivalents against 2 for the forward). A few fused
attention ops that appear in graphs traced on this CPU build have no
formula there; they are mapped onto the registered op with the same leading
arguments (see ``ATTENTION_EQUIVALENTS``).

``graph_compute`` reads a graph once and keeps plain numbers
(``ComputeSummary``), so the search can re-cost thousands of configurations
without touching torch.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch.utils import flop_counter

from autopar.cost_models import overlap
from autopar.cost_models.attention import attention_work

logger = logging.getLogger(__name__)

aten = torch.ops.aten

PHASES = ("forward", "backward")


# --------------------------------------------------------------------------- device and efficiency


class DeviceLike(Protocol):
    """What the roofline needs from a device; ``autopar.hardware.cluster.DeviceSpec`` has both.

    A Protocol rather than an import so that this module works with any
    device description (tests use a two-field stand-in).
    """

    peak_flops: Mapping[str, float]  # dtype name ("bf16", "fp16", "fp32", "tf32") -> dense FLOP/s
    hbm_bandwidth: float  # bytes/s


@dataclass(frozen=True)
class ComputeEfficiency:
    """Fraction of the device's peak each bound reaches in practice.

    ``matmul`` divides the peak FLOP/s for compute-bound ops, ``memory``
    divides the HBM bandwidth for memory-bound ones. Frozen (hashable) so it
    can key caches of per-phase times.
    """

    matmul: float
    memory: float

    def __post_init__(self) -> None:
        for name in ("matmul", "memory"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(
                    f"ComputeEfficiency.{name} must be a fraction in (0, 1], got {value!r}; "
                    "1.0 means the device's peak"
                )


# Fitted by benchmarks/calibrate.py (README, Calibration) on a third of the published runs, every third of
# its table, the other two thirds held out: compute-bound kernels at 0.76 of the FLOP/s they reach on their
# best shapes (the devices' measured kernel figures, kernel_flops), memory-bound ops at 0.74 of the HBM
# bandwidth; collectives at comm.LINK_EFFICIENCY of the line rate.
DEFAULT_EFFICIENCY = ComputeEfficiency(matmul=0.76, memory=0.74)

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "tensorfloat32": "tf32",
}


def _peak_flops(device: DeviceLike, dtype_name: str) -> float:
    """The device's peak for a dtype name; a clear error rather than a KeyError deep in the search."""
    key = _DTYPE_ALIASES.get(dtype_name.lower(), dtype_name.lower())
    peaks = device.peak_flops
    if key not in peaks:
        raise ValueError(f"device has no peak FLOP/s for dtype {dtype_name!r}; use one of {', '.join(peaks)}")
    peak = float(peaks[key])
    if not peak > 0:
        raise ValueError(f"device peak FLOP/s for {key!r} must be positive, got {peak!r}")
    return peak


def kernel_flops(device: DeviceLike, dtype_name: str = "bf16", attention: float = 0.0) -> float:
    """FLOP/s the device's kernels reach on their best shapes: a dense matmul's, or (``attention`` > 0) a fused
    attention kernel's, the runtime's own (see the module docstring).

    A device without the measured fractions (a custom or test device) reaches its peak.
    """
    peak = _peak_flops(device, dtype_name)
    matmul = float(getattr(device, "matmul_fraction", 1.0) or 1.0)
    if not attention:
        return peak * matmul
    fraction = getattr(device, "attention_fraction", None)
    # the runtime is read at call time: calibration sets it per published run
    return peak * (matmul if fraction is None else float(fraction)) * overlap.RUNTIME.attention_speedup


def roofline_time(
    flops: float,
    nbytes: float,
    device: DeviceLike,
    dtype_name: str = "bf16",
    efficiency: ComputeEfficiency | None = None,
    bytes_scale: float = 1.0,
    attention: float = 0.0,
) -> float:
    """Seconds for an op doing ``flops`` and moving ``nbytes``: the larger of its compute and memory times.

    ``bytes_scale`` converts bytes counted at the traced dtype to the
    training precision (0.5 for bf16-mixed activations on an fp32 trace).
    ``attention`` > 0 marks a fused attention kernel running that fraction of
    ``flops`` (:func:`autopar.cost_models.attention.attention_work`), at the attention kernel's FLOP/s.
    ``efficiency`` None means the module's ``DEFAULT_EFFICIENCY`` as it is
    at call time, so calibration can replace it after import.
    """
    eff = DEFAULT_EFFICIENCY if efficiency is None else efficiency
    bandwidth = float(device.hbm_bandwidth)
    if not bandwidth > 0:
        raise ValueError(f"device hbm_bandwidth must be positive bytes/s, got {bandwidth!r}")
    if bytes_scale < 0:
        raise ValueError(f"bytes_scale must be >= 0, got {bytes_scale!r}")
    work = flops * attention if attention else flops
    t_compute = work / (kernel_flops(device, dtype_name, attention) * eff.matmul) if flops else 0.0
    t_memory = nbytes * bytes_scale / (bandwidth * eff.memory) if nbytes else 0.0
    return max(t_compute, t_memory)


# --------------------------------------------------------------------------- symbolic shapes


def _hint(x: Any) -> Any:
    """A concrete value for a symbolic one, without adding guards to the capture's shape env.

    Cost estimates only need a representative size; guarding (``int(s)``)
    would specialise the captured graph as a side effect.
    """
    if isinstance(x, torch.SymInt):
        try:
            from torch.fx.experimental.symbolic_shapes import optimization_hint

            return int(optimization_hint(x))
        except Exception:  # unbacked with no fallback, or an older torch
            hint = getattr(x.node, "hint", None)
            if hint is None:
                logger.warning("symbolic size %s has no hint; costing it as 1", x)
                return 1
            return int(hint)
    if isinstance(x, (torch.SymFloat, torch.SymBool)):
        hint = getattr(x.node, "hint", None)
        if hint is None:
            logger.warning("symbolic value %s has no hint; costing it as 0", x)
            return False if isinstance(x, torch.SymBool) else 0.0
        return hint
    return x


# --------------------------------------------------------------------------- FLOPs

# Fused attention ops that this PyTorch's flop_counter has no formula for,
# mapped to a registered op whose formula reads the same leading arguments
# (query, key, value for a forward; grad_out, query, key, value for a
# backward) and ignores the rest. Tracing F.scaled_dot_product_attention on
# CPU or fake-CPU tensors gives the ``_for_cpu`` pair; on the meta device it
# decomposes to the math path (bmm + _safe_softmax), which bmm's formula
# already covers. An entry is used only while flop_counter lacks the op, so
# a later PyTorch's own formula wins.
ATTENTION_EQUIVALENTS: dict[str, str] = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_fused_attention_overrideable_backward": "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_attention_math_for_mps": "_scaled_dot_product_flash_attention",
}


def _flop_formula(target: Any) -> Callable[..., Any] | None:
    """The registered formula for a node target: by overload, then overload packet, then equivalence."""
    registry = flop_counter.flop_registry  # read at call time: register_flop_formula adds to it
    packet = getattr(target, "overloadpacket", None)
    for key in (target, packet):
        if key is not None:
            try:
                formula = registry.get(key)
            except TypeError:  # unhashable target
                return None
            if formula is not None:
                return formula
    qualified = getattr(packet, "_qualified_op_name", "")
    name = qualified[len("aten::") :] if qualified.startswith("aten::") else None
    if name in ATTENTION_EQUIVALENTS:
        return registry.get(getattr(aten, ATTENTION_EQUIVALENTS[name]))
    return None


def _concrete(x: Any) -> Any:
    """Tensors become meta tensors of hinted, concrete shape; symbolic scalars become their hints.

    The formulas read only shapes; concrete ints keep them from building
    (and guarding on) symbolic expressions.
    """
    if isinstance(x, torch.Tensor):
        return torch.empty([_hint(d) for d in x.shape], dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_concrete(v) for v in x) if type(x) in (list, tuple) else [_concrete(v) for v in x]
    if isinstance(x, dict):
        return {k: _concrete(v) for k, v in x.items()}
    return _hint(x)


def _arg_val(n: fx.Node) -> Any:
    return n.meta.get("val")


def node_flops(node: fx.Node) -> int:
    """FLOPs of one ATen node by ``torch.utils.flop_counter``'s formulas; 0 for ops without one.

    The formula is called as FlopCounterMode calls it: the node's
    arguments with fx Nodes replaced by their ``meta["val"]``, plus
    ``out_val``. A formula that fails on odd arguments costs the node 0
    FLOPs with a warning, never an exception: an uncosted op must not stop
    a plan.
    """
    if node.op != "call_function":
        return 0
    formula = _flop_formula(node.target)
    if formula is None:
        return 0
    try:
        args = _concrete(fx.node.map_arg(node.args, _arg_val))
        kwargs = _concrete(fx.node.map_arg(node.kwargs, _arg_val))
        flops = formula(*args, **kwargs, out_val=_concrete(node.meta.get("val")))
    except Exception as e:  # any failure (odd layouts, missing meta) degrades to "no FLOPs"
        logger.warning(
            "FLOP formula for %s failed on node %s (%s); counting 0 FLOPs", node.target, node.name, e
        )
        return 0
    return int(_hint(flops))


# --------------------------------------------------------------------------- bytes

# Ops whose output is a view (or an alias) of an input, or a value picked out
# of a tuple: they change metadata only, so they move no bytes. reshape can
# copy in eager mode, but traced graphs decompose it into view / clone, and
# the clone is what gets counted.
VIEW_OPS: frozenset[str] = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "view_as",
        "permute",
        "expand",
        "expand_as",
        "alias",
        "t",
        "transpose",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "detach",
        "as_strided",
        "narrow",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "diagonal",
        "movedim",
        "unflatten",
        "unfold",
        "lift_fresh",
        "view_as_real",
        "view_as_complex",
        "_conj",
        "_neg_view",
    }
)
"""Overload-packet names of the metadata-only ATen ops (plus ``operator.getitem``): 0 bytes."""


def is_view(node: fx.Node) -> bool:
    """True for nodes that only change metadata: views, aliases, detach and ``getitem``.

    Shared with the memory model, which follows view chains back to the
    tensor that owns the storage.
    """
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    packet = getattr(node.target, "overloadpacket", None)
    qualified = getattr(packet, "_qualified_op_name", "")
    return qualified.startswith("aten::") and qualified[len("aten::") :] in VIEW_OPS


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses.

    Dimensions with stride 0 (an ``expand``-ed bias, a broadcast scalar)
    are read once, not once per broadcast copy, so they do not multiply
    the count.
    """
    sizes = [_hint(s) for s in t.shape]
    if any(s == 0 for s in sizes):
        return 0
    try:
        strides = [_hint(s) for s in t.stride()]
    except Exception:  # sparse / nested layouts have no strides: count every element
        strides = [1] * len(sizes)
    distinct = math.prod(s for s, st in zip(sizes, strides, strict=False) if st != 0)
    return int(distinct) * t.dtype.itemsize


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def node_bytes(node: fx.Node) -> int:
    """Bytes an op reads and writes: its tensor inputs plus its tensor outputs, each counted once.

    Metadata-only ops (``is_view``) and ops with no tensor output (size
    queries, symbolic arithmetic, asserts) move 0 bytes. The count is at the
    dtype the graph was traced in; ``roofline_time``'s ``bytes_scale``
    converts it to the training precision.
    """
    if node.op != "call_function" or is_view(node):
        return 0
    outputs = _tensors(node.meta.get("val"))
    if not outputs:
        return 0
    inputs: dict[fx.Node, None] = {}  # ordered set: a tensor used twice is read once
    fx.node.map_arg((node.args, node.kwargs), lambda n: inputs.setdefault(n))
    total = sum(_tensor_bytes(t) for n in inputs for t in _tensors(n.meta.get("val")))
    return total + sum(_tensor_bytes(t) for t in outputs)


def _fixed_bytes(node: fx.Node, batch_free: set[str]) -> int:
    """The bytes of ``node_bytes(node)`` that belong to values named in ``batch_free``."""
    inputs: dict[fx.Node, None] = {}
    fx.node.map_arg((node.args, node.kwargs), lambda n: inputs.setdefault(n))
    total = sum(_tensor_bytes(t) for n in inputs if n.name in batch_free for t in _tensors(n.meta.get("val")))
    if node.name in batch_free:
        total += sum(_tensor_bytes(t) for t in _tensors(node.meta.get("val")))
    return total


def node_time(
    node: fx.Node,
    device: DeviceLike,
    dtype_name: str = "bf16",
    efficiency: ComputeEfficiency | None = None,
    bytes_scale: float = 1.0,
) -> float:
    """Roofline seconds of one node: max(FLOPs / its kernel's FLOP/s, bytes / HBM bandwidth), nothing else."""
    return roofline_time(
        node_flops(node), node_bytes(node), device, dtype_name, efficiency, bytes_scale, attention_work(node)
    )


# --------------------------------------------------------------------------- whole graph


@dataclass
class ComputeSummary:
    """FLOPs and bytes of every op of a graph, as plain numbers (no torch objects).

    ``per_node`` maps a node name to (flops, bytes); ``phase`` maps it to
    the phase it runs in ("forward" / "backward", or whatever the capture's
    ``phase_of`` says). Times are derived on demand because they depend on
    the device, dtype and efficiency the search is trying.
    """

    per_node: dict[str, tuple[int, int]] = field(default_factory=dict)
    phase: dict[str, str] = field(default_factory=dict)
    # fused attention kernels: the fraction of their FLOPs they run (attention_work)
    attention: dict[str, float] = field(default_factory=dict)
    # per node, the part of its bytes that does not grow with the batch: parameters, their gradients
    fixed_bytes: dict[str, int] = field(default_factory=dict)
    total_flops: int = 0
    forward_flops: int = 0
    backward_flops: int = 0
    total_bytes: int = 0

    def flops_by_phase(self) -> dict[str, int]:
        """FLOPs summed per phase; "forward" and "backward" are always present."""
        out = dict.fromkeys(PHASES, 0)
        for name, (flops, _) in self.per_node.items():
            p = self.phase.get(name, "forward")
            out[p] = out.get(p, 0) + flops
        return out

    def time_by_phase(
        self,
        device: DeviceLike,
        dtype_name: str = "bf16",
        efficiency: ComputeEfficiency | None = None,
        bytes_scale: float = 1.0,
        batch_scale: float = 1.0,
    ) -> dict[str, float]:
        """Sum of per-node roofline times per phase; "forward" and "backward" are always present.

        Summed per node, not from the totals: a graph's compute-bound and
        memory-bound ops do not overlap, so max(ΣF/peak, ΣB/bw) would
        underestimate. ``batch_scale`` costs the graph at that multiple of the
        batch it was captured at: FLOPs and activation bytes grow with it, a
        node's ``fixed_bytes`` (a parameter read, a gradient written) do not:

            t_v = roofline(k·F_v, k·(B_v − P_v) + P_v)      k = batch_scale, P_v = fixed bytes
        """
        out = dict.fromkeys(PHASES, 0.0)
        for name, (flops, nbytes) in self.per_node.items():
            p = self.phase.get(name, "forward")
            fixed = self.fixed_bytes.get(name, 0)
            out[p] = out.get(p, 0.0) + roofline_time(
                flops * batch_scale,
                (nbytes - fixed) * batch_scale + fixed,
                device,
                dtype_name,
                efficiency,
                bytes_scale,
                self.attention.get(name, 0.0),
            )
        return out

    def time(
        self,
        device: DeviceLike,
        dtype_name: str = "bf16",
        efficiency: ComputeEfficiency | None = None,
        bytes_scale: float = 1.0,
    ) -> float:
        """Roofline seconds of the whole graph (all phases) on one device."""
        return sum(self.time_by_phase(device, dtype_name, efficiency, bytes_scale).values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, so a capture's costs can be cached next to a plan."""
        return {
            "per_node": {k: [f, b] for k, (f, b) in self.per_node.items()},
            "phase": dict(self.phase),
            "attention": dict(self.attention),
            "fixed_bytes": dict(self.fixed_bytes),
            "total_flops": self.total_flops,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "total_bytes": self.total_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ComputeSummary:
        """Inverse of ``to_dict``."""
        return cls(
            per_node={k: (int(v[0]), int(v[1])) for k, v in d["per_node"].items()},
            phase=dict(d.get("phase", {})),
            attention={k: float(v) for k, v in d.get("attention", {}).items()},
            fixed_bytes={k: int(v) for k, v in d.get("fixed_bytes", {}).items()},
            total_flops=int(d["total_flops"]),
            forward_flops=int(d["forward_flops"]),
            backward_flops=int(d["backward_flops"]),
            total_bytes=int(d["total_bytes"]),
        )


def graph_compute(
    gm: fx.GraphModule,
    phase_of: Callable[[fx.Node], str] | None = None,
    batch_free: set[str] | None = None,
) -> ComputeSummary:
    """FLOPs and bytes of every call_function node of a graph, split by phase.

    ``phase_of`` labels each node "forward" or "backward" (the capture knows
    which is which); None counts everything as forward, for forward-only
    graphs. ``batch_free`` names the nodes whose values do not grow with the
    batch (parameters, their views and gradients): the bytes a node reads or
    writes of them are its ``fixed_bytes``.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    summary = ComputeSummary()
    unknown: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        flops, nbytes = node_flops(node), node_bytes(node)
        phase = "forward" if phase_of is None else phase_of(node)
        summary.per_node[node.name] = (flops, nbytes)
        if attention_work(node):
            summary.attention[node.name] = attention_work(node)
        if batch_free and nbytes:
            fixed = _fixed_bytes(node, batch_free)
            if fixed:
                summary.fixed_bytes[node.name] = fixed
        summary.phase[node.name] = phase
        summary.total_flops += flops
        summary.total_bytes += nbytes
        if phase == "forward":
            summary.forward_flops += flops
        elif phase == "backward":
            summary.backward_flops += flops
        else:
            unknown.add(phase)
    if unknown:
        logger.debug("graph_compute: phases other than forward/backward: %s", sorted(unknown))
    logger.debug(
        "graph_compute: %d ops, %.3g FLOPs (%.3g forward, %.3g backward), %.3g bytes",
        len(summary.per_node),
        summary.total_flops,
        summary.forward_flops,
        summary.backward_flops,
        summary.total_bytes,
    )
    return summary
