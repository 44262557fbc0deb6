"""The solver core's input and output: a strategy graph and one strategy per node (see :mod:`autopar.solver.solve`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MEMORY_RTOL = 1e-9
"""Relative tolerance on the memory limit: a peak up to ``M * (1 + MEMORY_RTOL)`` fits."""

@dataclass
class StrategyProblem:
    """A strategy graph: per-node strategy costs and memory, live intervals, edge cost matrices.

    Costs are seconds, memory is bytes. ``edge_costs[e]`` is row-major over
    ``(strategy of u, strategy of v)`` for ``edges[e] = (u, v)``. ``groups`` lists nodes
    that must take the same strategy index (repeated layers); overlapping groups merge.
    """

    node_costs: list[list[float]]
    node_memory: list[list[float]]
    node_intervals: list[tuple[int, int]]
    edges: list[tuple[int, int]]
    edge_costs: list[list[float]]
    memory_limit: float | None = None
    node_names: list[str] | None = None
    groups: list[list[int]] | None = None
    memory_items: list[tuple[int, tuple[int, int], list[float]]] | None = None

    def items(self) -> tuple[np.ndarray, np.ndarray, list[list[float]]]:
        """Every memory item: (node of each, (N, 2) live intervals, memory per strategy of its node).

        Items ``0..N-1`` are the nodes' own outputs; ``memory_items`` adds more, each
        ``(node, (start, end), memory per strategy of node)``: memory a node's choice holds
        over a second interval, such as an activation that one strategy keeps for the
        backward and another recomputes there.
        """
        extra = self.memory_items or []
        nodes = np.concatenate(
            [np.arange(len(self.node_costs), dtype=np.int64), np.array([v for v, _, _ in extra], dtype=np.int64)]
        )
        intervals = np.asarray(
            [*self.node_intervals, *(iv for _, iv, _ in extra)], dtype=np.int64
        ).reshape(len(nodes), 2)
        return nodes, intervals, [*self.node_memory, *(m for _, _, m in extra)]


STOP_REASONS = ("optimal", "gap target", "time limit", "infeasible", "no answer")
"""Why a solve stopped: proven optimal; proven within its gap target (``GAP_TARGET`` unless the caller set one) of its bound; out of
time with a larger gap (or none proved); proven that nothing fits; out of time with no answer."""

GAP_TARGET = 0.01
"""A solve with time left keeps improving its answer until the proven gap is at most this."""

PROVED_GAP = 1e-9
"""A gap this small (relative, rounding in the costs) is a proof: the answer is reported optimal."""


@dataclass
class SolverStats:
    """What a solve did and found, one named field per figure; ``None`` when a step did not run.

    Sizes come from the pipeline's steps (see :mod:`autopar.solver.solve`): the input, what
    the exact reductions left, the MILP built on it. Times are seconds of wall clock.
    ``budget_s`` is the time limit the call was given, ``used_s`` what it spent, and
    ``stop_reason`` (one of :data:`STOP_REASONS`) why it returned: together they show
    whether an answer came back early because it was proven good or because time ran out.
    """

    # the input and the reductions
    nodes: int | None = None
    edges: int | None = None
    variables: int | None = None
    strategies: int | None = None
    memory_rows: int | None = None
    nodes_after_reduction: int | None = None
    factors_after_reduction: int | None = None
    strategies_after_reduction: int | None = None
    binding_memory_rows: int | None = None
    memory_rows_after_reduction: int | None = None
    reduce_time_s: float | None = None
    # step 0: the problem without its memory limit (a lower bound; the answer when it fits)
    memory_free_bound: float | None = None
    memory_free_fits: bool | None = None
    memory_free_time_s: float | None = None
    # the heuristics: greedy, then memory priced into exact eliminations
    greedy_time_s: float | None = None
    greedy_objective: float | None = None  # the best heuristic answer, before the MILP
    priced_bound: float | None = None
    priced_objective: float | None = None
    priced_time_s: float | None = None
    # the whole MILP
    relaxation_only: bool | None = None  # only its LP relaxation was (or would have been) solved
    milp_nonzeros_at_least: int | None = None
    milp_constraints: int | None = None
    milp_variables: int | None = None
    milp_nonzeros: int | None = None
    memory_form: str | None = None
    build_time_s: float | None = None
    solver_status: str | None = None
    solver_time_s: float | None = None
    best_bound: float | None = None
    # large neighbourhood search (autopar.solver.lns)
    lns_rounds: int = 0
    lns_improvements: int = 0
    lns_time_s: float | None = None
    lns_start_objective: float | None = None
    # bounds and the answer
    diffusion_bound: float | None = None
    bound_time_s: float | None = None
    lower_bound: float | None = None
    peak_memory: float | None = None
    infeasible_reason: str | None = None
    min_peak_memory: float | None = None
    min_peak_memory_exact: bool | None = None
    # the budget
    budget_s: float | None = None
    used_s: float | None = None
    stop_reason: str | None = None
    # set by the mesh search when a seeded answer competes with the MILP's
    found_by: str | None = None
    milp_status: str | None = None
    milp_gap: float | None = None
    milp_objective: float | None = None
    seed_status: str | None = None
    seed_gap: float | None = None


@dataclass
class Solution:
    """One strategy index per node, with how sure the solver is about it.

    ``status`` is "optimal", "feasible" (time limit hit: the best answer found, with
    ``gap`` against the solver's bound when it has one), "infeasible" (``choice`` empty,
    ``objective`` inf; with a memory limit, ``stats.min_peak_memory`` is the smallest
    peak any choice reaches) or "unknown" (time ran out before any answer was found).
    """

    choice: list[int]
    objective: float
    status: str
    gap: float | None
    solve_time_s: float
    backend: str
    stats: SolverStats = field(default_factory=SolverStats)
