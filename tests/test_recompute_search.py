"""Recompute chosen by the planner: op by op by the sharding MILP, only where memory asks for it; or
fixed to one of Megatron-LM's settings ("none", "selective", "full") or torchtitan's per-op policy
("op-sac"), costed on the graph that runs it.

One process: what each setting charges in FLOPs (against the dense-transformer formula) and keeps in
memory on the MILP and pipeline paths, MFU against HFU, and the settings' plans re-costed as they stand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import autopar
from autopar.capture.joint import capture, node_phase
from autopar.plans.plan import Plan
from autopar.plans.report import report_html
from autopar.search.recost import estimate_plan
from autopar.search.sharding.recompute import apply_recompute, can_recompute, layer_of, recompute_layers
from autopar.search.sharding.recompute_settings import SETTINGS, attention_core
from examples.models import gpt, gpt2_tiny


@pytest.fixture(scope="module")
def tiny():
    model, batch = gpt2_tiny()
    cluster = autopar.Cluster.local(2)
    fixed = {"dp": 2, "zero": 0}
    roomy = autopar.plan(model, batch, cluster, precision="fp32", fixed=fixed)
    return model, batch, cluster, fixed, roomy


def _marked(plan: autopar.Plan) -> list[str]:
    return [n for n, e in plan.placements.items() if "recompute" in e]


def test_nothing_is_recomputed_when_memory_is_plenty(tiny):
    *_, roomy = tiny
    assert roomy.recompute == "none" and not _marked(roomy) and roomy.estimate.recompute_s == 0


def test_tight_memory_recomputes_forward_ops_and_pays_for_them_in_time(tiny):
    model, batch, cluster, fixed, roomy = tiny
    limit = 0.85 * roomy.estimate.memory.peak
    plan = autopar.plan(model, batch, cluster, precision="fp32", fixed=fixed, memory_limit=limit)
    assert plan.estimate.fits and plan.estimate.memory.peak <= limit * (1 + 1e-6)
    assert plan.microbatches == 1  # recompute, not gradient accumulation, made it fit
    assert plan.recompute == "op-level" and _marked(plan)
    assert plan.estimate.memory.activations < roomy.estimate.memory.activations
    assert plan.estimate.memory.model_states == pytest.approx(roomy.estimate.memory.model_states)
    assert 0 < plan.estimate.recompute_s < plan.estimate.compute_s
    assert plan.estimate.step_time_s > roomy.estimate.step_time_s
    # every mark is on a forward op that can be replayed, and the runtime's pass takes them all
    captured = capture(model, batch)
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    assert all(node_phase(nodes[n]) == "forward" and can_recompute(nodes[n]) for n in _marked(plan))
    rewritten, placements = apply_recompute(captured, plan.placements)
    assert any(n.name.endswith("_recompute") for n in rewritten.gm.graph.nodes)
    assert "recompute" in plan.summary()


def test_fixed_none_keeps_every_activation(tiny):
    model, batch, cluster, fixed, roomy = tiny
    limit = 0.8 * roomy.estimate.memory.peak
    plan = autopar.plan(
        model, batch, cluster, precision="fp32", fixed={**fixed, "recompute": "none"}, memory_limit=limit
    )
    assert not _marked(plan) and plan.recompute == "none"
    assert plan.microbatches > 1 or not plan.estimate.fits  # accumulation, or over the limit with a warning
    with pytest.raises(autopar.PlanError, match="'none', 'selective' .* or 'full'") as err:
        autopar.plan(model, batch, cluster, fixed={"recompute": "sometimes"})
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- fixed settings, Megatron-LM's names

B, S, L, H, V = 4, 32, 4, 256, 512  # GPT-2 shape: batch, sequence, layers, hidden, vocab


@pytest.fixture(scope="module")
def settings():
    """A GPT-2 shape (meta device) planned data parallel on 2 processes under each setting, and on pp = 2.

    In fp32: under bf16-mixed the fp32 gradients of this small model outweigh its bf16 activations,
    and the peak falls at the end of the backward, where no recompute setting changes it.
    """
    model, batch = gpt(L, H, 4, vocab=V, seq=S, batch=B, dropout=0.0)
    cluster = autopar.Cluster.local(2)
    fixed = {"dp": 2, "tp": 1, "zero": 3}
    flat = {
        how: autopar.plan(model, batch, cluster, fixed={**fixed, "recompute": how}, precision="fp32")
        for how in SETTINGS
    }
    piped = {
        how: autopar.plan(
            model, batch, cluster, fixed={"pp": 2, "microbatches": 2, "recompute": how}, precision="fp32"
        )
        for how in ("none", "full")
    }
    return model, batch, flat, piped


def test_each_setting_charges_the_forward_ops_it_replays(settings):
    *_, flat, piped = settings
    none, selective, op_sac, full = (flat[how].estimate for how in ("none", "selective", "op-sac", "full"))
    # MFU counts the model's FLOPs whatever is recomputed: the same numerator for every setting
    assert none.model_flops == selective.model_flops == full.model_flops
    dense = 72 * B * S * L * H**2 * (1 + S / (6 * H) + V / (12 * L * H))  # REFERENCES.md, no recompute
    assert none.model_flops == pytest.approx(dense, rel=0.01)
    assert none.hfu == none.mfu and none.hardware_flops == none.model_flops and none.recompute_s == 0
    for e in (selective, op_sac, full):
        assert e.mfu * e.step_time_s == pytest.approx(none.mfu * none.step_time_s, rel=1e-9)
        assert e.hfu > e.mfu and e.hfu / e.mfu == pytest.approx(e.hardware_flops / e.model_flops, rel=1e-9)
        assert e.recompute_s > 0 and e.step_time_s > none.step_time_s
    # selective replays the attention kernel's forward, 4·b·s²·h a layer
    assert selective.hardware_flops - selective.model_flops == pytest.approx(L * 4 * B * S**2 * H, rel=1e-6)
    # full replays each layer's forward but its last GEMM, the MLP's down projection, whose output
    # nothing in the backward reads: QKV 6·b·s·h², attention 4·b·s²·h, output projection 2·b·s·h², MLP
    # up 8·b·s·h². Megatron's checkpoint runs that GEMM again too: 4/3 of the layers (96 / 72)
    replayed = L * B * (16 * S * H**2 + 4 * S**2 * H)
    assert full.hardware_flops - full.model_flops == pytest.approx(replayed, rel=1e-6)
    megatron = (1 + S / (6 * H) + V / (16 * L * H)) * 96 / (72 * (1 + S / (6 * H) + V / (12 * L * H)))
    assert 1.15 < full.hfu / full.mfu < megatron
    assert full.recompute_s > selective.recompute_s
    # torchtitan's per-op policy keeps the attention and every other projection (QKV, MLP up) and replays
    # the rest; of the matmuls the backward reads only the attention's output projection, 2·b·s·h² a layer
    assert op_sac.hardware_flops - op_sac.model_flops == pytest.approx(L * 2 * B * S * H**2, rel=1e-6)
    assert full.recompute_s > op_sac.recompute_s
    # a pipeline charges the same replays (its stages' MILP runs on the same graph)
    for how in ("none", "full"):
        assert piped[how].estimate.model_flops == none.model_flops
        assert piped[how].estimate.hardware_flops == flat[how].estimate.hardware_flops
    assert piped["full"].estimate.hfu > piped["full"].estimate.mfu


def test_each_setting_keeps_less_activation_memory_than_the_one_before(settings):
    *_, flat, piped = settings
    none, selective, op_sac, full = (flat[how].estimate.memory for how in ("none", "selective", "op-sac", "full"))
    assert full.activations < selective.activations < none.activations
    assert full.peak < selective.peak < none.peak
    # op by op, the replays live only from just before their backward use: less than selective keeps
    assert op_sac.activations < selective.activations and op_sac.peak < selective.peak
    assert none.model_states == selective.model_states == full.model_states
    # full keeps the layers' inputs only: less than half of what the layers keep without recompute
    assert full.activations < 0.5 * none.activations
    assert piped["full"].estimate.memory.activations < 0.5 * piped["none"].estimate.memory.activations
    for how in SETTINGS:
        plan = flat[how]
        assert plan.recompute == how and plan.estimate.fits
        marks = {n: e["recompute"] for n, e in plan.placements.items() if "recompute" in e}
        # torchtitan's policy is carried out by per-node marks, the MILP's own kind
        assert set(marks.values()) == ({"selective" if how == "op-sac" else how} if how != "none" else set())
        assert not any(n.endswith("_recompute") for n in plan.placements)  # the runtime makes the clones
    layers = {layer_of(flat["full"].placements[n]["module"]) for n in _marked(flat["full"])}
    assert layers == {f"transformer.h.{i}" for i in range(L)}
    ops = {flat["selective"].placements[n]["op"] for n in _marked(flat["selective"])}
    assert ops == {"aten._scaled_dot_product_flash_attention_for_cpu.default", "<built-in function getitem>"}
    # op-sac: every other projection of a layer (c_attn, c_fc) and the attention kernel are kept
    replayed = [flat["op-sac"].placements[n] for n in _marked(flat["op-sac"])]
    kept = {e["module"] for e in flat["op-sac"].placements.values() if e.get("op") == "aten.addmm.default"}
    kept -= {e["module"] for e in replayed if e["op"] == "aten.addmm.default"}
    assert {".".join(m.split(".")[-2:]) for m in kept} == {"attn.c_attn", "mlp.c_fc"}
    assert not any("scaled_dot_product" in e["op"] for e in replayed)


def test_a_setting_plan_recosted_as_it_stands_gets_its_estimate_back(settings):
    model, batch, flat, _ = settings
    for how in ("selective", "full"):
        again, own = estimate_plan(flat[how], model, batch), flat[how].estimate
        for field in ("step_time_s", "recompute_s", "mfu", "hfu", "model_flops", "hardware_flops"):
            assert getattr(again, field) == pytest.approx(getattr(own, field), rel=1e-9), field
        assert again.memory.peak == pytest.approx(own.memory.peak, rel=1e-9)


def test_summary_report_and_diff_show_hfu_where_it_differs_from_mfu(settings):
    *_, flat, _ = settings
    none, full = flat["none"], flat["full"]
    assert "HFU" in full.summary(width=200) and "HFU" not in none.summary(width=200)
    assert "full (Megatron's: every layer from its input)" in full.summary(width=200)
    assert "HFU" in report_html(full) and "HFU" not in report_html(none)
    assert "HFU" in str(autopar.diff(none, full))
    again = Plan.from_dict(full.to_dict())
    assert again.estimate.hfu == full.estimate.hfu
    assert again.estimate.hardware_flops == full.estimate.hardware_flops
    older = full.to_dict()  # a plan saved before HFU was a figure of its own
    for key in ("hfu", "hardware_flops"):
        del older["estimate"][key]
    est = Plan.from_dict(older).estimate
    assert est.hfu == est.mfu and est.hardware_flops == est.model_flops


def test_selective_on_an_unfused_attention_replays_its_core():
    """Eager attention: scores matmul, scale, mask, softmax, dropout and probabilities x values, per layer."""
    model, batch = gpt(2, H, 4, vocab=V, seq=S, batch=B, dropout=0.0)
    model.config._attn_implementation = "eager"
    captured = capture(model, batch)
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    core = attention_core(captured)
    assert list(core) == list(recompute_layers(captured))
    for names in core.values():
        ops = [nodes[n].target for n in names]
        assert ops.count(torch.ops.aten.bmm.default) == 2 and torch.ops.aten._softmax.default in ops
        assert not {torch.ops.aten.addmm.default, torch.ops.aten.mm.default} & set(ops)  # no projection
    cluster = autopar.Cluster.local(2)
    # ZeRO-3 keeps the gradients small, so the peak falls in the backward, where the activations are (in
    # fp32: under bf16-mixed the masters' fp32 gradients outweigh this model's bf16 activations)
    plans = {
        h: autopar.plan(model, batch, cluster, fixed={"dp": 2, "zero": 3, "recompute": h}, precision="fp32")
        for h in ("none", "selective")
    }
    none, selective = plans["none"].estimate, plans["selective"].estimate
    # the scores matmul is replayed (no backward op reads the context matmul's output): 2·b·s²·h a layer
    assert selective.hardware_flops - selective.model_flops == pytest.approx(2 * 2 * B * S**2 * H, rel=1e-6)
    # what it frees is quadratic in the sequence: the softmax's probabilities (4 bytes each, fp32), less the
    # additive causal mask each layer keeps for the replay (s x s, shared by the batch)
    probabilities = 2 * (B // 2) * 4 * S * S * 4  # two layers, a local batch of B / 2, 4 heads
    mask = 2 * S * S * 4
    assert none.memory.activations - selective.memory.activations == probabilities - mask


@pytest.mark.parametrize(("bubble", "full_wins"), [(7.0, True), (3.0, False)])
def test_an_idle_pipeline_where_nothing_else_fits_is_weighed_against_full_recompute(monkeypatch, bubble, full_wins):
    """With recompute left to the search, no mesh without a pipeline fitting op by op, and a pipeline idle for
    more than ``IDLE_PIPELINE`` of its work (15 s a step, ``bubble`` of it idle), those meshes are costed again
    under full recompute, in the time left, and the faster plan wins; a busier pipeline is kept without it.
    (LLaMA-3-8B at 262,144 tokens on 64 H100s: ``benchmarks/plan_long_context.py --seq 262144``.)"""
    from autopar.api import planner
    from autopar.api.search_record import Sharded
    from autopar.cost_models.estimate import Estimate
    from autopar.plans.records import Fixed, MeshRecord, SearchRecord

    calls = []

    def searched(captured, stats, cluster, gbs, prec, optimizer, limit, fixed, time_limit_s, flat_optional=False):
        calls.append((fixed.recompute, fixed.pp, flat_optional))
        if fixed.recompute == "full":
            record = SearchRecord(meshes=[MeshRecord(mesh={"dp": 2, "tp": 2, "pp": 1}, fits=True)])
            return Sharded((None, Estimate(step_time_s=10.0, fits=True)), record, {}, [])
        record = SearchRecord(
            meshes=[MeshRecord(mesh={"dp": 2, "tp": 2, "pp": 1}, fits=False), MeshRecord(mesh={"dp": 1, "tp": 2, "pp": 2})]
        )
        return Sharded((SimpleNamespace(pp=2, tp=2), Estimate(step_time_s=15.0, bubble_s=bubble, fits=True)), record, {}, [])

    monkeypatch.setattr(planner, "_sharded_as_fixed", searched)
    torch.manual_seed(0)
    model, inputs = gpt2_tiny()
    captured = capture(model, inputs)
    cluster = autopar.Cluster.local(4)
    got = planner._sharded_plan(captured, None, cluster, 8, None, "adamw", 1e9, Fixed(), 60.0)
    assert got.args[1].step_time_s == (10.0 if full_wins else 15.0)
    assert calls == ([(None, None, False), ("full", 1, True)] if full_wins else [(None, None, False)])
    if full_wins:
        assert "full recompute" in got.solver.stopped
    calls.clear()
    planner._sharded_plan(captured, None, cluster, 8, None, "adamw", 1e9, Fixed(recompute="op-sac"), 60.0)
    assert calls == [("op-sac", None, False)]  # a setting the user fixed is kept


def test_a_mesh_that_fits_op_by_op_only_with_tp_across_nodes_is_weighed_against_full_recompute() -> None:
    """Memory binds there too: LLaMA-3-8B at 524,288 tokens on 64 H100s fits dp 2 x tp 32 op by op at 282.6 s,
    and dp 8 x cp 8 under full recompute at 183.5 s. A mesh with tp inside a node that fits keeps the plan."""
    from autopar.api import planner
    from autopar.api.search_record import Sharded
    from autopar.cost_models.estimate import Estimate
    from autopar.plans.records import Fixed, MeshRecord, SearchRecord

    torch.manual_seed(0)
    model, inputs = gpt2_tiny()
    captured = capture(model, inputs)
    cluster = autopar.Cluster.preset("dgx-h100", nodes=2)

    def found(*tps_fitting):
        meshes = [MeshRecord(mesh={"dp": 16 // t, "tp": t, "pp": 1}, fits=ok) for t, ok in tps_fitting]
        best = min(t for t, ok in tps_fitting if ok)
        return Sharded((SimpleNamespace(pp=1, tp=best), Estimate(step_time_s=1.0, fits=True)), SearchRecord(meshes=meshes), {}, [])

    assert planner._full_recompute_worth(captured, Fixed(), found((8, False), (16, True)), cluster)
    assert not planner._full_recompute_worth(captured, Fixed(), found((4, True), (8, False)), cluster)


def test_where_nothing_fits_the_error_also_names_what_full_recompute_needs(monkeypatch) -> None:
    """Op by op the least memory can be far above what full recompute needs (LLaMA-7B on 8 H100s at 16 GB: 18.5
    GB op by op, 16.1 GB under full recompute, ``benchmarks/memory_sweep.py``): the error says both."""
    from autopar.api import planner
    from autopar.api.search_record import Sharded
    from autopar.cost_models.estimate import Estimate, MemoryEstimate
    from autopar.plans.records import Fixed, MeshRecord, SearchRecord

    def searched(captured, stats, cluster, gbs, prec, optimizer, limit, fixed, time_limit_s, flat_optional=False):
        if fixed.recompute != "full":
            raise autopar.PlanError("no plan fits 16 GB per device; the smallest memory that would fit is 18.5 GB")
        record = SearchRecord(meshes=[MeshRecord(mesh={"dp": 1, "tp": 8, "pp": 1}, fits=False)])
        est = Estimate(step_time_s=0.5, fits=False, memory=MemoryEstimate(peak=16.06e9))
        return Sharded((SimpleNamespace(pp=1, tp=8), est), record, {}, [])

    monkeypatch.setattr(planner, "_sharded_as_fixed", searched)
    monkeypatch.setattr(planner, "_full_recompute_worth", lambda *args: True)
    torch.manual_seed(0)
    model, inputs = gpt2_tiny()
    with pytest.raises(autopar.PlanError, match=r"18.5 GB; under full recompute .* needs 16.1 GB") as err:
        planner._sharded_plan(capture(model, inputs), None, autopar.Cluster.local(8), 8, None, "adamw", 16e9, Fixed(), 60.0)
    assert "\n" not in str(err.value)
