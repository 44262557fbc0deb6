"""Pipeline configurations: the sharding MILP inside each stage, the stage cuts around it.

For a mesh pp × dp × tp (pp ≥ 2) the search runs in two levels, as Alpa's
does (intra-op ILP inside, inter-op slicing around):

1. **Inside a stage**: the sharding problem of the whole graph on the dp × tp
   sub-mesh every stage uses (:mod:`autopar.search.sharding.problem`), solved
   by the MILP with the memory a stage has to itself.  A stage holds 1/pp of
   the model's parameter states, and under 1F1B its first stage keeps pp
   micro-batches of its 1/pp of the layers in flight — one micro-batch of all
   of them.  So the MILP sees the parameters' memory divided by pp and the
   activations of one micro-batch: the same limit and the same decisions
   (shardings, ZeRO stage per parameter, recompute) as without a pipeline,
   on the memory a stage really has.
2. **Around the stages**: the chosen strategies give every segment of the
   forward (:func:`autopar.search.pipeline.stages.forward_segments`) its time and memory
   (:class:`autopar.cost_models.pipeline.Segment`), and
   :func:`autopar.search.pipeline.cuts.best_cuts` places the cuts exactly for each
   micro-batch count and schedule; every stage's memory is checked there with
   its own parameters and in-flight micro-batches.

Seed layouts (data parallel, ZeRO-3, Megatron) are solved on the same
sub-mesh problem beside the MILP, as for meshes without a pipeline, so that a
hand-set Megatron tp × pp × dp configuration costed by the same model can
never beat the search.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.capture.joint import CapturedGraph
from autopar.cost_models.comm import collective_time
from autopar.cost_models.estimate import Estimate, MemoryEstimate
from autopar.cost_models.pipeline import (
    Segment,
    interleaved_activations,
    pipeline_time,
    stage_activations,
    stage_figures,
)
from autopar.cost_models.schedule import chunk_depths, interleaved_runs
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.plans.records import Fixed
from autopar.search.pipeline.cuts import CutChoice, best_cuts, stage_memory_of
from autopar.search.pipeline.segments import (
    even_layer_cuts,
    layer_figures,
    microbatch_counts,
    pipeline_memory_problem,
    rescale,
)
from autopar.search.pipeline.stages import GraphSegment, forward_segments
from autopar.search.sharding.answer import evaluate
from autopar.search.sharding.context_parallel import cp_axis_of, cp_axis_sizes, cp_filter
from autopar.search.sharding.derived import restrict, with_microbatches
from autopar.search.sharding.instance import ShardingProblem
from autopar.search.sharding.mesh_solve import (
    MeshProblem,
    ShardingResult,
    both,
    describe_result,
    prepare_folded,
    prepare_mesh,
    unfold_result,
    zero_filter,
)
from autopar.search.sharding.microbatches import microbatch_divides, microbatch_filter
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.seeds import cp_kinds, ep_filter, ep_seeds, layout_filter, seeds_for
from autopar.solver import GAP_TARGET, solve_strategies

log = logging.getLogger(__name__)


@dataclass
class PipelineResult:
    """The best pipeline found on one pp × dp × tp mesh."""

    mesh: MeshShape
    microbatches: int
    schedule: str
    chunks: int
    cuts: list[int]  # segment indices where stages start (after the first)
    segments: list[Segment]
    graph_segments: list[GraphSegment]
    sharding: ShardingResult  # placements inside the stages (one micro-batch's problem)
    estimate: Estimate
    choice: CutChoice
    source: str = "milp"
    timings: dict[str, float] = field(default_factory=dict)

    def stages(self) -> list[dict[str, Any]]:
        """The plan's description of each stage: where it starts, what it holds, its time and memory."""
        bounds = [0, *self.cuts, len(self.segments)]
        out = []
        for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            fig = stage_figures(self.segments, a, b)
            names = [seg.name for seg in self.graph_segments[a:b]]
            out.append(
                {
                    "first": self.graph_segments[a].first,
                    "segments": names,
                    "forward_s": fig.forward_s,
                    "backward_s": fig.backward_s,
                    "params": fig.params,
                    "memory_bytes": self.choice.memory[s % len(self.choice.memory)],
                    "device": s % self.mesh.pp,
                }
            )
        return out


def _costed_cuts(segments, cuts, m, schedule, p2p, memory_limit, chunks) -> CutChoice | None:
    if cuts is None:
        return None
    memory = stage_memory_of(segments, cuts, m, schedule, chunks)
    if max(memory) > memory_limit:
        return None
    return CutChoice(cuts, pipeline_time(segments, cuts, m, schedule, p2p, chunks), memory, exact=False)


def _splittable(pm: PipelineMesh, sp: ShardingProblem, choice: list[int]) -> list[int]:
    """The micro-batch counts under which every placement of ``choice`` still divides its tensor."""
    return [m for m in pm.counts if microbatch_divides(pm.solved, sp, choice, (pm.mesh.dp, pm.mesh.tp), m)]


@dataclass
class PipelineMesh:
    """One pp × dp × tp mesh's sharding problem, built once and solved under several layouts."""

    captured: CapturedGraph
    mesh: MeshShape
    mp: MeshProblem
    sp: ShardingProblem  # at the most micro-batches, the parameters' states divided by pp
    counts: list[int]  # micro-batch counts to cost
    graph_segments: list[GraphSegment]
    link: Any
    activation_scale: float
    memory_limit: float
    ep: int | None = None  # the experts' split fixed (seeds.ep_filter); None: searched
    cp: int | None = None  # attention's split of the sequence fixed (context_parallel.cp_filter); None: searched
    cp_axis: int | None = None  # the mesh axis a fixed cp splits the sequence over; None: either

    @property
    def solve_microbatches(self) -> int:
        return self.counts[-1]

    @property
    def solved(self) -> CapturedGraph:
        """The graph the problem's node names are of: the four traced layers' when it is folded."""
        return self.mp.captured

    def p2p(self, nbytes: float) -> float:
        return collective_time("send_recv", nbytes, 2, self.link) if nbytes > 0 else 0.0


def prepare_pipeline_mesh(
    request: MeshRequest, *, microbatches: int | None = None, fold: bool = True
) -> PipelineMesh | None:
    """Build the problem of ``request``'s mesh (pp ≥ 2); None when the model has fewer segments than stages.

    ``fold`` (on a folded capture): the problem is the four traced layers' folded to all of them
    (:func:`~autopar.search.sharding.mesh_solve.prepare_folded`); its answers are carried onto the
    whole graph by :func:`unfold_pipeline`.
    """
    captured, mesh = request.captured, request.mesh
    graph_segments = forward_segments(captured)
    if len(graph_segments) < mesh.pp:
        return None
    counts = microbatch_counts(captured.batch_size // mesh.dp, mesh.pp, microbatches)
    if not counts:
        return None
    mp = prepare_folded(request) if fold else prepare_mesh(request)
    # its answers are costed at every count: none takes a strategy that holds at the most alone
    sp = pipeline_memory_problem(with_microbatches(mp.sp, counts[-1], reopen=False), mesh.pp)
    link = request.cluster.axis_link(mesh, "pp")
    return PipelineMesh(
        captured, mesh, mp, sp, counts, graph_segments, link, request.activation_scale, mp.memory_limit
    )


def layout_candidates(pm: PipelineMesh, zero: int | None, milp: bool, layouts: tuple[str, ...] | None):
    """(name, strategy filter) of each way to shard inside the stages: the MILP and the seed layouts."""
    captured = pm.solved
    fixed = zero_filter(pm.mp.sp, zero) if zero is not None else None
    if pm.ep is not None:
        by_ep = ep_filter(captured, (pm.mesh.dp, pm.mesh.tp), pm.ep)
        fixed = by_ep if fixed is None else both(pm.mp.sp, fixed, by_ep)
    if pm.cp is not None:
        by_cp = cp_filter(captured, (pm.mesh.dp, pm.mesh.tp), pm.cp, pm.cp_axis)
        fixed = by_cp if fixed is None else both(pm.mp.sp, fixed, by_cp)
    params = {p.placeholder: p.name for p in captured.params}
    out = [("milp", fixed)] if milp else []
    kinds = layouts if layouts is not None else seeds_for(pm.mesh.tp, list(params.values()))
    if pm.ep is not None:
        kinds = [k for k in kinds if k in ep_seeds(pm.ep, pm.mesh.dp, pm.mesh.tp)]
    if pm.cp is not None:  # the seeds that split the sequence as fixed (of those asked for, when asked)
        allowed = cp_kinds(kinds, pm.cp, pm.mesh.dp, pm.mesh.tp, pm.cp_axis)
        kinds = allowed if layouts is None else [k for k in kinds if k in allowed]
    for kind in kinds:
        seed = layout_filter(kind, captured, (pm.mesh.dp, pm.mesh.tp))
        out.append((kind, seed if fixed is None else both(pm.mp.sp, seed, fixed)))
    return out


def solve_pipeline(
    pm: PipelineMesh,
    time_limit_s: float,
    *,
    schedules: tuple[str, ...] = ("1F1B",),
    zero: int | None = None,
    milp: bool = True,
    layouts: tuple[str, ...] | None = None,
    even_cuts: bool = False,
    start: list[int] | None = None,
    target_gap: float = GAP_TARGET,
    dividing_only: bool = False,
) -> PipelineResult | None:
    """The fastest pipeline on ``pm``'s mesh that fits, or None.

    Each candidate way of sharding inside the stages (the MILP when ``milp``, and
    ``layouts``, default the mesh's seed layouts) is solved once; its segments are
    costed at each micro-batch count and schedule, and the cuts placed exactly
    (:func:`autopar.search.pipeline.cuts.best_cuts`).  ``even_cuts`` cuts at an equal
    number of layers per stage instead (the first stage also holds what comes
    before the layers, the last what comes after), as Megatron-LM does: with
    ``milp=False, layouts=("megatron",)`` that costs a hand-set configuration.
    ``start``: a known answer to the stage problem (a seed layout's) the MILP starts from;
    ``target_gap``: each solve stops once proven this close to its bound. ``dividing_only``: each
    candidate is solved once, with only the placements that divide a micro-batch at the most
    micro-batches (a pipeline's answer at every count), not first without that restriction.
    """
    t0 = time.perf_counter()
    candidates = layout_candidates(pm, zero, milp, layouts)
    if not candidates:
        return None
    per = max(time_limit_s / len(candidates), 1.0)
    mesh, mp, m_solve = pm.mesh, pm.mp, pm.solve_microbatches
    shape = (mesh.dp, mesh.tp)
    best: tuple | None = None  # (step, m, schedule, chunks, choice, segments, solution, source)
    for source, solution, counts in _stage_answers(pm, candidates, per, start, target_gap, dividing_only):
        sp_solve = with_microbatches(mp.sp, m_solve)
        base = layer_figures(
            pm.captured, sp_solve, solution.choice, pm.graph_segments, shape, m_solve, pm.activation_scale, mp.links
        )
        for m in counts:
            segments = rescale(base, m_solve, m)
            for schedule in schedules:
                chunks = 2 if schedule == "interleaved" else 1
                if chunks > 1 and not interleaved_runs(mesh.pp, m):
                    continue  # a count the runtime's schedule (torch's) refuses
                if even_cuts:
                    cuts = even_layer_cuts(pm.graph_segments, mesh.pp * chunks)
                    choice = _costed_cuts(segments, cuts, m, schedule, pm.p2p, pm.memory_limit, chunks)
                else:
                    choice = best_cuts(segments, mesh.pp, m, schedule, pm.p2p, pm.memory_limit, chunks)
                if choice is not None and (best is None or choice.time.step_s < best[0] * (1 - 1e-9)):
                    best = (choice.time.step_s, m, schedule, chunks, choice, segments, solution, source)
    if best is None:
        return None
    _, m, schedule, chunks, choice, segments, solution, source = best
    res = ShardingResult(mesh, m, with_microbatches(mp.sp, m), solution, Estimate(), source=source)
    if mp.sp.template is not None:
        res.template_strategies = mp.strategies
    est = _estimate(pm.captured, res, segments, choice, schedule, chunks, mp, pm.memory_limit)
    result = PipelineResult(
        mesh, m, schedule, chunks, choice.cuts, segments, pm.graph_segments, res, est, choice, source
    )
    if res.sp.template is None:  # a folded answer is described once carried onto the whole graph
        describe_result(pm.captured, res)
    result.timings = {**mp.timings, "pipeline_s": time.perf_counter() - t0}
    log.info(
        "mesh %s: pipeline %s, %d micro-batches, step %.4g s (%s)", mesh, schedule, m, est.step_time_s, source
    )
    return result


def _stage_answers(
    pm: PipelineMesh, candidates, per: float, start: list[int] | None, target_gap: float, dividing_only: bool = False
):
    """(source, solution, micro-batch counts it divides at) of each candidate way to shard inside the stages.

    An answer whose placements split a batch dim finer than a micro-batch holds is solved
    again without such placements (they divide at every count, since every count divides
    the most micro-batches).
    """
    sp, m_solve = pm.sp, pm.solve_microbatches
    divides = microbatch_filter(pm.solved, (pm.mesh.dp, pm.mesh.tp), m_solve)
    for source, allowed in candidates:
        known = start if source == "milp" else None
        counts: list[int] = []
        if not dividing_only:
            problem = sp.problem if allowed is None else restrict(sp.problem, sp, allowed)
            solution = solve_strategies(problem, time_limit_s=per, bound=False, start=known, target_gap=target_gap)
            counts = _splittable(pm, sp, solution.choice) if solution.choice else []
            if solution.choice:
                yield source, solution, counts
        if m_solve not in counts:
            # a fixed experts' split binds over the micro-batch's divisibility (the counts it divides then follow)
            narrow = divides if allowed is None else both(sp, divides, allowed) if pm.ep else both(sp, allowed, divides)
            narrowed = restrict(sp.problem, sp, narrow)
            solution = solve_strategies(narrowed, time_limit_s=per, bound=False, start=known, target_gap=target_gap)
            if solution.choice:
                yield source, solution, _splittable(pm, sp, solution.choice)


def solve_pipeline_mesh(
    request: MeshRequest,
    time_limit_s: float,
    *,
    schedules: tuple[str, ...] = ("1F1B",),
    microbatches: int | None = None,
    zero: int | None = None,
    milp: bool = True,
    layouts: tuple[str, ...] | None = None,
    even_cuts: bool = False,
) -> PipelineResult | None:
    """:func:`prepare_pipeline_mesh` then :func:`solve_pipeline`: the fastest pipeline on ``request``'s mesh, or None."""
    pm = prepare_pipeline_mesh(request, microbatches=microbatches)
    if pm is None:
        return None
    result = solve_pipeline(
        pm, time_limit_s, schedules=schedules, zero=zero, milp=milp, layouts=layouts, even_cuts=even_cuts
    )
    return None if result is None else unfold_pipeline(result, request)


def unfold_pipeline(result: PipelineResult, request: MeshRequest) -> PipelineResult:
    """``result`` with its sharding carried onto ``request``'s whole graph and described there
    (:func:`~autopar.search.sharding.mesh_solve.unfold_result`); one solved on the whole graph as it is."""
    if result.sharding.sp.template is None:
        return result
    sharding = unfold_result(result.sharding, request)
    describe_result(request.captured, sharding)
    return replace(result, sharding=sharding)


def _estimate(captured, res, segments, choice, schedule, chunks, mp, memory_limit) -> Estimate:
    """The pipeline's Estimate: its step, the worst stage's memory, and the collectives inside stages."""
    inner = evaluate(
        res.sp,
        res.solution,
        (res.mesh.dp, res.mesh.tp),
        mp.cluster,
        captured.batch_size,
        memory_limit,
        mp.links,
        mp.compute_dtype,
    )
    t = choice.time
    memory = stage_memory_of(segments, choice.cuts, res.microbatches, schedule, chunks)
    worst = max(range(len(memory)), key=memory.__getitem__)
    bounds = [0, *choice.cuts, len(segments)]
    pieces = [stage_figures(segments, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    mine = pieces[worst :: len(memory)] if chunks > 1 else [pieces[worst]]
    share = sum(x.state_bytes for x in mine) / max(sum(x.state_bytes for x in pieces), 1e-30)
    collectives = list(inner.collectives)
    sends = len(choice.cuts)
    if sends:
        nbytes = sum(segments[c - 1].boundary_bytes for c in choice.cuts) / sends
        collectives.append(
            {
                "kind": "send_recv",
                "axis": "pp",
                "bytes": nbytes,
                "count": 2 * sends * res.microbatches,
                "time_s": t.p2p_s,
            }
        )
    devices = res.mesh.size
    peak_flops = mp.cluster.device_spec.peak_flops[mp.compute_dtype]
    flops = inner.model_flops
    peak = max(memory)
    if chunks > 1:  # the gradient sum of the chunk in a later backward where the rank's peak is, if there
        rows = chunk_depths(len(memory), chunks, res.microbatches)[worst]
        twice = interleaved_activations(mine, rows, res.microbatches)[1]
    else:
        x = mine[0]
        twice = stage_activations(x.saved_bytes, x.grad_bytes, schedule, worst, len(memory), res.microbatches)[1]
    held = sum(x.state_bytes for x in mine) + twice
    activations = max(0.0, peak - held)
    # the sum of the earlier micro-batches' gradients, beside those the backward makes, where the peak has it
    grads = inner.memory.grads * share + twice
    mem = MemoryEstimate(
        params=inner.memory.params * share,
        grads=grads,
        optimizer=inner.memory.optimizer * share,
        activations=activations,
        peak=peak,
        at_peak={
            "params": inner.memory.params * share,
            "optimizer": inner.memory.optimizer * share,
            "grads": grads,
            "activations": activations,
        },
        peak_at=f"pipeline stage {worst} with its micro-batches in flight ({schedule})",
    )
    rate = t.step_s * devices * peak_flops
    return Estimate(
        step_time_s=t.step_s,
        samples_per_s=captured.batch_size / t.step_s if t.step_s > 0 else 0.0,
        mfu=flops / rate if t.step_s > 0 else 0.0,
        hfu=inner.hardware_flops / rate if t.step_s > 0 else 0.0,
        memory=mem,
        memory_limit=memory_limit,
        fits=peak <= memory_limit,
        compute_s=t.work_s,
        comm_s=inner.comm_s + t.p2p_s,
        exposed_comm_s=t.p2p_s,
        optimizer_s=t.tail_s,
        recompute_s=inner.recompute_s / max(res.mesh.pp, 1),
        bubble_s=t.bubble_s,
        model_flops=flops,
        hardware_flops=inner.hardware_flops,
        collectives=collectives,
    )


def pipeline_meshes(cluster: Cluster, batch: int, segments: int, fixed: Fixed) -> list[MeshShape]:
    """The pp × dp × tp meshes (pp ≥ 2) worth a pipeline search, fewest stages first.

    Tensor parallelism stays inside a node, its size a divisor of the node's
    devices (across nodes it runs on the slow links: Megatron-LM keeps it there
    too); a stage needs at least one segment;
    dp must divide the batch.
    """
    world = cluster.world_size
    out = []
    for pp in range(2, world + 1):
        if world % pp or pp > segments or (fixed.pp is not None and fixed.pp != pp):
            continue
        for tp in range(1, world // pp + 1):
            if (world // pp) % tp or (fixed.tp is not None and fixed.tp != tp):
                continue
            if cluster.gpus_per_node % tp and fixed.tp is None:
                continue
            dp = world // (pp * tp)
            if batch % dp or (fixed.dp is not None and fixed.dp != dp):
                continue
            if (fixed.ep or 1) > 1 and fixed.ep not in (dp, tp):
                continue
            if not cp_axis_sizes(fixed.cp or 1, dp, tp, cp_axis_of(fixed, dp * tp)):
                continue
            out.append(cluster.check_mesh(dp=dp, tp=tp, pp=pp))
    return out

