"""What the planner's searches hand back before a Plan is made: the chosen answer's pieces and its record.

Shared by the search of meshes without a pipeline (:mod:`autopar.api.flat_plan`) and the
planner's pipeline branch (:mod:`autopar.api.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopar.plans.data import param_zero_stage
from autopar.plans.records import MeshRecord, SearchRecord


@dataclass
class Sharded:
    """The chosen answer as ``_make_plan`` takes it: (Config, Estimate), the search's record, the placements,
    warnings, and for a pipeline its stages and schedule."""

    args: tuple  # (Config, Estimate) for _make_plan
    solver: SearchRecord
    placements: dict[str, Any]
    warnings: list[str]
    stages: list[dict[str, Any]] = field(default_factory=list)
    schedule: str = ""


def mesh_record(result, mesh: dict[str, int], status: str, schedule: str = "") -> MeshRecord:
    """What the search found on one mesh (a sharding or a pipeline result), for the plan's record."""
    return MeshRecord(
        mesh=mesh,
        microbatches=result.microbatches,
        schedule=schedule,
        status=status,
        source=result.source,
        step_time_s=result.estimate.step_time_s,
        peak_bytes=result.estimate.memory.peak,
        fits=result.estimate.fits,
        timings={k: round(v, 3) for k, v in result.timings.items()},
    )


def zero_stage(captured, placements: dict[str, Any], dp: int) -> int:
    """The plan's ZeRO stage for the summary: the stage of most parameter elements.

    A parameter sharded over dp is ZeRO-3; a replicated one has its placement's
    ``"zero"`` (1 or 2, or 0). The runtime reads each parameter's own stage.
    """
    if dp <= 1:
        return 0
    weight: dict[int, int] = {}
    for p in captured.params:
        entry = placements.get(p.placeholder, {})
        stage = param_zero_stage(entry)
        weight[stage] = weight.get(stage, 0) + math.prod(p.shape)
    return max(weight, key=lambda z: (weight[z], -z)) if weight else 0
