"""The analytic data-parallel path of ``autopar.plan``: ZeRO stage x micro-batch count, exhaustively.

What leaves no sharding to decide (one device, or a pinned data-parallel mesh with a
fixed micro-batch count and no recompute setting) is costed by the analytic model of
:mod:`autopar.cost_models.step` for every configuration ``fixed`` allows; the fastest
that fits wins, the simplest among those within ``TIE_TOLERANCE`` of it.

The chosen plan carries the per-op placements it runs (:func:`data_parallel_placements`),
decided here once rather than by every rank at run time.
"""

from __future__ import annotations

import logging

from autopar.capture.joint import CapturedGraph
from autopar.core.errors import PlanError
from autopar.cost_models.estimate import Estimate
from autopar.cost_models.memory import Precision
from autopar.cost_models.step import Config, estimate_config
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.plans.format import GB
from autopar.plans.records import Alternative, Fixed, SearchRecord
from autopar.search.sharding.layouts import layout_placements

log = logging.getLogger(__name__)


def data_parallel_plan(stats, cluster, gbs, prec, optimizer, limit, fixed: Fixed, warnings: list[str]):
    """The analytic data-parallel model over every ZeRO stage and micro-batch count ``fixed`` allows.

    Returns (config, estimate, search record); a warning joins ``warnings`` when a fixed
    configuration does not fit, and a PlanError says the smallest memory when nothing does.
    """
    candidates = _candidates(cluster, gbs, fixed)
    costed = [(cfg, estimate_config(stats, cfg, cluster, prec, optimizer, limit)) for cfg in candidates]
    fitting = [(cfg, est) for cfg, est in costed if est.fits]
    if fitting:
        cfg, est = _choose(fitting)
    else:
        cfg, est = min(costed, key=lambda ce: ce[1].memory.peak)
        need = est.memory.peak
        where = f"dp={cfg.dp}, ZeRO-{cfg.zero}, {cfg.microbatches} micro-batch(es)"
        if not fixed:
            raise PlanError(
                f"no configuration fits {limit / GB:.1f} GB per device; the smallest needs {need / GB:.1f} GB "
                f"({where}): raise memory_limit, use more devices, or lower the batch"
            )
        msg = (
            f"the fixed configuration needs {need / GB:.2f} GB per device, {(need - limit) / GB:.2f} GB over "
            f"the {limit / GB:.1f} GB limit"
        )
        log.warning(msg)
        warnings.append(msg)
    solver = SearchRecord(
        status="optimal (exhaustive)", alternatives=_alternatives(costed), candidates=len(costed), gap=0.0
    )
    return cfg, est, solver


def data_parallel_placements(
    captured: CapturedGraph, cluster: Cluster, mesh: MeshShape, zero: int, precision: Precision, optimizer: str
) -> dict[str, dict]:
    """The per-op placements a data-parallel plan runs, on ``captured``: the graph of one micro-batch.

    The dp layout (the zero3 layout under ZeRO-3) with every other node solved
    (:func:`autopar.search.sharding.layouts.layout_placements`), on the graph the
    runtime captures, so that it runs them as they are.  The layout's
    per-parameter ZeRO stages are dropped: such a plan has one stage for all,
    its ``zero``, which the placements would otherwise override.
    """
    kind = "zero3" if zero == 3 else "dp"
    placements = layout_placements(captured, cluster, mesh, precision, optimizer, kind, batch_activations=True)
    return {k: {kk: v for kk, v in e.items() if kk != "zero"} for k, e in placements.items()}


# Configurations within this fraction of the fastest count as equally fast; the simplest of them wins.
TIE_TOLERANCE = 0.01


def _choose(fitting: list[tuple[Config, Estimate]]) -> tuple[Config, Estimate]:
    """The fastest configuration; among those within TIE_TOLERANCE of it, the simplest.

    Analytic estimates are not exact to 1%, and a lower ZeRO stage or fewer
    micro-batches is easier to run and debug (DeepSpeed's defaults make the
    same choice), so a saving smaller than the model's error buys nothing.
    """
    best = min(est.step_time_s for _, est in fitting)
    close = [ce for ce in fitting if ce[1].step_time_s <= best * (1 + TIE_TOLERANCE)]
    return min(close, key=lambda ce: (ce[0].zero, ce[0].microbatches, ce[1].step_time_s))


def _alternatives(costed: list[tuple[Config, Estimate]]) -> list[Alternative]:
    """The best configuration of each ZeRO stage: what the chosen plan won against."""
    best: dict[int, tuple[Config, Estimate]] = {}
    for cfg, est in costed:
        key = (not est.fits, est.step_time_s)
        if cfg.zero not in best or key < (not best[cfg.zero][1].fits, best[cfg.zero][1].step_time_s):
            best[cfg.zero] = (cfg, est)
    return [
        Alternative(
            mesh={"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp},
            zero=cfg.zero,
            microbatches=cfg.microbatches,
            step_time_s=est.step_time_s,
            peak_bytes=est.memory.peak,
            fits=est.fits,
        )
        for _, (cfg, est) in sorted(best.items())
    ]


def _candidates(cluster: Cluster, gbs: int, fixed: Fixed) -> list[Config]:
    """Every configuration of the (data-parallel) search space that ``fixed`` allows."""
    mesh = cluster.check_mesh(dp=fixed.dp, tp=fixed.tp or 1, pp=fixed.pp or 1)
    dp = mesh.dp
    if gbs % dp:
        raise PlanError(
            f"global batch {gbs} does not split over {dp} data-parallel ranks; choose a multiple of {dp}"
        )
    local = gbs // dp
    if fixed.microbatches is not None:
        if local % fixed.microbatches:
            raise PlanError(
                f"the local batch {local} (global {gbs} / dp {dp}) does not split into "
                f"{fixed.microbatches} micro-batches; choose a divisor of {local}"
            )
        counts = [fixed.microbatches]
    else:
        counts = [m for m in range(1, local + 1) if local % m == 0]
    zeros = [fixed.zero] if fixed.zero is not None else [0, 1, 2, 3]
    if dp == 1 and fixed.zero is None:
        zeros = [0]  # ZeRO shards over data-parallel ranks; with one rank every stage is the same
    return [
        Config(dp=dp, tp=mesh.tp, pp=mesh.pp, zero=z, microbatches=m, micro_batch_size=local // m)
        for z in zeros
        for m in counts
    ]
