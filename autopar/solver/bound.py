"""A lower bound on a reduced strategy problem without solving its MILP: min-sum diffusion.

When the MILP is too large to start in the time left (see
:func:`autopar.solver.solve.solve_strategies`) and memory pricing cannot solve the
priced problems exactly, the heuristics' answer would come back with no bound, so no
gap. This module gives one cheaply: the memory rows are dropped (a relaxation), and
the remaining cost, unaries plus factor tables, is *reparametrised* by min-sum
diffusion (Schlesinger; Werner, "A linear programming approach to max-sum problem",
2007). Moving cost between a variable and the factors it belongs to leaves every
assignment's total unchanged, and for any such split

    constant + sum_v min_s c'_v[s] + sum_f min f'

is at most the cost of every assignment, hence at most the optimum. Diffusion
repeatedly splits, for each variable in turn, its cost plus the min-marginals of its
factors evenly among them; the bound never decreases and converges to a point of the
dual of the local-polytope LP relaxation (the same relaxation the MILP's marginal rows
describe), tight on the chain-like graphs of transformer layers in a few sweeps.
"""

from __future__ import annotations

import time

import numpy as np

from autopar.solver.core_problem import CoreProblem


def diffusion_bound(core: CoreProblem, deadline: float, max_sweeps: int = 100, rtol: float = 1e-7) -> float:
    """A lower bound on ``core``'s optimum (memory ignored); sweeps until the deadline or it stalls.

    Infinite costs are replaced by a large finite penalty (lowering a cost keeps a bound
    valid), so the arithmetic stays finite.
    """
    finite = [np.abs(c[np.isfinite(c)]).sum() for c in core.costs]
    finite += [np.abs(t[np.isfinite(t)]).sum() for _, t in core.factors]
    big = 1e3 * (float(np.sum(finite)) + 1.0)
    costs = [np.where(np.isfinite(c), c, big) for c in core.costs]
    tables = [np.where(np.isfinite(t), t, big) for _, t in core.factors]
    # per variable: (factor, axis of the variable in it, shape broadcasting a vector along that axis)
    incident: list[list[tuple[int, int, tuple[int, ...]]]] = [[] for _ in range(core.n)]
    for f, (scope, table) in enumerate(core.factors):
        for axis, v in enumerate(scope):
            shape = [1] * table.ndim
            shape[axis] = table.shape[axis]
            incident[v].append((f, axis, tuple(shape)))

    def value() -> float:
        return core.constant + sum(float(c.min()) for c in costs) + sum(float(t.min()) for t in tables)

    def marginal(t: np.ndarray, axis: int) -> np.ndarray:
        return np.moveaxis(t, axis, 0).reshape(t.shape[axis], -1).min(axis=1)

    best = value()
    for _ in range(max_sweeps):
        if time.perf_counter() > deadline:
            break
        for v, inc in enumerate(incident):
            if not inc:
                continue
            mins = [marginal(tables[f], axis) for f, axis, _ in inc]
            share = (costs[v] + np.sum(mins, axis=0)) / (len(inc) + 1)
            costs[v] = share
            for (f, _, shape), m in zip(inc, mins, strict=True):
                tables[f] += (share - m).reshape(shape)
        bound = value()
        stalled = bound - best <= rtol * max(abs(bound), 1e-300)
        best = max(best, bound)
        if stalled:
            break
    return best
