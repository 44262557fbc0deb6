"""Which placements still divide when the batch is cut into micro-batches.

A problem is built on the graph at the whole batch; the runtime runs it at ``1/m`` of
the batch, where a sharded dim that scales with the batch must still split evenly.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.capture.joint import CapturedGraph
from autopar.search.sharding.instance import ShardingProblem


def microbatch_divides(
    captured: CapturedGraph,
    sp: ShardingProblem,
    choice: list[int],
    mesh_shape: tuple[int, ...],
    microbatches: int,
) -> bool:
    """Whether every sharded dim of the chosen placements still divides at ``microbatches`` micro-batches.

    The problem is built on the graph at the whole batch; the runtime runs the graph
    at ``1/m`` of it, where a dim that scales with the batch (the batch dim, or batch
    and sequence flattened) is ``m`` times smaller.  Which dims scale is not recorded,
    so every dim whose size is a multiple of the batch is taken to: at worst a
    micro-batch count that would have worked is refused.
    """
    if microbatches == 1:
        return True
    allowed = microbatch_filter(captured, mesh_shape, microbatches)
    return all(allowed(name, sp.strategies[i][choice[i]]) for i, name in enumerate(sp.nodes))


def microbatch_filter(captured: CapturedGraph, mesh_shape: tuple[int, ...], microbatches: int):
    """``allowed(node name, strategy)``: whether the strategy's placements divide at ``microbatches``.

    A strategy allowed at ``m`` micro-batches is allowed at every count that divides
    ``m`` (each batch-scaled dim is then a multiple of its size at ``m``), so one
    filter at the most micro-batches serves every count the search costs.
    """
    batch = captured.batch_size
    by_name = {n.name: n for n in captured.gm.graph.nodes}

    def fits(val, placement) -> bool:
        if placement is None or not hasattr(val, "shape"):
            return True
        pieces: dict[int, int] = {}
        for d, p in enumerate(placement):
            if p.is_shard():
                pieces[p.dim] = pieces.get(p.dim, 1) * mesh_shape[d]
        for dim, k in pieces.items():
            size = int(val.shape[dim]) if dim < len(val.shape) else 0
            if size and size % batch == 0 and (size % microbatches or (size // microbatches) % k):
                return False
        return True

    def allowed(name: str, s) -> bool:
        node = by_name.get(name)
        if node is None or microbatches == 1:
            return True
        vals = node.meta.get("val")
        outs = vals if isinstance(vals, (list, tuple)) else [vals]
        if not all(fits(v, p) for v, p in zip(outs, s.outputs, strict=False)):
            return False
        leaves = pytree.tree_leaves((node.args, dict(node.kwargs)), is_leaf=lambda x: isinstance(x, fx.Node))
        args = [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        return all(fits(a.meta["val"], p) for a, p in zip(args, s.inputs, strict=False))

    return allowed
