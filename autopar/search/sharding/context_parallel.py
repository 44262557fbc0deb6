"""Context parallelism as a restriction of the sharding problem: attention's queries split on the sequence.

A plan is context parallel over a mesh axis when its attention kernels read
their queries split on the sequence (dim 2) over that axis, the keys and values
gathered whole (:func:`autopar.search.sharding.strategy_rules.sequence_rows`).
The axis is the dp axis or the second one, as for expert parallelism: ``cp``
names a split over the ranks of an axis, not an axis of its own
(:data:`autopar.core.mesh.SHARED_AXES`).  Everything else about the layer (the
sequence split of its other activations, the weights replicated over the axis
and their gradients reduced over it, ZeRO over it) is the solver's or a seed's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from autopar.capture.joint import CapturedGraph
from autopar.core.errors import PlanError
from autopar.ops import dropout_attention  # noqa: F401  (registers torch.ops.autopar.dropout_attention*)
from autopar.plans.records import Fixed
from autopar.search.sharding.filters import keyed
from autopar.search.sharding.node_strategies import Strategy

aten = torch.ops.aten

# attention kernels (by the name plans record) -> where the query is among their tensor inputs
QUERY_AT: dict[str, int] = {
    str(aten._scaled_dot_product_flash_attention_for_cpu.default): 0,
    str(aten._scaled_dot_product_flash_attention_for_cpu_backward.default): 1,
    str(torch.ops.autopar.dropout_attention.default): 0,
    str(torch.ops.autopar.dropout_attention_backward.default): 1,
}
SEQ_DIM = 2  # of the kernels' (batch, heads, seq, head_dim) queries


def attention_kernels(gm: fx.GraphModule) -> dict[str, int]:
    """The graph's attention kernels, by node name, with where each reads its query."""
    return {n.name: QUERY_AT[str(n.target)] for n in gm.graph.nodes if str(n.target) in QUERY_AT}


def query_axes(inputs: Any, q_at: int) -> list[int]:
    """The mesh axes over which a kernel's query (input ``q_at`` of ``inputs``) is split on the sequence."""
    q = inputs[q_at] or ()
    return [a for a, p in enumerate(q) if p.is_shard(SEQ_DIM)]


def cp_filter(
    captured: CapturedGraph, mesh_shape: tuple[int, ...], cp: int, axis: int | None = None, order: str | None = None
) -> Callable[[str, Strategy], bool]:
    """``fixed={"cp": cp}``: every attention kernel splits its queries' sequence over one mesh axis of size
    ``cp`` (1: over none), mesh axis ``axis`` where given, in ``order`` where given: "balanced" (head-tail,
    :mod:`autopar.search.sharding.balanced_shards`) or "contiguous"; other nodes are free."""
    kernels = attention_kernels(captured.gm)

    def allowed(node: str, strategy: Strategy) -> bool:
        if node not in kernels:
            return True
        axes = query_axes(strategy.inputs, kernels[node])
        if axis is not None and cp > 1 and axes != [axis]:
            return False
        if order is not None and cp > 1:
            q = strategy.inputs[kernels[node]]
            if any(q[a].is_balanced() != (order == "balanced") for a in axes):
                return False
        return [mesh_shape[a] for a in axes] == ([cp] if cp > 1 else [])

    return keyed(allowed, kernels.get)  # the attention kernels alike, by where their query is; others free


def _contiguous(node: str, strategy: Strategy) -> bool:
    return not any(p is not None and any(q.is_balanced() for q in p) for p in (*strategy.outputs, *strategy.inputs))


contiguous_only = keyed(_contiguous, lambda node: None)
"""The strategies that hold nothing in head-tail order (:mod:`autopar.search.sharding.balanced_shards`): the
search's solves that do not split the sequence for attention on purpose keep to them
(:func:`autopar.search.sharding.mesh._best_on_mesh`), a problem the size it is without the twins."""


def cp_axis_sizes(cp: int, dp: int, tp: int, axis: int | None = None) -> bool:
    """Whether a dp x tp mesh has an axis of ``cp`` ranks to split the sequence over (mesh axis ``axis``
    where given)."""
    return cp == 1 or (cp in (dp, tp) if axis is None else (dp, tp)[axis] == cp)


def cp_axis_of(fixed: Fixed, world: int) -> int | None:
    """The mesh axis a fixed cp splits the sequence over: with a tensor-parallel size fixed too, the dp
    axis's ranks (Megatron-LM's ``--context-parallel-size`` beside ``--tensor-model-parallel-size``: the
    second axis keeps the tensor split); with dp fixed and tp not, the second axis (dp x cp, torchtitan's
    FSDP beside context parallelism) where dp leaves one; otherwise either axis, as the search finds cheaper."""
    if (fixed.tp or 1) > 1:
        return 0
    return 1 if fixed.dp is not None and fixed.tp is None and world > fixed.dp else None


def context_parallel_mesh(placements: dict[str, Any], dp: int, tp: int) -> dict[str, int]:
    """``{"cp": n}`` when the plan's attention kernels split their queries' sequence ``n`` ways, else {}."""
    sizes, n = (dp, tp), 1
    for entry in placements.values():
        q_at = QUERY_AT.get(entry.get("op", ""))
        if q_at is not None and entry["inputs"][q_at]:
            n = max(n, math.prod(sizes[a] for a in query_axes(entry["inputs"], q_at)))
    return {"cp": n} if n > 1 else {}


def check_cp(cp: int, captured: CapturedGraph, world: int) -> None:
    """Refuse, in one line naming the fix, a ``fixed`` cp that does not divide the sequence or the cluster,
    or a model with no attention kernel to split."""
    if cp == 1:
        return
    if world % cp:
        raise PlanError(f"fixed cp={cp} does not divide the cluster's {world} devices; choose a divisor of {world}")
    kernels = attention_kernels(captured.gm)
    if not kernels:
        raise PlanError(f"fixed cp={cp}: {captured.model_name} has no attention kernel to split; leave cp out")
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    name, q_at = next(iter(kernels.items()))
    q = by_name[name].args[q_at]
    seq = int(q.meta["val"].shape[SEQ_DIM])
    if seq % cp:
        raise PlanError(f"fixed cp={cp} does not divide the sequence of {seq} tokens; choose a divisor of {seq}")
