"""The pipeline search over meshes within a time limit: which pipeline meshes are costed, and which polished.

Solving one pipeline mesh (the sharding MILP inside its stages, the cuts around
them) is :mod:`autopar.search.pipeline.mesh`; this module spends the time limit
across meshes. A seed round costs meshes with their seed layouts, most promising
first; a MILP round polishes the fastest; the time those rounds leave costs more
meshes and polishes any that comes out on top (:func:`search_pipelines`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from autopar.capture.joint import CapturedGraph
from autopar.core.notes import note
from autopar.cost_models.memory import Precision
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.search.pipeline.mesh import PipelineMesh, PipelineResult, prepare_pipeline_mesh, solve_pipeline
from autopar.search.pipeline.preview import HOPELESS, Preview
from autopar.search.sharding.mesh import SEED_GAP
from autopar.search.sharding.request import MeshRequest

log = logging.getLogger(__name__)


# The pipeline meshes whose stages get a MILP of their own, after every mesh was costed with the seed layouts.
MILP_MESHES = 2
# A MILP round on a mesh takes at most this many times what solving its seed layouts took (its problem is built).
MILP_ROUND_OF = 4
# The share of the time limit for costing meshes with the seed layouts; the MILP rounds get the rest.
SEED_ROUND = 0.75
# Each mesh of the seed round may take up to 1/SHARE_OF of the round's time left.
SHARE_OF = 3


def search_pipelines(
    captured: CapturedGraph,
    cluster: Cluster,
    precision: Precision,
    optimizer: str,
    memory_limit: float,
    meshes: list[MeshShape],
    time_limit_s: float,
    *,
    schedules: tuple[str, ...] = ("1F1B", "interleaved"),
    microbatches: int | None = None,
    zero: int | None = None,
    recompute: bool = True,
    preview: Preview | None = None,
    notes: list[str] | None = None,
    ep: int | None = None,
    cp: int | None = None,
    cp_axes: dict[MeshShape, int | None] | None = None,
    spare_s: float | Callable[[list[PipelineResult]], float] = 0.0,
) -> list[PipelineResult]:
    """The fastest pipeline that fits on each of ``meshes`` searched, in two rounds, within the time limit.

    Every mesh is first costed with its seed layouts inside the stages (restricted
    solves, quick, each once with only the placements that divide a micro-batch at the most
    micro-batches: an answer at every count, where solving first without them and then narrowed
    took twice as long on LLaMA-2-70B's memory-bound stages), most promising first, until SEED_ROUND of the time limit is
    spent (the rest are left out, and the log says how many): in the order given,
    or, with a ``preview``, in the order of its previewed step times, which every
    costed mesh refines for the meshes of its tp; the meshes the preview finds hopeless
    (:meth:`Preview.hopeless`) are left out. Another mesh is costed only if, at what costing one
    took so far, the time left then still holds the MILP's polish of the best (LLaMA-3-405B on
    16,384 H100s under load: a third pipeline mesh costed at the expense of that polish left the
    plan at 11.1 s a step, against 10.1 s for the same mesh polished). The MILP then runs on the
    ``MILP_MESHES`` meshes whose seeded pipelines were fastest, where it can only
    improve them, as long as the time left is at least what costing a mesh took. Time the two rounds
    leave goes to more meshes of the seed round (each only where, at what costing one took, it ends
    ``spare_s`` before the limit: the caller's own work after the search, or a function of the pipelines found
    so far that gives it) and to polishing any of them that comes out on top.
    ``notes`` (when given) collects why the search left meshes out, as the log says it. ``ep`` and ``cp``
    fix the experts' and attention's splits inside the stages (``cp_axes``: a mesh's axis for it, where one is fixed).
    """
    start = time.perf_counter()
    deadline = start + time_limit_s
    seeded: list[tuple[PipelineMesh, PipelineResult | None]] = []
    todo = preview.order(meshes) if preview is not None else list(meshes)
    costed, solving, costing, taken = 0, 0.0, 0.0, 0
    hopeless: list[MeshShape] = []

    def no_room(now: float, polish: bool, end: float = deadline) -> bool:
        """Another mesh would not end before ``end``: what costing a mesh took, and (``polish``) its solves
        again for the MILP's polish of the best."""
        return bool(costed) and now + (costing + (2 if polish else 1) * solving) / costed > end

    def seed_round(seeds_end: float, polish: bool, end: float = deadline) -> None:
        """Cost the meshes of ``todo`` with their seed layouts, most promising first, until ``seeds_end`` or no room
        before ``end``."""
        nonlocal todo, costed, solving, costing, taken
        while todo:
            now = time.perf_counter()
            if taken and (now > seeds_end or no_room(now, polish, end)):
                return
            if preview is not None and preview.hopeless(todo[0]):
                # the first pipeline of a tp goes ahead of the previewed order under a wider margin:
                # a hopeless one does not make the meshes behind it hopeless
                hopeless.extend(m for m in todo if preview.hopeless(m))
                todo = [m for m in todo if m not in hopeless]
                if not todo:
                    return
            mesh = todo.pop(0)
            taken += 1
            request = MeshRequest(captured, cluster, mesh, precision, optimizer, memory_limit, recompute=recompute)
            pm = prepare_pipeline_mesh(request, microbatches=microbatches)
            if pm is None:
                continue
            pm.ep, pm.cp, pm.cp_axis = ep, cp, (cp_axes or {}).get(mesh)
            costed += 1
            costing += time.perf_counter() - now
            # a share of what is left that lets a large mesh's solve find an answer: the limit ends
            # the round long before every mesh of a large cluster is costed
            left = max(seeds_end - time.perf_counter(), 0.0) / min(max(len(meshes) - taken + 1, 1), SHARE_OF)
            began = time.perf_counter()
            res = solve_pipeline(
                pm, left, schedules=schedules, zero=zero, milp=False, target_gap=SEED_GAP, dividing_only=True
            )
            solving += time.perf_counter() - began
            seeded.append((pm, res))
            if preview is not None:
                recomputed = res is not None and res.estimate.recompute_s > 0
                preview.costed(mesh, res.estimate.step_time_s if res is not None else None, recomputed)
                if res is not None:
                    preview.learn(res.mesh, res.segments, res.microbatches)
                todo = preview.order(todo)

    seed_round(start + time_limit_s * SEED_ROUND, polish=True)
    if hopeless:
        note(
            log,
            notes,
            "pipelines: %d of %d meshes left out, previewed more than %.0f%% slower than the best plan",
            len(hopeless), len(meshes), 100 * HOPELESS,
        )
    if not seeded:
        return []
    flat_best = preview.flat_best if preview is not None else math.inf
    polished: set[int] = set()
    end = deadline  # the first polish may run to the limit; what comes after it ends spare_s before
    while True:
        per_mesh = solving / max(costed, 1)  # what solving one prepared mesh under its seed layouts took
        _milp_round(seeded, end, per_mesh, schedules, zero, flat_best, notes, polished)
        # the best polished, the time left costs the meshes not reached (each only if it ends before the
        # deadline) and polishes any that comes out on top: DeepSeek-V3 on 2,048 H100s ended with 18 s of
        # its 60 unspent, 2 of 24 pipeline meshes costed
        found = [r for _, r in seeded if r is not None]
        before, end = len(seeded), deadline - (spare_s(found) if callable(spare_s) else spare_s)
        if not todo or no_room(time.perf_counter(), False, end):
            break
        seed_round(end, False, end)
        if len(seeded) == before:
            break
    if todo:
        note(log, notes, "pipelines: time limit reached after %d of %d meshes", taken, len(meshes))
    return [r for _, r in seeded if r is not None]


def _step(r: PipelineResult | None) -> float:
    return r.estimate.step_time_s if r is not None else math.inf


def _milp_round(
    seeded: list[tuple[PipelineMesh, PipelineResult | None]],
    deadline: float,
    per_mesh: float,
    schedules: tuple[str, ...],
    zero: int | None,
    flat_best: float = math.inf,
    notes: list[str] | None = None,
    polished: set[int] | None = None,
) -> None:
    """The MILP inside the stages of the ``MILP_MESHES`` fastest seeded meshes, started from their seeded
    answers, side by side on threads; each takes at most ``MILP_ROUND_OF`` times what solving a mesh's seed
    layouts took (``per_mesh``: the mesh's problem is built already), and replaces its mesh's entry of
    ``seeded`` when faster.

    A seeded pipeline more than ``HOPELESS`` slower than the fastest plan without a pipeline
    (``flat_best``) is not polished: the same margin leaves a mesh uncosted in the seed round
    (LLaMA-7B on 64 H100s: the polish took 8 of the search's 35 s to bring dp 16 x tp 2 x pp 2
    from 1.973 s to 1.968 s, against 1.673 s without a pipeline).
    """
    done = polished if polished is not None else set()  # the meshes polished already, left as they are
    ranked = [i for i in sorted(range(len(seeded)), key=lambda i: _step(seeded[i][1]))[:MILP_MESHES] if i not in done]
    top = [i for i in ranked if _step(seeded[i][1]) <= flat_best * (1 + HOPELESS)]
    if len(top) < len(ranked):
        note(
            log,
            notes,
            "pipelines: %d of %d meshes left out of the MILP round, more than %.0f%% slower than the best plan "
            "without a pipeline", len(ranked) - len(top), len(ranked), 100 * HOPELESS,
        )
    # it starts from the seeded answer: a polish, not a search. Like the seeds, it solves once over the placements
    # that divide a micro-batch at the most micro-batches (an answer at every count): solving first without them
    # took LLaMA-2-70B's two polished meshes 4 s of their 4.1 each, to the same plan (66.857 s a step)
    left = min(max(deadline - time.perf_counter(), 0.0), MILP_ROUND_OF * per_mesh)
    if top and left < per_mesh:  # a MILP round takes at least as long as the seed layouts' solves: no time for it
        note(log, notes, "pipelines: no time left for the MILP on %d meshes", len(top))
        return

    def polish(i: int) -> PipelineResult | None:
        pm, old = seeded[i]
        known = old.sharding.solution.choice if old is not None else None
        return solve_pipeline(pm, left, schedules=schedules, zero=zero, layouts=(), start=known, dividing_only=True)

    # the meshes' MILPs are independent and spend their time in HiGHS, outside the GIL: side by side
    with ThreadPoolExecutor(max_workers=max(len(top), 1), thread_name_prefix="autopar-milp") as pool:
        answers = list(pool.map(polish, top))
    done.update(top)
    for i, res in zip(top, answers, strict=True):
        if res is not None and _step(res) < _step(seeded[i][1]) * (1 - 1e-9):
            seeded[i] = (seeded[i][0], res)
