"""Reading a plan: per-op records of the search, Plan.explain for ops, parameters and layers, diff."""

import copy
import json

import pytest

import autopar
import autopar.api.flat_plan as flat_plan
from autopar.core.placements import REPLICATE as R
from autopar.core.placements import shard as S
from autopar.core.placements import text as placement_text
from autopar.plans.inspection import UnknownNameError, diff, explain_plan, record_of
from autopar.plans.plan import Plan
from autopar.plans.records import SearchRecord
from autopar.search.sharding.explain_records import explain_records
from examples.models import gpt2_tiny


def plan_with_ops(factory, cluster, **kwargs):
    """``autopar.plan`` with the search's per-op records in ``solver.ops``.

    Catches the search's best result as it is made whole (``finish_best``, once it wins); also
    returns the records built with a small limit.
    """
    caught = {}
    finish = flat_plan.finish_best

    def keep(best, results, request, time_limit_s):
        best = finish(best, results, request, time_limit_s)
        caught["args"] = (request.captured, best)
        return best

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flat_plan, "finish_best", keep)
        model, batch = factory()
        plan = autopar.plan(model, batch, cluster, **kwargs)
    plan.solver.ops = explain_records(*caught["args"])
    small = explain_records(*caught["args"], limit=5, alternatives=2)
    return plan, small


@pytest.fixture(scope="module")
def planned():
    return plan_with_ops(gpt2_tiny, autopar.Cluster.local(4), precision="fp32", fixed={"pp": 1})


@pytest.fixture(scope="module")
def plan(planned, tmp_path_factory):
    """The plan after a JSON round trip: explain works from the file alone."""
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    planned[0].save(path)
    return Plan.load(path)


def test_records_are_compact_json_and_bounded(planned):
    plan, small = planned
    ops = plan.solver.ops
    text = json.dumps(ops.to_dict())
    assert len(text) < 200_000
    recs = ops.records
    assert recs and ops.dropped == 0
    # repeated layers are stored once: layer 1's ops point at layer 0's records
    assert ops.same_as and all(target in recs for target in ops.same_as.values())
    assert not any(".h.1." in r.module for r in recs.values() if r.param)
    for name, r in recs.items():
        assert r.alternatives and r.why and r.strategies >= len(r.alternatives)
        # the chosen strategy is listed first and is the plan's placement
        placed = plan.placements[name]["outputs"]
        assert r.chosen.outputs == " | ".join(placement_text(p) if p else "-" for p in placed)
    # the FLOP-heavy ops and every parameter are there
    assert any(r.flops > 0 for r in recs.values())
    params = {e["param"] for e in plan.placements.values() if "param" in e}
    recorded = {r.param for r in recs.values() if r.param}
    aliased = {plan.placements[n].get("param") for n in ops.same_as} - {None}
    assert params == recorded | aliased
    # limits hold: at most 5 records, 2 strategies each, the rest counted
    assert len(small.records) <= 5 and small.dropped > 0
    assert all(len(r.alternatives) <= 2 for r in small.records.values())
    assert all(t in small.records for t in small.same_as.values())


def test_explain_an_op(plan):
    ops = plan.solver.ops.records
    name = max(ops, key=lambda n: ops[n].flops)
    text = plan.explain(name)
    assert name in text and ops[name].op in text
    assert "chosen" in text and "why:" in text and "strategies (" in text
    assert ops[name].chosen.outputs in text


def test_explain_a_parameter_by_name_and_a_repeated_copy(plan):
    text = plan.explain("transformer.h.1.mlp.c_fc.weight")
    assert "parameter transformer.h.1.mlp.c_fc.weight" in text
    assert "recorded under its copy" in text and "why:" in text
    rec, rep = record_of(plan, "p_transformer_h_1_mlp_c_fc_weight")
    assert rec is not None and rep == "p_transformer_h_0_mlp_c_fc_weight"


def test_explain_a_layer(plan):
    text = plan.explain("transformer.h.0.mlp")
    assert "module transformer.h.0.mlp" in text
    assert "transformer.h.0.mlp.c_fc.weight" in text and "ops with work or communication" in text
    folded = plan.explain("transformer.h.*.attn")
    assert "transformer.h.0.attn.c_attn.weight" in folded
    assert "transformer.h.1.attn.c_attn.weight" not in folded  # the first layer speaks for all


def test_unknown_name_is_one_line_with_close_matches(plan):
    with pytest.raises(UnknownNameError) as err:
        plan.explain("transformer.h.0.mlpp")
    msg = str(err.value)
    assert "\n" not in msg and "transformer.h.0.mlp" in msg and "close matches" in msg
    with pytest.raises(autopar.AutoparError):
        plan.explain("nothing_like_it_xyz")


def test_explain_without_records_falls_back_to_placements(plan):
    bare = copy.deepcopy(plan)
    bare.solver.ops = None
    node = next(n for n, e in bare.placements.items() if e.get("param") == "transformer.wte.weight")
    bare.placements[node]["zero"] = 2
    text = explain_plan(bare, "transformer.wte.weight")
    assert "keeps no alternatives" in text and "chosen placement" in text
    assert "ZeRO stage 2" in text


def test_recompute_and_zero_keys_are_shown(plan):
    p = copy.deepcopy(plan)
    ops = p.solver.ops.records
    name = next(n for n in ops if not ops[n].param and ops[n].flops)
    p.placements[name]["recompute"] = "selective"
    assert "recompute: selective" in p.explain(name)


def test_diff_of_a_plan_with_itself_is_empty(plan):
    d = diff(plan, copy.deepcopy(plan))
    assert d.same and "no difference" in str(d)


def test_diff_names_what_changed(plan):
    b = copy.deepcopy(plan)
    b.mesh = {"dp": 4, "tp": 1, "pp": 1}
    b.zero, b.microbatches, b.recompute = 1, 2, "selective"
    b.estimate.step_time_s *= 1.5
    b.estimate.memory.activations *= 0.5
    b.warnings.append("something to look at")
    node = next(n for n, e in b.placements.items() if e.get("param") == "transformer.h.0.mlp.c_fc.weight")
    b.placements[node]["outputs"] = [(S(0), R)]
    d = diff(plan, b, "old", "new")
    text = str(d)
    for needle in (
        "dp=2 x tp=2 x pp=1",
        "dp=4 x tp=1 x pp=1",
        "ZeRO stage",
        "micro-batches",
        "recompute",
        "step time",
        "+50.0%",
        "activations",
        "something to look at",
        "transformer.h.*.mlp.c_fc.weight",
        "out S(0),R",
    ):
        assert needle in text, needle
    assert not d.same


def test_diff_of_different_models_skips_placements(plan):
    b = copy.deepcopy(plan)
    b.fingerprint = "other"
    d = diff(plan, b)
    assert "different models" in str(d)


def _one_node_result(source="milp", status="optimal", limit=None, peak=0.0, chosen=1):
    """A one-node search result: strategy 0 is cheaper (1 s vs 2 s) but holds 10 bytes more."""
    from types import SimpleNamespace

    from autopar.search.sharding.strategies import Strategy

    problem = SimpleNamespace(
        node_costs=[[1.0, 2.0]], node_memory=[[20.0, 10.0]], edges=[], edge_costs=[], memory_limit=limit
    )
    strategies = [[Strategy((((R, R)),), ()), Strategy((((S(0), R)),), ())]]
    sp = SimpleNamespace(problem=problem, strategies=strategies)
    res = SimpleNamespace(
        sp=sp,
        source=source,
        estimate=SimpleNamespace(memory=SimpleNamespace(peak=peak)),
        solution=SimpleNamespace(status=status),
    )
    return res, [chosen]


@pytest.mark.parametrize(
    "kwargs, copies, needle",
    [
        ({"chosen": 0}, 1, "cheapest of its 2 allowed strategies"),
        ({"limit": 100.0, "peak": 95.0}, 1, "near the 100 B limit"),
        ({}, 4, "tied to its 4 copies"),
        ({"source": "megatron"}, 1, "the megatron layout was kept"),
        ({"status": "feasible"}, 1, "time limit"),
    ],
)
def test_why_names_the_reason(kwargs, copies, needle):
    from autopar.search.sharding.explain_records import _Context

    res, choice = _one_node_result(**kwargs)
    rec = _Context(res, choice, [[]], {0: copies}).record(0, alternatives=5)
    assert needle in rec.why, rec.why
    assert rec.chosen.outputs == ("R,R" if choice == [0] else "S(0),R")


def test_explain_a_data_parallel_plan_says_there_are_no_ops(plan):
    bare = copy.deepcopy(plan)
    bare.placements, bare.solver = {}, SearchRecord(status="optimal (exhaustive)")
    with pytest.raises(UnknownNameError, match="no per-op placements"):
        bare.explain("transformer.h.0.mlp")
