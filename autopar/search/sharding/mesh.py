"""Sharding search over the dp × tp meshes of a cluster, one mesh's problem solved at a time.

strategies → MILP instance → solve → per-node placements + an Estimate
(:mod:`autopar.search.sharding.mesh_solve` builds and solves one mesh's problem,
:mod:`autopar.search.sharding.answer` costs a chosen answer). Baseline layouts (pure data
parallel, ZeRO-3 style parameter sharding, Megatron-style tensor parallel) are costed by
the same code with the parameters' placements restricted, so every comparison uses one
model; the best of them is where the unrestricted search starts.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

from autopar.capture.joint import CapturedGraph
from autopar.core.heap import long_lived_heap
from autopar.core.notes import note
from autopar.cost_models.memory import Precision
from autopar.hardware.cluster import Cluster
from autopar.plans.format import size_brief
from autopar.search.sharding.context_parallel import (
    attention_kernels,
    contiguous_only,
    cp_axis_sizes,
    cp_filter,
)
from autopar.search.sharding.mesh_solve import (
    MeshProblem,
    ShardingResult,
    both,
    describe_result,
    held_batch,
    prepare_folded,
    prepare_mesh,
    solve_prepared,
    unfold_result,
    zero_filter,
)
from autopar.search.sharding.node_strategies import NodeStrategies, Strategy
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.seeds import (
    cp_kinds,
    cp_seeds,
    ep_filter,
    ep_seeds,
    fallback_seeds,
    layout_filter,
    seeds_for,
)
from autopar.solver import (
    GAP_TARGET,
    PROVED_GAP,
    lower_bound,
)

log = logging.getLogger(__name__)

HOPELESS = 0.1
"""A mesh whose answer so far is this much slower than the best plan found is given no more than a
polish: its seed layouts' answers stand, and the MILP starts from the best of them for at most
``MILP_POLISH_OF`` times what they took (the pipeline search leaves such meshes out by their preview)."""

MILP_POLISH_OF = 2

SEED_GAP = 0.05
"""A seed layout solved before the unrestricted search is its starting point, not its answer:
it is solved to this gap, and the unrestricted search (to ``GAP_TARGET``) improves on it."""


def solve_mesh(
    request: MeshRequest,
    time_limit_s: float = 60.0,
    allowed: Callable[[str, Strategy], bool] | None = None,
    strategies: dict[str, NodeStrategies] | None = None,
) -> ShardingResult:
    """The cheapest sharding of ``request``'s graph on its dp × tp mesh that fits its memory limit.

    ``request.recompute``: activations may be recomputed (as :func:`search_meshes` allows by default).
    """
    mp = prepare_mesh(request, strategies)
    res = solve_prepared(mp, time_limit_s, allowed)
    res.timings = dict(mp.timings)
    return res


def flat_tp_sizes(
    cluster: Cluster,
    batch: int,
    tp: int | None = None,
    dp: int | None = None,
    microbatches: int | None = None,
    cp_dp: int | None = None,
) -> list[int]:
    """The tensor-parallel sizes of the dp × tp meshes to search, in the order to search them.

    Those inside a node come first, largest first (a large model wants them, and a
    small one solves quickly anyway); those that cross nodes follow, smallest first.
    dp must divide the batch, and ``microbatches`` (when given) the local batch, or the whole batch
    where a fixed cp of ``cp_dp`` may split the sequence over the dp axis's ranks instead.
    """
    world = cluster.world_size
    sizes = [t for t in range(1, world + 1) if world % t == 0]
    if tp is not None:
        sizes = [tp]
    if dp is not None:
        sizes = [t for t in sizes if world // t == dp]
    sizes = [t for t in sizes if batch % (world // t) == 0]
    if microbatches is not None:
        sizes = [t for t in sizes if (batch // (world // t)) % microbatches == 0 or (world // t == cp_dp and batch % microbatches == 0)]
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
    notes: list[str] | None = None,
    fold: bool = True,
    ep: int | None = None,
    cp: int | None = None,
    cp_axis: int | None = None,
    finish: bool = True,
    solve_by: float | None = None,
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
    micro-batch count (meshes whose local batch it does not divide are left out). ``notes`` (when
    given) collects why meshes were left out, as the log says it. ``fold`` (on a folded capture):
    each mesh's problem is the four traced layers' folded to all of them
    (:func:`~autopar.search.sharding.mesh_solve.prepare_folded`), and the best answer is carried onto
    the whole graph (:func:`~autopar.search.sharding.mesh_solve.unfold_result`): the other results
    read back onto the template (``ShardingResult.sp.template`` is set). ``ep`` fixes the experts' split
    (:func:`ep_filter`), ``cp`` attention's split of the sequence (:func:`cp_filter`): meshes with no axis
    of that size are left out; ``cp_axis`` (0 or 1) names the axis the sequence is split over.
    ``finish=False`` returns the best as solved (on the folded problem, its gap not bounded, its placements
    not read): a caller that may not keep it finishes it with :func:`finish_best` once it wins. ``solve_by``
    (a ``time.perf_counter()`` instant): no solve of a mesh is given time past it, whatever the least a mesh's
    seeds and MILP otherwise get (:func:`_best_on_mesh`).
    """
    world = cluster.world_size
    fold = fold and captured.fold is not None
    sizes = flat_tp_sizes(cluster, captured.batch_size, tp, dp, microbatches, cp_over_dp(cp, cp_axis))
    if not milp:  # the baselines keep tensor parallelism inside a node
        sizes = [t for t in sizes if cluster.gpus_per_node % t == 0] or sizes[:1]
    results: list[ShardingResult] = []
    began = time.perf_counter()
    for k, t in enumerate(sizes):
        # every mesh gets its share of the solver time, and what the earlier ones left unspent
        per_mesh = max((time_limit_s - (time.perf_counter() - began)) / (len(sizes) - k), 1.0)
        late = deadline is not None and time.perf_counter() > deadline
        if late and (not require_one or any(r.estimate.fits for r in results)):
            note(log, notes, "meshes: time limit reached after %d of %d dp x tp meshes", k, len(sizes))
            break
        if cluster.gpus_per_node % t and tp is None and _lost_across_nodes(results, cluster):
            note(log, notes, "meshes: tp across nodes loses at tp=%d; tp >= %d left out", results[-1].mesh.tp, t)
            break
        if ep is not None and ep > 1 and ep not in (world // t, t):
            continue
        if cp is not None and not cp_axis_sizes(cp, world // t, t, cp_axis):
            continue
        mesh = cluster.check_mesh(dp=world // t, tp=t, pp=1)
        request = MeshRequest(captured, cluster, mesh, precision, optimizer, memory_limit, recompute=recompute)
        mp = prepare_folded(request) if fold else prepare_mesh(request)
        best_step = min((r.estimate.step_time_s for r in results if r.solution.choice and r.estimate.fits), default=None)
        res = _best_on_mesh(mp, per_mesh, zero, milp, microbatches, best_step, ep, cp, cp_axis, solve_by)
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
    if best is not None and finish:
        request = MeshRequest(captured, cluster, best.mesh, precision, optimizer, memory_limit, recompute=recompute)
        best = finish_best(best, results, request, time_limit_s)
    return best, results


def cp_over_dp(cp: int | None, cp_axis: int | None) -> int | None:
    """A fixed cp that may split the sequence over the dp axis's ranks (where that axis has ``cp`` of them),
    or None."""
    return cp if cp is not None and cp > 1 and cp_axis in (None, 0) else None


def finish_best(
    best: ShardingResult, results: list[ShardingResult], request: MeshRequest, time_limit_s: float
) -> ShardingResult:
    """The answer a plan keeps, made whole: its gap bounded, carried onto the whole graph, its placements read.

    Done for one result only, the one that wins (unfolding LLaMA-2-70B's answer takes about a second),
    and in place of it in ``results``. Done once: a finished result is returned as it is.
    """
    if best.finished:
        return best
    if best.solution.status != "optimal":
        _bound_gap(best, time_limit_s)
    where = next((k for k, r in enumerate(results) if r is best), None)
    best = unfold_result(best, request)
    describe_result(request.captured, best)
    best.finished = True
    if where is not None:
        results[where] = best
    return best


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
    mp: MeshProblem,
    time_limit_s: float,
    zero: int | None,
    milp: bool,
    microbatches: int | None,
    best_step: float | None = None,
    ep: int | None = None,
    cp: int | None = None,
    cp_axis: int | None = None,
    solve_by: float | None = None,
) -> ShardingResult:
    """The better of the MILP's answer on ``mp`` and its seed layouts' (the seeds alone when not ``milp``).

    The seed layouts are solved first, and the best one's answer is where the
    unrestricted search starts: it can only improve on it. Seeds also guard the
    estimate's overlap of gradient synchronisation with the backward, which the MILP's
    linear objective does not see, so the final choice is by the estimate. When the best
    seed is more than ``HOPELESS`` slower than ``best_step`` (the best plan of the meshes
    solved before), the MILP only polishes it (LLaMA-7B on 64 H100s: dp 4 x tp 16's MILP
    spent 15 s bringing it from 1.149 s to 1.148 s, against 0.849 s for dp 8 x tp 8). No solve is given time
    past ``solve_by``, not even the second a solve otherwise gets at least (a seed then answers as its greedy
    start does), and the MILP does not run past it once a seed fits.
    """
    captured = mp.captured
    params = {p.placeholder: p.name for p in captured.params}
    fixed = zero_filter(mp.sp, zero) if zero is not None else None
    if ep is not None:
        by_ep = ep_filter(mp.captured, (mp.mesh.dp, mp.mesh.tp), ep)
        fixed = by_ep if fixed is None else both(mp.sp, fixed, by_ep)
    if cp is not None:
        by_cp = cp_filter(mp.captured, (mp.mesh.dp, mp.mesh.tp), cp, cp_axis)
        fixed = by_cp if fixed is None else both(mp.sp, fixed, by_cp)
    # head-tail shards of the sequence where it is split for attention on purpose (a fixed cp, a cp seed): the
    # other solves keep to contiguous shards, and so to the problem's size without the twins (balanced_shards)
    plain_order = fixed
    if cp is None and any(not contiguous_only("", s) for ss in mp.sp.strategies for s in ss):
        plain_order = contiguous_only if fixed is None else both(mp.sp, fixed, contiguous_only)
    # no solve spends time on a bound here: only the chosen mesh's gap is worth one (search_meshes)
    solve = functools.partial(
        solve_prepared, mp, describe=False, bound=False, microbatches=microbatches, solve_by=solve_by
    )
    kinds = seeds_for(mp.mesh.tp, list(params.values()))
    if ep is not None:  # the seeds that split the experts as fixed, or none
        kinds = [k for k in kinds if k in ep_seeds(ep, mp.mesh.dp, mp.mesh.tp)]
    if cp is not None:  # the seeds that split the sequence as fixed
        kinds = cp_kinds(kinds, cp, mp.mesh.dp, mp.mesh.tp, cp_axis)
    began = time.perf_counter()
    seeded_best: ShardingResult | None = None
    seeded: ShardingResult | None = None
    seeds_budget = time_limit_s / 2 if milp else time_limit_s

    def whole_batch(kind: str) -> bool:  # cp over the dp axis's ranks: each holds the whole batch
        return kind.startswith("cp_dp")

    def counts_divide(whole: bool) -> bool:  # a fixed micro-batch count divides what a rank holds
        return microbatches is None or held_batch(captured.batch_size, mp.mesh.dp, whole) % microbatches == 0

    def run_seeds(kinds: list[str]) -> None:
        nonlocal seeded, seeded_best
        kinds = [kind for kind in kinds if counts_divide(whole_batch(kind))]
        for k, kind in enumerate(kinds):
            seed = layout_filter(kind, captured, (mp.mesh.dp, mp.mesh.tp))
            # what an earlier seed left unspent (one that is infeasible at once) goes to the later ones
            share = max(seeds_budget - (time.perf_counter() - began), 0.25 * seeds_budget) / (len(kinds) - k)
            share = _until(solve_by, share, len(kinds) - k)
            order = fixed if kind.startswith("cp") else plain_order
            allowed = seed if order is None else both(mp.sp, seed, order)
            seeded = solve(
                share, allowed=allowed, least_peak=False, target_gap=SEED_GAP if milp else GAP_TARGET,
                dividing_only=True, whole_batch=whole_batch(kind),
            )  # fmt: skip
            seeded.source = kind
            if seeded.solution.choice and seeded.estimate.fits and (
                seeded_best is None or seeded.estimate.step_time_s < seeded_best.estimate.step_time_s
            ):
                seeded_best = seeded

    run_seeds(kinds)
    # the full search only: costed with seeds only (a pipeline fits already), Megatron beside ZeRO-3 on the
    # 70B's dp 32 x tp 2, where Megatron alone does not fit, took the last 5 s of the call
    fallback = [] if not milp or cp is not None else fallback_seeds(kinds)
    fallback = [k for k in fallback if ep is None or k in ep_seeds(ep, mp.mesh.dp, mp.mesh.tp)]
    if seeded_best is None and fallback:
        run_seeds(fallback)
    why_cp = ""
    if seeded_best is None and cp is None and ep is None and attention_kernels(captured.gm):
        # no other layout fits: the activations may, split on the sequence over either axis
        failed = [k for k in kinds + fallback if counts_divide(whole_batch(k))]
        run_seeds(cp_seeds(mp.mesh.dp, mp.mesh.dp, 1) + cp_seeds(mp.mesh.tp, 1, mp.mesh.tp))
        why_cp = _why_context_parallel(mp, failed, microbatches)
    plain = None
    past = solve_by is not None and time.perf_counter() >= solve_by and seeded_best is not None
    if (milp or seeded is None) and not past:  # no seed layout ran on this mesh: the MILP it is
        start = seeded_best.solution.choice if seeded_best is not None else None
        left = _until(solve_by, max(time_limit_s - (time.perf_counter() - began), 0.5 * time_limit_s))
        if _far_behind(seeded_best, best_step):
            left = min(left, MILP_POLISH_OF * (time.perf_counter() - began))
            log.info("mesh %s: the seed layouts are more than %.0f%% slower than the best plan: a polish only", mp.mesh, 100 * HOPELESS)
        cp_seeded = seeded_best is not None and seeded_best.source.startswith("cp")
        # past the local batch only from a context-parallel seed over the dp ranks that fits: where none does,
        # the MILP's counts past it would cost seconds each (LLaMA-3-8B at 262,144 tokens: 20 s of the 60)
        whole = cp_seeded and whole_batch(seeded_best.source)
        if counts_divide(whole):
            plain = solve(left, allowed=fixed if cp_seeded else plain_order, start=start, whole_batch=whole)
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
    res.why_cp = why_cp
    if plain is not None and res is not plain:
        _against_bound(res, plain.solution.stats.lower_bound, plain.microbatches == res.microbatches)
    res.timings = dict(mp.timings)
    return res


def _why_context_parallel(mp: MeshProblem, failed: list[str], microbatches: int | None) -> str:
    """Why a mesh's answer splits the sequence for attention where no layout was asked to: the seed layouts
    without it that did not fit, at the most micro-batches a dp rank's batch allows."""
    local = held_batch(mp.captured.batch_size, mp.mesh.dp, False)
    most = microbatches or local
    layouts = ", ".join(failed) if failed else "none"
    return (
        f"no layout without it fits {size_brief(mp.memory_limit)} on {mp.mesh}, recompute op by op allowed "
        f"(seed layouts {layouts}, at up to {most} micro-batch{'es' if most > 1 else ''} of a dp rank's "
        f"{local} sequence{'s' if local > 1 else ''})"
    )


def _until(solve_by: float | None, seconds: float, shares: int = 1) -> float:
    """``seconds``, or no more than a ``shares``-th of the time left before ``solve_by`` (none past it)."""
    if solve_by is None:
        return seconds
    return min(seconds, max(solve_by - time.perf_counter(), 0.0) / shares)


def _far_behind(seeded: ShardingResult | None, best_step: float | None) -> bool:
    """Whether a mesh's best seed answer is more than HOPELESS slower than the best plan found before it."""
    return (
        seeded is not None
        and best_step is not None
        and seeded.estimate.step_time_s > best_step * (1 + HOPELESS)
    )


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
    status = "optimal" if gap is not None and gap <= PROVED_GAP else "feasible"
    res.solution = replace(sol, status=status, gap=gap, stats=stats)
