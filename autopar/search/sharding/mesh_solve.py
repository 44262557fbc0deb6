"""One mesh's sharding problem: built once, solved under restrictions at the fewest micro-batches that fit.

The search over meshes (:mod:`autopar.search.sharding.mesh`) and the pipeline search
(:mod:`autopar.search.pipeline.mesh`) both solve each mesh's problem several times: without
restriction, under each seed layout, under a ZeRO stage or a micro-batch filter, and at
more micro-batches when nothing fits. All of these are the same built problem with some
strategies forbidden or the activation memory divided; this module holds that problem
(:class:`MeshProblem`), those solves (:func:`solve_prepared`), the answer's record
(:class:`ShardingResult`) and the restrictions (:func:`zero_filter`, :func:`both`).
"""

from __future__ import annotations

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
from autopar.cost_models.estimate import Estimate
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.plans.op_records import ChargedCollective
from autopar.search.sharding.answer import describe_collectives, evaluate, read_placements
from autopar.search.sharding.derived import restrict, with_microbatches
from autopar.search.sharding.filters import keyed, node_key
from autopar.search.sharding.fold import fold_problem, unfold_choice, unfold_strategies
from autopar.search.sharding.instance import ShardingProblem
from autopar.search.sharding.microbatches import microbatch_divides, microbatch_filter
from autopar.search.sharding.node_strategies import NodeStrategies, Strategy
from autopar.search.sharding.problem import build_problem, repeated_layer_groups
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.resharding_edges import FORBIDDEN_S
from autopar.search.sharding.step_memory import peak_items, step_memory
from autopar.search.sharding.strategies import enumerate_strategies
from autopar.solver import (
    GAP_TARGET,
    MEMORY_RTOL,
    Solution,
    SolverStats,
    StrategyProblem,
    solve_strategies,
)
from autopar.solver.evaluate import objective_of, peak_memory_of

log = logging.getLogger(__name__)


@dataclass
class ShardingResult:
    mesh: MeshShape
    microbatches: int
    sp: ShardingProblem
    solution: Solution
    estimate: Estimate
    placements: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    charged: list[ChargedCollective] = field(default_factory=list)  # every collective the estimate charged
    source: str = "milp"  # "milp", or the seed layout whose answer beat the MILP's
    milp: ShardingResult | None = None  # when a seed won: the unrestricted MILP's result on the mesh
    # micro-batch counts proven not to fit (infeasible, or below the least peak): no restriction of the
    # same problem fits them either, so the seed layouts of the mesh skip them
    unfit: frozenset[int] = frozenset()
    # an answer to a folded problem: the strategies of the template it was built from (unfold_result reads
    # the whole graph's off them)
    template_strategies: dict[str, NodeStrategies] | None = None
    # gap bounded, carried onto the whole graph, placements read (mesh.finish_best): the answer a plan keeps
    finished: bool = False
    # why the answer may split the sequence for attention unasked: no layout without that fitted (mesh.py)
    why_cp: str = ""


@dataclass
class MeshProblem:
    """One mesh's sharding problem, built once (for one micro-batch) and solved under several restrictions.

    The search solves each mesh unrestricted and again for every seed layout, and
    retries with more micro-batches when nothing fits: all of these are the same
    problem with some strategies forbidden or the activation memory divided, so
    they share this one build.
    """

    request: MeshRequest
    links: list
    sp: ShardingProblem  # one micro-batch, repeated-layer groups set
    timings: dict[str, float] = field(default_factory=dict)
    strategies: dict[str, NodeStrategies] = field(default_factory=dict)  # what sp was built from

    @property
    def captured(self) -> CapturedGraph:
        return self.request.captured

    @property
    def cluster(self) -> Cluster:
        return self.request.cluster

    @property
    def mesh(self) -> MeshShape:
        return self.request.mesh

    @property
    def memory_limit(self) -> float:
        """The limit the answers must fit (none: every answer fits)."""
        limit = self.request.memory_limit
        return math.inf if limit is None else limit

    @property
    def compute_dtype(self) -> str:
        return self.request.precision.compute_dtype


@long_lived_heap()
def prepare_mesh(request: MeshRequest, strategies: dict[str, NodeStrategies] | None = None) -> MeshProblem:
    """Enumerate strategies (unless given) and build the sharding problem of ``request``'s dp × tp mesh.

    ``request.recompute``: activations may also be recomputed in the backward (a decision of the MILP).
    """
    timings: dict[str, float] = {}
    t = time.perf_counter()
    if strategies is None:
        strategies = enumerate_strategies(
            request.captured.gm, request.shape, SHARDING_AXES, batch=request.captured.batch_size
        )
    timings["strategies_s"] = time.perf_counter() - t
    t = time.perf_counter()
    sp = build_problem(request, strategies, microbatches=1)
    sp.problem.groups = repeated_layer_groups(request.captured.gm, sp)
    timings["build_s"] = time.perf_counter() - t
    timings["solve_s"] = 0.0
    return MeshProblem(request, request.links, sp, timings, strategies)


def prepare_folded(request: MeshRequest) -> MeshProblem:
    """:func:`prepare_mesh` of ``request``'s folded capture: the four traced layers' problem, folded to all of them.

    The whole graph's problem (:mod:`autopar.search.sharding.fold`), built and solved a
    layer-count times cheaper; its answers read back onto the four-layer template
    (``MeshProblem.captured`` is that template), and :func:`unfold_result` carries one onto the
    whole graph. Without a fold (a model traced whole), :func:`prepare_mesh` itself.
    """
    fold = request.captured.fold
    if fold is None:
        return prepare_mesh(request)
    template = replace(fold.template, capacity_factor=request.captured.capacity_factor)  # what plan() set
    mp = prepare_mesh(replace(request, captured=template))
    mp.sp = fold_problem(mp.sp, fold)
    return mp


def unfold_result(res: ShardingResult, request: MeshRequest) -> ShardingResult:
    """A result solved on a folded problem (:func:`prepare_folded`) as the same answer on ``request``'s whole graph.

    The whole graph's problem is built, each node takes the strategy of the template node it
    stands on, and the answer is costed there: the folded problem costs it alike (the fold's
    tests hold them equal), and what the plan records (placements, collectives) names the
    whole graph's nodes. A result not folded is returned as it is. The whole graph's strategies
    are read off the template's (:func:`~autopar.search.sharding.fold.unfold_strategies`) rather
    than enumerated again.
    """
    template_strategies = res.template_strategies
    fold = request.captured.fold
    if res.sp.template is None or fold is None:
        return res
    t = time.perf_counter()
    mp = None
    if template_strategies:
        mp = prepare_mesh(request, unfold_strategies(request.captured, template_strategies))
    solution = res.solution
    try:
        sp = with_microbatches(mp.sp, res.microbatches) if mp is not None else None
        if sp is not None and solution.choice:
            solution = replace(solution, choice=unfold_choice(sp, res.sp, solution.choice, fold))
    except ValueError:  # a layer whose strategies the template's do not give: enumerated on the whole graph
        mp = None
    if mp is None:
        mp = prepare_mesh(request)
        sp = with_microbatches(mp.sp, res.microbatches)
        solution = res.solution
        if solution.choice:
            solution = replace(solution, choice=unfold_choice(sp, res.sp, solution.choice, fold))
    limit = request.memory_limit if request.memory_limit is not None else math.inf
    shape = (res.mesh.dp, res.mesh.tp)
    estimate = evaluate(sp, solution, shape, mp.cluster, mp.captured.batch_size, limit, mp.links, mp.compute_dtype)
    timings = dict(res.timings)
    timings["unfold_s"] = time.perf_counter() - t
    return replace(res, sp=sp, solution=solution, estimate=estimate, timings=timings, placements={}, charged=[])


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
    dividing_only: bool = False,
    solve_by: float | None = None,
    whole_batch: bool = False,
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
    ``dividing_only``: at each count past one, only the placements that divide a micro-batch are
    solved over, at once, rather than after an answer that does not (the answer is the same: one
    that does not divide is never kept; a seed layout's restricted problem is rebuilt cheaply, so
    the seeds take this, and the MILP, whose answers mostly divide, does not). Each solve of the call (a
    micro-batch count, an answer solved again to fit) gets what is left of ``time_limit_s`` and at least a
    second, but none past ``solve_by`` (a ``time.perf_counter()`` instant), where it answers as its greedy start
    does. ``whole_batch``: the layout keeps the batch whole over the dp axis (context parallelism over its
    ranks), so the counts divide the global batch, down to one sequence a micro-batch.
    """
    counts = _microbatch_counts(mp, microbatches, whole_batch)
    restricted = None if allowed is None else restrict(mp.sp.problem, mp.sp, allowed)
    run = _Solves(
        mp, allowed, restricted, time.perf_counter() + time_limit_s, bound, least_peak, start, target_gap, dividing_only,
        solve_by=solve_by,
    )
    states = None  # the least memory the parameters and fixed state can take: no micro-batching lowers it
    solution, m, sp = None, counts[0], mp.sp
    proven = set(unfit)  # counts that cannot fit
    if not least_peak:
        states = sum(_least_memory(restricted or mp.sp.problem, i) for i in mp.sp.held_nodes)
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
    if mp.sp.template is not None:
        res.template_strategies = mp.strategies
    res.unfit = frozenset(proven)
    if describe:
        describe_result(mp.captured, res)
    return res


def held_batch(batch: int, dp: int, whole_batch: bool) -> int:
    """The sequences of the batch a rank holds: its dp share, or all of them where the dp axis's ranks split
    the sequence instead (``whole_batch``); the micro-batch counts divide it."""
    return batch if whole_batch else batch // dp


def _microbatch_counts(mp: MeshProblem, microbatches: int | None, whole_batch: bool = False) -> list[int]:
    """The micro-batch counts to try on ``mp``, fewest first: the divisors of the local batch (or the one given).

    ``whole_batch``: the batch is not split over the dp axis, whose ranks split the sequence instead; a rank
    then holds the whole batch, and the counts go down to one sequence a micro-batch (a count past the local
    batch keeps only the placements that divide a micro-batch: :func:`microbatch_filter`).
    """
    local = held_batch(mp.captured.batch_size, mp.mesh.dp, whole_batch)
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
    dividing_only: bool = False  # past one micro-batch, solve over the placements that divide one only
    solve_s: float = 0.0  # seconds spent solving so far
    solve_by: float | None = None  # no solve runs past it, not even its least second

    @property
    def shape(self) -> tuple[int, int]:
        return (self.mp.mesh.dp, self.mp.mesh.tp)

    def left(self) -> float:
        now = time.perf_counter()
        left = max(self.deadline - now, 1.0)
        return left if self.solve_by is None else min(left, max(self.solve_by - now, 0.0))

    def at(self, k: int) -> tuple[ShardingProblem, StrategyProblem]:
        """The problem at ``k`` micro-batches, restricted as this call's strategies are."""
        sp = with_microbatches(self.mp.sp, k)
        return sp, sp.problem if self.restricted is None else _microbatched(self.restricted, sp, self.allowed)

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
        if self.dividing_only and k > 1:
            problem = restrict(sp.problem, sp, self._divides(sp, k))
        raw, solution = self.fitted(sp, problem, self.bound)
        give_up = False
        if solution.choice and not microbatch_divides(captured, sp, solution.choice, shape, k):
            log.info("mesh %s: the answer at %d micro-batches does not divide a micro-batch", self.mp.mesh, k)
            problem = restrict(sp.problem, sp, self._divides(sp, k))
            _, solution = self.fitted(sp, problem, False)
            if solution.choice and not microbatch_divides(captured, sp, solution.choice, shape, k):
                solution, give_up = _no_answer(), True
        self.solve_s += time.perf_counter() - start
        return sp, problem, raw, solution, give_up

    def _divides(self, sp: ShardingProblem, k: int) -> Callable[[str, Strategy], bool]:
        """The strategies this call allows whose placements divide a micro-batch of ``k``."""
        divides = microbatch_filter(self.mp.captured, self.shape, k)
        return divides if self.allowed is None else both(self.mp.sp, self.allowed, divides)

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
    """The answer at the fewest micro-batch count of ``tries`` that fits, or the last one tried.

    The fewest count is solved first (most problems fit at once); past it the counts are
    bisected. More micro-batches shrink only the activations, so what fits at k fits at
    any count above it: a count that does not fit sends the search up, one that fits
    down. A memory-tight mesh so takes log2 of its counts in solves, not all of them
    (LLaMA-2-70B's dp 16 x tp 4 walked six counts one by one to fit at the seventh).
    Counts proven not to fit are added to ``proven``; a count the least-peak bound
    (:func:`_may_fit`) rules out is not solved, and with it every count below it.
    """
    limit = run.mp.memory_limit
    solution, m, sp = None, counts[0], run.mp.sp
    fit: tuple[Solution, int, ShardingProblem] | None = None  # at the fewest count that fits so far
    lo, hi = 0, len(tries) - 1
    while lo <= hi:
        if solution is not None and not solution.choice and states is not None:
            # the bound falls as the count grows: it rules out the counts from ``lo`` up to some count
            if not _may_fit(solution, m, tries[hi], states, limit):
                proven.update(c for c in tries[lo : hi + 1])
                break
            while not _may_fit(solution, m, tries[lo], states, limit):
                proven.add(tries[lo])
                lo += 1
        at = lo if solution is None else (lo + hi) // 2
        k = tries[at]
        sp, problem, raw, solution, give_up = run.solve_count(k)
        if raw.status == "infeasible":  # proven (an answer not found in time is "unknown")
            proven.add(k)
        m = k
        if states is None and not solution.choice:
            states = sum(_least_memory(problem, i) for i in sp.held_nodes)
        if solution.choice:
            fit = (solution, m, sp)
            hi = at - 1
        elif give_up:  # its placements split the batch too finely already: more micro-batches only worse
            hi = at - 1
        else:
            lo = at + 1
    if fit is not None:
        return fit
    assert solution is not None
    return solution, m, sp


def _fit_exactly(
    sp: ShardingProblem,
    problem: StrategyProblem,
    solution: Solution,
    shape: tuple[int, ...],
    memory_limit: float,
    solve: Callable[[StrategyProblem], Solution],
    tries: int = 6,
) -> Solution:
    """``solution``, solved again while its exact peak is over ``memory_limit``.

    The MILP's memory rows leave out buffers that depend on the strategies of both ends
    of an edge (a gradient being reduced, a value redistributed); the estimate counts them
    (:mod:`autopar.search.sharding.step_memory`).  Where an answer's exact peak is over the limit,
    the problem is solved again in two ways, the second where the first finds nothing:

    1. under the MILP's limit ``L`` lowered to leave room for the most such memory any answer so far
       needed beyond what the MILP saw (``hidden``): ``L' = min(L - (exact - M), M - hidden)``;
    2. under the first limit, with the buffers live at each such answer's peak as memory items
       (:func:`peak_items`: each on one end of its edge, at the most it holds under any strategy of
       the other end).

    The first keeps the MILP's view as it is and finds the answer where a little room is enough
    (LLaMA-2-70B's dp 64 under ZeRO-3 at 16 micro-batches: 79.48 GB of 80). It fails where layouts
    the MILP sees alike hold different buffers (a gradient reduced in flight or not): LLaMA-7B's shape
    on 8 H100s under full recompute at 16 GB, whose best answers peak at 16.06-16.24 GB with 0.2-0.45
    GB of buffers at a peak the rows put at 15.85-15.86 GB, the least any layout reaches there, so that
    every lower limit leaves nothing while a layout that fits in 15.97 GB exists; the second finds it.
    The items charge more than a layout may hold, so they come second. An answer that uses a forbidden
    transition is no answer, nor is one still over after ``tries`` solves.
    """
    limit = problem.memory_limit
    if limit is None or not math.isfinite(limit):
        return solution
    hidden, items, lowering = 0.0, [], True
    for _ in range(tries):
        if solution.choice and objective_of(problem, solution.choice) >= FORBIDDEN_S:
            solution = _none_of(solution)
        if solution.choice:
            exact = step_memory(sp, solution.choice, shape).peak
            if exact <= memory_limit * (1 + MEMORY_RTOL):
                return solution
            log.info("an answer the MILP fits is %.3g bytes over the limit: solving again", exact - memory_limit)
            items += peak_items(sp, problem, solution.choice, shape)
            hidden = max(hidden, exact - peak_memory_of(problem, solution.choice))
            limit = min(limit - (exact - memory_limit), memory_limit - hidden)
            lowering = lowering and limit > 0
        elif lowering and items:
            lowering = False  # the lowered limit left nothing: the first limit, the buffers seen
        else:
            return solution
        tried = replace(problem, memory_limit=limit) if lowering else _with_items(problem, items)
        solution = solve(tried)
    if solution.choice and (
        objective_of(problem, solution.choice) >= FORBIDDEN_S
        or step_memory(sp, solution.choice, shape).peak > memory_limit * (1 + MEMORY_RTOL)
    ):
        return _none_of(solution)
    return solution


def _none_of(solution: Solution) -> Solution:
    """``solution`` as no answer, its solver's figures kept."""
    return replace(solution, choice=[], status="infeasible", objective=math.inf)


def _with_items(problem: StrategyProblem, items: list) -> StrategyProblem:
    """``problem`` with more memory items."""
    return replace(problem, memory_items=[*(problem.memory_items or []), *items])


def _microbatched(
    restricted: StrategyProblem, sp: ShardingProblem, allowed: Callable[[str, Strategy], bool] | None
) -> StrategyProblem:
    """``restricted`` (from :func:`restrict`) with ``sp``'s memory and edges: another micro-batch count.

    A restriction changes only node costs and groups, and micro-batching touches node costs only
    where a strategy holds at this count alone (``sp.reopened``): those ``allowed`` permits are
    opened, so the mesh's problem is restricted once and each count reuses it.
    """
    costs = restricted.node_costs
    opened = [(i, j) for i, j in sp.reopened if allowed is None or allowed(sp.nodes[i], sp.strategies[i][j])]
    if opened:
        costs = list(costs)
        for i, j in opened:
            costs[i] = [sp.problem.node_costs[i][j] if k == j else c for k, c in enumerate(costs[i])]
    return replace(sp.problem, node_costs=costs, groups=restricted.groups)


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

    return keyed(allowed, lambda name: (name in params, name in shardable))


def both(
    sp: ShardingProblem, first: Callable[[str, Strategy], bool], then: Callable[[str, Strategy], bool]
) -> Callable[[str, Strategy], bool]:
    """Strategies both filters allow; at a node where none does, those ``then`` allows (it is binding)."""
    agree = {
        sp.nodes[i]
        for i in range(len(sp.nodes))
        if any(first(sp.nodes[i], s) and then(sp.nodes[i], s) for s in sp.strategies[i])
    }
    first_key, then_key = node_key(first), node_key(then)
    return keyed(
        lambda name, s: then(name, s) and (first(name, s) or name not in agree),
        lambda name: (first_key(name), then_key(name), name in agree),
    )


@long_lived_heap()
def describe_result(captured: CapturedGraph, res: ShardingResult) -> ShardingResult:
    """Fill in the placements and charged collectives of ``res``'s answer (once; none without one)."""
    if res.solution.choice and not res.placements:
        shape = (res.mesh.dp, res.mesh.tp)
        res.placements = read_placements(captured, res.sp, res.solution.choice)
        res.charged = describe_collectives(captured, res.sp, res.solution.choice, shape)
    return res
