"""Plan placements <-> ONNX sharding specs, and the validator that reads them back.

``onnx.checker`` checks operators and types, not the multi-device fields: a
spec naming a tensor the node never touches, a device count that is not the
plan's, or a shard count that does not divide the axis all pass it. A file
that says the wrong thing about where tensors live is worse than one that
says nothing, so ``validate_onnx_plan`` checks each spec against its graph
and the plan, and decodes it back into the plan's placements.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from autopar.core.errors import AutoparError, PlanFormatError
from autopar.core.mesh import SHARDING_AXES, world_size
from autopar.core.placements import REPLICATE, Placements, parse_all, shard, texts
from autopar.plans.plan import Plan

log = logging.getLogger(__name__)

CONFIGURATION = "autopar"  # name of the DeviceConfigurationProto autopar writes
PLAN_KEY = "autopar.plan"  # ModelProto.metadata_props: the plan's JSON
NODE_KEY = "autopar.sharding"  # NodeProto.metadata_props: {tensor: {"placements", "plan_node"}}
MULTI_DEVICE_IR_VERSION = 11  # the first ONNX IR with configuration / device_configurations


class OnnxError(AutoparError):
    """An ONNX export failed, or an ONNX file's autopar annotations do not fit its graph."""


@dataclass
class OnnxPlan:
    """The plan an annotated ONNX file carries, read back from the file's own fields.

    ``placements`` maps each annotated tensor to one placement per mesh axis
    (``SHARDING_AXES``), as the plan holds them; ``plan_nodes``
    names the node of the plan's joint graph each annotation came from;
    ``stages`` maps ONNX node names to their pipeline stage, where set.
    """

    plan: Plan
    placements: dict[str, Placements] = field(default_factory=dict)
    plan_nodes: dict[str, str] = field(default_factory=dict)
    stages: dict[str, int] = field(default_factory=dict)
    num_devices: int = 1
    annotated_nodes: int = 0


# ---- placements <-> specs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A sharding spec as plain data: [(axis, dim, num_shards)], one device entry per shard, groups."""

    sharded: tuple[tuple[int, int | None, int], ...]
    devices: tuple[int, ...]
    groups: tuple[tuple[int, tuple[int, ...]], ...]

    def canonical(self) -> tuple:
        """What two specs must share to describe one layout (group keys and dim sizes aside)."""
        groups = dict(self.groups)
        holders = tuple(frozenset(groups.get(d, (d,))) for d in self.devices)
        return tuple((a, n) for a, _, n in self.sharded), holders


def mesh_of(plan: Plan) -> tuple[int, ...]:
    return tuple(int(plan.mesh.get(a, 1)) for a in SHARDING_AXES)


def world_of(plan: Plan) -> int:
    return world_size(plan.mesh)


def as_sharded(placements: Placements) -> Placements:
    """Partial values as ONNX can say them: the full value, replicated on that mesh axis."""
    return tuple(REPLICATE if p.is_partial() else p for p in placements)


def encode(placements: Placements, shape: tuple, mesh: tuple[int, ...], offset: int, world: int) -> Spec:
    """The spec of a tensor of ``shape`` placed ``placements`` (no partials) on ``mesh``, ranks from ``offset``."""
    split, devices, groups = _layout(tuple(placements), len(shape), mesh, offset, world)
    return Spec(tuple((a, shape[a], n) for a, n in split), devices, groups)


@functools.lru_cache(maxsize=4096)
def _layout(placements: Placements, rank: int, mesh: tuple[int, ...], offset: int, world: int) -> tuple:
    """(sharded (axis, num_shards), device entries, groups): what ``encode`` computes, shape aside (cached)."""
    split: dict[int, list[int]] = {}  # tensor axis -> mesh axes splitting it, outer first
    for mesh_axis, p in enumerate(placements):
        if not p.is_shard():
            if not p.is_replicate():
                raise OnnxError(f"not a placement ONNX can express: {str(p)!r}")
            continue
        d = p.dim + rank if p.dim < 0 else p.dim
        if not 0 <= d < rank:
            raise OnnxError(f"placement {p} names axis {d} of a tensor of rank {rank}")
        split.setdefault(d, []).append(mesh_axis)
    sharded = tuple((axis, math.prod(mesh[a] for a in split[axis])) for axis in sorted(split))
    holders: dict[int, list[int]] = {}
    for coord in itertools.product(*(range(s) for s in mesh)):
        device = 0
        for c, s in zip(coord, mesh, strict=True):
            device = device * s + c
        shard = 0
        for axis, n in sharded:
            i = 0
            for a in split[axis]:
                i = i * mesh[a] + coord[a]
            shard = shard * n + i
        holders.setdefault(shard, []).append(offset + device)
    devices, groups = [], []
    for shard in range(len(holders)):
        members = holders[shard]
        if len(members) == 1:
            devices.append(members[0])
        else:  # a group key outside the device range, so that no reader mistakes it for a device
            devices.append(world + shard)
            groups.append((world + shard, tuple(members)))
    return sharded, tuple(devices), tuple(groups)


def decode(spec: Spec, rank: int, mesh: tuple[int, ...], offset: int, world: int) -> Placements | None:
    """The placements (no partials) whose spec is ``spec``, replicated preferred; None if none is."""
    want = spec.canonical()
    options = [REPLICATE] + [shard(a) for a, _, _ in spec.sharded]
    for cand in itertools.product(options, repeat=len(mesh)):
        split, devices, groups = _layout(cand, rank, mesh, offset, world)
        if Spec(tuple((a, None, n) for a, n in split), devices, groups).canonical() == want:
            return tuple(cand)
    return None


# ---- reading and validating -------------------------------------------------------------------------


def read_onnx_plan(path: str | Path) -> OnnxPlan:
    """The plan and per-tensor placements an annotated ONNX file carries, validated against its graph.

    Weights are not loaded (only the graph is needed), so this is cheap for
    a model with its weights in external data.
    """
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - missing file, not protobuf, ...: one line either way
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise OnnxError(f"cannot read ONNX file {path}: {first}") from None
    return validate_onnx_plan(model, source=str(path))


def validate_onnx_plan(model: onnx.ModelProto, source: str = "the model") -> OnnxPlan:
    """Check that the autopar annotations of ``model`` fit its graph and its plan; return them.

    Raises OnnxError (one line) for: no or unreadable plan; no "autopar"
    configuration, or one whose device count is not the plan's world size; a
    spec naming a tensor its node neither reads nor writes; an axis out of
    range; a shard count that does not divide the axis or that no product of
    mesh axis sizes gives; devices that do not lay out a placement on the
    mesh; a pipeline stage outside pp; specs or notes disagreeing about a
    tensor. Configurations other than "autopar" are left alone.
    """
    meta = {p.key: p.value for p in model.metadata_props}
    if PLAN_KEY not in meta:
        raise OnnxError(
            f"{source} has no autopar plan (metadata_props[{PLAN_KEY!r}]): export it with autopar.export_onnx"
        )
    try:
        plan = Plan.from_dict(json.loads(meta[PLAN_KEY]), source=f"the plan in {source}")
    except json.JSONDecodeError as err:
        raise OnnxError(f"the plan in {source} is not valid JSON ({err.msg})") from None
    except PlanFormatError as err:
        raise OnnxError(str(err)) from None
    mesh, world, pp = mesh_of(plan), world_of(plan), int(plan.mesh.get("pp", 1))
    configs = {c.name: c for c in model.configuration}
    config = configs.get(CONFIGURATION)
    if config is None:
        raise OnnxError(f"{source} has no device configuration named {CONFIGURATION!r}")
    if config.num_devices != world:
        raise OnnxError(
            f"{source}: configuration {CONFIGURATION!r} declares {config.num_devices} devices but the plan's "
            f"mesh {plan.mesh_str()} has {world}"
        )
    if config.device and len(config.device) != world:
        raise OnnxError(
            f"{source}: configuration {CONFIGURATION!r} names {len(config.device)} devices, not {world}"
        )

    shapes = _shapes(model)
    result = OnnxPlan(plan=plan, num_devices=world)
    for node in model.graph.node:
        if not node.device_configurations:
            continue
        label = node.name or node.op_type
        notes = _notes(node, label)
        io = set(node.input) | set(node.output)
        for dc in node.device_configurations:
            if dc.configuration_id not in configs:
                raise OnnxError(
                    f"node {label!r} refers to unknown device configuration {dc.configuration_id!r}"
                )
            if dc.configuration_id != CONFIGURATION:
                continue  # another tool's configuration: not ours to judge
            stage = dc.pipeline_stage if dc.HasField("pipeline_stage") else None
            if stage is not None:
                if not 0 <= stage < pp:
                    raise OnnxError(
                        f"node {label!r} is in pipeline stage {stage}, outside the plan's pp={pp}"
                    )
                result.stages[node.name] = stage
            result.annotated_nodes += 1
            for sp in dc.sharding_spec:
                name = sp.tensor_name
                if name not in io:
                    raise OnnxError(f"node {label!r} has a sharding spec for unknown tensor {name!r}")
                if name not in shapes:
                    raise OnnxError(f"node {label!r} shards {name!r}, whose shape the model does not state")
                offset = (stage or 0) * mesh[0] * mesh[1]
                placements = _check_spec(sp, shapes[name], mesh, offset, world, label, notes.get(name))
                if result.placements.setdefault(name, placements) != placements:
                    raise OnnxError(
                        f"{name!r} is annotated {texts(result.placements[name])} on one node and {texts(placements)} "
                        f"on {label!r}"
                    )
                if isinstance(notes.get(name), dict) and notes[name].get("plan_node"):
                    result.plan_nodes[name] = str(notes[name]["plan_node"])
    return result


def _notes(node: onnx.NodeProto, label: str) -> dict[str, Any]:
    raw = next((p.value for p in node.metadata_props if p.key == NODE_KEY), None)
    if raw is None:
        return {}
    try:
        notes = json.loads(raw)
    except json.JSONDecodeError:
        raise OnnxError(f"node {label!r} has unreadable {NODE_KEY} metadata") from None
    if not isinstance(notes, dict):
        raise OnnxError(f"node {label!r} has {NODE_KEY} metadata that is not a JSON object")
    return notes


def _shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """Tensor name -> shape (None for a symbolic dim), as the model states it or shape inference implies."""

    def read(m: onnx.ModelProto) -> dict[str, tuple]:
        out: dict[str, tuple] = {t.name: tuple(t.dims) for t in m.graph.initializer}
        for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
                out.setdefault(vi.name, dims)
        return out

    shapes = read(model)
    wanted = {
        sp.tensor_name for n in model.graph.node for dc in n.device_configurations for sp in dc.sharding_spec
    }
    if wanted - shapes.keys():
        try:
            shapes = {**read(onnx.shape_inference.infer_shapes(model)), **shapes}
        except Exception as err:  # noqa: BLE001 - a best effort: tensors still without shape are reported
            log.debug("shape inference failed: %s", err)
    return shapes


def _check_spec(
    sp: onnx.ShardingSpecProto,
    shape: tuple,
    mesh: tuple[int, ...],
    offset: int,
    world: int,
    label: str,
    note: Any,
) -> Placements:
    """One spec against its tensor and the mesh; its placements (the note's, once it agrees)."""
    name, rank = sp.tensor_name, len(shape)
    products = {math.prod(c) for k in range(len(mesh) + 1) for c in itertools.combinations(mesh, k)}
    mesh_text = " x ".join(f"{a}={s}" for a, s in zip(SHARDING_AXES, mesh, strict=True))
    sharded = []
    for sd in sp.sharded_dim:
        if not -rank <= sd.axis < rank:
            raise OnnxError(f"node {label!r} shards {name!r} on axis {sd.axis}, but it has rank {rank}")
        axis = sd.axis % rank
        if len(sd.simple_sharding) != 1:
            raise OnnxError(
                f"node {label!r} splits {name!r} axis {axis} with {len(sd.simple_sharding)} simple shardings; "
                "a placement on a device mesh gives one"
            )
        ss = sd.simple_sharding[0]
        n, dim = ss.num_shards, shape[axis]
        if ss.HasField("dim_value") and dim is not None and ss.dim_value != dim:
            raise OnnxError(
                f"node {label!r} says {name!r} axis {axis} has size {ss.dim_value}; the graph says {dim}"
            )
        if n < 1 or (dim is not None and dim % n):
            raise OnnxError(
                f"node {label!r} splits {name!r} axis {axis} (size {dim}) into {n}, which does not divide it"
            )
        if n not in products:
            raise OnnxError(
                f"node {label!r} splits {name!r} axis {axis} into {n}, which no mesh axis of {mesh_text} gives"
            )
        sharded.append((axis, dim, n))
    groups = {g.key: tuple(g.value) for g in sp.index_to_device_group_map}
    for d in sp.device:
        for member in groups.get(d, (d,)):
            if not 0 <= member < world:
                raise OnnxError(
                    f"node {label!r} places {name!r} on device {member}, outside the {world} devices"
                )
    shards = math.prod(n for _, _, n in sharded)
    if len(sp.device) != shards:
        raise OnnxError(f"node {label!r} lists {len(sp.device)} devices for the {shards} shards of {name!r}")
    spec = Spec(tuple(sharded), tuple(sp.device), tuple(groups.items()))
    decoded = decode(spec, rank, mesh, offset, world)
    if decoded is None:
        raise OnnxError(
            f"node {label!r}: the devices of {name!r} lay out no placement on the mesh {mesh_text}"
        )
    if note is None:
        return decoded
    written = note.get("placements") if isinstance(note, dict) else None
    if not isinstance(written, list) or len(written) != len(mesh):
        raise OnnxError(f"node {label!r}: the {NODE_KEY} note on {name!r} has no placement per mesh axis")
    placements: Placements = ()
    try:
        placements = parse_all(str(p) for p in written)
        agrees = encode(as_sharded(placements), shape, mesh, offset, world).canonical() == spec.canonical()
    except (OnnxError, ValueError):
        agrees = False
    if not agrees:
        raise OnnxError(
            f"node {label!r}: the spec of {name!r} says {texts(decoded)}, its {NODE_KEY} note "
            f"{[str(p) for p in written]}"
        )
    return placements
