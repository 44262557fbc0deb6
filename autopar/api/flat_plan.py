"""The search of the meshes without a pipeline (dp × tp), as the planner runs it, and its answer made a plan.

The best answer is kept as solved (on the folded problem) until it wins against the
pipelines: only then is it carried onto the whole graph and its placements read
(:func:`flat_result`), which takes about a second at LLaMA-2-70B's size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from autopar.api.fixed import recompute_label
from autopar.api.search_record import Sharded, mesh_record, zero_stage
from autopar.core.errors import PlanError
from autopar.core.notes import note
from autopar.cost_models.step import Config
from autopar.plans.format import size_brief
from autopar.plans.records import Fixed, MeshRecord, SearchRecord
from autopar.search.sharding.context_parallel import cp_axis_of
from autopar.search.sharding.explain_records import explain_records
from autopar.search.sharding.mesh import HOPELESS, finish_best, flat_tp_sizes, search_meshes
from autopar.search.sharding.mesh_solve import ShardingResult
from autopar.search.sharding.request import MeshRequest

log = logging.getLogger(__name__)


@dataclass
class FlatFound:
    """What the search of the meshes without a pipeline found: the best answer (one over the memory limit
    only where ``fixed`` asked for it, warned about), every mesh's result, and the time limit it had. The
    best is finished (carried onto the whole graph, its placements read) only once it wins."""

    best: ShardingResult
    results: list[ShardingResult]
    warnings: list[str]
    time_limit_s: float


def _search(captured, cluster, prec, optimizer, limit, fixed: Fixed, time_limit_s, **kwargs):
    """:func:`search_meshes` on the meshes ``fixed`` allows, under what else it fixes; the best as solved."""
    return search_meshes(
        captured,
        cluster,
        prec,
        optimizer,
        limit,
        time_limit_s,
        tp=fixed.tp,
        dp=fixed.dp,
        zero=fixed.zero,
        recompute=fixed.recompute is None,  # op by op only when no setting is fixed
        microbatches=fixed.microbatches,
        ep=fixed.ep,
        cp=fixed.cp,
        cp_axis=cp_axis_of(fixed, cluster.world_size),
        finish=False,
        **kwargs,
    )


def plan_flat(
    captured, cluster, gbs, prec, optimizer, limit, fixed, time_limit_s, deadline=None, optional=False, notes=None
) -> FlatFound | None:
    """Search per-op sharding, ZeRO stages and micro-batches on every dp × tp mesh; PlanError if none fits.

    Past ``deadline`` the meshes not yet solved are left out (the solver entry says how many);
    ``optional`` (a pipeline fits already): all of them may be, and then the answer is None, and
    a mesh is costed with its seed layouts only, the baselines a plan must not lose to. The best
    is returned as solved: :func:`flat_result` finishes it once it wins.
    """
    best, results = _search(
        captured,
        cluster,
        prec,
        optimizer,
        limit,
        fixed,
        time_limit_s,
        deadline=deadline,
        require_one=not optional,
        milp=not optional,
        notes=notes,
    )
    if not results and optional and deadline is not None and time.perf_counter() > deadline:
        log.info("meshes without a pipeline: all left out at the time limit")
        return None
    if not results:
        into = f" into {fixed.microbatches} micro-batches per rank" if fixed.microbatches is not None else ""
        raise PlanError(
            f"no dp x tp mesh of {cluster.world_size} devices splits the global batch {gbs}{into}; "
            "use a global batch that the data-parallel size (times the micro-batches) divides"
        )
    warnings: list[str] = []
    if best is None:
        best = fastest_over_limit(captured, cluster, prec, optimizer, limit, fixed, time_limit_s, results, warnings)
    return FlatFound(best, results, warnings, time_limit_s)


POLISH_AT_LEAST = 1.0
"""The least solve time a mesh is searched in full with (:func:`polish_flat`), the least
:func:`~autopar.search.sharding.mesh.search_meshes` gives a mesh whatever its share: with less left before
the deadline, the mesh keeps its seed layouts' answer."""


def polish_flat(
    captured, cluster, prec, optimizer, limit, fixed: Fixed, flat: FlatFound, deadline: float, notes=None
) -> FlatFound:
    """``flat``, costed with its seed layouts only (a pipeline was expected to win), searched again in full on
    its meshes within ``HOPELESS`` of its best, best first, sharing the time left before ``deadline`` (a
    ``time.perf_counter()`` instant).

    Run when no pipeline beats it after all: Mixtral-8x7B's states outgrow a node, so its pipelines are
    searched first, and its meshes without one, each seed given a quarter of a second on two loaded cores,
    answered dp 8 x tp 8 at 7.05 s where dp 64 under ZeRO-3, solved for longer, costs 6.93 s. A mesh
    keeps the faster of its two answers. A mesh is searched only with ``POLISH_AT_LEAST`` seconds of solving
    left after building its problem again (as long as it took beside the pipelines); the meshes it leaves
    out keep their answers, and ``notes`` says so.
    """
    fits = [r for r in flat.results if r.solution.choice and r.estimate.fits]
    if not fits:
        return flat
    cutoff = flat.best.estimate.step_time_s * (1 + HOPELESS)
    near = sorted((r for r in fits if r.estimate.step_time_s <= cutoff), key=lambda r: r.estimate.step_time_s)
    results = list(flat.results)
    for k, old in enumerate(near):
        left = deadline - time.perf_counter()
        build = sum(old.timings.get(key, 0.0) for key in ("strategies_s", "build_s"))
        if left - build < POLISH_AT_LEAST:
            if k == 0:
                note(
                    log, notes, "meshes without a pipeline: no time left to search them in full; their seed layouts' "
                    "answers stand",
                )
            else:
                note(
                    log, notes, "meshes without a pipeline: %d of %d searched in full before the time limit; the rest "
                    "keep their seed layouts' answers", k, len(near),
                )
            break
        share = min(max(left / (len(near) - k), POLISH_AT_LEAST + build), left) - build
        one = dataclasses.replace(fixed, dp=old.mesh.dp, tp=old.mesh.tp)
        new, _ = _search(captured, cluster, prec, optimizer, limit, one, share, solve_by=deadline)
        if new is not None and new.estimate.fits and new.estimate.step_time_s < old.estimate.step_time_s:
            results[results.index(old)] = new
            log.info("mesh %s searched in full: %.4g s -> %.4g s", old.mesh, old.estimate.step_time_s, new.estimate.step_time_s)
    fitting = [r for r in results if r.solution.choice and r.estimate.fits]
    best = min(fitting, key=lambda r: r.estimate.step_time_s)
    return FlatFound(best, results, flat.warnings, flat.time_limit_s)


def fastest_over_limit(captured, cluster, prec, optimizer, limit, fixed: Fixed, time_limit_s, results, warnings):
    """No mesh fits: a PlanError naming the smallest memory that would, or, when the user fixed part of
    the answer, the fastest plan of it with no limit, marked as not fitting and warned about."""
    need = least_need(results, limit)
    what = ", ".join(
        f"{k}={v}" for k, v in fixed.given().items() if k in ("dp", "tp", "ep", "cp", "zero", "microbatches", "recompute")
    )
    if not what:
        raise PlanError(
            f"no plan fits {size_brief(limit)} per device{'; ' + need if need else ''}: raise memory_limit, "
            "use more devices, or lower the batch"
        )
    least = min(results, key=least_peak)
    best, _ = search_meshes(
        captured,
        cluster,
        prec,
        optimizer,
        math.inf,
        time_limit_s,
        least.mesh.tp,
        least.mesh.dp,
        fixed.zero,
        recompute=fixed.recompute is None,
        microbatches=fixed.microbatches,
        ep=fixed.ep,
        cp=fixed.cp,
        cp_axis=cp_axis_of(fixed, cluster.world_size),
    )
    best.estimate.memory_limit, best.estimate.fits = limit, False
    msg = (
        f"no plan with {what} fits {size_brief(limit)} per device{f' ({need})' if need else ''}; the "
        f"fastest one needs {size_brief(best.estimate.memory.peak)}, over the limit by "
        f"{size_brief(best.estimate.memory.peak - limit)}"
    )
    log.warning(msg)
    warnings.append(msg)
    return best


def flat_result(captured, cluster, gbs, prec, optimizer, limit, fixed: Fixed, flat: FlatFound) -> Sharded:
    """The chosen dp x tp answer, finished (:func:`finish_best`), as a configuration, an estimate and the
    search's record."""
    request = MeshRequest(
        captured, cluster, flat.best.mesh, prec, optimizer, limit, recompute=fixed.recompute is None
    )
    best = finish_best(flat.best, flat.results, request, flat.time_limit_s)
    results = flat.results
    sol = best.solution
    est = best.estimate
    est.samples_per_s = gbs / est.step_time_s if est.step_time_s > 0 else 0.0
    m = best.microbatches
    split_sequences = gbs % (best.mesh.dp * m) != 0  # a micro-batch smaller than dp: cp over the dp ranks
    cfg = Config(
        dp=best.mesh.dp,
        tp=best.mesh.tp,
        pp=1,
        zero=zero_stage(captured, best.placements, best.mesh.dp),
        recompute=recompute_label(fixed, best.placements),
        microbatches=m,
        micro_batch_size=gbs // (m if split_sequences else best.mesh.dp * m),
        split_sequences=split_sequences,
    )
    left_out, meshes = flat_records(captured, cluster, fixed, flat)
    solver = SearchRecord(
        status=sol.status,
        gap=sol.gap,
        objective=sol.objective,
        backend=sol.backend,
        candidates=len(results),
        meshes_left_out=left_out,
        meshes=meshes,
        charged=best.charged,
        graph_nodes=sol.stats.nodes,
        nodes_after_reduction=sol.stats.nodes_after_reduction,
        ops=explain_records(captured, best),
        context_parallel_why=best.why_cp,
    )
    return Sharded((cfg, est), solver, best.placements, flat.warnings)


def flat_records(captured, cluster, fixed: Fixed, flat: FlatFound) -> tuple[int, list[MeshRecord]]:
    """How many dp x tp meshes the search left out, and a record of each it solved."""
    sizes = flat_tp_sizes(cluster, captured.batch_size, fixed.tp, fixed.dp, fixed.microbatches)
    records = [mesh_record(r, {"dp": r.mesh.dp, "tp": r.mesh.tp, "pp": 1}, r.solution.status) for r in flat.results]
    return len(sizes) - len(flat.results), records


def least_need(results, limit: float) -> str:
    """The least memory a plan needs, as the searches know it: the bound they proved where it is over the
    limit; otherwise the least an answer found needs, or "" when none was (the bound is the MILP's memory
    rows', which leave out the buffers of values being moved that the estimate counts, so it can sit under
    a limit nothing fits)."""
    bound = min(least_peak(r) for r in results)
    if math.isfinite(bound) and bound > limit:
        return f"the smallest memory that would fit is {size_brief(bound)}"
    found = min((r.estimate.memory.peak for r in results if r.solution.choice), default=math.inf)
    return f"the least any plan found needs is {size_brief(found)}" if math.isfinite(found) else ""


def least_peak(res) -> float:
    """The least peak memory a mesh's search saw: its answer's, or the least any choice reaches."""
    if res.solution.choice:
        return res.estimate.memory.peak
    peak = res.solution.stats.min_peak_memory
    return math.inf if peak is None else peak
