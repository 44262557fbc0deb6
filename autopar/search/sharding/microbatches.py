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
from autopar.search.sharding.batch_dims import guessed, scaled_dims
from autopar.search.sharding.filters import keyed
from autopar.search.sharding.instance import ShardingProblem
from autopar.search.sharding.placement_sets import split_ways

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
    and sequence flattened) is ``m`` times smaller (which dims scale:
    :mod:`autopar.search.sharding.batch_dims`). A strategy that holds at some
    counts alone (``Strategy.only_at``) divides at those only.
    """
    if microbatches == 1:
        return not any(sp.strategies[i][j].only_at for i, j in enumerate(choice))
    allowed = microbatch_filter(captured, mesh_shape, microbatches)
    return all(allowed(name, sp.strategies[i][choice[i]]) for i, name in enumerate(sp.nodes))


def microbatch_filter(captured: CapturedGraph, mesh_shape: tuple[int, ...], microbatches: int):
    """``allowed(node name, strategy)``: whether the strategy's placements divide at ``microbatches``.

    A strategy allowed at ``m`` micro-batches is allowed at every count that divides
    ``m`` (each batch-scaled dim is then a multiple of its size at ``m``), so one
    filter at the most micro-batches serves every count the search costs; save one
    that holds at some counts alone (``Strategy.only_at``), allowed at those only. A node's
    shapes are read once and each (shape, placement) pair is tested once: the filter
    is asked about every strategy of every node.
    """
    batch = captured.batch_size
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    shapes = _SHAPES.setdefault(captured.gm, {})
    scaled = scaled_dims(captured)
    tested: dict[tuple, bool] = {}

    def fits(value, placement) -> bool:
        if placement is None or value is None:
            return True
        key = (value, placement)
        if key not in tested:
            shape, scales = value
            ok = True
            for dim, k in split_ways(placement, mesh_shape).items():
                size = int(shape[dim]) if dim < len(shape) else 0
                if size and scales[dim] and (size % microbatches or (size // microbatches) % k):
                    ok = False
            tested[key] = ok
        return tested[key]

    def value_of(name: str, k: int, val) -> tuple | None:
        """(shape, which dims scale with the batch) of output ``k`` of node ``name``, valued ``val``."""
        if not hasattr(val, "shape"):
            return None
        shape = tuple(val.shape)
        known = scaled.get(name) if scaled is not None else None
        scales = known[k] if known is not None and k < len(known) and known[k] is not None else None
        return shape, scales if scales is not None and len(scales) == len(shape) else guessed(shape, batch)

    def node_shapes(node: fx.Node) -> tuple[tuple, tuple]:
        """The (shape, scaled dims) of ``node``'s outputs (None: not a tensor) and of its tensor arguments."""
        if node.name not in shapes:
            vals = node.meta.get("val")
            outs = vals if isinstance(vals, (list, tuple)) else [vals]
            out_shapes = tuple(value_of(node.name, k, v) for k, v in enumerate(outs))
            leaves = pytree.tree_leaves((node.args, dict(node.kwargs)), is_leaf=lambda x: isinstance(x, fx.Node))
            args = [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            shapes[node.name] = (out_shapes, tuple(value_of(a.name, 0, a.meta["val"]) for a in args))
        return shapes[node.name]

    # (node shapes, strategy) -> verdict: the copies of a repeated layer ask the same questions; the
    # strategy is kept beside its verdict so that its id cannot be reused while the filter lives
    verdicts: dict[tuple, tuple[bool, object]] = {}

    def allowed(name: str, s) -> bool:
        if s.only_at and microbatches not in s.only_at:
            return False
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
