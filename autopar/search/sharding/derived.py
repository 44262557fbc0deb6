"""Problems derived from a built sharding problem without building it again.

The search solves one mesh's problem (built once, for one micro-batch, by
:func:`autopar.search.sharding.problem.build_problem`) for several
micro-batch counts and under several restrictions (seed layouts, a fixed
ZeRO stage, placements that divide a micro-batch): each is the same problem
with some memory divided or some strategies forbidden.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from autopar.search.sharding.filters import node_key
from autopar.search.sharding.instance import ShardingProblem, parameter_sourced, per_microbatch_grad_sync
from autopar.search.sharding.node_strategies import Strategy
from autopar.search.sharding.step_memory import accumulated
from autopar.solver import StrategyProblem


def with_microbatches(sp: ShardingProblem, microbatches: int, reopen: bool = True) -> ShardingProblem:
    """``sp`` (built for one micro-batch) for ``microbatches``: its activation memory divided by that.

    The strategies that hold at this count alone (``sp.held``) are allowed, unless not ``reopen``: an
    answer costed at other counts too (a pipeline's) must not take them.

    Exactly what :func:`autopar.search.sharding.problem.build_problem` computes with ``microbatches`` (the same floating-point
    operations), without building again: only the memory of the nodes the model does not hold for the whole
    step (its parameters and fixed state) depends on it.
    """
    if microbatches == 1:
        return sp
    params = set(sp.held_nodes)
    divided: dict[int, list[float]] = {}  # repeated layers share their rows (one list object): divide each once

    def per_microbatch(row: list[float]) -> list[float]:
        out = divided.get(id(row))
        if out is None:
            out = divided[id(row)] = [x / microbatches for x in row]
        return out

    memory = [row if i in params else per_microbatch(row) for i, row in enumerate(sp.problem.node_memory)]
    # ZeRO-2 and ZeRO-3 reduce each micro-batch's gradient (ZeRO-1 and plain data parallelism once a
    # step), and every micro-batch moves the parameters it reads again (ZeRO-3's all-gathers)
    edge_costs = list(sp.problem.edge_costs)
    for e in sp.grad_edges:
        v = sp.problem.edges[e][1]
        cols = [j for j, s in enumerate(sp.strategies[v]) if per_microbatch_grad_sync(sp, s)]
        if cols:
            n_v = len(sp.strategies[v])
            row = list(edge_costs[e])
            for a in range(len(row) // n_v):
                for j in cols:
                    row[a * n_v + j] *= microbatches
            edge_costs[e] = row
    moved = parameter_sourced(sp)
    for e, info in enumerate(sp.edge_info):
        if info.kind == "data" and info.src in moved:
            edge_costs[e] = [c * microbatches for c in edge_costs[e]]
    # gradients are sized by the parameters, not the batch, and accumulate over the micro-batches
    grads = set(sp.grad_items)
    items = [
        (v, iv, row if k in grads else per_microbatch(row))
        for k, (v, iv, row) in enumerate(sp.problem.memory_items or [])
    ]
    grad_items = accumulated(items, sp.grad_items)
    # the strategies that hold at this count alone (a reshape local once a micro-batch is one sequence)
    reopened = tuple(ij for ij, (_, counts) in sp.held.items() if reopen and microbatches in counts)
    node_costs = sp.problem.node_costs
    if reopened:
        node_costs = list(node_costs)
        for i, j in reopened:
            node_costs[i] = [sp.held[(i, j)][0] if k == j else c for k, c in enumerate(node_costs[i])]
    problem = replace(
        sp.problem, node_costs=node_costs, node_memory=memory, edge_costs=edge_costs, memory_items=items or None
    )
    template = None if sp.template is None else with_microbatches(sp.template, microbatches, reopen)
    return replace(
        sp, problem=problem, microbatches=microbatches, grad_items=grad_items, template=template, reopened=reopened
    )


def restrict(
    problem: StrategyProblem, sp: ShardingProblem, allowed: Callable[[str, Strategy], bool]
) -> StrategyProblem:
    """``problem`` with the strategies ``allowed(node name, strategy)`` rejects forbidden (infinite cost).

    A node none of whose strategies is allowed keeps them all. Nodes with the same strategy
    list (``sp.list_ids``) and the same key of the filter (:mod:`autopar.search.sharding.filters`)
    are asked once. Repeated-layer groups are
    split where their members' restrictions differ, so tying them never forbids more.
    Indices stay those of ``sp``: an answer reads back through ``sp`` as it is.
    """
    costs = list(problem.node_costs)
    masks: dict[int, tuple[bool, ...]] = {}
    key = node_key(allowed)
    shared: dict[tuple, tuple[bool, ...]] = {}  # (strategy list, node key) -> mask: the repeated layers' copies
    lists = sp.list_ids if len(sp.list_ids) == len(sp.nodes) else None
    for i, name in enumerate(sp.nodes):
        k = (lists[i], key(name)) if lists is not None else None
        mask = shared.get(k) if k is not None else None
        if mask is None:
            mask = tuple(bool(allowed(name, s)) for s in sp.strategies[i])
            if k is not None:
                shared[k] = mask
        if all(mask) or not any(mask):
            continue
        masks[i] = mask
        costs[i] = [c if ok else math.inf for c, ok in zip(costs[i], mask, strict=True)]
    groups = None
    if problem.groups:
        groups = []
        for group in problem.groups:
            parts: dict[tuple[bool, ...] | None, list[int]] = {}
            for v in group:
                parts.setdefault(masks.get(v), []).append(v)
            groups += [g for g in parts.values() if len(g) > 1]
    return replace(problem, node_costs=costs, groups=groups or None)
