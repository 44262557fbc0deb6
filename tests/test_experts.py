"""Mixtures of experts: routing captured as one op, and expert parallelism trained like one device.

One process: HuggingFace's mixtures (Mixtral, Qwen3-MoE, DeepSeek-V3-style with a
shared expert and group-limited top-k) capture their routed experts as
``autopar::experts`` (dropless: every token reaches its top-k experts) with the
router's load-balancing loss in the loss where the family has one, and the
sharding rules offer expert parallelism for them.

Four gloo processes (``-m slow``): tiny Mixtral and DeepSeek-V3-style under expert
parallelism on a 2 x 2 mesh, experts split over the second axis (ep 2 x dp 2) and
over the data-parallel axis itself (ep 2 sharing its ranks with dp 2, the second
axis tensor parallel where the solver wants it), and as the search plans ep with
ZeRO-1, ZeRO-3 and a two-stage pipeline: 3 AdamW steps within 1e-5 of eager
PyTorch on one device (the oracle gathers the parameters with ``full_state_dict``);
and a checkpoint round trip between one device and ep 2 x dp 2.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import autopar
from autopar.capture.joint import capture
from autopar.search.sharding.strategies import enumerate_strategies
from autopar.verify.oracle import check_plans, plan_with_layout, shell_plan
from examples import families

pytest.importorskip("transformers")

EXPERTS = "autopar.experts.default"
MOE = {"mixtral": 1, "qwen3_moe": 1, "deepseek_v3": 1}  # routed-experts layers of each tiny model
FOUR = autopar.Cluster.local(4)


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", list(MOE))
def test_routed_experts_capture_as_one_op(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = families.FAMILIES[name]()
    ops = _ops(capture(model, inputs).gm)
    assert ops.count(EXPERTS) == MOE[name]
    assert ops.count("autopar.experts_backward.default") == MOE[name]
    assert not any("grouped_mm" in op or op == "aten.sort.default" for op in ops), "HF's dispatch left in"
    # the router's top-k per layer, and Mixtral's and Qwen's load-balancing loss takes its own over all layers
    aux = 1 if model.config.output_router_logits and name != "deepseek_v3" else 0
    topk_per_router = 3 if name == "deepseek_v3" else 1  # group scores, groups, experts
    assert ops.count("aten.topk.default") == MOE[name] * topk_per_router + aux


def test_experts_op_matches_huggingface() -> None:
    """The op's forward and gradients against HuggingFace's own experts implementation, in fp32."""
    torch.manual_seed(0)
    model, inputs = families.mixtral()
    block = model.model.layers[0].mlp
    x = torch.randn(families.BATCH * families.SEQ, families.HIDDEN, requires_grad=True)
    _, weights, index = block.gate(x)
    from autopar.ops.experts import experts

    ours = experts(x, index, weights, block.experts.gate_up_proj, block.experts.down_proj, "silu")
    theirs = block.experts(x, index, weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    params = [x, block.experts.gate_up_proj, block.gate.weight]
    g1 = torch.autograd.grad(ours.square().sum(), params, retain_graph=True)
    g2 = torch.autograd.grad(theirs.square().sum(), params)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_expert_parallel_strategies_are_offered() -> None:
    """On a 2 x 2 mesh the experts op can split the experts over either axis, tokens split with them."""
    torch.manual_seed(0)
    model, inputs = families.mixtral()
    gm = capture(model, inputs).gm
    node = next(n.name for n in gm.graph.nodes if str(n.target) == EXPERTS)
    strategies = enumerate_strategies(gm, (2, 2))[node].strategies
    ep_axes = {
        tuple(a for a, p in enumerate(s.inputs[3]) if p.is_shard(0)) for s in strategies
    }
    assert {(0,), (1,), ()} <= ep_axes and (0, 1) not in ep_axes


def test_expert_weight_gradients_are_reduced_in_the_reduce_dtype() -> None:
    """The experts' weight gradients leave ``experts_backward`` (several outputs) through getitems on the
    gradient chain: under bf16-mixed their reductions move fp32, as the runtime casts them, not bf16."""
    from autopar.capture.graph import gradient_chain
    from autopar.cost_models.memory import precision_spec
    from autopar.search.sharding.mesh_solve import prepare_mesh
    from autopar.search.sharding.request import MeshRequest

    torch.manual_seed(0)
    model, inputs = families.mixtral()
    captured = capture(model, inputs)
    chain = gradient_chain(captured.gm, len(captured.params))
    backward = next(n for n in captured.gm.graph.nodes if str(n.target) == "autopar.experts_backward.default")
    weights = {u.name for u in backward.users if u.name in chain}
    assert len(weights) >= 2, "the experts' weight gradients are not on the chain"
    mesh = FOUR.check_mesh(dp=4, tp=1, pp=1)
    sp = prepare_mesh(MeshRequest(captured, FOUR, mesh, precision_spec("bf16-mixed"), "adamw")).sp
    scales = {info.dst: info.reduce_scale for info in sp.edge_info if info.src == backward.name}
    assert {scales[w] for w in weights} == {2.0}, scales
    assert all(scales[d] == 1.0 for d in scales if d not in chain), scales  # the input's gradient is no gradient


def test_every_mesh_of_a_mixture_also_searches_the_experts_whole() -> None:
    """Beside the expert-parallel seeds, the experts-whole search runs on a dp-only mesh too: there the ZeRO-3
    seed holds every parameter at one stage and the MILP's other answers keep the expert split it starts from
    (Mixtral-8x7B on 64 H100s at 64 sequences: ``benchmarks/plan_moe.py --model mixtral --batch 64``)."""
    from autopar.search.sharding.seeds import seeds_for

    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight"]
    assert seeds_for(1, names) == ["dp", "zero3", "ep_dp", "experts_whole"]
    assert "experts_whole" in seeds_for(8, names)
    assert seeds_for(1, names[1:]) == ["dp", "zero3"]  # no experts: no expert seeds


@functools.cache
def _planned(name: str) -> tuple[torch.nn.Module, dict, autopar.Plan]:
    """The model and a dp 2 x tp 2 plan without placements, for the layouts to fill (no search: its answer
    would not be kept)."""
    torch.manual_seed(0)
    model, inputs = families.FAMILIES[name]()
    return model, inputs, shell_plan(model, inputs, FOUR, 2, 2)


def _expert_parallel(name: str, kind: str) -> autopar.Plan:
    model, inputs, plan = _planned(name)
    out = plan_with_layout(plan, model, inputs, FOUR, kind)
    split = [v for v in out.placements.values() if v["op"] == EXPERTS]
    axis = 1 if kind == "ep" else 0
    assert split and all(v["inputs"][3][axis].is_shard(0) for v in split), "the layout is not expert parallel"
    return out


def _searched(name: str, fixed: tuple) -> autopar.Plan:
    torch.manual_seed(0)
    model, inputs = families.FAMILIES[name]()
    plan = autopar.plan(model, inputs, FOUR, precision="fp32", fixed=dict(fixed))
    assert plan.mesh.get("ep") == 2, plan.mesh
    return plan


# expert parallelism composed with ZeRO and with a pipeline, as the search plans them under ``fixed``
COMPOSED = [
    ("mixtral", (("ep", 2), ("dp", 2), ("tp", 2), ("zero", 1))),
    ("deepseek_v3", (("ep", 2), ("dp", 2), ("tp", 2), ("zero", 3))),
    ("deepseek_v3", (("ep", 2), ("pp", 2), ("microbatches", 2))),
]


@pytest.mark.slow
def test_expert_parallel_trains_like_one_device() -> None:
    names = ["mixtral", "deepseek_v3"]
    kinds = ["ep", "ep_dp"]  # ep 2 x dp 2; ep 2 over the dp axis's ranks
    labels = [f"{n} {k}" for n in names for k in kinds] + [f"{n} {dict(f)}" for n, f in COMPOSED]
    cases = [
        (families.FAMILIES[n], functools.partial(_expert_parallel, n, k)) for n in names for k in kinds
    ] + [(families.FAMILIES[n], functools.partial(_searched, n, f)) for n, f in COMPOSED]
    checks = check_plans(cases, FOUR, rng="exact")
    bad = [f"{label}: {c}" for label, c in zip(labels, checks, strict=True) if not c.ok(1e-5)]
    assert not bad, "expert-parallel plans that do not train like one device:\n" + "\n".join(bad)
    for c in checks:
        assert len(c.losses) == 3 and c.losses[0] != c.losses[2]
        assert c.collectives.get("all_to_all_single", 0) == 0  # the op's all-to-alls run inside it


def test_fixed_ep_splits_the_experts_and_the_mesh_names_it() -> None:
    """``fixed={"ep": n}`` as ``"tp"``: the experts split n ways over the ranks of dp or of the second axis,
    with or without a pipeline, and ``plan.mesh`` names the split (it adds no devices)."""
    torch.manual_seed(0)
    model, inputs = families.mixtral()
    for fixed, axis in (({"ep": 2, "dp": 2, "tp": 2}, None), ({"ep": 4, "dp": 4, "tp": 1}, 0)):
        plan = autopar.plan(model, inputs, FOUR, precision="fp32", fixed=fixed)
        assert plan.mesh["ep"] == fixed["ep"] and "(ep=" in plan.mesh_str()
        entries = [v for v in plan.placements.values() if v["op"] == EXPERTS]
        split = {a for v in entries for a, p in enumerate(v["inputs"][3]) if p.is_shard(0)}
        assert len(split) == 1 and (axis is None or split == {axis})
    plan = autopar.plan(model, inputs, FOUR, precision="fp32", fixed={"ep": 1, "dp": 4})
    assert "ep" not in plan.mesh
    torch.manual_seed(0)
    model, inputs = families.deepseek_v3()  # two layers: a pipeline of two stages
    plan = autopar.plan(model, inputs, FOUR, precision="fp32", fixed={"ep": 2, "pp": 2, "microbatches": 2})
    assert plan.mesh["pp"] == 2 and plan.mesh["ep"] == 2


def test_load_balancing_loss_keeps_batches_whole() -> None:
    """The load-balancing loss is a product of batch means: the search cuts no micro-batches for it."""
    torch.manual_seed(0)
    model, inputs = families.mixtral()
    plan = autopar.plan(model, inputs, FOUR, precision="fp32")
    assert plan.microbatches == 1 and plan.mesh["pp"] == 1


def test_busiest_rank_under_uniform_dropless_routing() -> None:
    """The expected busiest rank's pairs over the mean: E[max] of two standard normals is 1/sqrt(pi), of eight
    1.4236; Mixtral-8x7B's 32,768 tokens a rank over ep 8 put 0.5% more on the busiest rank, far under the 25%
    a capacity factor of 1.25 pads to; fewer tokens or more ranks spread more; one rank, or every expert
    chosen, none."""
    from autopar.cost_models.experts import busiest_rank_share, expected_max_normal

    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(8) == pytest.approx(1.4236, abs=1e-4)
    mixtral = busiest_rank_share(8 * 4096, 2, 8, 8)
    assert mixtral == pytest.approx(1 + 1.4236 * math.sqrt(6 / (7 * 65536)), rel=1e-4) and mixtral < 1.006
    assert busiest_rank_share(4096, 2, 8, 8) > mixtral and busiest_rank_share(8 * 4096, 2, 64, 64) > mixtral
    assert busiest_rank_share(100, 2, 8, 1) == 1.0 and busiest_rank_share(100, 8, 8, 4) == 1.0


def test_all_to_all_and_imbalance_are_charged() -> None:
    """Expert parallel costs two all-to-alls of the pairs' rows forward, four backward, at the busiest rank's
    ``capacity_factor``; a larger factor makes the same expert-parallel plan slower, never faster."""
    from autopar.cost_models.comm import collective_time
    from autopar.cost_models.experts import all_to_all_seconds

    link = autopar.Cluster.preset("dgx-h100", nodes=1).axis_link(
        autopar.hardware.cluster.MeshShape(dp=8, tp=1, pp=1), "dp"
    )
    one = collective_time("all_to_all", 1.5e6, 8, link)
    assert all_to_all_seconds(1e6, 8, link, backward=False, capacity_factor=1.5) == pytest.approx(2 * one)
    assert all_to_all_seconds(1e6, 8, link, backward=True, capacity_factor=1.5) == pytest.approx(4 * one)
    with pytest.raises(ValueError, match="below 1"):
        all_to_all_seconds(1e6, 8, link, backward=False, capacity_factor=0.5)
    torch.manual_seed(0)
    model, inputs = families.mixtral()
    fixed = {"ep": 2, "dp": 2, "tp": 2}
    steps = [
        autopar.plan(model, inputs, FOUR, precision="fp32", fixed=fixed, capacity_factor=cf).estimate.step_time_s
        for cf in (1.0, None, 2.0)
    ]
    assert steps[0] < steps[1] < steps[2]  # None: the expected busiest rank of uniform routing, over the mean
    with pytest.raises(autopar.PlanError, match="capacity_factor"):
        autopar.plan(model, inputs, FOUR, fixed=fixed, capacity_factor=0.9)


@pytest.mark.slow
def test_expert_parallel_checkpoints_round_trip(tmp_path) -> None:
    """One device saves, an ep 2 x dp 2 plan loads it bit for bit, steps as one device does and saves; one
    device loads that bit for bit (experts split over a mesh axis, in the checkpoint's whole-tensor form)."""
    from autopar.verify.round_trip import check_round_trip

    trip = check_round_trip(families.mixtral, FOUR, _expert_parallel("mixtral", "ep"), tmp_path)
    assert trip.loaded_exactly, "the ep plan did not load what one device saved"
    assert trip.step_error <= 1e-5, f"the step after loading: {trip.step_error:.1e} ({trip.worst})"
    assert trip.reloaded_exactly, "one device did not load ep's save"


def _ep_gradients_with_an_idle_rank() -> list[float]:
    """On each of 2 ranks: the expert-parallel backward where every token chooses experts 0 and 1 (rank 0's),
    so rank 1 computes no rows; each gradient's largest difference from one device's."""
    import torch.distributed as dist

    from autopar.ops.experts import _grads

    torch.manual_seed(0)
    tokens, k, hidden, inter, n_experts = 8, 2, 4, 3, 4
    x, w = torch.randn(tokens, hidden), torch.rand(tokens, k)
    gate_up, down = torch.randn(n_experts, 2 * inter, hidden), torch.randn(n_experts, hidden, inter)
    index = torch.tensor([[0, 1]] * tokens)
    grad = torch.randn(tokens, hidden)
    whole = _grads(grad, x, index, w, gate_up, down, "silu")
    rank = dist.get_rank()
    mine = slice(rank * tokens // 2, (rank + 1) * tokens // 2)
    experts = slice(rank * n_experts // 2, (rank + 1) * n_experts // 2)
    group = dist.distributed_c10d._get_default_group().group_name
    local = torch.ops.autopar.experts_ep_backward(
        grad[mine], x[mine], index[mine], w[mine], gate_up[experts], down[experts], "silu", group, 2
    )
    want = (whole[0][mine], whole[1][mine], whole[2][experts], whole[3][experts])
    return [(a - b).abs().max().item() for a, b in zip(local, want, strict=True)]


def test_expert_parallel_backward_runs_on_a_rank_whose_experts_get_no_tokens() -> None:
    """A rank of the expert-parallel group whose experts no token chose still takes part in the backward's
    all-to-alls: it once computed its (empty) output from nothing, which cut its autograd graph, skipped the
    all-to-alls the other rank waited in, and hung the job (found by running every strategy of GPT-OSS-style
    Afmoe alone: ``autopar.verify.rule_check``)."""
    from autopar.runtime.launch import launch

    for errors in launch(_ep_gradients_with_an_idle_rank, 2, collective_timeout_s=30):
        assert max(errors) < 1e-5, errors
