"""Thinning the memory rows the reductions leave: a row implied by another is dropped.

The MILP's size grows with every memory row it holds, and after the reductions
many binding rows are implied by another one (a subset of its live items, a
capacity no smaller). :func:`prune_rows` finds those in two passes: by the
items' live ranges alone, then, when few variables remain, by comparing rows as
dense vectors of per-variable coefficients.
"""

from __future__ import annotations

import heapq

import numpy as np

from autopar.solver.core_problem import CoreProblem
from autopar.solver.memory_rows import range_sums

# Rows are compared a block of this many at a time: small temporaries stay in cache.
_BLOCK = 256


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``min(values[lo:hi])`` per query (inf for an empty range), with a sparse table."""
    out = np.full(len(lo), np.inf)
    if not len(values):
        return out
    levels = [values]
    while 2 ** len(levels) <= len(values):
        prev, step = levels[-1], 2 ** (len(levels) - 1)
        levels.append(np.minimum(prev[:-step], prev[step:]))
    ok = hi > lo
    length = (hi - lo)[ok]
    k = np.floor(np.log2(length)).astype(np.int64)
    table_lo = np.empty(len(length))
    table_hi = np.empty(len(length))
    for level in np.unique(k).tolist():
        sel = k == level
        table_lo[sel] = levels[level][lo[ok][sel]]
        table_hi[sel] = levels[level][hi[ok][sel] - 2**level]
    out[ok] = np.minimum(table_lo, table_hi)
    return out


def _running_sums(
    prefix: np.ndarray,
    r0: np.ndarray,
    r1: np.ndarray,
    col: np.ndarray,
    val: np.ndarray,
    used: np.ndarray,
    n_rows: int,
) -> np.ndarray:
    """Per kept row and used column, the sum of the (item, strategy) entries live there.

    Built in place (at 10^7 entries a fresh array costs more in page faults than the sums);
    entries are added in their given order, zeros left out, so every sum is the one a
    full-width matrix holds.
    """
    nonzero = val != 0
    where = np.searchsorted(used, col[nonzero])
    dense = np.zeros((n_rows + 1, len(used)))
    np.add.at(dense, (prefix[r0[nonzero]], where), val[nonzero])
    np.add.at(dense, (prefix[r1[nonzero]], where), -val[nonzero])
    return np.cumsum(dense[:-1], axis=0, out=dense[:-1])


def prune_rows(core: CoreProblem, dense_budget: float = 2e8) -> CoreProblem:
    """Drop memory rows implied by another row, and re-index the items' row ranges.

    Row ``j`` is implied by row ``i`` when every item live at ``j`` is live at ``i`` and
    ``cap_i <= cap_j`` (coefficients are non-negative). Items are intervals of rows, so the
    rows whose live set contains ``j``'s form the range ``[max r0, min r1)`` over ``j``'s
    items, and a range minimum of ``cap`` finds a dominating row. When few variables remain
    (repeated layers grouped into one variable), rows are also compared as dense vectors
    of per-variable coefficients, each shifted so its smallest entry is zero (valid because
    every variable takes exactly one strategy): this catches rows with different items but
    the same totals, the usual case once the layers share variables.
    """
    if len(core.cap) <= 1:
        return core
    keep = _not_implied_by_ranges(core)
    x0 = np.concatenate([[0], np.cumsum(core.sizes)]).astype(np.int64)
    keep = _not_implied_by_chains(core, keep, x0)
    kept = np.nonzero(keep)[0]
    if len(kept) > 1 and float(len(kept)) * x0[-1] <= 2e7:
        keep = _not_implied_by_totals(core, keep, x0, dense_budget)
    if keep.all():
        return core
    return _without_rows(core, keep)


def _live_range_bounds(core: CoreProblem) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the smallest end and the largest start of the items live there (-1 start: none)."""
    n_rows = len(core.cap)
    order = np.argsort(core.item_r0, kind="stable")
    starts, ends = core.item_r0[order].tolist(), core.item_r1[order].tolist()
    first_end = np.full(n_rows, n_rows + 1, dtype=np.int64)
    last_start = np.full(n_rows, -1, dtype=np.int64)
    by_end: list[tuple[int, int]] = []  # (r1, r0) of items started
    by_start: list[tuple[int, int]] = []  # (-r0, r1)
    t = 0
    for j in range(n_rows):
        while t < len(starts) and starts[t] <= j:
            heapq.heappush(by_end, (ends[t], starts[t]))
            heapq.heappush(by_start, (-starts[t], ends[t]))
            t += 1
        while by_end and by_end[0][0] <= j:
            heapq.heappop(by_end)
        while by_start and by_start[0][1] <= j:
            heapq.heappop(by_start)
        if by_end:
            first_end[j] = by_end[0][0]
            last_start[j] = -by_start[0][0]
    return first_end, last_start


def _not_implied_by_ranges(core: CoreProblem) -> np.ndarray:
    """The rows no other row implies by holding all their items with no larger capacity."""
    n_rows = len(core.cap)
    first_end, last_start = _live_range_bounds(core)
    empty = last_start < 0
    rows = np.arange(n_rows)
    lo = np.where(empty, 0, last_start)
    hi = np.where(empty, n_rows, first_end)
    # a strictly smaller cap anywhere in the range, or an equal one at a smaller index
    before = _range_min(core.cap, lo, np.maximum(rows, lo))
    after = _range_min(core.cap, np.minimum(rows + 1, hi), hi)
    return ~empty & ~(before <= core.cap) & ~(after < core.cap)


# Two rows match when they agree to this fraction of the largest coefficient sum.
_MATCH_RTOL = 1e-9


# Directions a midpoint found on two projections is checked on. A row that is not the
# midpoint agrees on all of them only if its difference from the midpoint is orthogonal to
# each, which for Gaussian directions has probability zero; and whatever answer the rows
# admit is checked against the exact peak (``solve_strategies``) anyway.
_CHECK_DIRECTIONS = 8


def _projections(core: CoreProblem, x0: np.ndarray, count: int = 2, seed: int = 0) -> np.ndarray:
    """Each row's coefficient vector projected on ``count`` fixed pseudo-random directions: (rows, count)."""
    width = int(x0[-1])
    directions = np.random.default_rng(seed).standard_normal((width, count))
    weights = np.array(
        [core.item_coef[i] @ directions[x0[v] : x0[v + 1]] for i, v in enumerate(core.item_var.tolist())]
    ).reshape(-1, count)
    n_rows = len(core.cap)
    return np.stack([range_sums(core.item_r0, core.item_r1, weights[:, c], n_rows) for c in range(count)], axis=1)


# Rows sampled to find the distances at which midpoints lie (one layer's rows, forward and backward).
_SAMPLED_ROWS = 64
_DISTANCES = 8


def _distances(proj: np.ndarray, tol: float) -> list[int]:
    """The distances d at which sampled rows are midpoints of the rows d before and after them.

    Trying every d on every row is quadratic in the rows; a stack's rows repeat with one
    period in the forward and one in the backward, so the smallest d of a sample of rows
    finds them. The ``_DISTANCES`` most frequent, in increasing order.
    """
    n = len(proj)
    found: list[int] = []
    for j in np.unique(np.linspace(1, n - 2, min(_SAMPLED_ROWS, n - 2)).astype(np.int64)).tolist():
        d = np.arange(1, min(j, n - 1 - j) + 1)
        close = np.abs(proj[j - d] + proj[j + d] - 2 * proj[j]).max(axis=1) <= tol
        apart = np.abs(proj[j - d] - proj[j + d]).max(axis=1) > tol
        hits = d[close & apart]
        if len(hits):
            found.append(int(hits[0]))
    counts = np.bincount(found, minlength=1) if found else np.zeros(1, dtype=np.int64)
    top = [int(d) for d in np.argsort(-counts, kind="stable")[:_DISTANCES] if counts[d] > 0]
    return sorted(top)


def _not_implied_by_chains(core: CoreProblem, keep: np.ndarray, x0: np.ndarray) -> np.ndarray:
    """``keep`` without the kept rows that are the midpoint of two other kept rows.

    In a stack of L repeated layers whose copies share variables, the row at one position
    of layer i holds i copies of the layer's saved activations and L - 1 - i copies of
    its gradients: an affine function of i, so the rows of the first and last layers imply
    all the others. Row j with coefficients a_j and capacity c_j is implied by rows i, k
    when a_j = (a_i + a_k) / 2 and c_j >= (c_i + c_k) / 2 (average their inequalities).
    Dropping every such row at once is safe when a_i != a_k: the midpoint of two distinct
    vectors is strictly nearer a fixed centre than the farther of them, so each dropped
    row is implied by rows farther out, and the farthest rows are never dropped. The
    partners are looked for at equal distances d before and after j in row order (rows of
    consecutive layers lie one layer's rows apart), matched on two random projections,
    then checked on ``_CHECK_DIRECTIONS`` more.
    """
    kept = np.nonzero(keep)[0]
    n = len(kept)
    if n < 3:
        return keep
    proj = _projections(core, x0)[kept]
    cap = core.cap[kept]
    scale = max(float(np.abs(proj).max()), 1.0)
    cap_tol = _MATCH_RTOL * max(float(np.abs(cap).max()), 1.0)
    partner = np.zeros(n, dtype=np.int64)  # the smallest distance d that makes j a midpoint; 0: none
    for d in _distances(proj, _MATCH_RTOL * scale):
        mid = np.arange(d, n - d)
        open_ = partner[mid] == 0
        if not open_.any():
            continue
        close = np.abs(proj[mid - d] + proj[mid + d] - 2 * proj[mid]).max(axis=1) <= _MATCH_RTOL * scale
        apart = np.abs(proj[mid - d] - proj[mid + d]).max(axis=1) > _MATCH_RTOL * scale
        roomy = cap[mid] >= (cap[mid - d] + cap[mid + d]) / 2 - cap_tol
        partner[mid[open_ & close & apart & roomy]] = d
    found = np.nonzero(partner)[0]
    if not len(found):
        return keep
    check = _projections(core, x0, _CHECK_DIRECTIONS, seed=1)[kept]
    d = partner[found]
    a, b, c = check[found - d], check[found], check[found + d]
    tol = _MATCH_RTOL * max(float(np.abs(check).max()), 1.0)
    midpoint = (np.abs(a + c - 2 * b).max(axis=1) <= tol) & (np.abs(a - c).max(axis=1) > tol)
    out = keep.copy()
    out[kept[found[midpoint]]] = False
    return out


def _dense_rows(core: CoreProblem, keep: np.ndarray, x0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept rows as dense coefficient vectors over the columns some item touches, and those columns."""
    prefix = np.concatenate([[0], np.cumsum(keep)])
    n_kept = int(keep.sum())
    # per row and column, the items' coefficients: a difference array over the rows
    lengths = np.array([len(c) for c in core.item_coef], dtype=np.int64)
    item = np.repeat(np.arange(len(lengths)), lengths)
    col = x0[core.item_var[item]] + np.arange(len(item)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    val = np.concatenate(core.item_coef)
    # Only the columns some item touches can be non-zero: the matrix keeps those (in order,
    # so each variable's stay together), and is built in place, as at 10^7 entries a fresh
    # array costs more in page faults than the sums themselves.
    used = np.unique(col[val != 0])
    dense = _running_sums(prefix, core.item_r0[item], core.item_r1[item], col, val, used, n_kept)
    if (dense < 0).any():
        # rounding left a negative sum, so a variable's minimum may be below its untouched
        # columns' zero: keep every column, as the subtraction below will touch them all
        used = np.arange(int(x0[-1]))
        dense = _running_sums(prefix, core.item_r0[item], core.item_r1[item], col, val, used, n_kept)
    return dense, used


def _shift_to_zero_minima(
    core: CoreProblem, dense: np.ndarray, used: np.ndarray, x0: np.ndarray, cap: np.ndarray
) -> None:
    """Per row, subtract each variable's smallest coefficient from its columns and from ``cap``, in place.

    A variable with an untouched (zero) column has a zero minimum (sums are non-negative
    now), and subtracting zero does nothing, so only variables whose columns are all used
    are shifted.
    """
    var_of_used = np.searchsorted(x0, used, side="right") - 1
    full = np.bincount(var_of_used, minlength=core.n) == core.sizes
    seg = np.searchsorted(var_of_used, np.arange(core.n + 1))
    for i in np.nonzero(full)[0].tolist():
        low = dense[:, seg[i] : seg[i + 1]].min(axis=1)
        if low.any():
            dense[:, seg[i] : seg[i + 1]] -= low[:, None]
            cap -= low


def _row_totals(dense: np.ndarray, used: np.ndarray, width: int) -> np.ndarray:
    """Row totals over all the columns, zeros included, summed as one row-major matrix would be."""
    n = len(dense)
    totals = np.empty(n)
    block = np.zeros((min(_BLOCK, n), width))
    for a in range(0, n, _BLOCK):
        rows_ = dense[a : a + _BLOCK]
        block[: len(rows_), used] = rows_
        totals[a : a + _BLOCK] = block[: len(rows_)].sum(axis=1)
    return totals


def _not_implied_by_totals(core: CoreProblem, keep: np.ndarray, x0: np.ndarray, dense_budget: float) -> np.ndarray:
    """``keep`` without the rows another kept row dominates as a dense, shifted coefficient vector.

    Rows with the most slack are tried first as the dominating one; the comparisons stop
    once ``dense_budget`` entries (counted as if every column were kept) have been compared.
    """
    kept = np.nonzero(keep)[0]
    width = int(x0[-1])
    dense, used = _dense_rows(core, keep, x0)
    cap = core.cap[kept].copy()
    _shift_to_zero_minima(core, dense, used, x0, cap)
    totals = _row_totals(dense, used, width)
    alive = np.ones(len(kept), dtype=bool)
    budget = dense_budget
    for r in np.argsort(cap - totals).tolist():
        if budget <= 0:
            break
        if alive[r]:
            dominated = np.zeros(len(kept), dtype=bool)
            for a in range(0, len(kept), _BLOCK):
                dominated[a : a + _BLOCK] = (dense[a : a + _BLOCK] <= dense[r]).all(axis=1)
            dominated &= cap >= cap[r]
            dominated[r] = False
            alive &= ~dominated
            budget -= len(kept) * width  # as if all the columns were kept
    out = np.zeros(len(keep), dtype=bool)
    out[kept[alive]] = True
    return out


def _without_rows(core: CoreProblem, keep: np.ndarray) -> CoreProblem:
    """``core`` with only the rows in ``keep``; items live at none of them are dropped."""
    prefix = np.concatenate([[0], np.cumsum(keep)])
    r0, r1 = prefix[core.item_r0], prefix[core.item_r1]
    live = r1 > r0
    return CoreProblem(
        var_ids=core.var_ids,
        keep=core.keep,
        costs=core.costs,
        factors=core.factors,
        constant=core.constant,
        cap=core.cap[keep],
        row_times=core.row_times[keep],
        item_var=core.item_var[live],
        item_r0=r0[live],
        item_r1=r1[live],
        item_coef=[c for c, ok in zip(core.item_coef, live.tolist(), strict=True) if ok],
    )
