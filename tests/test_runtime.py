"""Codegen and runtime: every plan trains like the single-device model.

Multi-process tests are costly (a launch of 4 gloo processes is 10–20 s
here, and on 2 cores a case on 4 ranks takes twice its time on 2), so one
launch of 4 processes runs the plans of 2-D meshes (dp 2 x tp 2) and tp 4 (a
group of 4 on an axis), and one launch of 2 processes the 1-D meshes (dp 2,
tp 2) and gradient accumulation.  Collective accounting and bad input are
checked in one process on torch's fake process group.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections import Counter
from signal import SIGKILL

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.capture.joint import capture
from autopar.codegen.shard import shard_graph
from autopar.core.placements import REPLICATE as R
from autopar.cost_models.memory import precision_spec
from autopar.hardware.cluster import MeshShape
from autopar.plans.data import param_zero_stage
from autopar.runtime.grad_accumulation import GradAccumulator
from autopar.runtime.precision import PrecisionPolicy
from autopar.search.sharding.layouts import layout_placements
from autopar.search.sharding.mesh import solve_mesh
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.seeds import seed_filter
from autopar.verify.oracle import (
    check_plans,
    factory_layout_plan,
    group_error,
    layout_plan,
    loss_split_layout,
    plan_with_layout,
    random_placements,
    shell_plan,
)
from examples.handwritten import clicks_tiny, graph_net, lstm_tiny, meta_llama
from examples.models import (
    gpt2_tiny,
    gpt2_tiny4_padded,
    gpt2_tiny_shared_positions,
    llama_tiny,
    mlp_deep,
    mlp_tiny,
    resnet_tiny,
)

TOL = 1e-5
FACTORIES = [mlp_tiny, gpt2_tiny, llama_tiny]


def _plan(factory, n: int, dp: int, tp: int, layout: str | None = None) -> autopar.Plan:
    torch.manual_seed(0)
    model, inputs = factory()
    cluster = autopar.Cluster.local(n)
    if layout:  # its placements replace the search's: none is run
        return layout_plan(model, inputs, cluster, dp, tp, layout)
    return autopar.plan(model, inputs, cluster, fixed={"dp": dp, "tp": tp}, precision="fp32")


def _assert_all_match(cases, checks) -> None:
    bad = [
        f"{f.__name__} {p.mesh} ({p.solver.status}): {c}"
        for (f, p), c in zip(cases, checks, strict=True)
        if not c.ok(TOL)
    ]
    assert not bad, "plans that do not train like one device:\n" + "\n".join(bad)
    for (_, _), c in zip(cases, checks, strict=True):
        assert len(c.losses) == 3 and c.losses[0] != c.losses[2]  # three real steps were taken


def _loss_split_plan(factory, n: int, dp: int, tp: int) -> autopar.Plan:
    torch.manual_seed(0)
    model, inputs = factory()
    cluster = autopar.Cluster.local(n)
    plan = shell_plan(model, inputs, cluster, dp, tp)
    return loss_split_layout(lambda seed: plan_with_layout(plan, model, inputs, cluster, "flowing", seed=seed))


def _accumulating_plan(factory, n: int = 4, microbatches: int = 2) -> autopar.Plan:
    """A data-parallel plan over ``n`` ranks with gradient accumulation over ``microbatches`` micro-batches
    (the analytic search's kind)."""
    torch.manual_seed(0)
    model, inputs = factory()
    fixed = {"dp": n, "zero": 0, "microbatches": microbatches}
    plan = autopar.plan(model, inputs, autopar.Cluster.local(n), fixed=fixed, precision="fp32")
    assert plan.microbatches == microbatches and plan.solver.status == "optimal (exhaustive)"  # the analytic path
    return plan


@pytest.mark.slow
def test_plans_on_4_processes_train_like_one_device():
    """The 2-D mesh on 4 ranks, in one launch: the solver's plan, Megatron's layout, random strategies per op
    (not the solver's choice: every op's drawn among all it has, a change of placement between almost any two
    ops), padded labels with the loss split over tp, an LSTM and a click model (EmbeddingBag, a loss DTensor
    cannot run sharded) from examples/handwritten.py under random strategies (tests/test_handwritten.py trains
    nanoGPT, the U-Net and the MobileNet, the 2-process launch below Meta's LLaMA); and the solver's tp 4 plan of GPT-2 (collectives and
    shards over an axis of 4 ranks, which dp 2 x tp 2 does not have). Placements are laid out on plans made without a search
    (:func:`autopar.verify.oracle.shell_plan`).

    Covered elsewhere on 4 processes: random "flowing" strategies of LLaMA on dp 2 x tp 2 by
    tests/test_context_parallel.py (its causal LLaMA, head-tail shards among them; AUTOPAR_FUZZ_PLANS=N runs
    N of this file's tiny LLaMA here too), GPT-2's ZeRO-3 layout on dp 4 by tests/test_rng.py ("zero3", with dropout
    under rng="exact"). The 1-D meshes of 2 ranks are trained by the test below."""
    cases = [
        (mlp_tiny, _plan(mlp_tiny, 4, 2, 2)),
        (gpt2_tiny, _plan(gpt2_tiny, 4, 1, 4)),
        (llama_tiny, _plan(llama_tiny, 4, 2, 2, "megatron")),
        (mlp_deep, plan_with_layout_random(mlp_deep, 0)),  # planned on a folded capture
        (gpt2_tiny4_padded, _loss_split_plan(gpt2_tiny4_padded, 4, 2, 2)),
        (lstm_tiny, plan_with_layout_random(lstm_tiny, 0, "flowing")),  # a kernel that reads grad mode
        (clicks_tiny, plan_with_layout_random(clicks_tiny, 0)),  # EmbeddingBag replicated; a loss run whole
    ]
    count = int(os.environ.get("AUTOPAR_FUZZ_PLANS", "0"))
    cases += [(llama_tiny, plan_with_layout_random(llama_tiny, seed, "flowing")) for seed in range(count)]
    checks = check_plans(cases, autopar.Cluster.local(4))
    _assert_all_match(cases, checks)
    # Megatron's row-parallel reductions ran: all-reduced, or reduce-scattered where the layout is sequence parallel
    ran = checks[2].collectives
    assert ran.get("all_reduce", 0) + ran.get("reduce_scatter_tensor", 0) >= 2, ran


@pytest.mark.slow
def test_plans_on_2_processes_train_like_one_device():
    """The 1-D meshes, in one launch of 2 ranks: the solver's data-parallel and tensor-parallel plans, Meta's
    reference LLaMA (rotary embeddings in complex numbers) under random strategies on tp 2, and
    gradient accumulation on the analytic data-parallel path over 4 micro-batches of one sequence a rank (as
    dp 4 at 2 micro-batches cuts them), GPT-2's with position_ids of shape (1, T) and padded labels', each rank
    fed its own part of the batch (and the whole position_ids)."""
    cases = [(mlp_tiny, _plan(mlp_tiny, 2, dp, tp)) for dp, tp in [(2, 1), (1, 2)]]
    cases += [
        (llama_tiny, _plan(llama_tiny, 2, 2, 1)),
        # rotary embeddings in complex numbers, under random strategies: on tp 2 here, a quarter of its cost on the
        # 4-process launch (8.5 CPU-s a rank there); AUTOPAR_HANDWRITTEN=all trains it on dp 2 x tp 2
        (meta_llama, factory_layout_plan(meta_llama, autopar.Cluster.local(2), 1, 2, "flowing", seed=1000)),
        # inputs that are not batches of samples (a graph's edge lists beside its nodes): the search's plan
        (graph_net, _searched_plan(graph_net, 2)),
        # position_ids of shape (1, T) every sample shares: each rank and micro-batch takes them whole
        (gpt2_tiny_shared_positions, _accumulating_plan(gpt2_tiny_shared_positions, 2, 4)),
        (gpt2_tiny4_padded, _accumulating_plan(gpt2_tiny4_padded, 2, 4)),
    ]
    assert all(p.micro_batch_size == 1 for _, p in cases[-2:])
    local_batch = [False] * (len(cases) - 2) + [True, True]
    checks = check_plans(cases, autopar.Cluster.local(2), local_batch=local_batch)
    _assert_all_match(cases, checks)


def _searched_plan(factory, n: int) -> autopar.Plan:
    torch.manual_seed(0)
    model, inputs = factory()
    return autopar.plan(model, inputs, autopar.Cluster.local(n), precision="fp32", time_limit_s=10)


def test_inputs_that_are_not_batches_of_samples_keep_their_shape_and_one_micro_batch() -> None:
    """A graph network's edge lists (40 rows beside 16 nodes): the capture at another batch leaves them as they
    are, the search plans one micro-batch, and a fixed count of more is refused in one line."""
    from autopar.core.errors import PlanError
    from autopar.cost_models.graph_cache import resize_batch

    torch.manual_seed(0)
    model, inputs = graph_net()
    resized = resize_batch(inputs, 8)
    assert [tuple(v.shape) for v in resized.values()] == [(8, 8), (40,), (40,), (8,)]
    plan = autopar.plan(model, inputs, autopar.Cluster.local(2), precision="fp32", time_limit_s=10)
    assert plan.microbatches == 1
    with pytest.raises(PlanError, match="input src is not a batch of 16 samples.*microbatches=1"):
        autopar.plan(model, inputs, autopar.Cluster.local(2), fixed={"dp": 2, "microbatches": 2}, time_limit_s=10)


def test_an_input_every_sample_shares_goes_whole_to_every_micro_batch() -> None:
    """position_ids of shape (1, T) beside (8, T) ids: not the batch (also where the examples list it first), kept
    whole by a capture at another batch, micro-batches allowed (one sample each included, where the capture alone
    cannot tell it from the batch), and a shared input of another shape refused in one line at the step."""
    from autopar.capture.inputs import batch_of, batched_flags, input_tensors
    from autopar.core.errors import RuntimeMismatchError
    from autopar.cost_models.graph_cache import resize_batch
    from autopar.runtime.parallel_module import batch_placement, micro_part
    from autopar.verify.reference import slice_batch

    torch.manual_seed(0)
    model, inputs = gpt2_tiny_shared_positions()
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    assert batch_of([positions, ids]) == 8 and batched_flags([positions, ids, torch.ones(())]) == [False, True, False]
    assert batch_of([positions]) == 1 and batched_flags([positions]) == [True]
    assert tuple(resize_batch(inputs, 2)["position_ids"].shape) == (1, 16)
    assert [tuple(v.shape) for v in slice_batch(inputs, 1, 4).values()] == [(2, 16), (2, 16), (1, 16)]
    plan = autopar.plan(model, inputs, autopar.Cluster.local(2), fixed={"dp": 2, "microbatches": 4}, time_limit_s=10)
    assert plan.microbatches == 4
    one = resize_batch(inputs, 1)  # a micro-batch of one sample: the capture is told which input is the batch
    captured = capture(model, one, batched=batched_flags(input_tensors(model, inputs)))
    assert [(i.name, i.batched) for i in captured.inputs] == [("input_ids", True), ("labels", True), ("position_ids", False)]
    shared = captured.inputs[2]
    spec = (R, R)
    assert batch_placement(positions, spec, shared, 4, 2, local_batch=True) == spec
    assert micro_part(positions, shared, 4, 3) is positions
    assert micro_part(ids, captured.inputs[0], 4, 3).shape == (2, 16)
    with pytest.raises(RuntimeMismatchError, match=r"input position_ids has shape \(8, 16\).*\(1, 16\).*re-plan"):
        batch_placement(positions.expand(8, -1), spec, shared, 4, 2, local_batch=False)
    with pytest.raises(RuntimeMismatchError, match="input input_ids has batch 8, the plan expects 4; re-plan"):
        batch_placement(ids, spec, captured.inputs[0], 4, 2, local_batch=False)  # captured at 1 sample, 4 micro-batches


def plan_with_layout_random(factory, seed: int, layout: str = "random") -> autopar.Plan:
    return factory_layout_plan(factory, autopar.Cluster.local(4), 2, 2, layout, seed=1000 + seed)


# ---------------------------------------------------------------- one process, fake process group


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def _totals(records) -> tuple[Counter, Counter]:
    count, nbytes = Counter(), Counter()
    for r in records:
        count[(r["kind"], r["axis"])] += 1
        nbytes[(r["kind"], r["axis"])] += r["bytes"]
    return count, nbytes


def _as_run_on_gloo(charged: list, mesh_shape: tuple[int, int]) -> list[dict]:
    """Gloo has no all-to-all: DTensor gathers the whole tensor and keeps its chunk instead
    (torch's ``shard_dim_alltoall`` on a CPU mesh), so each charged all-to-all runs as an all-gather of
    the group's tensor. A GPU cluster runs the all-to-all the plan charged."""
    out = []
    for c in charged:
        run = {"kind": c.kind, "axis": c.axis, "bytes": c.bytes}
        if c.kind == "all_to_all":
            n = mesh_shape[("dp", "tp").index(c.axis)]
            run = {**run, "kind": "all_gather", "bytes": c.bytes * n}
        out.append(run)
    return out


@pytest.mark.parametrize("factory, precision", [(gpt2_tiny, "fp32"), (llama_tiny, "bf16-mixed")])
@pytest.mark.parametrize("layout", [None, "megatron", "zero3"])
def test_generated_collectives_are_the_ones_charged(fake_world, factory, layout, precision):
    """Every collective of the local graph, kind, axis and bytes, is one the search charged; under
    bf16-mixed (LLaMA: its norms and loss cast to fp32 in the graph), activations move in bf16 and
    gradients are reduced in fp32 on both sides. (LLaMA in fp32 moves the same collectives in fp32:
    GPT-2's cases hold the fp32 path.)"""
    torch.manual_seed(0)
    model, inputs = factory()
    cluster = autopar.Cluster.local(4)
    policy = PrecisionPolicy.of(precision)
    captured = capture(model, inputs, compute_dtype=policy.param_dtype)
    mesh = MeshShape(dp=4, tp=1, pp=1) if layout == "zero3" else MeshShape(dp=2, tp=2, pp=1)
    params = {p.placeholder: p.name for p in captured.params}
    res = solve_mesh(
        MeshRequest(captured, cluster, mesh, precision_spec(precision), "adamw", float("inf")),
        30.0,
        allowed=seed_filter(layout, params, factory is gpt2_tiny) if layout else None,
    )
    device_mesh = init_device_mesh("cpu", (mesh.dp, mesh.tp), mesh_dim_names=("dp", "tp"))
    # ZeRO-1/2 parameters (a tie with ZeRO-0 when memory is unlimited): their gradients leave the graph,
    # and the runtime's sharded optimizer reduce-scatters them and gathers the parameters after the step
    zero = {ph: z for ph in params if (z := param_zero_stage(res.placements[ph])) in (1, 2)}
    local = shard_graph(captured, res.placements, device_mesh, zero, reduce_dtype=policy.reduce_dtype)
    graph_count, graph_bytes = _totals(local.collective_records(device_mesh))
    in_runtime = [
        c
        for c in res.charged
        if c.reason == "zero" or (c.reason == "grad-sync" and c.dst in zero and c.axis == "dp")
    ]
    assert len([c for c in in_runtime if c.reason == "zero"]) == len(zero)
    in_graph = [c for c in res.charged if c not in in_runtime]
    charged_count, charged_bytes = _totals(_as_run_on_gloo(in_graph, (mesh.dp, mesh.tp)))
    assert graph_count == charged_count
    assert graph_bytes == charged_bytes
    assert sum(graph_count.values()) > 0


class _Literal(torch.nn.Module):
    """A tensor literal in the forward (Falcon's ``torch.tensor(...)``): a constant of the captured graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * torch.tensor([0.5, 2.0]).repeat(4)).square().mean()


def test_model_constants_are_constants_of_the_local_graph(fake_world):
    torch.manual_seed(0)
    captured = capture(_Literal(), (torch.randn(8, 8),))
    assert any(n.op == "get_attr" for n in captured.gm.graph.nodes)
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for seed in range(3):
        local = shard_graph(captured, random_placements(captured, (2, 2), seed), device_mesh)
        assert any(n.op == "get_attr" for n in local.gm.graph.nodes)


def test_ops_sharded_through_their_decomposition_run_it(fake_world):
    """mse_loss_backward has no DTensor rule; its strategies come from its decomposition, which reads the whole
    tensor's size (2 / numel): on a shard, the op itself would scale the gradient by the number of shards."""
    torch.manual_seed(0)
    model, inputs = mlp_tiny()
    captured = capture(model, inputs)
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    backward = next(n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.mse_loss_backward.default)
    placements = random_placements(captured, (2, 2), seed=0)
    assert placements[backward.name]["inputs"][1] != (R, R)  # the loss's input arrives sharded
    local = shard_graph(captured, placements, device_mesh)
    assert torch.ops.aten.mse_loss_backward.default not in {n.target for n in local.gm.graph.nodes}


def test_an_op_dtensor_cannot_run_sharded_runs_whole_on_its_gathered_inputs(fake_world, caplog):
    """binary_cross_entropy_with_logits has no DTensor rule; its strategies come from its decomposition traced on
    a one-dimensional mesh, which on a 2-D mesh reaches log_sigmoid_forward, which DTensor cannot run: the op runs
    whole on every rank, on gathered inputs, with a warning (trained like one device in the 4-process test)."""
    torch.manual_seed(0)
    model, inputs = clicks_tiny()
    captured = capture(model, inputs)
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    bce = torch.ops.aten.binary_cross_entropy_with_logits.default
    loss = next(n for n in captured.gm.graph.nodes if n.target is bce)
    placements = random_placements(captured, (2, 2), seed=0)
    assert any(p != R for p in placements[loss.name]["inputs"][0])  # its logits arrive sharded
    with caplog.at_level(logging.WARNING, logger="autopar.codegen.shard"):
        local = shard_graph(captured, placements, device_mesh)
    assert any("binary_cross_entropy_with_logits" in r.getMessage() and "whole" in r.getMessage() for r in caplog.records)
    assert bce in {n.target for n in local.gm.graph.nodes}


def test_a_plan_for_another_world_size_is_refused_before_any_collective(fake_world):
    plan = _plan(mlp_tiny, 2, 2, 1)
    model, inputs = mlp_tiny()
    with pytest.raises(autopar.RuntimeMismatchError, match="plan is for 2 devices but this job has 4 ranks"):
        autopar.parallelize(model, autopar.Cluster.local(4), inputs, plan=plan)
    with pytest.raises(autopar.RuntimeMismatchError, match="cluster has 2 devices but this job has 4"):
        autopar.parallelize(model, autopar.Cluster.local(2), inputs, plan=plan)


def test_a_plan_for_another_model_is_refused(fake_world):
    plan = _plan(mlp_tiny, 4, 4, 1)
    other = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(autopar.RuntimeMismatchError, match="made for another model"):
        autopar.parallelize(other, autopar.Cluster.local(4), (torch.randn(8, 32),), plan=plan)


def test_a_data_parallel_plan_carries_the_placements_it_runs(fake_world, monkeypatch):
    """The analytic data-parallel path solves its layout once, at plan time: parallelize solves nothing. A plan
    saved without placements (by an older autopar) is completed on rank 0 to the same placements and graph."""
    plan = _accumulating_plan(mlp_tiny)
    params = [e for e in plan.placements.values() if "param" in e]
    assert params and all(e["outputs"][0] == (R, R) and "zero" not in e for e in params)  # dp layout, plan.zero
    solves = []
    real = autopar.search.sharding.mesh.prepare_mesh
    monkeypatch.setattr(
        autopar.search.sharding.mesh, "prepare_mesh", lambda *a, **k: solves.append(1) or real(*a, **k)
    )
    model, inputs = mlp_tiny()
    cluster = autopar.Cluster.local(4)
    carried = autopar.parallelize(model, cluster, inputs, plan=autopar.Plan.from_dict(plan.to_dict()))
    assert not solves
    old = autopar.parallelize(model, cluster, inputs, plan=dataclasses.replace(plan, placements={}))
    assert solves and old.plan.placements == plan.placements and old.graph.code == carried.graph.code


@pytest.mark.parametrize("factory", [gpt2_tiny, llama_tiny, resnet_tiny])
@pytest.mark.parametrize("kind", ["dp", "zero3"])
def test_one_device_layouts_are_read_off_without_a_solve(factory, kind, monkeypatch):
    """On one device every node has one strategy: the layout's placements are the ones the solve would return.

    zero3 wants parameters sharded, which one device cannot: that falls back to the solve, as before.
    """
    model, inputs = factory()
    captured = capture(model, inputs)
    cluster, mesh, prec = autopar.Cluster.local(1), MeshShape(dp=1, tp=1, pp=1), precision_spec("bf16-mixed")
    params = {p.placeholder: p.name for p in captured.params}
    request = MeshRequest(captured, cluster, mesh, prec, "adamw", float("inf"))
    solved = solve_mesh(request, 30.0, allowed=seed_filter(kind, params, factory is gpt2_tiny)).placements
    solves = []
    real = autopar.search.sharding.layouts.solve_mesh
    monkeypatch.setattr(
        autopar.search.sharding.layouts, "solve_mesh", lambda *a, **k: solves.append(1) or real(*a, **k)
    )
    if kind == "zero3" and not solved:
        with pytest.raises(autopar.PlanError):
            layout_placements(captured, cluster, mesh, prec, "adamw", kind)
        assert solves
        return
    read = layout_placements(captured, cluster, mesh, prec, "adamw", kind)
    assert list(read.items()) == list(solved.items())
    assert len(solves) == (kind == "zero3")


def test_parallelize_outside_a_job_says_how_to_launch():
    model, inputs = mlp_tiny()
    with pytest.raises(autopar.RuntimeMismatchError, match=r"autopar.launch\(fn, cluster\) or torchrun"):
        autopar.parallelize(model, autopar.Cluster.local(2), inputs)


# ---------------------------------------------------------------- launcher


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _one_rank_dies() -> None:
    if dist.get_rank() == 1:
        os.abort()  # a native crash
    dist.barrier()  # would wait for rank 1 forever without the launcher


def _one_rank_raises() -> None:
    if dist.get_rank() == 0:
        raise ValueError("bad batch")
    dist.barrier()


def test_launch_returns_every_rank_result():
    assert autopar.launch(_rank_and_world, 2) == [(0, 2), (1, 2)]


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def test_launches_at_once_each_meet_in_their_own_store():
    """Each launch serves its job's store on a port it holds: jobs started together (as a suite's workers
    start theirs) never share one, so each job's ranks form their own group."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(autopar.launch, _sum_of_ranks, 2) for _ in range(3)]
        assert [j.result() for j in jobs] == [[1.0, 1.0]] * 3


def test_a_dead_rank_stops_the_job_without_hanging():
    with pytest.raises(autopar.LaunchError, match="rank 1 was killed by SIGABRT") as caught:
        autopar.launch(_one_rank_dies, 2, timeout_s=60)
    assert caught.value.signal == 6


def test_a_failing_rank_reports_its_error():
    with pytest.raises(autopar.LaunchError, match="rank 0 failed: ValueError: bad batch"):
        autopar.launch(_one_rank_raises, 2, timeout_s=60)


@pytest.mark.parametrize("signal", [6, None])
def test_check_plans_runs_again_only_after_a_native_crash(monkeypatch, signal):
    """check_plans runs a launch again only when a rank was killed, up to its retries."""
    from autopar.runtime import launch as launching

    calls = []

    def crashing_launch(*args, **kwargs):
        calls.append(1)
        raise autopar.LaunchError("rank 1 was killed", signal=signal)

    monkeypatch.setattr(launching, "_launch_once", crashing_launch)
    with pytest.raises(autopar.LaunchError, match="rank 1 was killed"):
        check_plans([(mlp_tiny, None)], autopar.Cluster.local(2), steps=1, crash_retries=2)
    assert len(calls) == (3 if signal else 1)


def _killed_once(marker: str, home: int):
    """mlp_tiny, except that rank 1 of a launched job kills itself the first time it builds it (``marker``
    then exists): a native crash in the middle of a launch. ``home``: the test's process, which builds it for
    the reference and is left alone."""
    if os.getpid() != home and dist.is_initialized() and dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), SIGKILL)
    return mlp_tiny()


def _counted(log: str, home: int):
    """mlp_tiny, a line appended to ``log`` each time rank 0 of a launched job builds it."""
    if os.getpid() != home and dist.is_initialized() and dist.get_rank() == 0:
        with open(log, "a") as f:
            f.write("built\n")
    return mlp_tiny()


@pytest.mark.slow
def test_a_launch_killed_midway_runs_again_from_the_case_it_stopped_in(tmp_path, caplog):
    """Rank 1 is killed in the second of three cases: the launch runs again with the second and third only
    (the first, finished on every rank, is kept), and all three train like one device."""
    counted = functools.partial(_counted, str(tmp_path / "built"), os.getpid())
    killed = functools.partial(_killed_once, str(tmp_path / "killed"), os.getpid())
    two = autopar.Cluster.local(2)
    cases = [(counted, _plan(mlp_tiny, 2, 2, 1)), (killed, _plan(mlp_tiny, 2, 1, 2)), (mlp_tiny, _plan(mlp_tiny, 2, 2, 1))]
    with caplog.at_level(logging.WARNING, logger="autopar.verify.oracle"):
        checks = check_plans(cases, two, crash_retries=1)
    assert (tmp_path / "killed").exists()
    assert "running the 2 cases not finished again" in caplog.text
    assert (tmp_path / "built").read_text().count("built") == 1  # the first case ran once
    _assert_all_match(cases, checks)


def test_gradients_sum_over_microbatches_into_grad_without_sharing_storage():
    shards = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))])
    fused = torch.arange(6.0)  # one buffer holding both gradients, as a fused backward returns them
    sink = GradAccumulator(shards, [0, 0], None, [False, False])
    sink.add({0: fused[:4], 1: fused[4:]})
    assert shards[0].grad.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr()
    whole = torch.ones(2)
    sink = GradAccumulator(shards[1:], [0], None, [False])
    shards[1].grad = None
    sink.add({0: whole}, 0.25)
    sink.add({0: whole}, 0.75)
    sink.finish()
    assert torch.equal(shards[1].grad, torch.ones(2)) and torch.equal(whole, torch.ones(2))
    owned = torch.full((2,), 3.0)
    shards[1].grad = None
    GradAccumulator(shards[1:], [0], None, [False]).add({0: owned})
    assert shards[1].grad is owned  # a gradient alone in its storage becomes .grad without a copy
    shards[1].grad = None
    GradAccumulator(shards[1:], [0], None, [False], copy=True).add({0: owned})
    assert shards[1].grad is not owned and torch.equal(shards[1].grad, owned)


def test_a_gradient_neither_run_has_agrees_and_one_only_one_run_has_does_not():
    # a parameter the loss does not reach (BigBird's pooler under its causal LM head) has no gradient on one device
    # nor under a plan: the reference of a model with dropout, autopar on one process, lists it as None
    g = torch.ones(3)
    assert group_error({"w": g, "pooler": None}, {"w": g, "pooler": None}) == (0.0, "w")
    assert group_error({"w": g, "pooler": torch.zeros(3)}, {"w": g, "pooler": None})[0] == float("inf")
    assert group_error({"w": g, "pooler": None}, {"w": g, "pooler": torch.zeros(3)})[0] == float("inf")
