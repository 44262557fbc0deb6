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
   variables, merge parallel edges (:mod:`autopar.solver.variables`).
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
   branch and bound cannot be held to a time limit (see ``_Run.planned_milp``), so only
   the LP relaxation is solved there, with ``LARGE_MILP_SHARE`` of the time left, then
   rounded and repaired; its optimum is the bound. The reductions stop at
   ``REDUCE_SHARE`` of the budget, leaving a larger but exact problem.
5. Anytime improvement: while time is left and the answer is not proven optimal nor
   within ``GAP_TARGET`` (1%, or the caller's ``target_gap``) of the best lower bound (the solver's, the priced one's,
   or min-sum diffusion's), large neighbourhood search (:mod:`autopar.solver.lns`)
   improves it by exact sub-MILPs over a few variables at a time, the others fixed.
   When greedy and pricing find nothing that fits, the search starts from a choice
   built by arc consistency with memory as its cost. ``Solution.stats`` records the
   budget, the time used and why the solve stopped.
6. The answer is mapped back through the reductions and checked on the original
   problem: objective recomputed, peak memory verified (:mod:`autopar.solver.evaluate`).
   When nothing fits, the smallest peak memory any choice reaches is reported
   (:mod:`autopar.solver.min_peak`).

This module keeps the public types and the entry point, :func:`solve_strategies`, which
runs the pipeline; each step lives in the module named beside it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time

import numpy as np

from autopar.core.heap import long_lived_heap
from autopar.solver.backends import (
    HIGHS_MIP_MAX_NNZ,
    MIN_SOLVER_TIME_S,
    SolverResult,
    lp_seconds,
    resolve_backend,
    run_solver,
)
from autopar.solver.bound import diffusion_bound
from autopar.solver.core_problem import CoreProblem, InfeasibleError
from autopar.solver.evaluate import objective_of, peak_memory_of
from autopar.solver.heuristics import Greedy, least_memory_start, priced_answer
from autopar.solver.lns import improve
from autopar.solver.memory_rows import memory_rows
from autopar.solver.milp import Milp, build_milp, hint_values, milp_nonzeros_at_least
from autopar.solver.min_peak import min_peak_memory
from autopar.solver.problem import GAP_TARGET, MEMORY_RTOL, PROVED_GAP, Solution, SolverStats, StrategyProblem
from autopar.solver.prune_rows import prune_rows
from autopar.solver.reduce import ELIMINATION_LIMIT, PROBE_ELIMINATION_LIMIT, Reducer
from autopar.solver.validate import node_label, validate
from autopar.solver.variables import group_vars, variable_graph

logger = logging.getLogger(__name__)

MEMORY_FREE_SHARE = 0.5
"""Step 0 (the problem without its memory limit) stops at this share of the budget."""

REDUCE_SHARE = 0.6
"""The reductions stop at this share of the budget; what they leave undone the later steps take on."""

LARGE_MILP_SHARE = 0.6
"""When only the whole MILP's relaxation can be solved, it gets this share of the time left
(and is not started when it would need more), and the neighbourhood search the rest; a
MILP that HiGHS branches on gets all of it, being anytime itself."""

Best = tuple[list[int], float, "float | None"]
"""An answer on the original problem: a strategy per node, its objective, its peak memory."""


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
    start: list[int] | None = None,
    target_gap: float = GAP_TARGET,
) -> Solution:
    """Choose a strategy per node minimising total cost under the memory limit (see module doc).

    ``start`` is a known answer (a strategy per node, say a hand-set layout's): the
    search starts from it, so the answer returned costs no more than it when it fits.

    ``backend`` forces "highs", "scip" or "cbc"; by default the first available in that order.
    ``reduce=False`` skips the graph reductions and ``memory_form`` ("auto", "direct",
    "cumulative") picks how memory rows are written: both exist to test that the
    alternatives agree. The time limit covers the whole call. The call is anytime: until
    the answer is proven optimal or within ``target_gap`` of a lower bound, the time left
    goes to improving it (the MILP, then large neighbourhood search); when time runs out
    the best answer found comes back as "feasible". ``stats.stop_reason`` says which
    happened, ``stats.used_s`` how much of ``stats.budget_s`` it took.
    When neither the solver nor memory pricing gives a lower bound, one comes from
    :mod:`autopar.solver.bound` for the gap; ``bound=False`` skips that unless the search
    needs it to know when to stop (the answer is the same), for callers that only compare
    answers by their cost. The bound behind the gap is ``stats.lower_bound``. When nothing
    fits, ``stats.min_peak_memory`` is the smallest peak any choice reaches;
    ``exact_peak=False`` makes it a cheap lower bound instead (``stats.min_peak_memory_exact``
    says which), for callers that only need to know whether fewer activations could fit.
    """
    if not time_limit_s >= 0:
        raise ValueError(f"time_limit_s {time_limit_s} must be a non-negative number of seconds")
    if memory_form not in ("auto", "direct", "cumulative"):
        raise ValueError(f"memory_form {memory_form!r} is not one of auto, direct, cumulative")
    if start is not None and len(start) != len(problem.node_costs):
        raise ValueError(f"start has {len(start)} strategies for {len(problem.node_costs)} nodes")
    if not 0.0 <= target_gap < 1.0:
        raise ValueError(f"target_gap {target_gap} must be in [0, 1)")
    run = _Run(problem, time_limit_s, backend, reduce, memory_form, bound, exact_peak)
    run.target_gap = target_gap
    run.starts = [list(start)] if start is not None else []
    return run.run()


class _Run:
    """One call of :func:`solve_strategies`: the problem, the clock, the stats, and the steps in order."""

    def __init__(
        self,
        problem: StrategyProblem,
        time_limit_s: float,
        backend: str | None,
        reduce: bool,
        memory_form: str,
        bound: bool,
        exact_peak: bool,
    ) -> None:
        self.start = time.perf_counter()
        validate(problem)
        self.problem, self.budget, self.deadline = problem, time_limit_s, self.start + time_limit_s
        self.reduce, self.memory_form, self.bound, self.exact_peak = reduce, memory_form, bound, exact_peak
        self.name = resolve_backend(backend)
        self.var_of_node, self.members = group_vars(problem)
        limit = problem.memory_limit
        self.limit = None if limit is None or math.isinf(limit) else limit
        self.tol = MEMORY_RTOL * self.limit if self.limit is not None else 0.0
        self.costs, self.mats = variable_graph(problem, self.var_of_node, self.members)
        item_node, intervals, item_memory = problem.items()
        self.rows = memory_rows(intervals, all_segments=not reduce) if self.limit is not None else None
        self.item_var = self.var_of_node[item_node]
        self.item_mem = [np.asarray(m, dtype=float) for m in item_memory]
        self.starts: list[list[int]] = []  # known answers to start from (a strategy per node)
        self.target_gap = GAP_TARGET
        self.elimination_limit = ELIMINATION_LIMIT
        self.probe = False  # step 0: the reductions, heuristics and a bound only
        self.stats = SolverStats(
            nodes=len(problem.node_costs),
            edges=len(problem.edges),
            variables=len(self.members),
            strategies=int(sum(len(c) for c in self.costs)),
            memory_rows=self.rows.count if self.rows is not None else 0,
            budget_s=time_limit_s,
        )

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def describe(self, k: int) -> str:
        vs = self.members[k]
        first = node_label(self.problem, vs[0])
        return first if len(vs) == 1 else f"the group of {len(vs)} nodes with {first}"

    def run(self) -> Solution:
        """The pipeline of the module doc, one step a method."""
        if self.limit is not None and self.reduce and self.budget > 0:
            free = self.memory_free()
            if free is not None:
                return free
        infeasible = self.reduced()
        if infeasible is not None:
            return infeasible
        if self.core.n == 0:
            best = self.finish(np.zeros(0, dtype=np.int64))
            if best is None:
                raise RuntimeError("reduction settled every node but the answer does not check out; please report")
            self.stats.lower_bound = best[1]
            return self.answer(best, "optimal", 0.0, "reduction", "optimal")
        milp, relax, skip = (None, False, True) if self.probe else self.planned_milp()
        best, local = self.heuristics(skip)
        best, local = self.from_starts(best, local)
        result, proved = None, True
        if milp is not None and not skip and self.left() >= MIN_SOLVER_TIME_S:
            best, local, result, proved = self.whole_milp(milp, relax, best, local)
        if best is None and result is not None and result.status == "INFEASIBLE":
            reason = f"{self.name} proved that no choice fits the memory limit and avoids the forbidden strategies"
            return self.infeasible(reason, 10.0)
        if best is None and local is not None:  # it fits, but on a forbidden pair: search off it
            best, local, _, _ = self.improved(None, local, None, "lns")
        if best is None:
            logger.warning("solve: no feasible answer found within %.3g s", self.budget)
            self.stats.used_s, self.stats.stop_reason = time.perf_counter() - self.start, "no answer"
            return Solution([], math.inf, "unknown", None, self.stats.used_s, self.name, self.stats)
        if proved and result is not None and result.status in ("OPTIMAL", "LP_OPTIMAL"):
            self.stats.lower_bound = best[1]
            return self.answer(best, "optimal", 0.0, self.name, "optimal")
        if result is not None and result.status == "INFEASIBLE":
            logger.warning("solve: %s reports infeasible but the greedy answer fits; returning it", self.name)
        used = self.name if result is not None else "greedy"
        lower = self.lower_bound(result, best)
        if not self.probe and (_gap(best[1], lower) is None or _gap(best[1], lower) > self.target_gap):
            best, local, optimal, used = self.improved(best, local, lower, used)
            if optimal:
                self.stats.lower_bound = best[1]
                return self.answer(best, "optimal", 0.0, used, "optimal")
        gap = _gap(best[1], lower)
        if gap is not None and gap <= PROVED_GAP:  # the bound meets the answer: proved, whoever found it
            self.stats.lower_bound = best[1]
            return self.answer(best, "optimal", 0.0, used, "optimal")
        stop = "gap target" if gap is not None and gap <= self.target_gap else "time limit"
        return self.answer(best, "feasible", gap, used, stop)

    def without_limit(self, budget: float) -> _Run:
        """This run's problem without its memory limit, sharing the variables already built."""
        run = copy.copy(self)
        run.start = time.perf_counter()
        run.budget, run.deadline = budget, run.start + budget
        run.problem = dataclasses.replace(self.problem, memory_limit=None)
        run.limit, run.tol, run.rows = None, 0.0, None
        run.bound, run.exact_peak, run.starts = True, False, []
        run.elimination_limit, run.probe = PROBE_ELIMINATION_LIMIT, True
        run.stats = dataclasses.replace(self.stats, memory_rows=0, budget_s=budget)
        return run

    def memory_free(self) -> Solution | None:
        """Step 0: the answer without the memory limit when it fits and its gap is small; else None.

        Its lower bound is kept (``stats.memory_free_bound``) for the gap of the limited problem.
        """
        free_start = time.perf_counter()
        sol = self.without_limit(MEMORY_FREE_SHARE * self.budget).run()
        st = self.stats
        st.memory_free_time_s = time.perf_counter() - free_start
        st.memory_free_bound = sol.stats.lower_bound
        if not sol.choice:
            return None
        peak = peak_memory_of(self.problem, sol.choice)
        st.memory_free_fits = peak <= self.limit + self.tol
        if not st.memory_free_fits:
            return None
        if sol.gap is None or sol.gap > self.target_gap or any(objective_of(self.problem, c) < sol.objective for c in self.starts):
            self.starts.append(sol.choice)  # it fits: the limited search starts from it (and from a cheaper start)
            return None
        free_stats = sol.stats
        st.nodes_after_reduction = free_stats.nodes_after_reduction
        st.factors_after_reduction = free_stats.factors_after_reduction
        st.strategies_after_reduction = free_stats.strategies_after_reduction
        st.reduce_time_s, st.greedy_objective = free_stats.reduce_time_s, free_stats.greedy_objective
        st.lns_rounds, st.lns_time_s = free_stats.lns_rounds, free_stats.lns_time_s
        st.lower_bound, st.peak_memory = sol.stats.lower_bound, peak
        st.used_s = time.perf_counter() - self.start
        st.stop_reason = "optimal" if sol.status == "optimal" else "gap target"
        logger.info(
            "solve: %d nodes, the answer without the memory limit fits: %s objective %.6g (gap %.2e) in %.2f s of %.3g",
            st.nodes, sol.status, sol.objective, sol.gap, st.used_s, self.budget,
        )
        return Solution(sol.choice, sol.objective, sol.status, sol.gap, st.used_s, sol.backend, st)

    def reduced(self) -> Solution | None:
        """Step 2, the exact reductions (the core is ``self.core``); a Solution when nothing fits."""
        self.reducer = Reducer(
            self.costs, self.mats.items(), self.item_var, self.item_mem, self.rows, self.limit, self.tol, self.describe
        )
        self.reducer.elimination_limit = self.elimination_limit
        try:
            if self.reduce:
                self.reducer.run(self.start + REDUCE_SHARE * self.budget)
            else:
                self.reducer.refresh_memory(all_binding=True)
        except InfeasibleError as err:
            return self.infeasible(str(err), self.left())
        core = self.reducer.core()
        binding = len(core.cap)
        if self.reduce:
            core = prune_rows(core)
        self.core = core
        st = self.stats
        st.nodes_after_reduction, st.factors_after_reduction = core.n, len(core.factors)
        st.strategies_after_reduction = int(core.sizes.sum())
        st.binding_memory_rows, st.memory_rows_after_reduction = binding, len(core.cap)
        st.reduce_time_s = time.perf_counter() - self.start
        return None

    def finish(self, local: np.ndarray) -> Best | None:
        """A core answer mapped back to the nodes and checked on the original problem; None if it fails."""
        choice = self.reducer.expand(self.core, local)[self.var_of_node].tolist()
        objective = objective_of(self.problem, choice)
        peak = peak_memory_of(self.problem, choice) if self.limit is not None else None
        if not math.isfinite(objective) or (peak is not None and peak > self.limit + self.tol):
            return None
        return choice, objective, peak

    def answer(self, best: Best, status: str, gap: float | None, used: str, stop: str) -> Solution:
        st = self.stats
        st.peak_memory = best[2] if best[2] is not None else peak_memory_of(self.problem, best[0])
        st.used_s = elapsed = time.perf_counter() - self.start
        st.stop_reason = stop
        logger.info(
            "solve: %d nodes -> %d after reduction, %s objective %.6g (gap %s) by %s in %.2f s of %.3g (%s)",
            st.nodes,
            self.core.n,
            status,
            best[1],
            "n/a" if gap is None else f"{gap:.2e}",
            used,
            elapsed,
            self.budget,
            stop,
        )
        return Solution(best[0], best[1], status, gap, elapsed, used, st)

    def infeasible(self, reason: str, time_limit_s: float) -> Solution:
        """No choice fits: the reason, and with a memory limit the smallest peak any choice reaches."""
        p, st = self.problem, self.stats
        st.infeasible_reason = reason
        message = f"no feasible strategy choice: {reason}"
        if p.memory_limit is not None and math.isfinite(p.memory_limit):
            peak, exact = min_peak_memory(
                p, self.var_of_node, self.members, self.name, max(time_limit_s, 1.0), exact=self.exact_peak
            )
            st.min_peak_memory, st.min_peak_memory_exact = peak, exact
            message += f"; the smallest memory that would fit is {peak:.6g} bytes"
        logger.info("solve: %s", message)
        st.used_s, st.stop_reason = time.perf_counter() - self.start, "infeasible"
        return Solution([], math.inf, "infeasible", None, st.used_s, self.name, st)

    def planned_milp(self) -> tuple[Milp | None, bool, bool]:
        """Step 4's model: (the MILP or None, whether only its relaxation is solved, whether to skip it).

        HiGHS's branch and bound cannot be held to a time limit past ``HIGHS_MIP_MAX_NNZ``
        nonzeros (its root waits on an interior-point "analytic centre" solve that no limit
        or interrupt stops, tens of seconds here): the LP relaxation is solved instead,
        rounded and repaired, and not even started when it cannot finish in its share.
        When even the rows without memory are past that, the MILP is not built at all.
        """
        st = self.stats
        if self.left() < MIN_SOLVER_TIME_S:
            return None, False, True
        if self.name == "highs":
            least = milp_nonzeros_at_least(self.core)
            if least > HIGHS_MIP_MAX_NNZ and lp_seconds(least) > LARGE_MILP_SHARE * self.left():
                st.relaxation_only, st.milp_nonzeros_at_least = True, least
                return None, True, True
        build_start = time.perf_counter()
        milp = build_milp(self.core, self.limit if self.limit else 1.0, self.memory_form)
        st.milp_constraints, st.milp_variables, st.milp_nonzeros = milp.shape
        st.memory_form, st.build_time_s = milp.memory_form, time.perf_counter() - build_start
        relax = self.name == "highs" and milp.shape[2] > HIGHS_MIP_MAX_NNZ
        st.relaxation_only = relax
        return milp, relax, relax and lp_seconds(milp.shape[2]) > LARGE_MILP_SHARE * self.left()

    def heuristics(self, skip_solver: bool) -> tuple[Best | None, np.ndarray | None]:
        """Step 3: greedy, then memory priced into exact eliminations; the best and its core choice.

        Pricing gets a quarter of the time left, half when the MILP will not run (the rest
        is for the neighbourhood search).
        """
        st, core = self.stats, self.core
        greedy_start = time.perf_counter()
        local = Greedy(core, self.tol).run(self.deadline)
        best = self.finish(local) if local is not None else None
        st.greedy_time_s = time.perf_counter() - greedy_start
        priced_start = time.perf_counter()
        share = 0.5 if skip_solver else 0.25
        priced, st.priced_bound = priced_answer(core, self.tol, priced_start + share * (self.deadline - priced_start))
        if priced is not None:
            priced = Greedy(core, self.tol).run(self.deadline, start=priced)
            found = self.finish(priced) if priced is not None else None
            st.priced_objective = found[1] if found is not None else None
            if found is not None and (best is None or found[1] < best[1]):
                best, local = found, priced
        st.greedy_objective = best[1] if best is not None else None
        st.priced_time_s = time.perf_counter() - priced_start
        if best is None:
            # Nothing that fits and avoids the forbidden pairs yet: start the search from the
            # least memory, repaired and improved by greedy moves, when that fits at all.
            start = least_memory_start(core, self.deadline)
            local = Greedy(core, self.tol).run(self.deadline, start=start) if start is not None else None
            best = self.finish(local) if local is not None else None
        return best, local

    def from_starts(self, best: Best | None, local: np.ndarray | None) -> tuple[Best | None, np.ndarray | None]:
        """The best of ``best`` and the known answers (``self.starts``), each read into the core.

        A strategy the reductions dropped as dominated is replaced by the greedy repair's
        choice, which then improves the whole answer; the result is checked on the problem.
        """
        for choice in self.starts:
            var_choice = np.asarray(choice, dtype=np.int64)[[m[0] for m in self.members]]
            start = np.zeros(self.core.n, dtype=np.int64)
            for i, k in enumerate(self.core.var_ids.tolist()):
                at = np.nonzero(self.core.keep[i] == var_choice[k])[0]
                start[i] = at[0] if len(at) else 0
            found_local = Greedy(self.core, self.tol).run(self.deadline, start=start)
            found = self.finish(found_local) if found_local is not None else None
            if found is not None and (best is None or found[1] < best[1]):
                best, local = found, found_local
        return best, local

    def whole_milp(
        self, milp: Milp, relax: bool, best: Best | None, local: np.ndarray | None
    ) -> tuple[Best | None, np.ndarray | None, SolverResult, bool]:
        """Step 4: the whole MILP with the time left (a share of it for the relaxation); whether it proved its answer."""
        core, st, name = self.core, self.stats, self.name
        hint = hint_values(milp, core, local) if best is not None and name != "highs" else None
        share = LARGE_MILP_SHARE if relax else 1.0
        result = run_solver(milp, name, share * self.left(), hint, relax=relax)
        st.solver_status, st.solver_time_s, st.best_bound = result.status, result.wall_s, result.bound
        proved = True
        if result.values is None:
            return best, local, result, proved
        found_local = _local_from_values(milp, core, result.values)
        x = result.values[: milp.n_x]
        if relax and np.abs(x - np.round(x)).max() > 1e-9:
            proved = False
            found_local = Greedy(core, self.tol).run(self.deadline, start=found_local)
        found = self.finish(found_local) if found_local is not None else None
        if found is None and found_local is not None:
            # Within the solver's tolerance but over the limit by more than MEMORY_RTOL once
            # rounded: nudge it back under with the greedy repair, and claim no optimality.
            logger.warning("solve: the %s answer overflows memory after rounding; repairing it", name)
            found_local = Greedy(core, self.tol).run(self.deadline, start=found_local)
            found = self.finish(found_local) if found_local is not None else None
            proved = False
        if found is not None and (best is None or found[1] <= best[1]):
            best, local = found, found_local
        return best, local, result, proved

    def lower_bound(self, result: SolverResult | None, best: Best) -> float | None:
        """The best lower bound known: the solver's, the priced one's, else min-sum diffusion's.

        Diffusion gets a tenth of the time left at most; it runs when the caller asked for
        a bound, or when the search needs one to know when to stop.
        """
        st = self.stats
        candidates = (result.bound if result is not None else None, st.priced_bound, st.memory_free_bound)
        bounds = [b for b in candidates if b is not None]
        if not bounds and (self.bound or self.left() > MIN_SOLVER_TIME_S):
            bound_start = time.perf_counter()
            st.diffusion_bound = diffusion_bound(self.core, bound_start + 0.1 * max(self.left(), 0.0))
            bounds.append(st.diffusion_bound)
            st.bound_time_s = time.perf_counter() - bound_start
        if not bounds:
            return None
        st.lower_bound = max(bounds)
        return st.lower_bound

    def improved(
        self, best: Best | None, local: np.ndarray | None, lower: float | None, used: str
    ) -> tuple[Best | None, np.ndarray | None, bool, str]:
        """Step 5: large neighbourhood search with the time left (:mod:`autopar.solver.lns`).

        Returns the best answer, its core choice, whether it is proven optimal, and who found it. Without a
        ``best``, ``local`` fits the memory but uses a forbidden pair, and the search starts there.
        """
        st = self.stats
        if local is None or self.left() < 0.1:
            return best, local, False, used
        lns_start = time.perf_counter()
        if st.lns_start_objective is None:
            st.lns_start_objective = best[1] if best is not None else math.inf
        found = improve(
            self.core,
            local,
            self.name,
            self.deadline,
            self.tol,
            self.limit if self.limit else 1.0,
            lower,
            self.target_gap * 0.999,
        )
        st.lns_rounds += found.rounds
        st.lns_improvements += found.improvements
        st.lns_time_s = (st.lns_time_s or 0.0) + time.perf_counter() - lns_start
        if found.improvements or found.proved_optimal:
            checked = self.finish(found.local)
            if checked is not None and (best is None or checked[1] <= best[1]):
                return checked, found.local, found.proved_optimal, "lns" if found.improvements else used
        return best, local, False, used


def _gap(objective: float, lower: float | None) -> float | None:
    if lower is None:
        return None
    return max(0.0, (objective - lower) / (abs(objective) or 1.0))


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
    var_of_node, members = group_vars(problem)
    costs, mats = variable_graph(problem, var_of_node, members)
    reducer = Reducer(costs, mats.items(), np.zeros(0, dtype=np.int64), [], None, None, 0.0, str)
    try:
        reducer.run()
    except InfeasibleError:
        return math.inf
    return diffusion_bound(reducer.core(), start + time_limit_s)
