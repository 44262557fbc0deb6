"""The variable graph: what the solver works on in place of the nodes and edges.

Nodes of a group (repeated layers) share one strategy, so each group becomes one
variable whose cost is the sum of its members'; edges between the same two
variables become one matrix, and an edge inside a group lands on the diagonal of
its variable's costs. The reductions (:mod:`autopar.solver.reduce`) start here.
"""

from __future__ import annotations

import numpy as np

from autopar.solver.problem import StrategyProblem


def group_vars(p: StrategyProblem) -> tuple[np.ndarray, list[list[int]]]:
    """Variable of each node (groups share one; numbered by their smallest node) and members."""
    n = len(p.node_costs)
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for group in p.groups or []:
        root = find(int(group[0]))
        for v in group[1:]:
            r = find(int(v))
            if r != root:
                parent[r] = root
    var_of_node = np.empty(n, dtype=np.int64)
    members: list[list[int]] = []
    var_of_root: dict[int, int] = {}
    for v in range(n):
        r = find(v)
        k = var_of_root.setdefault(r, len(members))
        if k == len(members):
            members.append([])
        members[k].append(v)
        var_of_node[v] = k
    return var_of_node, members


def variable_graph(
    p: StrategyProblem, var_of_node: np.ndarray, members: list[list[int]]
) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray]]:
    """Per-variable costs and per-pair matrices (parallel edges summed, in-group edges on the diagonal)."""
    # repeated layers share cost lists: each list is converted once
    vectors: dict[int, np.ndarray] = {}

    def vector(row: list[float]) -> np.ndarray:
        got = vectors.get(id(row))
        if got is None:
            got = vectors[id(row)] = np.asarray(row, dtype=float)
        return got

    costs = [np.sum([vector(p.node_costs[v]) for v in vs], axis=0) for vs in members]
    mats: dict[tuple[int, int], np.ndarray] = {}
    arrays: dict[tuple[int, int, int], np.ndarray] = {}
    var_of = var_of_node.tolist()
    sizes = [len(c) for c in p.node_costs]
    for e, (u, v) in enumerate(p.edges):
        a, b = var_of[u], var_of[v]
        shape = (sizes[u], sizes[v])
        m = arrays.get((id(p.edge_costs[e]), *shape))
        if m is None:
            m = arrays[(id(p.edge_costs[e]), *shape)] = np.asarray(p.edge_costs[e], dtype=float).reshape(
                shape
            )
        if a == b:
            costs[a] = costs[a] + np.diagonal(m)
            continue
        key, m = ((a, b), m) if a < b else ((b, a), m.T)
        old = mats.get(key)
        mats[key] = m if old is None else old + m
    return costs, mats
