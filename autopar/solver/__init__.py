"""The torch-free solver core: choose one strategy per node of a strategy graph.

Public: :class:`StrategyProblem` (nodes with per-strategy cost and memory and a live
interval, edges with strategy-pair cost matrices, groups of nodes sharing a choice, a
memory limit), :func:`solve_strategies` (returns a :class:`Solution`: one strategy per
node, its objective, status and proven gap, and :class:`SolverStats`) and :func:`lower_bound`. The mathematics is
written out in :mod:`autopar.solver.solve`. Nothing here imports torch.
"""

from autopar.solver.problem import GAP_TARGET, MEMORY_RTOL, PROVED_GAP, Solution, SolverStats, StrategyProblem
from autopar.solver.solve import lower_bound, solve_strategies

__all__ = [
    "GAP_TARGET",
    "MEMORY_RTOL",
    "PROVED_GAP",
    "Solution",
    "SolverStats",
    "StrategyProblem",
    "lower_bound",
    "solve_strategies",
]
