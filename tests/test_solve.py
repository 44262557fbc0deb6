"""The strategy solver against brute force, and its reductions, fallbacks and messages."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autopar.solver import MEMORY_RTOL, StrategyProblem, solve_strategies

# -- helpers -------------------------------------------------------------------------------------


def brute_force(p: StrategyProblem) -> tuple[float, float, float]:
    """(optimal objective, smallest peak memory, peak of the optimum without a limit), exhaustively."""
    sizes = [len(c) for c in p.node_costs]
    grid = np.indices(sizes).reshape(len(sizes), -1).T
    cost = np.zeros(len(grid))
    for v, c in enumerate(p.node_costs):
        cost += np.asarray(c, dtype=float)[grid[:, v]]
    for e, (u, v) in enumerate(p.edges):
        cost += np.asarray(p.edge_costs[e], dtype=float)[grid[:, u] * sizes[v] + grid[:, v]]
    ok = np.ones(len(grid), dtype=bool)
    for group in p.groups or []:
        for v in group[1:]:
            ok &= grid[:, v] == grid[:, group[0]]
    peak = np.zeros(len(grid))
    items = _memory_items(p)
    horizon = max((e for _, (_, e), _ in items), default=0)
    for t in range(horizon):
        usage = np.zeros(len(grid))
        for v, (s, e), mem in items:
            if s <= t < e:
                usage += np.asarray(mem, dtype=float)[grid[:, v]]
        peak = np.maximum(peak, usage)
    allowed = ok & np.isfinite(cost)
    if not allowed.any():
        return math.inf, math.inf, math.inf
    min_peak = float(peak[allowed].min())
    free_peak = float(peak[np.argmin(np.where(allowed, cost, np.inf))])
    if p.memory_limit is not None:
        ok &= peak <= p.memory_limit * (1 + MEMORY_RTOL)
    best = float(cost[ok].min()) if ok.any() else math.inf
    return best, min_peak, free_peak


def evaluate(p: StrategyProblem, choice: list[int]) -> tuple[float, float]:
    """(objective, peak memory) of a choice, computed independently of the solver."""
    total = sum(p.node_costs[v][s] for v, s in enumerate(choice))
    total += sum(
        p.edge_costs[e][choice[u] * len(p.node_costs[v]) + choice[v]] for e, (u, v) in enumerate(p.edges)
    )
    items = _memory_items(p)
    horizon = max((e for _, (_, e), _ in items), default=0)
    usage = np.zeros(horizon + 1)
    for v, (s, e), mem in items:
        usage[s] += mem[choice[v]]
        usage[e] -= mem[choice[v]]
    return total, float(np.cumsum(usage).max(initial=0.0))


def _memory_items(p: StrategyProblem) -> list:
    """Every (node, interval, memory per strategy): the nodes' own, then the extra items."""
    own = [(v, tuple(iv), m) for v, (iv, m) in enumerate(zip(p.node_intervals, p.node_memory, strict=True))]
    return own + [(v, tuple(iv), m) for v, iv, m in p.memory_items or []]


def random_problem(
    rng: np.random.Generator,
    n: int,
    max_strategies: int = 4,
    memory: bool = False,
    groups: bool = False,
    forbidden: bool = False,
    max_assignments: int = 20_000,
    extra_items: bool = False,
) -> StrategyProblem:
    """A random DAG with every kind of edge matrix the reductions look at."""
    sizes: list[int] = []
    total = 1
    for _ in range(n):
        s = int(rng.integers(1, max_strategies + 1))
        while total * s > max_assignments and s > 1:
            s -= 1
        sizes.append(s)
        total *= s
    group_list: list[list[int]] | None = None
    if groups:
        by_size: dict[int, list[int]] = {}
        for v, s in enumerate(sizes):
            by_size.setdefault(s, []).append(v)
        group_list = [vs[: int(rng.integers(2, 4))] for vs in by_size.values() if len(vs) >= 2 and vs[0] != 1]
    integral = rng.random() < 0.5  # integer data gives ties, which dominance must break correctly
    draw = (
        (lambda *shape: rng.integers(0, 5, shape).astype(float))
        if integral
        else (lambda *shape: rng.random(shape))
    )
    costs = [draw(s).tolist() for s in sizes]
    mem = [
        rng.integers(0, 6, s).astype(float).tolist() if integral else (rng.random(s) * 5).tolist()
        for s in sizes
    ]
    if forbidden:
        for c in costs:
            if len(c) > 1 and rng.random() < 0.3:
                c[int(rng.integers(len(c)))] = math.inf
    intervals = []
    for _ in range(n):
        start = int(rng.integers(0, n))
        intervals.append((start, start + int(rng.integers(0, 4))))
    edges: list[tuple[int, int]] = []
    for v in range(1, n):
        for u in rng.choice(v, size=min(v, int(rng.integers(1, 3))), replace=False).tolist():
            edges.append((u, v))
    for _ in range(int(rng.integers(0, 3))):  # parallel edges, either direction
        u, v = edges[int(rng.integers(len(edges)))] if edges else (0, 0)
        if u != v:
            edges.append((u, v) if rng.random() < 0.5 else (v, u))
    edge_costs = []
    for u, v in edges:
        su, sv = sizes[u], sizes[v]
        kind = rng.random()
        if kind < 0.15:
            m = np.zeros((su, sv))
        elif kind < 0.3:  # separable: depends on each end alone
            m = draw(su)[:, None] + draw(sv)[None, :]
        elif kind < 0.5:  # resharding-like: free when the strategies agree
            m = draw(su, sv) + 0.5
            np.fill_diagonal(m, 0.0)
        else:
            m = draw(su, sv)
        if forbidden and rng.random() < 0.2:
            m[int(rng.integers(su)), int(rng.integers(sv))] = math.inf
        edge_costs.append(m.ravel().tolist())
    items = None
    if extra_items:  # a node holding memory again later, as an activation kept for the backward
        items = []
        for _ in range(int(rng.integers(1, n + 1))):
            v = int(rng.integers(n))
            start = int(rng.integers(0, n + 2))
            m = rng.integers(0, 6, sizes[v]).astype(float) if integral else rng.random(sizes[v]) * 5
            items.append((v, (start, start + int(rng.integers(0, 4))), m.tolist()))
    p = StrategyProblem(costs, mem, intervals, edges, edge_costs, groups=group_list, memory_items=items)
    if memory:
        _, min_peak, free_peak = brute_force(p)
        if math.isfinite(min_peak):
            # mostly between the smallest peak and the unconstrained optimum's; sometimes below
            p.memory_limit = float(min_peak + (rng.random() * 1.1 - 0.1) * max(free_peak - min_peak, 1.0))
    return p


def check_against_brute_force(p: StrategyProblem, **kwargs) -> None:
    want, _, _ = brute_force(p)
    sol = solve_strategies(p, **kwargs)
    if not math.isfinite(want):
        assert sol.status == "infeasible", sol
        assert sol.choice == [] and sol.objective == math.inf
        # a proof of infeasibility ends the search: no neighbourhood search runs after it
        assert sol.stats.stop_reason == "infeasible" and sol.stats.lns_rounds <= 1, sol.stats
        return
    assert sol.status == "optimal", sol
    assert sol.objective == pytest.approx(want, rel=1e-9, abs=1e-12)
    # lower bounds on the optimum: exact (priced eliminations), and to the solver's tolerances
    for bound, rtol in ((sol.stats.priced_bound, 1e-9), (sol.stats.best_bound, 1e-6)):
        if bound is not None:
            assert bound <= want + rtol * abs(want) + 1e-12
    got, peak = evaluate(p, sol.choice)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    if p.memory_limit is not None:
        assert peak <= p.memory_limit * (1 + MEMORY_RTOL)
    for group in p.groups or []:
        assert len({sol.choice[v] for v in group}) == 1


def chain_problem(n: int, seed: int = 0, memory_limit: float | None = None) -> StrategyProblem:
    """Transformer-ish chain with skip edges: sharding more saves memory but costs more time."""
    rng = np.random.default_rng(seed)
    shard = np.array([1.0, 2.0, 4.0, 8.0])
    costs = [
        (rng.random() * (1 + 0.3 * np.log2(shard)) * (1 + 0.2 * rng.random(4))).tolist() for _ in range(n)
    ]
    memory = [(rng.integers(1, 10) * 1e6 / shard).tolist() for _ in range(n)]
    intervals = [(v, 2 * n - v) if v % 3 == 0 else (v, v + 2) for v in range(n)]
    edges = [(v - 1, v) for v in range(1, n)] + [(v - 4, v) for v in range(4, n, 4)]
    edge_costs = []
    for _ in edges:
        m = rng.random((4, 4)) * 0.3
        np.fill_diagonal(m, 0.0)
        edge_costs.append(m.ravel().tolist())
    return StrategyProblem(costs, memory, intervals, edges, edge_costs, memory_limit=memory_limit)


def ladder_problem(blocks: int, seed: int = 0, grouped: bool = False) -> StrategyProblem:
    """A training graph's shape: a forward chain with residual skips, weights feeding it, and the
    backward chain in reverse, each backward node reading its forward node (the "ladder").
    Forward outputs live until their backward node, weights throughout."""
    rng = np.random.default_rng(seed)
    shard = np.array([1.0, 2.0, 2.0, 4.0])
    costs: list[list[float]] = []
    memory: list[list[float]] = []
    position: list[int] = []
    edges: list[tuple[int, int]] = []

    def node(size: float, pos: int) -> int:
        costs.append((rng.random() / shard + rng.random(4) * 0.3 * (shard > 1)).tolist())
        memory.append((size / shard).tolist())
        position.append(pos)
        return len(costs) - 1

    forward, weights, prev = [], [], -1
    for _ in range(blocks):
        block_input, ids = prev, []
        for i in range(6):
            ids.append(node(float(rng.integers(1, 5)), i))
            if prev >= 0:
                edges.append((prev, ids[-1]))
            prev = ids[-1]
        if block_input >= 0:
            edges.append((block_input, ids[3]))
        weights.append(node(6.0, 6))
        edges.append((weights[-1], ids[1]))
        forward.append(ids)
    backward_of = {}
    for ids in reversed(forward):
        for i, f in reversed(list(enumerate(ids))):
            g = node(memory[f][0], 7 + i)
            edges += [(prev, g), (f, g)]
            backward_of[f] = g
            prev = g
    horizon = len(costs)
    intervals = [
        (0, horizon) if v in weights else (v, backward_of[v] + 1) if v in backward_of else (v, v + 2)
        for v in range(horizon)
    ]
    edge_costs = []
    for _ in edges:
        m = rng.random((4, 4)) * 0.5
        np.fill_diagonal(m, 0.0)
        edge_costs.append(m.ravel().tolist())
    groups = None
    if grouped:
        by_pos: dict[int, list[int]] = {}
        for v, pos in enumerate(position):
            by_pos.setdefault(pos, []).append(v)
        groups = list(by_pos.values())
    return StrategyProblem(costs, memory, intervals, edges, edge_costs, groups=groups)


# -- correctness against brute force -------------------------------------------------------------


@pytest.mark.parametrize("memory", [False, True])
def test_brute_force_random(memory: bool) -> None:
    rng = np.random.default_rng(1234 + memory)
    for _ in range(100):
        p = random_problem(rng, int(rng.integers(2, 13)), memory=memory)
        check_against_brute_force(p)


def test_brute_force_with_extra_memory_items() -> None:
    rng = np.random.default_rng(4321)
    for _ in range(60):
        p = random_problem(rng, int(rng.integers(2, 11)), memory=True, extra_items=True, groups=rng.random() < 0.3)
        check_against_brute_force(p)


def test_an_extra_item_decides_the_choice() -> None:
    # Node 0's strategy 0 is cheaper but holds 4 bytes again over [2, 3), where node 1 holds 3.
    p = StrategyProblem(
        node_costs=[[0.0, 1.0], [0.0]],
        node_memory=[[1.0, 1.0], [3.0]],
        node_intervals=[(0, 1), (2, 3)],
        edges=[],
        edge_costs=[],
        memory_items=[(0, (2, 3), [4.0, 0.0])],
    )
    assert solve_strategies(p).choice == [0, 0]
    p.memory_limit = 5.0
    sol = solve_strategies(p)
    assert sol.choice == [1, 0] and sol.objective == 1.0
    p.memory_limit = 2.0
    assert solve_strategies(p).status == "infeasible"


def test_brute_force_forbidden_strategies() -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        p = random_problem(rng, int(rng.integers(2, 11)), memory=bool(rng.random() < 0.5), forbidden=True)
        check_against_brute_force(p)


def test_groups_share_a_strategy() -> None:
    rng = np.random.default_rng(99)
    for _ in range(40):
        p = random_problem(rng, int(rng.integers(3, 13)), memory=bool(rng.random() < 0.5), groups=True)
        check_against_brute_force(p)


def test_groups_matter() -> None:
    # Alone each node prefers a different strategy; tied together they must agree.
    p = StrategyProblem(
        node_costs=[[0.0, 3.0], [3.0, 0.0], [1.0, 0.0]],
        node_memory=[[0.0, 0.0]] * 3,
        node_intervals=[(0, 1)] * 3,
        edges=[],
        edge_costs=[],
        groups=[[0, 2], [1, 2]],
    )
    sol = solve_strategies(p)
    assert sol.choice in ([0, 0, 0], [1, 1, 1])
    assert sol.objective == 3.0
    check_against_brute_force(p)


def test_small_costs_next_to_large_penalties() -> None:
    # Seconds-scale costs (1e-4) beside finite "forbidden" penalties (1e6), as the sharding
    # pass writes them: scaling must keep the small ones above the solver's tolerances.
    rng = np.random.default_rng(17)
    for _ in range(30):
        p = random_problem(rng, int(rng.integers(4, 12)), memory=bool(rng.random() < 0.5))
        p.node_costs = [[c * 1e-4 for c in cs] for cs in p.node_costs]
        p.edge_costs = [[1e6 if rng.random() < 0.1 else c * 1e-4 for c in cs] for cs in p.edge_costs]
        check_against_brute_force(p)


@pytest.mark.parametrize("backend", ["scip", "cbc"])
def test_other_backends(backend: str) -> None:
    rng = np.random.default_rng(5)
    for _ in range(10):
        p = random_problem(rng, int(rng.integers(4, 11)), memory=True)
        check_against_brute_force(p, backend=backend)


# -- reductions and formulations agree -----------------------------------------------------------


def test_reduction_keeps_optimality() -> None:
    rng = np.random.default_rng(3)
    for trial in range(12):
        p = random_problem(rng, 40, memory=False, max_assignments=10**30)
        if trial % 2:
            p.memory_limit = None
        else:
            p.memory_limit = float(evaluate(p, solve_strategies(p).choice)[1] * 0.8)
        reduced = solve_strategies(p)
        full = solve_strategies(p, reduce=False)
        assert reduced.status == full.status
        if full.status == "optimal":
            assert reduced.objective == pytest.approx(full.objective, rel=1e-9)
            assert reduced.stats.strategies_after_reduction < full.stats.strategies_after_reduction


def test_memory_forms_agree() -> None:
    p = chain_problem(120, seed=2)
    free = solve_strategies(p)
    peak = evaluate(p, free.choice)[1]
    p.memory_limit = 0.6 * peak
    direct = solve_strategies(p, memory_form="direct")
    cumulative = solve_strategies(p, memory_form="cumulative")
    unreduced = solve_strategies(p, reduce=False, memory_form="cumulative")
    assert direct.status == cumulative.status == unreduced.status == "optimal"
    assert direct.stats.memory_form == "direct" and cumulative.stats.memory_form == "cumulative"
    assert cumulative.objective == pytest.approx(direct.objective, rel=1e-9)
    assert unreduced.objective == pytest.approx(direct.objective, rel=1e-9)
    assert evaluate(p, direct.choice)[1] <= p.memory_limit * (1 + MEMORY_RTOL)
    assert direct.objective > free.objective


@pytest.mark.parametrize("grouped", [False, True])
def test_ladder(grouped: bool) -> None:
    p = ladder_problem(6, seed=11, grouped=grouped)
    free = solve_strategies(p)
    assert free.status == "optimal" and free.stats.nodes_after_reduction == 0
    assert free.objective == pytest.approx(solve_strategies(p, reduce=False).objective, rel=1e-9)
    lo = evaluate(p, [int(np.argmin(m)) for m in p.node_memory])[1]
    p.memory_limit = lo + 0.4 * (evaluate(p, free.choice)[1] - lo)
    reduced = solve_strategies(p)
    full = solve_strategies(p, reduce=False)
    assert reduced.status == full.status == "optimal"
    assert reduced.objective == pytest.approx(full.objective, rel=1e-9)
    if reduced.stats.memory_free_fits:  # an answer as cheap as the unlimited optimum fits: memory never bound
        assert reduced.objective == pytest.approx(free.objective, rel=1e-9)
    else:
        assert reduced.stats.memory_rows_after_reduction <= reduced.stats.binding_memory_rows
    assert evaluate(p, reduced.choice)[1] <= p.memory_limit * (1 + MEMORY_RTOL)



def stack_problem(layers: int, seed: int, fraction: float = 0.3) -> StrategyProblem:
    """A stack of like layers whose copies share variables: per layer a weight (live throughout),
    three activations saved from their forward step to their backward step, and the weight's
    gradient, made in the layer's backward and kept to the step's end. The memory limit lies
    ``fraction`` of the way from the least peak to the peak of the unlimited optimum."""
    rng = np.random.default_rng(seed)
    per, k = 3, 3
    layer_costs = [rng.random(k).tolist() for _ in range(per)]
    layer_mem = [(rng.integers(1, 6, k) * 1.0).tolist() for _ in range(per)]
    weight_costs, weight_mem = rng.random(k).tolist(), (rng.integers(1, 6, k) * 1.0).tolist()
    grad_costs, grad_mem = rng.random(k).tolist(), (rng.integers(1, 6, k) * 1.0).tolist()
    mats = [(rng.random((k, k)) * 0.5).ravel().tolist() for _ in range(per)]
    costs, memory, intervals, edges, edge_costs = [], [], [], [], []
    groups: dict[object, list[int]] = {}
    end, prev = 2 * layers * per + 2, None

    def node(c: list[float], m: list[float], interval: tuple[int, int], group: object) -> int:
        costs.append(c), memory.append(m), intervals.append(interval)
        groups.setdefault(group, []).append(len(costs) - 1)
        return len(costs) - 1

    for i in range(layers):
        w = node(weight_costs, weight_mem, (0, end), "weight")
        for j in range(per):
            t = i * per + j
            v = node(layer_costs[j], layer_mem[j], (t + 1, end - 1 - t), j)
            if prev is not None:
                edges.append((prev, v)), edge_costs.append(mats[j])
            prev = v
        g = node(grad_costs, grad_mem, (end - 2 - i * per, end), "grad")
        edges += [(w, w + 1), (w, g)]
        edge_costs += [mats[0], mats[1]]
    p = StrategyProblem(costs, memory, intervals, edges, edge_costs, groups=list(groups.values()))
    free = solve_strategies(p)
    lo = evaluate(p, [int(np.argmin(m)) for m in p.node_memory])[1]
    p.memory_limit = lo + fraction * (evaluate(p, free.choice)[1] - lo)
    return p


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_stack_of_like_layers_keeps_the_rows_of_one(seed: int) -> None:
    """The memory rows of a grouped stack are affine in the layer's index (saved activations of
    the layers below, gradients of those above), so its interior layers' rows are implied by
    the outer ones': the rows left do not grow with depth, and the optimum is unchanged."""
    rows = {}
    for layers in (8, 32):
        p = stack_problem(layers, seed)
        reduced, full = solve_strategies(p), solve_strategies(p, reduce=False)
        assert reduced.status == full.status == "optimal"
        assert not reduced.stats.memory_free_fits  # the limit binds
        assert reduced.objective == pytest.approx(full.objective, rel=1e-9)
        assert evaluate(p, reduced.choice)[1] <= p.memory_limit * (1 + MEMORY_RTOL)
        rows[layers] = (reduced.stats.binding_memory_rows, reduced.stats.memory_rows_after_reduction)
    assert rows[32][0] > rows[8][0]  # more layers, more rows that can bind
    assert rows[32][1] == rows[8][1] < rows[8][0]

def test_chain_without_memory_reduces_to_nothing() -> None:
    p = chain_problem(2000, seed=1)
    sol = solve_strategies(p)
    assert sol.status == "optimal" and sol.backend == "reduction"
    assert sol.stats.nodes_after_reduction == 0
    assert sol.objective == pytest.approx(evaluate(p, sol.choice)[0], rel=1e-12)


# -- infeasibility and time limits ---------------------------------------------------------------


def test_infeasible_memory_limit() -> None:
    p = chain_problem(30, seed=4)
    # every node's smallest memory is its last strategy (most sharded), so the minimum peak is
    # the largest sum of those over time
    horizon = max(e for _, e in p.node_intervals)
    min_peak = max(
        sum(m[-1] for m, (s, e) in zip(p.node_memory, p.node_intervals, strict=True) if s <= t < e)
        for t in range(horizon)
    )
    p.memory_limit = min_peak * 0.99
    sol = solve_strategies(p)
    assert sol.status == "infeasible"
    assert sol.choice == [] and sol.objective == math.inf and sol.gap is None
    assert sol.stats.min_peak_memory == pytest.approx(min_peak)
    p.memory_limit = sol.stats.min_peak_memory
    assert solve_strategies(p).status == "optimal"


def test_infeasible_groups_min_peak() -> None:
    # Two grouped nodes live at different times want opposite strategies for low memory.
    p = StrategyProblem(
        node_costs=[[0.0, 0.0], [0.0, 0.0]],
        node_memory=[[1.0, 5.0], [5.0, 2.0]],
        node_intervals=[(0, 1), (1, 2)],
        edges=[],
        edge_costs=[],
        memory_limit=3.0,
        groups=[[0, 1]],
    )
    sol = solve_strategies(p)
    assert sol.status == "infeasible"
    assert sol.stats.min_peak_memory == pytest.approx(5.0)
    assert sol.stats.min_peak_memory_exact


def test_tiny_time_limit_returns_greedy() -> None:
    p = chain_problem(3000, seed=6)
    p.memory_limit = 0.5 * evaluate(p, solve_strategies(p).choice)[1]
    sol = solve_strategies(p, time_limit_s=0.0)
    assert sol.status == "feasible"
    assert sol.backend == "greedy"
    assert len(sol.choice) == 3000
    objective, peak = evaluate(p, sol.choice)
    assert peak <= p.memory_limit * (1 + MEMORY_RTOL)
    assert sol.objective == pytest.approx(objective, rel=1e-12)


def test_time_limit_stops_the_solver() -> None:
    p = chain_problem(3000, seed=6)
    p.memory_limit = 0.5 * evaluate(p, solve_strategies(p).choice)[1]
    sol = solve_strategies(p, time_limit_s=0.3)
    assert sol.status in ("feasible", "optimal")
    assert sol.solve_time_s < 3.0
    assert evaluate(p, sol.choice)[1] <= p.memory_limit * (1 + MEMORY_RTOL)
    if sol.status == "feasible" and sol.gap is not None:
        assert sol.gap >= 0


# -- input validation ----------------------------------------------------------------------------


def _tiny(**changes) -> StrategyProblem:
    fields = dict(
        node_costs=[[1.0, 2.0], [1.0, 2.0, 3.0]],
        node_memory=[[1.0, 1.0], [1.0, 1.0, 1.0]],
        node_intervals=[(0, 1), (1, 2)],
        edges=[(0, 1)],
        edge_costs=[[0.0] * 6],
        node_names=["embed", "mlp"],
    )
    fields.update(changes)
    return StrategyProblem(**fields)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            dict(node_memory=[[1.0, 1.0], [1.0, 1.0]]),
            r"node 1 \('mlp'\): node_memory has 2 entries, node_costs has 3",
        ),
        (dict(node_costs=[[], [1.0, 2.0, 3.0]]), r"node 0 \('embed'\): has no strategies"),
        (
            dict(node_costs=[[1.0, float("nan")], [1.0, 2.0, 3.0]]),
            r"node 0 \('embed'\): node_costs contains NaN",
        ),
        (dict(node_memory=[[1.0, -1.0], [1.0, 1.0, 1.0]]), r"node 0 \('embed'\): node_memory is negative"),
        (dict(node_intervals=[(2, 1), (1, 2)]), r"node 0 \('embed'\): node_intervals entry \(2, 1\)"),
        (dict(node_intervals=[(0, 1)]), r"node_intervals has 1 entries, node_costs has 2"),
        (dict(edge_costs=[[0.0] * 5]), r"edge 0 \(0 -> 1\): edge_costs has 5 entries, expected 2 x 3 = 6"),
        (dict(edges=[(0, 2)]), r"edge 0 \(0, 2\): node index out of range"),
        (dict(edges=[(1, 1)], edge_costs=[[0.0] * 9]), r"edge 0 \(1, 1\): an edge from a node to itself"),
        (dict(edge_costs=[[0.0] * 5 + [float("-inf")]]), r"edge 0 \(0 -> 1\): edge_costs contains -inf"),
        (dict(groups=[[0, 1]]), r"group 0: node 1 \('mlp'\) has 3 strategies but node 0 \('embed'\) has 2"),
        (dict(groups=[[0, 5]]), r"group 0: node index 5 out of range"),
        (dict(memory_limit=-1.0), r"memory_limit -1.0 must be"),
        (dict(memory_items=[(2, (0, 1), [1.0])]), r"memory item 0: node index 2 out of range"),
        (dict(memory_items=[(1, (0, 1), [1.0])]), r"memory item 0 of node 1 \('mlp'\): 1 memory entries"),
        (dict(memory_items=[(0, (3, 1), [1.0, 1.0])]), r"memory item 0 of node 0 \('embed'\): interval"),
        (dict(memory_items=[(0, (0, 1), [1.0, -2.0])]), r"memory item 0 of node 0 \('embed'\): .*negative"),
    ],
)
def test_validation_messages(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        solve_strategies(_tiny(**changes))


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend 'gurobi' is not one of highs, scip, cbc"):
        solve_strategies(_tiny(), backend="gurobi")


def test_forbidden_everywhere_is_infeasible() -> None:
    sol = solve_strategies(_tiny(node_costs=[[math.inf, math.inf], [1.0, 2.0, 3.0]]))
    assert sol.status == "infeasible"
    assert "node 0 ('embed') has no allowed strategy" in sol.stats.infeasible_reason


# -- anytime: the budget is spent on improving the answer ----------------------------------------


def frustrated_chain(seed: int, n: int, strategies: int = 5, memory: bool = False) -> StrategyProblem:
    """A chain with skip edges and random edge matrices: greedy best response is far from optimal.

    With ``memory``, every node is live for three steps and the limit sits between the
    smallest peak and the peak of the cheapest strategies, so memory binds.
    """
    rng = np.random.default_rng(seed)
    costs = rng.uniform(0.0, 1.0, (n, strategies))
    mem = rng.uniform(1.0, 4.0, (n, strategies))
    edges = [(v, v + 1) for v in range(n - 1)] + [(v, v + 3) for v in range(0, n - 3, 2)]
    matrices = [rng.uniform(0.0, 3.0, strategies * strategies).tolist() for _ in edges]
    def peak(per_node: np.ndarray) -> float:
        return float(np.convolve(per_node, np.ones(3))[: n].max())

    limit = 0.5 * (peak(mem.min(axis=1)) + peak(mem[np.arange(n), costs.argmin(axis=1)]))
    return StrategyProblem(
        node_costs=costs.tolist(),
        node_memory=mem.tolist(),
        node_intervals=[(v, v + 3) for v in range(n)],
        edges=edges,
        edge_costs=matrices,
        memory_limit=limit if memory else None,
    )


def make_milp_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MILP counts as too large for HiGHS, even its relaxation: the whole MILP is never built."""
    import autopar.solver.solve as solve_module

    monkeypatch.setattr(solve_module, "HIGHS_MIP_MAX_NNZ", 0)
    monkeypatch.setattr(solve_module, "lp_seconds", lambda nnz: math.inf)


@pytest.mark.parametrize("memory", [False, True])
def test_too_large_milp_is_improved_past_the_heuristics(monkeypatch: pytest.MonkeyPatch, memory: bool) -> None:
    p = frustrated_chain(3, 60, strategies=4, memory=memory)
    exact = solve_strategies(p, time_limit_s=3, backend="highs", reduce=False)
    make_milp_too_large(monkeypatch)
    sol = solve_strategies(p, time_limit_s=4, backend="highs", reduce=False)
    st = sol.stats
    assert st.relaxation_only and st.milp_nonzeros is None  # the whole MILP was never built
    assert st.greedy_objective > exact.objective * 1.02  # the heuristics alone are not good enough
    assert st.lns_improvements > 0 and st.lns_start_objective == st.greedy_objective
    assert sol.objective < st.greedy_objective
    assert sol.gap is not None and st.lower_bound is not None  # the gap proved, against the bound found
    assert sol.gap == pytest.approx((sol.objective - st.lower_bound) / sol.objective)
    assert st.stop_reason == ("gap target" if sol.gap <= 0.01 else "time limit") or st.stop_reason == "optimal"
    if not memory:  # the whole MILP's optimum, within the target gap
        assert exact.status == "optimal" and sol.objective <= exact.objective * (1 + 0.01) + 1e-9
    assert evaluate(p, sol.choice)[0] == pytest.approx(sol.objective)
    if memory:
        assert evaluate(p, sol.choice)[1] <= p.memory_limit * (1 + MEMORY_RTOL)


def test_time_limit_is_honoured_and_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A problem too large to finish: the solve spends its budget, returns within it, and says so."""
    import time

    make_milp_too_large(monkeypatch)
    p = frustrated_chain(5, 4000, strategies=6, memory=True)
    start = time.perf_counter()
    sol = solve_strategies(p, time_limit_s=3.0, backend="highs", reduce=False)
    wall = time.perf_counter() - start
    st = sol.stats
    assert wall <= 3.0 + 1.0
    assert st.budget_s == 3.0 and st.used_s == pytest.approx(sol.solve_time_s)
    assert st.stop_reason in ("time limit", "gap target")
    if st.stop_reason == "time limit":
        assert st.used_s >= 0.8 * 3.0 and (sol.gap is None or sol.gap > 0.01)
    # how far a budget gets past the heuristics depends on the machine (none of 3 s went to a search round
    # on a loaded CI box): that the search improves on them is held by test_too_large_milp_is_improved_past_the_heuristics
    assert sol.objective <= st.greedy_objective
    assert sol.status == "feasible"


def test_optimal_solves_stop_early_and_say_why() -> None:
    p = frustrated_chain(3, 12)
    sol = solve_strategies(p, time_limit_s=30, backend="highs")
    assert sol.status == "optimal" and sol.stats.stop_reason == "optimal"
    assert sol.stats.budget_s == 30 and sol.stats.used_s < 5
    assert sol.stats.lns_rounds == 0


def test_consistent_start_avoids_forbidden_pairs_greedy_order_cannot() -> None:
    """Arc consistency looks ahead where best response in order does not.

    Node 0 prefers strategy 0, but strategy 0 of node 0 allows only strategy 0 of node 1,
    which node 2 forbids with each of its strategies: choosing in order without looking
    ahead lands on a forbidden pair; spreading each choice's consequences first does not.
    """
    from autopar.solver.heuristics import consistent_start
    from autopar.solver.lns import core_score
    from autopar.solver.reduce import CoreProblem

    inf = math.inf
    costs = [np.array([0.0, 1.0]), np.array([0.0, 1.0]), np.array([0.0, 1.0])]
    first = np.array([[0.0, inf], [0.0, 0.0]])  # node 0 at 0 needs node 1 at 0
    second = np.array([[inf, inf], [0.0, 0.0]])  # node 1 at 0 is forbidden with node 2
    empty = np.zeros(0, dtype=np.int64)
    core = CoreProblem(
        var_ids=np.arange(3),
        keep=[np.arange(2)] * 3,
        costs=costs,
        factors=[((0, 1), first), ((1, 2), second)],
        constant=0.0,
        cap=np.zeros(0),
        row_times=empty,
        item_var=empty,
        item_r0=empty,
        item_r1=empty,
        item_coef=[],
    )
    local = consistent_start(core, math.inf)
    assert core_score(core, local)[0] == 0
    assert local.tolist() == [1, 1, 0]


def test_a_limit_that_binds_only_in_the_worst_case_is_solved_without_it() -> None:
    # every node live to the end: replicating everything is over the limit, the cheap answer is not
    p = chain_problem(200, seed=4)
    free = solve_strategies(p)
    worst = sum(max(m) for m in p.node_memory)
    p.memory_limit = 0.5 * (evaluate(p, free.choice)[1] + worst)
    assert evaluate(p, free.choice)[1] < p.memory_limit < worst
    sol = solve_strategies(p, time_limit_s=10)
    assert sol.stats.memory_free_fits and sol.stats.memory_rows_after_reduction is None  # no limited solve ran
    assert sol.objective == pytest.approx(free.objective, rel=1e-9)
    assert sol.objective == pytest.approx(solve_strategies(p, reduce=False).objective, rel=1e-9)
    # a limit below the unlimited answer's peak: the limited solve runs, bounded by the unlimited optimum
    p.memory_limit = 0.7 * evaluate(p, free.choice)[1]
    tight = solve_strategies(p, time_limit_s=10)
    assert not tight.stats.memory_free_fits and tight.stats.memory_free_bound <= tight.objective
    assert tight.objective == pytest.approx(solve_strategies(p, reduce=False).objective, rel=1e-9)


@pytest.mark.parametrize("memory", [False, True])
def test_a_start_answer_is_never_made_worse(memory: bool) -> None:
    p = frustrated_chain(5, 60, strategies=4, memory=memory)
    exact = solve_strategies(p, time_limit_s=5, reduce=False)
    assert exact.status == "optimal"
    # no time for anything but the heuristics: the answer is the start's, which the greedy alone misses
    alone = solve_strategies(p, time_limit_s=0.0)
    started = solve_strategies(p, time_limit_s=0.0, start=exact.choice)
    assert alone.objective > exact.objective * (1 + 1e-6)
    assert started.objective == pytest.approx(exact.objective, rel=1e-9)
    with pytest.raises(ValueError, match="start has 3 strategies for 60 nodes"):
        solve_strategies(p, start=[0, 0, 0])
