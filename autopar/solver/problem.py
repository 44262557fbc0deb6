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


@dataclass
class Solution:
    """One strategy index per node, with how sure the solver is about it.

    ``status`` is "optimal", "feasible" (time limit hit: the best answer found, with
    ``gap`` against the solver's bound when it has one), "infeasible" (``choice`` empty,
    ``objective`` inf; with a memory limit, ``stats["min_peak_memory"]`` is the smallest
    peak any choice reaches) or "unknown" (time ran out before any answer was found).
    """

    choice: list[int]
    objective: float
    status: str
    gap: float | None
    solve_time_s: float
    backend: str
    stats: dict = field(default_factory=dict)
