"""How the strategy solver scales: random transformer-shaped problems of 1k to 30k nodes.

    .venv/bin/python benchmarks/solver_scale.py                    (1k, 10k, 30k; a few minutes)
    .venv/bin/python benchmarks/solver_scale.py --sizes 1000 --groups --backend scip

Each problem is a stack of blocks shaped like a transformer layer's joint graph: a
forward chain (norm, qkv, attention, projection, residual add, norm, fc1, activation,
fc2, residual add) with the residual skip edges, four weight nodes per block feeding
their matmuls, and the backward chain in reverse, each backward node also reading its
forward node's saved output. Every node has four strategies (replicate, two 2-way
shardings, one 4-way) whose compute time and memory fall with the shard count while a
collective is added to the sharded ones; edge matrices charge a resharding cost when
the two ends differ. Saved activations live from their forward node to their backward
node, weights for the whole step, everything else for two steps.

Every size is solved without a memory limit, then with a limit halfway between the
smallest achievable peak and the peak of the unconstrained optimum. ``--groups`` ties
each position of a block across all blocks (repeated layers sharing one variable set).

Columns: nodes before and after reduction; the MILP's variables and rows; how memory
rows were written; seconds in reduction, in the solver and in all; the status returned,
who settled it ("reduction" when nothing was left for a solver), what the solver said
(LP_* when only the relaxation was solved); the gap to the best lower bound; and how far
the best heuristic answer was above the returned one.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.solver import StrategyProblem, solve_strategies  # noqa: E402

FORWARD = ["ln1", "qkv", "attn", "proj", "add1", "ln2", "fc1", "act", "fc2", "add2"]
WEIGHTS = {"qkv": 3.0, "proj": 1.0, "fc1": 4.0, "fc2": 4.0}  # relative parameter sizes
SAVED = {"ln1", "qkv", "attn", "ln2", "fc1", "act"}  # outputs the backward pass reads
SHARDS = np.array([1.0, 2.0, 2.0, 4.0])
NODES_PER_BLOCK = 2 * len(FORWARD) + len(WEIGHTS)


def make_problem(n_nodes: int, seed: int = 0, groups: bool = False) -> StrategyProblem:
    """A random stack of blocks with about ``n_nodes`` nodes (see the module docstring)."""
    rng = np.random.default_rng(seed)
    blocks = max(1, round(n_nodes / NODES_PER_BLOCK))
    names: list[str] = []
    costs: list[list[float]] = []
    memory: list[list[float]] = []
    edges: list[tuple[int, int]] = []
    edge_costs: list[list[float]] = []
    position: list[int] = []  # index within the block, for groups

    def node(name: str, flops: float, act_bytes: float, pos: int) -> int:
        comm = np.concatenate([[0.0], rng.random(3) * act_bytes * 2e-12])
        costs.append((flops * 1e-14 / SHARDS * (1 + 0.2 * rng.random(4)) + comm).tolist())
        memory.append((act_bytes / SHARDS).tolist())
        names.append(name)
        position.append(pos)
        return len(costs) - 1

    def edge(u: int, v: int, act_bytes: float) -> None:
        m = rng.random((4, 4)) * act_bytes * 4e-12
        np.fill_diagonal(m, 0.0)
        edges.append((u, v))
        edge_costs.append(m.ravel().tolist())

    fwd_nodes: list[dict[str, int]] = []
    weight_nodes: list[int] = []
    prev = -1
    for b in range(blocks):
        ids: dict[str, int] = {}
        block_input = prev
        for i, name in enumerate(FORWARD):
            act = float(rng.integers(1, 8)) * 2**24
            ids[name] = node(f"layers.{b}.{name}", act * 64 * rng.random(), act, i)
            if prev >= 0:
                edge(prev, ids[name], act)
            prev = ids[name]
            if name == "add1" and block_input >= 0:
                edge(block_input, ids[name], act)
            if name == "add2":
                edge(ids["add1"], ids[name], act)
        for j, (name, size) in enumerate(WEIGHTS.items()):
            w = node(f"layers.{b}.{name}.weight", 0.0, size * 2**26, len(FORWARD) + j)
            weight_nodes.append(w)
            edge(w, ids[name], size * 2**26)
        fwd_nodes.append(ids)
    bwd_of: dict[int, int] = {}
    for b in reversed(range(blocks)):
        for i, name in reversed(list(enumerate(FORWARD))):
            f = fwd_nodes[b][name]
            act = memory[f][0]
            g = node(
                f"layers.{b}.{name}.backward", costs[f][0] * 2e14 * 2, act, len(FORWARD) + len(WEIGHTS) + i
            )
            edge(prev, g, act)
            edge(f, g, act)
            bwd_of[f] = g
            prev = g

    # Topological order is node creation order except that weights come before their blocks:
    # place forward nodes and weights at their creation step, backward nodes after all forward.
    horizon = len(costs)
    intervals: list[tuple[int, int]] = []
    for v, name in enumerate(names):
        if v in weight_nodes:
            intervals.append((0, horizon))
        elif v in bwd_of and name.split(".")[-1] in SAVED:
            intervals.append((v, bwd_of[v] + 1))
        else:
            intervals.append((v, v + 2))
    group_list = None
    if groups:
        by_pos: dict[int, list[int]] = {}
        for v, pos in enumerate(position):
            by_pos.setdefault(pos, []).append(v)
        group_list = list(by_pos.values())
    return StrategyProblem(costs, memory, intervals, edges, edge_costs, node_names=names, groups=group_list)


def peak_of(p: StrategyProblem, choice: list[int]) -> float:
    iv = np.asarray(p.node_intervals)
    mem = np.array([p.node_memory[v][s] for v, s in enumerate(choice)])
    delta = np.zeros(iv[:, 1].max() + 1)
    np.add.at(delta, iv[:, 0], mem)
    np.add.at(delta, iv[:, 1], -mem)
    return float(np.cumsum(delta).max())


def min_peak(p: StrategyProblem) -> float:
    return peak_of(p, [int(np.argmin(m)) for m in p.node_memory])


def row(label: str, p: StrategyProblem, time_limit: float, backend: str | None) -> str:
    start = time.perf_counter()
    sol = solve_strategies(p, time_limit_s=time_limit, backend=backend)
    wall = time.perf_counter() - start
    s = sol.stats
    gap = "-" if sol.gap is None else f"{sol.gap:.1e}"
    greedy = s.greedy_objective
    greedy_gap = (
        "-"
        if greedy is None or sol.status == "infeasible"
        else f"{(greedy - sol.objective) / sol.objective:+.1e}"
    )

    def shown(value: object, default: object = "-") -> object:
        return default if value is None else value

    return (
        f"| {label:<20} | {s.nodes:>6} | {shown(s.nodes_after_reduction):>6} | "
        f"{shown(s.milp_variables, 0):>7} | {shown(s.milp_constraints, 0):>7} | {shown(s.memory_form):<10} | "
        f"{shown(s.reduce_time_s, 0):>6.2f} | {shown(s.solver_time_s, 0):>6.2f} | {wall:>6.2f} | "
        f"{sol.status:<8} | {sol.backend:<9} | {shown(s.solver_status):<13} | {gap:>7} | {greedy_gap:>8} |"
    ), sol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 30000])
    parser.add_argument("--groups", action="store_true", help="also run with repeated layers grouped")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    print(
        "| problem              |  nodes | after  | MILP var | rows    | memory     | reduce | solver |  total | "
        "status   | backend   | solver said   |     gap | heur. Δ  |"
    )
    print("|" + "|".join("-" * w for w in (22, 8, 8, 9, 9, 12, 8, 8, 8, 10, 11, 15, 9, 10)) + "|")
    for n in args.sizes:
        for grouped in [False, True] if args.groups else [False]:
            p = make_problem(n, seed=args.seed, groups=grouped)
            tag = f"{n // 1000}k{' grouped' if grouped else ''}"
            line, free = row(f"{tag}", p, args.time_limit, args.backend)
            print(line, flush=True)
            lo, hi = min_peak(p), peak_of(p, free.choice)
            p.memory_limit = lo + 0.5 * (hi - lo)
            line, _ = row(f"{tag} mem-limit", p, args.time_limit, args.backend)
            print(line, flush=True)


if __name__ == "__main__":
    main()
