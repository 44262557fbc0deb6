"""Build the sharding MILP instance from a joint graph, its strategies and the cost models.

For a mesh of shape (n_1, ..., n_k) with links L_1..L_k, every node v of the
joint graph with strategies s ∈ S_v becomes a node of the solver's
``StrategyProblem``:

    c_v[s]  = roofline(flops_v / W_v(s), bytes_v(s))         compute, local to one device
              W_v(s) = Π n_d over mesh dims d where s is not all-"R" (the work is split)
              bytes_v(s) = Σ inputs and outputs of their local (sharded) bytes
    c_p[s]  = optimizer update of parameter p's local shard (memory-bound)
    m_v[s]  = local bytes of v's output, live from v through its last use (activations, temporaries)
    m_p[s]  = local bytes of p's parameter and optimizer state, live throughout; its gradient from the
              op that makes it, and buffers, are memory items (autopar.search.sharding.step_memory)

and every (producer u → consumer v) pair becomes an edge whose cost matrix is

    E_uv[a, b] = redistribute(u's output under a → the placement v needs under b)

Gradient synchronisation is the edge (grad of p → p): a gradient that is a
partial sum over the data-parallel dim must be all-reduced (or
reduce-scattered, if p is sharded) to p's placement.

ZeRO. A parameter sharded over dp is ZeRO-3 by its placement: its
parameter, gradient and optimizer state are all 1/dp, and every use pays an
all-gather on its data edges. A parameter replicated over dp (with D = dp
ranks, n its local elements) also has ZeRO-1 and ZeRO-2 strategies, the same
placement with

    m_p[s, z=1] = n (b_param + b_grad + (b_opt + b_copy) / D)
    m_p[s, z=2] = n (b_param + (b_grad + b_opt + b_copy) / D)
    c_p[s, z]   = update of n / D elements + all-gather of the stepped chunks (n b_param)

(b_copy: in fp32, the chunk of the parameter the optimizer steps, which no master copy already is;
the gradient's part, from the op that makes it, is a memory item) and a gradient edge that ends in a reduce-scatter over dp instead of an
all-reduce (once per step for ZeRO-1, once per micro-batch for ZeRO-2, as the
runtime does): the same 2Ψ of traffic as plain data parallelism, part of it
after the backward instead of under it, for 1/D of the optimizer state (and
gradients). User inputs are
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
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from autopar.capture.joint import CapturedGraph, graph_results
from autopar.cost_models.comm import collective_time
from autopar.cost_models.compute import (
    DEFAULT_EFFICIENCY,
    ComputeEfficiency,
    is_view,
    node_flops,
    roofline_time,
)
from autopar.cost_models.memory import Precision, optimizer_bytes_per_param, partition_copy_bytes
from autopar.cost_models.reshard import INF, grad_sync_steps, shard_factor
from autopar.hardware.cluster import Link
from autopar.search.sharding.recompute import can_recompute
from autopar.search.sharding.step_memory import accumulated, parameter_items
from autopar.search.sharding.strategies import NodeStrategies, Strategy
from autopar.solver import StrategyProblem

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
    # per parameter node, per strategy: (parameter, gradient, optimizer state) bytes, and the seconds of
    # its cost that are a ZeRO-1/2 all-gather rather than the optimizer update
    state_parts: dict[int, list[tuple[float, float, float]]] = field(default_factory=dict)
    param_comm: dict[int, list[float]] = field(default_factory=dict)
    dp_dim: int | None = 0
    # the gradients' memory items (positions in problem.memory_items: sized by the parameters, not the
    # batch); the graph's facts and the micro-batch count, for autopar.search.sharding.step_memory
    grad_items: list[int] = field(default_factory=list)
    facts: Any = None
    microbatches: int = 1
    # nodes that replay a forward op in the backward (made by autopar.search.sharding.recompute): hardware FLOPs,
    # not model FLOPs
    replayed: list[int] = field(default_factory=list)


def _tensor_bytes(val) -> float:
    if hasattr(val, "numel") and hasattr(val, "element_size"):
        return float(val.numel()) * val.element_size()
    return 0.0


def _output_vals(node: fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]


@dataclass
class _GraphFacts:
    """What build_problem reads from the graph that no mesh changes: computed once per graph.

    Planning builds one problem per mesh shape (and the search tries a dozen), so the
    FLOP formulas, byte counts and live intervals are read here once rather than once
    per strategy of every node of every mesh.
    """

    n_nodes: int
    order: dict[str, int]
    by_name: dict[str, fx.Node]
    out_bytes: dict[str, list[float]]  # per output value, at the traced dtype
    out_float: dict[str, list[bool]]  # per output value: floating point (scaled to the training dtype)
    whole_bytes: dict[str, float]  # bytes of meta["val"] taken whole (0 for a tuple)
    flops: dict[str, float]  # node_flops, 0 for non-calls
    view: dict[str, bool]
    interval: dict[str, tuple[int, int]]  # live interval of a non-parameter node (views of it included)
    # outputs of a tuple-valued node that outlive it through their getitem: (output index, end)
    tuple_tails: dict[str, list[tuple[int, int]]]
    backward: set[str]
    element_size: dict[str, int]
    # forward nodes whose output the backward reads and that can be recomputed there:
    # (end of the last forward use, first backward use); and per such node, its inputs that would
    # be freed before that backward use (and so must be kept for the recomputation), with their end
    recompute_gap: dict[str, tuple[int, int]] = field(default_factory=dict)
    late_inputs: dict[str, dict[str, int]] = field(default_factory=dict)


_FACTS: weakref.WeakKeyDictionary[fx.GraphModule, _GraphFacts] = weakref.WeakKeyDictionary()


def _graph_facts(gm: fx.GraphModule) -> _GraphFacts:
    facts = _FACTS.get(gm)
    if facts is not None and facts.n_nodes == len(gm.graph.nodes):
        return facts
    nodes = list(gm.graph.nodes)
    order = {n.name: i for i, n in enumerate(nodes)}
    facts = _GraphFacts(len(nodes), order, {n.name: n for n in nodes}, {}, {}, {}, {}, {}, {}, {}, set(), {})
    # A view keeps its base's storage alive: a tensor is freed after the last use of it or of any view of
    # it (and an output of a tuple-valued op after the last use of its getitem and that one's views; the
    # pieces of a view op such as split are views of its input). A tensor is live while its last reader
    # runs: the interval ends one after it. The graph's output is no reader: the gradients it returns are
    # costed as the parameters' (autopar.search.sharding.step_memory), the loss is a scalar. Nor is dead code (a
    # saved-tensor handle recompute left without readers): the runtime drops it.
    owner: dict[fx.Node, tuple] = {}
    storage_end: dict[tuple, int] = {}
    live = _live_nodes(nodes)
    for node in nodes:
        ends = [order[u.name] + 1 for u in node.users if u.op != "output" and u in live]
        last = max(ends, default=0 if is_view(node) or node not in live else order[node.name] + 1)
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            key = owner.get(src, (src, None)) if is_view(src) else (src, node.args[1])
        elif is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            key = owner.get(node.args[0], (node.args[0], None))
        else:
            key = (node, None)
        owner[node] = key
        storage_end[key] = max(storage_end.get(key, 0), last)
    tails: dict[str, list[tuple[int, int]]] = {}
    for (src, k), stop in storage_end.items():
        if k is not None:
            tails.setdefault(src.name, []).append((k, stop))
    for node in nodes:
        name = node.name
        vals = _output_vals(node)
        facts.out_bytes[name] = [_tensor_bytes(v) for v in vals]
        facts.out_float[name] = [bool(getattr(v, "is_floating_point", lambda: False)()) for v in vals]
        facts.whole_bytes[name] = _tensor_bytes(node.meta.get("val"))
        facts.flops[name] = float(node_flops(node)) if node.op == "call_function" else 0.0
        facts.view[name] = is_view(node)
        last_use = max(storage_end.get((node, None), 0), order[name] + 1)
        facts.interval[name] = (order[name], last_use)
        if name in tails:
            facts.tuple_tails[name] = [(k, stop) for k, stop in sorted(tails[name]) if stop > last_use]
        if node.op == "call_function" and node.meta.get("autopar_phase") == "backward":
            facts.backward.add(name)
        if hasattr(vals[0], "element_size"):
            facts.element_size[name] = vals[0].element_size()
    _recompute_facts(nodes, order, owner, storage_end, facts)
    _FACTS[gm] = facts
    return facts


def _live_nodes(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes that run: placeholders, the output, ops with side effects, and what they read."""
    live: set[fx.Node] = set()
    for n in reversed(nodes):
        if n.op in ("placeholder", "output") or n.is_impure() or any(u in live for u in n.users):
            live.add(n)
    return live


def _recompute_facts(
    nodes: list[fx.Node], order: dict[str, int], owner: dict[fx.Node, tuple], storage_end: dict, facts
) -> None:
    """Which forward values could be recomputed in the backward, and over which gap they would be freed.

    A value (with its views) is a candidate when the backward reads it, nothing
    outside the graph's ops does, it is one tensor made by a replayable op
    (:func:`autopar.search.sharding.recompute.can_recompute`), and its last forward use comes
    before its first backward use.
    """
    fwd_last: dict[tuple, int] = {}
    bwd_first: dict[tuple, int] = {}
    escapes: set[tuple] = set()
    for node in nodes:
        key = owner[node]
        for u in node.users:
            if u.op != "call_function":
                escapes.add(key)
            elif u.name in facts.backward:
                bwd_first[key] = min(bwd_first.get(key, order[u.name]), order[u.name])
            else:
                fwd_last[key] = max(fwd_last.get(key, 0), order[u.name])
    for node in nodes:
        name, key = node.name, (node, None)
        if (
            node.op != "call_function"
            or name in facts.backward
            or facts.view[name]
            or node.target is operator.getitem
            or owner[node] != key
            or key in escapes
            or key not in bwd_first
            or not isinstance(node.meta.get("val"), torch.Tensor)
        ):
            continue
        gap = (max(fwd_last.get(key, order[name]), order[name]) + 1, bwd_first[key])
        if gap[1] <= gap[0] or not can_recompute(node):
            continue
        facts.recompute_gap[name] = gap
        late = {}
        for a in node.all_input_nodes:
            end_a = storage_end.get(owner[a], 0)
            if a.op != "placeholder" and end_a < gap[1]:
                late[a.name] = end_a
        facts.late_inputs[name] = late


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
    recompute: bool = False,
) -> ShardingProblem:
    """The MILP instance for one mesh (see the module docstring for the formulation).

    ``recompute``: with a memory limit, each recomputable activation also gets its
    strategies again, recomputed in the backward.
    """
    gm = captured.gm
    facts = _graph_facts(gm)
    by_name = facts.by_name
    scale = precision.activation_bytes / max(
        (p.dtype.itemsize for p in captured.params if p.dtype.is_floating_point), default=4
    )
    param_nodes = {p.placeholder: p for p in captured.params}
    input_nodes = {t.placeholder for t in captured.inputs}
    opt_traffic = (
        precision.grad_bytes + 2 * optimizer_bytes_per_param(precision, optimizer) + precision.param_bytes
    )
    end = facts.n_nodes
    mem_bw = device.hbm_bandwidth * _mem_eff(efficiency)

    factor: dict[tuple[str, ...], int] = {}

    def pieces(p: tuple[str, ...]) -> int:
        f = factor.get(p)
        if f is None:
            f = factor[p] = shard_factor(p, mesh_shape)
        return f

    split_of: dict[tuple, int] = {}

    def split(s: Strategy) -> int:
        """The number of pieces the work is cut into: the mesh dims where any placement is not "R"."""
        key = (s.outputs, s.inputs)
        n = split_of.get(key)
        if n is None:
            n = split_of[key] = math.prod(
                n
                for d, n in enumerate(mesh_shape)
                if any(p is not None and p[d] != "R" for p in (*s.outputs, *s.inputs))
            )
        return n

    dp_n = mesh_shape[dp_dim] if dp_dim is not None else 1
    variants: dict[tuple[int, int], Strategy] = {}

    def with_zero(options: list[Strategy]) -> list[Strategy]:
        """A dp-replicated parameter's strategies, then each again under ZeRO-1 and ZeRO-2."""
        if dp_n == 1:
            return options
        out = list(options)
        for z in (1, 2):
            for s in options:
                if s.outputs[0] is not None and s.outputs[0][dp_dim] == "R":
                    v = variants.get((id(s), z))
                    if v is None:
                        v = variants[(id(s), z)] = replace(s, zero=z)
                    out.append(v)
        return out

    def with_recompute(options: list[Strategy]) -> list[Strategy]:
        """A recomputable activation's strategies, then each again recomputed in the backward."""
        out = list(options)
        for s in options:
            v = variants.get((id(s), -1))
            if v is None:
                v = variants[(id(s), -1)] = replace(s, recompute=True)
            out.append(v)
        return out

    b_param, b_grad = precision.param_bytes, precision.grad_bytes
    b_opt = optimizer_bytes_per_param(precision, optimizer)
    b_copy = partition_copy_bytes(precision)
    names: list[str] = []
    strats: list[list[Strategy]] = []
    state_parts: dict[int, list[tuple[float, float, float]]] = {}
    param_comm: dict[int, list[float]] = {}
    items: list[tuple[int, tuple[int, int], list[float]]] = []
    costs: list[list[float]] = []
    memory: list[list[float]] = []
    intervals: list[tuple[int, int]] = []
    backward: list[int] = []
    params_idx: list[int] = []
    flops_of: list[float] = []
    # nodes of repeated layers have the same strategies (shared objects) and sizes: cost them once
    rows: dict[tuple, tuple[list[float], list[float]]] = {}
    list_id: dict[tuple[int, ...], int] = {}  # distinct strategy lists (by their objects' identity)
    list_ids: list[int] = []  # per problem node
    for node in gm.graph.nodes:
        ns = strategies.get(node.name)
        if ns is None or not ns.strategies:
            continue
        name = node.name
        options = list(ns.strategies)
        if name in input_nodes and dp_dim is not None:
            batch = [s for s in options if s.outputs[0] is not None and s.outputs[0][dp_dim] == "S(0)"]
            options = batch or options
        is_param = name in param_nodes
        if is_param:
            options = with_zero(options)
        gap = facts.recompute_gap.get(name) if recompute and memory_limit is not None else None
        if gap is not None:
            options = with_recompute(options)
        kind = "param" if is_param else ("placeholder" if node.op == "placeholder" else "op")
        out_bytes = facts.out_bytes[name]
        in_bytes = [facts.whole_bytes.get(inp) for inp in ns.inputs] if kind == "op" else []
        ids = tuple(map(id, options))
        list_ids.append(list_id.setdefault(ids, len(list_id)))
        key = (
            kind,
            ids,
            tuple(out_bytes),
            tuple(in_bytes),
            facts.flops[name],
            facts.view[name],
            facts.element_size.get(name),
        )
        got = rows.get(key)
        if got is None:
            c_row, m_row, parts, gather, in_parts = [], [], [], [], []
            if is_param:
                elem = max(facts.element_size[name], 1)
                for s in options:
                    out_local = [
                        b / pieces(p) if p is not None else 0.0
                        for b, p in zip(out_bytes, s.outputs, strict=False)
                    ]
                    numel = sum(out_local) / elem
                    opt_div = dp_n if s.zero else 1
                    grad_div = dp_n if s.zero == 2 else 1
                    ag = (
                        collective_time("all_gather", numel * b_param, dp_n, links[dp_dim]) if s.zero else 0.0
                    )
                    c_row.append(numel * opt_traffic / opt_div / mem_bw + ag)
                    opt = b_opt + (b_copy if s.zero else 0)
                    parts.append((numel * b_param, numel * b_grad / grad_div, numel * opt / opt_div))
                    m_row.append(parts[-1][0] + parts[-1][2])  # the gradient is an item: it lives from the backward
                    gather.append(ag)
            elif kind == "placeholder":
                for s in options:
                    out_local = [
                        b / pieces(p) if p is not None else 0.0
                        for b, p in zip(out_bytes, s.outputs, strict=False)
                    ]
                    c_row.append(0.0)
                    m_row.append(sum(out_local) / microbatches)
            else:
                view = facts.view[name]
                node_fl = facts.flops[name]
                for s in options:
                    out_local = [
                        b / pieces(p) if p is not None else 0.0
                        for b, p in zip(out_bytes, s.outputs, strict=False)
                    ]
                    ins = [
                        b / pieces(p) if b is not None and p is not None else 0.0
                        for b, p in zip(in_bytes, s.inputs, strict=False)
                    ]
                    flops = node_fl / split(s)
                    nbytes = 0.0 if view else (sum(ins) + sum(out_local))
                    t = roofline_time(flops, nbytes, device, precision.compute_dtype, efficiency, scale)
                    c_row.append(2 * t if s.recompute else t)  # a recomputed op runs again in the backward
                    in_parts.append([b * scale / microbatches for b in ins])
                    # with m micro-batches a step runs the graph m times on 1/m of the batch: the same
                    # total compute and traffic, 1/m of the activations live at once
                    m_row.append(0.0 if view else sum(out_local) * scale / microbatches)
                    parts.append([0.0 if view else b * scale / microbatches for b in out_local])
            got = rows[key] = (c_row, m_row, parts, gather, in_parts)
        c_row, m_row, parts, gather, in_parts = got
        iv = (0, end) if is_param else facts.interval[name]
        if gap is not None:
            # live in the forward; kept over the gap unless recomputed; live again in the backward
            here = len(names)
            kept = [0.0 if s.recompute else m for s, m in zip(options, m_row, strict=True)]
            items.append((here, gap, kept))
            if iv[1] > gap[1]:
                items.append((here, (gap[1], iv[1]), list(m_row)))
            late = facts.late_inputs[name]
            for k, inp in enumerate(ns.inputs):
                if inp in late:  # an input that would be freed earlier is kept for the recomputation
                    row = [x[k] if s.recompute and k < len(x) else 0.0 for s, x in zip(options, in_parts, strict=True)]
                    items.append((here, (late[inp], gap[1]), row))
            iv = (iv[0], gap[0])
        for k, stop in facts.tuple_tails.get(name, []) if kind == "op" else []:
            # an output of a tuple-valued op, alive after the op through its getitem (a saved mean, a mask)
            items.append((len(names), (iv[1], stop), [row[k] if k < len(row) else 0.0 for row in parts]))
        if name in facts.backward:
            backward.append(len(names))
        if is_param:
            state_parts[len(names)] = parts
            param_comm[len(names)] = gather
            params_idx.append(len(names))
        flops_of.append(facts.flops[name])
        names.append(name)
        strats.append(options)
        costs.append(c_row)
        memory.append(m_row)
        intervals.append(iv)

    index = {n: i for i, n in enumerate(names)}
    grads = parameter_items(captured, by_name, facts.order, end, index, state_parts)
    grad_items = list(range(len(items), len(items) + len(grads)))
    items += grads
    if microbatches > 1:
        grad_items = accumulated(items, grad_items)
    edges: list[tuple[int, int]] = []
    edge_costs: list[list[float]] = []
    edge_info: list[tuple[str, str, int, float, str, int]] = []

    matrices: dict[tuple, list[float]] = {}
    moves: dict[tuple, float] = {}  # (have, need, bytes) -> seconds
    # the placements an edge's ends have and need, per strategy, numbered once per strategy list
    haves_of: dict[tuple[int, int], tuple[int, tuple]] = {}
    needs_of: dict[tuple[int, int], tuple[int, tuple]] = {}

    def add_edge(u: str, v: str, out_idx: int, pos: int, kind: str) -> None:
        iu, iv_ = index[u], index[v]
        need_id, need = needs_of.get((list_ids[iv_], pos), (-1, ()))
        if need_id < 0:
            need = tuple(
                (s.outputs[0], s.zero) if pos < 0 else (s.inputs[pos] if pos < len(s.inputs) else None, 0)
                for s in strats[iv_]
            )
            need_id = len(needs_of)
            needs_of[(list_ids[iv_], pos)] = (need_id, need)
        nbytes = facts.out_bytes[u][out_idx] * (scale if facts.out_float[u][out_idx] else 1)
        have_id, haves = haves_of.get((list_ids[iu], out_idx), (-1, ()))
        if have_id < 0:
            haves = tuple(a.outputs[out_idx] if out_idx < len(a.outputs) else None for a in strats[iu])
            have_id = len(haves_of)
            haves_of[(list_ids[iu], out_idx)] = (have_id, haves)
        # a parameter is gathered where an op computes with it, not into a view of it: the backward reads
        # such views, and the gathered parameter would stay alive from the forward to the backward
        pinned = u in param_nodes and kind == "data" and facts.view[v]
        key = (have_id, need_id, nbytes, pinned)
        row = matrices.get(key)
        if row is None:  # repeated layers ask for the same matrix: build it once
            row = []
            for have in haves:
                for b, zero in need:
                    if have is None or b is None:
                        row.append(0.0)
                        continue
                    t = moves.get((have, b, nbytes, zero))
                    if t is None:
                        steps = grad_sync_steps(have, b, zero, nbytes, mesh_shape, dp_dim)
                        t = INF if steps is None else _steps_time(steps, mesh_shape, links)
                        t = moves[(have, b, nbytes, zero)] = FORBIDDEN_S if t == INF else t
                    row.append(FORBIDDEN_S if pinned and t > 0 else t)
            matrices[key] = row
        edges.append((iu, iv_))
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
    # a buffer the forward updates in place gets its new value back in its own placement
    _, _, updates = graph_results(gm, len(captured.params))
    for b, node in zip(captured.updated, updates, strict=True):
        ph = captured.buffers[b].placeholder
        if node.name in index and ph in index and node.name != ph:
            add_edge(node.name, ph, 0, -1, "buffer-update")

    problem = StrategyProblem(
        node_costs=costs,
        node_memory=memory,
        node_intervals=intervals,
        edges=edges,
        edge_costs=edge_costs,
        memory_limit=memory_limit,
        node_names=names,
        memory_items=items or None,
    )
    return ShardingProblem(
        problem,
        names,
        strats,
        edge_info,
        grad_edges,
        backward,
        params_idx,
        flops_of,
        state_parts,
        param_comm,
        dp_dim,
        grad_items=grad_items,
        facts=facts,
        microbatches=microbatches,
        replayed=[i for i, name in enumerate(names) if "autopar_recompute_of" in by_name[name].meta],
    )


def _steps_time(steps: list[tuple[str, int, float]], mesh_shape: tuple[int, ...], links: list[Link]) -> float:
    return sum(collective_time(kind, b, mesh_shape[d], links[d]) for kind, d, b in steps)


def _mem_eff(efficiency: ComputeEfficiency | None) -> float:
    return (efficiency or DEFAULT_EFFICIENCY).memory


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
        b = sp.strategies[iv][choice[iv]]
        need = _needed(sp, e, b)
        if have is None or need is None:
            continue
        zero = b.zero if sp.edge_info[e][5] < 0 else 0
        for coll, d, size in grad_sync_steps(have, need, zero, nbytes, mesh_shape, sp.dp_dim) or []:
            out.append({"kind": coll, "mesh_dim": d, "bytes": size, "from": u, "to": v, "reason": kind})
    for i in sp.param_nodes:
        s = sp.strategies[i][choice[i]]
        if s.zero:
            local = sp.state_parts[i][choice[i]][0]
            name = sp.nodes[i]
            out.append(
                {
                    "kind": "all_gather",
                    "mesh_dim": sp.dp_dim,
                    "bytes": local,
                    "from": name,
                    "to": name,
                    "reason": "zero",
                }
            )
    return out


def with_microbatches(sp: ShardingProblem, microbatches: int) -> ShardingProblem:
    """``sp`` (built for one micro-batch) for ``microbatches``: its activation memory divided by that.

    Exactly what :func:`build_problem` computes with ``microbatches`` (the same floating-point
    operations), without building again: only the memory of non-parameter nodes depends on it.
    """
    if microbatches == 1:
        return sp
    params = set(sp.param_nodes)
    memory = [
        row if i in params else [x / microbatches for x in row]
        for i, row in enumerate(sp.problem.node_memory)
    ]
    # ZeRO-2 reduce-scatters each micro-batch's gradient (ZeRO-1 and plain data parallelism once a step)
    edge_costs = list(sp.problem.edge_costs)
    for e in sp.grad_edges:
        v = sp.problem.edges[e][1]
        cols = [j for j, s in enumerate(sp.strategies[v]) if s.zero == 2]
        if cols:
            n_v = len(sp.strategies[v])
            row = list(edge_costs[e])
            for a in range(len(row) // n_v):
                for j in cols:
                    row[a * n_v + j] *= microbatches
            edge_costs[e] = row
    # gradients are sized by the parameters, not the batch, and accumulate over the micro-batches
    grads = set(sp.grad_items)
    items = [
        (v, iv, row if k in grads else [x / microbatches for x in row])
        for k, (v, iv, row) in enumerate(sp.problem.memory_items or [])
    ]
    grad_items = accumulated(items, sp.grad_items)
    problem = replace(sp.problem, node_memory=memory, edge_costs=edge_costs, memory_items=items or None)
    return replace(sp, problem=problem, microbatches=microbatches, grad_items=grad_items)


def restrict(problem: StrategyProblem, sp: ShardingProblem, allowed) -> StrategyProblem:
    """``problem`` with the strategies ``allowed(node name, strategy)`` rejects forbidden (infinite cost).

    A node none of whose strategies is allowed keeps them all. Repeated-layer groups are
    split where their members' restrictions differ, so tying them never forbids more.
    Indices stay those of ``sp``: an answer reads back through ``sp`` as it is.
    """
    costs = list(problem.node_costs)
    masks: dict[int, tuple[bool, ...]] = {}
    for i, name in enumerate(sp.nodes):
        mask = tuple(bool(allowed(name, s)) for s in sp.strategies[i])
        if all(mask) or not any(mask):
            continue
        masks[i] = mask
        costs[i] = [c if ok else math.inf for c, ok in zip(costs[i], mask, strict=True)]
    groups = None
    if problem.groups:
        groups = []
        for group in problem.groups:
            parts: dict[tuple[bool, ...] | None, list[int]] = {}
            for v in group:
                parts.setdefault(masks.get(v), []).append(v)
            groups += [g for g in parts.values() if len(g) > 1]
    return replace(problem, node_costs=costs, groups=groups or None)
