"""``autopar.plan``: the order of the passes, from a model to a Plan.

capture → (a fixed recompute setting carried out) → per-op sharding MILP on every
dp × tp mesh and pipeline search on pp × dp × tp meshes → choose.

What leaves no sharding to decide (one device, or a pinned data-parallel mesh
with a fixed micro-batch count and no recompute setting) is costed by the
analytic data-parallel model instead: ZeRO stage × micro-batch count,
exhaustively (:mod:`autopar.api.data_parallel`); its plan carries the
data-parallel layout's placements, solved on the graph of one micro-batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from autopar.api.data_parallel import TIE_TOLERANCE, data_parallel_placements, data_parallel_plan
from autopar.api.fixed import check_fixed, recompute_label, searches_sharding
from autopar.api.flat_plan import FlatFound, flat_records, flat_result, plan_flat, polish_flat
from autopar.api.search_record import Sharded, mesh_record, zero_stage
from autopar.core.errors import PlanError
from autopar.core.heap import long_lived_heap
from autopar.cost_models.estimate import Estimate
from autopar.cost_models.experts import CAPACITY_FACTOR
from autopar.cost_models.graph_cache import captured_with_stats, example_batch
from autopar.cost_models.memory import Precision, optimizer_states, precision_spec
from autopar.cost_models.step import Config, GraphStats
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.ops import experts as experts_op
from autopar.ops.batch_norm import coupling_modules
from autopar.plans.format import size_brief
from autopar.plans.plan import Plan
from autopar.plans.records import Fixed, PipelineRecord, SearchRecord
from autopar.plans.summary import sharding_facts
from autopar.search.pipeline.mesh import PipelineResult, pipeline_meshes, unfold_pipeline
from autopar.search.pipeline.order import pipeline_order, total_state_bytes
from autopar.search.pipeline.preview import Preview
from autopar.search.pipeline.rounds import search_pipelines
from autopar.search.pipeline.stages import forward_segments
from autopar.search.sharding.batch_dims import scaled_dims
from autopar.search.sharding.context_parallel import check_cp, context_parallel_mesh, cp_axis_of
from autopar.search.sharding.explain_records import explain_records
from autopar.search.sharding.recompute import recomputed
from autopar.search.sharding.recompute_settings import NONE, apply_setting, mark_placements, setting_marks
from autopar.search.sharding.request import MeshRequest

log = logging.getLogger(__name__)


@long_lived_heap()
def plan(
    model,
    example_inputs,
    cluster: Cluster,
    *,
    loss_fn: Callable | None = None,
    example_targets=None,
    optimizer: str = "adamw",
    precision: str = "bf16-mixed",
    global_batch_size: int | None = None,
    memory_limit: float | None = None,
    fixed: dict[str, Any] | None = None,
    time_limit_s: float = 60.0,
    reduce_dtype: str | None = None,
    capacity_factor: float | None = CAPACITY_FACTOR,
) -> Plan:
    """Plan parallel training of ``model`` on ``cluster``.

    ``example_inputs`` is one batch (a tensor, a tuple of positional
    arguments or a dict of keyword arguments; dim 0 is the batch). The
    model may live on the meta device. ``fixed`` forces part of the answer
    (``{"dp": 64, "zero": 3}``); what it leaves open is searched. Its keys are
    ``dp``, ``tp``, ``pp``, ``zero`` (0-3), ``microbatches``, ``schedule`` and
    ``recompute``: "none", "selective" (Megatron-LM's: the attention core of every
    layer), "op-sac" (torchtitan's per-op checkpointing: every other matmul and the
    attention kept, the rest of each layer replayed), "full" (every layer replayed
    from its input), or absent: the MILP chooses op by op
    (:mod:`autopar.search.sharding.recompute_settings`), or "full" where op by op only an idle
    pipeline fits (:func:`_sharded_plan`).
    ``precision``: "bf16-mixed", "fp16-mixed" or "fp32"; under mixed precision
    gradients are reduced in ``reduce_dtype``, "fp32" by default or the compute
    dtype ("bf16", "fp16") for half the gradient traffic (:mod:`autopar.runtime.precision`).
    ``time_limit_s``: wall seconds for the whole call, capture included; the search gets what
    capture leaves, and at least ``SEARCH_AT_LEAST`` of it.
    ``capacity_factor``: a mixture of experts' busiest expert-parallel rank receives this many times the mean
    of (token, choice) pairs; the estimate charges its all-to-alls and expert FLOPs that much. None (the
    default): the expectation under uniform dropless routing at the tokens a rank holds, a few tenths of a
    percent at Mixtral-8x7B's (:mod:`autopar.cost_models.experts`); a number: a padded router's capacity or a
    measured imbalance. Routing stays dropless whatever it is.
    """
    t0 = time.perf_counter()
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor >= 1):
        raise PlanError(
            f"capacity_factor must be None or a number >= 1 (1: perfectly balanced routing), not {capacity_factor!r}"
        )
    prec, fixed, limit, gbs = _checked_request(
        cluster, example_inputs, optimizer, (precision, reduce_dtype), global_batch_size, memory_limit, fixed
    )
    # the sharding search needs the graph at the global batch (a sharded dim must divide); shapes only
    sharding = searches_sharding(cluster, fixed)
    captured, stats = captured_with_stats(
        model, example_inputs, loss_fn, example_targets, batch=gbs if sharding else None
    )
    captured.capacity_factor = None if capacity_factor is None else float(capacity_factor)
    t_capture = time.perf_counter() - t0
    fixed, coupling_note = _keep_batches_whole(captured, fixed)
    warnings = [coupling_note] if coupling_note else []
    if sharding:
        search_s = max(time_limit_s - t_capture, SEARCH_AT_LEAST * time_limit_s)
        sharded = _sharded_plan(captured, stats, cluster, gbs, prec, optimizer, limit, fixed, search_s)
        sharded.warnings += warnings
        sharded.solver.capture_s = round(t_capture, 3)
        sharded.solver.time_limit_s = time_limit_s
        sharded.solver.time_s = round(time.perf_counter() - t0, 3)
        return _make_plan(
            stats,
            cluster,
            *sharded.args,
            prec,
            optimizer,
            sharded.solver,
            sharded.warnings,
            placements=sharded.placements,
            stages=sharded.stages,
            schedule=sharded.schedule,
        )
    cfg, est, solver = data_parallel_plan(stats, cluster, gbs, prec, optimizer, limit, fixed, warnings)
    # the placements it runs, on the graph the runtime captures (one micro-batch): decided once, here
    micro, _ = captured_with_stats(
        model, example_inputs, loss_fn, example_targets, batch=cfg.global_batch_size // cfg.microbatches
    )
    mesh = MeshShape(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
    placements = data_parallel_placements(micro, cluster, mesh, cfg.zero, prec, optimizer)
    solver.capture_s = round(t_capture, 3)
    solver.time_s = round(time.perf_counter() - t0, 3)
    return _make_plan(stats, cluster, cfg, est, prec, optimizer, solver, warnings, placements=placements)


def _checked_request(cluster, example_inputs, optimizer, precision, global_batch_size, memory_limit, fixed):
    """The request's values, each checked with a one-line PlanError: (precision, Fixed, memory limit, batch)."""
    if not isinstance(cluster, Cluster):
        raise PlanError(
            f"cluster must be an autopar.Cluster, not {type(cluster).__name__}; see Cluster.preset()"
        )
    prec = precision_spec(*precision)
    optimizer_states(optimizer)
    fixed = check_fixed(fixed)
    beside = fixed.tp or (
        cluster.world_size // (fixed.dp * (fixed.pp or 1)) if fixed.cp and fixed.dp and fixed.tp is None else 1
    )
    cluster.check_mesh(dp=fixed.dp, tp=beside, pp=fixed.pp or 1)  # before any capture (cp: its axis beside dp)
    limit = float(memory_limit) if memory_limit is not None else float(cluster.memory_bytes)
    if limit <= 0:
        raise PlanError(f"memory_limit must be a positive number of bytes, not {memory_limit!r}")
    gbs = example_batch(example_inputs) if global_batch_size is None else global_batch_size
    if gbs is None:
        raise PlanError("example_inputs hold no tensor with a batch dimension; pass a batch of inputs")
    if not isinstance(gbs, int) or gbs < 1:
        raise PlanError(f"global_batch_size must be a positive integer, not {global_batch_size!r}")
    return prec, fixed, limit, gbs


FULL_RECOMPUTE_AT_LEAST = 5.0
"""The least time left (seconds) in which the meshes without a pipeline are searched again under full
recompute (:func:`_sharded_plan`)."""


def _sharded_plan(captured, stats, cluster, gbs, prec, optimizer, limit, fixed: Fixed, time_limit_s) -> Sharded:
    """Per-op sharding (and pipelines) searched on the graph, a fixed recompute setting carried out first.

    With no setting fixed, recompute is the MILP's choice op by op, and where memory binds hard that
    choice can fall short of Megatron's full recompute, every layer replayed from its input:
    LLaMA-3-8B at 262,144 tokens on 64 H100s fits no mesh without a pipeline op by op, and the
    search lands on an 8-stage pipeline of one sequence a micro-batch, 87.5% idle, 75.8 s a step;
    under full recompute dp 8 x tp 8 fits in 40 GB at 47.8 s.
    So where no mesh without a pipeline fits op by op and the plan is an idle pipeline or none
    (:func:`_full_recompute_worth`), they are costed again under full recompute in the time left (with
    their seed layouts, when a plan that fits is in hand), and the faster plan that fits wins.
    """
    start = time.perf_counter()
    first, failed = None, None
    try:
        first = _sharded_as_fixed(captured, stats, cluster, gbs, prec, optimizer, limit, fixed, time_limit_s)
    except PlanError as err:
        failed = err
    left = time_limit_s - (time.perf_counter() - start)
    if not _full_recompute_worth(captured, fixed, first, cluster) or left < FULL_RECOMPUTE_AT_LEAST:
        if first is None:
            raise failed
        return first
    full_fixed = dataclasses.replace(fixed, recompute="full", pp=1)
    in_hand = first is not None and first.args[1].fits
    try:  # with a plan that fits in hand, costed with the seed layouts only, within the time left
        full = _sharded_as_fixed(
            captured, stats, cluster, gbs, prec, optimizer, limit, full_fixed, left, flat_optional=in_hand
        )
    except PlanError:
        full = None
    if full is None or not full.args[1].fits or (
        first is not None and _fitting_step(full) >= _fitting_step(first) * (1 - TIE_TOLERANCE)
    ):
        if first is None and full is not None:
            # the op-by-op search's least memory can be far above what full recompute needs: say both
            raise PlanError(
                f"{failed}; under full recompute (fixed={{'recompute': 'full'}}) the fastest plan found needs "
                f"{size_brief(full.args[1].memory.peak)}"
            ) from None
        if first is None:
            raise failed
        found = f"{_fitting_step(full):.4g} s a step" if full is not None and full.args[1].fits else "none fits"
        first.solver.stopped += f"; full recompute on the meshes without a pipeline: {found}"
        return first
    before = f"{_fitting_step(first):.4g} s a step" if first is not None and first.args[1].fits else "none fits"
    full.solver.stopped += (
        f"; no mesh without a pipeline and with tp inside a node fits with recompute op by op ({before}): "
        "full recompute"
    )
    return full


def _fitting_step(sharded: Sharded) -> float:
    """The step time of a plan that fits; inf for one that does not."""
    est = sharded.args[1]
    return est.step_time_s if est.fits else math.inf


IDLE_PIPELINE = 0.75
"""A pipeline idle for more than this share of its work, the summary's bubble (p - 1) / (v m), makes the
meshes without one worth costing under full recompute (:func:`_full_recompute_worth`)."""


def _full_recompute_worth(captured, fixed: Fixed, sharded: Sharded | None, cluster: Cluster) -> bool:
    """Whether the meshes without a pipeline are worth costing under full recompute: recompute left to the
    search, pipelines not fixed, none of those meshes with tp inside a node fitting op by op, the plan found
    (if any) a pipeline idle for more than ``IDLE_PIPELINE`` of its work, and layers to replay.

    A mesh that fits op by op only with tp across nodes is memory-bound too: LLaMA-3-8B at 524,288 tokens
    on 64 H100s fits dp 2 x tp 32 (cp 32) op by op at 282.6 s a step, and dp 8 x cp 8 under full
    recompute at 183.5 s.

    Full recompute costs a third more compute, which only a pipeline idle for more than a third of its work
    could lose to, before the communication the meshes without one add. LLaMA-3-8B at 262,144 tokens: 87.5%
    idle, and full recompute 1.59 times faster. LLaMA-3-405B on 8,192 and 16,384 H100s: 48% and 47% idle, and
    costing its meshes without a pipeline under full recompute took the call from 35 to 72 s and from 31 to
    68 s for the same plans.
    """
    if fixed.recompute is not None or (fixed.pp or 1) > 1:
        return False
    if sharded is not None:
        flat = [r for r in sharded.solver.meshes if r.mesh.get("pp", 1) == 1]
        # (a search whose meshes without a pipeline all failed records none of them)
        if any(r.fits and cluster.gpus_per_node % r.mesh.get("tp", 1) == 0 for r in flat):
            return False
        cfg, est = sharded.args
        inside = cfg.pp > 1 or cluster.gpus_per_node % cfg.tp == 0
        if inside and _busy(est):
            return False
    return bool(setting_marks(captured, "full"))


def _sharded_as_fixed(
    captured, stats, cluster, gbs, prec, optimizer, limit, fixed: Fixed, time_limit_s, flat_optional=False
) -> Sharded:
    """:func:`_sharded_plan` under ``fixed`` as it stands (``flat_optional``: see :func:`_plan_sharded`)."""
    # a fixed recompute setting is costed on the graph that runs it: replays are backward ops there
    captured, marks = apply_setting(captured, fixed.recompute or NONE)
    notes: list[str] = []
    sharded = _plan_sharded(captured, cluster, gbs, prec, optimizer, limit, fixed, time_limit_s, notes, flat_optional)
    sharded.solver.stopped = "; ".join(notes) or "every mesh costed"
    sharded.placements = mark_placements(sharded.placements, marks, recomputed(captured))
    if (fixed.recompute or NONE) != NONE and not marks:
        why = "no attention in a numbered layer" if fixed.recompute == "selective" else "no numbered layers"
        msg = f"recompute {fixed.recompute!r} finds nothing to recompute in {stats.model}: {why}"
        log.warning(msg)
        sharded.warnings.append(msg)
    sharded.solver.sharding = sharding_facts(captured, sharded.placements)  # what the summary says
    return sharded


def _keep_batches_whole(captured, fixed: Fixed) -> tuple[Fixed, str]:
    """``fixed`` with one micro-batch and no pipeline for a model whose forward couples the samples of a batch
    (BatchNorm in training, a mixture of experts' load-balancing loss), unless the user fixed them; and a
    warning when the user did. A model with inputs that are not batches of samples (a graph's edge lists) gets
    one micro-batch, and a PlanError if more were fixed.

    Cut into micro-batches, such a model normalizes each by its own statistics: the
    function of gradient accumulation on one device, not of the global batch.
    """
    odd = captured.unbatched_inputs()
    if odd:  # not batches of samples: no micro-batch can take a part of them
        if (fixed.microbatches or 1) > 1:
            raise PlanError(
                f"input {odd[0]} is not a batch of {captured.batch_size} samples (its dim 0 has another length), "
                "so micro-batches cannot split it; plan with microbatches=1"
            )
        log.info("input %s is not a batch of %d samples: one micro-batch", odd[0], captured.batch_size)
        return dataclasses.replace(fixed, microbatches=1), ""
    modules = coupling_modules(captured.gm)
    balancing = experts_op.balancing_loss(captured.gm)
    if not modules and not balancing:
        return fixed, ""
    if (fixed.microbatches or 1) > 1 or (fixed.pp or 1) > 1:
        note = (
            f"BatchNorm in {modules[0]}{f' and {len(modules) - 1} more' if len(modules) > 1 else ''} normalizes "
            "each micro-batch by its own statistics, as gradient accumulation on one device does"
            if modules
            else "the experts' load-balancing loss is taken per micro-batch, as gradient accumulation on one "
            "device takes it"
        )
        log.warning(note)
        return fixed, note
    return dataclasses.replace(fixed, microbatches=fixed.microbatches or 1, pp=fixed.pp or 1), ""


SEARCH_AT_LEAST = 0.25
"""The least share of ``time_limit_s`` the search gets however long capture took."""

OPTIONAL_FLAT = 0.25
"""The share of their time the meshes without a pipeline keep when a pipeline is searched first
(a model whose states outgrow a node): there they are costed with their seed layouts only, which
took 3 to 10 s of the 24 s they were given for LLaMA-3-405B on 8,192 and 16,384 H100s."""


def _plan_sharded(
    captured, cluster, gbs, prec, optimizer, limit, fixed, time_limit_s, notes=None, flat_optional=False
) -> Sharded:
    """Search per-op sharding, ZeRO stages, micro-batches and pipelines on every mesh; PlanError if none fits.

    Meshes without a pipeline (dp × tp) and with one (pp × dp × tp, pp ≥ 2) share the
    solver's time limit by their number; the fastest plan that fits wins, and a plan
    without a pipeline wins a tie within TIE_TOLERANCE (it is simpler to run). ``notes`` collects
    why the searches left meshes out. ``flat_optional`` (a plan is known already): the meshes without a
    pipeline, searched alone, are costed with their seed layouts only, and past the time limit all may be
    left out.
    """
    if fixed.dp is not None and gbs % fixed.dp:
        raise PlanError(
            f"global batch {gbs} does not split over {fixed.dp} data-parallel ranks; choose a multiple"
        )
    pp = fixed.pp
    if (fixed.cp or 1) > 1:
        check_cp(fixed.cp, captured, cluster.world_size)
        stage = cluster.world_size // (pp or 1)
        if stage % fixed.cp:
            raise PlanError(
                f"fixed cp={fixed.cp} with pp={pp}: a stage has {stage} devices, no mesh axis of {fixed.cp}; "
                f"choose a cp that divides {stage}"
            )
    segments = len(forward_segments(captured))
    pipe_meshes = [] if pp == 1 else pipeline_meshes(cluster, gbs, segments, fixed)
    if pp is not None and pp > 1 and not pipe_meshes:
        raise PlanError(
            f"no mesh with pp={pp} fits this model and cluster: the model has {segments} segments to cut, "
            f"{cluster.world_size} devices and a global batch of {gbs}; choose another pp"
        )
    if pipe_meshes:  # the pipelines' micro-batch counts read these: a second capture, made before two threads share the GIL
        scaled_dims(captured)
    start = time.perf_counter()
    flat_allowed = pp is None or pp == 1
    share = 0.4 if flat_allowed and pipe_meshes else 1.0  # of the time limit, for meshes without a pipeline
    # a model whose states outgrow a node is pipelined in practice (Megatron-LM: tp inside a node, pp
    # across): its pipelines are searched first, and meshes without one in the time left
    pipelines_first = bool(pipe_meshes) and flat_allowed and total_state_bytes(captured, prec, optimizer) > (
        cluster.gpus_per_node * limit
    )
    preview = Preview(captured, cluster, prec, limit)
    flat, none_fits, pipes = None, None, []

    def search_flat(deadline: float, optional: bool) -> None:
        nonlocal flat, none_fits
        # costed with their seed layouts only when a pipeline fits already: a quarter of their share
        budget = time_limit_s * share * (OPTIONAL_FLAT if optional else 1.0)
        try:
            flat = plan_flat(
                captured, cluster, gbs, prec, optimizer, limit, fixed, budget, deadline, optional, notes
            )
        except PlanError as err:  # a pipeline may still fit: its stages hold less
            if not pipe_meshes:
                raise
            none_fits = err

    def search_pipes(budget: float, tp_ref: int) -> None:
        nonlocal pipes
        # most promising first: previewed with the shardings solved so far; the rest by the
        # tensor-parallel size the meshes without a pipeline chose (``tp_ref``), fewest stages first
        pipe_meshes[:] = pipeline_order(captured, prec, optimizer, limit, pipe_meshes, tp_ref)
        pipes = _pipelines(captured, cluster, prec, optimizer, limit, fixed, pipe_meshes, budget, preview, notes)

    if pipelines_first:
        # the meshes without a pipeline are costed with their seed layouts only (optional: a pipeline
        # will most likely fit), on a second thread while the pipelines are searched: most of either
        # search is HiGHS, which runs outside the GIL, so on two cores they overlap (LLaMA-2-70B on 64
        # H100s: 26 s one after the other). Should no pipeline fit, they are searched in full after.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-flat") as pool:
            beside = pool.submit(search_flat, start + time_limit_s, True)
            search_pipes(time_limit_s * (1 - share * OPTIONAL_FLAT), cluster.gpus_per_node)
            beside.result()
        if not any(r.estimate.fits for r in pipes):
            flat, none_fits = None, None
            search_flat(start + time_limit_s, optional=False)
        elif flat is not None and flat.best.estimate.fits and flat.best.estimate.step_time_s < min(
            r.estimate.step_time_s for r in pipes if r.estimate.fits
        ):
            # costed with seeds only, the meshes without a pipeline won after all: searched in full in the time left
            flat = polish_flat(captured, cluster, prec, optimizer, limit, fixed, flat, start + time_limit_s, notes)
    else:
        if flat_allowed:
            search_flat(start + time_limit_s * share, optional=flat_optional)
        if pipe_meshes:
            preview.learn_flat(flat.results if flat else [])
            # what is left of the time limit, and at least half the share pipelines were given
            left = max(start + time_limit_s - time.perf_counter(), time_limit_s * (1 - share) / 2)
            search_pipes(left, flat.best.mesh.tp if flat is not None else cluster.gpus_per_node)
    pipe = None
    if pipe_meshes:
        pipe = min(pipes, key=lambda r: r.estimate.step_time_s) if pipes else None
    if pipe is not None and (
        flat is None
        or not flat.best.estimate.fits
        or pipe.estimate.step_time_s < flat.best.estimate.step_time_s * (1 - TIE_TOLERANCE)
    ):
        # solved on the folded layers: carried onto the whole graph once it wins (its estimate stays)
        request = MeshRequest(captured, cluster, pipe.mesh, prec, optimizer, limit, recompute=fixed.recompute is None)
        folded, pipe = pipe, unfold_pipeline(pipe, request)
        pipes = [pipe if r is folded else r for r in pipes]
        return _pipelined(captured, cluster, pipe, pipes, gbs, flat, fixed)
    if none_fits is not None:
        raise none_fits
    if flat is None:
        raise PlanError(
            f"no pipeline with {', '.join(f'{k}={v}' for k, v in fixed.given().items())} fits {size_brief(limit)} per device: "
            "raise memory_limit, use more devices, or lower the batch"
        )
    return flat_result(captured, cluster, gbs, prec, optimizer, limit, fixed, flat)


def _pipelines(
    captured, cluster, prec, optimizer, limit, fixed, meshes, time_limit_s, preview=None, notes=None
) -> list[PipelineResult]:
    """The fastest pipeline that fits on each of ``meshes``; with ``fixed`` pp and none fitting, the fastest."""
    kwargs = dict(
        schedules=(fixed.schedule,) if fixed.schedule else ("1F1B", "interleaved"),
        microbatches=fixed.microbatches,
        zero=fixed.zero,
        recompute=fixed.recompute is None,  # op by op only when no setting is fixed
        preview=preview,
        notes=notes,
        ep=fixed.ep,
        cp=fixed.cp,
        cp_axes={m: cp_axis_of(fixed, m.dp * m.tp) for m in meshes},
        spare_s=_full_recompute_spare if fixed.recompute is None and (fixed.pp or 1) <= 1 else 0.0,
    )
    found = search_pipelines(captured, cluster, prec, optimizer, limit, meshes, time_limit_s, **kwargs)
    if not found and (fixed.pp or 1) > 1:
        found = search_pipelines(captured, cluster, prec, optimizer, math.inf, meshes, time_limit_s, **kwargs)
        for r in found:
            r.estimate.memory_limit, r.estimate.fits = limit, r.estimate.memory.peak <= limit
    return found


def _full_recompute_spare(found: list[PipelineResult]) -> float:
    """The time the pipeline search leaves unspent for the full-recompute pass (:func:`_sharded_plan`): none
    once a pipeline fits that is idle for at most ``IDLE_PIPELINE`` of its work, since the pass then does not
    run (:func:`_full_recompute_worth`); twice the least it runs in otherwise (the plan is carried onto the
    whole graph between). DeepSeek-V3 on 2,048 H100s: kept for a pass that would not run, the time cost its
    pipeline search the mesh of its plan (50.818 s a step, against 75.007 s without it)."""
    return 0.0 if any(_busy(r.estimate) for r in found) else 2 * FULL_RECOMPUTE_AT_LEAST


def _busy(est: Estimate) -> bool:
    """A plan that fits and, if a pipeline, is idle for at most ``IDLE_PIPELINE`` of its work."""
    return est.fits and est.bubble_s <= IDLE_PIPELINE * (est.step_time_s - est.bubble_s)


def _pipelined(
    captured,
    cluster: Cluster,
    pipe: PipelineResult,
    pipes: list[PipelineResult],
    gbs: int,
    flat: FlatFound | None,
    fixed: Fixed,
) -> Sharded:
    """The plan pieces of a pipeline result."""
    res, est = pipe.sharding, pipe.estimate
    est.samples_per_s = gbs / est.step_time_s if est.step_time_s > 0 else 0.0
    m, mesh = pipe.microbatches, pipe.mesh
    cfg = Config(
        dp=mesh.dp,
        tp=mesh.tp,
        pp=mesh.pp,
        zero=zero_stage(captured, res.placements, mesh.dp),
        recompute=recompute_label(fixed, res.placements),
        microbatches=m,
        micro_batch_size=gbs // (mesh.dp * m),
    )
    sol = res.solution
    warnings = []
    if not est.fits:
        msg = (
            f"no pipeline fits {size_brief(est.memory_limit)} per device; the fastest needs "
            f"{size_brief(est.memory.peak)}, over the limit by {size_brief(est.memory.peak - est.memory_limit)}"
        )
        log.warning(msg)
        warnings.append(msg)
    left_out, flat_meshes = flat_records(captured, cluster, fixed, flat) if flat else (0, [])
    solver = SearchRecord(
        status=sol.status,
        gap=sol.gap,
        objective=sol.objective,
        backend=sol.backend,
        source=pipe.source,
        pipeline=PipelineRecord(
            schedule=pipe.schedule,
            chunks=pipe.chunks,
            exact=pipe.choice.exact,
            bubble_fraction=(mesh.pp - 1) / (m * pipe.chunks),
        ),
        meshes_left_out=left_out,
        meshes=flat_meshes
        + [
            mesh_record(r, r.mesh.to_dict(), r.sharding.solution.status, r.schedule)
            for r in pipes
        ],
        charged=res.charged,
        graph_nodes=sol.stats.nodes,
        nodes_after_reduction=sol.stats.nodes_after_reduction,
        ops=explain_records(captured, res),
    )
    stages = pipe.stages()
    return Sharded((cfg, est), solver, res.placements, warnings, stages, pipe.schedule)


def expert_parallel_mesh(placements: dict[str, Any], dp: int, tp: int) -> dict[str, int]:
    """``{"ep": n}`` when the plan's experts ops split the experts ``n`` ways (over dp's or tp's ranks), else {}."""
    sizes, n = (dp, tp), 1
    for entry in placements.values():
        if entry.get("op") == "autopar.experts.default" and entry["inputs"][3]:
            n = max(n, math.prod(sizes[a] for a, p in enumerate(entry["inputs"][3]) if p.is_shard(0)))
    return {"ep": n} if n > 1 else {}


def _make_plan(
    stats: GraphStats,
    cluster: Cluster,
    cfg: Config,
    est: Estimate,
    precision: Precision,
    optimizer: str,
    solver: SearchRecord,
    warnings: list[str],
    placements: dict[str, Any] | None = None,
    stages: list[dict[str, Any]] | None = None,
    schedule: str = "",
) -> Plan:
    return Plan(
        model=stats.model,
        fingerprint=stats.fingerprint,
        num_params=stats.num_params,
        frozen_params=stats.frozen_params,
        cluster=cluster.to_dict(),
        cluster_description=cluster.describe(),
        mesh={
            "dp": cfg.dp,
            "tp": cfg.tp,
            "pp": cfg.pp,
            **expert_parallel_mesh(placements or {}, cfg.dp, cfg.tp),
            **context_parallel_mesh(placements or {}, cfg.dp, cfg.tp),
        },
        zero=cfg.zero,
        recompute=cfg.recompute,
        microbatches=cfg.microbatches,
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        precision=precision.name,
        reduce_dtype=precision.reduce_dtype,
        optimizer=optimizer,
        estimate=est,
        solver=solver,
        warnings=warnings,
        placements=placements or {},
        stages=stages or [],
        schedule=schedule,
    )
