"""The solver core on the IOPDDL contest problems, beside OR-tools CP-SAT given the same time.

    PYTHONPATH=. .venv/bin/python benchmarks/iopddl.py iopddl-problems                 # every problem there
    PYTHONPATH=. .venv/bin/python benchmarks/iopddl.py iopddl-problems/B.json.gz --time-scale 0.25

The problems are the ASPLOS 2025 / EuroSys 2025 contest's (github.com/google/iopddl,
``benchmarks/asplos-2025-iopddl-X.json.gz``); nothing is downloaded here. From a clone::

    mkdir -p iopddl-problems && for X in A B C D G K L M N P Q R S T U V; do
        git -C iopddl show HEAD:benchmarks/asplos-2025-iopddl-$X.json.gz > iopddl-problems/$X.json.gz; done

A file is named by its letter (``B.json.gz``) or keeps the contest's name; gzipped or not.
Each is solved with the contest's time limit for it (``iopddl-benchmark-details.png`` in
that repository), times ``--time-scale``.

The mapping onto :class:`~autopar.solver.StrategyProblem` is direct: IOPDDL's node
intervals are half-open ``[start, end)`` over time steps and a node's usage counts at
every step it is live, which is the solver core's own reading; strategy costs and usages
become node costs and memory, edge cost lists are row-major over the two nodes'
strategies as here, and the usage limit is the memory limit. A cost of 10^18 or more (the
contest's stand-in for "never") becomes infinity, a forbidden strategy or pair.

CP-SAT gets a model of the same problem. Up to ``ONE_HOT_MAX_ENTRIES`` edge entries:
Booleans ``x[v, s]`` with one true per node, and for each edge entry of positive cost a
Boolean ``y >= x[u, s] + x[v, t] - 1`` charged that cost (the objective pushes ``y``
down; costs are non-negative); forbidden entries as clauses. Past that (millions of
entries take minutes and gigabytes to build in Python): an integer ``s_v`` per node over its allowed
strategies, its cost by ``AddElement``; per edge an index ``S_v * s_u + s_v`` over the
allowed entries and its cost by ``AddElement``; per node its usage above its smallest by
``AddElement``, summed over each memory row (the locally largest live sets,
:func:`autopar.solver.reduce.memory_rows`) as a running sum against the limit less the
smallest usages (the same rows for the one-hot model, on ``s_v = sum_s s x[v, s]``). It
runs on 2 workers with the same time limit; the time to build its model is not counted.

Columns: the problem and its time limit; the solver core's cost (the contest's
evaluation, recomputed here), wall time, proven gap, status and why it stopped; CP-SAT's
cost and status; and the core's cost relative to CP-SAT's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.solver import StrategyProblem, solve_strategies  # noqa: E402
from autopar.solver.reduce import memory_rows  # noqa: E402

TIME_LIMITS_S = {
    **dict.fromkeys("ABCDE", 60),
    **dict.fromkeys("FGHIJ", 120),
    **dict.fromkeys("KLMNO", 180),
    **dict.fromkeys("PQRST", 240),
    **dict.fromkeys("UVWXY", 300),
}
"""The contest's time limit per problem, seconds."""

ONE_HOT_MAX_ENTRIES = 500_000
"""Up to this many edge entries CP-SAT gets one-hot Booleans; past it (minutes to build) elements."""

NEVER = 1e18
"""IOPDDL's cost for a strategy or pair that must not be chosen."""


def letter_of(path: Path) -> str:
    match = re.search(r"(?:iopddl-)?([A-Z])(?:\.json)", path.name)
    if match is None:
        raise ValueError(f"{path.name}: not an IOPDDL problem file (expected X.json[.gz] or asplos-2025-iopddl-X.json[.gz])")
    return match.group(1)


def read(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["problem"]


def to_strategy_problem(raw: dict) -> StrategyProblem:
    def costs(values: list[int]) -> list[float]:
        return [math.inf if c >= NEVER else float(c) for c in values]

    nodes, edges = raw["nodes"], raw["edges"]
    if any(len(e) != 2 for e in edges["nodes"]):
        raise ValueError("only edges between two nodes are supported")
    return StrategyProblem(
        node_costs=[costs(c) for c in nodes["costs"]],
        node_memory=[[float(u) for u in us] for us in nodes["usages"]],
        node_intervals=[(int(a), int(b)) for a, b in nodes["intervals"]],
        edges=[(int(u), int(v)) for u, v in edges["nodes"]],
        edge_costs=[costs(c) for c in edges["costs"]],
        memory_limit=float(raw["usage_limit"]) if "usage_limit" in raw else None,
    )


def evaluate(raw: dict, choice: list[int]) -> int | None:
    """The contest's evaluation (iopddl.cc, ``Evaluate``): total cost, or None when over the limit."""
    nodes, edges = raw["nodes"], raw["edges"]
    cost = sum(int(c[s]) for c, s in zip(nodes["costs"], choice, strict=True))
    sizes = [len(c) for c in nodes["costs"]]
    cost += sum(int(c[choice[u] * sizes[v] + choice[v]]) for (u, v), c in zip(edges["nodes"], edges["costs"], strict=True))
    if "usage_limit" in raw:
        iv = np.asarray(nodes["intervals"], dtype=np.int64)
        use = np.array([u[s] for u, s in zip(nodes["usages"], choice, strict=True)], dtype=object)
        horizon = int(iv[:, 1].max(initial=0))
        delta = [0] * (horizon + 1)
        for (a, b), u in zip(iv.tolist(), use.tolist(), strict=True):
            if b > a:
                delta[a] += u
                delta[b] -= u
        running, peak = 0, 0
        for d in delta:
            running += d
            peak = max(peak, running)
        if peak > int(raw["usage_limit"]):
            return None
    return cost


def cp_sat(raw: dict, time_limit_s: float, workers: int = 2) -> tuple[int | None, str, float, float]:
    """(cost or None, status, seconds to build the model, seconds solving) of CP-SAT's answer (module doc)."""
    from ortools.sat.python import cp_model

    built = time.perf_counter()
    edges = raw["edges"]
    model = cp_model.CpModel()
    entries = sum(len(c) for c in edges["costs"])
    if entries <= ONE_HOT_MAX_ENTRIES:
        choice, terms = _one_hot(model, raw)
    else:
        choice, terms = _by_element(model, raw)
    if "usage_limit" in raw:
        _memory_rows_cumulative(model, raw, choice)
    model.Minimize(sum(terms))
    build_s = time.perf_counter() - built
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    start = time.perf_counter()
    status = solver.Solve(model)
    solve_s = time.perf_counter() - start
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, name, build_s, solve_s
    return evaluate(raw, [int(solver.Value(s)) for s in choice]), name, build_s, solve_s


def _one_hot(model: object, raw: dict) -> tuple[list, list]:
    """Booleans ``x[v, s]``, one true per node; ``y >= x[u, s] + x[v, t] - 1`` per costly edge entry."""
    nodes, edges = raw["nodes"], raw["edges"]
    x, terms = [], []
    for costs in nodes["costs"]:
        xs = [model.NewBoolVar("") for _ in costs]
        model.AddExactlyOne(xs)
        for var, c in zip(xs, costs, strict=True):
            if c >= NEVER:
                model.Add(var == 0)
            elif c:
                terms.append(int(c) * var)
        x.append(xs)
    for (u, v), costs in zip(edges["nodes"], edges["costs"], strict=True):
        n_v = len(x[v])
        for k, c in enumerate(costs):
            if c:
                a, b = x[u][k // n_v], x[v][k % n_v]
                if c >= NEVER:
                    model.AddBoolOr([a.Not(), b.Not()])
                else:
                    y = model.NewBoolVar("")
                    model.AddBoolOr([a.Not(), b.Not(), y])
                    terms.append(int(c) * y)
    choice = []
    for xs in x:
        s = model.NewIntVar(0, len(xs) - 1, "")
        model.Add(s == sum(k * var for k, var in enumerate(xs)))
        choice.append(s)
    return choice, terms


def _by_element(model: object, raw: dict) -> tuple[list, list]:
    """An integer strategy per node; node and edge costs by ``AddElement`` over allowed entries."""
    from ortools.sat.python import cp_model

    nodes, edges = raw["nodes"], raw["edges"]
    choice, terms = [], []
    for costs in nodes["costs"]:
        allowed = [k for k, c in enumerate(costs) if c < NEVER] or [0]
        s = model.NewIntVarFromDomain(cp_model.Domain.FromValues(allowed), "")
        c = model.NewIntVar(min(costs[k] for k in allowed), max(costs[k] for k in allowed), "")
        model.AddElement(s, [min(int(x), costs[allowed[0]]) if x >= NEVER else int(x) for x in costs], c)
        choice.append(s)
        terms.append(c)
    sizes = [len(c) for c in nodes["costs"]]
    for (u, v), costs in zip(edges["nodes"], edges["costs"], strict=True):
        allowed = [k for k, c in enumerate(costs) if c < NEVER]
        if not allowed:
            model.AddBoolOr([])
            continue
        index = model.NewIntVarFromDomain(cp_model.Domain.FromValues(allowed), "")
        model.Add(index == sizes[v] * choice[u] + choice[v])
        finite = [costs[k] for k in allowed]
        c = model.NewIntVar(min(finite), max(finite), "")
        model.AddElement(index, [int(x) if x < NEVER else 0 for x in costs], c)
        terms.append(c)
    return choice, terms


def _memory_rows_cumulative(model: object, raw: dict, choice: list) -> None:
    """Usage per memory row as a running sum: ``u_r = u_{r-1} + entering - leaving <= limit - fixed_r``.

    Direct rows (every live node's usage in every row it is live in) hold 5 x 10^7 terms on
    problem A; the running sum holds each node twice.
    """
    nodes = raw["nodes"]
    iv = np.asarray(nodes["intervals"], dtype=np.int64).reshape(-1, 2)
    rows = memory_rows(iv)
    limit = int(raw["usage_limit"])
    base = [0] * (rows.count + 1)
    entering: list[list] = [[] for _ in range(rows.count)]
    leaving: list[list] = [[] for _ in range(rows.count + 1)]
    for i, us in enumerate(nodes["usages"]):
        r0, r1 = int(rows.r0[i]), int(rows.r1[i])
        if r1 <= r0:
            continue
        least = min(us)
        base[r0] += least
        base[r1] -= least
        if max(us) > least:
            m = model.NewIntVar(0, max(us) - least, "")
            model.AddElement(choice[i], [int(u - least) for u in us], m)
            entering[r0].append(m)
            leaving[r1].append(m)
    fixed = 0
    previous = None
    for r in range(rows.count):
        fixed += base[r]
        cap = limit - fixed
        if cap < 0:
            model.AddBoolOr([])  # nothing fits
            return
        u = model.NewIntVar(0, cap, "")
        flow = (previous if previous is not None else 0) + sum(entering[r]) - sum(leaving[r])
        model.Add(u == flow)
        previous = u


def problem_files(paths: list[Path]) -> list[Path]:
    found = []
    for p in paths:
        found += sorted(q for q in p.iterdir() if re.search(r"\.json(\.gz)?$", q.name)) if p.is_dir() else [p]
    return sorted(found, key=letter_of)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", type=Path, nargs="+", help="problem files, or directories of them")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies the contest's limits")
    parser.add_argument("--no-cp-sat", action="store_true", help="the solver core only")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    print("| problem | limit s | core cost | core s | gap | status | stopped | CP-SAT cost | CP-SAT | core/CP-SAT |")
    print("|---|--:|--:|--:|--:|---|---|--:|---|--:|")
    for path in problem_files(args.paths):
        letter = letter_of(path)
        limit = TIME_LIMITS_S[letter] * args.time_scale
        raw = read(path)
        problem = to_strategy_problem(raw)
        start = time.perf_counter()
        sol = solve_strategies(problem, time_limit_s=limit)
        wall = time.perf_counter() - start
        cost = evaluate(raw, sol.choice) if sol.choice else None
        gap = "-" if sol.gap is None else f"{100 * sol.gap:.2f}%"
        ref, ref_status = (None, "not run") if args.no_cp_sat else cp_sat(raw, limit)[:2]
        ratio = f"{cost / ref:.4f}" if cost is not None and ref else "-"
        print(
            f"| {letter} | {limit:g} | {cost if cost is not None else 'none'} | {wall:.1f} | {gap} | {sol.status} | "
            f"{sol.stats.stop_reason} | {ref if ref is not None else 'none'} | {ref_status} | {ratio} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
