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
between ``u``'s output and ``v``'s input). A node may hold memory over more than one
interval (*memory items* ``i`` of node ``v_i``, live over ``[start_i, end_i)``, holding
``m_i[s]`` under strategy ``s`` of ``v_i``; a node's own output is its first item).
With an optional memory limit ``M``::

    minimise    sum_v c_v[s_v] + sum_(u,v) E_uv[s_u, s_v]
    subject to  sum_{i : start_i <= t < end_i} m_i[s_{v_i}] <= M      for every t
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
:mod:`autopar.solver.reduce`); it gets one ``y`` per joint strategy and the
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
1. Validate (:mod:`autopar.solver.validate`), merge groups into shared
   variables, merge parallel edges.
2. Reduce exactly (:mod:`autopar.solver.reduce`): forbidden and dominated
   strategies, separable edges, fixed variables, and elimination of variables whose
   memory cannot matter. Without a memory limit this alone solves transformer-shaped
   training graphs of tens of thousands of nodes.
3. Heuristic answers on what is left (:mod:`autopar.solver.heuristics`): greedy
   (best response in order, memory repair cheapest cost per byte first, local
   improvement), and with a memory limit a Lagrangian one (memory priced into the
   costs, each priced problem solved exactly by elimination, the price searched until
   the answer fits), which also gives a lower bound. The best is the hint for SCIP and
   the fallback whenever the solver returns nothing better in time.
4. The MILP, built as arrays (:mod:`autopar.solver.milp`), through MathOpt for
   HiGHS and SCIP (one ``ModelProto`` filled from the arrays) or pywraplp for CBC
   (:mod:`autopar.solver.backends`), with the time that is left; a timer
   interrupts HiGHS at the deadline. Beyond ``HIGHS_MIP_MAX_NNZ`` nonzeros HiGHS's
   branch and bound cannot be held to a time limit (see ``solve_strategies``), so only
   the LP relaxation is solved there, then rounded and repaired; its optimum is the
   bound.
5. The answer is mapped back through the reductions and checked on the original
   problem: objective recomputed, peak memory verified.

This module keeps the public types and the entry point, :func:`solve_strategies`, which
runs the pipeline; each step lives in the module named beside it.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from autopar.core.heap import long_lived_heap
from autopar.solver.backends import (
    HIGHS_MIP_MAX_NNZ,
    MIN_SOLVER_TIME_S,
    lp_seconds,
    resolve_backend,
    run_solver,
)
from autopar.solver.bound import diffusion_bound
from autopar.solver.heuristics import Greedy, priced_answer
from autopar.solver.milp import Milp, build_milp, hint_values, merge_coo, milp_nonzeros_at_least
from autopar.solver.problem import MEMORY_RTOL, Solution, StrategyProblem
from autopar.solver.reduce import (
    CoreProblem,
    InfeasibleError,
    Reducer,
    memory_rows,
    prune_rows,
    range_sums,
)
from autopar.solver.validate import node_label, validate

logger = logging.getLogger(__name__)

MIN_PEAK_MAX_NNZ = 20_000_000
"""Above this many nonzeros the smallest-peak MILP is not built: its lower bound is returned instead."""


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
    # repeated layers share cost lists: each list is converted once
    vectors: dict[int, np.ndarray] = {}

    def vector(row: list[float]) -> np.ndarray:
        got = vectors.get(id(row))
        if got is None:
            got = vectors[id(row)] = np.asarray(row, dtype=float)
        return got

    costs = [np.sum([vector(p.node_costs[v]) for v in vs], axis=0) for vs in members]
    mats: dict[tuple[int, int], np.ndarray] = {}
    arrays: dict[tuple[int, int, int], np.ndarray] = {}
    var_of = var_of_node.tolist()
    sizes = [len(c) for c in p.node_costs]
    for e, (u, v) in enumerate(p.edges):
        a, b = var_of[u], var_of[v]
        shape = (sizes[u], sizes[v])
        m = arrays.get((id(p.edge_costs[e]), *shape))
        if m is None:
            m = arrays[(id(p.edge_costs[e]), *shape)] = np.asarray(p.edge_costs[e], dtype=float).reshape(
                shape
            )
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
    nodes, iv, item_mem = p.items()
    mem = np.array([m[choice[v]] for v, m in zip(nodes.tolist(), item_mem, strict=True)], dtype=float)
    live = iv[:, 1] > iv[:, 0]
    if not live.any():
        return 0.0
    horizon = int(iv[live, 1].max())
    delta = np.bincount(iv[live, 0], mem[live], minlength=horizon + 1)
    delta -= np.bincount(iv[live, 1], mem[live], minlength=horizon + 1)
    return float(max(np.cumsum(delta[:horizon]).max(), 0.0))


# -- the smallest peak memory --------------------------------------------------------------------


def _min_peak_memory(
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
    allowed = []
    for vs in members:
        c = np.sum([np.asarray(p.node_costs[v], dtype=float) for v in vs], axis=0)
        allowed.append(np.nonzero(np.isfinite(c))[0] if np.isfinite(c).any() else np.arange(len(c)))
    active = np.nonzero(rows.r1 > rows.r0)[0]
    mem = {i: np.asarray(item_memory[i], dtype=float)[allowed[item_var[i]]] for i in active.tolist()}
    item_min = np.array([mem[i].min() for i in active.tolist()])
    floor = range_sums(rows.r0[active], rows.r1[active], item_min, rows.count)
    items_of_var: list[list[int]] = [[] for _ in members]
    for i in mem:
        items_of_var[item_var[i]].append(i)
    hard: list[int] = []
    for k in range(len(members)):
        live = [mem[i] for i in items_of_var[k]]
        if len(live) > 1:
            stack = np.stack(live)
            if not (stack == stack.min(axis=1, keepdims=True)).all(axis=0).any():
                hard.append(k)
    if not hard:
        return float(floor.max()), True
    if not exact:
        return float(floor.max()), False
    # minimise P  s.t.  sum_s x_{k,s} = 1 (hard k),  floor_r + sum (m - min) x - P <= 0 (rows they touch)
    hard_set = set(hard)
    nonzeros = sum(
        int(rows.r1[i] - rows.r0[i]) * len(mem[i]) for i in active.tolist() if int(item_var[i]) in hard_set
    )
    if nonzeros > MIN_PEAK_MAX_NNZ:  # its rows would not fit in memory (a 70B graph: tens of GB)
        return float(floor.max()), False
    sizes = np.array([len(allowed[k]) for k in hard], dtype=np.int64)
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
    milp = Milp(
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
    result = run_solver(milp, backend, time_limit_s, None)
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
    exact_peak: bool = True,
) -> Solution:
    stats["infeasible_reason"] = reason
    message = f"no feasible strategy choice: {reason}"
    if p.memory_limit is not None and math.isfinite(p.memory_limit):
        peak, exact = _min_peak_memory(
            p, var_of_node, members, backend, max(time_limit_s, 1.0), exact=exact_peak
        )
        stats["min_peak_memory"] = peak
        stats["min_peak_memory_exact"] = exact
        message += f"; the smallest memory that would fit is {peak:.6g} bytes"
    logger.info("solve: %s", message)
    return Solution([], math.inf, "infeasible", None, time.perf_counter() - start, backend, stats)


def _local_from_values(milp: Milp, core: CoreProblem, values: np.ndarray) -> np.ndarray:
    sizes = core.sizes
    x0 = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    padded = np.full((core.n, int(sizes.max())), -np.inf)
    padded[np.repeat(np.arange(core.n), sizes), np.arange(milp.n_x) - np.repeat(x0[:-1], sizes)] = values[
        : milp.n_x
    ]
    return padded.argmax(axis=1)


@long_lived_heap()
def solve_strategies(
    problem: StrategyProblem,
    time_limit_s: float = 60.0,
    backend: str | None = None,
    *,
    reduce: bool = True,
    memory_form: str = "auto",
    bound: bool = True,
    exact_peak: bool = True,
) -> Solution:
    """Choose a strategy per node minimising total cost under the memory limit (see module doc).

    ``backend`` forces "highs", "scip" or "cbc"; by default the first available in that order.
    ``reduce=False`` skips the graph reductions and ``memory_form`` ("auto", "direct",
    "cumulative") picks how memory rows are written: both exist to test that the
    alternatives agree. The time limit covers the whole call; when it stops the solver,
    the best answer found so far (at worst the greedy one) comes back as "feasible".
    When neither the solver nor memory pricing gives a lower bound, one comes from
    :mod:`autopar.solver.bound` for the gap; ``bound=False`` skips that (the answer
    is the same), for callers that only compare answers by their cost. The bound behind
    the gap is ``stats["lower_bound"]``. When nothing fits, ``stats["min_peak_memory"]`` is
    the smallest peak any choice reaches; ``exact_peak=False`` makes it a cheap lower bound
    instead (``stats["min_peak_memory_exact"]`` says which), for callers that only need to
    know whether fewer activations could fit.
    """
    start = time.perf_counter()
    if not time_limit_s >= 0:
        raise ValueError(f"time_limit_s {time_limit_s} must be a non-negative number of seconds")
    if memory_form not in ("auto", "direct", "cumulative"):
        raise ValueError(f"memory_form {memory_form!r} is not one of auto, direct, cumulative")
    validate(problem)
    name = resolve_backend(backend)
    deadline = start + time_limit_s
    n = len(problem.node_costs)
    var_of_node, members = _group_vars(problem)
    limit = problem.memory_limit
    if limit is not None and math.isinf(limit):
        limit = None
    tol = MEMORY_RTOL * limit if limit is not None else 0.0
    costs, mats = _variable_graph(problem, var_of_node, members)
    item_node, intervals, item_memory = problem.items()
    rows = memory_rows(intervals, all_segments=not reduce) if limit is not None else None
    item_mem = [np.asarray(m, dtype=float) for m in item_memory]

    def describe(k: int) -> str:
        vs = members[k]
        first = node_label(problem, vs[0])
        return first if len(vs) == 1 else f"the group of {len(vs)} nodes with {first}"

    stats: dict = {
        "nodes": n,
        "edges": len(problem.edges),
        "variables": len(members),
        "strategies": int(sum(len(c) for c in costs)),
        "memory_rows": rows.count if rows is not None else 0,
    }
    reducer = Reducer(costs, mats.items(), var_of_node[item_node], item_mem, rows, limit, tol, describe)
    try:
        if reduce:
            reducer.run()
        else:
            reducer.refresh_memory(all_binding=True)
    except InfeasibleError as err:
        left = deadline - time.perf_counter()
        return _infeasible(problem, str(err), stats, start, name, var_of_node, members, left, exact_peak)
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
        stats["lower_bound"] = best[1]
        return answer(best, "optimal", 0.0, "reduction")

    greedy_start = time.perf_counter()
    greedy = Greedy(core, tol).run(deadline)
    best = finish(greedy) if greedy is not None else None
    stats["greedy_time_s"] = time.perf_counter() - greedy_start

    milp = None
    skip_solver = deadline - time.perf_counter() < MIN_SOLVER_TIME_S
    if not skip_solver and name == "highs":
        # The MILP has at least the nonzeros of its rows without memory: when even those are past
        # what HiGHS can take on in the time left (see below), the MILP is not built at all.
        least = milp_nonzeros_at_least(core)
        if least > HIGHS_MIP_MAX_NNZ and lp_seconds(least) > deadline - time.perf_counter():
            skip_solver = True
            stats.update(relaxation_only=True, milp_nonzeros_at_least=least)
    if not skip_solver:
        build_start = time.perf_counter()
        milp = build_milp(core, limit if limit else 1.0, memory_form)
        rows_, cols_, nnz_ = milp.shape
        stats.update(
            milp_constraints=rows_, milp_variables=cols_, milp_nonzeros=nnz_, memory_form=milp.memory_form
        )
        stats["build_time_s"] = time.perf_counter() - build_start
        # Past this size HiGHS's branch and bound cannot be held to the time limit (its root
        # waits on an interior-point "analytic centre" solve that no limit or interrupt stops,
        # tens of seconds here): solve the LP relaxation instead, round it, repair it; and
        # when even that cannot finish in the time left, do not start it.
        relax = name == "highs" and nnz_ > HIGHS_MIP_MAX_NNZ
        skip_solver = relax and lp_seconds(nnz_) > deadline - time.perf_counter()
        stats["relaxation_only"] = relax

    # Memory priced into exact eliminations: a quarter of the time left, or all of it when
    # the solver will not run.
    priced_start = time.perf_counter()
    share = 1.0 if skip_solver else 0.25
    priced, priced_bound = priced_answer(core, tol, priced_start + share * (deadline - priced_start))
    stats["priced_bound"] = priced_bound
    if priced is not None:
        priced = Greedy(core, tol).run(deadline, start=priced)
        found = finish(priced) if priced is not None else None
        stats["priced_objective"] = found[1] if found is not None else None
        if found is not None and (best is None or found[1] < best[1]):
            best, greedy = found, priced
    stats["greedy_objective"] = best[1] if best is not None else None
    stats["priced_time_s"] = time.perf_counter() - priced_start

    result = None
    proved = True
    if milp is not None and not skip_solver and deadline - time.perf_counter() >= MIN_SOLVER_TIME_S:
        hint = hint_values(milp, core, greedy) if best is not None and name != "highs" else None
        result = run_solver(milp, name, deadline - time.perf_counter(), hint, relax=relax)
        stats.update(solver_status=result.status, solver_time_s=result.wall_s, best_bound=result.bound)
        if result.values is not None:
            local = _local_from_values(milp, core, result.values)
            x = result.values[: milp.n_x]
            if relax and np.abs(x - np.round(x)).max() > 1e-9:
                proved = False
                local = Greedy(core, tol).run(deadline, start=local)
            found = finish(local) if local is not None else None
            if found is None:
                # Within the solver's tolerance but over the limit by more than MEMORY_RTOL once
                # rounded: nudge it back under with the greedy repair, and claim no optimality.
                logger.warning("solve: the %s answer overflows memory after rounding; repairing it", name)
                repaired = Greedy(core, tol).run(deadline, start=local)
                found = finish(repaired) if repaired is not None else None
                proved = False
            if found is not None and (best is None or found[1] <= best[1]):
                best = found
    if best is None:
        if result is not None and result.status == "INFEASIBLE":
            reason = f"{name} proved that no choice fits the memory limit and avoids the forbidden strategies"
            return _infeasible(problem, reason, stats, start, name, var_of_node, members, 10.0, exact_peak)
        logger.warning("solve: no feasible answer found within %.3g s", time_limit_s)
        return Solution([], math.inf, "unknown", None, time.perf_counter() - start, name, stats)
    if proved and result is not None and result.status in ("OPTIMAL", "LP_OPTIMAL"):
        stats["lower_bound"] = best[1]
        return answer(best, "optimal", 0.0, name)
    if result is not None and result.status == "INFEASIBLE":
        logger.warning("solve: %s reports infeasible but the greedy answer fits; returning it", name)
    gap = None
    bounds = [b for b in (result.bound if result is not None else None, priced_bound) if b is not None]
    if not bounds and bound:
        # the LP relaxation's dual, approached by diffusion: a tenth of the time left at most
        bound_start = time.perf_counter()
        bounds.append(diffusion_bound(core, bound_start + 0.1 * max(deadline - bound_start, 0.0)))
        stats["diffusion_bound"] = bounds[-1]
        stats["bound_time_s"] = time.perf_counter() - bound_start
    if bounds:
        stats["lower_bound"] = max(bounds)
        gap = max(0.0, (best[1] - max(bounds)) / (abs(best[1]) or 1.0))
    return answer(best, "feasible", gap, name if result is not None else "greedy")


def lower_bound(problem: StrategyProblem, time_limit_s: float = 1.0) -> float:
    """A lower bound on the optimum of ``problem`` without solving it (memory ignored).

    The exact reductions of the cost alone (:mod:`autopar.solver.reduce`, no
    memory rows), then min-sum diffusion on what they leave
    (:mod:`autopar.solver.bound`) for at most ``time_limit_s``. Dropping the
    memory limit only lowers the optimum, so the bound holds for every memory limit
    and every number of micro-batches. Infinite when no choice avoids the forbidden
    strategies.
    """
    start = time.perf_counter()
    validate(problem)
    var_of_node, members = _group_vars(problem)
    costs, mats = _variable_graph(problem, var_of_node, members)
    reducer = Reducer(costs, mats.items(), np.zeros(0, dtype=np.int64), [], None, None, 0.0, str)
    try:
        reducer.run()
    except InfeasibleError:
        return math.inf
    return diffusion_bound(reducer.core(), start + time_limit_s)
