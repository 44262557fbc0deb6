r"""Large neighbourhood search: improve an answer by solving sub-MILPs exactly.

This is what makes the solver anytime (see :mod:`autopar.solver.solve`): when the whole
MILP is too large to solve in the time left, or was stopped with a gap, the time that is
left goes to improving the best answer rather than being returned unspent.

The sub-problem
---------------
Take the reduced problem (:class:`~autopar.solver.core_problem.CoreProblem`: variables ``i``
with costs ``c_i``, factors ``T_f`` over scopes ``F_f``, memory items ``t`` of variable
``i_t`` holding ``m_t[s]`` over rows ``[r0_t, r1_t)`` with capacity ``cap_r``), an
incumbent ``s^0`` that fits, and a neighbourhood ``W`` of variables. Fixing every
variable outside ``W`` at ``s^0`` leaves::

    minimise    sum_{i in W} c_i[s_i] + sum_f T_f[s_{F_f}]          (s_j = s^0_j for j not in W)
    subject to  sum_{t : i_t in W, r0_t <= r < r1_t} m_t[s_{i_t}]
                    <= cap_r - sum_{t : i_t not in W, r0_t <= r < r1_t} m_t[s^0_{i_t}]   for every r

which is again a core problem: a factor with no variable in ``W`` is a constant, one with
a single variable in ``W`` a cost of that variable, one with more a factor over its
variables in ``W``; rows that no item of ``W`` touches hold at ``s^0`` whatever ``W``
does and are left out. ``s^0`` restricted to ``W`` is feasible for it, so its optimum
is never worse than the incumbent: an accepted answer only ever improves. It is solved
by the marginal-form MILP (:mod:`autopar.solver.milp`) with a short time limit.

The search
----------
Neighbourhoods alternate between a *ball* (breadth first over the factor graph from a
random variable, so that a chain of variables switching strategy together is inside
one sub-problem) and a *window* (a run of consecutive variables, which follow the
graph's order and hence the memory rows' time order, so that memory can be traded
between neighbouring time steps). Their size ``K`` adapts: it grows while sub-MILPs
are solved to optimality quickly, and shrinks when one is slow, runs out of time, or has
more than ``SUB_MAX_NNZ`` nonzeros (many small sub-problems improve more per second
than a few large ones, and HiGHS overruns short limits on large ones). An incumbent
that uses forbidden entries (infinite cost) is searched with each of them charged more
than the sub-problem's finite costs can differ: fewer forbidden entries first. The search
stops at the deadline, or once the answer is within the target gap of the lower bound;
it proves optimality only when a neighbourhood holds every variable and its sub-MILP is
solved to optimality.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from autopar.solver.backends import run_solver
from autopar.solver.core_problem import CoreProblem
from autopar.solver.memory_rows import range_sums
from autopar.solver.milp import build_milp

logger = logging.getLogger(__name__)

SUB_TIME_S = 2.0
"""The longest a single sub-MILP may run; a neighbourhood that needs more is too large."""

SUB_MAX_NNZ = 60_000
"""The largest sub-MILP solved: past this HiGHS can run seconds past a short time limit."""

MIN_ROUND_S = 0.5
"""No round is started with less time left: a sub-MILP may overrun its limit by a fraction of a second."""

START_SIZE = 30
"""Variables in the first neighbourhood: a sub-MILP of this size solves in well under a second."""


@dataclass
class LnsResult:
    local: np.ndarray  # the best answer, a strategy per core variable
    objective: float  # its cost on the core problem, constant included
    rounds: int
    improvements: int
    proved_optimal: bool


def core_cost(core: CoreProblem, local: np.ndarray) -> float:
    """The core problem's objective at ``local``, its constant included."""
    total = math.fsum(float(c[s]) for c, s in zip(core.costs, local.tolist(), strict=True))
    return total + math.fsum(float(t[tuple(local[list(s)])]) for s, t in core.factors) + core.constant


def core_score(core: CoreProblem, local: np.ndarray) -> tuple[int, float]:
    """(forbidden entries used, cost of the others): ``local`` is better than another when lower."""
    values = [float(c[s]) for c, s in zip(core.costs, local.tolist(), strict=True)]
    values += [float(t[tuple(local[list(s)])]) for s, t in core.factors]
    finite = [v for v in values if math.isfinite(v)]
    return len(values) - len(finite), math.fsum(finite) + core.constant


def _penalized(sub: CoreProblem) -> CoreProblem:
    """``sub`` with each forbidden entry costing more than any change of its finite costs can gain."""

    def spread(t: np.ndarray) -> float:
        f = t[np.isfinite(t)]
        return float(f.max() - f.min()) if len(f) else 0.0

    big = 10.0 * (sum(spread(c) for c in sub.costs) + sum(spread(t) for _, t in sub.factors)) + 1.0
    costs = [np.where(np.isfinite(c), c, big) for c in sub.costs]
    factors = [(scope, np.where(np.isfinite(t), t, big)) for scope, t in sub.factors]
    return replace(sub, costs=costs, factors=factors)


def core_usage(core: CoreProblem, local: np.ndarray) -> np.ndarray:
    """Memory above the items' minima on every row of the core problem at ``local``."""
    if not len(core.item_coef):
        return np.zeros(len(core.cap))
    picked = np.array([core.item_coef[t][local[i]] for t, i in enumerate(core.item_var.tolist())])
    return range_sums(core.item_r0, core.item_r1, picked, len(core.cap))


class Neighbourhoods:
    """The factor graph's adjacency and the items of each variable, kept for many sub-problems."""

    def __init__(self, core: CoreProblem, seed: int = 0) -> None:
        self.core = core
        self.rng = np.random.default_rng(seed)
        self.adjacent: list[list[int]] = [[] for _ in range(core.n)]
        self.factors_of: list[list[int]] = [[] for _ in range(core.n)]
        for f, (scope, _) in enumerate(core.factors):
            for v in scope:
                self.factors_of[v].append(f)
                self.adjacent[v].extend(u for u in scope if u != v)
        self.items_of: list[list[int]] = [[] for _ in range(core.n)]
        for t, i in enumerate(core.item_var.tolist()):
            self.items_of[i].append(t)

    def ball(self, size: int) -> np.ndarray:
        """Up to ``size`` variables breadth first from a random one (restarting when it runs dry)."""
        seen = np.zeros(self.core.n, dtype=bool)
        order: list[int] = []
        while len(order) < size:
            left = np.nonzero(~seen)[0]
            if not len(left):
                break
            root = int(self.rng.choice(left))
            seen[root] = True
            queue = [root]
            while queue and len(order) < size:
                v = queue.pop(0)
                order.append(v)
                for u in self.adjacent[v]:
                    if not seen[u]:
                        seen[u] = True
                        queue.append(u)
        return np.sort(np.array(order, dtype=np.int64))

    def window(self, size: int) -> np.ndarray:
        """``size`` consecutive variables from a random start."""
        first = int(self.rng.integers(0, max(self.core.n - size, 0) + 1))
        return np.arange(first, min(first + size, self.core.n), dtype=np.int64)

    def sub_problem(self, free: np.ndarray, local: np.ndarray, usage: np.ndarray) -> CoreProblem:
        """The core problem over ``free`` with every other variable fixed at ``local`` (module doc)."""
        core = self.core
        position = np.full(core.n, -1, dtype=np.int64)
        position[free] = np.arange(len(free))
        costs = [core.costs[i].copy() for i in free.tolist()]
        factors: list[tuple[tuple[int, ...], np.ndarray]] = []
        seen: set[int] = set()
        for i in free.tolist():
            for f in self.factors_of[i]:
                if f in seen:
                    continue
                seen.add(f)
                scope, table = core.factors[f]
                index = tuple(slice(None) if position[v] >= 0 else int(local[v]) for v in scope)
                sliced = table[index]
                kept = tuple(int(position[v]) for v in scope if position[v] >= 0)
                if len(kept) == 1:
                    costs[kept[0]] = costs[kept[0]] + sliced
                else:
                    factors.append((kept, sliced))
        items = np.array([t for i in free.tolist() for t in self.items_of[i]], dtype=np.int64)
        if len(items) and len(core.cap):
            r0, r1 = core.item_r0[items], core.item_r1[items]
            mine = range_sums(r0, r1, np.array([core.item_coef[t][local[core.item_var[t]]] for t in items]), len(core.cap))
            touched = range_sums(r0, r1, np.ones(len(items)), len(core.cap)) > 0
            rows = np.nonzero(touched)[0]
            new_index = np.cumsum(touched) - 1
            cap = core.cap[rows] - (usage[rows] - mine[rows])
            item_r0, item_r1 = new_index[r0], new_index[r1 - 1] + 1
            item_var = position[core.item_var[items]]
            item_coef = [core.item_coef[t] for t in items.tolist()]
            row_times = core.row_times[rows] if len(core.row_times) == len(core.cap) else rows
        else:
            cap = row_times = np.zeros(0)
            item_r0 = item_r1 = item_var = np.zeros(0, dtype=np.int64)
            item_coef = []
        return CoreProblem(
            var_ids=free,
            keep=[np.arange(len(c)) for c in costs],
            costs=costs,
            factors=factors,
            constant=0.0,
            cap=np.maximum(cap, 0.0),
            row_times=row_times,
            item_var=item_var,
            item_r0=item_r0,
            item_r1=item_r1,
            item_coef=item_coef,
        )


def improve(
    core: CoreProblem,
    start: np.ndarray,
    backend: str,
    deadline: float,
    tol: float,
    memory_scale: float,
    lower_bound: float | None,
    target_gap: float,
) -> LnsResult:
    """Improve ``start`` (a core answer that fits) by neighbourhood sub-MILPs until the deadline.

    ``start`` may use forbidden strategies or pairs (infinite cost): while it does, each
    sub-problem charges a forbidden entry more than all its finite costs can differ, so
    the search first moves off them, then lowers the cost.

    Stops early when the answer is within ``target_gap`` of ``lower_bound`` or proven
    optimal (a neighbourhood of every variable solved to optimality). See the module doc.
    """
    hoods = Neighbourhoods(core)
    local = start.copy()
    forbidden, finite = core_score(core, local)
    objective = math.inf if forbidden else finite
    usage = core_usage(core, local)
    size = min(START_SIZE, core.n)
    rounds = improvements = 0

    def close_enough() -> bool:
        if lower_bound is None:
            return False
        return objective - lower_bound <= target_gap * (abs(objective) or 1.0)

    while not close_enough():
        left = deadline - time.perf_counter()
        if left < MIN_ROUND_S:
            break
        free = hoods.window(size) if rounds % 2 else hoods.ball(size)
        rounds += 1
        sub = hoods.sub_problem(free, local, usage)
        milp = build_milp(_penalized(sub) if forbidden else sub, memory_scale, "auto")
        if milp.shape[2] > SUB_MAX_NNZ:
            size = max(8, int(size * 0.7))
            continue
        result = run_solver(milp, backend, min(left - 0.5 * MIN_ROUND_S, SUB_TIME_S), None, presolve=False)
        solved = result.status == "OPTIMAL"
        logger.debug(
            "lns round %d: %d variables, %s in %.2f s, %.3f s left", rounds, len(free), result.status,
            result.wall_s, deadline - time.perf_counter(),
        )
        if result.values is not None:
            change = _accept(core, sub, result.values, free, local, usage, finite, tol)
            if change is not None:
                local, usage, gone, saved = change
                improvements += 1
                forbidden, finite = forbidden - gone, finite - saved
                objective = math.inf if forbidden else finite
        if solved and len(free) == core.n:  # the whole problem solved: nothing is left to find
            return LnsResult(local, objective, rounds, improvements, not forbidden)
        # grow while sub-problems are solved well within their limit, shrink when one is slow
        if solved and result.wall_s < 0.1 * SUB_TIME_S:
            size = min(core.n, int(size * 1.2) + 1)
        elif not solved or result.wall_s > 0.3 * SUB_TIME_S:
            size = max(8, int(size * 0.7))
    return LnsResult(local, objective, rounds, improvements, False)


def _accept(
    core: CoreProblem,
    sub: CoreProblem,
    values: np.ndarray,
    free: np.ndarray,
    local: np.ndarray,
    usage: np.ndarray,
    finite: float,
    tol: float,
) -> tuple[np.ndarray, np.ndarray, int, float] | None:
    """The sub-MILP's answer put into ``local`` when it is better and fits, else None.

    Returns the new choice, its memory per row, and how many forbidden entries and how
    much finite cost it removed: the sub-problem holds every term that moves, so the
    change is computed on it alone.
    """
    x0 = np.concatenate([[0], np.cumsum(sub.sizes)]).astype(np.int64)
    picked = np.array([int(np.argmax(values[x0[i] : x0[i + 1]])) for i in range(sub.n)], dtype=np.int64)
    if np.array_equal(picked, local[free]):
        return None
    (old_forbidden, old), (new_forbidden, new) = core_score(sub, local[free]), core_score(sub, picked)
    # fewer forbidden entries is better whatever it costs; then the lower cost
    if new_forbidden > old_forbidden or (
        new_forbidden == old_forbidden and not new < old - 1e-12 * (abs(old) + abs(finite))
    ):
        return None
    candidate = local.copy()
    candidate[free] = picked
    if len(core.cap):
        moved = core_usage(sub, picked) - core_usage(sub, local[free])
        rows = np.nonzero(moved)[0]
        new_usage = usage.copy()
        # the sub-problem's rows are the core's rows its items touch, in order
        touched = _touched_rows(core, sub, free)
        new_usage[touched] += moved
        if len(rows) and (new_usage[touched] - core.cap[touched]).max() > tol:
            return None
        usage = new_usage
    return candidate, usage, old_forbidden - new_forbidden, old - new


def _touched_rows(core: CoreProblem, sub: CoreProblem, free: np.ndarray) -> np.ndarray:
    """The core rows that the items of ``free`` touch, in order: the sub-problem's rows."""
    items = np.isin(core.item_var, free)
    return np.nonzero(range_sums(core.item_r0[items], core.item_r1[items], np.ones(int(items.sum())), len(core.cap)) > 0)[0]
