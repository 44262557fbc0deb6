"""The memory estimate against the memory a step really holds.

Slow: one launch of 2 gloo processes runs a data-parallel GPT-2
(``gpt2_tiny_long``: 2 layers of hidden 128, sequence 64, global batch 8 in 2
micro-batches, fp32 AdamW) under ZeRO 0, 1, 2 and 3, each with recompute none,
op-level (the MILP's own marks under a memory limit) and full (every layer),
and under bf16-mixed (bf16 copies of fp32 masters, fp32 gradients and AdamW
state) for ZeRO 0-3 without recompute; every rank's measured peak of a step
(``pm.measure_step_memory``) must be within 15% of the plan's estimate, and in
fp32 must fall as the stage rises and when recompute is on.  The same launch
runs the model as a pipeline of 2 stages under each schedule (GPipe, 1F1B,
interleaved over 4 chunks), at 2 micro-batches with recompute none and full and
at 4 without, and under bf16-mixed at 2 without: each rank's peak within 15% of
its stage's estimate.

One process: a plan re-costed as it stands gets back the estimate the search
gave it, and the parts of the estimate add up to its peak.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.capture.joint import capture, frozen_parameter_count
from autopar.search.recost import estimate_plan
from autopar.search.sharding.recompute import recompute_layers, with_recompute
from autopar.verify.memory_check import (
    PIPELINE_SETTINGS,
    SCHEDULES,
    SETTINGS,
    measure_plans,
    pipeline_plans,
    setting_plans,
)
from examples.handwritten import nanogpt_lora
from examples.models import gpt2_tiny, gpt2_tiny_long

BOUND = 0.15
MIB = 2**20


@pytest.fixture(scope="module")
def measured_all():
    cases = setting_plans(gpt2_tiny_long, 2, microbatches=2)
    cases += setting_plans(gpt2_tiny_long, 2, microbatches=2, precision="bf16-mixed", settings=("none",))
    pipelines = pipeline_plans(gpt2_tiny_long)
    pipelines += pipeline_plans(gpt2_tiny_long, precision="bf16-mixed", settings=((2, "none"),))
    per_rank = measure_plans(gpt2_tiny_long, 2, [c.plan for c in cases] + pipelines)
    n = len(cases)
    return (cases, [r[:n] for r in per_rank]), (pipelines, [r[n:] for r in per_rank])


@pytest.fixture(scope="module")
def measured(measured_all):
    return measured_all[0]


def _key(c) -> tuple:
    return (c.plan.precision, c.zero, c.recompute)


def _table(cases, per_rank) -> str:
    return "\n".join(
        f"{c.plan.precision:>10} ZeRO-{c.zero} {c.recompute:>9}: estimated {c.estimate.memory.peak / MIB:.2f} MiB, "
        "measured " + ", ".join(f"{r[k].peak_bytes / MIB:.2f}" for r in per_rank)
        for k, c in enumerate(cases)
    )


@pytest.mark.slow
def test_measured_peak_is_within_15_percent_of_the_estimate(measured):
    cases, per_rank = measured
    assert [_key(c) for c in cases] == [("fp32", z, how) for z in range(4) for how in SETTINGS] + [
        ("bf16-mixed", z, "none") for z in range(4)
    ]
    assert all(c.plan.microbatches == 2 for c in cases)
    assert all(sum("recompute" in e for e in c.plan.placements.values()) > 0 for c in cases[1:12:3])
    off = [
        f"{c.plan.precision} ZeRO-{c.zero} {c.recompute} rank {rank}: {steps[k]} against "
        f"{c.estimate.memory.peak / MIB:.2f} MiB"
        for k, c in enumerate(cases)
        for rank, steps in enumerate(per_rank)
        if abs(steps[k].peak_bytes / c.estimate.memory.peak - 1) > BOUND
    ]
    assert not off, "\n".join(off) + "\n" + _table(cases, per_rank)


@pytest.mark.slow
def test_measured_peak_falls_as_the_stage_rises_and_with_recompute(measured):
    cases, per_rank = measured
    peak = {_key(c): c.estimate.memory.peak for c in cases}
    for rank, steps in enumerate(per_rank):
        got = {_key(c): m.peak_bytes for c, m in zip(cases, steps, strict=True)}
        report = f"rank {rank}:\n" + _table(cases, per_rank)
        for values in (got, peak):  # the measurement, and the estimate's own ordering
            # fp32 only: under bf16-mixed ZeRO-3 saves 0.3 MiB on ZeRO-2 here, less than the measurement of a
            # step varies by (now and then more on one rank: bf16 ZeRO-3 0.5 MiB in 1 step of 36, fp32 0.19 in 1
            # of 24)
            for how in SETTINGS:
                stages = [values[("fp32", z, how)] for z in range(4)]
                assert all(a > b for a, b in zip(stages, stages[1:], strict=False)), (how, report)
            for z in range(4):
                assert values[("fp32", z, "op-level")] < values[("fp32", z, "none")], (z, report)
                assert values[("fp32", z, "full")] < values[("fp32", z, "none")], (z, report)


@pytest.mark.slow
def test_a_pipeline_stage_measures_within_15_percent_of_its_estimate(measured_all):
    plans, per_rank = measured_all[1]
    assert [(p.precision, p.schedule, p.microbatches, p.recompute, p.mesh["pp"]) for p in plans] == [
        ("fp32", s, m, how, 2) for s in SCHEDULES for m, how in PIPELINE_SETTINGS
    ] + [("bf16-mixed", s, 2, "none", 2) for s in SCHEDULES]
    rows, off = [], []
    for k, plan in enumerate(plans):
        stage = {st["device"]: st["memory_bytes"] for st in plan.stages}
        for rank, steps in enumerate(per_rank):
            ratio = steps[k].peak_bytes / stage[rank]
            rows.append(
                f"{plan.precision} {plan.schedule} {plan.microbatches} micro-batches, recompute {plan.recompute}, "
                f"rank {rank}: "
                f"{steps[k]} against {stage[rank] / MIB:.2f} MiB"
            )
            if abs(ratio - 1) > BOUND:
                off.append(rows[-1])
    assert not off, "\n".join(off) + "\n\n" + "\n".join(rows)


# the plans of a LoRA fine-tune, its frozen weights held as fixed state: data parallel (the analytic path's), the
# MILP's over tp 2's ranks, a pipeline's and ZeRO-3's
LORA_FIXED = [
    {"dp": 2, "zero": 0, "microbatches": 4},
    {"tp": 2, "microbatches": 4},
    {"pp": 2, "microbatches": 4},
    {"dp": 2, "zero": 3, "microbatches": 2},
]


def _lora_plans() -> list[autopar.Plan]:
    torch.manual_seed(0)
    model, batch = nanogpt_lora()
    cluster = autopar.Cluster.local(2)
    return [autopar.plan(model, batch, cluster, precision="fp32", fixed=f, time_limit_s=10) for f in LORA_FIXED]


@pytest.mark.slow
def test_frozen_weights_measure_within_15_percent_of_the_estimate() -> None:
    """Before the fixed state was held for the whole step and whole at every micro-batch count, data
    parallelism's estimate at 4 micro-batches was 53% under the measured peak (LoRA on a GPT-2 of hidden 128:
    1.92 against 4.09 MiB)."""
    plans = _lora_plans()
    per_rank = measure_plans(nanogpt_lora, 2, plans)
    rows, off = [], []
    for k, plan in enumerate(plans):
        stage = {st["device"]: st["memory_bytes"] for st in plan.stages}
        for rank, steps in enumerate(per_rank):
            expected = stage.get(rank, plan.estimate.memory.peak)
            rows.append(f"{plan.mesh} {plan.microbatches} micro-batches, rank {rank}: {steps[k]} against {expected / MIB:.2f} MiB")
            if abs(steps[k].peak_bytes / expected - 1) > BOUND:
                off.append(rows[-1])
    assert not off, "\n".join(off) + "\n\n" + "\n".join(rows)


# ---------------------------------------------------------------- one process


def test_frozen_weights_are_held_whole_at_every_micro_batch_count() -> None:
    """A LoRA fine-tune's frozen weights (0.4M beside 12K trained) are the model's fixed state: counted in the
    estimate's params on every path, whole at any micro-batch count, where the activations are divided by it;
    the summary says how many parameters train."""
    torch.manual_seed(0)
    model, batch = nanogpt_lora()
    frozen = frozen_parameter_count(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert (frozen, trained) == (415232, 12288)
    analytic, milp, pipeline, zero3 = _lora_plans()
    assert analytic.solver.status.startswith("optimal (exhaustive)")
    assert analytic.estimate.memory.params == 4 * (frozen + trained)  # fp32, every weight whole
    assert zero3.estimate.memory.params == pytest.approx(4 * (frozen + trained / 2))  # the trained ones split
    assert min(milp.estimate.memory.params, pipeline.estimate.memory.params) >= 4 * frozen / 2  # on 2 ranks at most
    one = estimate_plan(dataclasses.replace(milp, microbatches=1, micro_batch_size=4), model, batch).memory
    assert one.params == milp.estimate.memory.params and one.activations > milp.estimate.memory.activations
    assert all(p.frozen_params == frozen for p in (analytic, milp, pipeline, zero3))
    assert "12,288 trainable of 427,520 params" in milp.summary(width=200)


@pytest.fixture(scope="module")
def tiny_plans():
    model, batch = gpt2_tiny()
    cluster = autopar.Cluster.local(2)
    plans = {
        z: autopar.plan(model, batch, cluster, precision="fp32", fixed={"dp": 2, "zero": z, "recompute": "none"})
        for z in (0, 3)
    }
    return model, batch, plans


def test_a_plan_recosted_as_it_stands_gets_back_its_estimate(tiny_plans):
    model, batch, plans = tiny_plans
    for plan in plans.values():
        again = estimate_plan(plan, model, batch)
        assert again.memory.peak == pytest.approx(plan.estimate.memory.peak, rel=1e-9)
        assert again.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)


def test_full_recompute_costed_on_the_graph_that_runs(tiny_plans):
    model, batch, plans = tiny_plans
    captured = capture(model, batch)
    for plan in plans.values():
        marked = with_recompute(plan.placements, (), list(recompute_layers(captured)), captured)
        full = estimate_plan(dataclasses.replace(plan, placements=marked), model, batch)
        assert full.memory.activations < plan.estimate.memory.activations
        assert 0 < full.recompute_s < full.compute_s and full.step_time_s > plan.estimate.step_time_s
        assert full.memory.params == plan.estimate.memory.params  # only activations change


def test_the_estimate_adds_up_and_says_where_its_peak_is(tiny_plans):
    _, _, plans = tiny_plans
    for z, plan in plans.items():
        mem = plan.estimate.memory
        assert mem.peak == pytest.approx(sum(mem.at_peak.values()))
        assert mem.at_peak["params"] == mem.params and mem.at_peak["optimizer"] == mem.optimizer
        assert 0 <= mem.at_peak["grads"] <= mem.grads and mem.activations > 0
        assert mem.peak_at.startswith(("forward", "backward", "end of the backward")), mem.peak_at
        if z == 3:
            assert mem.params == pytest.approx(plan.num_params * 4 / 2)
        # the summary says what is sharded and recomputed, and what the peak is made of
        text = plan.summary(width=200)
        assert "batch split 2 ways over dp" in text and f"{z} for 100%" in text
        assert "recompute" in text and "none: every activation" in text
        assert "of the 16.00 GB limit" in text and "activations" in text and mem.peak_at in text
