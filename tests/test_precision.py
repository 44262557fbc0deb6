"""Mixed precision at run time: plans train in the precision they were costed in.

Slow: one launch of 4 gloo processes trains for 3 AdamW steps under bf16-mixed
plans of every kind (GPT-2 under Megatron dp 2 x tp 2; six residual MLP blocks
under ZeRO-1 with 2 micro-batches and bf16 gradient reductions, ZeRO-2 with full
recompute, ZeRO-3 and a pipeline pp 2 x dp 2) and GPT-2 under an
fp16-mixed Megatron pipeline pp 2 x tp 2, each against one device running the
same precision policy (:mod:`autopar.verify.reference`).  One launch of 2 processes checks that
checkpoints hold the fp32 masters and that an fp16 overflow on one rank skips
the step on every rank.

Tolerances, for bf16 (8 significant bits, unit round-off 2^-9 = 0.2%):

* losses within 1e-2 relative at every step (the issue's bound);
* first-step gradients within 2e-2 relative L2 error: each op rounds its
  result to bf16 and the plan's ops add up partial sums in another order, some
  ten round-offs down the backward of a 2-layer model;
* parameters after the last step: AdamW moves an element by at most
  ``lr · r_t`` at step ``t``, where ``r_t`` bounds |m̂_t| / sqrt(v̂_t) whatever the
  gradients are (Cauchy-Schwarz over the bias-corrected averages: 1 at the first
  step, 1.0014 at the second), so two runs whose gradients differ by round-off,
  even in sign where a gradient is near zero, end at most ``2 · lr · Σ r_t``
  apart; :func:`adam_bound` computes it (6.01e-3 for 3 steps at lr 1e-3).

Each run must also have computed in the compute dtype, with fp32 masters,
optimizer state and gradients: a run that ignored the plan's precision would
pass the numbers above and fail this.

One process: the policy of each precision, capture in the compute dtype,
gradient reductions in fp32 wherever random layouts put them (on torch's fake
process group), the single-device reference, the loss scaler's rule, and the
cost model's reduce dtype.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.capture.joint import capture
from autopar.codegen.shard import shard_graph
from autopar.core.errors import PlanError
from autopar.cost_models.memory import precision_spec
from autopar.runtime.checkpoint import load_single
from autopar.runtime.precision import LossScaler, PrecisionPolicy, scale_steps
from autopar.verify.oracle import check_plans, layout_plan, plan_with_pipeline, random_placements, shell_plan
from autopar.verify.reference import single_device_run
from examples.models import gpt, gpt2_tiny, llama_tiny, mlp_deep, mlp_tiny

LR, STEPS = 1e-3, 3
LOSS_TOL, GRAD_TOL = 1e-2, 2e-2
FOUR = autopar.Cluster.local(4)


def adam_bound(lr: float, steps: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most two AdamW runs from the same weights can drift apart per element in ``steps`` steps.

    At step t, m̂ / sqrt(v̂) = Σ w_i g_i / sqrt(Σ u_i g_i²) with bias-corrected weights
    w_i = (1-β1) β1^(t-i) / (1-β1^t) and u_i = (1-β2) β2^(t-i) / (1-β2^t); by Cauchy-Schwarz
    its size is at most sqrt(Σ w_i² / u_i), whatever the gradients.  Each run moves an
    element by at most lr times that per step, so two runs by at most twice the sum.
    """
    total = 0.0
    for t in range(1, steps + 1):
        w = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1**t) for i in range(1, t + 1)]
        u = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2**t) for i in range(1, t + 1)]
        total += math.sqrt(sum(a * a / b for a, b in zip(w, u, strict=True)))
    return 2 * lr * total


def _plan(factory, fixed: dict, precision: str = "bf16-mixed", layout: str | None = None, **options) -> autopar.Plan:
    torch.manual_seed(0)
    model, batch = factory()
    if layout:  # its placements replace the search's: none is run
        return layout_plan(model, batch, FOUR, fixed["dp"], fixed.get("tp", 1), layout, precision=precision)
    return autopar.plan(model, batch, FOUR, fixed=fixed, precision=precision, **options)


def _pipeline(factory, tp: int, precision: str) -> autopar.Plan:
    torch.manual_seed(0)
    model, batch = factory()
    base = shell_plan(model, batch, FOUR, 4 // tp, tp, precision=precision)
    return plan_with_pipeline(base, model, batch, FOUR, 2, microbatches=2, layout="megatron" if tp > 1 else "dp")


# GPT-2 where the ops matter (attention, norms, embedding, a loss over fp32 logits); six residual MLP
# blocks, a few seconds cheaper to capture and trace on 4 processes, for the rest (a loss in bf16).
# Random layouts, which reduce gradients where no solver would, are checked in one process below
CASES = [
    ("GPT-2 megatron dp2 x tp2", gpt2_tiny, lambda: _plan(gpt2_tiny, {"dp": 2, "tp": 2}, layout="megatron")),
    ("MLPs ZeRO-3", mlp_deep, lambda: _plan(mlp_deep, {"dp": 4, "zero": 3})),
    (
        "MLPs ZeRO-1, 2 micro-batches, bf16 reductions",
        mlp_deep,
        lambda: _plan(mlp_deep, {"dp": 4, "zero": 1, "microbatches": 2}, reduce_dtype="bf16"),
    ),
    ("MLPs ZeRO-2, full recompute", mlp_deep, lambda: _plan(mlp_deep, {"dp": 4, "zero": 2, "recompute": "full"})),
    ("MLPs pipeline pp2 x dp2", mlp_deep, lambda: _pipeline(mlp_deep, 1, "bf16-mixed")),
    # GPT-2's loss is computed in fp32: its first scaled step does not overflow (the MLPs' fp16 loss would)
    ("GPT-2 fp16 pipeline pp2 x tp2", gpt2_tiny, lambda: _pipeline(gpt2_tiny, 2, "fp16-mixed")),
]


@pytest.mark.slow
def test_mixed_precision_plans_train_like_one_device_in_the_same_precision():
    cases = [(factory, make) for _, factory, make in CASES]
    checks = check_plans(cases, FOUR, lr=LR, steps=STEPS, precision="bf16-mixed")
    bound = adam_bound(LR, STEPS)
    report = "\n".join(
        f"{name}: {c}; largest parameter difference {c.param_max_abs:.1e}"
        for (name, *_), c in zip(CASES, checks, strict=True)
    )
    for (name, *_), c in zip(CASES, checks, strict=True):
        compute = "float16" if "fp16" in name else "bfloat16"
        assert compute in c.dtypes["graph"], (name, c.dtypes)
        assert c.dtypes["masters"] == c.dtypes["optimizer"] == c.dtypes["grads"] == ["float32"], (name, c.dtypes)
        assert c.loss_error <= LOSS_TOL and c.grad_error <= GRAD_TOL, f"{name}\n{report}"
        assert c.param_max_abs <= bound, f"{name}: {c.param_max_abs:.2e} > {bound:.2e}\n{report}"
        assert c.losses[0] != c.losses[-1]  # the steps were taken
    # the plans did what they say: tensor parallelism reduces partial sums, ZeRO-3 gathers parameters
    assert checks[0].collectives.get("all_reduce", 0) + checks[0].collectives.get("reduce_scatter_tensor", 0) > 0
    assert checks[1].collectives.get("all_gather_into_tensor", 0) > 0


def _masters_and_overflow(cluster: autopar.Cluster, path: str) -> dict:
    """On each of 2 ranks: a bf16 ZeRO-1 plan's checkpoint, then an fp16 step that overflows on rank 1 only."""
    torch.manual_seed(0)
    model, batch = mlp_deep()
    plan = autopar.plan(model, batch, cluster, fixed={"dp": 2, "zero": 1}, precision="bf16-mixed")
    pm = autopar.parallelize(model, cluster, batch, plan=plan)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR)
    pm.train_step(batch)
    opt.step()
    opt.zero_grad()
    masters = pm.full_state_dict()
    pm.save(path, opt)
    out = {"masters": masters}
    if dist.get_rank() == 0:
        fresh, _ = mlp_deep()
        load_single(fresh, path)
        out["loaded"] = {k: v.detach().clone() for k, v in fresh.state_dict().items()}

    plan16 = autopar.plan(model, batch, cluster, fixed={"dp": 2, "zero": 2}, precision="fp16-mixed")
    pm16 = autopar.parallelize(model, cluster, batch, plan=plan16)
    opt16 = pm16.make_optimizer(torch.optim.AdamW, lr=LR)
    pm16._scaler.scale = 2.0**8  # the MLPs' loss is itself fp16: 2^16 times it would overflow on every rank
    pm16.train_step(batch)
    opt16.step()  # a step that does not overflow
    opt16.zero_grad()
    out["clean step"] = pm16._scaler.skipped == 0
    before = {k: v.clone() for k, v in pm16.full_state_dict().items()}
    scale = pm16._scaler.scale
    pm16.train_step(batch)
    if dist.get_rank() == 1:  # one rank's gradient chunk overflows; the other's is finite
        next(p for g in opt16.param_groups for p in g["params"] if p.grad is not None).grad[0] = float("inf")
    opt16.step()
    opt16.zero_grad()
    after = pm16.full_state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["scale"] = (scale, pm16._scaler.scale, pm16._scaler.skipped)
    pm16.save(path + "-fp16", opt16)  # the scale reached is kept with the checkpoint
    reached, pm16._scaler.scale = pm16._scaler.scale, 1.0
    pm16.load(path + "-fp16", opt16)
    out["scale resumed"] = pm16._scaler.scale == reached
    return out


@pytest.mark.slow
def test_checkpoints_hold_fp32_masters_and_an_fp16_overflow_skips_the_step_on_every_rank():
    two = autopar.Cluster.local(2)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = autopar.launch(_masters_and_overflow, two, two, os.path.join(tmp, "ckpt"), crash_retries=1)
    masters, loaded = ranks[0]["masters"], ranks[0]["loaded"]
    assert all(t.dtype == torch.float32 for t in masters.values())
    assert all(torch.equal(loaded[k], masters[k]) for k in loaded), "the checkpoint is not the masters"
    # stepped fp32 masters are not all bf16 values: a checkpoint of the bf16 copies would be
    stepped = masters["layers.0.up.weight"]
    assert not torch.equal(stepped, stepped.bfloat16().float())
    for rank in ranks:
        assert rank["clean step"]
        assert rank["unchanged"], "an overflowing step changed the weights"
        start, now, skipped = rank["scale"]
        assert (now, skipped) == (start / 2, 1)
        assert rank["scale resumed"]


# ---------------------------------------------------------------- one process


def test_each_precision_names_its_dtypes():
    assert PrecisionPolicy.of("fp32") == PrecisionPolicy("fp32", None, None, False)
    bf16 = PrecisionPolicy.of("bf16-mixed")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.loss_scaling) == (torch.bfloat16, torch.float32, False)
    assert PrecisionPolicy.of("bf16-mixed", "bf16").reduce_dtype is None  # reduced as computed
    fp16 = PrecisionPolicy.of("fp16-mixed")
    assert (fp16.param_dtype, fp16.loss_scaling) == (torch.float16, True)
    with pytest.raises(PlanError, match="reduce_dtype='bf16' or 'fp32'"):
        PrecisionPolicy.of("bf16-mixed", "fp16")
    # the cost model holds fp32 gradients of the fp32 masters, reduced in the reduce dtype
    spec = precision_spec("bf16-mixed")
    assert (spec.param_bytes, spec.grad_bytes, spec.master_bytes, spec.reduce_bytes) == (2, 4, 4, 4)
    assert precision_spec("bf16-mixed", "bf16").reduce_bytes == 2


def test_capture_in_the_compute_dtype_casts_parameters_and_float_inputs_not_buffers():
    from examples.models import llama_tiny

    model, batch = llama_tiny()
    captured = capture(model, batch, compute_dtype=torch.bfloat16)
    assert {p.dtype for p in captured.params} == {torch.bfloat16}
    assert {b.dtype for b in captured.buffers} == {torch.float32}  # the rotary table stays fp32
    # the model's own casts are ops of the graph: LLaMA's RMSNorm and the loss run in fp32
    casts = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert len(casts) > 2 * 2
    model, (x, y) = mlp_tiny()
    captured = capture(model, (x, y), compute_dtype=torch.bfloat16)
    assert {i.dtype for i in captured.inputs} == {torch.bfloat16}


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


REDUCTIONS = {"all_reduce", "reduce_scatter_tensor"}


def _cast_back(gm) -> int:
    """Reductions of an fp32 value whose sum is cast back to bf16 (one cast up mid-chain, for a bf16 reader)."""
    found = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "_opname", "") in REDUCTIONS:
            if n.args[0].meta["val"].dtype == torch.float32:
                waits = [u for u in n.users if u.target is torch.ops._c10d_functional.wait_tensor.default]
                readers = [r for w in waits for r in w.users]
                found += any(getattr(r.meta.get("val"), "dtype", None) == torch.bfloat16 for r in readers)
    return found


def test_gradient_reductions_run_in_fp32_wherever_a_random_layout_puts_them(fake_world):
    """LLaMA (tiny: some of its activation gradients are as large as a weight's gradient, 128 x 64, and so on
    the chain) in bf16 under a random dp 2 x tp 2 layout: the gradients are reduced in fp32, a sum cast up
    mid-chain is cast back for the bf16 op that reads it (kept in fp32, it met a bf16 operand in a matmul),
    and the local graph runs on real tensors (the fake group's collectives hand back their input) with
    every gradient in fp32."""
    torch.manual_seed(0)
    model, batch = llama_tiny()
    captured = capture(model, batch, compute_dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    placements = random_placements(captured, (2, 2), 1, flowing=True)  # cheaper to trace than any-to-any
    local = shard_graph(captured, placements, mesh, reduce_dtype=torch.float32)
    assert _cast_back(local.gm)  # the layout reduces mid-chain, before a bf16 reader
    vals = [ph.meta["val"] for ph in local.gm.graph.find_nodes(op="placeholder")]
    args = [
        torch.randn(v.shape, dtype=v.dtype) if v.is_floating_point() else torch.randint(0, 128, v.shape)
        for v in vals
    ]  # parameters, buffers, then token ids and labels (vocabulary 128)
    _, *grads = local.gm(*args)
    assert {g.dtype for g in grads if g is not None} == {torch.float32}


def test_the_reference_steps_fp32_masters_from_bf16_gradients():
    fp32 = single_device_run(gpt2_tiny, 2, LR, 0)
    bf16 = single_device_run(gpt2_tiny, 2, LR, 0, precision="bf16-mixed")
    assert all(g.dtype == torch.float32 for g in bf16[1].values())
    assert all(t.dtype == torch.float32 for t in bf16[2].values())
    loss32, loss16 = fp32[0][0], bf16[0][0]
    assert loss16 != loss32 and abs(loss16 - loss32) / loss32 < LOSS_TOL  # bf16, and close


def test_the_loss_scaler_skips_overflows_backs_off_and_grows():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    scale_steps(opt, scaler)
    p.grad = torch.tensor([8.0, 8.0, float("inf")])
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and scaler.scale == 4.0 and scaler.skipped == 1
    for expected in (4.0, 8.0):  # two good steps in a row double the scale
        p.grad = torch.full((3,), scaler.scale)  # a gradient of 1, scaled
        opt.step()
        assert scaler.scale == expected
    assert torch.allclose(p.detach(), torch.zeros(3))  # two unscaled steps of lr * 1


def test_bf16_gradient_reductions_halve_the_gradient_traffic():
    model, batch = gpt(2, 256, 4, vocab=1024, seq=64, batch=8)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    est = {
        r: autopar.plan(model, batch, cluster, fixed={"dp": 8, "zero": 0}, reduce_dtype=r).estimate
        for r in ("fp32", "bf16")
    }
    reduced = {
        r: sum(c["bytes"] for c in e.collectives if c["kind"] == "all_reduce" and c["axis"] == "dp")
        for r, e in est.items()
    }
    assert reduced["bf16"] == pytest.approx(reduced["fp32"] / 2)
    assert est["bf16"].comm_s < est["fp32"].comm_s
    assert est["bf16"].memory.grads == est["fp32"].memory.grads  # the masters' gradients are fp32 either way
