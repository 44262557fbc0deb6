"""ZeRO-1/2 at run time and the step-memory tracker.

Numerics as in test_runtime.py: 3 AdamW steps under each plan against one
device (relative L2 error 1e-5), gathered gradients of the first step and
the full state dict after the last.  Plans: hand-set data-parallel layouts
(their GPT-2 gradients come out replicated: the chunk is cut locally),
random layouts (gradients come out as dp-partial sums, reduce-scattered, and
some parameters are ZeRO-3 by placement beside ZeRO-1/2 ones; drawn "flowing",
so that each parameter's placement is random and the activations change placement
where none fits, several times cheaper to trace than a change at every op), Megatron
dp x tp, accumulation over micro-batches, and per-parameter stages.  One
launch of 4 processes trains the plans of dp 2 x tp 2 (Megatron's under ZeRO-2, a random layout under
per-parameter stages 0, 1 and 2), the random layout's
ZeRO-2 on dp 4 (flat chunks over 4 ranks) and the search's per-parameter
stages on dp 4; one launch of 2 processes trains dp 2 (accumulation, the
random layout's ZeRO-1) and measures the peak memory of a step under ZeRO 0,
1, 2 and 3.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.capture.joint import capture
from autopar.codegen.shard import shard_graph
from autopar.codegen.zero_grads import flat_chunk_numel
from autopar.core.placements import REPLICATE as R
from autopar.plans.plan import Plan
from autopar.runtime.launch import launch
from autopar.runtime.memory_tracker import track_memory
from autopar.runtime.zero import zero_stages
from autopar.verify.oracle import _compare, _rank_run_all, layout_plan, single_device_run
from examples.models import gpt2_tiny

TOL = 1e-5


def _plan(n: int, dp: int, tp: int, layout: str | None = None, seed: int = 0, **fixed) -> Plan:
    torch.manual_seed(0)
    model, inputs = gpt2_tiny()
    cluster = autopar.Cluster.local(n)
    if layout:  # its placements replace the search's: none is run
        assert not fixed, fixed
        return layout_plan(model, inputs, cluster, dp, tp, layout, seed=seed)
    return autopar.plan(model, inputs, cluster, fixed={"dp": dp, "tp": tp, **fixed}, precision="fp32")


def _zero(plan: Plan, stage: int) -> Plan:
    """``plan`` with the plan-wide ``stage``: per-parameter stages 0-2 in the placements are dropped, as they override it."""
    placements = {
        k: {kk: v for kk, v in e.items() if not (kk == "zero" and v in (0, 1, 2))} for k, e in plan.placements.items()
    }
    return dataclasses.replace(plan, zero=stage, placements=placements)


def _mixed_stages(plan: Plan) -> Plan:
    """Per-parameter stages: dp-replicated parameters take 1, 2 and 0 in turn; the plan says 0."""
    placements = copy.deepcopy(plan.placements)
    replicated = [e for e in placements.values() if "param" in e and e["outputs"][0][0] == R]
    for k, entry in enumerate(replicated):
        entry["zero"] = (1, 2, 0)[k % 3]
    return dataclasses.replace(plan, zero=0, placements=placements)


def _assert_all_match(cases, checks) -> None:
    bad = [
        f"{p.mesh} zero={p.zero} ({p.solver.status}): {c}"
        for (_, p), c in zip(cases, checks, strict=True)
        if not c.ok(TOL)
    ]
    assert not bad, "plans that do not train like one device:\n" + "\n".join(bad)
    for c in checks:
        assert len(c.losses) == 3 and c.losses[0] != c.losses[2]


# ---------------------------------------------------------------- 4 and 2 processes: numerics and memory


def _peak_memory(factory, cluster, plan_dict) -> autopar.runtime.memory_tracker.StepMemory:
    torch.manual_seed(0)
    model, batch = factory()
    pm = autopar.parallelize(model, cluster, batch, plan=Plan.from_dict(plan_dict))
    opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    pm.train_step(batch)
    opt.step()  # the optimizer's state exists from here on
    opt.zero_grad()
    return pm.measure_step_memory(batch, opt)


def _rank_job(wire, memory_plans, cluster) -> tuple[list, list]:
    checks = _rank_run_all(wire, cluster, 3, 1e-3, 0, None)
    return checks, [_peak_memory(gpt2_tiny, cluster, p) for p in memory_plans]


def _run(cases, memory_plans, n: int) -> tuple[list, list]:
    """The cases trained and the memory plans measured in one launch of ``n`` processes."""
    cluster = autopar.Cluster.local(n)
    ref = single_device_run(gpt2_tiny, 3, 1e-3, 0)  # every case's: the same model, steps and seed
    assert all(f is gpt2_tiny for f, _ in cases)
    wire = [(f, p.to_dict()) for f, p in cases]
    per_rank = launch(_rank_job, cluster, wire, [p.to_dict() for p in memory_plans], cluster, crash_retries=1)
    checks = [_compare([r[0][k] for r in per_rank], ref) for k in range(len(cases))]
    return checks, [r[1] for r in per_rank]


def _searched_under_pressure() -> Plan:
    """The MILP's own plan at 40% of the memory its roomy plan takes: ZeRO stages chosen per parameter."""
    roomy = _plan(4, 4, 1)
    model, inputs = gpt2_tiny()
    limit = 0.4 * roomy.estimate.memory.peak
    plan = autopar.plan(
        model, inputs, autopar.Cluster.local(4), fixed={"dp": 4}, precision="fp32", memory_limit=limit
    )
    stages = {e.get("zero", 3) for e in plan.placements.values() if "param" in e}
    assert len(stages) > 1, stages  # a mixed plan: the point of choosing per parameter
    return plan


@pytest.fixture(scope="module")
def four_processes():
    megatron = _plan(4, 2, 2, "megatron")
    cases = [(gpt2_tiny, _zero(_plan(4, 4, 1, "flowing", seed=1000), 2))]  # flat chunks over 4 ranks
    # ZeRO-2 beside Megatron's tp; ZeRO-1 on dp 2 x tp 2 is in the per-parameter stages below, and plan-wide
    # on the 2-process launch
    cases += [(gpt2_tiny, _zero(megatron, 2))]
    cases += [(gpt2_tiny, _mixed_stages(_plan(4, 2, 2, "flowing", seed=1001)))]
    cases += [(gpt2_tiny, _searched_under_pressure())]
    return cases, _run(cases, [], 4)[0]


@pytest.fixture(scope="module")
def two_processes():
    accumulate = [
        _plan(2, 2, 1, zero=z, microbatches=2) for z in range(4)
    ]  # the analytic path: the dp / zero3 layouts' placements, solved at plan time
    cases = [(gpt2_tiny, p) for p in accumulate[1:3]]
    cases += [(gpt2_tiny, _zero(_plan(2, 2, 1, "flowing", seed=1000), 1))]
    return cases, *_run(cases, accumulate, 2)


@pytest.mark.slow
def test_zero_1_and_2_on_4_processes_train_like_one_device(four_processes):
    cases, checks = four_processes
    _assert_all_match(cases, checks)
    assert checks[0].collectives.get("reduce_scatter_tensor", 0) > 0  # ZeRO-2 reduce-scattered in the graph


@pytest.mark.slow
def test_zero_1_and_2_on_2_processes_train_like_one_device(two_processes):
    cases, checks, _ = two_processes
    _assert_all_match(cases, checks)


@pytest.mark.slow
def test_peak_memory_falls_with_each_zero_stage(two_processes):
    _, _, memory = two_processes
    for rank, steps in enumerate(memory):
        peaks = [m.peak_bytes for m in steps]
        assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, (rank, [str(m) for m in steps])
        zero0, zero1 = steps[0], steps[1]
        assert zero1.breakdown["optimizer"] * 1.5 < zero0.breakdown["optimizer"]  # 1/2 of AdamW's state


# ---------------------------------------------------------------- one process


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_zero_stage_of_a_parameter_follows_the_contract():
    plan = _plan(4, 4, 1, "flowing", seed=1000)
    model, inputs = gpt2_tiny()
    params = capture(model, inputs).params
    replicated = {p.placeholder for p in params if plan.placements[p.placeholder]["outputs"][0][0] == R}
    sharded = {p.placeholder for p in params} - replicated
    assert replicated and sharded  # a random plan has both kinds
    assert zero_stages(params, plan.placements, plan) == {}
    assert zero_stages(params, plan.placements, _zero(plan, 2)) == dict.fromkeys(replicated, 2)
    assert zero_stages(params, plan.placements, _zero(plan, 3)) == {}  # ZeRO-3 lives in the placements
    mixed = _mixed_stages(plan)
    expected = {p: e["zero"] for p, e in mixed.placements.items() if p in replicated and e.get("zero", 0)}
    assert zero_stages(params, mixed.placements, mixed) == expected and set(expected.values()) == {1, 2}
    one_rank = dataclasses.replace(plan, zero=2, mesh={**plan.mesh, "dp": 1})
    assert zero_stages(params, plan.placements, one_rank) == {}


def test_zero_2_graph_returns_flat_chunks_reduced_one_at_a_time(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    plan = _zero(_plan(4, 4, 1, "flowing", seed=1000), 2)
    model, inputs = gpt2_tiny()
    captured = capture(model, inputs)
    stages = zero_stages(captured.params, plan.placements, plan)
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    plain = shard_graph(captured, plan.placements, mesh)
    local = shard_graph(captured, plan.placements, mesh, stages)
    assert local.zero_stages == [stages.get(p.placeholder, 0) for p in captured.params]
    output = next(n for n in local.gm.graph.nodes if n.op == "output").args[0]
    for i, (info, stage) in enumerate(zip(captured.params, local.zero_stages, strict=True)):
        if stage and output[1 + i] is not None:
            assert output[1 + i].meta["val"].numel() == flat_chunk_numel(math.prod(info.shape), 4)
    rs = local.collectives()["reduce_scatter_tensor"] - plain.collectives()["reduce_scatter_tensor"]
    assert rs > 0
    # each ZeRO-2 reduction is waited for before the next starts: at most one whole gradient in flight
    in_flight, worst = 0, 0
    chunk_rs = {o.args[0] for o in output[1:] if o is not None and o.args and hasattr(o.args[0], "target")}
    for n in local.gm.graph.nodes:
        if n in chunk_rs and getattr(n.target, "_opname", "") == "reduce_scatter_tensor":
            in_flight += 1
            worst = max(worst, in_flight)
        elif getattr(n.target, "_opname", "") == "wait_tensor" and n.args[0] in chunk_rs:
            in_flight -= 1
    assert worst == 1


def test_track_memory_counts_params_grads_and_optimizer_state():
    model = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weights = 256 * 256 * 4
    with track_memory(model, opt) as m:
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert m.peak_bytes >= 4 * weights  # weights, gradient, two moments
    assert m.breakdown["params"] == weights and m.breakdown["optimizer"] >= 2 * weights
    assert m.current_bytes < m.peak_bytes  # the gradient is gone
