"""Sharding search over the dp × tp meshes of a cluster, one mesh's problem solved at a time.

strategies → MILP instance → solve → per-node placements + an Estimate
(:mod:`autopar.search.sharding.answer` costs a chosen answer). Baseline layouts (pure data parallel, ZeRO-3
style parameter sharding, Megatron-style tensor parallel) are costed by
the same code with the parameters' placements restricted, so every
comparison uses one model.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.capture.joint import CapturedGraph
from autopar.core.errors import PlanError
from autopar.core.heap import long_lived_heap
from autopar.core.mesh import SHARDING_AXES
from autopar.cost_models.compute import ComputeEfficiency
from autopar.cost_models.estimate import Estimate
from autopar.cost_models.memory import Precision
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.search.sharding.answer import describe_collectives, evaluate, read_placements
from autopar.search.sharding.derived import restrict, with_microbatches
from autopar.search.sharding.instance import ShardingProblem
from autopar.search.sharding.microbatches import microbatch_divides, microbatch_filter
from autopar.search.sharding.problem import build_problem, repeated_layer_groups
from autopar.search.sharding.seeds import seed_filter, seeds_for
from autopar.search.sharding.step_memory import step_memory
from autopar.search.sharding.strategies import NodeStrategies, Strategy, enumerate_strategies
from autopar.solver import (
    GAP_TARGET,
    MEMORY_RTOL,
    Solution,
    SolverStats,
    StrategyProblem,
    lower_bound,
    solve_strategies,
)

log = logging.getLogger(__name__)

SEED_GAP = 0.05
"""A seed layout solved before the unrestricted search is its starting point, not its answer:
it is solved to this gap, and the unrestricted search (to ``GAP_TARGET``) improves on it."""



@dataclass
class ShardingResult:
    mesh: MeshShape
    microbatches: int
    sp: ShardingProblem
    solution: Solution
    estimate: Estimate
    placements: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    charged: list[dict[str, Any]] = field(default_factory=list)  # every collective the estimate charged
    source: str = "milp"  # "milp", or the seed layout whose answer beat the MILP's
    milp: ShardingResult | None = None  # when a seed won: the unrestricted MILP's result on the mesh
    # micro-batch counts proven not to fit (infeasible, or below the least peak): no restriction of the
    # same problem fits them either, so the seed layouts of the mesh skip them
    unfit: frozenset[int] = frozenset()


def mesh_links(cluster: Cluster, mesh: MeshShape) -> list:
    return [cluster.axis_link(mesh, axis) for axis in SHARDING_AXES]


@dataclass
class MeshProblem:
    """One mesh's sharding problem, built once (for one micro-batch) and solved under several restrictions.

    The search solves each mesh unrestricted and again for every seed layout, and
    retries with more micro-batches when nothing fits: all of these are the same
    problem with some strategies forbidden or the activation memory divided, so
    they share this one build.
    """

    captured: CapturedGraph
    cluster: Cluster
    mesh: MeshShape
    links: list
    sp: ShardingProblem  # one micro-batch, repeated-layer groups set
    memory_limit: float
    compute_dtype: str
    timings: dict[str, float] = field(default_factory=dict)


@long_lived_heap()
def prepare_mesh(
    captured: CapturedGraph,
    cluster: Cluster,
    mesh: MeshShape,
    precision: Precision,
    optimizer: str,
    memory_limit: float,
    strategies: dict[str, NodeStrategies] | None = None,
    efficiency: ComputeEfficiency | None = None,
    recompute: bool = False,
) -> MeshProblem:
    """Enumerate strategies (unless given) and build the sharding problem of a dp × tp ``mesh``.

    ``recompute``: activations may also be recomputed in the backward (a decision of the MILP).
    """
    timings: dict[str, float] = {}
    shape = (mesh.dp, mesh.tp)
    t = time.perf_counter()
    if strategies is None:
        strategies = enumerate_strategies(captured.gm, shape, SHARDING_AXES)
    timings["strategies_s"] = time.perf_counter() - t
    t = time.perf_counter()
    links = mesh_links(cluster, mesh)
    sp = build_problem(
        captured,
        strategies,
        shape,
        links,
        cluster.device_spec,
        precision,
        optimizer,
        efficiency=efficiency,
        memory_limit=memory_limit,
        microbatches=1,
        recompute=recompute,
    )
    sp.problem.groups = repeated_layer_groups(captured.gm, sp)
    timings["build_s"] = time.perf_counter() - t
    timings["solve_s"] = 0.0
    return MeshProblem(captured, cluster, mesh, links, sp, memory_limit, precision.compute_dtype, timings)


@long_lived_heap()
def solve_prepared(
    mp: MeshProblem,
    time_limit_s: float = 60.0,
    allowed: Callable[[str, Strategy], bool] | None = None,
    describe: bool = True,
    bound: bool = True,
    least_peak: bool = True,
    unfit: frozenset[int] = frozenset(),
    microbatches: int | None = None,
    start: list[int] | None = None,
    target_gap: float = GAP_TARGET,
) -> ShardingResult:
    """The cheapest answer to ``mp`` that fits, with only the strategies ``allowed`` permits.

    ``start``: a known answer to ``mp`` (a strategy per node, for instance a seed layout's)
    every solve starts from. ``target_gap``: each solve stops once proven this close to its bound.

    Gradient accumulation only to fit: the fewest micro-batches that fit the memory
    limit, or ``microbatches`` when given (it must divide the local batch).
    ``describe=False`` leaves the placements and collectives to :func:`describe_result`;
    ``bound=False`` skips the solver's extra work on a lower bound (see ``solve_strategies``).
    ``least_peak=False``: an answer that does not fit is of no use to the caller (a seed
    layout), so no solve is spent on the smallest memory that would fit, and none at all
    when the parameters' states alone are over the limit. ``unfit``: micro-batch counts known not
    to fit (``ShardingResult.unfit`` of a less restricted solve of ``mp``), not tried again.
    """
    counts = _microbatch_counts(mp, microbatches)
    restricted = None if allowed is None else restrict(mp.sp.problem, mp.sp, allowed)
    run = _Solves(mp, allowed, restricted, time.perf_counter() + time_limit_s, bound, least_peak, start, target_gap)
    states = None  # the least memory the parameters' states can take: no micro-batching lowers it
    solution, m, sp = None, counts[0], mp.sp
    proven = set(unfit)  # counts that cannot fit
    if not least_peak:
        states = sum(_least_memory(restricted or mp.sp.problem, i) for i in mp.sp.param_nodes)
        if states > mp.memory_limit * (1 + MEMORY_RTOL):
            solution = _no_answer(min_peak_memory=states)
    tries = [k for k in counts if k not in proven]
    if solution is None and not tries:
        solution = _no_answer()
    if solution is None:
        solution, m, sp = _fewest_microbatches(run, counts, tries, proven, states)
    if not solution.choice and m != counts[-1] and least_peak:
        # nothing fits: the smallest memory that would fit is the least peak at the most micro-batches
        solution, m, sp = run.least_peak(counts[-1])
    mp.timings["solve_s"] += run.solve_s
    estimate = evaluate(
        sp, solution, run.shape, mp.cluster, mp.captured.batch_size, mp.memory_limit, mp.links, mp.compute_dtype
    )
    res = ShardingResult(mp.mesh, m, sp, solution, estimate, timings={"solve_s": run.solve_s})
    res.unfit = frozenset(proven)
    if describe:
        describe_result(mp.captured, res)
    return res


def _microbatch_counts(mp: MeshProblem, microbatches: int | None) -> list[int]:
    """The micro-batch counts to try on ``mp``, fewest first: the divisors of the local batch (or the one given)."""
    local = mp.captured.batch_size // mp.mesh.dp
    counts = [k for k in range(1, local + 1) if local % k == 0 and microbatches in (None, k)]
    if not counts:
        raise PlanError(
            f"the local batch {local} on mesh {mp.mesh} does not split into {microbatches} micro-batches"
        )
    return counts


def _no_answer(min_peak_memory: float | None = None) -> Solution:
    """An infeasible solution proven without a solve (``min_peak_memory``: a bound on the least peak, if known)."""
    stats = SolverStats(min_peak_memory=min_peak_memory, min_peak_memory_exact=False)
    return Solution([], math.inf, "infeasible", None, 0.0, "bound", stats)


@dataclass
class _Solves:
    """The solves of one :func:`solve_prepared` call: ``mp`` under one restriction, against one deadline."""

    mp: MeshProblem
    allowed: Callable[[str, Strategy], bool] | None
    restricted: StrategyProblem | None  # mp's problem with what ``allowed`` rejects forbidden
    deadline: float
    bound: bool
    exact_peak: bool
    start: list[int] | None = None  # a known answer every solve starts from
    target_gap: float = GAP_TARGET
    solve_s: float = 0.0  # seconds spent solving so far

    @property
    def shape(self) -> tuple[int, int]:
        return (self.mp.mesh.dp, self.mp.mesh.tp)

    def left(self) -> float:
        return max(self.deadline - time.perf_counter(), 1.0)

    def at(self, k: int) -> tuple[ShardingProblem, StrategyProblem]:
        """The problem at ``k`` micro-batches, restricted as this call's strategies are."""
        sp = with_microbatches(self.mp.sp, k)
        return sp, sp.problem if self.restricted is None else _microbatched(self.restricted, sp.problem)

    def fitted(self, sp: ShardingProblem, problem: StrategyProblem, bound_work: bool) -> tuple[Solution, Solution]:
        """The solver's answer to ``problem``, and that answer made to fit by ``_fit_exactly``."""

        def again(p: StrategyProblem) -> Solution:
            return solve_strategies(
                p, time_limit_s=self.left(), bound=False, start=self.start, target_gap=self.target_gap
            )

        raw = solve_strategies(
            problem,
            time_limit_s=self.left(),
            bound=bound_work,
            exact_peak=self.exact_peak,
            start=self.start,
            target_gap=self.target_gap,
        )
        return raw, _fit_exactly(sp, problem, raw, self.shape, self.mp.memory_limit, again)

    def solve_count(self, k: int) -> tuple[ShardingProblem, StrategyProblem, Solution, Solution, bool]:
        """Solve at ``k`` micro-batches: (problem, solved problem, raw answer, fitted answer, give up).

        An answer whose placements split the batch over more ranks than 1/k of it holds is
        solved again without such placements; if that one does too, no count is worth trying
        (more micro-batches would only make them worse): give up.
        """
        start = time.perf_counter()
        captured, shape = self.mp.captured, self.shape
        sp, problem = self.at(k)
        raw, solution = self.fitted(sp, problem, self.bound)
        give_up = False
        if solution.choice and not microbatch_divides(captured, sp, solution.choice, shape, k):
            log.info("mesh %s: the answer at %d micro-batches does not divide a micro-batch", self.mp.mesh, k)
            divides = microbatch_filter(captured, shape, k)
            narrow = divides if self.allowed is None else both(self.mp.sp, self.allowed, divides)
            problem = restrict(sp.problem, sp, narrow)
            _, solution = self.fitted(sp, problem, False)
            if solution.choice and not microbatch_divides(captured, sp, solution.choice, shape, k):
                solution, give_up = _no_answer(), True
        self.solve_s += time.perf_counter() - start
        return sp, problem, raw, solution, give_up

    def least_peak(self, k: int) -> tuple[Solution, int, ShardingProblem]:
        """A quick solve at ``k`` micro-batches, for the least peak memory it reports."""
        start = time.perf_counter()
        sp, problem = self.at(k)
        solution = solve_strategies(problem, time_limit_s=1.0, bound=False)
        self.solve_s += time.perf_counter() - start
        return solution, k, sp


def _fewest_microbatches(
    run: _Solves, counts: list[int], tries: list[int], proven: set[int], states: float | None
) -> tuple[Solution, int, ShardingProblem]:
    """The answer at the fewest micro-batch counts of ``tries`` that fits, or the last one tried.

    Counts proven not to fit are added to ``proven``; a count the least-peak bound
    (:func:`_may_fit`) rules out is not solved.
    """
    limit = run.mp.memory_limit
    solution, m, sp = None, counts[0], run.mp.sp
    for k in tries:
        if solution is not None and states is not None and not _may_fit(solution, m, k, states, limit):
            if not _may_fit(solution, m, counts[-1], states, limit):
                proven.update(c for c in counts if c >= k)
                break  # the bound falls as k grows: if the most micro-batches cannot fit, none can
            proven.add(k)
            continue
        sp, problem, raw, solution, give_up = run.solve_count(k)
        if raw.status == "infeasible":  # proven (an answer not found in time is "unknown")
            proven.add(k)
        m = k
        if give_up or solution.choice:
            break
        if states is None:
            states = sum(_least_memory(problem, i) for i in sp.param_nodes)
    assert solution is not None
    return solution, m, sp


def _fit_exactly(
    sp: ShardingProblem,
    problem: StrategyProblem,
    solution: Solution,
    shape: tuple[int, ...],
    memory_limit: float,
    solve: Callable[[StrategyProblem], Solution],
    tries: int = 4,
) -> Solution:
    """``solution``, solved again under a lower limit while its exact peak is over ``memory_limit``.

    The MILP's memory rows leave out buffers that depend on the strategies of both ends
    of an edge (a gradient being reduced, a value redistributed); the estimate counts them
    (:mod:`autopar.search.sharding.step_memory`).  Where an answer's exact peak is over the limit,
    the MILP's limit is lowered to leave room for the most such memory any answer so far
    needed beyond what the MILP saw, and the problem solved again; an answer still over
    after ``tries`` is no answer.
    """
    limit, hidden = problem.memory_limit, 0.0
    for _ in range(tries):
        if not solution.choice or limit is None or not math.isfinite(limit):
            return solution
        exact = step_memory(sp, solution.choice, shape).peak
        if exact <= memory_limit * (1 + MEMORY_RTOL):
            return solution
        hidden = max(hidden, exact - _seen_peak(problem, solution.choice))
        limit = min(limit - (exact - memory_limit), memory_limit - hidden)
        log.info("an answer the MILP fits is %.3g bytes over the limit: solving again", exact - memory_limit)
        if limit <= 0:
            break
        solution = solve(replace(problem, memory_limit=limit))
    if solution.choice and step_memory(sp, solution.choice, shape).peak > memory_limit * (1 + MEMORY_RTOL):
        return replace(solution, choice=[], status="infeasible", objective=math.inf)
    return solution


def _seen_peak(problem: StrategyProblem, choice: list[int]) -> float:
    """The peak of ``choice`` as the MILP's memory rows see it."""
    item_node, intervals, item_memory = problem.items()
    events: dict[int, float] = {}
    for k, (v, (s, e)) in enumerate(zip(item_node.tolist(), intervals.tolist(), strict=True)):
        m = item_memory[k][choice[v]]
        events[s] = events.get(s, 0.0) + m
        events[e] = events.get(e, 0.0) - m
    live = peak = 0.0
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak


def _microbatched(restricted: StrategyProblem, problem: StrategyProblem) -> StrategyProblem:
    """``restricted`` (from :func:`restrict`) with ``problem``'s memory and edges: another micro-batch count.

    A restriction changes only node costs and groups, and micro-batching never touches those,
    so the mesh's problem is restricted once and each count reuses it.
    """
    return replace(problem, node_costs=restricted.node_costs, groups=restricted.groups)


def _may_fit(solution: Solution, m0: int, m: int, states: float, memory_limit: float) -> bool:
    """Whether ``m`` micro-batches may fit where ``m0`` did not (``solution`` says by how much).

    The peak of any choice is its states' memory plus its activations' peak, and only
    the activations shrink with more micro-batches, so with ``P`` the least peak at
    ``m0`` and ``S`` the least states' memory, no choice peaks below
    ``(m0 / m) P + (1 - m0 / m) S`` at ``m``.
    """
    peak = solution.stats.min_peak_memory
    if peak is None:
        return True
    bound = (m0 / m) * peak + (1 - m0 / m) * states
    return bound <= memory_limit * (1 + MEMORY_RTOL)


def _least_memory(problem: StrategyProblem, i: int) -> float:
    """The least memory node ``i`` takes under a strategy that is not forbidden."""
    allowed = [
        mem for mem, c in zip(problem.node_memory[i], problem.node_costs[i], strict=True) if math.isfinite(c)
    ]
    return min(allowed or problem.node_memory[i])


def zero_filter(sp: ShardingProblem, zero: int) -> Callable[[str, Strategy], bool]:
    """The parameter strategies of ZeRO stage ``zero`` (0-3) on ``sp``'s mesh; other nodes are free.

    Stages 0-2 keep parameters replicated over dp (2: and their optimizer state and
    gradients split); stage 3 shards them over dp, and a parameter that no dp shard
    divides takes ZeRO-2, the most the runtime can split it.
    """
    dp = sp.dp_dim
    params = {sp.nodes[i]: sp.strategies[i] for i in sp.param_nodes}

    def over_dp(s: Strategy) -> bool:
        return s.outputs[0] is not None and not s.outputs[0][dp].is_replicate()

    shardable = {name for name, options in params.items() if any(over_dp(s) for s in options)}

    def allowed(name: str, s: Strategy) -> bool:
        if name not in params or dp is None:
            return True
        if zero == 3 and name in shardable:
            return over_dp(s)
        want = min(zero, 2)
        return not over_dp(s) and s.zero == (want if any(o.zero for o in params[name]) else 0)

    return allowed


def both(
    sp: ShardingProblem, first: Callable[[str, Strategy], bool], then: Callable[[str, Strategy], bool]
) -> Callable[[str, Strategy], bool]:
    """Strategies both filters allow; at a node where none does, those ``then`` allows (it is binding)."""
    agree = {
        sp.nodes[i]
        for i in range(len(sp.nodes))
        if any(first(sp.nodes[i], s) and then(sp.nodes[i], s) for s in sp.strategies[i])
    }
    return lambda name, s: then(name, s) and (first(name, s) or name not in agree)


def describe_result(captured: CapturedGraph, res: ShardingResult) -> ShardingResult:
    """Fill in the placements and charged collectives of ``res``'s answer (once; none without one)."""
    if res.solution.choice and not res.placements:
        shape = (res.mesh.dp, res.mesh.tp)
        res.placements = read_placements(captured, res.sp, res.solution.choice)
        res.charged = describe_collectives(captured, res.sp, res.solution.choice, shape)
    return res


def solve_mesh(
    captured: CapturedGraph,
    cluster: Cluster,
    mesh: MeshShape,
    precision: Precision,
    optimizer: str,
    memory_limit: float,
    time_limit_s: float = 60.0,
    allowed: Callable[[str, Strategy], bool] | None = None,
    strategies: dict[str, NodeStrategies] | None = None,
    efficiency: ComputeEfficiency | None = None,
    recompute: bool = False,
) -> ShardingResult:
    """The cheapest sharding of ``captured`` on a dp × tp ``mesh`` that fits ``memory_limit``.

    ``recompute``: activations may be recomputed (as :func:`search_meshes` allows by default).
    """
    mp = prepare_mesh(
        captured, cluster, mesh, precision, optimizer, memory_limit, strategies, efficiency, recompute
    )
    res = solve_prepared(mp, time_limit_s, allowed)
    res.timings = dict(mp.timings)
    return res


def flat_tp_sizes(
    cluster: Cluster, batch: int, tp: int | None = None, dp: int | None = None, microbatches: int | None = None
) -> list[int]:
    """The tensor-parallel sizes of the dp × tp meshes to search, in the order to search them.

    Those inside a node come first, largest first (a large model wants them, and a
    small one solves quickly anyway); those that cross nodes follow, smallest first.
    dp must divide the batch, and ``microbatches`` (when given) the local batch.
    """
    world = cluster.world_size
    sizes = [t for t in range(1, world + 1) if world % t == 0]
    if tp is not None:
        sizes = [tp]
    if dp is not None:
        sizes = [t for t in sizes if world // t == dp]
    sizes = [t for t in sizes if batch % (world // t) == 0]
    if microbatches is not None:
        sizes = [t for t in sizes if (batch // (world // t)) % microbatches == 0]
    inside = [t for t in sizes if cluster.gpus_per_node % t == 0]
    return sorted(inside, reverse=True) + [t for t in sizes if t not in inside]


@long_lived_heap()
def search_meshes(
    captured: CapturedGraph,
    cluster: Cluster,
    precision: Precision,
    optimizer: str,
    memory_limit: float,
    time_limit_s: float = 60.0,
    tp: int | None = None,
    dp: int | None = None,
    zero: int | None = None,
    recompute: bool = True,
    deadline: float | None = None,
    require_one: bool = True,
    milp: bool = True,
    microbatches: int | None = None,
) -> tuple[ShardingResult | None, list[ShardingResult]]:
    """Solve every dp × tp mesh of the cluster (pp = 1) that ``tp``/``dp`` allow; the fastest that fits wins.

    Tensor-parallel sizes that cross a node are tried too, after those inside a
    node (:func:`flat_tp_sizes`): the link model makes them expensive, not
    forbidden; once one of them fits and is slower than the best mesh, the wider ones
    are left out (:func:`_lost_across_nodes`), unless ``tp`` is fixed. Past ``deadline`` (a ``time.perf_counter()`` instant) the meshes
    not yet solved are left out once one fits (``require_one=False``: all may
    be). ``milp=False`` solves only the seed layouts where a mesh has some, on the
    meshes inside a node. Returns (best or None, all results);
    each mesh's problem is built once and its seed layouts are solved on it with the
    other strategies forbidden. Only the best result has its placements and charged
    collectives filled in (:func:`describe_result` fills in another's). ``zero`` fixes
    every parameter's ZeRO stage (:func:`zero_filter`); otherwise each parameter's is chosen.
    ``recompute=False`` keeps every activation for the backward. ``microbatches`` fixes the
    micro-batch count (meshes whose local batch it does not divide are left out).
    """
    world = cluster.world_size
    sizes = flat_tp_sizes(cluster, captured.batch_size, tp, dp, microbatches)
    if not milp:  # the baselines keep tensor parallelism inside a node
        sizes = [t for t in sizes if cluster.gpus_per_node % t == 0] or sizes[:1]
    results: list[ShardingResult] = []
    per_mesh = max(time_limit_s / max(len(sizes), 1), 1.0)  # every mesh gets its share of the solver time
    for k, t in enumerate(sizes):
        late = deadline is not None and time.perf_counter() > deadline
        if late and (not require_one or any(r.estimate.fits for r in results)):
            log.info("meshes: time limit reached after %d of %d dp x tp meshes", k, len(sizes))
            break
        if cluster.gpus_per_node % t and tp is None and _lost_across_nodes(results, cluster):
            log.info("meshes: tp across nodes loses at tp=%d; tp >= %d left out", results[-1].mesh.tp, t)
            break
        mesh = cluster.check_mesh(dp=world // t, tp=t, pp=1)
        mp = prepare_mesh(captured, cluster, mesh, precision, optimizer, memory_limit, recompute=recompute)
        res = _best_on_mesh(mp, per_mesh, zero, milp, microbatches)
        log.info(
            "mesh %s: %s, step %.4g s, peak %.3g GB (%s)",
            mesh,
            res.solution.status,
            res.estimate.step_time_s,
            res.estimate.memory.peak / 1e9,
            ", ".join(f"{k} {v:.2f}" for k, v in res.timings.items()),
        )
        results.append(res)
    fitting = [r for r in results if r.solution.choice and r.estimate.fits]
    best = min(fitting, key=lambda r: r.estimate.step_time_s) if fitting else None
    if best is not None:
        describe_result(captured, best)
        if best.solution.status != "optimal":
            _bound_gap(best, time_limit_s)
    return best, results


def _lost_across_nodes(results: list[ShardingResult], cluster: Cluster) -> bool:
    """Whether the last mesh solved had tp across nodes, fitted, and was slower than the best that fits.

    A wider tp across nodes sends more of every layer's traffic over the slow links and
    holds less memory, so once a narrower one fits and loses, the wider ones are left out.
    """
    if not results or cluster.gpus_per_node % results[-1].mesh.tp == 0:
        return False
    last = results[-1]
    fitting = [r.estimate.step_time_s for r in results if r.solution.choice and r.estimate.fits]
    return bool(last.solution.choice and last.estimate.fits and last.estimate.step_time_s > min(fitting))


def _best_on_mesh(
    mp: MeshProblem, time_limit_s: float, zero: int | None, milp: bool, microbatches: int | None
) -> ShardingResult:
    """The better of the MILP's answer on ``mp`` and its seed layouts' (the seeds alone when not ``milp``).

    The seed layouts are solved first, and the best one's answer is where the
    unrestricted search starts: it can only improve on it. Seeds also guard the
    estimate's overlap of gradient synchronisation with the backward, which the MILP's
    linear objective does not see, so the final choice is by the estimate.
    """
    captured = mp.captured
    params = {p.placeholder: p.name for p in captured.params}
    conv1d = captured.model_name.startswith("GPT2")
    fixed = zero_filter(mp.sp, zero) if zero is not None else None
    # no solve spends time on a bound here: only the chosen mesh's gap is worth one (search_meshes)
    solve = functools.partial(solve_prepared, mp, describe=False, bound=False, microbatches=microbatches)
    kinds = seeds_for(mp.mesh.tp, list(params.values()))
    began = time.perf_counter()
    seeded_best: ShardingResult | None = None
    for kind in kinds:
        seed = seed_filter(kind, params, conv1d)
        share = time_limit_s / (2 * len(kinds)) if milp else time_limit_s / len(kinds)
        allowed = seed if fixed is None else both(mp.sp, seed, fixed)
        seeded = solve(share, allowed=allowed, least_peak=False, target_gap=SEED_GAP if milp else GAP_TARGET)
        seeded.source = kind
        if seeded.solution.choice and seeded.estimate.fits and (
            seeded_best is None or seeded.estimate.step_time_s < seeded_best.estimate.step_time_s
        ):
            seeded_best = seeded
    plain = None
    if milp or not kinds:  # no seed layout on this mesh: the MILP it is
        start = seeded_best.solution.choice if seeded_best is not None else None
        left = time_limit_s - (time.perf_counter() - began)
        plain = solve(max(left, 0.5 * time_limit_s), allowed=fixed, start=start)
    res = plain
    if seeded_best is not None and (
        res is None or seeded_best.estimate.step_time_s < res.estimate.step_time_s * (1 - 1e-9)
    ):
        if plain is not None:
            log.info("mesh %s: the %s layout beats the MILP's answer", mp.mesh, seeded_best.source)
        seeded_best.milp = plain
        res = seeded_best
    if res is None:  # seeds only, and none fits: report the last one
        res = seeded
    if plain is not None and res is not plain:
        _against_bound(res, plain.solution.stats.lower_bound, plain.microbatches == res.microbatches)
    res.timings = dict(mp.timings)
    return res


def _bound_gap(best: ShardingResult, time_limit_s: float) -> None:
    """The gap of the answer kept, against the best bound on the unrestricted problem.

    That is the MILP's, or its relaxation's (memory dropped, so valid at any number of
    micro-batches), whichever is higher.
    """
    unrestricted = best.milp or best
    start = time.perf_counter()
    lower = lower_bound(unrestricted.sp.problem, time_limit_s=min(1.0, 0.05 * time_limit_s))
    elapsed = time.perf_counter() - start
    best.timings["solve_s"] = best.timings.get("solve_s", 0.0) + elapsed
    log.info("mesh %s: lower bound %.6g in %.2f s", best.mesh, lower, elapsed)
    milp_lower = unrestricted.solution.stats.lower_bound
    if milp_lower is not None and unrestricted.microbatches == best.microbatches:
        lower = max(lower, milp_lower)
    _against_bound(best, lower, True)


def _against_bound(res: ShardingResult, lower: float | None, comparable: bool) -> None:
    """Set ``res``'s status and gap from a lower bound on the unrestricted problem's optimum.

    A seed's answer is an answer to the unrestricted problem too (the same costs, fewer
    strategies allowed), so that problem's bound bounds it: the gap says how far its
    linear objective can be from the optimum. (A seed wins on the estimate, which also
    credits gradient synchronisation hidden under the backward; the objective does not.)
    ``comparable`` is False when the bound is for another number of micro-batches.
    """
    sol = res.solution
    stats = replace(sol.stats)
    if res.milp is not None:
        ms = res.milp.solution
        stats = replace(
            stats,
            found_by=res.source,
            milp_status=ms.status,
            milp_gap=ms.gap,
            milp_objective=ms.objective,
            seed_status=sol.status,
            seed_gap=sol.gap,
        )
    gap = sol.gap if res.milp is None else None  # a seed's own gap is on its restricted problem
    if lower is not None and comparable and math.isfinite(sol.objective):
        stats.lower_bound = lower
        gap = max(0.0, (sol.objective - lower) / (abs(sol.objective) or 1.0))
    status = "optimal" if gap is not None and gap <= 1e-9 else "feasible"
    res.solution = replace(sol, status=status, gap=gap, stats=stats)
