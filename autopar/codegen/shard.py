"""Shard: the joint graph and a plan's placements → one rank's local joint graph.

The local graph takes this rank's shards of the parameters, fixed state and
inputs, and returns the loss (whole, the same on every rank) and each
parameter's gradient shard, laid out the way the plan places that parameter.
Every change of placement the plan asks for is a ``_c10d_functional``
collective (all-reduce, all-gather, reduce-scatter, all-to-all) with its wait
in the graph.

How: :class:`autopar.codegen.shard_interpreter.ShardInterpreter` re-runs the
joint graph on DTensors as the plan places every node, and ``make_fx`` traces
that run.  The trace keeps only local ATen ops and functional collectives, so
the generated graph carries no DTensor overhead at run time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import _clear_sharding_prop_cache as clear_dtensor_caches
from torch.distributed.tensor.placement_types import Replicate
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.capture.joint import CapturedGraph, gradient_chain
from autopar.codegen.collective_order import one_chunk_in_flight, schedule_collectives
from autopar.codegen.local_graph import LocalGraph
from autopar.codegen.redistribute import dtensor_of, from_whole_planned, local_of, natural_order, redistribute
from autopar.codegen.shard_interpreter import GradientCasts, ShardInterpreter
from autopar.codegen.zero_grads import early_zero_gradients, zero_gradient
from autopar.core.placements import to_dtensor_all
from autopar.search.sharding.dtensor_rules import costs_off

log = logging.getLogger(__name__)

aten = torch.ops.aten


def backward_seed(captured: CapturedGraph) -> str:
    """The node the backward starts from: ``ones_like`` of the loss (``autograd.grad``'s default seed)."""
    for n in captured.gm.graph.nodes:
        if n.target is aten.ones_like.default and getattr(n.args[0], "name", None) == captured.loss:
            return n.name
    raise ValueError(f"the joint graph of {captured.model_name} has no backward seed ones_like({captured.loss})")


def source_of(node: fx.Node) -> str | None:
    """The captured node a node of a local graph traced with ``keep_sources`` came from; None if none."""
    sources = node.meta.get("from_node")
    return sources[-1].name if sources else None


def _local_joint(
    interp: ShardInterpreter,
    captured: CapturedGraph,
    mesh: DeviceMesh,
    phs: list[fx.Node],
    arg_pl: list[tuple],
    grad_pl: list[tuple],
    stages: list[int],
    early: dict[int, torch.Tensor],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The function ``make_fx`` traces: local shards in, the captured graph run on DTensors, local results out.

    With a loss scale (``interp.casts.seed``), it is one more argument after the inputs: a 0-dim fp32 tensor.
    """
    n_params = len(captured.params)
    casts = interp.casts
    result_nodes = next(n for n in captured.gm.graph.nodes if n.op == "output").args[0]

    def local_joint(*local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if casts.seed is not None:
            *local, scale = local
            casts.scale = dtensor_of(scale, mesh, (Replicate(),) * mesh.ndim, scale.shape, scale.stride())
        dt = [
            dtensor_of(t, mesh, to_dtensor_all(pl), ph.meta["val"].shape, ph.meta["val"].stride())
            for t, pl, ph in zip(local, arg_pl, phs, strict=True)
        ]
        loss, *results = interp.run(*dt)
        # each result as DTensor's plain rules read it, out of a head-tail shard
        loss, *results = (
            natural_order(v, interp._held(r) if isinstance(r, fx.Node) else None)
            for v, r in zip((loss, *results), result_nodes, strict=True)
        )
        grads, updates = results[:n_params], results[n_params:]
        out = [local_of(redistribute(loss, (Replicate(),) * mesh.ndim))]
        for i, (g, pl) in enumerate(zip(grads, grad_pl, strict=True)):
            if g is None:
                out.append(None)
                continue
            if casts.reduce_dtype is not None and g.dtype.is_floating_point:
                g = g.to(casts.reduce_dtype)  # reduced, and returned, in the reduce dtype
            if stages[i]:
                if i not in early:  # a gradient node shared with another parameter
                    early[i], grad_pl[i] = zero_gradient(g, pl, stages[i], mesh)
                out.append(early[i])
            else:
                out.append(local_of(redistribute(g, to_dtensor_all(pl))))
        for b, u in zip(captured.updated, updates, strict=True):  # each buffer's new value, as the buffer is held
            out.append(local_of(redistribute(u, to_dtensor_all(arg_pl[n_params + b]))))
        return tuple(out)

    return local_joint


def _trace_local(
    local_joint: Callable[..., tuple[torch.Tensor, ...]], fake_local: list[torch.Tensor], keep_sources: bool
) -> fx.GraphModule:
    """``make_fx`` of the local joint on fake local shards, DTensor's one expected warning muted."""
    # DTensor warns, once per trace, that a 2-D gather runs as two collectives: the plan costed it so
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    # DTensor caches an op's output placements by a key in which two meshes of one shape are equal: a mesh of
    # process groups since destroyed (a process that set up its groups again) would come back from it
    clear_dtensor_caches()
    try:
        # the plan laid every input out as one of the op's strategies reads it: DTensor need only find that one
        with fx_traceback.preserve_node_meta() if keep_sources else contextlib.nullcontext(), costs_off("match"):
            # the model's tensor constants (get_attr nodes: a literal such as Falcon's ``torch.tensor(...)``)
            # are real tensors: the trace records them as constants of the local graph
            return make_fx(local_joint, tracing_mode="fake", _allow_non_fake_inputs=True)(*fake_local)
    finally:
        quiet.setLevel(level)


def shard_graph(
    captured: CapturedGraph,
    plan_placements: dict[str, dict],
    mesh: DeviceMesh,
    zero_stages: dict[str, int] | None = None,
    keep_sources: bool = False,
    reduce_dtype: torch.dtype | None = None,
    loss_scale: bool = False,
    device: torch.device | None = None,
) -> LocalGraph:
    """The local joint graph of this rank of ``mesh`` for ``plan_placements`` (``Plan.placements``).

    ``keep_sources``: every traced node records the captured node it came from
    (:func:`source_of`) and collectives are left where the trace put them (right
    before their first reader), for a pass that splits the graph by source
    (pipeline stages) and schedules each part itself.

    ``zero_stages`` maps parameter placeholders of dp-replicated parameters to
    their ZeRO stage (1 or 2); their gradients leave the graph as
    :class:`LocalGraph` describes, for the runtime's sharded optimizer.

    Mixed precision (:class:`GradientCasts`): ``reduce_dtype`` reduces and
    returns the gradients in that dtype; ``loss_scale`` makes the graph take
    one more argument, the scale the backward starts from.  ``device``: where the
    rank's tensors live (the CPU by default), as the local shards are traced on it.
    """
    zero_stages = zero_stages or {}
    gm = captured.gm
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    arg_pl = [tuple(plan_placements[p.name]["outputs"][0]) for p in phs]
    param_ph = [p.placeholder for p in captured.params]
    grad_pl = [tuple(plan_placements[ph]["outputs"][0]) for ph in param_ph]
    stages = [zero_stages.get(ph, 0) for ph in param_ph]
    early: dict[int, torch.Tensor] = {}
    on_value = early_zero_gradients(gm, stages, grad_pl, early, mesh, reduce_dtype)
    casts = GradientCasts(
        reduce_dtype,
        gradient_chain(gm, len(param_ph)) if reduce_dtype is not None else set(),
        set(captured.grads.values()),
        backward_seed(captured) if loss_scale else None,
    )
    interp = ShardInterpreter(gm, plan_placements, mesh, on_value, casts)
    local_joint = _local_joint(interp, captured, mesh, phs, arg_pl, grad_pl, stages, early)

    fake_local = []
    for ph, pl in zip(phs, arg_pl, strict=True):
        v = ph.meta["val"]
        shape = list(v.shape)
        for i, s in enumerate(pl):
            if s.is_shard():
                shape[s.dim] //= mesh.size(i)
        fake_local.append(torch.empty(shape, dtype=v.dtype, device=device))
    if loss_scale:
        fake_local.append(torch.ones((), dtype=torch.float32, device=device))
    local_gm = _trace_local(local_joint, fake_local, keep_sources)
    # DTensor's decomposition-based rules run their decompositions on meta tensors during dispatch, and
    # make_fx records those ops too; nothing reads them
    local_gm.graph.eliminate_dead_code()
    if not keep_sources:
        schedule_collectives(local_gm.graph)
    one_chunk_in_flight(local_gm.graph, [1 + i for i, s in enumerate(stages) if s == 2])
    local_gm.recompile()
    if interp.local_only:
        log.debug("ran on local shards: %s", dict(interp.local_only))
    return LocalGraph(local_gm, arg_pl, grad_pl, stages, list(captured.updated), loss_scale)


def run_sharded(
    captured: CapturedGraph,
    plan_placements: dict[str, dict],
    mesh: DeviceMesh,
    whole: list[torch.Tensor],
    record: Callable[[fx.Node, Any], None],
) -> None:
    """Run the joint graph eagerly on this rank's shards of ``whole`` (every placeholder's whole value, in
    order) as ``plan_placements`` places every node, handing ``record(node, value)`` each node's value as it
    is computed: a DTensor (a head-tail shard in natural order) whose ``full_tensor()`` is the node's whole
    value under the plan.

    What the local graph computes, op by op, without the trace: for comparing a plan's values with one
    device's (:mod:`autopar.verify.localize`). Random ops draw under the ``autopar.ops.rng`` state in force.
    """
    gm = captured.gm
    interp = ShardInterpreter(gm, plan_placements, mesh, {n: functools.partial(record, n) for n in gm.graph.nodes})
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    places = [tuple(plan_placements[ph.name]["outputs"][0]) for ph in phs]
    args = [from_whole_planned(t, mesh, p) for t, p in zip(whole, places, strict=True)]
    interp.run(*args)
