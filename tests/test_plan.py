"""The Plan object: JSON round trip, clear errors on bad files, a readable summary."""

import json

import pytest

from autopar import Cluster, Plan, PlanFormatError
from autopar.cost_models.estimate import Estimate, MemoryEstimate
from autopar.plans.data import FORMAT_VERSION
from autopar.plans.op_records import ChargedCollective, OpAlternative, OpRecord, OpRecords
from autopar.plans.records import SearchRecord, ShardingFacts


def _plan() -> Plan:
    cluster = Cluster.preset("dgx-h100", nodes=8)
    est = Estimate(
        step_time_s=1.5,
        samples_per_s=341.3,
        mfu=0.42,
        memory=MemoryEstimate(
            params=1e9, grads=2e9, optimizer=3e9, activations=4e9, buffers=5e8, peak=1.05e10
        ),
        memory_limit=80e9,
        collectives=[{"kind": "all_reduce", "axis": "dp", "bytes": 25e6, "count": 10, "time_s": 0.01}],
    )
    return Plan(
        model="GPT2LMHeadModel",
        fingerprint="abc",
        num_params=7_500_000_000,
        cluster=cluster.to_dict(),
        cluster_description=cluster.describe(),
        mesh={"dp": 64, "tp": 1, "pp": 1},
        zero=3,
        global_batch_size=512,
        micro_batch_size=8,
        estimate=est,
        solver=SearchRecord(status="optimal", gap=0.0, candidates=4),
    )


def test_json_round_trip(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.estimate.memory.model_states == 6e9
    assert Cluster.from_dict(loaded.cluster) == Cluster.preset("dgx-h100", nodes=8)
    assert json.loads(path.read_text())["format_version"] == FORMAT_VERSION


def test_a_format_1_plan_still_loads_with_its_search_record(tmp_path):
    """Format 1 kept the search record as a loose dict, each mesh's phase timings flattened into it."""
    data = _plan().to_dict()
    data["format_version"] = 1
    data["solver"] = {
        "status": "optimal",
        "gap": 0.01,
        "meshes": [
            {"mesh": {"dp": 64, "tp": 1, "pp": 1}, "microbatches": 2, "status": "optimal", "source": "dp seed",
             "step_time_s": 1.5, "peak_bytes": 1e10, "fits": True, "strategies_s": 0.25, "solve_s": 1.0},
        ],
        "alternatives": [
            {"mesh": {"dp": 64, "tp": 1, "pp": 1}, "zero": 3, "microbatches": 2, "step_time_s": 1.5,
             "peak_bytes": 1e10, "fits": True},
        ],
        "charged": [{"from": "a", "to": "b", "kind": "all_gather"}],
        "retired_key": 1,
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    plan = Plan.load(path)
    assert plan.format_version == FORMAT_VERSION
    record = plan.solver.mesh_record({"dp": 64, "tp": 1, "pp": 1})
    assert record.source == "dp seed" and record.timings == {"strategies_s": 0.25, "solve_s": 1.0}
    assert plan.solver.alternatives[0].zero == 3
    assert plan.solver.charged == [ChargedCollective("all_gather", src="a", dst="b")]
    assert "found by the dp seed seed" in plan.summary() or "found by the dp seed" in plan.summary()
    plan.save(path)
    assert Plan.load(path) == plan


def _format_2_solver() -> dict:
    """A format-2 search record: charged collectives, per-op records and sharding facts as loose dicts."""
    edge = {"kind": "all_reduce", "axis": "tp", "bytes": 4096.0, "from": "mm", "to": "add", "reason": "data"}
    return {
        "status": "optimal",
        "charged": [{**edge, "from_module": "h.0.mlp", "to_module": "h.0", "phase": "forward", "from_param": False}],
        "ops": {
            "format": 1,
            "axes": ["dp", "tp"],
            "mesh": {"dp": 32, "tp": 2},
            "source": "milp",
            "status": "optimal",
            "memory_limit": 8e10,
            "peak": 1e10,
            "records": {
                "mm": {
                    "op": "aten.mm.default", "module": "h.0.mlp", "phase": "forward", "flops": 1e12, "n": 4,
                    "forbidden": 1, "copies": 2, "collectives": [edge], "why": "cheapest",
                    "alts": [{"out": "S(0),S(1)", "in": ["S(0),R", "R,S(1)"], "compute_s": 1e-3, "comm_s": 2e-4,
                              "mem": 1e6}],
                },
                "p_w": {"op": "placeholder", "param": "h.0.mlp.w", "n": 2, "forbidden": 0, "why": "only one",
                        "alts": [{"out": "R,S(1)", "in": [], "compute_s": 0.0, "comm_s": 0.0, "mem": 2e6}]},
            },
            "same_as": {"mm_1": "mm"},
            "dropped": 3,
        },
        "sharding": {"param_elements": 100, "zero_elements": {"0": 40, "3": 60},
                     "split_elements": {"none": 40, "dp": 60}},
    }


def test_a_format_2_plan_still_loads_with_typed_records(tmp_path):
    """Format 2 kept the charged collectives, per-op records and sharding facts as loose dicts."""
    data = _plan().to_dict()
    data["format_version"] = 2
    data["solver"] = _format_2_solver()
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    plan = Plan.load(path)
    assert plan.format_version == FORMAT_VERSION
    edge = ChargedCollective("all_reduce", "tp", 4096.0, "mm", "add", "data")
    assert plan.solver.charged == [ChargedCollective(**{**vars(edge), "src_module": "h.0.mlp", "dst_module": "h.0",
                                                        "phase": "forward"})]
    ops = plan.solver.ops
    assert (ops.mesh, ops.dropped, ops.same_as) == ({"dp": 32, "tp": 2}, 3, {"mm_1": "mm"})
    assert ops.records["mm"] == OpRecord(
        op="aten.mm.default", module="h.0.mlp", phase="forward", flops=1e12, strategies=4, forbidden=1,
        alternatives=[OpAlternative("S(0),S(1)", ["S(0),R", "R,S(1)"], 1e-3, 2e-4, 1e6)], why="cheapest",
        copies=2, collectives=[edge],
    )
    assert ops.record_of("mm_1") == (ops.records["mm"], "mm")
    assert ops.records["p_w"].param == "h.0.mlp.w" and ops.records["p_w"].chosen.outputs == "R,S(1)"
    assert plan.solver.sharding == ShardingFacts(100, {0: 40, 3: 60}, {"none": 40, "dp": 60})
    plan.save(path)
    assert json.loads(path.read_text())["format_version"] == FORMAT_VERSION
    assert Plan.load(path) == plan


def test_typed_records_round_trip_in_the_current_format(tmp_path):
    """Format 3 writes the records under their fields' names, defaults left out, and reads them back equal."""
    plan = _plan()
    edge = ChargedCollective("all_gather", "dp", 1e6, "p_w", "p_w", "zero", src_param=True)
    plan.solver.charged = [edge]
    plan.solver.ops = OpRecords(
        axes=["dp", "tp"],
        records={"p_w": OpRecord(op="placeholder", param="w", strategies=2, collectives=[edge],
                                 alternatives=[OpAlternative("S(0),R", [], memory=5e5)])},
    )
    plan.solver.sharding = ShardingFacts(10, {3: 10}, {"dp": 10})
    path = tmp_path / "plan.json"
    plan.save(path)
    written = json.loads(path.read_text())["solver"]
    assert written["charged"] == [{"kind": "all_gather", "axis": "dp", "bytes": 1e6, "src": "p_w", "dst": "p_w",
                                   "reason": "zero", "src_param": True}]
    assert written["ops"]["records"]["p_w"]["alternatives"] == [{"outputs": "S(0),R", "memory": 5e5}]
    assert Plan.load(path) == plan


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"model": "x"}', "no integer 'format_version'"),
        ('{"format_version": 99}', "newer than this autopar reads"),
        ('{"format_version": 1, "model": "x"}', "malformed"),
    ],
)
def test_bad_files_give_one_line_errors(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(PlanFormatError) as err:
        Plan.load(path)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_field_and_bad_mesh_are_malformed(tmp_path):
    data = _plan().to_dict()
    data["surprise"] = 1
    with pytest.raises(PlanFormatError, match="unexpected field"):
        Plan.from_dict(data)
    data = _plan().to_dict()
    data["mesh"] = {"dp": 0, "tp": 1, "pp": 1}
    with pytest.raises(PlanFormatError, match="mesh needs a positive integer 'dp'"):
        Plan.from_dict(data)


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(PlanFormatError, match="cannot read plan file"):
        Plan.load(tmp_path / "nope.json")


def test_summary_reads_like_a_table():
    text = _plan().summary()
    for needle in (
        "GPT2LMHeadModel",
        "dp=64 x tp=1 x pp=1",
        "ZeRO stage",
        "42.0%",
        "10.50",
        "all_reduce",
        "8 nodes x 8 H100-80GB",
    ):
        assert needle in text, needle


def test_the_search_line_says_the_time_spent_against_the_limit_and_why_meshes_were_left_out():
    from autopar.plans.data import FORMAT_VERSION
    from autopar.plans.records import SearchRecord, solver_line

    stopped = "pipelines: time limit reached after 3 of 27 meshes"
    record = SearchRecord(status="feasible", time_s=48.0, time_limit_s=60.0, stopped=stopped)
    line = solver_line(record)
    assert "48.00 s of the 60 s limit" in line and line.endswith(stopped)
    again = SearchRecord.from_dict(record.to_dict(), FORMAT_VERSION)
    assert (again.time_limit_s, again.stopped) == (60.0, stopped)
