"""Quick answers on the reduced problem: greedy with memory repair, and Lagrangian memory pricing.

Split from :mod:`autopar.solver.solve`. These give the solver an answer before (and
without) the MILP: the best of them is the hint for SCIP, the fallback when the solver
runs out of time or is not started, and the priced one also gives a lower bound, hence
a gap, when the MILP reports none.
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.solver.core_problem import CoreProblem, InfeasibleError
from autopar.solver.memory_rows import range_sums
from autopar.solver.reduce import Reducer


class Greedy:
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


def consistent_start(core: CoreProblem, deadline: float, costs: list[np.ndarray] | None = None) -> np.ndarray:
    """A choice built variable by variable, each from what its neighbours still allow.

    Greedy best response avoids a forbidden pair only with the neighbours already chosen;
    where most pairs are forbidden (the IOPDDL problems: two thirds of all entries) that
    leaves hundreds in its answer. Here choosing a strategy removes from each neighbour's
    set those it cannot be paired with, and the removal spreads (arc consistency, over
    two-variable factors) before the next variable is chosen, the cheapest of its set
    against the choices made. When a set runs empty the variable takes its cheapest
    strategy and the search is left to move it off the forbidden pair. ``costs`` replaces
    the variables' own costs in that choice.
    """
    n = core.n
    costs = core.costs if costs is None else costs
    allowed = [np.isfinite(c) for c in core.costs]
    pairs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]  # (other, finite mask: mine x other)
    for scope, table in core.factors:
        if len(scope) == 2:
            a, b = scope
            ok = np.isfinite(table)
            pairs[a].append((b, ok))
            pairs[b].append((a, ok.T))
    local = np.full(n, -1, dtype=np.int64)

    def spread(queue: list[int]) -> None:
        while queue and time.perf_counter() < deadline:
            i = queue.pop()
            for j, ok in pairs[i]:
                if local[j] >= 0:
                    continue
                keep = allowed[j] & ok[allowed[i]].any(axis=0)
                if keep.any() and not np.array_equal(keep, allowed[j]):
                    allowed[j] = keep
                    queue.append(j)

    spread(list(range(n)))  # what no choice of a neighbour allows goes before any is made
    for i in range(n):
        score = costs[i].copy()
        for j, ok in pairs[i]:
            if local[j] >= 0:
                score = np.where(ok[:, local[j]], score, np.inf)
        score = np.where(allowed[i], score, np.inf)
        if not np.isfinite(score).any():
            score = np.where(np.isfinite(core.costs[i]), costs[i], np.inf)
        s = int(np.argmin(score))
        local[i] = s
        mask = np.zeros(len(allowed[i]), dtype=bool)
        mask[s] = True
        allowed[i] = mask
        spread([i])
    return local


def least_memory_start(core: CoreProblem, deadline: float) -> np.ndarray:
    """A choice that holds little memory and avoids forbidden strategies and pairs where it can.

    :func:`consistent_start` with the memory each strategy holds (bytes times rows live) as
    its cost, the strategy's own cost breaking ties: where greedy on the real costs finds
    nothing that fits and avoids the forbidden pairs, this usually does, and it is where
    the neighbourhood search starts.
    """
    held = [np.zeros(len(c)) for c in core.costs]
    for t, i in enumerate(core.item_var.tolist()):
        held[i] = held[i] + core.item_coef[t] * float(core.item_r1[t] - core.item_r0[t])
    scale = max((float(np.abs(c[np.isfinite(c)]).max(initial=0.0)) for c in core.costs), default=0.0) or 1.0
    top = max((float(h.max(initial=0.0)) for h in held), default=0.0) or 1.0
    tie = 1e-6 * top / scale
    costs = [np.where(np.isfinite(c), h + tie * np.nan_to_num(c, posinf=0.0), np.inf) for c, h in zip(core.costs, held, strict=True)]
    return consistent_start(core, deadline, costs)


def priced_answer(core: CoreProblem, tol: float, deadline: float) -> tuple[np.ndarray | None, float | None]:
    """A memory-feasible answer, and a lower bound, from problems with memory priced into costs.

    With memory priced instead of limited, nothing stops the eliminations of
    :mod:`autopar.solver.reduce`, so each priced problem is solved exactly and
    whole chains switch strategy together, which single-variable greedy moves cannot do.
    An item's price is ``lam`` per byte above its minimum, times how many times a row it is
    live in has been the most overflowed one; ``lam`` doubles (and the worst row gains
    weight) until an answer fits, then is bisected towards the cheapest answer that fits. Each exact priced optimum also bounds the true
    one from below (Lagrangian duality: ``cost(x) + lam * sum_r w_r (usage_r(x) - cap_r)``
    with ``x`` the priced optimum), which gives a gap when the MILP has none. Returns
    ``(None, None)`` when an elimination would be too large or there is too little time.
    """
    if not len(core.cap) or core.n * 2e-4 > deadline - time.perf_counter():
        return None, None
    pricing = _Pricing(core, tol, deadline)
    started = time.perf_counter()
    local, over = pricing.solve(0.0)
    if local is None:
        return None, None
    if over.max() <= tol:
        return pricing.result(local)
    if (time.perf_counter() - started) * 12 > deadline - time.perf_counter():
        return pricing.result(None)  # no time for the dozen or so solves the search takes
    fitting = pricing.raise_price(over)
    if fitting is None:
        return pricing.result(None)
    return pricing.result(pricing.cheapest(*fitting))


class _Pricing:
    """The state of :func:`priced_answer`'s search: the per-row weights and the best bound so far."""

    def __init__(self, core: CoreProblem, tol: float, deadline: float) -> None:
        self.core, self.tol, self.deadline = core, tol, deadline
        self.weight = np.zeros(len(core.cap))
        self.coef = np.zeros((len(core.item_coef), int(core.sizes.max())))
        for t, c in enumerate(core.item_coef):
            self.coef[t, : len(c)] = c
        self.items = np.arange(len(core.item_coef))
        self.bound = -math.inf

    def cost(self, local: np.ndarray) -> float:
        core = self.core
        total = sum(float(c[local[i]]) for i, c in enumerate(core.costs))
        return total + sum(float(t[tuple(local[list(s)])]) for s, t in core.factors)

    def solve(self, lam: float) -> tuple[np.ndarray | None, np.ndarray]:
        """The exact optimum with memory priced at ``lam`` and each row's overflow under it (None: none found)."""
        core = self.core
        prefix = np.concatenate([[0.0], np.cumsum(self.weight)])
        price = lam * (prefix[core.item_r1] - prefix[core.item_r0])
        costs = [c.copy() for c in core.costs]
        for t, i in enumerate(core.item_var.tolist()):
            costs[i] = costs[i] + price[t] * core.item_coef[t]
        reducer = Reducer(costs, core.factors, np.zeros(0, dtype=np.int64), [], None, None, 0.0, str)
        try:
            reducer.run(self.deadline)  # unfinished, it leaves variables alive: no answer
        except InfeasibleError:
            return None, np.zeros(0)
        if reducer.alive.any():
            return None, np.zeros(0)
        local = reducer.expand(reducer.core(), np.zeros(0, dtype=np.int64))
        used = self.coef[self.items, local[core.item_var]]
        over = range_sums(core.item_r0, core.item_r1, used, len(core.cap)) - core.cap
        self.bound = max(self.bound, self.cost(local) + lam * float(self.weight @ (over - self.tol)))
        return local, over

    def result(self, best: np.ndarray | None) -> tuple[np.ndarray | None, float | None]:
        return best, (self.bound + self.core.constant if math.isfinite(self.bound) else None)

    def raise_price(self, over: np.ndarray) -> tuple[np.ndarray, float, float, float] | None:
        """Double the price, spreading it over every row that overflowed, until an answer fits.

        Returns that answer, its cost, and the last price that did not fit and the one that
        did; None when time runs out, a priced problem is not solved, or no price fits.
        """
        spread = [float(np.ptp(c[np.isfinite(c)])) for c in self.core.costs if np.isfinite(c).sum() > 1]
        lam = (float(np.mean(spread)) if spread else 1.0) / max(float(self.coef.max()), 1e-300) or 1.0
        low = 0.0
        for _ in range(40):
            if time.perf_counter() > self.deadline:
                return None
            self.weight[int(np.argmax(over))] += 1.0
            lam *= 2.0
            local, over = self.solve(lam)
            if local is None:
                return None
            if over.max() <= self.tol:
                return local, self.cost(local), low, lam
            low = lam
        return None

    def cheapest(self, best: np.ndarray, best_cost: float, low: float, high: float) -> np.ndarray:
        """Bisect the price between ``low`` and ``high`` for the cheapest answer that still fits."""
        for _ in range(8):
            if time.perf_counter() > self.deadline:
                break
            mid = 0.5 * (low + high)
            local, over = self.solve(mid)
            if local is None:
                break
            if over.max() <= self.tol:
                high = mid
                if self.cost(local) < best_cost:
                    best, best_cost = local, self.cost(local)
            else:
                low = mid
        return best
