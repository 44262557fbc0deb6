"""Random ops under a plan: sharded like element-wise ops, drawn from keys (autopar.ops.rng).

One process: the counter-based ("exact") numbers of a shard equal the same
elements of a whole draw, under any micro-batching and with local batches;
every random op autopar draws computes its distribution; random ops get
sharded strategies; a graph sharded on a fake 4-rank process group draws
through ``autopar.random`` with the streams its placements call for; a plan
made at the global batch is carried onto a one-row micro-batch's graph.

Four processes (``-m slow``): GPT-2 with its default dropout trains under
data parallel, Megatron tp, ZeRO-3 and a pipeline exactly as
it trains on one process under ``rng="exact"``; under the default (fast) mode,
the numbers drawn keep 1 - p of a dropout's elements, differ across
data-parallel ranks and agree across tensor-parallel ranks for a replicated
activation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.capture.joint import capture
from autopar.codegen.transfer import same_graph, transfer_placements
from autopar.core.placements import shard as S
from autopar.cost_models.graph_cache import resize_batch
from autopar.ops import rng
from autopar.runtime.launch import launch
from autopar.search.sharding.random_ops import KEYED_KERNELS, RANDOM_OPS, is_random, op_numbers, run_local
from autopar.search.sharding.strategies import enumerate_strategies
from autopar.verify.oracle import (
    check_plans,
    plan_with_layout,
    plan_with_pipeline,
    random_placements,
    shell_plan,
)
from examples.models import gpt2_tiny4_dropout

aten = torch.ops.aten


def _exact(**changes) -> rng.RngState:
    return rng.RngState(mode="exact", seed=7, **changes)


def test_exact_shards_are_the_whole_draws_elements():
    shape = [8, 6, 10]
    for normal in (False, True):
        with rng.using(_exact(batch=8)):
            whole = rng.draw(shape, torch.float32, normal=normal, op=3)
            rows = [rng.draw([4, 6, 10], torch.float32, normal=normal, op=3, global_shape=shape, offset=[4 * i, 0, 0]) for i in range(2)]
            cols = [rng.draw([8, 6, 5], torch.float32, normal=normal, op=3, global_shape=shape, offset=[0, 0, 5 * i]) for i in range(2)]
            other_op = rng.draw(shape, torch.float32, normal=normal, op=4)
        assert torch.equal(torch.cat(rows, 0), whole)
        assert torch.equal(torch.cat(cols, 2), whole)
        assert not torch.equal(other_op, whole)
    with rng.using(_exact(batch=8, step=1)):
        assert not torch.equal(rng.draw(shape, torch.float32, op=3), whole)


def test_exact_numbers_follow_the_global_row_across_microbatches_and_local_batches():
    """A row's numbers are those of its row in the global batch, however the batch was cut."""
    shape = [8, 3, 5]  # batch 8
    with rng.using(_exact(batch=8)):
        whole = rng.draw(shape, torch.float64)
    parts = []
    for k in range(4):  # 4 micro-batches of 2 rows
        with rng.using(_exact(batch=2, microbatch=k, microbatches=4)):
            parts.append(rng.draw([2, 3, 5], torch.float64))
    assert torch.equal(torch.cat(parts), whole)
    # each of 2 data-parallel ranks was given its 4 rows and cuts them into 2 micro-batches of 2;
    # micro-batch k's tensor holds rank 0's k-th pair of rows, then rank 1's
    for k in range(2):
        with rng.using(_exact(batch=4, microbatch=k, microbatches=2, dp_size=2, local_batch=True)):
            got = rng.draw([4, 3, 5], torch.float64)
        want = torch.cat([whole[2 * k : 2 * k + 2], whole[4 + 2 * k : 4 + 2 * k + 2]])
        assert torch.equal(got, want)
    # flattened tokens (rows x sequence on dim 0) follow their rows too
    with rng.using(_exact(batch=8)):
        tokens = rng.draw([8 * 3, 5], torch.float64)
    with rng.using(_exact(batch=2, microbatch=1, microbatches=4)):
        assert torch.equal(rng.draw([2 * 3, 5], torch.float64), tokens[6:12])


@pytest.mark.parametrize("mode", rng.MODES)
def test_numbers_are_uniform_and_normal(mode):
    with rng.using(rng.RngState(mode=mode, seed=3, batch=1)):
        u = rng.draw([200_000], torch.float32)
        z = rng.draw([200_000], torch.float32, normal=True, op=1)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    keep = (u < 0.9).float().mean().item()
    assert abs(keep - 0.9) < 0.01 * 0.9  # dropout p = 0.1 keeps 1 - p, within 1%
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1.0) < 0.01


def test_every_random_op_computes_its_distribution():
    x = torch.zeros(20_000)

    def draw(normal: bool, dtype: torch.dtype) -> torch.Tensor:
        return rng.draw(list(x.shape), dtype, normal=normal)

    def run(op, *args, **kwargs):
        return run_local(op, args, kwargs, draw, op(*args, **kwargs))

    with rng.using(rng.RngState(mode="exact", seed=1, batch=1)):
        out, mask = run(aten.native_dropout.default, x + 1, 0.25, True)
        assert mask.dtype == torch.bool and abs(mask.float().mean() - 0.75) < 0.015
        assert torch.equal(out, mask.float() / 0.75)
        assert abs(run(aten.bernoulli.p, x, 0.3).mean() - 0.3) < 0.015
        assert abs(run(aten.bernoulli.default, x + 0.7).mean() - 0.7) < 0.015
        assert abs(run(aten.exponential.default, x, 2.0).mean() - 0.5) < 0.02
        assert abs(run(aten.normal_functional.default, x, 3.0, 2.0).std() - 2.0) < 0.05
        assert run(aten.geometric.default, x, 0.5).min() >= 1
        u = run(aten.uniform.default, x, -2.0, 2.0)
        assert -2.0 <= u.min() and u.max() < 2.0
        ints = run(aten.randint_like.low_dtype, x.long(), 3, 9)
        assert ints.dtype == torch.int64 and set(ints.unique().tolist()) == set(range(3, 9))
        perm = run(aten.randperm.default, 20_000)
        assert torch.equal(perm.sort().values, torch.arange(20_000))
    assert all(torch.Tag.nondeterministic_seeded in op.tags for op in RANDOM_OPS)


def test_random_ops_shard_with_no_fallback(caplog):
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4_dropout()
    captured = capture(model, inputs)
    with caplog.at_level(logging.WARNING):
        strategies = enumerate_strategies(captured.gm, (2, 2))
    randoms = [n for n in captured.gm.graph.nodes if is_random(n)]
    # attention's dropout is one fused op, as on a GPU (autopar.ops.dropout_attention), not a bernoulli
    assert {str(n.target) for n in randoms} == {
        "aten.native_dropout.default",
        "autopar.dropout_attention.default",
        "autopar.dropout_attention_backward.default",
    }
    for n in randoms:
        assert strategies[n.name].rule == "autopar"
        # batch over dp and features (dropout) or heads (attention) over tp
        assert any(s.outputs[0] in {(S(0), S(1)), (S(0), S(2))} for s in strategies[n.name].strategies)
    assert "no sharding rule" not in caplog.text


# ------------------------------------------------------------- a fake 4-rank process group


@pytest.fixture
def fake_world():
    """A 4-rank process group that only traces (torch's fake backend), this process as rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    yield
    dist.destroy_process_group()


def _sharded(captured, placements):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.codegen.shard import shard_graph

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return shard_graph(captured, placements, mesh)


def test_sharded_graph_draws_the_streams_its_placements_call_for(fake_world):
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4_dropout()
    captured = capture(model, inputs)
    placements = random_placements(captured, (2, 2), seed=3)
    local = _sharded(captured, placements)
    ops = [n.target for n in local.gm.graph.nodes if n.op == "call_function"]
    assert not any(op in RANDOM_OPS for op in ops)
    draws = {n.args[3]: n for n in local.gm.graph.nodes if n.target is torch.ops.autopar.random.default}
    kernels = [n for n in local.gm.graph.nodes if n.target in KEYED_KERNELS]
    elementwise = [n for n in captured.gm.graph.nodes if n.target in RANDOM_OPS]
    attention = [n for n in captured.gm.graph.nodes if n.target in KEYED_KERNELS]
    assert len(draws) == len(elementwise) and len(kernels) == len(attention) == 8
    numbers = op_numbers(captured.gm.graph)
    for node in elementwise:
        spec = placements[node.name]["outputs"][0]
        shape, _, _, _, whole, offset, stream, _ = draws[numbers[node.name]].args
        assert list(whole) == list(node.meta["val"][0].shape)  # native_dropout: (output, mask)
        # rank 0 sits at coordinate (0, 0): stream 0 where the output is sharded, -1 where it is whole
        assert stream == [0 if p.is_shard() else -1 for p in spec]
        assert math.prod(shape) * math.prod(2 for p in spec if p.is_shard()) == math.prod(whole)
    forward_numbers = sorted(numbers[n.name] for n in attention if n.target is torch.ops.autopar.dropout_attention.default)
    # each backward kernel draws with its forward's key: the numbers come in pairs
    assert sorted(n.args[-4] for n in kernels) == sorted(forward_numbers * 2)
    for n in kernels:
        assert len(n.args[-3]) == 4 and n.args[-1] in ([0, 0], [0, -1], [-1, 0], [-1, -1])


def test_a_plan_made_at_the_global_batch_runs_on_one_row_microbatches(fake_world):
    """The graph of a one-row micro-batch drops ops a size-1 dim makes trivial: names shift, placements follow."""
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4_dropout()
    big = capture(model, inputs)
    one = capture(model, resize_batch(inputs, 1))
    placements = random_placements(big, (2, 2), seed=5)
    for e, n in zip(placements.values(), big.gm.graph.nodes, strict=False):
        e["module"] = n.meta.get("autopar_module", "")
    assert not same_graph(placements, one)
    moved, names = transfer_placements(placements, one, (2, 2))
    nodes = [n for n in one.gm.graph.nodes if n.op != "output"]
    assert list(moved) == [n.name for n in nodes]
    assert len(names) > 0.9 * len(nodes)
    assert all(names[p.placeholder] == p.placeholder for p in big.params)
    _sharded(one, moved)  # every entry fits its node: the graph shards and traces


# ------------------------------------------------------------- four processes


class NoisyMLP(torch.nn.Module):
    """Random ops as models write them by hand: a ``torch.rand`` factory, ``randn_like``, in-place ``bernoulli_``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        keep = (torch.rand(h.shape[0], 1) < 0.75).to(h.dtype)  # stochastic depth: one draw per row
        h = h * keep / 0.75 + 0.1 * torch.randn_like(h)
        h = torch.nn.functional.gelu(h) * torch.empty_like(h).bernoulli_(0.9)
        return torch.nn.functional.mse_loss(self.down(h), y)


def noisy_mlp():
    return NoisyMLP(), (torch.randn(8, 16), torch.randn(8, 16))


@functools.cache
def _plans() -> dict[str, autopar.Plan]:
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4_dropout()
    four = autopar.Cluster.local(4)
    base = autopar.plan(model, inputs, four, precision="fp32", fixed={"dp": 4, "tp": 1, "pp": 1})
    tp = dataclasses.replace(base, mesh={"dp": 2, "tp": 2, "pp": 1})
    return {
        "zero3": plan_with_layout(base, model, inputs, four, "zero3"),
        "megatron": plan_with_layout(tp, model, inputs, four, "megatron"),
        "pp2 x dp2": plan_with_pipeline(base, model, inputs, four, 2, microbatches=4),
    }


@pytest.mark.slow
def test_plans_under_exact_rng_train_like_one_process():
    """Data parallel (with ZeRO-3 on dp 4), Megatron tp, a pipeline pp 2 x dp 2 of one-row micro-batches, and
    random layouts of a small noisy MLP.

    The searched plan of a GPT-2 with dropout under rng="exact" is trained by tests/test_families.py ("gpt2
    searched": today dp 2 x pp 2, 1F1B over 4 one-row micro-batches, the plan made at the global batch and
    carried onto the micro-batch's graph, :mod:`autopar.codegen.transfer`)."""
    four = autopar.Cluster.local(4)
    cases = [(gpt2_tiny4_dropout, p) for p in _plans().values()]
    torch.manual_seed(0)
    model, inputs = noisy_mlp()
    base = shell_plan(model, inputs, four, 2, 2)
    cases += [(noisy_mlp, plan_with_layout(base, model, inputs, four, "random", seed=s)) for s in range(2)]
    checks = check_plans(cases, four, rng="exact")
    names = [*_plans(), "noisy MLP, random layout 0", "noisy MLP, random layout 1"]
    for name, (_, plan), check in zip(names, cases, checks, strict=True):
        assert check.ok(1e-5), f"{name} ({plan.mesh}): {check}"


class _Draws(TorchDispatchMode):
    """Records every ``autopar.random`` call: (op number, stream, numbers drawn)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, list[int], torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.autopar.random.default:
            self.seen.append((args[3], list(args[6]), out.clone()))
        return out


def _fast_draws(cluster, plan_dict):
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4_dropout()
    pm = autopar.parallelize(model, cluster, inputs, plan=autopar.Plan.from_dict(plan_dict))
    with _Draws() as draws:
        loss = pm.train_step(inputs)
    return pm.mesh.get_coordinate(), draws.seen, float(loss)


@pytest.mark.slow
def test_fast_rng_keeps_1_minus_p_differs_over_dp_and_agrees_over_tp_for_replicated_values():
    four = autopar.Cluster.local(4)
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4_dropout()
    # a random layout on dp 2 x tp 2: activations split over dp, over tp, over both and over neither (each op's
    # strategy drawn among those that take its inputs as they come: as varied for the draws, cheaper to trace)
    plan = plan_with_layout(_plans()["megatron"], model, inputs, four, "flowing", seed=1)
    runs = launch(_fast_draws, four, four, plan.to_dict(), crash_retries=1)
    assert len({loss for _, _, loss in runs}) == 1 and math.isfinite(runs[0][2])
    kept = total = 0
    kinds = {"split over dp": 0, "whole over tp": 0, "split over tp": 0}
    by_coord = {tuple(coord): {op: (stream, u) for op, stream, u in seen} for coord, seen, _ in runs}
    for (dp, tp), draws in by_coord.items():
        for op, (stream, u) in draws.items():
            kept += int((u < 0.9).sum())
            total += u.numel()
            other_dp = by_coord[(1 - dp, tp)][op][1]
            other_tp = by_coord[(dp, 1 - tp)][op][1]
            assert other_dp.shape == u.shape and other_tp.shape == u.shape
            # a value split over an axis draws its own numbers per rank; a value whole over it, the same
            assert stream[0] in (dp, -1) and stream[1] in (tp, -1)
            assert torch.equal(other_dp, u) == (stream[0] == -1), (op, stream)
            assert torch.equal(other_tp, u) == (stream[1] == -1), (op, stream)
            kinds["split over dp"] += stream[0] == dp
            kinds["whole over tp"] += stream[1] == -1
            kinds["split over tp"] += stream[1] == tp
    assert all(kinds.values()), kinds  # the layout has activations of every kind
    assert abs(kept / total - 0.9) < 0.01 * 0.9
