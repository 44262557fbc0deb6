"""Build the sharding MILP instance from a joint graph, its strategies and the cost models.

For a mesh of shape (n_1, ..., n_k) with links L_1..L_k, every node v of the
joint graph with strategies s ∈ S_v becomes a node of the solver's
``StrategyProblem``:

    c_v[s]  = roofline(flops_v / W_v(s), bytes_v(s))         compute, local to one device
              W_v(s) = Π n_d over mesh dims d where s is not all-"R" (the work is split)
              bytes_v(s) = Σ inputs and outputs of their local (sharded) bytes
    c_p[s]  = optimizer update of parameter p's local shard (memory-bound)
    m_v[s]  = local bytes of v's output, live from v to its last use (activations, temporaries)
    m_p[s]  = local bytes of p's parameter, gradient and optimizer state, live throughout

and every (producer u → consumer v) pair becomes an edge whose cost matrix is

    E_uv[a, b] = redistribute(u's output under a → the placement v needs under b)

Gradient synchronisation is the edge (grad of p → p): a gradient that is a
partial sum over the data-parallel dim must be all-reduced (or
reduce-scattered, if p is sharded) to p's placement. User inputs are
sharded on dim 0 (the batch) over the data-parallel mesh dim: that is what
makes it the data-parallel dim.

Gradient accumulation over m micro-batches runs the graph m times on 1/m of
the batch: compute and activation traffic add up to the same, gradient
synchronisation happens once, and 1/m of the activations are live at a
time; so m divides the activation memory terms and leaves the rest.

The solver core sees numbers only; ``ShardingProblem`` keeps the map back
to node names and placements.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.capture import CapturedGraph
from autopar.cluster import Link
from autopar.cost_models.compute import ComputeEfficiency, is_view, node_flops, roofline_time
from autopar.cost_models.memory import Precision, optimizer_bytes_per_param
from autopar.cost_models.reshard import INF, collectives_between, redistribute_time, shard_factor
from autopar.passes.solve import StrategyProblem
from autopar.passes.strategies import NodeStrategies, Strategy

# A cost the solver must avoid but that keeps the matrix finite (a forbidden transition).
FORBIDDEN_S = 1e6


@dataclass
class ShardingProblem:
    """A StrategyProblem plus what is needed to read its answer back onto the graph."""

    problem: StrategyProblem
    nodes: list[str]  # problem node index -> graph node name
    strategies: list[list[Strategy]]  # per problem node
    # per edge: (u, v, output index of u, global bytes, "data" | "grad-sync", input position in v's strategy;
    # -1: the edge targets v's own output placement, as a gradient targets its parameter's)
    edge_info: list[tuple[str, str, int, float, str, int]]
    grad_edges: list[int] = field(default_factory=list)  # indices of gradient-synchronisation edges
    backward_nodes: list[int] = field(default_factory=list)
    param_nodes: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)  # global FLOPs per problem node


def _tensor_bytes(val) -> float:
    if hasattr(val, "numel") and hasattr(val, "element_size"):
        return float(val.numel()) * val.element_size()
    return 0.0


def _output_vals(node: fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]


def build_problem(
    captured: CapturedGraph,
    strategies: dict[str, NodeStrategies],
    mesh_shape: tuple[int, ...],
    links: list[Link],
    device,
    precision: Precision,
    optimizer: str,
    efficiency: ComputeEfficiency | None = None,
    dp_dim: int | None = 0,
    memory_limit: float | None = None,
    microbatches: int = 1,
) -> ShardingProblem:
    """The MILP instance for one mesh (see the module docstring for the formulation)."""
    gm = captured.gm
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    scale = precision.activation_bytes / max(
        (p.dtype.itemsize for p in captured.params if p.dtype.is_floating_point), default=4
    )
    param_nodes = {p.placeholder: p for p in captured.params}
    input_nodes = {t.placeholder for t in captured.inputs}
    state_bytes = (
        precision.param_bytes + precision.grad_bytes + optimizer_bytes_per_param(precision, optimizer)
    )
    opt_traffic = (
        precision.grad_bytes + 2 * optimizer_bytes_per_param(precision, optimizer) + precision.param_bytes
    )
    end = len(order)

    names: list[str] = []
    strats: list[list[Strategy]] = []
    costs: list[list[float]] = []
    memory: list[list[float]] = []
    intervals: list[tuple[int, int]] = []
    backward: list[int] = []
    params_idx: list[int] = []
    flops_of: list[float] = []
    for node in gm.graph.nodes:
        ns = strategies.get(node.name)
        if ns is None or not ns.strategies:
            continue
        options = list(ns.strategies)
        if node.name in input_nodes and dp_dim is not None:
            batch = [s for s in options if s.outputs[0] is not None and s.outputs[0][dp_dim] == "S(0)"]
            options = batch or options
        vals = _output_vals(node)
        c_row, m_row = [], []
        for s in options:
            out_local = [
                _tensor_bytes(v) / shard_factor(p, mesh_shape) if p is not None else 0.0
                for v, p in zip(vals, s.outputs, strict=False)
            ]
            if node.name in param_nodes:
                numel = sum(out_local) / max(vals[0].element_size(), 1)
                c_row.append(numel * opt_traffic / (device.hbm_bandwidth * _mem_eff(efficiency)))
                m_row.append(numel * state_bytes)
                continue
            if node.op == "placeholder":
                c_row.append(0.0)
                m_row.append(sum(out_local) / microbatches)
                continue
            split = math.prod(
                n
                for d, n in enumerate(mesh_shape)
                if any(p is not None and p[d] != "R" for p in (*s.outputs, *s.inputs))
            )
            in_local = 0.0
            for inp, p in zip(ns.inputs, s.inputs, strict=False):
                src = by_name.get(inp)
                if src is not None and p is not None:
                    in_local += _tensor_bytes(src.meta.get("val")) / shard_factor(p, mesh_shape)
            flops = node_flops(node) / split
            nbytes = 0.0 if is_view(node) else (in_local + sum(out_local))
            c_row.append(roofline_time(flops, nbytes, device, precision.compute_dtype, efficiency, scale))
            # with m micro-batches a step runs the graph m times on 1/m of the batch: the same total
            # compute and traffic, 1/m of the activations live at once
            m_row.append(0.0 if is_view(node) else sum(out_local) * scale / microbatches)
        last_use = max((order[u.name] for u in node.users), default=order[node.name] + 1)
        iv = (0, end) if node.name in param_nodes else (order[node.name], max(last_use, order[node.name] + 1))
        if node.op == "call_function" and node.meta.get("autopar_phase") == "backward":
            backward.append(len(names))
        if node.name in param_nodes:
            params_idx.append(len(names))
        flops_of.append(float(node_flops(node)) if node.op == "call_function" else 0.0)
        names.append(node.name)
        strats.append(options)
        costs.append(c_row)
        memory.append(m_row)
        intervals.append(iv)

    index = {n: i for i, n in enumerate(names)}
    edges: list[tuple[int, int]] = []
    edge_costs: list[list[float]] = []
    edge_info: list[tuple[str, str, int, float, str, int]] = []

    matrices: dict[tuple, list[float]] = {}

    def add_edge(u: str, v: str, out_idx: int, pos: int, kind: str) -> None:
        iu = index[u]
        need = [
            s.outputs[0] if pos < 0 else (s.inputs[pos] if pos < len(s.inputs) else None)
            for s in strats[index[v]]
        ]
        val = _output_vals(by_name[u])[out_idx]
        nbytes = _tensor_bytes(val) * (scale if getattr(val, "is_floating_point", lambda: False)() else 1)
        haves = tuple(a.outputs[out_idx] if out_idx < len(a.outputs) else None for a in strats[iu])
        key = (haves, tuple(need), nbytes)
        row = matrices.get(key)
        if row is None:  # repeated layers ask for the same matrix: build it once
            row = []
            for have in haves:
                for b in need:
                    if have is None or b is None:
                        row.append(0.0)
                        continue
                    t = redistribute_time(have, b, nbytes, mesh_shape, links)
                    row.append(FORBIDDEN_S if t == INF else t)
            matrices[key] = row
        edges.append((iu, index[v]))
        edge_costs.append(row)
        edge_info.append((u, v, out_idx, nbytes, kind, pos))

    for v in names:
        ns = strategies[v]
        node = by_name[v]
        for k, u in enumerate(ns.inputs):
            if u not in index:
                continue
            out_idx = node.args[1] if node.target is operator.getitem and k == 0 else 0
            add_edge(u, v, out_idx, k, "data")
    grad_edges = []
    for p in captured.params:
        g = captured.grads.get(p.name)
        if g in index and p.placeholder in index:
            grad_edges.append(len(edges))
            add_edge(g, p.placeholder, 0, -1, "grad-sync")

    problem = StrategyProblem(
        node_costs=costs,
        node_memory=memory,
        node_intervals=intervals,
        edges=edges,
        edge_costs=edge_costs,
        memory_limit=memory_limit,
        node_names=names,
    )
    return ShardingProblem(problem, names, strats, edge_info, grad_edges, backward, params_idx, flops_of)


def _mem_eff(efficiency: ComputeEfficiency | None) -> float:
    from autopar.cost_models import compute

    return (efficiency or compute.DEFAULT_EFFICIENCY).memory


def _needed(sp: ShardingProblem, edge: int, b: Strategy):
    pos = sp.edge_info[edge][5]
    if pos < 0:
        return b.outputs[0]
    return b.inputs[pos] if pos < len(b.inputs) else None


def charged_collectives(sp: ShardingProblem, choice: list[int], mesh_shape: tuple[int, ...]) -> list[dict]:
    """Every collective the chosen strategies imply, one record per edge that communicates."""
    out = []
    for e, (iu, iv) in enumerate(sp.problem.edges):
        u, v, k, nbytes, kind, _ = sp.edge_info[e]
        a = sp.strategies[iu][choice[iu]]
        have = a.outputs[k] if k < len(a.outputs) else None
        need = _needed(sp, e, sp.strategies[iv][choice[iv]])
        if have is None or need is None:
            continue
        for coll, d, size in collectives_between(have, need, nbytes, mesh_shape) or []:
            out.append({"kind": coll, "mesh_dim": d, "bytes": size, "from": u, "to": v, "reason": kind})
    return out
