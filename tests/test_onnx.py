"""Annotated ONNX export: valid ONNX, runs like torch, carries the plan back, and bad annotations are caught.

Each model is planned (Megatron tensor parallel on dp=2 x tp=2, so that the
annotations are not all replicated) and exported once per session; the
tests share that file and only read it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import autopar
from autopar.core.errors import RuntimeMismatchError
from autopar.core.placements import REPLICATE as R
from autopar.core.placements import shard as S
from autopar.core.placements import texts
from autopar.onnx import OnnxError, OnnxPlan, export_onnx, read_onnx_plan, validate_onnx_plan
from autopar.onnx.annotations import NODE_KEY, PLAN_KEY, decode, encode
from autopar.verify.oracle import layout_plan, plan_with_layout
from examples.models import gpt2_tiny, llama_tiny, mlp_tiny

CLUSTER = autopar.Cluster.local(4)
FACTORIES = {"gpt2": gpt2_tiny, "llama": llama_tiny}


@dataclasses.dataclass
class Exported:
    name: str
    model: torch.nn.Module
    batch: dict
    plan: autopar.Plan
    path: str
    result: OnnxPlan


_EXPORTS: dict[str, Exported] = {}


def _exported(name: str, tmp_path_factory) -> Exported:
    """``name``'s model planned with a Megatron layout and exported, once per session."""
    if name not in _EXPORTS:
        torch.manual_seed(0)
        model, batch = FACTORIES[name]()
        plan = layout_plan(model, batch, CLUSTER, CLUSTER.world_size // 2, 2, "megatron")
        path = str(tmp_path_factory.mktemp("onnx") / f"{name}.onnx")
        _EXPORTS[name] = Exported(name, model, batch, plan, path, export_onnx(model, plan, path, batch))
    return _EXPORTS[name]


@pytest.fixture(params=sorted(FACTORIES))
def exported(request, tmp_path_factory) -> Exported:
    return _exported(request.param, tmp_path_factory)


@pytest.fixture
def gpt2(tmp_path_factory) -> Exported:
    return _exported("gpt2", tmp_path_factory)


@pytest.fixture
def llama(tmp_path_factory) -> Exported:
    return _exported("llama", tmp_path_factory)


def _session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the unoptimised graph makes ORT warn about constant folding
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def test_valid_onnx_that_runs_like_torch(exported: Exported) -> None:
    proto = onnx.load(exported.path)
    onnx.checker.check_model(proto, full_check=True)
    assert [o.name for o in proto.graph.output] == ["logits"]  # the inference graph, not the loss
    (logits,) = _session(exported.path).run(None, {"input_ids": exported.batch["input_ids"].numpy()})
    model = exported.model.eval()
    try:
        with torch.no_grad():
            ref = model(input_ids=exported.batch["input_ids"], use_cache=False).logits
    finally:
        model.train()
    np.testing.assert_allclose(logits, ref.numpy(), atol=1e-5, rtol=0)


def test_annotations_read_back_as_the_plan(exported: Exported) -> None:
    back = read_onnx_plan(exported.path)
    plan = exported.plan
    assert back.plan.to_dict() == plan.to_dict()
    assert back.num_devices == 4 and back.placements == exported.result.placements
    proto = onnx.load(exported.path, load_external_data=False)
    assert [(c.name, c.num_devices, len(c.device)) for c in proto.configuration] == [("autopar", 4, 4)]
    for tensor, placements in back.placements.items():
        assert placements == plan.placements[back.plan_nodes[tensor]]["outputs"][0], tensor
    # every parameter is annotated, under its initializer's name
    params = {e["param"]: name for name, e in plan.placements.items() if "param" in e}
    canon, first = {}, {}  # GPT-2 ties its head to the embedding: one parameter, two names
    for n, t in exported.model.named_parameters(remove_duplicate=False):
        canon[n] = first.setdefault(id(t), n)
    for init in proto.graph.initializer:
        if canon.get(init.name) in params:
            assert back.plan_nodes[init.name] == params[canon[init.name]], init.name
    assert set(params) <= {canon.get(n, n) for n in back.placements}
    # non-trivial: weights and activations split over tp, the batch over dp
    sharded = {t: p for t, p in back.placements.items() if any(x.is_shard() for x in p)}
    assert any(p[1].is_shard() for t, p in sharded.items() if t.endswith(".weight"))
    assert any(p[1].is_shard() for t, p in sharded.items() if not t.endswith(".weight"))
    assert back.placements["input_ids"] == (S(0), R)
    ops = [t for t in back.plan_nodes if not t.endswith((".weight", ".bias")) and t != "input_ids"]
    assert len(ops) > 50, "forward ops should be paired, not only parameters"


def test_partial_is_written_replicated_and_read_back_partial(exported: Exported) -> None:
    back = read_onnx_plan(exported.path)
    partial = [t for t, p in back.placements.items() if any(x.is_partial() for x in p)]
    if exported.name == "llama":  # the row-parallel linear's output is its view after the all-reduce
        assert back.placements["linear_3"][1] == R  # whole over tp (dp: the batch's split, the solver's choice)
        return
    assert partial, "GPT-2's row-parallel addmm has a partial output"
    name, placements = partial[0], back.placements[partial[0]]
    mesh = (2, 2)
    shards: dict[int, int] = {}  # tensor dim -> shards written: the Shard placements only, a partial axis none
    for size, p in zip(mesh, placements, strict=True):
        if p.is_shard():
            shards[p.dim] = shards.get(p.dim, 1) * size
    proto = onnx.load(exported.path, load_external_data=False)
    for node in proto.graph.node:
        for dc in node.device_configurations:
            for sp in dc.sharding_spec:
                if sp.tensor_name == name:
                    written = {d.axis: math.prod(x.num_shards for x in d.simple_sharding) for d in sp.sharded_dim}
                    assert written == shards
                    groups = {g.key: sorted(g.value) for g in sp.index_to_device_group_map}
                    pieces = [groups[d] for d in sp.device]
                    assert len(pieces) == math.prod(shards.values())  # one device group per piece
                    assert sorted(r for g in pieces for r in g) == [0, 1, 2, 3]  # the partial axis holds copies
                    note = json.loads(next(p.value for p in node.metadata_props if p.key == NODE_KEY))
                    assert note[name]["placements"] == texts(placements)  # written in the plain form
                    return
    raise AssertionError(f"no spec for {partial[0]}")


def _first_spec(proto: onnx.ModelProto, want=lambda sp, dim: True):
    """(node, device configuration, spec, sharded dim) of the first sharded spec for which ``want`` holds."""
    shapes = {t.name: list(t.dims) for t in proto.graph.initializer}
    for node in proto.graph.node:
        for dc in node.device_configurations:
            for sp in dc.sharding_spec:
                for sd in sp.sharded_dim:
                    if want(sp, shapes.get(sp.tensor_name, [None] * (sd.axis + 1))[sd.axis]):
                        return node, dc, sp, sd
    raise AssertionError("no sharded spec found")


def _unknown_tensor(p):
    _first_spec(p)[2].tensor_name = "no_such_tensor"


def _device_count(p):
    p.configuration[0].num_devices = 3
    del p.configuration[0].device[:]


def _not_dividing(p):
    _first_spec(p, lambda sp, dim: dim and dim % 3)[3].simple_sharding[0].num_shards = 3


def _not_a_mesh_axis(p):
    _first_spec(p, lambda sp, dim: dim and dim % 8 == 0)[3].simple_sharding[0].num_shards = 8


def _device_out_of_range(p):
    _first_spec(p)[2].device[0] = 99


def _wrong_dim_value(p):
    _first_spec(p)[3].simple_sharding[0].dim_value = 7


def _stage_outside_pp(p):
    _first_spec(p)[1].pipeline_stage = 3


def _note_disagrees(p):
    node, _, sp, _ = _first_spec(p)
    entry = next(e for e in node.metadata_props if e.key == NODE_KEY)
    notes = json.loads(entry.value)
    notes[sp.tensor_name]["placements"] = ["R", "R"]
    entry.value = json.dumps(notes)


def _two_layouts(p):  # one consumer says the tensor is replicated: specs disagree across nodes
    specs = [sp for n in p.graph.node for dc in n.device_configurations for sp in dc.sharding_spec]
    count = {sp.tensor_name: sum(s.tensor_name == sp.tensor_name for s in specs) for sp in specs}
    name = _first_spec(p, lambda sp, dim: count[sp.tensor_name] > 1)[2].tensor_name  # producer and consumer
    other = [sp for sp in specs if sp.tensor_name == name][-1]
    del other.sharded_dim[:]
    del other.device[:]
    other.device.extend([4])
    del other.index_to_device_group_map[:]
    other.index_to_device_group_map.add(key=4, value=[0, 1, 2, 3])
    for n in p.graph.node:  # drop the note so that only the specs speak
        for e in [e for e in n.metadata_props if e.key == NODE_KEY]:
            n.metadata_props.remove(e)


def _no_plan(p):
    for e in [e for e in p.metadata_props if e.key == PLAN_KEY]:
        p.metadata_props.remove(e)


CORRUPTIONS = {
    "unknown tensor": (_unknown_tensor, "unknown tensor 'no_such_tensor'"),
    "device count": (_device_count, "declares 3 devices"),
    "shards do not divide": (_not_dividing, "into 3, which does not divide"),
    "shards match no mesh axis": (_not_a_mesh_axis, "into 8, which no mesh axis of dp=2 x tp=2 gives"),
    "device out of range": (_device_out_of_range, "device 99, outside the 4 devices"),
    "dim value": (_wrong_dim_value, "has size 7"),
    "pipeline stage": (_stage_outside_pp, "stage 3, outside the plan's pp=1"),
    "note disagrees": (_note_disagrees, "note \\['R', 'R'\\]"),
    "two layouts": (_two_layouts, "is annotated .* on one node and"),
    "no plan": (_no_plan, "has no autopar plan"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupted_annotations_are_rejected(gpt2: Exported, corruption: str) -> None:
    edit, message = CORRUPTIONS[corruption]
    proto = onnx.load(gpt2.path, load_external_data=False)
    validate_onnx_plan(proto)  # intact, it passes
    edit(proto)
    onnx.checker.check_model(proto)  # ONNX's own checker does not look at these fields
    with pytest.raises(OnnxError, match=message) as err:
        validate_onnx_plan(proto)
    assert "\n" not in str(err.value)


def test_placements_survive_encoding() -> None:
    mesh, shape = (2, 2), (4, 6, 8)
    options = [R, S(0), S(1), S(2)]
    for placements in itertools.product(options, repeat=2):
        spec = encode(placements, shape, mesh, offset=0, world=4)
        assert decode(spec, 3, mesh, 0, 4) == placements
    # tp-sharded columns: one shard per tp rank, each held by both dp ranks (a group)
    spec = encode([R, S(1)], (64, 192), mesh, 0, 4)
    assert spec.sharded == ((1, 192, 2),)
    assert [dict(spec.groups)[d] for d in spec.devices] == [(0, 2), (1, 3)]
    # both axes split one dim dp-major, as DTensor does
    spec = encode([S(0), S(0)], (8, 3), mesh, 0, 4)
    assert spec.sharded == ((0, 8, 4),) and spec.devices == (0, 1, 2, 3)
    assert encode([S(1), S(0)], (8, 4), mesh, 0, 4).devices == (0, 2, 1, 3)
    # a split over a mesh axis of size 1 stays written (one shard), so it reads back as written
    spec = encode([S(0), S(1)], (8, 4), (1, 4), 0, 4)
    assert spec.sharded == ((0, 8, 1), (1, 4, 4)) and decode(spec, 2, (1, 4), 0, 4) == (S(0), S(1))


def test_stages_and_plans_without_placements(tmp_path, caplog) -> None:
    torch.manual_seed(0)
    model, inputs = mlp_tiny()
    cluster = autopar.Cluster.local(2)
    plan = autopar.plan(model, inputs, cluster, precision="fp32", fixed={"dp": 2})
    plan = plan_with_layout(plan, model, inputs, cluster, "dp")
    staged = dataclasses.replace(
        plan, mesh={**plan.mesh, "pp": 2}, stages=[{"modules": ["up"]}, {"modules": ["down"]}]
    )
    back = export_onnx(model, staged, tmp_path / "mlp.onnx", inputs)
    assert back.num_devices == 4 and set(back.stages.values()) == {0, 1}
    assert back.placements["up.weight"] == plan.placements["p_up_weight"]["outputs"][0]
    assert back.placements["x"] == (S(0), R)  # positional inputs pair by order
    proto = onnx.load(str(tmp_path / "mlp.onnx"))
    for node in proto.graph.node:
        for dc in node.device_configurations:
            if dc.pipeline_stage == 1:  # stage 1 runs on ranks 2 and 3
                for sp in dc.sharding_spec:
                    groups = {g.key: list(g.value) for g in sp.index_to_device_group_map}
                    assert all(m >= 2 for d in sp.device for m in groups.get(d, [d]))
    (loss,) = _session(str(tmp_path / "mlp.onnx")).run(
        None, {"x": inputs[0].numpy(), "target": inputs[1].numpy()}
    )
    np.testing.assert_allclose(loss, model(*inputs).detach().numpy(), atol=1e-5, rtol=0)

    with caplog.at_level(logging.WARNING, logger="autopar.onnx"):
        bare = export_onnx(model, dataclasses.replace(plan, placements={}), tmp_path / "dp.onnx", inputs)
    assert bare.placements == {} and bare.num_devices == 2
    assert "no per-op placements" in caplog.text


def test_refusals(llama: Exported, tmp_path) -> None:
    model, batch = gpt2_tiny()
    with pytest.raises(RuntimeMismatchError, match="made for another model"):
        export_onnx(model, llama.plan, tmp_path / "x.onnx", batch)
    with pytest.raises(OnnxError, match="cannot read ONNX file"):
        read_onnx_plan(tmp_path / "missing.onnx")
    proto = onnx.load(llama.path, load_external_data=False)
    onnx.save(proto, str(tmp_path / "copy.onnx"))
    assert read_onnx_plan(tmp_path / "copy.onnx").placements == llama.result.placements
