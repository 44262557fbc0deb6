"""The costing of a chosen answer to a sharding problem: its estimate, placements and collectives.

The Estimate reads the chosen strategies back through the same cost terms
the MILP minimised, then adds what the linear objective cannot express, the
overlap of communication with compute, as the analytic data-parallel model
(:mod:`autopar.cost_models.step`) does, so that one layout costs the same on
either path:

    step      = compute + exposed + optimizer
    exposed   = data + Y(P_fwd, T_fwd) + Y(P_bwd, T_bwd) + X(G_fwd, T_fwd) + X(G_bwd + R, T_bwd)
                + X(R_1, T_bwd / k) + W(Z)
    X(c, w)   = max(c − w, the last bucket's share of c)

where ``data`` is every activation moved between ops (on the critical path),
P_fwd / P_bwd the tensor-parallel collectives among them when the runtime the
estimate describes overlaps them with GEMMs, Y their exposed part
(:func:`autopar.cost_models.overlap.tp_exposed`; autopar's own runtime does not
overlap them: P = 0 and they stay in ``data``), G_fwd / G_bwd the parameters
moved to forward / backward ops (ZeRO-3's all-gathers, once per micro-batch,
prefetched under the pass that reads them, as FSDP does), R the gradient
synchronisation in buckets (:func:`autopar.cost_models.comm.bucketed_time`;
a partial gradient reduced on its way to the gradient, a bias's ``sum``,
counts as gradient synchronisation) done every micro-batch (ZeRO-2 and 3),
R_1 the part done once a step over the gradients accumulated over k
micro-batches (ZeRO 0 and 1, as DDP and Megatron-LM do): only the last
micro-batch's backward is left to hide it, T_fwd / T_bwd the forward and backward
compute, and Z ZeRO-1/2's gather of the stepped shards after the optimizer
(in buckets), W(Z) its exposed part: all of it on autopar's runtime, nothing left
to hide it under; X(Z, T_fwd / k) where the runtime overlaps it with the next
step's first forward (:func:`autopar.cost_models.step.param_gather_exposed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autopar.capture.joint import CapturedGraph, node_module, node_phase
from autopar.core.mesh import SHARDING_AXES
from autopar.cost_models import overlap
from autopar.cost_models.comm import bucketed_time, collective_time
from autopar.cost_models.compute import is_view
from autopar.cost_models.estimate import Estimate
from autopar.cost_models.reshard import grad_sync_steps
from autopar.cost_models.step import exposed_part, param_gather_exposed
from autopar.hardware.cluster import Cluster
from autopar.plans.op_records import ChargedCollective
from autopar.search.sharding.instance import (
    TP_DIM,
    EdgeCollective,
    ShardingProblem,
    charged_collectives,
    gradient_chain,
    parameter_sourced,
    per_microbatch_grad_sync,
    tp_seconds,
)
from autopar.search.sharding.node_keys import input_names
from autopar.search.sharding.node_strategies import Strategy
from autopar.search.sharding.step_memory import step_memory
from autopar.solver import Solution


def describe_collectives(
    captured: CapturedGraph, sp: ShardingProblem, choice: list[int], mesh_shape: tuple[int, ...]
) -> list[ChargedCollective]:
    """The collectives of a chosen answer, each with the axis, bytes, module and phase it belongs to."""
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    params = {p.placeholder for p in captured.params}
    for n in captured.gm.graph.nodes:  # a view of a parameter (its transpose) moves the parameter
        if is_view(n) and n.args and isinstance(n.args[0], torch.fx.Node) and n.args[0].name in params:
            params.add(n.name)
    out = []
    for c in charged_collectives(sp, choice, mesh_shape):
        src = by_name[c.src]
        out.append(
            ChargedCollective(
                kind=c.kind,
                axis=SHARDING_AXES[c.mesh_dim],
                bytes=c.bytes,
                src=c.src,
                dst=c.dst,
                reason=c.reason,
                src_module=node_module(src),
                dst_module=node_module(by_name[c.dst]),
                phase=src.meta.get("autopar_phase", ""),
                src_param=c.src in params,
            )
        )
    return out


def evaluate(
    sp: ShardingProblem,
    solution: Solution,
    mesh_shape: tuple[int, ...],
    cluster: Cluster,
    batch: int,
    memory_limit: float,
    links: list,
    compute_dtype: str = "bf16",
) -> Estimate:
    """Step time, memory and collectives of the chosen strategies."""
    choice = solution.choice
    if not choice:
        return Estimate(step_time_s=float("inf"), memory_limit=memory_limit, fits=False)
    p = sp.problem
    node_time = [p.node_costs[i][c] for i, c in enumerate(choice)]
    param_idx = set(sp.param_nodes)
    compute = sum(t for i, t in enumerate(node_time) if i not in param_idx)
    # forward ops run again in the backward: op-level variants (charged twice) and replaying nodes
    recomputed = [i for i, c in enumerate(choice) if sp.strategies[i][c].recompute]
    replayed = set(sp.replayed)
    recompute_s = sum(node_time[i] / 2 for i in recomputed) + sum(node_time[i] for i in replayed)
    optimizer_s = sum(node_time[i] for i in param_idx) - sum(
        sp.param_comm[i][choice[i]] for i in param_idx if i in sp.param_comm
    )
    backward = sum(node_time[i] for i in sp.backward_nodes if i not in param_idx)
    comm = _step_comm(sp, choice, mesh_shape, links)
    # the parameters' gathers hide under the pass that reads them, the gradients' reduction under the
    # backward; ZeRO-1/2 gather the stepped parameters after the optimizer: nothing left to hide them under
    tp = mesh_shape[TP_DIM] if len(mesh_shape) > TP_DIM else 1
    dp = mesh_shape[sp.dp_dim] if sp.dp_dim is not None else 1
    k = sp.microbatches
    exposed = (
        comm.data
        + overlap.tp_exposed(comm.tp_forward, compute - backward, tp)
        + overlap.tp_exposed(comm.tp_backward, backward, tp)
        + exposed_part(comm.gather_forward, compute - backward, comm.gathered_forward_bytes, dp)
        + exposed_part(
            comm.gather_backward + comm.grad, backward, comm.gathered_backward_bytes or comm.grad_bytes, dp
        )
        + exposed_part(comm.grad_once, backward / k, comm.grad_once_bytes, dp)
        + param_gather_exposed(comm.zero_gather, (compute - backward) / k, comm.zero_gather_bytes, dp)
    )
    step = compute + exposed + optimizer_s

    memory = step_memory(sp, choice, mesh_shape)
    peak = memory.peak
    collectives = _aggregate(charged_collectives(sp, choice, mesh_shape), mesh_shape, links)
    devices = 1
    for n in mesh_shape:
        devices *= n
    flops = sum(f for i, f in enumerate(sp.flops) if i not in replayed)  # the model's: recompute not counted
    hardware = sum(sp.flops) + sum(sp.flops[i] for i in recomputed)
    rate = step * devices * cluster.device_spec.peak_flops[compute_dtype]
    return Estimate(
        step_time_s=step,
        samples_per_s=batch / step if step > 0 else 0.0,
        mfu=flops / rate if step > 0 else 0.0,
        hfu=hardware / rate if step > 0 else 0.0,
        memory=memory,
        memory_limit=memory_limit,
        fits=peak <= memory_limit,
        compute_s=compute,
        comm_s=comm.total,
        exposed_comm_s=exposed,
        optimizer_s=optimizer_s,
        recompute_s=recompute_s,
        model_flops=flops,
        hardware_flops=hardware,
        collectives=collectives,
    )


@dataclass
class StepComm:
    """A chosen answer's communication per step, by what it can hide under (seconds; bytes per micro-batch)."""

    data: float = 0.0  # activations moved between ops: on the critical path
    # of those, the tensor-parallel collectives a runtime may overlap with GEMMs (autopar.cost_models.overlap);
    # counted apart only when the runtime the estimate describes does so
    tp_forward: float = 0.0
    tp_backward: float = 0.0
    gather_forward: float = 0.0  # parameters moved to forward ops (ZeRO-3's all-gathers)
    gather_backward: float = 0.0  # parameters moved to backward ops
    gathered_forward_bytes: float = 0.0  # one micro-batch's, whole (before sharding)
    gathered_backward_bytes: float = 0.0
    grad: float = 0.0  # gradient synchronisation every micro-batch (ZeRO-2 and 3), in buckets
    grad_bytes: float = 0.0
    grad_once: float = 0.0  # gradient synchronisation once a step, under the last micro-batch's backward
    grad_once_bytes: float = 0.0
    zero_gather: float = 0.0  # ZeRO-1/2: the stepped shards gathered after the optimizer, in buckets
    zero_gather_bytes: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.data + self.tp_forward + self.tp_backward + self.gather_forward + self.gather_backward
            + self.grad + self.grad_once + self.zero_gather
        )


def _step_comm(sp: ShardingProblem, choice: list[int], mesh_shape: tuple[int, ...], links: list) -> StepComm:
    """Each edge's cost sorted by what it can overlap with; gradients and ZeRO's gathers re-costed in buckets.

    The MILP's objective charges a gradient's reduction per parameter (an edge
    is linear in its own bytes); the runtime, like DDP and FSDP, sends them in
    buckets, and the analytic data-parallel model costs them so
    (:func:`autopar.cost_models.comm.bucketed_time`): the estimate does the same,
    so that one layout costs the same on every path.
    """
    p = sp.problem
    out = StepComm()
    moved = parameter_sourced(sp)
    chain = gradient_chain(sp)
    backward = {sp.nodes[i] for i in sp.backward_nodes}
    grad = set(sp.grad_edges)
    k = sp.microbatches
    weights = sp.edge_weight
    # (kind, mesh dim, rounds per step) -> each tensor's bytes and how many tensors it stands for (a fold)
    buckets: dict[tuple[str, int, int], tuple[list[float], list[float]]] = {}

    def bucket(key: tuple[str, int, int], size: float, w: float) -> None:
        sizes, ws = buckets.setdefault(key, ([], []))
        sizes.append(size)
        ws.append(w)

    for e, (u, v) in enumerate(p.edges):
        info = sp.edge_info[e]
        c = p.edge_costs[e][choice[u] * len(p.node_costs[v]) + choice[v]]
        w = 1.0 if weights is None else weights[e]  # the edges of the graph it stands for (a fold)
        if e in grad:
            b = sp.strategies[v][choice[v]]
            have, need = info.have(sp.strategies[u][choice[u]]), info.need(b)
            rounds = k if per_microbatch_grad_sync(sp, b) else 1
            nbytes = info.moved_bytes(have, need)
            for kind, d, size in grad_sync_steps(have, need, b.zero, nbytes, mesh_shape, sp.dp_dim) or []:
                bucket((kind, d, rounds), size, w)
            if rounds == 1 and k > 1:
                out.grad_once_bytes += nbytes * w
            else:
                out.grad_bytes += nbytes * w
        elif info.kind == "data" and info.dst in chain and c > 0:
            have, need = info.have(sp.strategies[u][choice[u]]), info.need(sp.strategies[v][choice[v]])
            nbytes = info.moved_bytes(have, need)
            for kind, d, size in grad_sync_steps(have, need, 0, nbytes, mesh_shape, sp.dp_dim) or []:
                bucket((kind, d, 1), size, w)
        elif info.kind == "data" and info.src in moved and c > 0:
            if info.dst in backward:
                out.gather_backward += c
                out.gathered_backward_bytes += info.nbytes * w
            else:
                out.gather_forward += c
                out.gathered_forward_bytes += info.nbytes * w
        else:
            _add_data(out, sp, e, choice, mesh_shape, links, c, info.dst in backward, w)
    for (kind, d, rounds), (sizes, ws) in buckets.items():
        t = bucketed_time(kind, sizes, mesh_shape[d], links[d], overlap.bucket_bytes(mesh_shape[d]), ws)[0]
        if rounds == 1 and k > 1:  # accumulated over the micro-batches, reduced once: under the last backward
            out.grad_once += t
        else:
            out.grad += rounds * t
    zeroed = [i for i in sp.param_nodes if sp.strategies[i][choice[i]].zero]
    ws = [1.0 if sp.node_weight is None else sp.node_weight[i] for i in zeroed]
    sizes = [sp.state_parts[i][choice[i]][0] / w for i, w in zip(zeroed, ws, strict=True)]
    stepped = sum(sp.state_parts[i][choice[i]][0] for i in zeroed)
    if stepped and sp.dp_dim is not None:
        d = sp.dp_dim
        bucket_bytes = overlap.bucket_bytes(mesh_shape[d])
        out.zero_gather = bucketed_time("all_gather", sizes, mesh_shape[d], links[d], bucket_bytes, ws)[0]
        out.zero_gather_bytes = stepped
    return out


def _add_data(
    out: StepComm,
    sp: ShardingProblem,
    e: int,
    choice: list[int],
    mesh_shape,
    links,
    cost: float,
    in_backward: bool,
    weight: float = 1.0,
) -> None:
    """An activation's move: on the critical path, its tensor-parallel part apart when the runtime overlaps it.

    ``weight``: the edges of the graph the edge stands for (``cost`` counts them all already).
    """
    info = sp.edge_info[e]
    tp = 0.0
    if overlap.RUNTIME.tp_comm_overlap and info.kind == "data" and cost > 0:
        u, v = sp.problem.edges[e]
        a, b = sp.strategies[u][choice[u]], sp.strategies[v][choice[v]]
        tp = min(cost, weight * tp_seconds(info, a, b, mesh_shape, links, sp.dp_dim))
    out.data += cost - tp
    if in_backward:
        out.tp_backward += tp
    else:
        out.tp_forward += tp


def _aggregate(records: list[EdgeCollective], mesh_shape, links) -> list[dict]:
    """Collectives per (kind, mesh axis): how many, average bytes, total time."""
    agg: dict[tuple[str, str], dict] = {}
    for r in records:
        d = r.mesh_dim
        key = (r.kind, SHARDING_AXES[d])
        a = agg.setdefault(key, {"kind": key[0], "axis": key[1], "bytes": 0.0, "count": 0, "time_s": 0.0})
        a["bytes"] += r.bytes
        a["count"] += 1
        a["time_s"] += collective_time(r.kind, r.bytes, mesh_shape[d], links[d])
    for a in agg.values():
        a["bytes"] = a["bytes"] / max(a["count"], 1)  # bytes each, on average
    return sorted(agg.values(), key=lambda a: (a["axis"], a["kind"]))


def read_placements(
    captured: CapturedGraph, sp: ShardingProblem, choice: list[int]
) -> dict[str, dict[str, Any]]:
    """Per node: op, module, chosen output placements and the placements its inputs are brought to."""
    chosen = [sp.strategies[i][c] for i, c in enumerate(choice)]
    return placements_of(captured, sp.nodes, chosen, sp.dp_dim)


def placements_of(
    captured: CapturedGraph, nodes: list[str], chosen: list[Strategy], dp_dim: int | None
) -> dict[str, dict[str, Any]]:
    """:func:`read_placements` of the strategies ``chosen`` for ``nodes``, however they were chosen.

    ``dp_dim``: the mesh dim a parameter's ZeRO stage is written for (a dp-replicated one writes its own).
    """
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    param_of = {p.placeholder: p.name for p in captured.params}
    op_names: dict[Any, str] = {}  # str() of an OpOverload is slow, and a graph has few distinct ops
    out = {}
    for name, s in zip(nodes, chosen, strict=True):
        node = by_name[name]
        if node.op == "call_function" and node.target not in op_names:
            op_names[node.target] = str(node.target)
        out[name] = {
            "op": op_names[node.target] if node.op == "call_function" else node.op,
            "module": node_module(node),
            "args": input_names(node),
            "outputs": list(s.outputs),
            "inputs": list(s.inputs),
        }
        if s.recompute:
            out[name]["recompute"] = "selective"
        if name in param_of:
            out[name]["param"] = param_of[name]
            if dp_dim is not None and s.outputs[0] is not None and s.outputs[0][dp_dim].is_replicate():
                out[name]["zero"] = s.zero  # 0 written out: the plan's stage is not this parameter's default
    _recompute_views(captured, out)
    return out


def _recompute_views(captured: CapturedGraph, placements: dict[str, dict[str, Any]]) -> None:
    """Mark the forward views of a recomputed value that the backward reads: kept, they would keep it."""
    base: dict[str, str] = {}
    for node in captured.gm.graph.nodes:
        src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if src is None or not is_view(node) or node_phase(node) == "backward":
            continue
        root = base.get(src.name, src.name)
        base[node.name] = root
        entry = placements.get(node.name)
        if (
            entry is not None
            and placements.get(root, {}).get("recompute")
            and any(node_phase(u) == "backward" for u in node.users)
        ):
            entry["recompute"] = "selective"
