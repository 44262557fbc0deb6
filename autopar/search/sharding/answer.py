"""The costing of a chosen answer to a sharding problem: its estimate, placements and collectives.

The Estimate reads the chosen strategies back through the same cost terms
the MILP minimised, then adds what the linear objective cannot express:
gradient synchronisation overlaps the backward pass (bucketed, as DDP
does), so only the part of it that outlasts the backward compute, or the
last bucket, is exposed.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.capture.joint import CapturedGraph, node_module, node_phase
from autopar.core.mesh import SHARDING_AXES
from autopar.cost_models.comm import collective_time
from autopar.cost_models.compute import is_view
from autopar.cost_models.estimate import Estimate
from autopar.cost_models.step import BUCKET_BYTES
from autopar.hardware.cluster import Cluster
from autopar.plans.op_records import ChargedCollective
from autopar.search.sharding.instance import EdgeCollective, ShardingProblem, charged_collectives
from autopar.search.sharding.step_memory import step_memory
from autopar.search.sharding.strategies import Strategy
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
    zero_gather = sum(sp.param_comm[i][choice[i]] for i in param_idx if i in sp.param_comm)
    optimizer_s = sum(node_time[i] for i in param_idx) - zero_gather
    backward = sum(node_time[i] for i in sp.backward_nodes)
    grad = set(sp.grad_edges)
    data_comm = grad_comm = 0.0
    grad_bytes = 0.0
    for e, (u, v) in enumerate(p.edges):
        c = p.edge_costs[e][choice[u] * len(p.node_costs[v]) + choice[v]]
        if e in grad:
            grad_comm += c
            grad_bytes += sp.edge_info[e].nbytes
        else:
            data_comm += c
    tail = grad_comm * min(1.0, BUCKET_BYTES / max(grad_bytes, 1.0))
    # ZeRO-1/2 gather the stepped parameters after the optimizer: nothing left to hide them under
    exposed = data_comm + max(grad_comm - backward, tail) + zero_gather
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
        comm_s=data_comm + grad_comm + zero_gather,
        exposed_comm_s=exposed,
        optimizer_s=optimizer_s,
        recompute_s=recompute_s,
        model_flops=flops,
        hardware_flops=hardware,
        collectives=collectives,
    )


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
    out = {}
    for name, s in zip(nodes, chosen, strict=True):
        node = by_name[name]
        out[name] = {
            "op": str(node.target) if node.op == "call_function" else node.op,
            "module": node_module(node),
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
