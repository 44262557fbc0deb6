"""The sharding problem of L repeated layers, written on the four layers traced (a fold).

A transformer's problem is its layers' problem repeated: the mesh search ties every
layer's strategies together (:func:`autopar.search.sharding.problem.repeated_layer_groups`),
so the answer is one layer's choice copied L times, and the problem of the whole graph
is the problem of the four-layer template (:class:`autopar.capture.graph.Fold`) with its
first middle layer counted L - 3 times. Building and solving that is a few
times cheaper at LLaMA-7B's 32 layers and some thirty times at LLaMA-3-405B's 126.

The folded problem
------------------
Let the template's layers be T0, T1, T2, T3 (first, two middle ones, last), and
``w = L - 3``. The full graph's layer 0 stands on T0, layers 1 .. L-3 on T1, layer L-2
on T2 and layer L-1 on T3. With every layer choosing alike (one strategy per position
of a layer, the same in all of them):

    node cost       c'_v = w · c_v  for v in T1, else c_v (FLOPs, a parameter's optimizer
                    step and its ZeRO gather alike)
    edge cost       E'_uv = w · E_uv  for v in T1, else E_uv
                    An edge into T1 stands for its L - 3 copies: from a node outside the stack
                    or of T1 itself, each copy reads its own; from the neighbouring layer (T0 in
                    the forward, T2 in the backward), layer 1 reads layer 0 (and layer L-3 reads
                    L-2), and each of the L - 4 other copies reads another middle layer, whose
                    choice is the neighbour's: the same matrix at the same strategies.
    parameter memory  m'_p = w · m_p for p in T1 (live throughout the step; a buffer's or frozen parameter's alike)

The other memory of T1 belongs to layer L-3 (T1 sits just before T2 in the template's
order), and the L - 4 layers before it, 1 .. L-4, add their items as phantoms: each item
of T1 live over [s, e) adds ``(L - 4) · m`` over [s', e'), with

    s' = s            if s < F1 (before T1's forward: a parameter's state)
         F1           if F1 <= s < B2   (made in its own or the next layer's forward)
         B1           if B2 <= s < B1   (made in the next layer's backward or its own)
    e' = F1           if e <= F2'   (freed within its own or the next layer's forward)
         B1           if F2' < e <= B1   (kept for the backward: freed in the next's or its own)
         B1           if B1 < e < E   (read by the backward of the layer before: T1's input gradient,
                        whose copies in layers 2 .. L-3 are freed within T1's backward)
         e            if e = E      (a gradient: kept to the end of the step, E)

where F1 is where T1's forward starts, F2' where T2's forward ends, B2 where T2's backward
starts and B1 where T1's backward ends (a phantom layer's forward runs at F1, its
backward at B1); the phantom is left out when s' >= e'. The buffers the step's memory adds
beside the items (a value redistributed for a T1 op, :mod:`autopar.search.sharding.step_memory`)
get their phantoms the same way (:class:`~autopar.search.sharding.instance.PhantomLayers`). So the activations every phantom
layer keeps for its backward are live from T1's forward to T1's backward's end (the
forward and backward of layers L-3 .. L-1 and the loss between), and their gradients
from there to the end of the step.

This is exact where the peak can be: through the forward, the live bytes grow with
each layer, so the peak is in the last layers (T1 - T3, with every phantom's activations
held); through the backward of layer k they are the activations of layers 0 .. k-1 and
the gradients of k+1 .. L-1, linear in k, so the largest is at k = L-3 (T1's backward)
or at layer 0's (T0's), both in the template. The peak a phantom layer's own transient
values make is the same layer's in T1, which the template holds.
"""

from __future__ import annotations

from dataclasses import replace

import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.capture.graph import CapturedGraph, Fold
from autopar.search.sharding.instance import PhantomLayers, ShardingProblem
from autopar.search.sharding.node_strategies import NodeStrategies
from autopar.solver import StrategyProblem

MIDDLE = 1
"""The template layer that stands for layers 1 .. L-3."""


def fold_problem(sp: ShardingProblem, fold: Fold) -> ShardingProblem:
    """``sp``, the sharding problem of ``fold.template``, as the problem of all ``fold.layers`` layers.

    Indices, strategies and the map back onto the template stay ``sp``'s: an answer to
    the result is an answer to ``sp`` (and, through :func:`unfold_choice`, to the full graph's).
    """
    layers = fold.layers
    w = float(layers - 3)
    middle = [fold.template_layer.get(name, (None,))[0] == MIDDLE for name in sp.nodes]
    weight = [w if m else 1.0 for m in middle]
    p = sp.problem
    params = set(sp.held_nodes)  # the parameters' and the fixed state's memory: held throughout
    ghosts = PhantomLayers(layers - 4, *_marks(sp, fold), sp.facts.n_nodes)
    phantoms = float(ghosts.count)

    node_costs = [_scaled(row, x) for row, x in zip(p.node_costs, weight, strict=True)]
    node_memory = [
        _scaled(row, weight[i]) if i in params else row for i, row in enumerate(p.node_memory)
    ]
    edge_weight = [weight[v] for _, v in p.edges]
    edge_costs = [_scaled(row, x) for row, x in zip(p.edge_costs, edge_weight, strict=True)]
    items = list(p.memory_items or [])
    grad_items = list(sp.grad_items)
    added = []
    for i, m in enumerate(middle):
        if m and i not in params:
            iv = ghosts.span(*p.node_intervals[i])
            if iv is not None:
                added.append((i, iv, _scaled(p.node_memory[i], phantoms)))
    grads = set(sp.grad_items)
    for k, (v, iv, row) in enumerate(p.memory_items or []):
        if middle[v]:
            span = ghosts.span(*iv)
            if span is not None:
                if k in grads:
                    grad_items.append(len(items) + len(added))
                added.append((v, span, _scaled(row, phantoms)))
    items += added
    problem: StrategyProblem = replace(
        p,
        node_costs=node_costs,
        node_memory=node_memory,
        edge_costs=edge_costs,
        memory_items=items or None,
    )
    return replace(
        sp,
        problem=problem,
        flops=[f * x for f, x in zip(sp.flops, weight, strict=True)],
        state_parts={i: [tuple(y * weight[i] for y in part) for part in rows] for i, rows in sp.state_parts.items()},
        param_comm={i: _scaled(rows, weight[i]) for i, rows in sp.param_comm.items()},
        grad_items=grad_items,
        edge_weight=edge_weight,
        node_weight=weight,
        template=sp,
        phantoms=ghosts,
        held={(i, j): (cost * weight[i], counts) for (i, j), (cost, counts) in sp.held.items()},
    )


def unfold_choice(full: ShardingProblem, folded: ShardingProblem, choice: list[int], fold: Fold) -> list[int]:
    """The full graph's answer that ``choice`` (an answer to ``folded``) stands for: each node takes the
    strategy of the template node it stands on (:attr:`Fold.origin`)."""
    index = {name: i for i, name in enumerate(folded.nodes)}
    same_lists = len(full.list_ids) == len(full.nodes) and len(folded.list_ids) == len(folded.nodes)
    found: dict[tuple[int, int, int], int] = {}
    out = []
    for i, name in enumerate(full.nodes):
        j = index[fold.origin[name]]
        key = (full.list_ids[i], folded.list_ids[j], choice[j]) if same_lists else None
        k = found.get(key) if key is not None else None
        if k is None:
            k = full.strategies[i].index(folded.strategies[j][choice[j]])
            if key is not None:
                found[key] = k
        out.append(k)
    return out


def unfold_strategies(captured: CapturedGraph, template: dict[str, NodeStrategies]) -> dict[str, NodeStrategies]:
    """The whole graph's strategies from the template's: each node those of the node it stands on.

    A node of the whole graph is the template node's op on inputs of the same shapes
    (:attr:`Fold.origin`), read from the copies of that node's inputs, so its candidate
    strategies are the template node's with the inputs renamed. Where a middle layer's
    candidates would differ from the one it stands on (an input whose candidates differ
    between the first layer and a middle one), :func:`unfold_choice` finds no strategy to
    carry over and says so with a ValueError.
    """
    fold = captured.fold
    assert fold is not None
    by_template = {n.name: n for n in fold.template.gm.graph.nodes}
    out: dict[str, NodeStrategies] = {}
    for node in captured.gm.graph.nodes:
        if node.op == "output":
            continue
        t = by_template[fold.origin[node.name]]
        ns = template[t.name]
        read = {}
        mine = pytree.tree_leaves((node.args, dict(node.kwargs)), is_leaf=lambda x: isinstance(x, fx.Node))
        theirs = pytree.tree_leaves((t.args, dict(t.kwargs)), is_leaf=lambda x: isinstance(x, fx.Node))
        for a, b in zip(theirs, mine, strict=True):
            if isinstance(a, fx.Node):
                read[a.name] = b.name
        out[node.name] = replace(ns, node=node.name, inputs=[read[x] for x in ns.inputs])
    return out


def _scaled(row: list[float], x: float) -> list[float]:
    return row if x == 1.0 else [c * x for c in row]


def _marks(sp: ShardingProblem, fold: Fold) -> tuple[int, int, int, int]:
    """Where T1's forward starts, T2's forward ends, T2's backward starts and T1's ends: positions in the template's graph."""
    facts = sp.facts
    assert facts is not None
    spans: dict[tuple[int, str], list[int]] = {}
    for name, part in fold.template_layer.items():
        if name in facts.order:
            spans.setdefault(part, []).append(facts.order[name])
    return (
        min(spans[(MIDDLE, "fwd")]),
        max(spans[(MIDDLE + 1, "fwd")]) + 1,
        min(spans[(MIDDLE + 1, "bwd")]),
        max(spans[(MIDDLE, "bwd")]) + 1,
    )
