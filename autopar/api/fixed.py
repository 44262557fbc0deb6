"""What ``autopar.plan(..., fixed=...)`` takes: its keys, their checks, and which search plans a request.

The keys are what a Megatron-LM or DeepSpeed configuration says: the mesh
(``dp``, ``tp``, ``pp``; ``ep`` the experts' split and ``cp`` the sequence's in attention, each over the
ranks of dp or of the second axis), the ZeRO stage, micro-batches (gradient
accumulation), the pipeline schedule and the recompute setting
(:mod:`autopar.search.sharding.recompute_settings`).  Any combination is planned as
asked; refused, in one line, is only what cannot be built (a schedule without
a pipeline) or is no value of its key.  Sizes that do not divide the cluster or
the batch are refused where they are known (the cluster's mesh check, the
searches).
"""

from __future__ import annotations

from typing import Any

from autopar.core.errors import PlanError
from autopar.cost_models.pipeline import schedule_name
from autopar.cost_models.schedule import interleaved_runs
from autopar.hardware.cluster import Cluster
from autopar.plans.records import Fixed
from autopar.search.sharding.recompute_settings import NONE, OP_LEVEL, SETTINGS

FIXED_KEYS = ("dp", "tp", "pp", "ep", "cp", "zero", "recompute", "microbatches", "schedule")


def check_fixed(fixed: dict[str, Any] | None) -> Fixed:
    """The user's ``fixed`` as a record, its schedule's name normalised; a one-line PlanError for what cannot be built."""
    if fixed is None:
        return Fixed()
    if not isinstance(fixed, dict):
        raise PlanError(f"fixed must be a dict such as {{'dp': 8, 'zero': 1}}, not {type(fixed).__name__}")
    fixed = dict(fixed)  # the caller's dict is left as it was
    unknown = sorted(set(fixed) - set(FIXED_KEYS))
    if unknown:
        raise PlanError(
            f"unknown key(s) in fixed: {', '.join(unknown)}; known keys are {', '.join(FIXED_KEYS)}"
        )
    for key in ("dp", "tp", "pp", "ep", "cp", "microbatches"):
        if key in fixed and (not isinstance(fixed[key], int) or fixed[key] < 1):
            raise PlanError(f"fixed[{key!r}] must be a positive integer, not {fixed[key]!r}")
    if "zero" in fixed and fixed["zero"] not in (0, 1, 2, 3):
        raise PlanError(f"fixed['zero'] must be 0, 1, 2 or 3, not {fixed['zero']!r}")
    if "schedule" in fixed:
        try:
            fixed["schedule"] = schedule_name(fixed["schedule"])
        except ValueError as err:
            raise PlanError(str(err)) from None
    if "schedule" in fixed and fixed.get("pp") == 1:
        raise PlanError(
            f"fixed['schedule'] = {fixed['schedule']!r} schedules pipeline stages, but pp is 1; "
            "drop the schedule or fix pp >= 2"
        )
    if fixed.get("schedule") == "interleaved" and "pp" in fixed and "microbatches" in fixed:
        pp, m = fixed["pp"], fixed["microbatches"]
        if not interleaved_runs(pp, m):
            rounds = max(1, m // pp)
            raise PlanError(
                f"fixed['microbatches'] = {m} cannot run interleaved on pp {pp}: torch's ScheduleInterleaved1F1B "
                f"deals micro-batches in {rounds} rounds, which must divide them; use a multiple of {rounds} "
                "or another schedule"
            )
    if "recompute" in fixed and fixed["recompute"] not in SETTINGS:
        raise PlanError(
            f"fixed['recompute'] must be 'none', 'selective' (the attention core of every layer), 'op-sac' "
            f"(torchtitan's per-op policy) or 'full' (every layer), not {fixed['recompute']!r}; leave it out "
            "to let the search choose op by op"
        )
    return Fixed(**fixed)


def searches_sharding(cluster: Cluster, fixed: Fixed) -> bool:
    """Whether the sharding MILP plans (per-op placements), not the analytic data-parallel model.

    The analytic model costs what leaves no sharding to decide and recomputes nothing: one
    device, or a pinned data-parallel mesh (tp 1, or dp the whole cluster) with a fixed
    micro-batch count and no pipeline.  Everything else, and any recompute setting other
    than "none" (costed on the graph that runs it), is the MILP's, with the micro-batch
    count fixed where ``fixed`` says.
    """
    if (fixed.recompute or NONE) != NONE or (fixed.ep or 1) > 1 or (fixed.cp or 1) > 1:
        return True
    if cluster.world_size == 1:
        return False
    pinned_dp = fixed.tp == 1 or fixed.dp == cluster.world_size
    return not (fixed.microbatches is not None and (fixed.pp or 1) == 1 and pinned_dp)


def recompute_label(fixed: Fixed, placements: dict[str, Any]) -> str:
    """Plan.recompute: the fixed setting, or "op-level" when the MILP marked ops, or "none"."""
    if (fixed.recompute or NONE) != NONE:
        return fixed.recompute
    return OP_LEVEL if any("recompute" in e for e in placements.values()) else NONE
