"""The smallest peak memory any choice reaches: what a solve reports when nothing fits.

A caller told that no choice fits the memory limit wants to know by how much
(fewer activations, more devices, a larger ZeRO stage): this is the limit that
would have fitted, exact where a small MILP settles it, a lower bound otherwise.
"""

from __future__ import annotations

import numpy as np

from autopar.solver.backends import run_solver
from autopar.solver.memory_rows import MemoryRows, memory_rows, range_sums
from autopar.solver.milp import Milp, merge_coo
from autopar.solver.problem import StrategyProblem

MIN_PEAK_MAX_NNZ = 20_000_000
"""Above this many nonzeros the smallest-peak MILP is not built: its lower bound is returned instead."""


def min_peak_memory(
    p: StrategyProblem,
    var_of_node: np.ndarray,
    members: list[list[int]],
    backend: str,
    time_limit_s: float,
    exact: bool = True,
) -> tuple[float, bool]:
    """The smallest peak memory any choice reaches, and whether it is exact.

    Strategies with infinite node cost are excluded; edge costs, forbidden pairs included,
    are ignored, so where those pairs matter this is a lower bound on what would fit.

    Cheap in the usual case: when one strategy of a variable minimises the memory of all its
    nodes at once, that strategy is optimal for the peak, and the peak is the largest sum of
    per-node minima. Only groups whose members disagree need a small MILP over those groups;
    ``exact=False`` skips it and returns that largest sum, a lower bound (its MILP holds every
    row a long-lived item touches, seconds on a 7B training graph).
    """
    item_node, intervals, item_memory = p.items()
    item_var = var_of_node[item_node]
    rows = memory_rows(intervals)
    if not rows.count:
        return 0.0, True
    allowed = _allowed_strategies(p, members)
    active = np.nonzero(rows.r1 > rows.r0)[0]
    mem = {i: np.asarray(item_memory[i], dtype=float)[allowed[item_var[i]]] for i in active.tolist()}
    item_min = np.array([mem[i].min() for i in active.tolist()])
    floor = range_sums(rows.r0[active], rows.r1[active], item_min, rows.count)
    hard = _disagreeing_variables(mem, item_var, len(members))
    if not hard:
        return float(floor.max()), True
    if not exact:
        return float(floor.max()), False
    hard_set = set(hard)
    nonzeros = sum(
        int(rows.r1[i] - rows.r0[i]) * len(mem[i]) for i in active.tolist() if int(item_var[i]) in hard_set
    )
    if nonzeros > MIN_PEAK_MAX_NNZ:  # its rows would not fit in memory (a 70B graph: tens of GB)
        return float(floor.max()), False
    sizes = np.array([len(allowed[k]) for k in hard], dtype=np.int64)
    milp = _peak_milp(rows, active, item_var, mem, item_min, floor, hard, sizes)
    result = run_solver(milp, backend, time_limit_s, None)
    if result.values is not None:
        return float(result.values[milp.n_x]), result.status == "OPTIMAL"
    return float(floor.max()), False


def _allowed_strategies(p: StrategyProblem, members: list[list[int]]) -> list[np.ndarray]:
    """Per variable, the strategies of finite cost (all of them when none is finite)."""
    allowed = []
    for vs in members:
        c = np.sum([np.asarray(p.node_costs[v], dtype=float) for v in vs], axis=0)
        allowed.append(np.nonzero(np.isfinite(c))[0] if np.isfinite(c).any() else np.arange(len(c)))
    return allowed


def _disagreeing_variables(mem: dict[int, np.ndarray], item_var: np.ndarray, n_vars: int) -> list[int]:
    """The variables with no one strategy that minimises the memory of all their live items."""
    items_of_var: list[list[int]] = [[] for _ in range(n_vars)]
    for i in mem:
        items_of_var[item_var[i]].append(i)
    hard: list[int] = []
    for k in range(n_vars):
        live = [mem[i] for i in items_of_var[k]]
        if len(live) > 1:
            stack = np.stack(live)
            if not (stack == stack.min(axis=1, keepdims=True)).all(axis=0).any():
                hard.append(k)
    return hard


def _peak_milp(
    rows: MemoryRows,
    active: np.ndarray,
    item_var: np.ndarray,
    mem: dict[int, np.ndarray],
    item_min: np.ndarray,
    floor: np.ndarray,
    hard: list[int],
    sizes: np.ndarray,
) -> Milp:
    """minimise P  s.t.  sum_s x_{k,s} = 1 (hard k),  floor_r + sum (m - min) x - P <= 0 (rows they touch)."""
    hard_set = set(hard)
    x0 = dict(zip(hard, np.concatenate([[0], np.cumsum(sizes)])[:-1].tolist(), strict=True))
    n_x = int(sizes.sum())
    r_list, c_list, v_list = [np.repeat(np.arange(len(hard)), sizes)], [np.arange(n_x)], [np.ones(n_x)]
    for t, i in enumerate(active.tolist()):
        k = int(item_var[i])
        if k in hard_set:
            coef = mem[i] - item_min[t]
            span = np.arange(rows.r0[i], rows.r1[i])
            r_list.append(len(hard) + np.repeat(span, len(coef)))
            c_list.append(np.tile(x0[k] + np.arange(len(coef)), len(span)))
            v_list.append(np.tile(coef, len(span)))
    r_all = np.concatenate(r_list + [len(hard) + np.arange(rows.count)])
    c_all = np.concatenate(c_list + [np.full(rows.count, n_x)])
    v_all = np.concatenate(v_list + [-np.ones(rows.count)])
    r_all, c_all, v_all = merge_coo(r_all, c_all, v_all, n_x + 1)
    n_rows = len(hard) + rows.count
    return Milp(
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
