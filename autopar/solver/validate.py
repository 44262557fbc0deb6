"""Checks that a :class:`~autopar.solver.solve.StrategyProblem` is well formed, with messages naming the culprit.

Split from :mod:`autopar.solver.solve` so that the solver's entry point reads as the
pipeline it runs; every public solve starts here, so a malformed problem (a NaN cost, a
wrong matrix size, a group of mismatched nodes) fails with a ValueError that names the
node, edge or group rather than somewhere deep in the reductions or the MILP.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import numpy as np

from autopar.solver.problem import StrategyProblem


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


def _shapes_ok(p: StrategyProblem) -> bool:
    """Whether every node's sizes and interval and every edge's ends and size are well formed.

    The same checks as the loops of :func:`validate`, over arrays: a problem of ten thousand
    nodes is validated once per solve, and the search solves each mesh several times. When
    this says no, the loops run to name the culprit.
    """
    n, m = len(p.node_costs), len(p.edges)
    if not n:
        return False
    sizes = np.fromiter(map(len, p.node_costs), dtype=np.int64, count=n)
    if (sizes == 0).any() or not np.array_equal(sizes, np.fromiter(map(len, p.node_memory), np.int64, n)):
        return False
    if not _int_pairs(p.node_intervals):
        return False
    iv = np.array(p.node_intervals, dtype=np.int64).reshape(n, 2)
    if (iv[:, 0] < 0).any() or (iv[:, 0] > iv[:, 1]).any():
        return False
    if not m:
        return True
    if not _int_pairs(p.edges):
        return False
    ends = np.array(p.edges, dtype=np.int64).reshape(m, 2)
    if (ends < 0).any() or (ends >= n).any() or (ends[:, 0] == ends[:, 1]).any():
        return False
    want = sizes[ends[:, 0]] * sizes[ends[:, 1]]
    return np.array_equal(want, np.fromiter(map(len, p.edge_costs), np.int64, m))


def _int_pairs(pairs: list) -> bool:
    """Whether every entry is a pair of Python ints (numpy integers, bools and the rest: the loops decide)."""
    try:
        return all(len(x) == 2 and type(x[0]) is int and type(x[1]) is int for x in pairs)
    except TypeError:
        return False


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
    shapes_ok = _shapes_ok(p)
    for v in range(0 if shapes_ok else n):
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
    for e, edge in enumerate([] if shapes_ok else p.edges):
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
    items = p.memory_items or []
    # the values of all items in one array pass (see _first_bad); the loop raises at the first bad one
    bad_values = _first_bad([_item_memory(item) for item in items], allow_inf=False, nonneg=True)
    for k, item in enumerate(items):
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
        if bad_values is not None and bad_values[0] == k:
            raise ValueError(f"memory item {k} of {node_label(p, v)}: {bad_values[1]}")


def _item_memory(item) -> list:
    """An item's memory per strategy, or nothing when it is not shaped as one (the loop says so)."""
    try:
        return item[2] if len(item) == 3 else []
    except TypeError:
        return []
