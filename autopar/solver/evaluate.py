"""Exact evaluation of a choice on the original problem: its objective and its peak memory.

Every answer, whichever step found it on the reduced problem, is mapped back to
the nodes and checked here before it is returned, so that what the caller gets
is costed on the problem it passed in.
"""

from __future__ import annotations

import math

import numpy as np

from autopar.solver.problem import StrategyProblem


def objective_of(p: StrategyProblem, choice: list[int]) -> float:
    """The total cost of ``choice``, node and edge terms summed exactly (``math.fsum``)."""
    terms = [p.node_costs[v][s] for v, s in enumerate(choice)]
    terms += [
        p.edge_costs[e][choice[u] * len(p.node_costs[v]) + choice[v]] for e, (u, v) in enumerate(p.edges)
    ]
    return math.fsum(terms)


def peak_memory_of(p: StrategyProblem, choice: list[int]) -> float:
    """Largest total memory of the live nodes over all time steps for this choice."""
    if not choice:
        return 0.0
    nodes, iv, item_mem = p.items()
    mem = np.array([m[choice[v]] for v, m in zip(nodes.tolist(), item_mem, strict=True)], dtype=float)
    live = iv[:, 1] > iv[:, 0]
    if not live.any():
        return 0.0
    horizon = int(iv[live, 1].max())
    delta = np.bincount(iv[live, 0], mem[live], minlength=horizon + 1)
    delta -= np.bincount(iv[live, 1], mem[live], minlength=horizon + 1)
    return float(max(np.cumsum(delta[:horizon]).max(), 0.0))
