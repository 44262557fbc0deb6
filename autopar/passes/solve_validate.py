"""Checks that a :class:`~autopar.passes.solve.StrategyProblem` is well formed, with messages naming the culprit.

Split from :mod:`autopar.passes.solve` so that the solver's entry point reads as the
pipeline it runs; every public solve starts here, so a malformed problem (a NaN cost, a
wrong matrix size, a group of mismatched nodes) fails with a ValueError that names the
node, edge or group rather than somewhere deep in the reductions or the MILP.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from autopar.passes.solve import StrategyProblem


def node_label(problem: StrategyProblem, v: int) -> str:
    names = problem.node_names
    return f"node {v} ({names[v]!r})" if names is not None and v < len(names) else f"node {v}"


def _value_problem(values: list[float], allow_inf: bool, nonneg: bool) -> str | None:
    """What is wrong with one list of numbers, or None."""
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as err:
        return f"not a list of numbers ({err})"
    if arr.ndim != 1:
        return f"expected a flat list of numbers, got shape {arr.shape}"
    if np.isnan(arr).any():
        return "contains NaN"
    if np.isneginf(arr).any():
        return "contains -inf"
    if not allow_inf and np.isinf(arr).any():
        return "contains inf"
    if nonneg and (arr < 0).any():
        return "is negative"
    return None


def _first_bad(lists: list[list[float]], allow_inf: bool, nonneg: bool = False) -> tuple[int, str] | None:
    """The first list holding a bad value and what is wrong; one array pass when all is well.

    A list object that appears several times (repeated layers share one cost matrix) is
    read once, at its first appearance, which is also where the first bad index would be.
    """
    first: dict[int, int] = {}
    for i, x in enumerate(lists):
        first.setdefault(id(x), i)
    index = list(first.values())
    distinct = [lists[i] for i in index]
    lengths = [len(x) for x in distinct]
    try:
        flat = np.fromiter(itertools.chain.from_iterable(distinct), dtype=float, count=sum(lengths))
    except (TypeError, ValueError):
        candidates: Iterable[int] = range(len(lists))
    else:
        bad = np.isnan(flat) | np.isneginf(flat)
        if not allow_inf:
            bad |= np.isinf(flat)
        if nonneg:
            bad |= flat < 0
        if not bad.any():
            return None
        candidates = [index[int(np.searchsorted(np.cumsum(lengths), int(np.argmax(bad)), side="right"))]]
    for i in candidates:
        message = _value_problem(lists[i], allow_inf, nonneg)
        if message is not None:
            return i, message
    return None


def validate(p: StrategyProblem) -> None:
    """Raise ValueError naming the first malformed node, edge or group."""
    n = len(p.node_costs)
    for name in ("node_memory", "node_intervals"):
        if len(getattr(p, name)) != n:
            raise ValueError(f"{name} has {len(getattr(p, name))} entries, node_costs has {n}")
    if p.node_names is not None and len(p.node_names) != n:
        raise ValueError(f"node_names has {len(p.node_names)} entries, node_costs has {n}")
    if len(p.edge_costs) != len(p.edges):
        raise ValueError(f"edge_costs has {len(p.edge_costs)} entries, edges has {len(p.edges)}")
    for v in range(n):
        s = len(p.node_costs[v])
        if s == 0:
            raise ValueError(f"{node_label(p, v)}: has no strategies")
        if len(p.node_memory[v]) != s:
            raise ValueError(
                f"{node_label(p, v)}: node_memory has {len(p.node_memory[v])} entries, node_costs has {s}"
            )
        iv = p.node_intervals[v]
        if len(iv) != 2 or any(isinstance(x, bool) or int(x) != x for x in iv):
            raise ValueError(
                f"{node_label(p, v)}: node_intervals entry {iv!r} is not a pair of integers (start, end)"
            )
        if not 0 <= iv[0] <= iv[1]:
            raise ValueError(f"{node_label(p, v)}: node_intervals entry {tuple(iv)} needs 0 <= start <= end")
    for field_name, allow_inf, nonneg in (("node_costs", True, False), ("node_memory", False, True)):
        bad = _first_bad(getattr(p, field_name), allow_inf, nonneg)
        if bad is not None:
            raise ValueError(f"{node_label(p, bad[0])}: {field_name} {bad[1]}")
    _validate_items(p)
    for e, edge in enumerate(p.edges):
        if len(edge) != 2:
            raise ValueError(f"edge {e}: {edge!r} is not a pair (u, v)")
        u, v = edge
        if not (0 <= u < n and 0 <= v < n) or int(u) != u or int(v) != v:
            raise ValueError(f"edge {e} ({u}, {v}): node index out of range 0..{n - 1}")
        if u == v:
            raise ValueError(f"edge {e} ({u}, {v}): an edge from a node to itself")
        want = len(p.node_costs[u]) * len(p.node_costs[v])
        if len(p.edge_costs[e]) != want:
            raise ValueError(
                f"edge {e} ({u} -> {v}): edge_costs has {len(p.edge_costs[e])} entries, expected "
                f"{len(p.node_costs[u])} x {len(p.node_costs[v])} = {want}"
            )
    bad = _first_bad(p.edge_costs, allow_inf=True)
    if bad is not None:
        u, v = p.edges[bad[0]]
        raise ValueError(f"edge {bad[0]} ({u} -> {v}): edge_costs {bad[1]}")
    if p.memory_limit is not None and (math.isnan(p.memory_limit) or p.memory_limit < 0):
        raise ValueError(f"memory_limit {p.memory_limit} must be a non-negative number or None")
    for g, group in enumerate(p.groups or []):
        if len(group) == 0:
            raise ValueError(f"group {g}: is empty")
        for v in group:
            if not (0 <= v < n) or int(v) != v:
                raise ValueError(f"group {g}: node index {v} out of range 0..{n - 1}")
            if len(p.node_costs[v]) != len(p.node_costs[group[0]]):
                raise ValueError(
                    f"group {g}: {node_label(p, v)} has {len(p.node_costs[v])} strategies but "
                    f"{node_label(p, group[0])} has {len(p.node_costs[group[0]])}"
                )


def _validate_items(p: StrategyProblem) -> None:
    """Each extra memory item names a node, a live interval and a memory per strategy of that node."""
    n = len(p.node_costs)
    for k, item in enumerate(p.memory_items or []):
        if len(item) != 3:
            raise ValueError(f"memory item {k}: {item!r} is not (node, (start, end), memory per strategy)")
        v, iv, mem = item
        if isinstance(v, bool) or int(v) != v or not 0 <= v < n:
            raise ValueError(f"memory item {k}: node index {v} out of range 0..{n - 1}")
        if len(iv) != 2 or any(isinstance(x, bool) or int(x) != x for x in iv) or not 0 <= iv[0] <= iv[1]:
            raise ValueError(f"memory item {k} of {node_label(p, v)}: interval {iv!r} needs integers 0 <= start <= end")
        if len(mem) != len(p.node_costs[v]):
            raise ValueError(
                f"memory item {k} of {node_label(p, v)}: {len(mem)} memory entries, the node has "
                f"{len(p.node_costs[v])} strategies"
            )
        message = _value_problem(mem, allow_inf=False, nonneg=True)
        if message is not None:
            raise ValueError(f"memory item {k} of {node_label(p, v)}: {message}")
