"""Head-tail shards of the sequence: context parallelism with causal attention's work balanced.

A causal kernel whose queries are cut in ``n`` contiguous shards leaves the last
rank ``(2n-1)/n`` of the mean work (:func:`autopar.cost_models.attention.causal_imbalance`).
Megatron-LM and torch's ``context_parallel`` (``_HeadTailLoadBalancer``) cut the
sequence in ``2n`` chunks and give rank ``r`` chunks ``r`` and ``2n-1-r``: every
rank then does the same work.  They do it by permuting the inputs once (tokens,
labels, positions) before the model runs.  autopar cannot: a graph that builds its
positions, rotary tables or causal mask from ``arange`` would see them in natural
order.  So the order is a placement instead, ``B(d)``
(:func:`autopar.core.placements.balanced`): a shard that holds those two chunks.

Every strategy that splits, over one mesh dim, only tensor dims of one sequence's
length (those of the attention kernels' queries), from at least one input, gets a twin
with those shards in head-tail order (:func:`balanced_variants`).  The twin is exact
wherever the op treats the positions of those dims alike, which is what a shard row
says of an op once every split dim is the whole sequence: element-wise ops,
matmuls and norms over other dims, reductions and contractions over it (a sum does
not care for order), attention's queries (the kernel runs once per chunk:
:mod:`autopar.codegen.sequence_attention`), an embedding of positions.  A value whose
order matters (a mask or rotary table built from ``arange``, the keys gathered for
attention) meets it at a change of placement, where the runtime reorders it
(:func:`autopar.core.placements.balanced_route`): so nothing needs the graph's
positions permuted, and a model builds them however it likes.  A split that a row
makes from whole inputs (the rows of a vocabulary-parallel table, which take their
position from the rank) is not reordered, nor is a parameter, nor a value the graph
returns (gradients, the loss): those keep the order the runtime and checkpoints know.

Only graphs with a causal kernel (the flag) get the twins, where they can save time;
``masks`` adds those of kernels given a mask tensor with the queries' rows (HuggingFace's
causal mask), which the cost model cannot tell from any other mask, for layouts that ask
for the balanced split (:mod:`autopar.search.sharding.seeds`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar.core.placements import Placement, Placements, balanced
from autopar.cost_models.attention import CAUSAL_WORK, attention_work, is_attention_kernel
from autopar.search.sharding.node_strategies import Strategy

SEQ_DIM = 2  # of the kernels' (batch, heads, seq, head_dim) queries


@dataclasses.dataclass(frozen=True)
class Balance:
    """What the twins of a graph need: the sequence lengths to reorder, and the nodes that keep their order."""

    lengths: frozenset[int] = frozenset()
    fixed: frozenset[str] = frozenset()


def balance_of(gm: fx.GraphModule, masks: bool = False) -> Balance:
    """The query lengths of ``gm``'s causal attention kernels (and, with ``masks``, of those given a mask
    with the queries' rows), and the nodes whose values leave the graph."""
    lengths = set()
    for node in gm.graph.nodes:
        if not is_attention_kernel(node):
            continue
        backward = node.target._schema.name.endswith("_backward")
        q = node.args[1 if backward else 0].meta["val"]
        seq = int(q.shape[SEQ_DIM])
        if attention_work(node) == CAUSAL_WORK or (masks and _per_query_mask(node, seq)):
            lengths.add(seq)
    fixed = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            for a in node.all_input_nodes:
                fixed.add(a.name)
                if a.target is operator.getitem and isinstance(a.args[0], fx.Node):
                    fixed.add(a.args[0].name)
    return Balance(frozenset(lengths), frozenset(fixed))


def _per_query_mask(node: fx.Node, seq: int) -> bool:
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == 4 and int(v.shape[SEQ_DIM]) == seq and int(v.shape[-1]) == seq:
            return True
    return False


def balanced_variants(
    strategies: Sequence[Strategy],
    inputs: Sequence[fx.Node],
    outs: Sequence[object],
    placeholders: Sequence[bool],
    lengths: frozenset[int],
    mesh_shape: Sequence[int],
) -> list[Strategy]:
    """The head-tail twins of the strategies of a node reading ``inputs`` and returning ``outs`` (values), one
    per strategy and mesh dim where it has one.

    ``placeholders`` says which inputs are the graph's own (parameters, inputs): they are
    never held in head-tail order, and a row that splits one is not twinned.
    """
    in_shapes = [tuple(a.meta["val"].shape) for a in inputs]
    out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in outs]
    out = []
    for s in strategies:
        for axis, n in enumerate(mesh_shape):
            if n > 1:
                twin = _twin(s, axis, n, in_shapes, out_shapes, placeholders, lengths, mesh_shape)
                if twin is not None:
                    out.append(twin)
    return out


def _twin(
    s: Strategy,
    axis: int,
    n: int,
    in_shapes: list[tuple[int, ...]],
    out_shapes: list[tuple[int, ...] | None],
    placeholders: Sequence[bool],
    lengths: frozenset[int],
    mesh_shape: Sequence[int],
) -> Strategy | None:
    """``s`` with its shards on mesh dim ``axis`` in head-tail order; None where that would not be exact."""
    if any(p is not None and not p[axis].is_shard() and not p[axis].is_partial() for p in s.outputs):
        return None  # a whole output of a split input: it does not follow the inputs' positions
    ins = []
    split_input = False
    for p, shape, own in zip(s.inputs, in_shapes, placeholders, strict=True):
        q = _reordered(p, shape, axis, n, lengths, mesh_shape)
        if q is False or (own and p is not None and p[axis].is_shard()):
            return None
        split_input = split_input or (p is not None and p[axis].is_shard())
        ins.append(q)
    if not split_input:
        return None
    outs = []
    for p, shape in zip(s.outputs, out_shapes, strict=False):
        q = _reordered(p, shape, axis, n, lengths, mesh_shape)
        if q is False:
            return None
        outs.append(q)
    return dataclasses.replace(s, outputs=tuple(outs), inputs=tuple(ins))


def _reordered(
    p: Placements | None,
    shape: tuple[int, ...] | None,
    axis: int,
    n: int,
    lengths: frozenset[int],
    mesh_shape: Sequence[int],
) -> Placements | None | bool:
    """``p`` with its shard on mesh dim ``axis`` in head-tail order (unchanged when it has none there); False
    where the split dim is not a whole sequence of ``lengths`` on that mesh dim, or a later mesh dim splits it."""
    if p is None or not p[axis].is_shard():
        return p
    if shape is None or any(q.is_balanced() for q in p):
        return False
    d = p[axis].dim
    if any(p[i].is_shard(d) for i in range(axis + 1, len(p))):
        return False
    size = int(shape[d]) // math.prod(mesh_shape[i] for i in range(axis) if p[i].is_shard(d))
    if size not in lengths or size % (2 * n):
        return False
    new: list[Placement] = list(p)
    new[axis] = balanced(d)
    return tuple(new)



def holds_balanced(placements: dict[str, dict]) -> bool:
    """Whether a plan's placements hold anything in head-tail order: its strategies are then enumerated with
    every twin (``balance_masks``), so that whatever layout made it is among them."""
    return any(
        q.is_balanced()
        for entry in placements.values()
        for p in (*(entry.get("inputs") or ()), *(entry.get("outputs") or ()))
        if p
        for q in p
    )
