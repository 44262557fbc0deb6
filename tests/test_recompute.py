"""Recompute at run time (autopar/search/sharding/recompute.py).

One process: the analysis helpers, the structure of the transformed graph
(clones before the first backward use, originals dead after the forward),
the guard against marks that cannot be honoured, and the transformed joint
graph run on real tensors giving bit-identical loss and gradients.

Several processes (slow): GPT-2 and LLaMA tiny under data-parallel (with
ZeRO-2) and Megatron dp x tp plans with selective and full recompute train
like one device (3 AdamW steps, relative L2 error 1e-5), one launch of 2 processes
and one of 4; the launches also train the planner's own plans of
``fixed={"recompute": "selective" | "full"}`` (tp = 2 with 2 micro-batches, a
2-stage pipeline, a pipeline with ZeRO-3 over dp = 2) and of ``"op-sac"``
(torchtitan's per-op checkpointing under ZeRO-3), and the 2-process launch
measures a step's peak memory with recompute off and full.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.capture.joint import capture, input_tensors, node_phase
from autopar.core.errors import PlanError
from autopar.plans.plan import Plan
from autopar.runtime.launch import launch
from autopar.search.sharding.random_ops import op_numbers
from autopar.search.sharding.recompute import (
    apply_recompute,
    can_recompute,
    full_recompute_nodes,
    layer_of,
    layer_outputs,
    recompute_layers,
    recomputed,
    saved_activations,
    with_recompute,
)
from autopar.verify.oracle import _compare, _rank_run_all, layout_plan, single_device_run
from examples.models import gpt, gpt2_tiny, gpt2_tiny4, llama_tiny

TOL = 1e-5
aten = torch.ops.aten
# Not worth replaying: matmuls, attention and lookups (what selective recompute keeps, as Megatron's does)
HEAVY = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.embedding.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


@functools.cache
def _captured(factory):
    """``(model, inputs, captured)``, shared by the tests: none of them changes any of the three."""
    torch.manual_seed(0)
    model, inputs = factory()
    return model, inputs, capture(model, inputs)


def cheap_saved(captured) -> list[str]:
    """Saved activations of cheap ops (element-wise, norms, softmax, views): the selective set of the tests."""
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    out = []
    for name in saved_activations(captured.gm):
        n = nodes[name]
        op = n.args[0].target if n.target is operator.getitem else n.target
        if op not in HEAVY and can_recompute(n):
            out.append(name)
    return out


def _blank(captured) -> dict[str, dict]:
    return {n.name: {"outputs": [], "inputs": []} for n in captured.gm.graph.nodes if n.op != "output"}


def _real_args(model, inputs, captured) -> list[torch.Tensor]:
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return [
        *(state[p.name].detach() for p in captured.params),
        *(state[b.name].detach() for b in captured.buffers),
        *input_tensors(model, inputs),
    ]


def _order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


# ---------------------------------------------------------------- analysis


def test_layers_are_the_numbered_blocks():
    assert layer_of("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert layer_of("model.layers.12") == "model.layers.12"
    assert layer_of("transformer.ln_f") is None and layer_of("") is None
    for factory, prefix in [(gpt2_tiny, "transformer.h"), (llama_tiny, "model.layers")]:
        _, _, c = _captured(factory)
        layers = recompute_layers(c)
        assert list(layers) == [f"{prefix}.0", f"{prefix}.1"]
        nodes = {n.name: n for n in c.gm.graph.nodes}
        for layer, names in layers.items():
            assert all(node_phase(nodes[n]) == "forward" for n in names)
            # the residual stream leaves each layer through one add; the last one feeds the final norm
            (out,) = layer_outputs(c, layer)
            assert nodes[out].target is aten.add.Tensor
            full = full_recompute_nodes(c, layer)
            assert out not in full and set(full) <= set(names) and len(full) >= len(names) - 2


def test_saved_activations_are_forward_values_the_backward_reads():
    _, _, c = _captured(gpt2_tiny)
    nodes = {n.name: n for n in c.gm.graph.nodes}
    saved = saved_activations(c.gm)
    assert saved and saved == saved_activations(c)
    for name in saved:
        assert node_phase(nodes[name]) == "forward"
        assert any(node_phase(u) == "backward" and u.op != "output" for u in nodes[name].users)


def test_only_ops_that_give_the_same_value_again_are_replayed():
    g = fx.Graph()
    x = g.placeholder("x")
    ops = {
        "poisson": g.call_function(aten.poisson.default, (x,)),
        "multinomial": g.call_function(aten.multinomial.default, (x, 2)),
        "inplace": g.call_function(aten.add_.Tensor, (x, x)),
        "collective": g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0")),
        "attention_with_dropout": g.call_function(
            aten._scaled_dot_product_flash_attention_for_cpu.default, (x, x, x, 0.1)
        ),
    }
    for name, node in ops.items():
        assert not can_recompute(node), name
    assert not can_recompute(x)
    lse = g.call_function(operator.getitem, (ops["attention_with_dropout"], 1))
    assert not can_recompute(lse)  # a getitem is replayed with the op it unpacks
    dropout = g.call_function(aten.native_dropout.default, (x, 0.5, True))
    for node in [
        # random ops autopar draws from a key (random_ops): a replay draws the same numbers
        dropout,
        g.call_function(operator.getitem, (dropout, 1)),
        g.call_function(aten.rand_like.default, (x,)),
        g.call_function(aten.bernoulli.default, (x,)),
        g.call_function(aten.gelu.default, (x,)),
        g.call_function(aten.view.default, (x, [-1])),
        g.call_function(aten.native_layer_norm.default, (x, [4], None, None, 1e-5)),
        g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (x, x, x)),
    ]:
        assert can_recompute(node), node.target


# ---------------------------------------------------------------- the pass


def test_a_plan_without_marks_comes_back_unchanged():
    _, _, c = _captured(gpt2_tiny)
    placements = _blank(c)
    out, pl = apply_recompute(c, placements)
    assert out is c and pl is placements


def _dead(node: fx.Node) -> bool:
    """Nothing reads ``node``, or only other nodes nothing reads."""
    return all(_dead(u) for u in node.users)


def _check_structure(c, c2, placements, pl2) -> dict[str, str]:
    clones = recomputed(c2)
    assert clones
    order = _order(c2.gm)
    nodes = {n.name: n for n in c2.gm.graph.nodes}
    for clone, orig in clones.items():
        cn, on = nodes[clone], nodes[orig]
        assert cn.meta["autopar_phase"] == "backward" and cn.op == on.op and cn.target == on.target
        assert cn.meta["autopar_module"] == on.meta["autopar_module"] and cn.meta["val"] is on.meta["val"]
        # the original dies in the forward: no backward node reads it any more (a saved-tensor handle
        # of it, traced in the forward, is left without users: its clone is read instead)
        assert all(node_phase(u) == "forward" or u.op == "output" or _dead(u) for u in on.users), orig
        if node_phase(on) == "forward":  # else a handle on a saved value, cloned after its value's clone
            last_fwd = max((order[u] for u in on.users if node_phase(u) == "forward"), default=order[on])
            assert last_fwd < order[cn]
        assert cn.users and all(order[cn] < order[u] for u in cn.users)  # before its first backward use
        want = {k: v for k, v in placements[orig].items() if k != "recompute"}
        assert pl2[clone] == want and pl2[orig] == placements[orig]
    # the input graph is untouched; names of everything else are kept
    assert not recomputed(c) and len(c.gm.graph.nodes) + len(clones) == len(c2.gm.graph.nodes)
    assert [n.name for n in c.gm.graph.nodes] == [n.name for n in c2.gm.graph.nodes if n.name not in clones]
    assert (c2.params, c2.buffers, c2.inputs, c2.grads, c2.loss) == (
        c.params,
        c.buffers,
        c.inputs,
        c.grads,
        c.loss,
    )
    return clones


@pytest.mark.parametrize("factory", [gpt2_tiny, llama_tiny])
def test_recomputed_graph_gives_the_same_loss_and_gradients_bit_for_bit(factory):
    model, inputs, c = _captured(factory)
    args = _real_args(model, inputs, c)
    with torch.no_grad():
        ref = c.gm(*args)
    layers = list(recompute_layers(c))
    mixed = with_recompute(_blank(c), cheap_saved(c), layers[:1], c)  # layer 0 full, the rest selective
    for placements in [
        with_recompute(_blank(c), cheap_saved(c)),
        with_recompute(_blank(c), (), layers, c),
        mixed,
    ]:
        c2, pl2 = apply_recompute(c, placements)
        _check_structure(c, c2, placements, pl2)
        with torch.no_grad():
            out = c2.gm(*args)
        assert len(out) == len(ref)
        for a, b in zip(out, ref, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_full_recompute_replays_the_layer_in_forward_order_before_its_first_backward_use():
    _, _, c = _captured(gpt2_tiny)
    layers = recompute_layers(c)
    placements = with_recompute(_blank(c), (), ["transformer.h.1"], c)
    c2, pl2 = _apply_checked(c, placements)
    clones = recomputed(c2)
    nodes = list(c2.gm.graph.nodes)
    order = _order(c2.gm)
    positions = sorted(order[n] for n in nodes if n.name in clones)
    assert positions == list(range(positions[0], positions[0] + len(positions)))  # one block
    originals = [clones[nodes[i].name] for i in positions]
    handles = [o for o in originals if o.startswith("detach")]  # autograd's handles on saved tanh, attention
    assert handles
    originals = [o for o in originals if o not in handles]
    assert originals == [n for n in layers["transformer.h.1"] if n in set(originals)]  # forward order
    assert set(originals) <= set(full_recompute_nodes(c, "transformer.h.1"))
    assert "add_11" not in originals  # the layer's output is kept
    first_backward_use = min(
        order[u] for n in nodes if n.name in clones for u in n.users if u.name not in clones
    )
    assert first_backward_use == positions[-1] + 1
    assert all(layer_of(n.meta["autopar_module"]) == "transformer.h.1" for n in nodes if n.name in clones)


def _apply_checked(c, placements):
    c2, pl2 = apply_recompute(c, placements)
    _check_structure(c, c2, placements, pl2)
    return c2, pl2


class _PoissonNoise(torch.nn.Module):
    """Multiplies by Poisson noise: a random op autopar does not draw itself (random_ops), so no replay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.poisson(torch.ones_like(x))


def test_marks_that_cannot_be_honoured_are_refused_in_one_line():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _PoissonNoise(), torch.nn.Linear(8, 1))
    c = capture(model, torch.randn(4, 8), loss_fn=lambda out: out.sum())
    nodes = {n.name: n for n in c.gm.graph.nodes}
    noise = next(n for n in nodes.values() if n.target is aten.poisson.default)
    backward = next(n for n in nodes.values() if n.meta["autopar_phase"] == "backward" and n.op != "output")
    # nn.Sequential numbers its children: each of them is a layer; the loss is outside them
    forward = next(
        n for n in nodes.values() if n.meta["autopar_phase"] == "forward" and n.meta["autopar_module"] == ""
    )
    assert set(recompute_layers(c)) == {"0", "1", "2"}
    base = _blank(c)
    cases = [
        (noise.name, "selective", "draws random numbers"),
        (c.params[0].placeholder, "selective", "not a forward node .phase 'input'"),
        (backward.name, "selective", "not a forward node .phase 'backward'"),
        (forward.name, "full", "in no numbered layer"),
        (forward.name, "sometimes", "the settings are"),
    ]
    for name, how, message in cases:
        placements = {**base, name: {**base[name], "recompute": how}}
        with pytest.raises(PlanError, match=message) as err:
            apply_recompute(c, placements)
            pytest.fail(f"{name} marked {how} was accepted")
        assert name in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PlanError, match="not a node of the graph"):
        apply_recompute(c, {"nowhere": {"recompute": "selective"}})


def test_dropout_is_replayed_with_its_mask_and_keyed_to_the_forward_draw():
    """autopar draws dropout's numbers from a key (autopar.ops.rng), so a replay draws the forward's mask."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    c = capture(model, torch.randn(4, 8), loss_fn=lambda out: out.sum())
    dropout = next(n for n in c.gm.graph.nodes if n.target is aten.native_dropout.default)
    assert can_recompute(dropout)
    placements = {**_blank(c), dropout.name: {**_blank(c)[dropout.name], "recompute": "selective"}}
    c2, _ = _apply_checked(c, placements)
    clones = [n for n in c2.gm.graph.nodes if n.meta.get("autopar_recompute_of") == dropout.name]
    assert [n.target for n in clones] == [aten.native_dropout.default]
    numbers = op_numbers(c2.gm.graph)
    assert numbers[clones[0].name] == numbers[dropout.name]


# ---------------------------------------------------------------- several processes


def gpt2_wide():
    """GPT-2 tiny's layers on a longer sequence and a bigger batch: activations outweigh the model states."""
    return gpt(2, 64, 4, vocab=128, seq=64, batch=16, device="cpu", dropout=0.0)  # the eager oracle draws other masks


def _layout(factory, n: int, dp: int, tp: int, layout: str) -> Plan:
    """A hand-set layout on a dp x tp mesh of ``n`` processes, laid on a plan made without a search."""
    torch.manual_seed(0)
    model, inputs = factory()
    return layout_plan(model, inputs, autopar.Cluster.local(n), dp, tp, layout)


def _recompute(plan: Plan, factory, how: str) -> Plan:
    """``plan`` with recompute: "selective" on every cheap saved activation, "full" on every layer, or
    "mixed": layer 0 full and selective elsewhere."""
    c = _captured(factory)[2]
    layers = list(recompute_layers(c))
    selective = cheap_saved(c) if how in ("selective", "mixed") else []
    full = layers if how == "full" else layers[:1] if how == "mixed" else []
    placements = with_recompute(plan.placements, selective, full, c)
    assert sum("recompute" in e for e in placements.values()) > 10
    return dataclasses.replace(
        plan, placements=placements, solver=dataclasses.replace(plan.solver, status=f"recompute {how}")
    )


def _zero(plan: Plan, stage: int) -> Plan:
    """``plan`` under ZeRO ``stage``: gradients leave the graph as chunks, beside the replayed nodes.

    Per-parameter stages 0-2 in the placements override the plan's: they are dropped.
    """
    placements = {
        k: {kk: v for kk, v in e.items() if not (kk == "zero" and v in (0, 1, 2))} for k, e in plan.placements.items()
    }
    return dataclasses.replace(plan, zero=stage, placements=placements)


def _searched(factory, fraction: float) -> Plan:
    """The MILP's plan on 2 processes (dp 2) with ``fraction`` of the memory the roomy plan needs."""
    torch.manual_seed(0)
    model, inputs = factory()
    two, fixed = autopar.Cluster.local(2), {"dp": 2, "zero": 0}
    roomy = autopar.plan(model, inputs, two, fixed=fixed, precision="fp32")
    limit = fraction * roomy.estimate.memory.peak
    plan = autopar.plan(model, inputs, two, fixed=fixed, precision="fp32", memory_limit=limit)
    assert plan.recompute == "op-level" and plan.microbatches == 1
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, status="searched recompute"))


def _fixed(factory, n: int, **fixed) -> Plan:
    """The planner's plan with ``fixed`` on ``n`` processes: the settings a Megatron-LM run names."""
    torch.manual_seed(0)
    model, inputs = factory()
    cluster = autopar.Cluster.local(n)
    plan = autopar.plan(model, inputs, cluster, fixed=fixed, precision="fp32", time_limit_s=10)
    assert plan.recompute == fixed["recompute"] and plan.microbatches == fixed["microbatches"]
    assert plan.mesh["tp"] == fixed.get("tp", plan.mesh["tp"]) and plan.mesh["pp"] == fixed.get("pp", 1)
    marks = {e["recompute"] for e in plan.placements.values() if "recompute" in e}
    assert marks == {"selective" if fixed["recompute"] == "op-sac" else fixed["recompute"]}, marks
    # the replays are charged: HFU counts them, MFU does not
    assert plan.estimate.hfu > plan.estimate.mfu and plan.estimate.recompute_s > 0
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, status=f"fixed {fixed}"))


def _assert_all_match(cases, checks) -> None:
    bad = [
        f"{f.__name__} {p.mesh} zero={p.zero} ({p.solver.status}): {c}"
        for (f, p), c in zip(cases, checks, strict=True)
        if not c.ok(TOL)
    ]
    assert not bad, "recompute plans that do not train like one device:\n" + "\n".join(bad)
    for c in checks:
        assert len(c.losses) == 3 and c.losses[0] != c.losses[2]


def _peak_memory(factory, cluster, plan_dict):
    torch.manual_seed(0)
    model, batch = factory()
    pm = autopar.parallelize(model, cluster, batch, plan=Plan.from_dict(plan_dict))
    opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    pm.train_step(batch)
    opt.step()  # AdamW's state exists from here on
    opt.zero_grad()
    return pm.measure_step_memory(batch, opt)


def _job(wire, memory_plans, cluster) -> tuple[list, list]:
    checks = _rank_run_all(wire, cluster, 3, 1e-3, 0, None)
    return checks, [_peak_memory(gpt2_wide, cluster, p) for p in memory_plans]


def _run(cases, memory_plans, n: int):
    cluster = autopar.Cluster.local(n)
    ref = {f: single_device_run(f, 3, 1e-3, 0) for f in dict.fromkeys(f for f, _ in cases)}  # one run per model
    refs = [ref[f] for f, _ in cases]
    wire = [(f, p.to_dict()) for f, p in cases]
    per_rank = launch(_job, cluster, wire, [p.to_dict() for p in memory_plans], cluster, crash_retries=1)
    checks = [_compare([r[0][k] for r in per_rank], refs[k]) for k in range(len(cases))]
    return checks, [r[1] for r in per_rank]


@pytest.fixture(scope="module")
def two_processes():
    cases = [
        (gpt2_tiny, _zero(_recompute(_layout(gpt2_tiny, 2, 2, 1, "dp"), gpt2_tiny, "selective"), 2)),
        # Megatron-LM's settings as autopar.plan plans them: tensor parallel with micro-batches, a pipeline
        (gpt2_tiny, _fixed(gpt2_tiny, 2, tp=2, microbatches=2, recompute="selective")),
        (llama_tiny, _fixed(llama_tiny, 2, tp=2, microbatches=2, recompute="full")),
        (gpt2_tiny4, _fixed(gpt2_tiny4, 2, pp=2, microbatches=2, schedule="1F1B", recompute="full")),
        # torchtitan's: FSDP (ZeRO-3) with its per-op checkpointing
        (llama_tiny, _fixed(llama_tiny, 2, dp=2, zero=3, microbatches=1, recompute="op-sac")),
    ]
    searched = _searched(gpt2_wide, 0.8)
    cases.append((gpt2_wide, searched))
    dp = _layout(gpt2_wide, 2, 2, 1, "dp")
    memory_plans = [dp, _recompute(dp, gpt2_wide, "full"), searched]
    return cases, *_run(cases, memory_plans, 2)


@pytest.mark.slow
def test_recompute_on_2_processes_trains_like_one_device(two_processes):
    cases, checks, _ = two_processes
    _assert_all_match(cases, checks)
    for k in (1, 2):  # tensor parallel: its reductions ran (all-reduced or, sequence parallel, reduce-scattered)
        ran = checks[k].collectives
        assert ran.get("all_reduce", 0) + ran.get("reduce_scatter_tensor", 0) >= 2, (k, ran)


@pytest.mark.slow
def test_peak_step_memory_falls_with_recompute(two_processes):
    _, _, memory = two_processes
    for rank, (off, full, searched) in enumerate(memory):
        report = f"rank {rank}: recompute off {off}; full {full}; searched {searched}"
        assert full.peak_bytes < 0.8 * off.peak_bytes, report  # measured: 9.6 MiB -> 6.1 MiB
        assert full.breakdown["params"] == off.breakdown["params"], report
        assert searched.peak_bytes < off.peak_bytes, report  # the MILP's own recompute choice


@pytest.mark.slow
def test_recompute_on_4_processes_trains_like_one_device():
    """A dp x tp = 2 x 2 Megatron layout with full recompute of layer 0 and selective elsewhere; the planner's
    pp 2 x dp 2 pipeline with ZeRO-3 and full recompute (a configuration DeepSpeed refuses): ZeRO's
    gradient chunks beside the replayed nodes."""
    cases = [
        (gpt2_tiny, _recompute(_layout(gpt2_tiny, 4, 2, 2, "megatron"), gpt2_tiny, "mixed")),
        (gpt2_tiny4, _fixed(gpt2_tiny4, 4, pp=2, dp=2, zero=3, microbatches=2, recompute="full")),
    ]
    assert cases[1][1].zero == 3
    checks, _ = _run(cases, [], 4)
    _assert_all_match(cases, checks)
