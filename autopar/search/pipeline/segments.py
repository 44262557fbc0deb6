"""Segments of a solved sharding: what each piece of the forward costs inside a pipeline stage.

The pipeline search (:mod:`autopar.search.pipeline.mesh`) solves the sharding
problem of the whole graph on a stage's dp × tp sub-mesh, then reads the
chosen strategies back per *segment* of the forward
(:func:`autopar.search.pipeline.stages.forward_segments`): compute per micro-batch by
phase, tensor-parallel communication, parameter states, the activations a
micro-batch keeps from its forward to its backward, and the bytes that cross
a cut placed after the segment.  These are the numbers
:mod:`autopar.cost_models.pipeline` prices a cut set with.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.capture.joint import CapturedGraph
from autopar.cost_models.pipeline import Segment
from autopar.cost_models.reshard import shard_factor
from autopar.search.pipeline.stages import GraphSegment, segment_of_nodes
from autopar.search.sharding.instance import ShardingProblem


def pipeline_memory_problem(sp: ShardingProblem, pp: int) -> ShardingProblem:
    """``sp`` with the parameters' states divided by ``pp``: the memory one stage's MILP must fit."""
    params = set(sp.param_nodes)
    grads = set(getattr(sp, "grad_items", ()))  # positions in memory_items
    memory = [[x / pp for x in row] if i in params else row for i, row in enumerate(sp.problem.node_memory)]
    items = sp.problem.memory_items
    if items:
        items = [
            (v, iv, [x / pp for x in row]) if (v in params or k in grads) else (v, iv, row)
            for k, (v, iv, row) in enumerate(items)
        ]
    return replace(sp, problem=replace(sp.problem, node_memory=memory, memory_items=items))


def segment_figures(
    captured: CapturedGraph,
    sp: ShardingProblem,
    choice: list[int],
    graph_segments: list[GraphSegment],
    mesh_shape: tuple[int, ...],
    microbatches: int,
    activation_scale: float,
) -> list[Segment]:
    """Per segment, per device of its stage: the figures of the chosen strategies (see Segment).

    ``sp`` is the problem at ``microbatches`` micro-batches (activation memory per
    micro-batch); compute and data movement are per step there, so they are divided
    by the micro-batch count here.
    """
    m = microbatches
    seg_of = segment_of_nodes(captured, graph_segments)
    gm = captured.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    for n in gm.graph.nodes:  # placeholders belong to their first reader's segment
        if n.op == "placeholder":
            readers = [seg_of[u.name] for u in n.users if u.name in seg_of]
            if readers:
                seg_of[n.name] = min(readers)
    k = len(graph_segments)
    fwd, bwd, saved, trans = [0.0] * k, [0.0] * k, [0.0] * k, [0.0] * k
    states, opt, sync, params, boundary = [0.0] * k, [0.0] * k, [0.0] * k, [0] * k, [0.0] * k
    p = sp.problem
    index_seg = [seg_of.get(name, k - 1) for name in sp.nodes]
    backward = set(sp.backward_nodes)
    param_nodes = set(sp.param_nodes)
    for i, c in enumerate(choice):
        t = p.node_costs[i][c]
        seg = index_seg[i]
        if i in param_nodes:
            opt[seg] += t
            parts = sp.state_parts.get(i)
            states[seg] += sum(parts[c]) if parts else p.node_memory[i][c]
            val = by_name[sp.nodes[i]].meta.get("val")
            params[seg] += val.numel() if hasattr(val, "numel") else 0
        elif i in backward:
            bwd[seg] += t / m
        else:
            fwd[seg] += t / m
    grad_edges = set(sp.grad_edges)
    for e, (u, v) in enumerate(p.edges):
        cost = p.edge_costs[e][choice[u] * len(p.node_costs[v]) + choice[v]]
        seg = index_seg[v]
        if e in grad_edges:
            sync[seg] += cost
        elif v in backward:
            bwd[seg] += cost / m
        else:
            fwd[seg] += cost / m
    # memory per micro-batch: a value live across the forward/backward turn is kept for the backward.  The
    # turn follows the last forward op: autograd's saved-tensor handles are backward nodes traced inside
    # the forward (a detach where a value is saved), and the first of them is no turn
    not_forward = backward | param_nodes
    turn = max((p.node_intervals[i][0] for i in range(len(choice)) if i not in not_forward), default=-1) + 1
    n_nodes = len(p.node_costs)
    skip = {n_nodes + k for k in getattr(sp, "grad_items", ())}  # gradients: counted with the states
    item_node, intervals, item_memory = p.items()
    events: list[dict[int, float]] = [{} for _ in range(k)]
    for idx, (v, (s, e), row) in enumerate(
        zip(item_node.tolist(), intervals.tolist(), item_memory, strict=True)
    ):
        if v in param_nodes or idx in skip:
            continue
        mem = row[choice[v]]
        if not mem:
            continue
        seg = index_seg[v]
        if s < turn < e and v not in backward:
            saved[seg] += mem
        else:
            ev = events[seg]
            ev[s] = ev.get(s, 0.0) + mem
            ev[e] = ev.get(e, 0.0) - mem
    for seg, ev in enumerate(events):
        live = top = 0.0
        for t in sorted(ev):
            live += ev[t]
            top = max(top, live)
        trans[seg] = top
    # bytes crossing each cut: forward values a later segment reads, local shards, per micro-batch
    strategy_of = {name: sp.strategies[i][choice[i]] for i, name in enumerate(sp.nodes)}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n.name not in seg_of or n.meta.get("autopar_phase") != "forward":
            continue
        a = seg_of[n.name]
        b = max((seg_of[u.name] for u in n.users if u.name in seg_of), default=a)
        if b <= a:
            continue
        val = n.meta.get("val")
        if not hasattr(val, "numel"):
            continue
        nbytes = val.numel() * val.element_size() * (activation_scale if val.is_floating_point() else 1.0)
        s = strategy_of.get(n.name)
        placement = s.outputs[0] if s is not None and s.outputs else None
        local = nbytes / (shard_factor(placement, mesh_shape) if placement is not None else 1) / m
        for j in range(a, b):
            boundary[j] += local
    return [
        Segment(
            name=graph_segments[j].name,
            forward_s=fwd[j],
            backward_s=bwd[j],
            saved_bytes=saved[j],
            transient_bytes=trans[j],
            state_bytes=states[j],
            optimizer_s=opt[j],
            grad_sync_s=sync[j],
            boundary_bytes=boundary[j],
            params=params[j],
        )
        for j in range(k)
    ]


def microbatch_counts(local_batch: int, pp: int, fixed: int | None) -> list[int]:
    """Micro-batch counts worth costing: at least pp of them (else the bubble dominates), at most four."""
    if fixed is not None:
        return [fixed] if local_batch % fixed == 0 else []
    counts = [k for k in range(1, local_batch + 1) if local_batch % k == 0]
    deep = [k for k in counts if k >= pp] or counts[-1:]
    if len(deep) > 4:
        deep = sorted({deep[0], deep[len(deep) // 3], deep[2 * len(deep) // 3], deep[-1]})
    return deep


def rescale(segments: list[Segment], measured: int, microbatches: int) -> list[Segment]:
    """Segments costed at ``measured`` micro-batches, at ``microbatches`` instead.

    A micro-batch is ``1/m`` of the rank's batch: its compute, activations and the
    bytes it sends scale with that (every op of the graph is linear in the batch);
    the per-step figures (states, optimizer, gradient sync) do not change.
    """
    if measured == microbatches:
        return segments
    f = measured / microbatches
    return [
        replace(
            s,
            forward_s=s.forward_s * f,
            backward_s=s.backward_s * f,
            saved_bytes=s.saved_bytes * f,
            transient_bytes=s.transient_bytes * f,
            boundary_bytes=s.boundary_bytes * f,
        )
        for s in segments
    ]


def even_layer_cuts(graph_segments: list[GraphSegment], pieces: int) -> list[int] | None:
    """Cuts giving each of ``pieces`` stages the same number of layers (None: the layers do not divide)."""
    layers = [i for i, s in enumerate(graph_segments) if s.name.rsplit(".", 1)[-1].isdigit()]
    if not layers or len(layers) % pieces:
        return None
    per = len(layers) // pieces
    return [layers[k * per] for k in range(1, pieces)]
