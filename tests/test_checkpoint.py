"""Checkpoints round-trip across plans and one device, every weight and optimizer value bit for bit.

One launch of 4 gloo processes resumes a chain of checkpoints: the first is
written by one device after 2 AdamW steps; each plan loads the previous
checkpoint into a model with other weights and an optimizer with another
learning rate (one with state of its own already), takes a step and saves.
The parent then loads every checkpoint on one device.  Checked, with
``torch.equal``: what each plan loaded is what the writer held (weights,
optimizer state, hyperparameters), and what one device loads of each plan's
checkpoint is what that plan held; with the oracle's tolerance: the step
after a load is the step one device takes from the same checkpoint.

Chains: GPT-2 through Megatron dp × tp → ZeRO-3 (tied weights, HF modules)
→ pipeline pp2 × tp2 (the tied embedding untied across the two stages, one
copy each) → pipeline pp2 × dp2 with ZeRO-1 (each stage's chunks),
and an MLP whose sizes do not divide by the data-parallel size through data
parallel → ZeRO-2 (chunks padded, rows cut mid-way) → Megatron dp × tp with
ZeRO-1 (chunks of tensor-parallel shards).  About 45 s, most of it starting
4 processes and generating the GPT-2 graphs; the fast tests below cover the
boxes of a ZeRO chunk, a one-device round trip and the error messages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.capture.joint import model_loss
from autopar.core.placements import REPLICATE as R
from autopar.plans.plan import Plan
from autopar.runtime.checkpoint import full_optimizer_state, load_single, save_single
from autopar.runtime.checkpoint_chunks import FlatChunk, LoadPlanner, SavePlanner, flat_range_boxes
from autopar.verify.oracle import group_error, plan_with_layout, plan_with_pipeline, shell_plan
from examples.models import MLP, gpt2_tiny, mlp_tiny

LR = 1e-3
TOL = 1e-5


class OddMLP(torch.nn.Module):
    """30 → 126 → 30, named as Megatron knows (up_proj column-, down_proj row-parallel).

    Its biases and rows do not divide by the data-parallel size: ZeRO chunks
    are padded and cut rows mid-way.
    """

    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(30, 126)
        self.down_proj = torch.nn.Linear(126, 30)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.up_proj(x))
        return torch.nn.functional.mse_loss(self.down_proj(hidden), target)


def odd_mlp():
    return OddMLP(), (torch.randn(8, 30), torch.randn(8, 30))


def _model(factory, seed: int):
    """The factory's model with weights from ``seed`` and the batch of seed 0 (the same batch everywhere)."""
    torch.manual_seed(0)
    _, batch = factory()
    torch.manual_seed(seed)
    model, _ = factory()
    return model, batch


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _hyper(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _single_state(model, opt) -> tuple:
    return _weights(model), full_optimizer_state(model, opt), _hyper(opt)


def _parallel_state(pm, opt, names) -> tuple:
    full = pm.full_state_dict()
    return {n: full[n] for n in names}, full_optimizer_state(pm, opt), _hyper(opt)


# ---------------------------------------------------------------- 4 processes


def _resume(factory, cluster, plan: dict, src: str, dst: str, own_state: bool) -> tuple | None:
    model, batch = _model(factory, seed=1)  # other weights than any checkpoint's: the load must replace them
    names = list(_weights(model))
    pm = autopar.parallelize(model, cluster, batch, plan=Plan.from_dict(plan))
    opt = pm.make_optimizer(torch.optim.AdamW, lr=10 * LR)  # the checkpoint's lr must win
    if own_state:  # state of its own that the load must replace
        pm.train_step(batch)
        opt.step()
        opt.zero_grad()
    pm.load(src, opt)
    loaded = _parallel_state(pm, opt, names)
    pm.train_step(batch)
    opt.step()
    opt.zero_grad()
    pm.save(dst, opt)
    stepped = _parallel_state(pm, opt, names)
    specs = [pm._specs[i] for i in pm._params] if hasattr(pm, "_params") else pm._param_specs  # pipeline or not
    layout = (set(pm.zero_stages), {s[0].is_shard() for s in specs})  # ZeRO-1/2 stages, whether dp shards
    return (loaded, stepped, layout) if dist.get_rank() == 0 else None


def _chains(cluster, chains: list) -> list[list]:
    return [[_resume(factory, cluster, *step) for step in steps] for factory, steps in chains]


def _train_single(factory, path: str) -> tuple:
    """2 AdamW steps on one device, saved to ``path``."""
    model, batch = _model(factory, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(2):
        model_loss(model, batch, None).backward()
        opt.step()
        opt.zero_grad()
    save_single(model, path, opt)
    return _single_state(model, opt)


def _load_and_step_single(factory, path: str) -> tuple[tuple, tuple]:
    model, batch = _model(factory, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=10 * LR)
    load_single(model, path, opt)
    loaded = _single_state(model, opt)
    model_loss(model, batch, None).backward()
    opt.step()
    return loaded, _single_state(model, opt)


def _assert_equal(ours: tuple, ref: tuple, what: str) -> None:
    (w, o, h), (rw, ro, rh) = ours, ref
    assert w.keys() == rw.keys() and o.keys() == ro.keys(), what
    bad = [n for n in rw if not torch.equal(w[n], rw[n])]
    bad += [
        f"{n}.{k}"
        for n in ro
        for k in ro[n]
        if o[n].keys() != ro[n].keys() or not torch.equal(o[n][k], ro[n][k])
    ]
    assert not bad, f"{what}: not bit for bit: {bad[:5]}"
    assert h == rh, what


def _assert_close(ours: tuple, ref: tuple, what: str) -> None:
    err, worst = group_error(ours[0], ref[0])
    assert err <= TOL, f"{what}: weights {err:.1e} ({worst})"
    for key in ("exp_avg", "exp_avg_sq"):
        err, worst = group_error(
            {n: s[key] for n, s in ours[1].items()}, {n: s[key] for n, s in ref[1].items()}
        )
        assert err <= TOL, f"{what}: {key} {err:.1e} ({worst})"
    assert all(torch.equal(ours[1][n]["step"], ref[1][n]["step"]) for n in ref[1])


def _layouts(factory, meshes: list[tuple[int, int]]) -> dict[tuple[int, int], functools.partial]:
    """For each (dp, tp) mesh: ``layout(kind)`` gives the factory's plan there with that hand-set layout."""
    torch.manual_seed(0)
    model, batch = factory()
    cluster = autopar.Cluster.local(4)
    out = {}
    for dp, tp in meshes:
        base = shell_plan(model, batch, cluster, dp, tp)
        out[dp, tp] = functools.partial(plan_with_layout, base, model, batch, cluster)
    return out


def _zero(plan: Plan, stage: int) -> Plan:
    """``plan`` with ZeRO-``stage`` for every parameter (a parameter's own ``"zero"`` overrides the plan's)."""
    placements = {k: {**e, "zero": stage} if "param" in e else e for k, e in plan.placements.items()}
    return dataclasses.replace(plan, zero=stage, placements=placements)


def _pipeline(factory, tp: int, layout: str) -> Plan:
    """The factory's model on pp = 2 (1F1B, 2 micro-batches) with the hand-set ``layout`` on each stage."""
    torch.manual_seed(0)
    model, batch = factory()
    cluster = autopar.Cluster.local(4)
    base = shell_plan(model, batch, cluster, 4 // tp, tp)
    return plan_with_pipeline(base, model, batch, cluster, 2, microbatches=2, layout=layout)


def _gpt2_plans() -> list[tuple[str, Plan, bool]]:
    """(name, plan, whether the optimizer has state of its own before the load)."""
    layout = _layouts(gpt2_tiny, [(4, 1), (2, 2)])
    return [
        ("Megatron dp x tp", _zero(layout[2, 2]("megatron"), 0), False),
        ("ZeRO-3", _zero(layout[4, 1]("zero3"), 3), True),
        ("pipeline pp2 x tp2", _zero(_pipeline(gpt2_tiny, 2, "megatron"), 0), False),
        ("pipeline pp2 x dp2, ZeRO-1", _zero(_pipeline(gpt2_tiny, 1, "dp"), 1), True),
    ]


def _mlp_plans() -> list[tuple[str, Plan, bool]]:
    layout = _layouts(odd_mlp, [(4, 1), (2, 2)])
    dp = _zero(layout[4, 1]("dp"), 0)
    return [
        ("MLP data parallel", dp, False),
        ("MLP ZeRO-2 (padded chunks)", _zero(dp, 2), True),
        ("MLP Megatron dp x tp, ZeRO-1", _zero(layout[2, 2]("megatron"), 1), False),
    ]


@pytest.mark.slow
def test_checkpoints_round_trip_across_plans_and_one_device_bit_for_bit(tmp_path):
    cluster = autopar.Cluster.local(4)
    chains, named = [], []
    for factory, plans in [(gpt2_tiny, _gpt2_plans()), (odd_mlp, _mlp_plans())]:
        dirs = [str(tmp_path / f"{factory.__name__}-{k}") for k in range(len(plans) + 1)]
        first = _train_single(factory, dirs[0])
        steps = [(p.to_dict(), dirs[k], dirs[k + 1], own) for k, (_, p, own) in enumerate(plans)]
        chains.append((factory, steps))
        named.append((factory, plans, dirs, first))
    results = autopar.launch(_chains, cluster, cluster, chains, crash_retries=1)[0]

    for (factory, plans, dirs, first), chain in zip(named, results, strict=True):
        writer, held = "one device", first
        for k, ((name, plan, _), (loaded, stepped, layout)) in enumerate(zip(plans, chain, strict=True)):
            stages, dp_shards = layout
            assert stages == {plan.zero if plan.zero in (1, 2) else 0}, (name, stages)
            assert (True in dp_shards) == (plan.zero == 3), (name, dp_shards)
            _assert_equal(loaded, held, f"{name} loading what {writer} saved")
            single_loaded, single_stepped = _load_and_step_single(factory, dirs[k])
            _assert_equal(single_loaded, held, f"one device loading what {writer} saved")
            _assert_close(stepped, single_stepped, f"the step after {name} loaded")
            writer, held = name, stepped
        single_loaded, _ = _load_and_step_single(factory, dirs[-1])
        _assert_equal(single_loaded, held, f"one device loading what {writer} saved")


# ---------------------------------------------------------------- one process


def test_flat_ranges_become_boxes_in_flat_order():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        whole = torch.arange(numel).view(shape)
        boxes = flat_range_boxes(shape, start, stop)
        got = [
            whole[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1)
            for off, size in boxes
        ]
        assert torch.equal(
            torch.cat(got) if got else torch.empty(0, dtype=torch.long), torch.arange(start, stop)
        )
        assert len(boxes) <= max(2 * len(shape) - 1, 1)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_zero_chunk_writes_and_reads_only_its_boxes(tmp_path):
    """Rank 2 of 4 holds elements 54..80 of a (5, 7, 3) tensor (27 each, padded): rows cut mid-way."""
    import torch.distributed.checkpoint as dcp

    whole = torch.arange(105, dtype=torch.float32).view(5, 7, 3)
    dcp.save({"t": whole}, checkpoint_id=str(tmp_path / "whole"), no_dist=True)
    n = math.ceil(105 / 4)
    for rank in range(4):
        start, stop = min(rank * n, 105), min((rank + 1) * n, 105)
        chunk = FlatChunk(torch.full((n,), -1.0), (5, 7, 3), (0, 0, 0), (5, 7, 3), start, stop)
        dcp.load({"t": chunk}, checkpoint_id=str(tmp_path / "whole"), planner=LoadPlanner(), no_dist=True)
        expected = torch.nn.functional.pad(whole.reshape(-1)[start:stop], (0, n - (stop - start)), value=-1.0)
        assert torch.equal(chunk.chunk, expected), rank
    # what one rank writes: its boxes only, the rest of the tensor untouched on load
    chunk = FlatChunk(torch.arange(54.0, 81.0), (5, 7, 3), (0, 0, 0), (5, 7, 3), 54, 81)
    dcp.save({"t": chunk}, checkpoint_id=str(tmp_path / "rank2"), planner=SavePlanner(), no_dist=True)
    back = torch.full((5, 7, 3), -1.0)
    dcp.load({"t": back}, checkpoint_id=str(tmp_path / "rank2"), no_dist=True)
    flat = back.reshape(-1)
    assert (
        torch.equal(flat[54:81], torch.arange(54.0, 81.0))
        and (flat[:54] == -1).all()
        and (flat[81:] == -1).all()
    )


def _trained(factory, seed: int, steps: int, lr: float = LR):
    model, batch = _model(factory, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        model_loss(model, batch, None).backward()
        opt.step()
        opt.zero_grad()
    return model, batch, opt


def test_one_device_round_trip_is_bit_for_bit(tmp_path):
    model, batch, opt = _trained(gpt2_tiny, 0, 2)  # GPT-2 ties lm_head to wte: saved once
    save_single(model, tmp_path, opt)
    other, _, other_opt = _trained(gpt2_tiny, 1, 1, lr=10 * LR)  # state and weights of its own
    load_single(other, tmp_path, other_opt)
    _assert_equal(_single_state(other, other_opt), _single_state(model, opt), "one device")
    assert other.lm_head.weight is other.transformer.wte.weight
    for m, o in [(model, opt), (other, other_opt)]:
        model_loss(m, batch, None).backward()
        o.step()
    _assert_equal(_single_state(other, other_opt), _single_state(model, opt), "the step after")


def test_a_weight_held_twice_on_one_rank_is_saved_once_and_loaded_into_both(tmp_path):
    """Two copies of one weight on a rank (a tie across two of its pipeline stages): one entry; each copy
    loads it, and each keeps optimizer state of its own (an aliased state would be stepped twice)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.capture.joint import TensorInfo
    from autopar.runtime.checkpoint import load_layout, save_layout, sharded_layout

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        w, v = TensorInfo("w", "w", (4, 3), torch.float32), TensorInfo("v", "v", (5,), torch.float32)

        def rank(seed: int, lr: float, steps: int):
            torch.manual_seed(seed)
            a = torch.nn.Parameter(torch.randn(4, 3))
            b, c = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(torch.randn(5))
            opt = torch.optim.AdamW([a, c, b], lr=lr)
            for _ in range(steps):
                grad = torch.randn(4, 3)
                a.grad, b.grad, c.grad = grad, grad.clone(), torch.randn(5)
                opt.step()
            held = [(w, a, (R, R), 0), (v, c, (R, R), 1), (w, b, (R, R), 2)]
            return (a, b, c), opt, sharded_layout(mesh, held, None, [w, v, w])

        (a, _, c), opt, layout = rank(0, LR, 2)
        assert [x.name for x in layout.weights] == ["w", "v"] and len(layout.copies) == 1
        save_layout(layout, tmp_path, opt, "test")
        (a2, b2, c2), opt2, layout2 = rank(1, 10 * LR, 1)
        load_layout(layout2, tmp_path, opt2)
        assert torch.equal(a2, a) and torch.equal(b2, a) and torch.equal(c2, c)
        assert opt2.param_groups[0]["lr"] == LR
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt2.state[b2][key], opt.state[a][key])
            assert opt2.state[b2][key] is not opt2.state[a2][key]
        grad = torch.randn(4, 3)
        a2.grad, b2.grad, c2.grad = grad, grad.clone(), torch.zeros(5)
        opt2.step()
        assert torch.equal(a2, b2)
    finally:
        dist.destroy_process_group()


def test_bad_checkpoints_are_one_line_errors(tmp_path):
    model, _, opt = _trained(mlp_tiny, 0, 1)
    save_single(model, tmp_path / "mlp", opt)
    save_single(model, tmp_path / "weights")
    (tmp_path / "empty").mkdir()

    def refused(path, match, target=model, optimizer=None):
        with pytest.raises(autopar.CheckpointError, match=match) as err:
            load_single(target, tmp_path / path, optimizer)
        assert "\n" not in str(err.value)

    refused("nowhere", "no checkpoint at .*nowhere: the directory does not exist")
    refused("empty", "is not a checkpoint .*no .metadata")
    refused("mlp", r"different model: it has no 'transformer\.wte\.weight' \(and \d+ more\)", gpt2_tiny()[0])
    refused("mlp", r"holds 'up\.weight' as \(128, 32\) but this model's is \(64, 32\)", MLP(32, 64))
    refused("weights", "holds no optimizer state .*load it with optimizer=None", optimizer=opt)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    refused("mlp", "holds AdamW state but the optimizer is SGD", optimizer=sgd)
    stranger = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    refused(
        "mlp", r"steps a tensor of shape \(3,\) that is not a parameter of this model", optimizer=stranger
    )
    with pytest.raises(autopar.CheckpointError, match="it is a file"):
        save_single(model, tmp_path / "mlp" / ".metadata")
