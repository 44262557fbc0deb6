"""``autopar.plan``: the order of the passes, from a model to a Plan.

capture → graph statistics → candidate configurations → cost each → choose.

The search over op shardings (tensor / sequence parallel) and pipeline cuts
plugs in at ``_candidates``; until then the space is the data-parallel one:
ZeRO stage × micro-batch count on a dp-only mesh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from autopar.capture import capture
from autopar.cluster import Cluster
from autopar.cost_models.graph_stats import graph_stats
from autopar.cost_models.memory import optimizer_states, precision_spec
from autopar.cost_models.step import Config, GraphStats, estimate_config
from autopar.errors import PlanError
from autopar.plan import GB, Estimate, Plan

log = logging.getLogger(__name__)

FIXED_KEYS = ("dp", "tp", "pp", "zero", "recompute", "microbatches")


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
) -> Plan:
    """Plan parallel training of ``model`` on ``cluster``.

    ``example_inputs`` is one batch (a tensor, a tuple of positional
    arguments or a dict of keyword arguments; dim 0 is the batch). The
    model may live on the meta device. ``fixed`` forces part of the answer
    (``{"dp": 64, "zero": 3}``); what it leaves open is searched.
    """
    t0 = time.perf_counter()
    if not isinstance(cluster, Cluster):
        raise PlanError(
            f"cluster must be an autopar.Cluster, not {type(cluster).__name__}; see Cluster.preset()"
        )
    prec = precision_spec(precision)
    optimizer_states(optimizer)
    fixed = _check_fixed(fixed)
    limit = float(memory_limit) if memory_limit is not None else float(cluster.memory_bytes)
    if limit <= 0:
        raise PlanError(f"memory_limit must be a positive number of bytes, not {memory_limit!r}")

    stats = _stats_for(model, example_inputs, loss_fn, example_targets)
    t_capture = time.perf_counter() - t0
    gbs = stats.batch_size if global_batch_size is None else global_batch_size
    if not isinstance(gbs, int) or gbs < 1:
        raise PlanError(f"global_batch_size must be a positive integer, not {global_batch_size!r}")

    candidates = _candidates(cluster, gbs, fixed)
    costed = [(cfg, estimate_config(stats, cfg, cluster, prec, optimizer, limit)) for cfg in candidates]
    fitting = [(cfg, est) for cfg, est in costed if est.fits]
    warnings: list[str] = []
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

    solver = {
        "status": "optimal (exhaustive)",
        "alternatives": _alternatives(costed),
        "candidates": len(costed),
        "gap": 0.0,
        "capture_s": round(t_capture, 3),
        "time_s": round(time.perf_counter() - t0, 3),
    }
    return _make_plan(stats, cluster, cfg, est, precision, optimizer, solver, warnings)


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


def _alternatives(costed: list[tuple[Config, Estimate]]) -> list[dict[str, Any]]:
    """The best configuration of each ZeRO stage: what the chosen plan won against."""
    best: dict[int, tuple[Config, Estimate]] = {}
    for cfg, est in costed:
        key = (not est.fits, est.step_time_s)
        if cfg.zero not in best or key < (not best[cfg.zero][1].fits, best[cfg.zero][1].step_time_s):
            best[cfg.zero] = (cfg, est)
    return [
        {
            "mesh": {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp},
            "zero": cfg.zero,
            "microbatches": cfg.microbatches,
            "step_time_s": est.step_time_s,
            "peak_bytes": est.memory.peak,
            "fits": est.fits,
        }
        for _, (cfg, est) in sorted(best.items())
    ]


_last_stats: tuple[tuple, GraphStats] | None = None


def _stats_for(model, example_inputs, loss_fn, example_targets) -> GraphStats:
    """Capture the model and read its statistics, reusing the last capture of the same model and inputs.

    Users re-plan one model with other options (a ZeRO stage, a batch, a
    memory limit); a 7B capture takes seconds, its statistics do not change.
    The key covers the model object, its parameter names, shapes and dtypes,
    the example inputs' shapes and dtypes, and the loss function.
    """
    global _last_stats
    key = (
        id(model),
        type(model),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()),
        _shapes(example_inputs),
        _shapes(example_targets),
        id(loss_fn),
    )
    if _last_stats is not None and _last_stats[0] == key:
        log.info("reusing the capture of %s", type(model).__name__)
        return _last_stats[1]
    stats = graph_stats(capture(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets))
    _last_stats = (key, stats)
    return stats


def _shapes(x) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return (tuple(x.shape), x.dtype, str(getattr(x, "device", "")))
    if isinstance(x, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_shapes(v) for v in x)
    return repr(x)


def _check_fixed(fixed: dict[str, Any] | None) -> dict[str, Any]:
    if fixed is None:
        return {}
    if not isinstance(fixed, dict):
        raise PlanError(f"fixed must be a dict such as {{'dp': 8, 'zero': 1}}, not {type(fixed).__name__}")
    unknown = sorted(set(fixed) - set(FIXED_KEYS))
    if unknown:
        raise PlanError(
            f"unknown key(s) in fixed: {', '.join(unknown)}; known keys are {', '.join(FIXED_KEYS)}"
        )
    for key in ("dp", "tp", "pp", "microbatches"):
        if key in fixed and (not isinstance(fixed[key], int) or fixed[key] < 1):
            raise PlanError(f"fixed[{key!r}] must be a positive integer, not {fixed[key]!r}")
    if "zero" in fixed and fixed["zero"] not in (0, 1, 2, 3):
        raise PlanError(f"fixed['zero'] must be 0, 1, 2 or 3, not {fixed['zero']!r}")
    for key in ("tp", "pp"):
        if fixed.get(key, 1) != 1:
            raise PlanError(
                f"{key}={fixed[key]} is not costed by this version of autopar (data parallel and ZeRO only); "
                f"leave {key} at 1"
            )
    if fixed.get("recompute", "none") != "none":
        raise PlanError(
            f"recompute={fixed['recompute']!r} is not costed by this version of autopar; leave it at 'none'"
        )
    return dict(fixed)


def _candidates(cluster: Cluster, gbs: int, fixed: dict[str, Any]) -> list[Config]:
    """Every configuration of the (data-parallel) search space that ``fixed`` allows."""
    mesh = cluster.check_mesh(dp=fixed.get("dp"), tp=fixed.get("tp", 1), pp=fixed.get("pp", 1))
    dp = mesh.dp
    if gbs % dp:
        raise PlanError(
            f"global batch {gbs} does not split over {dp} data-parallel ranks; choose a multiple of {dp}"
        )
    local = gbs // dp
    if "microbatches" in fixed:
        if local % fixed["microbatches"]:
            raise PlanError(
                f"the local batch {local} (global {gbs} / dp {dp}) does not split into "
                f"{fixed['microbatches']} micro-batches; choose a divisor of {local}"
            )
        counts = [fixed["microbatches"]]
    else:
        counts = [m for m in range(1, local + 1) if local % m == 0]
    zeros = [fixed["zero"]] if "zero" in fixed else [0, 1, 2, 3]
    if dp == 1 and "zero" not in fixed:
        zeros = [0]  # ZeRO shards over data-parallel ranks; with one rank every stage is the same
    return [
        Config(dp=dp, tp=mesh.tp, pp=mesh.pp, zero=z, microbatches=m, micro_batch_size=local // m)
        for z in zeros
        for m in counts
    ]


def _make_plan(
    stats: GraphStats,
    cluster: Cluster,
    cfg: Config,
    est: Estimate,
    precision: str,
    optimizer: str,
    solver: dict[str, Any],
    warnings: list[str],
) -> Plan:
    return Plan(
        model=stats.model,
        fingerprint=stats.fingerprint,
        num_params=stats.num_params,
        cluster=cluster.to_dict(),
        cluster_description=cluster.describe(),
        mesh={"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp},
        zero=cfg.zero,
        recompute=cfg.recompute,
        microbatches=cfg.microbatches,
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        precision=precision,
        optimizer=optimizer,
        estimate=est,
        solver=solver,
        warnings=warnings,
    )
