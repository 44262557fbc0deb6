r"""Choose one strategy per node of a strategy graph: the solver core of autopar.

This module knows nothing of torch (DESIGN.md, "The solver core knows nothing of
torch"): the strategies pass turns a captured graph into a :class:`StrategyProblem`
and maps the returned :class:`Solution` back to placements.

The problem
-----------
Nodes ``v = 0..N-1``; node ``v`` has ``S_v`` strategies. Choosing strategy ``s`` for
``v`` costs ``c_v[s]`` seconds and holds ``m_v[s] >= 0`` bytes during the node's live
interval ``[start_v, end_v)`` of a global time order ``t = 0..T-1``. A directed edge
``(u, v)`` carries a matrix ``E_uv`` of shape ``S_u x S_v`` (seconds: resharding
between ``u``'s output and ``v``'s input). With an optional memory limit ``M``::

    minimise    sum_v c_v[s_v] + sum_(u,v) E_uv[s_u, s_v]
    subject to  sum_{v : start_v <= t < end_v} m_v[s_v] <= M      for every t
                s_v = s_w                      for v, w in the same group

An infinite cost marks a forbidden strategy (``c_v[s]``) or pair (``E_uv[s, t]``).
Memory is honoured to a relative ``MEMORY_RTOL`` (1e-9) of ``M``.

The MILP
--------
Binary ``x_{v,s}`` (one set per group: repeated layers share variables) with
``sum_s x_{v,s} = 1``. Each edge gets continuous ``y_{uv,s,t} >= 0`` tied to both
ends by the *marginal* (flow) constraints::

    sum_t y_{uv,s,t} = x_{u,s}   for all s        sum_s y_{uv,s,t} = x_{v,t}   for all t

and costs ``sum E_uv[s,t] y_{uv,s,t}``. With integral ``x`` the marginals are unit
vectors, so ``y`` is forced to the indicator of ``(s_u, s_v)`` and needs no
integrality. We use this form rather than ``y >= x_{u,s} + x_{v,t} - 1``: that one
lets the LP relaxation set every ``y`` to zero at ``x = 1/S``, so its bound ignores
the edge costs, while the marginal form is the local-polytope relaxation of MAP
inference, exact on trees and near-integral on the chain-with-skips graphs of
transformer layers. It costs ``S_u + S_v - 1`` rows per edge (one is implied).
The reduction can leave a cost table over three or more variables (a *factor*, see
:mod:`autopar.passes.solve_reduce`); it gets one ``y`` per joint strategy and the
same marginal rows for each variable of its scope.

Memory rows are written only for the time steps whose live set is locally maximal
(others are implied; memory is non-negative), that can bind at all, and that no
other row implies; items whose memory does not depend on the choice become
constants on the right-hand side. With long-lived activations the direct rows
``sum_{live} m x <= M - const`` hold O(N^2) nonzeros, so when that is much more
than the alternative the rows are written cumulatively,
``u_r = u_{r-1} + (entering) - (leaving)``, ``0 <= u_r <= cap_r``: the same LP, with
each item appearing twice. Costs are scaled so typical coefficients are near 1 and
memory rows are in units of ``M``, for the solvers' absolute tolerances.

The pipeline
------------
1. Validate, merge groups into shared variables, merge parallel edges.
2. Reduce exactly (:mod:`autopar.passes.solve_reduce`): forbidden and dominated
   strategies, separable edges, fixed variables, and elimination of variables whose
   memory cannot matter. Without a memory limit this alone solves transformer-shaped
   training graphs of tens of thousands of nodes.
3. Heuristic answers on what is left: greedy (best response in order, memory repair
   cheapest cost per byte first, local improvement), and with a memory limit a
   Lagrangian one (memory priced into the costs, each priced problem solved exactly
   by elimination, the price searched until the answer fits), which also gives a
   lower bound. The best is the hint for SCIP and the fallback whenever the solver
   returns nothing better in time.
4. The MILP, through MathOpt for HiGHS and SCIP (built as one ``ModelProto`` from
   arrays) or pywraplp for CBC, with the time that is left; a timer interrupts HiGHS
   at the deadline. Beyond ``_HIGHS_MIP_MAX_NNZ`` nonzeros HiGHS's branch and bound
   cannot be held to a time limit (see ``solve_strategies``), so only the LP
   relaxation is solved there, then rounded and repaired; its optimum is the bound.
5. The answer is mapped back through the reductions and checked on the original
   problem: objective recomputed, peak memory verified.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from autopar.passes.solve_reduce import (
    CoreProblem,
    InfeasibleError,
    Reducer,
    memory_rows,
    prune_rows,
    range_sums,
)

logger = logging.getLogger(__name__)

MEMORY_RTOL = 1e-9
"""Relative tolerance on the memory limit: a peak up to ``M * (1 + MEMORY_RTOL)`` fits."""

_MIP_REL_GAP = 1e-9
_BACKENDS = ("highs", "scip", "cbc")
# HiGHS runs without presolve and costly heuristics on models with more nonzeros (_run_solver).
_HIGHS_LARGE_NNZ = 200_000
# Above this many nonzeros HiGHS solves only the LP relaxation, which is rounded (see solve_strategies).
_HIGHS_MIP_MAX_NNZ = 400_000
# Below this much time left, the solver is not started and the greedy answer is returned.
_MIN_SOLVER_TIME_S = 0.01


@dataclass
class StrategyProblem:
    """A strategy graph: per-node strategy costs and memory, live intervals, edge cost matrices.

    Costs are seconds, memory is bytes. ``edge_costs[e]`` is row-major over
    ``(strategy of u, strategy of v)`` for ``edges[e] = (u, v)``. ``groups`` lists nodes
    that must take the same strategy index (repeated layers); overlapping groups merge.
    """

    node_costs: list[list[float]]
    node_memory: list[list[float]]
    node_intervals: list[tuple[int, int]]
    edges: list[tuple[int, int]]
    edge_costs: list[list[float]]
    memory_limit: float | None = None
    node_names: list[str] | None = None
    groups: list[list[int]] | None = None


@dataclass
class Solution:
    """One strategy index per node, with how sure the solver is about it.

    ``status`` is "optimal", "feasible" (time limit hit: the best answer found, with
    ``gap`` against the solver's bound when it has one), "infeasible" (``choice`` empty,
    ``objective`` inf; with a memory limit, ``stats["min_peak_memory"]`` is the smallest
    peak any choice reaches) or "unknown" (time ran out before any answer was found).
    """

    choice: list[int]
    objective: float
    status: str
    gap: float | None
    solve_time_s: float
    backend: str
    stats: dict = field(default_factory=dict)


# -- validation ----------------------------------------------------------------------------------


def _node_label(problem: StrategyProblem, v: int) -> str:
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
    """The first list holding a bad value and what is wrong; one array pass when all is well."""
    lengths = [len(x) for x in lists]
    try:
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=float, count=sum(lengths))
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
        candidates = [int(np.searchsorted(np.cumsum(lengths), int(np.argmax(bad)), side="right"))]
    for i in candidates:
        message = _value_problem(lists[i], allow_inf, nonneg)
        if message is not None:
            return i, message
    return None


def _validate(p: StrategyProblem) -> None:
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
            raise ValueError(f"{_node_label(p, v)}: has no strategies")
        if len(p.node_memory[v]) != s:
            raise ValueError(
                f"{_node_label(p, v)}: node_memory has {len(p.node_memory[v])} entries, node_costs has {s}"
            )
        iv = p.node_intervals[v]
        if len(iv) != 2 or any(isinstance(x, bool) or int(x) != x for x in iv):
            raise ValueError(
                f"{_node_label(p, v)}: node_intervals entry {iv!r} is not a pair of integers (start, end)"
            )
        if not 0 <= iv[0] <= iv[1]:
            raise ValueError(f"{_node_label(p, v)}: node_intervals entry {tuple(iv)} needs 0 <= start <= end")
    for field_name, allow_inf, nonneg in (("node_costs", True, False), ("node_memory", False, True)):
        bad = _first_bad(getattr(p, field_name), allow_inf, nonneg)
        if bad is not None:
            raise ValueError(f"{_node_label(p, bad[0])}: {field_name} {bad[1]}")
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
                    f"group {g}: {_node_label(p, v)} has {len(p.node_costs[v])} strategies but "
                    f"{_node_label(p, group[0])} has {len(p.node_costs[group[0]])}"
                )


def _resolve_backend(backend: str | None) -> str:
    """The backend to use: the forced one (checked), else the first of HiGHS, SCIP, CBC available."""
    if backend is not None and backend.lower() not in _BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(_BACKENDS)}")
    for name in [backend.lower()] if backend is not None else list(_BACKENDS):
        if _backend_available(name):
            return name
        if backend is not None:
            raise ValueError(f"backend {backend!r} is not available in this OR-tools build")
    raise RuntimeError("no MILP backend (HiGHS, SCIP, CBC) is available in this OR-tools build")


@functools.cache
def _backend_available(name: str) -> bool:
    """Whether this OR-tools build has the backend: asked once per process with an empty model."""
    if name == "cbc":
        from ortools.linear_solver import pywraplp

        return pywraplp.Solver.CreateSolver("CBC") is not None
    empty = _Milp(
        *(np.zeros(0) for _ in range(6)), np.zeros(1, dtype=np.int64), np.zeros(0, np.int64), np.zeros(0)
    )
    return _run_solver(empty, name, 1.0, None).status == "OPTIMAL"


# -- the variable graph --------------------------------------------------------------------------


def _group_vars(p: StrategyProblem) -> tuple[np.ndarray, list[list[int]]]:
    """Variable of each node (groups share one; numbered by their smallest node) and members."""
    n = len(p.node_costs)
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for group in p.groups or []:
        root = find(int(group[0]))
        for v in group[1:]:
            r = find(int(v))
            if r != root:
                parent[r] = root
    var_of_node = np.empty(n, dtype=np.int64)
    members: list[list[int]] = []
    var_of_root: dict[int, int] = {}
    for v in range(n):
        r = find(v)
        k = var_of_root.setdefault(r, len(members))
        if k == len(members):
            members.append([])
        members[k].append(v)
        var_of_node[v] = k
    return var_of_node, members


def _variable_graph(
    p: StrategyProblem, var_of_node: np.ndarray, members: list[list[int]]
) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray]]:
    """Per-variable costs and per-pair matrices (parallel edges summed, in-group edges on the diagonal)."""
    costs = [np.sum([np.asarray(p.node_costs[v], dtype=float) for v in vs], axis=0) for vs in members]
    mats: dict[tuple[int, int], np.ndarray] = {}
    for e, (u, v) in enumerate(p.edges):
        a, b = int(var_of_node[u]), int(var_of_node[v])
        m = np.asarray(p.edge_costs[e], dtype=float).reshape(len(p.node_costs[u]), len(p.node_costs[v]))
        if a == b:
            costs[a] = costs[a] + np.diagonal(m)
            continue
        key, m = ((a, b), m) if a < b else ((b, a), m.T)
        old = mats.get(key)
        mats[key] = m if old is None else old + m
    return costs, mats


# -- exact evaluation on the original problem ----------------------------------------------------


def _objective(p: StrategyProblem, choice: list[int]) -> float:
    terms = [p.node_costs[v][s] for v, s in enumerate(choice)]
    terms += [
        p.edge_costs[e][choice[u] * len(p.node_costs[v]) + choice[v]] for e, (u, v) in enumerate(p.edges)
    ]
    return math.fsum(terms)


def _peak_memory(p: StrategyProblem, choice: list[int]) -> float:
    """Largest total memory of the live nodes over all time steps for this choice."""
    if not choice:
        return 0.0
    iv = np.asarray(p.node_intervals, dtype=np.int64).reshape(-1, 2)
    mem = np.array([p.node_memory[v][s] for v, s in enumerate(choice)], dtype=float)
    live = iv[:, 1] > iv[:, 0]
    if not live.any():
        return 0.0
    horizon = int(iv[live, 1].max())
    delta = np.bincount(iv[live, 0], mem[live], minlength=horizon + 1)
    delta -= np.bincount(iv[live, 1], mem[live], minlength=horizon + 1)
    return float(max(np.cumsum(delta[:horizon]).max(), 0.0))


# -- greedy --------------------------------------------------------------------------------------


class _Greedy:
    """A quick answer on the core problem: best response in order, memory repair, local moves.

    Infinite costs are replaced by a large finite penalty so incremental updates stay
    finite; an answer that still uses one is rejected by the caller's exact evaluation.
    ``local[i, s]`` is variable i's cost plus its factors' entries at the others' choices.
    """

    def __init__(self, core: CoreProblem, tol: float) -> None:
        self.core = core
        self.tol = tol
        n = core.n
        self.sizes = core.sizes
        smax = int(self.sizes.max()) if n else 1
        finite = [np.abs(c[np.isfinite(c)]).sum() for c in core.costs]
        finite += [np.abs(t[np.isfinite(t)]).sum() for _, t in core.factors]
        big = 1e3 * (float(np.sum(finite)) + 1.0)
        self.cost = np.full((n, smax), np.inf)
        for i, c in enumerate(core.costs):
            self.cost[i, : len(c)] = np.where(np.isfinite(c), c, big)
        self.scopes = [scope for scope, _ in core.factors]
        self.tables = [np.where(np.isfinite(t), t, big) for _, t in core.factors]
        self.of_var: list[list[int]] = [[] for _ in range(n)]
        for f, scope in enumerate(self.scopes):
            for v in scope:
                self.of_var[v].append(f)
        self.cur = np.full(n, -1, dtype=np.int64)
        # memory items, padded with +inf so a padding strategy never looks like it saves memory
        self.r0, self.r1, self.ivar = core.item_r0, core.item_r1, core.item_var
        self.coef = np.full((len(core.item_coef), smax), np.inf)
        for t, c in enumerate(core.item_coef):
            self.coef[t, : len(c)] = c
        self.items_of: list[list[int]] = [[] for _ in range(n)]
        for t, i in enumerate(core.item_var.tolist()):
            self.items_of[i].append(t)
        self.cap = core.cap

    def _slice(self, f: int, i: int) -> np.ndarray:
        """Factor f's entries over i's strategies; undecided others at their most favourable."""
        scope, table = self.scopes[f], self.tables[f]
        t = table[tuple(slice(None) if v == i or self.cur[v] < 0 else self.cur[v] for v in scope)]
        if t.ndim > 1:
            free = [v for v in scope if v == i or self.cur[v] < 0]
            t = t.min(axis=tuple(a for a, v in enumerate(free) if v != i))
        return t

    def _local_costs(self) -> np.ndarray:
        local = self.cost.copy()
        for i in range(self.core.n):
            for f in self.of_var[i]:
                local[i, : self.sizes[i]] += self._slice(f, i)
        return local

    def _usage(self) -> np.ndarray:
        picked = self.coef[np.arange(len(self.ivar)), self.cur[self.ivar]] if len(self.ivar) else np.zeros(0)
        return range_sums(self.r0, self.r1, picked, len(self.cap))

    def _move(self, i: int, s: int, local: np.ndarray, usage: np.ndarray) -> None:
        old = self.cur[i]
        for f in self.of_var[i]:
            for j in self.scopes[f]:
                if j != i:
                    before = self._slice(f, j)
                    self.cur[i] = s
                    local[j, : self.sizes[j]] += self._slice(f, j) - before
                    self.cur[i] = old
        for t in self.items_of[i]:
            usage[self.r0[t] : self.r1[t]] += self.coef[t, s] - self.coef[t, old]
        self.cur[i] = s

    def run(self, deadline: float, start: np.ndarray | None = None) -> np.ndarray | None:
        """Local strategy per core variable, or None when memory could not be repaired.

        From ``start`` when given (an answer to repair), else best response in order.
        """
        if start is not None:
            self.cur[:] = start
        for i in range(self.core.n if start is None else 0):
            score = self.cost[i, : self.sizes[i]].copy()
            for f in self.of_var[i]:
                score += self._slice(f, i)
            self.cur[i] = int(np.argmin(score))
        local = self._local_costs()
        usage = self._usage()
        if len(self.cap) and not self._repair(local, usage):
            return None
        self._improve(local, usage, deadline)
        return self.cur.copy()

    def _repair(self, local: np.ndarray, usage: np.ndarray) -> bool:
        """Lower memory where rows overflow, cheapest cost per byte first, until all fit.

        Not cut by the deadline: this answer is the fallback when the solver gets no time.
        Each move strictly lowers the total overflow, so the loop ends.
        """
        for _ in range(20 * self.core.n + 100):
            excess = usage - self.cap
            r = int(np.argmax(excess))
            if excess[r] <= self.tol:
                return True
            sel = np.nonzero((self.r0 <= r) & (r < self.r1))[0]
            per_item = self.coef[sel, self.cur[self.ivar[sel]]][:, None] - self.coef[sel]
            vars_, inv = np.unique(self.ivar[sel], return_inverse=True)
            if len(vars_) == len(sel):
                saved = np.empty_like(per_item)
                saved[inv] = per_item
            else:
                saved = np.zeros((len(vars_), self.coef.shape[1]))
                np.add.at(saved, inv, per_item)
            extra = local[vars_] - local[vars_, self.cur[vars_]][:, None]
            ok = saved > 0
            ratio = np.where(ok, extra / np.where(ok, saved, 1.0), np.inf).ravel()
            # Take moves in order of cost per byte saved until this row fits, one per variable;
            # each must lower the total overflow, so the loop cannot cycle.
            top = min(64, len(ratio))
            best = np.argpartition(ratio, top - 1)[:top]
            moved: set[int] = set()
            for flat in best[np.argsort(ratio[best])].tolist():
                if not np.isfinite(ratio[flat]) or usage[r] - self.cap[r] <= self.tol:
                    break
                vi, s = divmod(flat, saved.shape[1])
                i = int(vars_[vi])
                if i not in moved and self._excess_change(i, s, usage) < 0:
                    self._move(i, s, local, usage)
                    moved.add(i)
            if not moved:
                return False
        return False

    def _excess_change(self, i: int, s: int, usage: np.ndarray) -> float:
        items = self.items_of[i]
        lo = min(self.r0[t] for t in items)
        hi = max(self.r1[t] for t in items)
        delta = np.zeros(hi - lo)
        for t in items:
            delta[self.r0[t] - lo : self.r1[t] - lo] += self.coef[t, s] - self.coef[t, self.cur[i]]
        slack = usage[lo:hi] - self.cap[lo:hi]
        return float(np.maximum(slack + delta, 0).sum() - np.maximum(slack, 0).sum())

    def _improve(self, local: np.ndarray, usage: np.ndarray, deadline: float) -> None:
        """Best-response sweeps; with memory rows only moves that raise no item's memory."""
        for _ in range(3):
            moved = 0
            for i in range(self.core.n):
                row = local[i, : self.sizes[i]]
                c = self.cur[i]
                items = self.items_of[i]
                if items:
                    allowed = (self.coef[items, : self.sizes[i]] <= self.coef[items, c][:, None]).all(axis=0)
                    row = np.where(allowed, row, np.inf)
                s = int(np.argmin(row))
                if row[s] < local[i, c] - 1e-12 * abs(local[i, c]):
                    self._move(i, s, local, usage)
                    moved += 1
            if not moved or time.perf_counter() > deadline:
                return


def _priced(core: CoreProblem, tol: float, deadline: float) -> tuple[np.ndarray | None, float | None]:
    """A memory-feasible answer, and a lower bound, from problems with memory priced into costs.

    With memory priced instead of limited, nothing stops the eliminations of
    :mod:`autopar.passes.solve_reduce`, so each priced problem is solved exactly and
    whole chains switch strategy together, which single-variable greedy moves cannot do.
    An item's price is ``lam`` per byte above its minimum, times how many times a row it is
    live in has been the most overflowed one; ``lam`` doubles (and the worst row gains
    weight) until an answer fits, then is bisected towards the cheapest answer that fits. Each exact priced optimum also bounds the true
    one from below (Lagrangian duality: ``cost(x) + lam * sum_r w_r (usage_r(x) - cap_r)``
    with ``x`` the priced optimum), which gives a gap when the MILP has none. Returns
    ``(None, None)`` when an elimination would be too large or there is too little time.
    """
    n_rows = len(core.cap)
    if not n_rows or core.n * 2e-4 > deadline - time.perf_counter():
        return None, None
    weight = np.zeros(n_rows)
    coef = np.zeros((len(core.item_coef), int(core.sizes.max())))
    for t, c in enumerate(core.item_coef):
        coef[t, : len(c)] = c
    items = np.arange(len(core.item_coef))
    bound = -math.inf

    def cost(local: np.ndarray) -> float:
        total = sum(float(c[local[i]]) for i, c in enumerate(core.costs))
        return total + sum(float(t[tuple(local[list(s)])]) for s, t in core.factors)

    def solve(lam: float) -> tuple[np.ndarray | None, np.ndarray]:
        nonlocal bound
        prefix = np.concatenate([[0.0], np.cumsum(weight)])
        price = lam * (prefix[core.item_r1] - prefix[core.item_r0])
        costs = [c.copy() for c in core.costs]
        for t, i in enumerate(core.item_var.tolist()):
            costs[i] = costs[i] + price[t] * core.item_coef[t]
        reducer = Reducer(costs, core.factors, np.zeros(0, dtype=np.int64), [], None, None, 0.0, str)
        try:
            reducer.run()
        except InfeasibleError:
            return None, np.zeros(0)
        if reducer.alive.any():
            return None, np.zeros(0)
        local = reducer.expand(reducer.core(), np.zeros(0, dtype=np.int64))
        over = range_sums(core.item_r0, core.item_r1, coef[items, local[core.item_var]], n_rows) - core.cap
        bound = max(bound, cost(local) + lam * float(weight @ (over - tol)))
        return local, over

    def result(best: np.ndarray | None) -> tuple[np.ndarray | None, float | None]:
        return best, (bound + core.constant if math.isfinite(bound) else None)

    started = time.perf_counter()
    local, over = solve(0.0)
    if local is None:
        return None, None
    if over.max() <= tol:
        return result(local)
    if (time.perf_counter() - started) * 12 > deadline - time.perf_counter():
        return result(None)  # no time for the dozen or so solves the search takes
    spread = [float(np.ptp(c[np.isfinite(c)])) for c in core.costs if np.isfinite(c).sum() > 1]
    lam = (float(np.mean(spread)) if spread else 1.0) / max(float(coef.max()), 1e-300) or 1.0
    best, best_cost, low = None, math.inf, 0.0
    for _ in range(40):  # raise the price, spreading it over every row that overflowed
        if time.perf_counter() > deadline:
            return result(None)
        weight[int(np.argmax(over))] += 1.0
        lam *= 2.0
        local, over = solve(lam)
        if local is None:
            return result(None)
        if over.max() <= tol:
            best, best_cost = local, cost(local)
            break
        low = lam
    if best is None:
        return result(None)
    high = lam
    for _ in range(8):  # then look for the cheapest price that still fits
        if time.perf_counter() > deadline:
            break
        mid = 0.5 * (low + high)
        local, over = solve(mid)
        if local is None:
            break
        if over.max() <= tol:
            high = mid
            if cost(local) < best_cost:
                best, best_cost = local, cost(local)
        else:
            low = mid
    return result(best)


# -- the MILP ------------------------------------------------------------------------------------


@dataclass
class _Milp:
    """A MILP as arrays (rows in CSR, sorted by column), so building it costs numpy time."""

    lb: np.ndarray
    ub: np.ndarray
    obj: np.ndarray
    integer: np.ndarray
    row_lb: np.ndarray
    row_ub: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    offset: float = 0.0
    scale: float = 1.0  # objective coefficients are costs times this
    memory_scale: float = 1.0  # memory rows are bytes divided by this
    n_x: int = 0
    memory_form: str = "none"

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.row_lb), len(self.lb), len(self.data)


def _merge_coo(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n_cols: int) -> tuple[np.ndarray, ...]:
    """Sum duplicate (row, col) entries; returns them sorted by row, then column."""
    key = rows.astype(np.int64) * n_cols + cols
    uniq, inv = np.unique(key, return_inverse=True)
    summed = np.bincount(inv, vals, minlength=len(uniq))
    return uniq // n_cols, uniq % n_cols, summed


def _objective_scale(values: np.ndarray) -> float:
    """A factor that brings typical costs near 1 for the solvers' absolute tolerances.

    The median non-zero magnitude rather than the largest, so that large "avoid this"
    penalties (finite stand-ins for forbidden pairs) do not shrink every real cost below
    the tolerances.
    """
    mags = np.abs(values[np.isfinite(values) & (values != 0)])
    return 1.0 / float(np.median(mags)) if len(mags) else 1.0


def _factor_rows(core: CoreProblem, x0: np.ndarray, first_row: int, first_col: int) -> tuple[list, ...]:
    """Marginal rows tying each factor's continuous ``y`` to the ``x`` of its scope.

    For every variable of the scope and each of its strategies ``s``: the ``y`` entries whose
    assignment gives that variable ``s`` sum to ``x_{v,s}``. For all but the first variable
    the last strategy's row is implied and left out. Factors of the same shape are built
    together with array arithmetic.
    """
    sizes = core.sizes
    shapes = [tuple(sizes[list(scope)].tolist()) for scope, _ in core.factors]
    n_entries = np.array([int(np.prod(s)) for s in shapes], dtype=np.int64)
    n_rows = np.array([s[0] + sum(d - 1 for d in s[1:]) for s in shapes], dtype=np.int64)
    y0 = first_col + np.concatenate([[0], np.cumsum(n_entries)]).astype(np.int64)
    base = first_row + np.concatenate([[0], np.cumsum(n_rows)]).astype(np.int64)
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for f, shape in enumerate(shapes):
        by_shape.setdefault(shape, []).append(f)
    for shape, fs in by_shape.items():
        sel = np.array(fs, dtype=np.int64)
        scopes = np.array([core.factors[f][0] for f in fs], dtype=np.int64)
        coords = np.unravel_index(np.arange(int(np.prod(shape))), shape)
        offset = 0
        for axis, d in enumerate(shape):
            kept = d if axis == 0 else d - 1
            mask = coords[axis] < kept
            entries = np.nonzero(mask)[0]
            rows.append((base[sel][:, None] + offset + coords[axis][mask][None, :]).ravel())
            cols.append((y0[sel][:, None] + entries[None, :]).ravel())
            vals.append(np.ones(len(sel) * len(entries)))
            s = np.arange(kept)
            rows.append((base[sel][:, None] + offset + s[None, :]).ravel())
            cols.append((x0[scopes[:, axis]][:, None] + s[None, :]).ravel())
            vals.append(-np.ones(len(sel) * kept))
            offset += kept
    return rows, cols, vals, int(base[-1]), int(y0[-1])


def _build_milp(core: CoreProblem, memory_scale: float, memory_form: str) -> _Milp:
    """The marginal-form MILP of the core problem (see the module docstring)."""
    sizes = core.sizes
    n = core.n
    x0 = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n_x = int(x0[-1])
    cost = np.concatenate(core.costs + [t.ravel() for _, t in core.factors])
    scale = _objective_scale(cost)
    finite = np.isfinite(cost)

    # One strategy per variable, then the factors' marginals.
    rows = [np.repeat(np.arange(n), sizes)]
    cols = [np.arange(n_x)]
    vals = [np.ones(n_x)]
    f_rows, f_cols, f_vals, n_rows, n_cols = _factor_rows(core, x0, n, n_x)
    rows += f_rows
    cols += f_cols
    vals += f_vals
    lb = [np.zeros(n_cols)]
    ub = [np.where(finite, 1.0, 0.0)]
    obj = [np.where(finite, cost * scale, 0.0)]
    integer = [np.arange(n_cols) < n_x]
    row_lb = [np.ones(n), np.zeros(n_rows - n)]
    row_ub = [np.ones(n), np.zeros(n_rows - n)]

    form = "none"
    n_mem = len(core.cap)
    if n_mem and len(core.item_coef):
        # (item, strategy) pairs with memory above the item's minimum
        lengths = np.array([len(c) for c in core.item_coef], dtype=np.int64)
        pi = np.repeat(np.arange(len(lengths)), lengths)
        ps = np.arange(len(pi)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        pval = np.concatenate(core.item_coef) / memory_scale
        nonzero = pval > 0
        pi, ps, pval = pi[nonzero], ps[nonzero], pval[nonzero]
        pcol = x0[core.item_var[pi]] + ps
        r0, r1 = core.item_r0[pi], core.item_r1[pi]
        span = r1 - r0
        direct_nnz = int(span.sum())
        form = memory_form
        if form == "auto":
            # entries of one variable in one row merge, so a row holds at most one per column
            merged = min(direct_nnz, n_mem * len(np.unique(pcol)))
            form = "direct" if merged <= 3 * (2 * len(pi) + 2 * n_mem) else "cumulative"
        cap = core.cap / memory_scale
        if form == "direct" and n_mem * n_x <= direct_nnz:
            # many items per variable (grouped layers): sum them densely with a difference array
            delta = np.zeros((n_mem + 1, n_x))
            np.add.at(delta, (r0, pcol), pval)
            np.add.at(delta, (r1, pcol), -pval)
            dense = np.cumsum(delta[:-1], axis=0)
            mr, mc = np.nonzero(dense > 1e-12 * pval.max())
            mv = dense[mr, mc]
        elif form == "direct":
            offs = np.arange(direct_nnz) - np.repeat(np.cumsum(span) - span, span)
            mr, mc, mv = _merge_coo(
                np.repeat(r0, span) + offs, np.repeat(pcol, span), np.repeat(pval, span), n_cols
            )
        if form == "direct":
            row_lb.append(np.full(n_mem, -np.inf))
            row_ub.append(cap)
        else:
            # u_r - u_{r-1} - (entering) + (leaving) = 0, with 0 <= u_r <= cap_r
            u = n_cols + np.arange(n_mem)
            leaves = r1 < n_mem
            mr = np.concatenate([r0, r1[leaves], np.arange(n_mem), np.arange(1, n_mem)])
            mc = np.concatenate([pcol, pcol[leaves], u, u[:-1]])
            mv = np.concatenate([-pval, pval[leaves], np.ones(n_mem), -np.ones(n_mem - 1)])
            mr, mc, mv = _merge_coo(mr, mc, mv, n_cols + n_mem)
            lb.append(np.zeros(n_mem))
            ub.append(np.maximum(cap, 0.0))
            obj.append(np.zeros(n_mem))
            integer.append(np.zeros(n_mem, dtype=bool))
            row_lb.append(np.zeros(n_mem))
            row_ub.append(np.zeros(n_mem))
        keep = mv != 0
        rows.append(mr[keep] + n_rows)
        cols.append(mc[keep])
        vals.append(mv[keep])
        n_rows += n_mem

    all_rows = np.concatenate(rows)
    all_cols = np.concatenate(cols)
    order = np.lexsort((all_cols, all_rows))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(all_rows, minlength=n_rows))]).astype(np.int64)
    return _Milp(
        lb=np.concatenate(lb),
        ub=np.concatenate(ub),
        obj=np.concatenate(obj),
        integer=np.concatenate(integer),
        row_lb=np.concatenate(row_lb),
        row_ub=np.concatenate(row_ub),
        indptr=indptr,
        indices=all_cols[order].astype(np.int64),
        data=np.concatenate(vals)[order].astype(float),
        offset=core.constant * scale,
        scale=scale,
        memory_scale=memory_scale,
        n_x=n_x,
        memory_form=form,
    )


def _hint_values(milp: _Milp, core: CoreProblem, local: np.ndarray) -> np.ndarray:
    """A full assignment of the MILP's columns from a core choice (x, y, and u if present)."""
    values = np.zeros(len(milp.lb))
    x0 = np.concatenate([[0], np.cumsum(core.sizes)]).astype(np.int64)
    values[x0[:-1] + local] = 1.0
    col = milp.n_x
    for scope, table in core.factors:
        values[col + np.ravel_multi_index(tuple(local[list(scope)]), table.shape)] = 1.0
        col += table.size
    if milp.memory_form == "cumulative" and len(core.cap):
        picked = np.array([core.item_coef[t][local[i]] for t, i in enumerate(core.item_var.tolist())])
        usage = range_sums(core.item_r0, core.item_r1, picked, len(core.cap))
        values[col : col + len(core.cap)] = usage / milp.memory_scale
    return values


@dataclass
class _SolverResult:
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, NOT_SOLVED (limit, nothing found) or the backend's word
    values: np.ndarray | None
    bound: float | None  # in cost units, constant included
    wall_s: float


def _run_solver(
    milp: _Milp, backend: str, time_limit_s: float, hint: np.ndarray | None, relax: bool = False
) -> _SolverResult:
    """Solve with HiGHS or SCIP through MathOpt, or with CBC through pywraplp.

    MathOpt takes the model as one ``ModelProto`` filled from the arrays, and reports the
    dual bound. (OR-tools 9.15's ModelBuilder/pywraplp route to HiGHS adds rows one call
    at a time, seconds on 10^5 rows, reports the primal value as the bound, and crashes on
    a hint: hints go to SCIP only.) SCIP is given ``os.cpu_count()`` threads; HiGHS takes
    no thread count through MathOpt (its scheduler is process-wide and sizes itself from
    the machine), and its branch and bound is serial anyway.
    """
    if backend == "cbc":
        return _run_pywraplp(milp, time_limit_s, hint)
    from ortools.math_opt import callback_pb2, model_parameters_pb2, model_pb2, parameters_pb2, result_pb2
    from ortools.math_opt.core.python import solver as core_solver
    from ortools.util.python.pybind_solve_interrupter import PySolveInterrupter

    start = time.perf_counter()
    n = len(milp.lb)
    model = model_pb2.ModelProto()
    model.variables.ids.extend(range(n))
    model.variables.lower_bounds.extend(milp.lb.tolist())
    model.variables.upper_bounds.extend(milp.ub.tolist())
    model.variables.integers.extend([False] * n if relax else milp.integer.astype(bool).tolist())
    nz = np.nonzero(milp.obj)[0]
    model.objective.linear_coefficients.ids.extend(nz.tolist())
    model.objective.linear_coefficients.values.extend(milp.obj[nz].tolist())
    model.objective.offset = milp.offset
    m = len(milp.row_lb)
    model.linear_constraints.ids.extend(range(m))
    model.linear_constraints.lower_bounds.extend(milp.row_lb.tolist())
    model.linear_constraints.upper_bounds.extend(milp.row_ub.tolist())
    matrix = model.linear_constraint_matrix
    matrix.row_ids.extend(np.repeat(np.arange(m), np.diff(milp.indptr)).tolist())
    matrix.column_ids.extend(milp.indices.tolist())
    matrix.coefficients.extend(milp.data.tolist())
    # On models with millions of nonzeros the solvers take seconds to notice a stop and
    # return; leave them an allowance in proportion so that the caller's limit holds.
    time_limit_s -= min(0.25 * time_limit_s, 4e-6 * len(milp.data)) + (time.perf_counter() - start)
    params = parameters_pb2.SolveParametersProto()
    params.time_limit.FromNanoseconds(int(max(time_limit_s, _MIN_SOLVER_TIME_S) * 1e9))
    params.relative_gap_tolerance = _MIP_REL_GAP
    params.absolute_gap_tolerance = 0.0
    # Memory rows are in units of M; hold them to about MEMORY_RTOL rather than the default 1e-6.
    if backend == "highs":
        params.highs.double_options["primal_feasibility_tolerance"] = 1e-9
        params.highs.double_options["mip_feasibility_tolerance"] = 1e-9
    else:
        params.gscip.real_params["numerics/feastol"] = 1e-9
        params.threads = os.cpu_count() or 1
    if backend == "highs" and len(milp.data) > _HIGHS_LARGE_NNZ:
        # On models this size HiGHS's presolve (and the setup after it) and its central
        # rounding heuristic (an interior-point solve) each run for tens of seconds without
        # looking at the clock, so neither the time limit nor the interrupter can stop them;
        # presolve removes little from these problems. Without both, the first incumbent
        # (feasibility jump, randomized rounding) comes in seconds and the time limit holds.
        params.highs.string_options["presolve"] = "off"
        params.highs.double_options["mip_heuristic_effort"] = 0.0
    model_params = model_parameters_pb2.ModelSolveParametersProto()
    if backend == "scip" and hint is not None:
        h = model_params.solution_hints.add()
        h.variable_values.ids.extend(range(n))
        h.variable_values.values.extend(hint.tolist())
    kind = parameters_pb2.SOLVER_TYPE_HIGHS if backend == "highs" else parameters_pb2.SOLVER_TYPE_GSCIP
    # HiGHS checks its own limit only between steps that can take seconds on large models;
    # an interrupter fired by a timer stops it sooner. (SCIP keeps to its limit, and with an
    # interrupter OR-tools 9.15's SCIP wrapper prints an error from its event handler.)
    interrupter = timer = None
    if backend == "highs":
        interrupter = PySolveInterrupter()
        timer = threading.Timer(max(time_limit_s, _MIN_SOLVER_TIME_S), interrupter.interrupt)
        timer.daemon = True
        timer.start()
    try:
        res = core_solver.solve(
            model,
            kind,
            parameters_pb2.SolverInitializerProto(),
            params,
            model_params,
            None,
            callback_pb2.CallbackRegistrationProto(),
            None,
            interrupter,
        )
    except Exception as err:  # a solver error is reported, and the greedy answer stands
        logger.warning("solve: %s failed: %s", backend, err)
        return _SolverResult("ERROR", None, None, time.perf_counter() - start)
    finally:
        if timer is not None:
            timer.cancel()
    reason = result_pb2.TerminationReasonProto.Name(res.termination.reason).removeprefix(
        "TERMINATION_REASON_"
    )
    status = {"NO_SOLUTION_FOUND": "NOT_SOLVED"}.get(reason, reason)
    if relax:
        status = "LP_" + status  # the relaxation's status: its optimum bounds the MILP's
    values = None
    if res.solutions and res.solutions[0].HasField("primal_solution"):
        sol = res.solutions[0].primal_solution
        values = np.zeros(n)
        values[np.asarray(sol.variable_values.ids, dtype=np.int64)] = sol.variable_values.values
    bound = res.termination.objective_bounds.dual_bound
    bound = bound / milp.scale if math.isfinite(bound) else None
    return _SolverResult(status, values, bound, time.perf_counter() - start)


def _run_pywraplp(milp: _Milp, time_limit_s: float, hint: np.ndarray | None) -> _SolverResult:
    """CBC is reachable only through pywraplp; slower to build, used when forced or alone.

    No thread count is set: OR-tools' CBC is built without threads and rejects the option.
    """
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("CBC")
    inf = solver.infinity()
    xs = [
        solver.Var(lo, hi, bool(integral), "")
        for lo, hi, integral in zip(milp.lb.tolist(), milp.ub.tolist(), milp.integer.tolist(), strict=True)
    ]
    objective = solver.Objective()
    for j in np.nonzero(milp.obj)[0].tolist():
        objective.SetCoefficient(xs[j], float(milp.obj[j]))
    objective.SetOffset(milp.offset)
    indices, data = milp.indices.tolist(), milp.data.tolist()
    for r in range(len(milp.row_lb)):
        lo, hi = float(milp.row_lb[r]), float(milp.row_ub[r])
        ct = solver.RowConstraint(max(lo, -inf), min(hi, inf), "")
        for j in range(int(milp.indptr[r]), int(milp.indptr[r + 1])):
            ct.SetCoefficient(xs[indices[j]], data[j])
    if hint is not None:
        solver.SetHint(xs, hint.tolist())
    solver.SetTimeLimit(int(max(time_limit_s, _MIN_SOLVER_TIME_S) * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, _MIP_REL_GAP)
    start = time.perf_counter()
    code = solver.Solve(params)
    names = {
        pywraplp.Solver.OPTIMAL: "OPTIMAL",
        pywraplp.Solver.FEASIBLE: "FEASIBLE",
        pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
        pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
        pywraplp.Solver.ABNORMAL: "ABNORMAL",
        pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED",
    }
    status = names.get(code, str(code))
    values = np.array([x.solution_value() for x in xs]) if status in ("OPTIMAL", "FEASIBLE") else None
    bound = objective.BestBound() if status in ("OPTIMAL", "FEASIBLE") else None
    if bound is not None and not math.isfinite(bound):
        bound = None
    return _SolverResult(
        status, values, None if bound is None else bound / milp.scale, time.perf_counter() - start
    )


def _lp_seconds(nnz: int) -> float:
    """A rough guess of HiGHS's dual simplex time on these relaxations, 2 cores (measured:
    20 s at 6.3e5 nonzeros, over 115 s at 1.9e6): superlinear, as simplex iterations grow
    with the rows."""
    return 20.0 * (nnz / 6.3e5) ** 1.7


# -- the smallest peak memory --------------------------------------------------------------------


def _min_peak_memory(
    p: StrategyProblem, var_of_node: np.ndarray, members: list[list[int]], backend: str, time_limit_s: float
) -> tuple[float, bool]:
    """The smallest peak memory any choice reaches, and whether it is exact.

    Strategies with infinite node cost are excluded; edge costs, forbidden pairs included,
    are ignored, so where those pairs matter this is a lower bound on what would fit.

    Cheap in the usual case: when one strategy of a variable minimises the memory of all its
    nodes at once, that strategy is optimal for the peak, and the peak is the largest sum of
    per-node minima. Only groups whose members disagree need a small MILP over those groups.
    """
    n = len(p.node_costs)
    intervals = np.asarray(p.node_intervals, dtype=np.int64).reshape(n, 2)
    rows = memory_rows(intervals)
    if not rows.count:
        return 0.0, True
    allowed = []
    for vs in members:
        c = np.sum([np.asarray(p.node_costs[v], dtype=float) for v in vs], axis=0)
        allowed.append(np.nonzero(np.isfinite(c))[0] if np.isfinite(c).any() else np.arange(len(c)))
    active = np.nonzero(rows.r1 > rows.r0)[0]
    mem = {v: np.asarray(p.node_memory[v], dtype=float)[allowed[var_of_node[v]]] for v in active.tolist()}
    item_min = np.array([mem[v].min() for v in active.tolist()])
    floor = range_sums(rows.r0[active], rows.r1[active], item_min, rows.count)
    hard: list[int] = []
    for k, vs in enumerate(members):
        live = [mem[v] for v in vs if v in mem]
        if len(live) > 1:
            stack = np.stack(live)
            if not (stack == stack.min(axis=1, keepdims=True)).all(axis=0).any():
                hard.append(k)
    if not hard:
        return float(floor.max()), True
    # minimise P  s.t.  sum_s x_{k,s} = 1 (hard k),  floor_r + sum (m - min) x - P <= 0 (rows they touch)
    hard_set = set(hard)
    sizes = np.array([len(allowed[k]) for k in hard], dtype=np.int64)
    x0 = dict(zip(hard, np.concatenate([[0], np.cumsum(sizes)])[:-1].tolist(), strict=True))
    n_x = int(sizes.sum())
    r_list, c_list, v_list = [np.repeat(np.arange(len(hard)), sizes)], [np.arange(n_x)], [np.ones(n_x)]
    for t, v in enumerate(active.tolist()):
        k = int(var_of_node[v])
        if k in hard_set:
            coef = mem[v] - item_min[t]
            span = np.arange(rows.r0[v], rows.r1[v])
            r_list.append(len(hard) + np.repeat(span, len(coef)))
            c_list.append(np.tile(x0[k] + np.arange(len(coef)), len(span)))
            v_list.append(np.tile(coef, len(span)))
    r_all = np.concatenate(r_list + [len(hard) + np.arange(rows.count)])
    c_all = np.concatenate(c_list + [np.full(rows.count, n_x)])
    v_all = np.concatenate(v_list + [-np.ones(rows.count)])
    r_all, c_all, v_all = _merge_coo(r_all, c_all, v_all, n_x + 1)
    n_rows = len(hard) + rows.count
    milp = _Milp(
        lb=np.concatenate([np.zeros(n_x), [floor.max()]]),
        ub=np.concatenate([np.ones(n_x), [np.inf]]),
        obj=np.concatenate([np.zeros(n_x), [1.0]]),
        integer=np.concatenate([np.ones(n_x, dtype=bool), [False]]),
        row_lb=np.concatenate([np.ones(len(hard)), np.full(rows.count, -np.inf)]),
        row_ub=np.concatenate([np.ones(len(hard)), -floor]),
        indptr=np.concatenate([[0], np.cumsum(np.bincount(r_all, minlength=n_rows))]).astype(np.int64),
        indices=c_all,
        data=v_all,
        n_x=n_x,
    )
    result = _run_solver(milp, backend, time_limit_s, None)
    if result.values is not None:
        return float(result.values[n_x]), result.status == "OPTIMAL"
    return float(floor.max()), False


# -- the entry point -----------------------------------------------------------------------------


def _infeasible(
    p: StrategyProblem,
    reason: str,
    stats: dict,
    start: float,
    backend: str,
    var_of_node: np.ndarray,
    members: list[list[int]],
    time_limit_s: float,
) -> Solution:
    stats["infeasible_reason"] = reason
    message = f"no feasible strategy choice: {reason}"
    if p.memory_limit is not None and math.isfinite(p.memory_limit):
        peak, exact = _min_peak_memory(p, var_of_node, members, backend, max(time_limit_s, 1.0))
        stats["min_peak_memory"] = peak
        stats["min_peak_memory_exact"] = exact
        message += f"; the smallest memory that would fit is {peak:.6g} bytes"
    logger.info("solve: %s", message)
    return Solution([], math.inf, "infeasible", None, time.perf_counter() - start, backend, stats)


def _local_from_values(milp: _Milp, core: CoreProblem, values: np.ndarray) -> np.ndarray:
    sizes = core.sizes
    x0 = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    padded = np.full((core.n, int(sizes.max())), -np.inf)
    padded[np.repeat(np.arange(core.n), sizes), np.arange(milp.n_x) - np.repeat(x0[:-1], sizes)] = values[
        : milp.n_x
    ]
    return padded.argmax(axis=1)


def solve_strategies(
    problem: StrategyProblem,
    time_limit_s: float = 60.0,
    backend: str | None = None,
    *,
    reduce: bool = True,
    memory_form: str = "auto",
) -> Solution:
    """Choose a strategy per node minimising total cost under the memory limit (see module doc).

    ``backend`` forces "highs", "scip" or "cbc"; by default the first available in that order.
    ``reduce=False`` skips the graph reductions and ``memory_form`` ("auto", "direct",
    "cumulative") picks how memory rows are written: both exist to test that the
    alternatives agree. The time limit covers the whole call; when it stops the solver,
    the best answer found so far (at worst the greedy one) comes back as "feasible".
    """
    start = time.perf_counter()
    if not time_limit_s >= 0:
        raise ValueError(f"time_limit_s {time_limit_s} must be a non-negative number of seconds")
    if memory_form not in ("auto", "direct", "cumulative"):
        raise ValueError(f"memory_form {memory_form!r} is not one of auto, direct, cumulative")
    _validate(problem)
    name = _resolve_backend(backend)
    deadline = start + time_limit_s
    n = len(problem.node_costs)
    var_of_node, members = _group_vars(problem)
    limit = problem.memory_limit
    if limit is not None and math.isinf(limit):
        limit = None
    tol = MEMORY_RTOL * limit if limit is not None else 0.0
    costs, mats = _variable_graph(problem, var_of_node, members)
    rows = None
    if limit is not None:
        intervals = np.asarray(problem.node_intervals, dtype=np.int64).reshape(n, 2)
        rows = memory_rows(intervals, all_segments=not reduce)
    item_mem = [np.asarray(m, dtype=float) for m in problem.node_memory]

    def describe(k: int) -> str:
        vs = members[k]
        first = _node_label(problem, vs[0])
        return first if len(vs) == 1 else f"the group of {len(vs)} nodes with {first}"

    stats: dict = {
        "nodes": n,
        "edges": len(problem.edges),
        "variables": len(members),
        "strategies": int(sum(len(c) for c in costs)),
        "memory_rows": rows.count if rows is not None else 0,
    }
    reducer = Reducer(costs, mats.items(), var_of_node, item_mem, rows, limit, tol, describe)
    try:
        if reduce:
            reducer.run()
        else:
            reducer.refresh_memory(all_binding=True)
    except InfeasibleError as err:
        return _infeasible(
            problem, str(err), stats, start, name, var_of_node, members, deadline - time.perf_counter()
        )
    core = reducer.core()
    binding = len(core.cap)
    if reduce:
        core = prune_rows(core)
    stats.update(
        nodes_after_reduction=core.n,
        factors_after_reduction=len(core.factors),
        strategies_after_reduction=int(core.sizes.sum()),
        binding_memory_rows=binding,
        memory_rows_after_reduction=len(core.cap),
        reduce_time_s=time.perf_counter() - start,
    )

    def finish(local: np.ndarray) -> tuple[list[int], float, float | None] | None:
        choice = reducer.expand(core, local)[var_of_node].tolist()
        objective = _objective(problem, choice)
        peak = _peak_memory(problem, choice) if limit is not None else None
        if not math.isfinite(objective) or (peak is not None and peak > limit + tol):
            return None
        return choice, objective, peak

    def answer(
        best: tuple[list[int], float, float | None], status: str, gap: float | None, used: str
    ) -> Solution:
        stats["peak_memory"] = best[2] if best[2] is not None else _peak_memory(problem, best[0])
        elapsed = time.perf_counter() - start
        logger.info(
            "solve: %d nodes -> %d after reduction, %s objective %.6g (gap %s) by %s in %.2f s",
            n,
            core.n,
            status,
            best[1],
            "n/a" if gap is None else f"{gap:.2e}",
            used,
            elapsed,
        )
        return Solution(best[0], best[1], status, gap, elapsed, used, stats)

    if core.n == 0:
        best = finish(np.zeros(0, dtype=np.int64))
        if best is None:
            raise RuntimeError(
                "reduction settled every node but the answer does not check out; please report"
            )
        return answer(best, "optimal", 0.0, "reduction")

    greedy_start = time.perf_counter()
    greedy = _Greedy(core, tol).run(deadline)
    best = finish(greedy) if greedy is not None else None
    stats["greedy_time_s"] = time.perf_counter() - greedy_start

    milp = None
    skip_solver = deadline - time.perf_counter() < _MIN_SOLVER_TIME_S
    if not skip_solver:
        build_start = time.perf_counter()
        milp = _build_milp(core, limit if limit else 1.0, memory_form)
        rows_, cols_, nnz_ = milp.shape
        stats.update(
            milp_constraints=rows_, milp_variables=cols_, milp_nonzeros=nnz_, memory_form=milp.memory_form
        )
        stats["build_time_s"] = time.perf_counter() - build_start
        # Past this size HiGHS's branch and bound cannot be held to the time limit (its root
        # waits on an interior-point "analytic centre" solve that no limit or interrupt stops,
        # tens of seconds here): solve the LP relaxation instead, round it, repair it; and
        # when even that cannot finish in the time left, do not start it.
        relax = name == "highs" and nnz_ > _HIGHS_MIP_MAX_NNZ
        skip_solver = relax and _lp_seconds(nnz_) > deadline - time.perf_counter()
        stats["relaxation_only"] = relax

    # Memory priced into exact eliminations: a quarter of the time left, or all of it when
    # the solver will not run.
    priced_start = time.perf_counter()
    share = 1.0 if skip_solver else 0.25
    priced, priced_bound = _priced(core, tol, priced_start + share * (deadline - priced_start))
    stats["priced_bound"] = priced_bound
    if priced is not None:
        priced = _Greedy(core, tol).run(deadline, start=priced)
        found = finish(priced) if priced is not None else None
        stats["priced_objective"] = found[1] if found is not None else None
        if found is not None and (best is None or found[1] < best[1]):
            best, greedy = found, priced
    stats["greedy_objective"] = best[1] if best is not None else None
    stats["priced_time_s"] = time.perf_counter() - priced_start

    result = None
    proved = True
    if milp is not None and not skip_solver and deadline - time.perf_counter() >= _MIN_SOLVER_TIME_S:
        hint = _hint_values(milp, core, greedy) if best is not None and name != "highs" else None
        result = _run_solver(milp, name, deadline - time.perf_counter(), hint, relax=relax)
        stats.update(solver_status=result.status, solver_time_s=result.wall_s, best_bound=result.bound)
        if result.values is not None:
            local = _local_from_values(milp, core, result.values)
            x = result.values[: milp.n_x]
            if relax and np.abs(x - np.round(x)).max() > 1e-9:
                proved = False
                local = _Greedy(core, tol).run(deadline, start=local)
            found = finish(local) if local is not None else None
            if found is None:
                # Within the solver's tolerance but over the limit by more than MEMORY_RTOL once
                # rounded: nudge it back under with the greedy repair, and claim no optimality.
                logger.warning("solve: the %s answer overflows memory after rounding; repairing it", name)
                repaired = _Greedy(core, tol).run(deadline, start=local)
                found = finish(repaired) if repaired is not None else None
                proved = False
            if found is not None and (best is None or found[1] <= best[1]):
                best = found
    if best is None:
        if result is not None and result.status == "INFEASIBLE":
            reason = f"{name} proved that no choice fits the memory limit and avoids the forbidden strategies"
            return _infeasible(problem, reason, stats, start, name, var_of_node, members, 10.0)
        logger.warning("solve: no feasible answer found within %.3g s", time_limit_s)
        return Solution([], math.inf, "unknown", None, time.perf_counter() - start, name, stats)
    if proved and result is not None and result.status in ("OPTIMAL", "LP_OPTIMAL"):
        return answer(best, "optimal", 0.0, name)
    if result is not None and result.status == "INFEASIBLE":
        logger.warning("solve: %s reports infeasible but the greedy answer fits; returning it", name)
    gap = None
    bounds = [b for b in (result.bound if result is not None else None, priced_bound) if b is not None]
    if bounds:
        gap = max(0.0, (best[1] - max(bounds)) / (abs(best[1]) or 1.0))
    return answer(best, "feasible", gap, name if result is not None else "greedy")
