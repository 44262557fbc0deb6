"""The memory estimate held against the runtime: plans per ZeRO stage and recompute setting, measured.

``plan.estimate.memory.peak`` is a model (:mod:`autopar.search.sharding.step_memory`);
``pm.measure_step_memory`` (:mod:`autopar.runtime.memory_tracker`) counts the
bytes of live tensors on a rank over a real step.  :func:`setting_plans` makes
one data-parallel plan per ZeRO stage and recompute setting, each with the
estimate it should be held to, and :func:`measure_plans` runs all of them in
one launch of local processes (a launch costs seconds; a plan, milliseconds
of training) and returns every rank's measured peak per plan.

Recompute settings:

* ``"none"`` — the search's plan with ``fixed={"zero": z, "recompute": "none"}``,
  and its own estimate;
* ``"op-level"`` — the search's plan under a memory limit below that plan's
  peak (``squeeze`` of it), for which the MILP recomputes forward ops of its
  choice, and its own estimate;
* ``"full"`` — the search's plan with ``fixed={"zero": z, "recompute": "full"}``
  (Megatron's full activation checkpointing of every layer), and its own estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from autopar.api.parallelizer import parallelize
from autopar.api.planner import plan as make_plan
from autopar.cost_models.estimate import Estimate
from autopar.hardware.cluster import Cluster
from autopar.plans.plan import Plan
from autopar.runtime.launch import launch
from autopar.runtime.memory_tracker import StepMemory
from autopar.search.recost import estimate_plan

SETTINGS = ("none", "op-level", "full")
SCHEDULES = ("GPipe", "1F1B", "interleaved")
# (micro-batches, recompute) per schedule: 2 as the data-parallel cases, and 4, more than 2 stages, where 1F1B
# keeps fewer in flight than GPipe and interleaved 1F1B's warm-up runs more of a rank's first chunk
PIPELINE_SETTINGS = ((2, "none"), (2, "full"), (4, "none"))


@dataclass
class Case:
    """One setting: its ZeRO stage and recompute, the plan, and the estimate its measurement is held to."""

    zero: int
    recompute: str
    plan: Plan
    estimate: Estimate


def setting_plans(
    factory: Callable,
    processes: int,
    zeros: Sequence[int] = (0, 1, 2, 3),
    squeeze: float = 0.85,
    microbatches: int = 1,
    precision: str = "fp32",
    settings: Sequence[str] = SETTINGS,
) -> list[Case]:
    """A data-parallel plan (AdamW, in ``precision``) for every ZeRO stage in ``zeros`` and recompute setting.

    With ``microbatches`` > 1 each plan accumulates gradients over that many
    micro-batches (its placements unchanged) and is costed as it stands: the
    gradients of the first micro-batch are then live under the activations of the
    next, which is where ZeRO-2's smaller gradients lower the peak.
    """

    cluster = Cluster.local(processes)
    torch.manual_seed(0)
    model, inputs = factory()
    cases = []
    for z in zeros:
        fixed = {"dp": processes, "tp": 1, "zero": z}
        made = {}
        for how in settings:
            made[how] = _setting_plan(model, inputs, cluster, fixed, how, precision, made, squeeze)
        for how, plan in made.items():
            if microbatches > 1:
                plan = dataclasses.replace(
                    plan,
                    microbatches=microbatches,
                    micro_batch_size=plan.global_batch_size // (processes * microbatches),
                )
                plan.estimate = estimate_plan(plan, model, inputs)
            cases.append(Case(z, how, plan, plan.estimate))
    return cases


def _setting_plan(model, inputs, cluster: Cluster, fixed: dict, how: str, precision: str, made: dict, squeeze: float):
    """The plan of one recompute setting (op-level: under ``squeeze`` of the peak of the one without)."""
    if how == "op-level":
        none = made.get("none") or _setting_plan(model, inputs, cluster, fixed, "none", precision, made, squeeze)
        limit = squeeze * none.estimate.memory.peak
        return make_plan(model, inputs, cluster, fixed=fixed, precision=precision, memory_limit=limit)
    return make_plan(model, inputs, cluster, fixed={**fixed, "recompute": how}, precision=precision)


def pipeline_plans(
    factory: Callable,
    stages: int = 2,
    schedules: Sequence[str] = SCHEDULES,
    settings: Sequence[tuple[int, str]] = PIPELINE_SETTINGS,
    precision: str = "fp32",
    dp: int = 1,
    zeros: Sequence[int] = (0,),
) -> list[Plan]:
    """A pipeline of ``stages`` stages, each over ``dp`` ranks (AdamW in ``precision``), per schedule,
    (micro-batches, recompute) setting and ZeRO stage; the interleaved schedule deals two chunks to a rank.
    Each plan's ``stages`` give every device's estimated peak (``memory_bytes``)."""
    cluster = Cluster.local(stages * dp)
    torch.manual_seed(0)
    model, inputs = factory()
    return [
        make_plan(
            model, inputs, cluster, precision=precision, time_limit_s=10,
            fixed={"dp": dp, "tp": 1, "pp": stages, "microbatches": m, "schedule": s, "zero": z, "recompute": how},
        )  # fmt: skip
        for s in schedules
        for m, how in settings
        for z in zeros
    ]


def _measure(factory: Callable, cluster: Cluster, plan: dict) -> StepMemory:
    """This rank's peak over the second step of ``plan`` (the first creates the optimizer's state)."""

    torch.manual_seed(0)
    model, batch = factory()
    pm = parallelize(model, cluster, batch, plan=Plan.from_dict(plan))
    opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    pm.train_step(batch)
    opt.step()
    opt.zero_grad()
    return pm.measure_step_memory(batch, opt)


def _measure_all(factory: Callable, cluster: Cluster, plans: list[dict]) -> list[StepMemory]:
    return [_measure(factory, cluster, p) for p in plans]


def measure_plans(factory: Callable, processes: int, plans: Sequence[Plan]) -> list[list[StepMemory]]:
    """Per rank, per plan: the measured peak of a step, all plans in one launch of ``processes`` processes.

    ``factory`` must be picklable (a module-level function) and give the same model on every call.
    """
    cluster = Cluster.local(processes)
    return launch(_measure_all, cluster, factory, cluster, [p.to_dict() for p in plans], crash_retries=1)
