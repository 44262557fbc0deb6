"""Exact reductions of a strategy graph before the MILP of :mod:`autopar.solver.solve`.

Every reduction here keeps the optimum *exactly*: it only removes choices that
some other choice is at least as good as in every completion, or it solves a
piece of the graph in closed form and remembers how to extend the answer.
That is what lets the MILP see a few hundred or thousand variables where the
captured graph has tens of thousands of nodes.

The reduced problem is over *variables* ``k``: one per group of nodes that
must share a strategy index (a node outside every group is its own variable).
A variable has costs ``c_k`` (the sum of its members' costs) and the list of
original strategy indices still allowed (``keep[k]``). Interactions are
*factors*: a table over the joint strategies of a few variables (its scope).
The edges of the original graph are factors of two variables, summed per
unordered pair (parallel edges merged; edges inside a group land on the
diagonal of the variable's costs; direction does not matter to the cost).
Eliminating a variable can create a factor over more than two.

Memory enters through *rows* (time steps, see :mod:`autopar.solver.memory_rows`) and
*items* (one per node, with its memory vector and the range of rows where it
is live). An item matters only if its memory differs across the variable's
remaining strategies and it is live in a *binding* row: one whose worst case
(every live item at its largest memory) exceeds the limit. Rows that cannot
bind are implied, so a variable with no relevant item is as free as one with
no memory at all. Binding rows only become fewer as strategies are removed,
so that classification, once made, stays valid.

Reductions, applied from a work list until none fires:

* **forbidden**: a strategy with infinite cost, or whose slice of a factor is
  all infinite, can never be chosen.
* **dominance**: strategy ``a`` is dropped when some ``b`` is no worse in the
  variable's cost, in every relevant item's memory and in every entry of every
  factor it is in (equal strategies keep the lowest index). Any solution
  using ``a`` can switch to ``b`` without raising cost or memory anywhere.
* **separable pairs**: ``E[s, t] = r[s] + q[t]`` (a constant or zero matrix is
  the common case) moves into the two variables' costs and the factor vanishes.
* **subsumed factors**: a factor whose scope lies inside another's is added
  into it, so the MILP links each set of variables once.
* **fixing**: a variable with one strategy left is sliced out of its factors.
* **elimination** (variables with no relevant memory): ``k`` is minimised out,
  ``F(N) = min_s c_k[s] + sum_{f containing k} f(N, s)`` over its neighbours
  ``N``, and the argmin table is kept to recover ``s`` once ``N`` is decided.
  With two neighbours this is the min-plus matrix product of a chain; with one,
  a leaf folded into its neighbour's costs; with none, the cheapest strategy.
  Variables are eliminated smallest resulting table first and only while that
  table stays small (bucket elimination, at most ``ELIMINATION_LIMIT`` entries),
  and, when the table would stay in the MILP because a neighbour's memory is
  relevant, only if it is no bigger than what it replaces. On the fwd/bwd
  "ladder" of a training graph this solves the whole problem when there is no
  memory limit. Dominance is checked only for variables that are not about to
  be eliminated (elimination subsumes it).

Memory rows left for the MILP are thinned by :mod:`autopar.solver.prune_rows` (a
row implied by another is dropped). The data the reductions hand on is
:mod:`autopar.solver.core_problem`'s.
"""

from __future__ import annotations

import functools
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from autopar.solver.core_problem import CoreProblem, InfeasibleError
from autopar.solver.memory_rows import MemoryRows, memory_rows, range_sums
from autopar.solver.prune_rows import prune_rows

__all__ = [
    "ELIMINATION_LIMIT",
    "PROBE_ELIMINATION_LIMIT",
    "CoreProblem",
    "InfeasibleError",
    "MemoryRows",
    "Record",
    "Reducer",
    "align",
    "memory_rows",
    "prune_rows",
    "range_sums",
]

logger = logging.getLogger(__name__)

# A pair factor counts as separable when its residual is below this fraction of its largest entry.
_SEPARABLE_RTOL = 1e-12
# Eliminations whose new factor table would exceed this many entries are not done.
ELIMINATION_LIMIT = 4096

PROBE_ELIMINATION_LIMIT = 16384
"""The table limit of the solve without memory limit that comes first (``autopar.solver.solve``'s
step 0): eliminating further usually finishes the problem there, while a larger core left
for a MILP has larger tables, past what HiGHS branches on in time."""


@dataclass
class Record:
    """How to recover an eliminated variable's strategy from its neighbours' final strategies.

    ``table`` holds original strategy indices of ``var``, indexed by the positions of the
    neighbours' strategies in ``snaps`` (their allowed strategies when ``var`` was removed).
    """

    var: int
    nbrs: tuple[int, ...]
    snaps: tuple[np.ndarray, ...]
    table: np.ndarray


def align(scope: tuple[int, ...], table: np.ndarray, target: list[int]) -> np.ndarray:
    """View of ``table`` (axes in ``scope`` order) broadcastable over axes in ``target`` order."""
    where = {v: i for i, v in enumerate(target)}
    shape = [1] * len(target)
    for v, n in zip(scope, table.shape, strict=True):
        shape[where[v]] = n
    pos = [where[v] for v in scope]
    order = sorted(range(len(pos)), key=pos.__getitem__)
    if order != list(range(len(pos))):
        table = table.transpose(order)
    return table.reshape(shape)


def _no_worse(prof: np.ndarray) -> np.ndarray:
    """``le[a, b]``: row ``b`` of ``prof`` is no larger than row ``a`` in every column.

    Compared a block of columns at a time, stopping once only the diagonal is left: a
    variable with hundreds of factors has a profile of 10^5 columns, and no pair of its
    strategies usually survives the first block, so the full ``n x n x columns`` comparison
    (seconds per call on the IOPDDL problems, where it is called many times) is rarely made.
    """
    n, width = prof.shape
    block = max(64, (1 << 18) // max(n * n, 1))
    if width <= block:
        return (prof[None, :, :] <= prof[:, None, :]).all(axis=2)
    le = np.ones((n, n), dtype=bool)
    for lo in range(0, width, block):
        part = prof[:, lo : lo + block]
        le &= (part[None, :, :] <= part[:, None, :]).all(axis=2)
        if int(le.sum()) == n:
            break
    return le


class Reducer:
    """Holds the variable-level problem and applies the reductions in place.

    Built from per-variable costs, factors ``(scope, table)`` (the merged edges: scopes of two
    variables with ``|S_a| x |S_b|`` tables), and per-node memory items (``item_var[v]`` is
    node v's variable). Without memory items it is an exact solver for the cost alone.
    """

    def __init__(
        self,
        costs: list[np.ndarray],
        factors: Iterable[tuple[tuple[int, ...], np.ndarray]],
        item_var: np.ndarray,
        item_mem: list[np.ndarray],
        rows: MemoryRows | None,
        memory_limit: float | None,
        tol: float,
        describe: Callable[[int], str],
    ) -> None:
        n = len(costs)
        self.keep = [np.arange(len(c)) for c in costs]
        self.cost = [np.asarray(c, dtype=float) for c in costs]
        self.scope: dict[int, tuple[int, ...]] = {}
        self.table: dict[int, np.ndarray] = {}
        self.of_var: list[set[int]] = [set() for _ in range(n)]
        self.by_scope: dict[tuple[int, ...], int] = {}
        self.unchecked: set[int] = set()  # pair factors not yet tested for separability since they changed
        self._next_id = 0
        self.alive = np.ones(n, dtype=bool)
        self.records: list[Record] = []
        self.constant = 0.0
        self.counts = {"separable": 0, "pruned": 0, "fixed": 0, "eliminated": 0, "merged": 0}
        for scope, table in factors:
            if len(scope) == 2 and scope[0] < scope[1] and scope not in self.by_scope:
                self._new_factor(scope, table)
            else:
                self._add(scope, table, lambda v: None)
        self.describe = describe
        self.elimination_limit = ELIMINATION_LIMIT
        self.limit = memory_limit
        self.tol = tol
        self.rows = rows
        self.item_var = item_var
        self.item_mem = item_mem
        self.item_min = np.array([float(m.min()) for m in item_mem]) if item_mem else np.zeros(0)
        self.item_max = np.array([float(m.max()) for m in item_mem]) if item_mem else np.zeros(0)
        self.items_of: list[list[int]] = [[] for _ in range(n)]
        self.active = np.zeros(0, dtype=np.int64)
        if memory_limit is not None and rows is not None and rows.count:
            self.active = np.nonzero(rows.r1 > rows.r0)[0]
            for i in self.active.tolist():
                self.items_of[item_var[i]].append(i)
        self.relevant_item = np.zeros(len(item_mem), dtype=bool)
        self.relevant_var = np.zeros(n, dtype=bool)
        self.binding = np.zeros(rows.count if rows is not None else 0, dtype=bool)
        self.row_min = np.zeros_like(self.binding, dtype=float)

    # -- factors ---------------------------------------------------------------------------------

    def _new_factor(self, scope: tuple[int, ...], table: np.ndarray) -> int:
        fid = self._next_id
        self._next_id += 1
        self.scope[fid] = scope
        self.table[fid] = table
        self.unchecked.add(fid)
        self.by_scope[scope] = fid
        for v in scope:
            self.of_var[v].add(fid)
        return fid

    def _set_table(self, fid: int, table: np.ndarray) -> None:
        self.table[fid] = table
        self.unchecked.add(fid)

    def _drop_factor(self, fid: int) -> None:
        scope = self.scope.pop(fid)
        del self.table[fid]
        self.unchecked.discard(fid)
        del self.by_scope[scope]
        for v in scope:
            self.of_var[v].discard(fid)

    def _add(self, scope: tuple[int, ...], table: np.ndarray, push: Callable[[int], None]) -> None:
        """Add a table over ``scope`` (any order) into the factors, merging where scopes nest."""
        if len(scope) == 0:
            self.constant += float(table)
            return
        if len(scope) == 1:
            self.cost[scope[0]] = self.cost[scope[0]] + table
            push(scope[0])
            return
        key = tuple(sorted(scope))
        if key != scope:
            table = align(scope, table, list(key))
        for v in key:
            push(v)
        fid = self.by_scope.get(key)
        if fid is not None:
            self._set_table(fid, self.table[fid] + table)
            self.counts["merged"] += 1
            return
        members = set(key)
        pivot = min(key, key=lambda v: len(self.of_var[v]))
        for g in self.of_var[pivot]:
            if members <= set(self.scope[g]):
                self._set_table(g, self.table[g] + align(key, table, list(self.scope[g])))
                self.counts["merged"] += 1
                for v in self.scope[g]:
                    push(v)
                return
        inner = {g for v in key for g in self.of_var[v] if set(self.scope[g]) < members}
        for g in inner:
            table = table + align(self.scope[g], self.table[g], list(key))
            self._drop_factor(g)
            self.counts["merged"] += 1
        self._new_factor(key, np.ascontiguousarray(table))

    def neighbours(self, k: int) -> list[int]:
        return sorted({v for f in self.of_var[k] for v in self.scope[f]} - {k})

    # -- memory ----------------------------------------------------------------------------------

    def refresh_memory(self, all_binding: bool = False) -> list[int]:
        """Recompute which rows can bind and which variables carry relevant memory.

        Raises :class:`InfeasibleError` when a row exceeds the limit even with every live
        item at its smallest memory. Returns the live variables that have just lost all
        relevance (they may now be eliminated).
        """
        if self.limit is None or self.rows is None or not self.rows.count:
            return []
        act, rows = self.active, self.rows
        n_rows = rows.count
        r0, r1 = rows.r0[act], rows.r1[act]
        lo = range_sums(r0, r1, self.item_min[act], n_rows)
        worst = int(np.argmax(lo))
        if lo[worst] > self.limit + self.tol:
            raise InfeasibleError(
                f"at time step {int(rows.times[worst])} the live nodes need at least {lo[worst]:.6g} "
                f"bytes, over the memory limit of {self.limit:.6g}"
            )
        if all_binding:
            binding = np.ones(n_rows, dtype=bool)
        else:
            binding = range_sums(r0, r1, self.item_max[act], n_rows) > self.limit + self.tol
        prefix = np.concatenate([[0], np.cumsum(binding)])
        touches = prefix[r1] > prefix[r0]
        rel = touches & (self.item_max[act] > self.item_min[act])
        relevant_item = np.zeros_like(self.relevant_item)
        relevant_item[act[rel]] = True
        relevant_var = np.zeros_like(self.relevant_var)
        relevant_var[self.item_var[act[rel]]] = True
        freed = np.nonzero(self.relevant_var & ~relevant_var & self.alive)[0].tolist()
        self.relevant_item, self.relevant_var = relevant_item, relevant_var
        self.binding, self.row_min = binding, lo
        return freed

    def _update_items(self, k: int) -> None:
        for i in self.items_of[k]:
            m = self.item_mem[i][self.keep[k]]
            self.item_min[i] = m.min()
            self.item_max[i] = m.max()

    # -- the work list ---------------------------------------------------------------------------

    def run(self, deadline: float | None = None) -> None:
        """Apply every reduction until none fires, or until ``deadline`` (``time.perf_counter``).

        Each reduction leaves an exact, smaller problem, so stopping between two of them
        leaves a correct one that is only larger: the time limit of a solve holds even when
        reducing a large graph would take longer than the whole budget.
        """
        n = len(self.cost)
        queue = deque(range(n))
        queued = np.ones(n, dtype=bool)
        heap: list[tuple[int, int]] = []

        def push(k: int) -> None:
            if not queued[k] and self.alive[k]:
                queued[k] = True
                queue.append(k)

        def late() -> bool:
            return deadline is not None and time.perf_counter() > deadline

        self.refresh_memory()
        while True:
            while (queue or heap) and not late():
                while queue and not late():
                    k = queue.popleft()
                    queued[k] = False
                    self._process(k, push, heap)
                while heap and not queue and not late():
                    size, k = heapq.heappop(heap)
                    if self.alive[k] and not self.relevant_var[k] and self._elimination_size(k) == size > 0:
                        self._eliminate(k, push)
            freed = self.refresh_memory()
            if not freed or late():
                break
            for k in freed:  # they, and neighbours they blocked, may now be eliminated
                push(k)
                for v in self.neighbours(k):
                    push(v)
        logger.debug("reduction: %s; %d variables left", self.counts, int(self.alive.sum()))

    def _elimination_size(self, k: int) -> int:
        """Entries of the table eliminating ``k`` would create; 0 when it should not be done.

        Too large a table is refused outright. A table that would stay in the MILP (some
        neighbour has relevant memory and will not be eliminated) must also not make the
        MILP bigger than keeping ``k``: this is what keeps ``k``'s factors and strategies.
        """
        size = 1
        nbrs = self.neighbours(k)
        for v in nbrs:
            size *= len(self.keep[v])
        if size > self.elimination_limit:
            return 0
        if any(self.relevant_var[v] for v in nbrs):
            kept = len(self.keep[k]) + sum(self.table[f].size for f in self.of_var[k])
            if size > kept:
                return 0
        return size

    def _process(self, k: int, push: Callable[[int], None], heap: list[tuple[int, int]]) -> None:
        if not self.alive[k]:
            return
        for f in [f for f in self.of_var[k] if f in self.unchecked]:
            self.unchecked.discard(f)
            if len(self.scope[f]) == 2:
                a, b = self.scope[f]
                if self._absorb_if_separable(f):
                    push(b if a == k else a)
        if not self.relevant_var[k] and len(self.keep[k]) > 1:
            # To be minimised out, which subsumes dominance: prune only what is too big for that.
            size = self._elimination_size(k)
            if size:
                heapq.heappush(heap, (size, k))
                return
        if self._prune(k, push):
            for v in self.neighbours(k):
                push(v)
        if len(self.keep[k]) == 1:
            self._fix(k, push)
        elif not self.relevant_var[k]:
            size = self._elimination_size(k)
            if size:
                heapq.heappush(heap, (size, k))

    def _absorb_if_separable(self, f: int) -> bool:
        m = self.table[f]
        if not np.isfinite(m).all():
            return False
        r = m[:, 0]
        q = m[0, :] - m[0, 0]
        if np.abs(m - r[:, None] - q[None, :]).max() > _SEPARABLE_RTOL * np.abs(m).max():
            return False
        a, b = self.scope[f]
        self.cost[a] = self.cost[a] + r
        self.cost[b] = self.cost[b] + q
        self._drop_factor(f)
        self.counts["separable"] += 1
        return True

    def _prune(self, k: int, push: Callable[[int], None]) -> bool:
        """Drop forbidden and dominated strategies of ``k``; True when any went."""
        # This runs for every variable, often many times, mostly on a few strategies: it is
        # written to make few numpy calls (their overhead, not the comparisons, is its cost).
        c = self.cost[k]
        n = len(c)
        parts = [c[:, None]]
        starts = [0]  # where each part's columns begin
        for f in self.of_var[k]:
            t, axis = self.table[f], self.scope[f].index(k)
            starts.append(starts[-1] + parts[-1].shape[1])
            parts.append((np.swapaxes(t, 0, axis) if axis else t).reshape(n, -1))
        prof = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        # a strategy is forbidden by its own cost, or by a factor all of whose entries for it are
        forbidden = np.logical_and.reduceat(prof == np.inf, starts, axis=1).any(axis=1)
        if forbidden.all():
            raise InfeasibleError(f"{self.describe(k)} has no allowed strategy (all cost infinity)")
        if n == 1:
            return False
        if self.relevant_var[k]:
            rel = [i for i in self.items_of[k] if self.relevant_item[i]]
            if rel:
                mems = np.array([self.item_mem[i] for i in rel])[:, self.keep[k]]
                prof = np.concatenate([prof, mems.T], axis=1)
        # le[a, b]: b is no worse than a everywhere; b is better somewhere exactly when not le[b, a].
        # b dominates a when it is no worse and better somewhere, or the same with a lower index.
        le = _no_worse(prof)
        dom = le & (~le.T | _earlier(n))
        drop = dom.any(axis=1) | forbidden
        if not drop.any():
            return False
        mask = ~drop
        self.counts["pruned"] += int(drop.sum())
        self.keep[k] = self.keep[k][mask]
        self.cost[k] = c[mask]
        for f in self.of_var[k]:
            self._set_table(f, np.compress(mask, self.table[f], axis=self.scope[f].index(k)))
        self._update_items(k)
        return True

    def _fix(self, k: int, push: Callable[[int], None]) -> None:
        for f in list(self.of_var[k]):
            scope, table = self.scope[f], self.table[f]
            self._drop_factor(f)
            axis = scope.index(k)
            self._add(scope[:axis] + scope[axis + 1 :], table.take(0, axis=axis), push)
        self.constant += float(self.cost[k][0])
        self.records.append(Record(k, (), (), np.array(self.keep[k][0])))
        self.alive[k] = False
        self.counts["fixed"] += 1

    def _eliminate(self, k: int, push: Callable[[int], None]) -> None:
        nbrs = self.neighbours(k)
        axes = nbrs + [k]
        total = align((k,), self.cost[k], axes)
        for f in list(self.of_var[k]):
            total = total + align(self.scope[f], self.table[f], axes)
            self._drop_factor(f)
        total = np.broadcast_to(total, tuple(len(self.keep[v]) for v in axes))
        best = total.min(axis=-1)
        if np.isposinf(best).all():
            raise InfeasibleError(
                f"{self.describe(k)} has no allowed strategy"
                + (
                    " (all cost infinity)"
                    if np.isposinf(self.cost[k]).all()
                    else " next to its neighbours' allowed ones"
                )
            )
        # keep arrays are replaced, never changed in place, so holding them is a snapshot
        self.records.append(
            Record(k, tuple(nbrs), tuple(self.keep[v] for v in nbrs), self.keep[k][total.argmin(axis=-1)])
        )
        self.alive[k] = False
        self.counts["eliminated"] += 1
        self._add(tuple(nbrs), best, push)

    # -- results ---------------------------------------------------------------------------------

    def core(self) -> CoreProblem:
        """The variables still undecided, their factors, and the memory rows that can bind."""
        ids = np.nonzero(self.alive)[0]
        local = np.full(len(self.cost), -1, dtype=np.int64)
        local[ids] = np.arange(len(ids))
        factors = [(tuple(int(local[v]) for v in self.scope[f]), self.table[f]) for f in sorted(self.scope)]
        cap = np.zeros(0)
        times = np.zeros(0, dtype=np.int64)
        item_var = item_r0 = item_r1 = np.zeros(0, dtype=np.int64)
        coefs: list[np.ndarray] = []
        if self.limit is not None and self.rows is not None and self.rows.count and self.binding.any():
            prefix = np.concatenate([[0], np.cumsum(self.binding)])
            cap = self.limit - self.row_min[self.binding]
            times = self.rows.times[self.binding]
            its = self.active[self.relevant_item[self.active] & self.alive[self.item_var[self.active]]]
            item_var = local[self.item_var[its]]
            item_r0 = prefix[self.rows.r0[its]]
            item_r1 = prefix[self.rows.r1[its]]
            coefs = [
                self.item_mem[i][self.keep[v]] - self.item_min[i]
                for i, v in zip(its.tolist(), self.item_var[its].tolist(), strict=True)
            ]
        return CoreProblem(
            var_ids=ids,
            keep=[self.keep[k] for k in ids.tolist()],
            costs=[self.cost[k] for k in ids.tolist()],
            factors=factors,
            constant=self.constant,
            cap=cap,
            row_times=times,
            item_var=item_var,
            item_r0=item_r0,
            item_r1=item_r1,
            item_coef=coefs,
        )

    def expand(self, core: CoreProblem, local_choice: np.ndarray) -> np.ndarray:
        """Original strategy index per reducer variable, from local choices of the core."""
        choice = np.full(len(self.cost), -1, dtype=np.int64)
        for i, k in enumerate(core.var_ids.tolist()):
            choice[k] = core.keep[i][local_choice[i]]
        for rec in reversed(self.records):
            pos = tuple(
                int(np.searchsorted(snap, choice[b])) for b, snap in zip(rec.nbrs, rec.snaps, strict=True)
            )
            choice[rec.var] = rec.table[pos]
        return choice


@functools.cache
def _earlier(n: int) -> np.ndarray:
    """``[a, b]``: strategy ``b`` comes before ``a`` (ties in dominance keep the lowest index)."""
    return np.tri(n, k=-1, dtype=bool)
