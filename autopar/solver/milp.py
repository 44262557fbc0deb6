"""The marginal-form MILP of a reduced strategy problem, built as arrays.

Split from :mod:`autopar.solver.solve` (whose docstring states the formulation): the
model is assembled with numpy into CSR arrays, so building a model of millions of
nonzeros costs array time rather than one Python call per coefficient, and the same
arrays feed every backend (:mod:`autopar.solver.backends`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.solver.core_problem import CoreProblem
from autopar.solver.memory_rows import range_sums


@dataclass
class Milp:
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


def merge_coo(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n_cols: int) -> tuple[np.ndarray, ...]:
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


@dataclass
class _Factor:
    """A factor with its strategies gathered into classes that see the same costs.

    ``classes[a][s]`` is the class of strategy ``s`` of the scope's ``a``-th variable, and
    ``table`` is indexed by classes: strategies whose slices of the factor's table are equal
    (a node's strategies that place this input alike and differ elsewhere) share a class,
    and the factor's ``y`` is one per combination of classes rather than of strategies.
    """

    scope: tuple[int, ...]
    table: np.ndarray
    classes: list[np.ndarray]
    sizes: tuple[int, ...]  # strategies per variable of the scope


def compressed_factors(core: CoreProblem) -> list[_Factor]:
    """Every factor of ``core`` with the strategies of each scope variable gathered into classes.

    The marginal rows then tie each class's ``y`` sum to the sum of its strategies' ``x``.
    Exact, and as tight: a ``y`` over classes spreads over strategies in proportion to their
    ``x`` with the same cost and marginals.
    """
    out = []
    for scope, table in core.factors:
        t, classes = table, []
        for axis in range(table.ndim):
            slices = np.moveaxis(t, axis, 0).reshape(t.shape[axis], -1)
            _, first, inverse = np.unique(slices, axis=0, return_index=True, return_inverse=True)
            rank = np.empty(len(first), dtype=np.int64)
            rank[np.argsort(first)] = np.arange(len(first))  # classes numbered by first strategy
            classes.append(rank[np.asarray(inverse).ravel()])
            t = np.take(t, np.sort(first), axis=axis)
        out.append(_Factor(tuple(scope), t, classes, table.shape))
    return out


def _factor_rows(
    factors: list[_Factor], x0: np.ndarray, first_row: int, first_col: int
) -> tuple[list, ...]:
    """Marginal rows tying each factor's continuous ``y`` to the ``x`` of its scope.

    For every variable of the scope and each class ``c`` of its strategies: the ``y``
    entries whose assignment gives that variable class ``c`` sum to the ``x`` of the class's
    strategies. For all but the first variable the last class's row is implied and left out.
    Factors of the same shapes are built together with array arithmetic.
    """
    shapes = [f.table.shape for f in factors]
    n_entries = np.array([int(np.prod(s)) for s in shapes], dtype=np.int64)
    n_rows = np.array([s[0] + sum(d - 1 for d in s[1:]) for s in shapes], dtype=np.int64)
    y0 = first_col + np.concatenate([[0], np.cumsum(n_entries)]).astype(np.int64)
    base = first_row + np.concatenate([[0], np.cumsum(n_rows)]).astype(np.int64)
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    by_shape: dict[tuple, list[int]] = {}
    for k, f in enumerate(factors):
        by_shape.setdefault((f.table.shape, f.sizes), []).append(k)
    for (shape, _), fs in by_shape.items():
        sel = np.array(fs, dtype=np.int64)
        scopes = np.array([factors[k].scope for k in fs], dtype=np.int64)
        coords = np.unravel_index(np.arange(int(np.prod(shape))), shape)
        offset = 0
        for axis, d in enumerate(shape):
            kept = d if axis == 0 else d - 1
            mask = coords[axis] < kept
            entries = np.nonzero(mask)[0]
            rows.append((base[sel][:, None] + offset + coords[axis][mask][None, :]).ravel())
            cols.append((y0[sel][:, None] + entries[None, :]).ravel())
            vals.append(np.ones(len(sel) * len(entries)))
            cls = np.stack([factors[k].classes[axis] for k in fs])  # (factors, strategies)
            f_idx, s = np.nonzero(cls < kept)
            rows.append(base[sel][f_idx] + offset + cls[f_idx, s])
            cols.append(x0[scopes[f_idx, axis]] + s)
            vals.append(-np.ones(len(s)))
            offset += kept
    return rows, cols, vals, int(base[-1]), int(y0[-1])


def milp_nonzeros_at_least(core: CoreProblem) -> int:
    """The nonzeros :func:`build_milp` writes before any memory row: one per ``x`` in the
    one-strategy rows, and the factors' marginal rows as :func:`_factor_rows` writes them."""
    total = int(core.sizes.sum())
    for f in compressed_factors(core):
        entries = int(f.table.size)
        total += entries + f.sizes[0]  # the first variable: every entry once, one x per strategy
        for axis, d in enumerate(f.table.shape[1:], start=1):  # the others: all but the last class's row
            total += entries // d * (d - 1) + int((f.classes[axis] < d - 1).sum())
    return total


@dataclass
class _Parts:
    """The MILP's arrays as lists of pieces, appended step by step and concatenated once."""

    rows: list[np.ndarray]
    cols: list[np.ndarray]
    vals: list[np.ndarray]
    lb: list[np.ndarray]
    ub: list[np.ndarray]
    obj: list[np.ndarray]
    integer: list[np.ndarray]
    row_lb: list[np.ndarray]
    row_ub: list[np.ndarray]
    n_rows: int
    n_cols: int


@dataclass
class _MemoryEntries:
    """The (item, strategy) pairs with memory above the item's minimum, in units of the memory scale."""

    col: np.ndarray  # the x column of the pair
    r0: np.ndarray  # the item's first row
    r1: np.ndarray  # one past its last row
    val: np.ndarray

    @property
    def span(self) -> np.ndarray:
        return self.r1 - self.r0


def build_milp(core: CoreProblem, memory_scale: float, memory_form: str) -> Milp:
    """The marginal-form MILP of the core problem (see the module docstring)."""
    x0 = np.concatenate([[0], np.cumsum(core.sizes)]).astype(np.int64)
    factors = compressed_factors(core)
    cost = np.concatenate(core.costs + [f.table.ravel() for f in factors])
    scale = _objective_scale(cost)
    parts = _choice_and_factor_parts(core, factors, x0, cost, scale)
    form = "none"
    if len(core.cap) and len(core.item_coef):
        entries = _memory_entries(core, x0, memory_scale)
        form = _memory_form(memory_form, len(core.cap), entries)
        if form == "direct":
            _add_direct_rows(parts, core.cap / memory_scale, entries, int(x0[-1]))
        else:
            _add_cumulative_rows(parts, core.cap / memory_scale, entries)
    return _assemble(parts, core.constant, scale, memory_scale, int(x0[-1]), form)


def _choice_and_factor_parts(
    core: CoreProblem, factors: list[_Factor], x0: np.ndarray, cost: np.ndarray, scale: float
) -> _Parts:
    """One strategy per variable, then the factors' marginals; the columns are every x, then every y."""
    n, sizes, n_x = core.n, core.sizes, int(x0[-1])
    finite = np.isfinite(cost)
    f_rows, f_cols, f_vals, n_rows, n_cols = _factor_rows(factors, x0, n, n_x)
    return _Parts(
        rows=[np.repeat(np.arange(n), sizes), *f_rows],
        cols=[np.arange(n_x), *f_cols],
        vals=[np.ones(n_x), *f_vals],
        lb=[np.zeros(n_cols)],
        ub=[np.where(finite, 1.0, 0.0)],
        obj=[np.where(finite, cost * scale, 0.0)],
        integer=[np.arange(n_cols) < n_x],
        row_lb=[np.ones(n), np.zeros(n_rows - n)],
        row_ub=[np.ones(n), np.zeros(n_rows - n)],
        n_rows=n_rows,
        n_cols=n_cols,
    )


def _memory_entries(core: CoreProblem, x0: np.ndarray, memory_scale: float) -> _MemoryEntries:
    lengths = np.array([len(c) for c in core.item_coef], dtype=np.int64)
    pi = np.repeat(np.arange(len(lengths)), lengths)
    ps = np.arange(len(pi)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    pval = np.concatenate(core.item_coef) / memory_scale
    nonzero = pval > 0
    pi, ps, pval = pi[nonzero], ps[nonzero], pval[nonzero]
    return _MemoryEntries(x0[core.item_var[pi]] + ps, core.item_r0[pi], core.item_r1[pi], pval)


def _memory_form(memory_form: str, n_mem: int, entries: _MemoryEntries) -> str:
    """The form asked for, or under "auto" direct unless it holds over three times the cumulative's nonzeros."""
    if memory_form != "auto":
        return memory_form
    # entries of one variable in one row merge, so a row holds at most one per column
    merged = min(int(entries.span.sum()), n_mem * len(np.unique(entries.col)))
    return "direct" if merged <= 3 * (2 * len(entries.col) + 2 * n_mem) else "cumulative"


def _add_direct_rows(parts: _Parts, cap: np.ndarray, e: _MemoryEntries, n_x: int) -> None:
    """``sum_{live} m x <= cap`` per row."""
    n_mem, span = len(cap), e.span
    direct_nnz = int(span.sum())
    if n_mem * n_x <= direct_nnz:
        # many items per variable (grouped layers): sum them densely with a difference array
        delta = np.zeros((n_mem + 1, n_x))
        np.add.at(delta, (e.r0, e.col), e.val)
        np.add.at(delta, (e.r1, e.col), -e.val)
        dense = np.cumsum(delta[:-1], axis=0)
        mr, mc = np.nonzero(dense > 1e-12 * e.val.max())
        mv = dense[mr, mc]
    else:
        offs = np.arange(direct_nnz) - np.repeat(np.cumsum(span) - span, span)
        mr, mc, mv = merge_coo(
            np.repeat(e.r0, span) + offs, np.repeat(e.col, span), np.repeat(e.val, span), parts.n_cols
        )
    parts.row_lb.append(np.full(n_mem, -np.inf))
    parts.row_ub.append(cap)
    _add_memory_entries(parts, mr, mc, mv, n_mem)


def _add_cumulative_rows(parts: _Parts, cap: np.ndarray, e: _MemoryEntries) -> None:
    """``u_r - u_{r-1} - (entering) + (leaving) = 0``, with ``0 <= u_r <= cap_r``."""
    n_mem, n_cols = len(cap), parts.n_cols
    u = n_cols + np.arange(n_mem)
    leaves = e.r1 < n_mem
    mr = np.concatenate([e.r0, e.r1[leaves], np.arange(n_mem), np.arange(1, n_mem)])
    mc = np.concatenate([e.col, e.col[leaves], u, u[:-1]])
    mv = np.concatenate([-e.val, e.val[leaves], np.ones(n_mem), -np.ones(n_mem - 1)])
    mr, mc, mv = merge_coo(mr, mc, mv, n_cols + n_mem)
    parts.lb.append(np.zeros(n_mem))
    parts.ub.append(np.maximum(cap, 0.0))
    parts.obj.append(np.zeros(n_mem))
    parts.integer.append(np.zeros(n_mem, dtype=bool))
    parts.row_lb.append(np.zeros(n_mem))
    parts.row_ub.append(np.zeros(n_mem))
    _add_memory_entries(parts, mr, mc, mv, n_mem)


def _add_memory_entries(parts: _Parts, mr: np.ndarray, mc: np.ndarray, mv: np.ndarray, n_mem: int) -> None:
    keep = mv != 0
    parts.rows.append(mr[keep] + parts.n_rows)
    parts.cols.append(mc[keep])
    parts.vals.append(mv[keep])
    parts.n_rows += n_mem


def _assemble(parts: _Parts, constant: float, scale: float, memory_scale: float, n_x: int, form: str) -> Milp:
    """The pieces concatenated, the entries sorted by row then column into CSR."""
    all_rows = np.concatenate(parts.rows)
    all_cols = np.concatenate(parts.cols)
    order = np.lexsort((all_cols, all_rows))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(all_rows, minlength=parts.n_rows))]).astype(np.int64)
    return Milp(
        lb=np.concatenate(parts.lb),
        ub=np.concatenate(parts.ub),
        obj=np.concatenate(parts.obj),
        integer=np.concatenate(parts.integer),
        row_lb=np.concatenate(parts.row_lb),
        row_ub=np.concatenate(parts.row_ub),
        indptr=indptr,
        indices=all_cols[order].astype(np.int64),
        data=np.concatenate(parts.vals)[order].astype(float),
        offset=constant * scale,
        scale=scale,
        memory_scale=memory_scale,
        n_x=n_x,
        memory_form=form,
    )


def hint_values(milp: Milp, core: CoreProblem, local: np.ndarray) -> np.ndarray:
    """A full assignment of the MILP's columns from a core choice (x, y, and u if present)."""
    values = np.zeros(len(milp.lb))
    x0 = np.concatenate([[0], np.cumsum(core.sizes)]).astype(np.int64)
    values[x0[:-1] + local] = 1.0
    col = milp.n_x
    for f in compressed_factors(core):
        at = tuple(int(f.classes[a][local[v]]) for a, v in enumerate(f.scope))
        values[col + np.ravel_multi_index(at, f.table.shape)] = 1.0
        col += f.table.size
    if milp.memory_form == "cumulative" and len(core.cap):
        picked = np.array([core.item_coef[t][local[i]] for t, i in enumerate(core.item_var.tolist())])
        usage = range_sums(core.item_r0, core.item_r1, picked, len(core.cap))
        values[col : col + len(core.cap)] = usage / milp.memory_scale
    return values
