"""Which placements still divide when the batch is cut into micro-batches.

A problem is built on the graph at the whole batch; the runtime runs it at ``1/m`` of
the batch, where a sharded dim that scales with the batch must still split evenly.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.capture.joint import CapturedGraph
from autopar.search.sharding.filters import keyed
from autopar.search.sharding.instance import ShardingProblem

_SHAPES: weakref.WeakKeyDictionary[fx.GraphModule, dict[str, tuple[list, list]]] = weakref.WeakKeyDictionary()
"""Per graph, each node's output and tensor-argument shapes, read once for every filter made on it."""


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
    filter at the most micro-batches serves every count the search costs. A node's
    shapes are read once and each (shape, placement) pair is tested once: the filter
    is asked about every strategy of every node.
    """
    batch = captured.batch_size
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    shapes = _SHAPES.setdefault(captured.gm, {})
    tested: dict[tuple, bool] = {}

    def fits(shape, placement) -> bool:
        if placement is None or shape is None:
            return True
        key = (shape, placement)
        if key not in tested:
            pieces: dict[int, int] = {}
            for d, p in enumerate(placement):
                if p.is_shard():
                    pieces[p.dim] = pieces.get(p.dim, 1) * mesh_shape[d]
            ok = True
            for dim, k in pieces.items():
                size = int(shape[dim]) if dim < len(shape) else 0
                if size and size % batch == 0 and (size % microbatches or (size // microbatches) % k):
                    ok = False
            tested[key] = ok
        return tested[key]

    def node_shapes(node: fx.Node) -> tuple[tuple, tuple]:
        """The shapes of ``node``'s outputs (None: not a tensor) and of its tensor arguments, in order."""
        if node.name not in shapes:
            vals = node.meta.get("val")
            outs = vals if isinstance(vals, (list, tuple)) else [vals]
            out_shapes = tuple(tuple(v.shape) if hasattr(v, "shape") else None for v in outs)
            leaves = pytree.tree_leaves((node.args, dict(node.kwargs)), is_leaf=lambda x: isinstance(x, fx.Node))
            args = [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            shapes[node.name] = (out_shapes, tuple(tuple(a.meta["val"].shape) for a in args))
        return shapes[node.name]

    # (node shapes, strategy) -> verdict: the copies of a repeated layer ask the same questions; the
    # strategy is kept beside its verdict so that its id cannot be reused while the filter lives
    verdicts: dict[tuple, tuple[bool, object]] = {}

    def allowed(name: str, s) -> bool:
        node = by_name.get(name)
        if node is None or microbatches == 1:
            return True
        sig = node_shapes(node)
        key = (sig, id(s))
        hit = verdicts.get(key)
        if hit is None:
            outs, args = sig
            ok = all(fits(v, p) for v, p in zip(outs, s.outputs, strict=False)) and all(
                fits(a, p) for a, p in zip(args, s.inputs, strict=False)
            )
            hit = verdicts[key] = (ok, s)
        return hit[0]

    def shapes_of(name: str):
        node = by_name.get(name)
        return None if node is None or microbatches == 1 else node_shapes(node)

    return keyed(allowed, shapes_of)  # a node by its shapes
