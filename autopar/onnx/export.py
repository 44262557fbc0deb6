"""Export: the model's forward through torch.onnx, paired with the plan's joint graph, then annotated.

The plan speaks of nodes of autopar's joint training graph (dispatcher-level
ATen, captured with ``autopar.capture.joint``); the ONNX file holds the graph
``torch.onnx.export`` traced for inference. They are two traces of one
forward, so they are paired by what both keep: parameter names (the
initializers), input names, and for ops the module path, the kind of op,
its position among ops of that kind in the module, and its shape. See the
package docstring for what is and is not annotated.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch
import torch.fx as fx
from torch import nn

from autopar.capture.inputs import hf_no_cache
from autopar.capture.joint import CapturedGraph, node_module, node_phase
from autopar.codegen.transfer import transfer_placements
from autopar.core.errors import RuntimeMismatchError
from autopar.core.mesh import SHARDING_AXES
from autopar.core.placements import Placements, texts
from autopar.cost_models.graph_cache import captured_with_stats, example_batch
from autopar.cost_models.graph_stats import model_fingerprint
from autopar.onnx.annotations import (
    CONFIGURATION,
    MULTI_DEVICE_IR_VERSION,
    NODE_KEY,
    PLAN_KEY,
    OnnxError,
    OnnxPlan,
    as_sharded,
    encode,
    mesh_of,
    read_onnx_plan,
    world_of,
)
from autopar.plans.plan import Plan

log = logging.getLogger(__name__)

DROPPED_INPUTS = ("labels",)  # an inference graph takes no targets; HF models then return logits, not a loss

# Kinds of op that the joint graph (dispatcher-level ATen) and torch.onnx's graph (which keeps composite
# ops) name differently: both names map to one kind.
_KIND = {
    "aten.mm.default": "matmul",
    "aten.addmm.default": "matmul",
    "aten.bmm.default": "matmul",
    "aten.baddbmm.default": "matmul",
    "aten.matmul.default": "matmul",
    "aten.linear.default": "matmul",
    "aten.layer_norm.default": "layer_norm",
    "aten.native_layer_norm.default": "layer_norm",
    "aten.scaled_dot_product_attention.default": "attention",
    "aten._scaled_dot_product_flash_attention_for_cpu.default": "attention",
    "aten._scaled_dot_product_flash_attention.default": "attention",
    "aten._scaled_dot_product_efficient_attention.default": "attention",
    "aten._scaled_dot_product_cudnn_attention.default": "attention",
    "aten.view.default": "view",
    "aten._unsafe_view.default": "view",
    "aten.reshape.default": "view",
}
# Ops one graph has and the other drops or places freely: counting them would shift the pairing.
_UNPAIRED = {"aten.detach.default", "aten.alias.default", "aten.clone.default"}
_FX_NODE = re.compile(r"^%(\S+) : .*?call_function\[target=([^\]]+)\]")
_SCOPES = "pkg.torch.onnx.name_scopes"  # torch.onnx's record of the module path of each node


def export_onnx(
    model: nn.Module,
    plan: Plan,
    path: str | Path,
    example_inputs: Any,
    loss_fn: Any = None,
    example_targets: Any = None,
) -> OnnxPlan:
    """Write ``model``'s inference graph to ``path`` as ONNX, annotated with ``plan``; return what was written.

    The graph is ``torch.onnx.export(..., dynamo=True)`` of the model's
    forward in eval mode on ``example_inputs`` (static shapes), with a
    keyword input named ``labels`` left out: its outputs are the model's
    outputs (for a HuggingFace causal LM, ``logits``), not the loss. The
    exporter's graph optimizer is not run: it merges parameters with equal
    values and folds transposed weights into unnamed constants, which would
    cut the link between initializers and the plan's parameters.

    ``example_inputs``, ``loss_fn`` and ``example_targets`` are those the
    plan was made with: the model is captured again (shapes only) to pair
    the plan's joint graph with the exported one. The model needs real
    weights. The file is read back and validated before this returns.
    """
    cls = type(model).__name__
    trainable = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    if model_fingerprint(trainable) != plan.fingerprint:
        raise RuntimeMismatchError(
            f"the plan was made for another model ({plan.model}; parameter names or shapes differ from this "
            f"{cls}): plan this model"
        )
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise OnnxError(
            f"{cls} has weights on the meta device; ONNX export needs real weights: build it on a device"
        )
    captured = None
    if plan.placements:
        captured, _ = captured_with_stats(
            model, example_inputs, loss_fn, example_targets, batch=example_batch(example_inputs)
        )
    else:
        log.warning(
            "the plan has no per-op placements (the data-parallel model chose it): the ONNX file gets the "
            "device configuration and the plan JSON, no sharding specs"
        )
    program, names = _export(model, example_inputs)
    ir_model = program.model
    found = _pair(ir_model, captured, plan, model) if captured is not None else {}
    outputs = ir_model.graph.outputs
    if names and len(names) == len(outputs):  # after pairing, which reads the exporter's names
        for value, name in zip(outputs, names, strict=True):
            value.name = name
    _annotate(ir_model, plan, found)
    path = Path(path)
    program.save(str(path))
    result = read_onnx_plan(path)
    log.info(
        "wrote %s: %d tensors annotated on %d nodes, %d devices",
        path,
        len(result.placements),
        result.annotated_nodes,
        result.num_devices,
    )
    return result


def _export(model: nn.Module, example_inputs: Any) -> tuple[Any, list[str] | None]:
    """torch.onnx's ONNXProgram of the model's forward in eval mode, and the names of the model's outputs."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), {k: v for k, v in example_inputs.items() if k not in DROPPED_INPUTS}
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        args, kwargs = tuple(example_inputs), {}
    hf_no_cache(model, kwargs)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
        program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, optimize=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - every exporter failure becomes one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise OnnxError(f"torch.onnx.export could not export {type(model).__name__}: {first}") from exc
    finally:
        model.train(was_training)
    return program, _output_names(out)


def _output_names(out: Any) -> list[str] | None:
    """Keys of a dict-like output whose values are all tensors (a HuggingFace ModelOutput), else None."""
    if isinstance(out, dict):
        items = [(k, v) for k, v in out.items() if v is not None]
        if items and all(isinstance(v, torch.Tensor) for _, v in items):
            return [str(k) for k, _ in items]
    return None


# ---- pairing the plan's joint graph with the exported graph -----------------------------------------


@dataclass
class _Found:
    placements: Placements
    plan_node: str


def _pair(ir_model: Any, captured: CapturedGraph, plan: Plan, model: nn.Module) -> dict[Any, _Found]:
    """Annotated ONNX value -> its placements: initializers, graph inputs, paired op outputs."""
    graph = ir_model.graph
    found: dict[Any, _Found] = {}
    # this capture's names may be other nodes' in the plan's graph (another batch, another hash seed):
    # a captured node is annotated with the plan node it carries the entry of
    carried, mapping = transfer_placements(plan.placements, captured, tuple(plan.mesh[a] for a in SHARDING_AXES))
    plan_node = {
        run: name for name, run in mapping.items() if carried[run]["outputs"] == plan.placements[name]["outputs"]
    }

    def take(value: Any, node: str, joint_shape: Any = None) -> None:
        """Annotate ``value`` with the first output placement of captured node ``node``'s plan node, if any."""
        node = plan_node.get(node, "")
        entry = plan.placements.get(node)
        outs = entry.get("outputs") if isinstance(entry, dict) else None
        p = outs[0] if outs else None
        if p is None or len(p) != len(SHARDING_AXES):
            return
        if joint_shape is not None and _shape(value.shape) != tuple(joint_shape):
            return
        found[value] = _Found(tuple(p), node)

    # parameters and buffers: initializer names are qualified names, maybe a tied alias or sanitised
    canon: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        canon[name] = first.setdefault(id(t), name)
    for name in list(canon):
        canon.setdefault(re.sub(r"\W", "_", name), canon[name])
    state = {info.name: info for info in [*captured.params, *captured.buffers]}
    for name, value in graph.initializers.items():
        info = state.get(canon.get(name) or canon.get(re.sub(r"\W", "_", name), ""))
        if info is not None:
            take(value, info.placeholder, joint_shape=info.shape)

    # graph inputs: by name (keyword inputs), else in order
    inputs = [i for i in captured.inputs if not i.name.startswith("target") and i.name not in DROPPED_INPUTS]
    by_name = {i.name: i for i in inputs}
    user = [v for v in graph.inputs if v.name not in graph.initializers]
    onnx_names = {v.name for v in user}
    unnamed = iter([i for i in inputs if i.name not in onnx_names])
    for value in user:
        info = by_name.get(value.name) or next(unnamed, None)
        if info is not None:
            take(value, info.placeholder, joint_shape=info.shape)

    # ops: per (module, kind), in order, one to one
    exported = _exported_ops(graph)
    if not exported:
        log.warning(
            "the exported graph has no torch.onnx node metadata: only parameters and inputs annotated"
        )
    joint = _joint_ops(captured.gm)
    skipped = []
    for key, ops in exported.items():
        pairs = joint.get(key, [])
        if len(pairs) != len(ops):
            skipped.append(f"{key[1]} in {key[0] or '<top>'} ({len(ops)} exported, {len(pairs)} planned)")
            continue
        chosen: list[tuple[Any, fx.Node]] | None = []
        for (name, value), jnode in zip(ops, pairs, strict=True):
            src = _joint_value(jnode, _shape(value.shape)) if value is not None else jnode
            if src is None:  # a shape that does not pair: the order is not to be trusted either
                chosen = None
                skipped.append(f"{key[1]} in {key[0] or '<top>'} (shapes differ at {name})")
                break
            if value is not None:
                chosen.append((value, src))
        for value, src in chosen or []:
            take(value, src.name)
    if skipped:
        log.debug("ops left unannotated: %s", "; ".join(skipped))
    return found


def _shape(shape: Any) -> tuple | None:
    if shape is None:
        return None
    return tuple(d if isinstance(d, int) else None for d in shape)


def _exported_ops(graph: Any) -> dict[tuple[str, str], list[tuple[str, Any]]]:
    """(module, kind) -> [(fx node name, the ONNX value it produced or None)] in graph order.

    torch.onnx records on every ONNX node the FX node it was lowered from and
    the module scopes; the FX node's result is the ONNX value named after it.
    """
    values = {}
    ops: dict[str, tuple[str, str]] = {}
    for node in graph:
        meta = node.metadata_props
        m = _FX_NODE.match(meta.get("pkg.torch.onnx.fx_node", ""))
        if m is None:
            continue
        name, target = m.group(1), m.group(2).removeprefix("torch.ops.")
        for out in node.outputs:
            if out.name == name and out.shape is not None:  # a tensor, not a sequence of them
                values[name] = out
        if name not in ops:
            ops[name] = (_module_of(node), target)
    out: dict[tuple[str, str], list[tuple[str, Any]]] = {}
    for name, (module, target) in ops.items():
        if target not in _UNPAIRED and "getitem" not in target:
            out.setdefault((module, _KIND.get(target, target)), []).append((name, values.get(name)))
    return out


def _module_of(node: Any) -> str:
    """Module path of an exported node: torch.onnx's scopes end with the module, then the FX node name."""
    try:
        scopes = ast.literal_eval(node.metadata_props.get(_SCOPES, "[]"))
    except (ValueError, SyntaxError):
        return ""
    return str(scopes[-2]) if isinstance(scopes, list) and len(scopes) >= 2 else ""


def _joint_ops(gm: fx.GraphModule) -> dict[tuple[str, str], list[fx.Node]]:
    """(module, kind) -> forward op nodes of the joint graph, in graph order."""
    out: dict[tuple[str, str], list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or node_phase(n) != "forward":
            continue
        target = str(n.target)
        if target in _UNPAIRED or "getitem" in target:
            continue
        out.setdefault((node_module(n), _KIND.get(target, target)), []).append(n)
    return out


def _joint_value(node: fx.Node, shape: tuple | None) -> fx.Node | None:
    """The joint node holding ``node``'s first result in ``shape``: itself, its getitem 0, or the views after."""
    cur = node
    val = cur.meta.get("val")
    if isinstance(val, (tuple, list)):
        cur = next((u for u in cur.users if "getitem" in str(u.target) and u.args[1] == 0), None)
        if cur is None:
            return None
    module = node_module(node)
    while True:
        val = cur.meta.get("val")
        if isinstance(val, torch.Tensor) and shape is not None and tuple(val.shape) == shape:
            return cur
        users = [u for u in cur.users if node_phase(u) == "forward"]
        if len(users) != 1 or _KIND.get(str(users[0].target)) != "view" or node_module(users[0]) != module:
            return None
        cur = users[0]


# ---- writing the annotations ------------------------------------------------------------------------


def _annotate(ir_model: Any, plan: Plan, found: dict[Any, _Found]) -> None:
    """Attach the device configuration, the per-node sharding specs and the plan JSON to the IR model."""
    mesh, world = mesh_of(plan), world_of(plan)
    ir_model.ir_version = max(ir_model.ir_version, MULTI_DEVICE_IR_VERSION)
    device = str(plan.cluster.get("device", "device"))
    config = ir_model.add_device_configuration(
        CONFIGURATION, num_devices=world, device_names=[f"{device}:{r}" for r in range(world)]
    )
    ir_model.metadata_props[PLAN_KEY] = json.dumps(plan.to_dict())
    for node in ir_model.graph:
        stage = _stage_of(plan, node)
        offset = (stage or 0) * mesh[0] * mesh[1]
        specs, notes = [], {}
        for value in [*node.inputs, *node.outputs]:
            if value is None or value not in found or value.name in notes:
                continue
            f = found[value]
            shape = _shape(value.shape)
            if shape is None:
                continue
            spec = encode(as_sharded(f.placements), shape, mesh, offset, world)
            for axis, dim, n in spec.sharded:
                if dim is not None and dim % n:
                    raise OnnxError(
                        f"{value.name} (shape {list(shape)}) cannot be split {n} ways on axis {axis} as the plan "
                        f"places it ({texts(f.placements)}): export with inputs of the shapes the plan was made for"
                    )
            specs.append(
                ir.ShardingSpec(
                    value=value,
                    device=spec.devices,
                    index_to_device_group_map=tuple(
                        ir.IndexToDeviceGroupMapEntry(key=k, value=members) for k, members in spec.groups
                    ),
                    sharded_dims=tuple(
                        ir.ShardedDim(
                            axis=a, simple_shardings=(ir.SimpleShardedDim(dim=value.shape[a], num_shards=n),)
                        )
                        for a, _, n in spec.sharded
                    ),
                )
            )
            notes[value.name] = {"placements": texts(f.placements), "plan_node": f.plan_node}
        if specs or stage is not None:
            node.device_configurations = (
                ir.NodeDeviceConfiguration(
                    configuration=config, sharding_specs=tuple(specs), pipeline_stage=stage
                ),
            )
        if notes:
            node.metadata_props[NODE_KEY] = json.dumps(notes)


def _stage_of(plan: Plan, node: Any) -> int | None:
    """Pipeline stage of an exported node, where the plan has stages.

    Provisional until pipeline planning lands: a stage is read as a dict
    whose "modules" lists module-path prefixes; a node belongs to the first
    stage listing a prefix of its module.
    """
    if not plan.stages:
        return None
    module = _module_of(node)
    for i, stage in enumerate(plan.stages):
        prefixes = stage.get("modules", []) if isinstance(stage, dict) else []
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None
