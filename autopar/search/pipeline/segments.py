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

from dataclasses import dataclass, replace

from autopar.capture.graph import Fold
from autopar.capture.joint import CapturedGraph
from autopar.cost_models import overlap
from autopar.cost_models.comm import bucketed_time
from autopar.cost_models.compute import is_view
from autopar.cost_models.pipeline import Segment
from autopar.cost_models.reshard import shard_factor
from autopar.cost_models.step import param_gather_exposed
from autopar.search.pipeline.stages import GraphSegment, forward_segments, segment_of_nodes
from autopar.search.sharding.instance import (
    TP_DIM,
    ShardingProblem,
    gradient_chain,
    parameter_sourced,
    tp_seconds,
)
from autopar.search.sharding.step_memory import Buffer, edge_buffers


def pipeline_memory_problem(sp: ShardingProblem, pp: int) -> ShardingProblem:
    """``sp`` with the parameters' states (and the fixed state) divided by ``pp``: the memory one stage's MILP
    must fit."""
    params = set(sp.held_nodes)
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
    links: list | None = None,
) -> list[Segment]:
    """Per segment, per device of its stage: the figures of the chosen strategies (see Segment).

    ``links``: the mesh dims' links, to find the tensor-parallel part of the data
    movement when the runtime overlaps it (:mod:`autopar.cost_models.overlap`);
    without them it stays on the critical path.

    ``sp`` is the problem at ``microbatches`` micro-batches (activation memory per
    micro-batch); compute and data movement are per step there, so they are divided
    by the micro-batch count here.
    """
    k = len(graph_segments)
    seg_of = _segments_of_names(captured, graph_segments)
    index_seg = [seg_of.get(name, k - 1) for name in sp.nodes]
    f = _SegmentFigures.zeros(k)
    _add_node_figures(f, captured, sp, choice, index_seg, microbatches, seg_of, graph_segments)
    _add_edge_figures(f, sp, choice, index_seg, microbatches, mesh_shape, links)
    tp = mesh_shape[TP_DIM] if len(mesh_shape) > TP_DIM else 1
    _add_activation_memory(
        f, sp, choice, index_seg, _backward_reader_segments(captured, sp, seg_of), edge_buffers(sp, choice, mesh_shape)
    )
    _add_boundary_bytes(f, captured, sp, choice, seg_of, mesh_shape, microbatches, activation_scale)
    return [
        Segment(
            name=graph_segments[j].name,
            forward_s=f.fwd[j] - f.fwd_tp[j] + overlap.tp_exposed(f.fwd_tp[j], f.fwd_compute[j], tp),
            backward_s=f.bwd[j] - f.bwd_tp[j] + overlap.tp_exposed(f.bwd_tp[j], f.bwd_compute[j], tp),
            saved_bytes=f.saved[j],
            transient_bytes=f.trans[j],
            state_bytes=f.states[j],
            optimizer_s=f.opt[j] + _param_gather(f.gathered[j], f.fwd_compute[j], sp, mesh_shape, links),
            grad_sync_s=f.sync[j],
            boundary_bytes=f.boundary[j],
            params=f.params[j],
            forward_fixed_s=f.fwd_fixed[j],
            backward_fixed_s=f.bwd_fixed[j],
            grad_bytes=f.grads[j],
            tied=tuple(f.tied[j]),
        )
        for j in range(k)
    ]


def layer_figures(
    captured: CapturedGraph,
    sp: ShardingProblem,
    choice: list[int],
    graph_segments: list[GraphSegment],
    mesh_shape: tuple[int, ...],
    microbatches: int,
    activation_scale: float,
    links: list | None = None,
) -> list[Segment]:
    """:func:`segment_figures` of ``captured``'s segments, for an answer to its problem or to its folded one.

    An answer to a folded problem (``sp.template`` set, :mod:`autopar.search.sharding.fold`) is
    read on the four traced layers, every layer counted once, and each template layer's
    figures stand for the layers it stands for (:func:`unfold_segments`).
    """
    fold = captured.fold
    if sp.template is None or fold is None:
        return segment_figures(
            captured, sp, choice, graph_segments, mesh_shape, microbatches, activation_scale, links
        )
    template = forward_segments(fold.template)
    segs = segment_figures(
        fold.template, sp.template, choice, template, mesh_shape, microbatches, activation_scale, links
    )
    return unfold_segments(segs, fold)


def unfold_segments(segments: list[Segment], fold: Fold) -> list[Segment]:
    """The four traced layers' segments as all ``fold.layers``: the first middle layer's for layers 1 .. L-3.

    Layers before the run (``fold.first``) were traced whole and keep their segments."""
    prefix, first = fold.stack + ".", fold.first
    last = fold.layers - 1
    out: list[Segment] = []
    for seg in segments:
        t = seg.name[len(prefix) :] if seg.name.startswith(prefix) else ""
        if not t.isdigit() or int(t) < first:
            out.append(seg)
            continue
        layers = {0: [0], 1: list(range(1, last - 1)), 2: [last - 1], 3: [last]}[int(t) - first]
        out += [replace(seg, name=f"{prefix}{j + first}") for j in layers]
    return out


def _param_gather(sizes: list[float], forward: float, sp: ShardingProblem, mesh_shape, links) -> float:
    """Exposed seconds of gathering a segment's stepped ZeRO-1/2 shards (``sizes`` bytes each) over dp, in
    buckets."""
    d = sp.dp_dim
    nbytes = sum(sizes)
    if not nbytes or d is None or links is None:
        return 0.0
    comm = bucketed_time("all_gather", sizes, mesh_shape[d], links[d], overlap.bucket_bytes(mesh_shape[d]))[0]
    return param_gather_exposed(comm, forward, nbytes, mesh_shape[d])


@dataclass
class _SegmentFigures:
    """The figures of :class:`Segment`, one list entry per segment, as the helpers add them up."""

    fwd: list[float]
    bwd: list[float]
    saved: list[float]
    trans: list[float]
    states: list[float]
    opt: list[float]
    sync: list[float]
    params: list[int]
    boundary: list[float]
    fwd_fixed: list[float]  # per micro-batch, whatever its size: parameters moved to the ops that read them
    bwd_fixed: list[float]
    # per micro-batch: the ops' compute, and the tensor-parallel collectives the runtime overlaps with it
    # (autopar.cost_models.overlap; none on autopar's own runtime)
    fwd_compute: list[float]
    bwd_compute: list[float]
    fwd_tp: list[float]
    bwd_tp: list[float]
    gathered: list[list[float]]  # ZeRO-1/2: bytes of each stepped parameter shard gathered after the optimizer
    grads: list[float]  # the gradients' part of states
    tied: list[list[tuple[str, str, float, float]]]  # Segment.tied

    @classmethod
    def zeros(cls, k: int) -> _SegmentFigures:
        return cls(
            *([0.0] * k for _ in range(7)),
            [0] * k,
            *([0.0] * k for _ in range(7)),
            [[] for _ in range(k)],
            [0.0] * k,
            [[] for _ in range(k)],
        )


def _segments_of_names(captured: CapturedGraph, graph_segments: list[GraphSegment]) -> dict[str, int]:
    """The segment of every node, placeholders in their first reader's."""
    seg_of = segment_of_nodes(captured, graph_segments)
    for n in captured.gm.graph.nodes:
        if n.op == "placeholder":
            readers = [seg_of[u.name] for u in n.users if u.name in seg_of]
            if readers:
                seg_of[n.name] = min(readers)
    return seg_of


def _add_node_figures(
    f: _SegmentFigures,
    captured: CapturedGraph,
    sp: ShardingProblem,
    choice: list[int],
    index_seg: list[int],
    m: int,
    seg_of: dict[str, int],
    graph_segments: list[GraphSegment],
) -> None:
    """Node costs per micro-batch by phase; parameters' optimizer time, state bytes and element counts.

    A parameter's states count in its first reader's segment; a later segment that reads it too (a head
    tied to the embedding) notes it in ``tied``, for the stage that holds a copy of it.
    """
    p = sp.problem
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    backward = set(sp.backward_nodes)
    param_nodes = set(sp.param_nodes)
    held = param_nodes | set(sp.state_nodes)
    for i, c in enumerate(choice):
        t = p.node_costs[i][c]
        seg = index_seg[i]
        if i in held:  # a parameter, or the fixed state (a buffer, a frozen parameter: held, never stepped)
            parts = sp.state_parts.get(i)
            states = sum(parts[c]) if parts else p.node_memory[i][c]
            grads = parts[c][1] if parts else 0.0
            f.states[seg] += states
            f.grads[seg] += grads
            node = by_name[sp.nodes[i]]
            for other in sorted({seg_of[u.name] for u in node.users if u.name in seg_of} - {seg}):
                f.tied[other].append((node.name, graph_segments[seg].name, states, grads))
            if i not in param_nodes:
                continue
            # ZeRO-1/2's gather of the stepped shard is costed per segment, in buckets (segment_figures)
            gather = sp.param_comm[i][c] if i in sp.param_comm else 0.0
            f.opt[seg] += t - gather
            if gather and sp.strategies[i][c].zero:
                f.gathered[seg].append(sp.state_parts[i][c][0])
            val = node.meta.get("val")
            f.params[seg] += val.numel() if hasattr(val, "numel") else 0
        elif i in backward:
            f.bwd[seg] += t / m
            f.bwd_compute[seg] += t / m
        else:
            f.fwd[seg] += t / m
            f.fwd_compute[seg] += t / m


def _add_edge_figures(
    f: _SegmentFigures,
    sp: ShardingProblem,
    choice: list[int],
    index_seg: list[int],
    m: int,
    mesh_shape: tuple[int, ...],
    links: list | None,
) -> None:
    """Edge costs in the consumer's segment: gradient synchronisation per step, the rest per micro-batch.

    A partial gradient reduced on its way to the gradient (a bias's ``sum``, a norm's
    weight gradient) is gradient synchronisation too, wherever the solver put its
    collective (:func:`autopar.search.sharding.instance.gradient_chain`): it overlaps
    with the last backward, as the flat estimate has it, not with every micro-batch's.
    """
    p = sp.problem
    backward = set(sp.backward_nodes)
    grad_edges = set(sp.grad_edges)
    chain = gradient_chain(sp)
    moved = parameter_sourced(sp)
    for e, (u, v) in enumerate(p.edges):
        cost = p.edge_costs[e][choice[u] * len(p.node_costs[v]) + choice[v]]
        seg = index_seg[v]
        info = sp.edge_info[e]
        fixed = info.kind == "data" and info.src in moved  # moved again for every micro-batch
        if e in grad_edges or (info.kind == "data" and info.dst in chain):
            f.sync[seg] += cost
            continue
        tp = 0.0
        if links is not None and overlap.RUNTIME.tp_comm_overlap and info.kind == "data" and cost > 0:
            a, b = sp.strategies[u][choice[u]], sp.strategies[v][choice[v]]
            tp = min(cost, tp_seconds(info, a, b, mesh_shape, links, sp.dp_dim))
        if v in backward:
            f.bwd[seg] += cost / m
            f.bwd_tp[seg] += tp / m
            if fixed:
                f.bwd_fixed[seg] += cost / m
        else:
            f.fwd[seg] += cost / m
            f.fwd_tp[seg] += tp / m
            if fixed:
                f.fwd_fixed[seg] += cost / m


def _backward_reader_segments(
    captured: CapturedGraph, sp: ShardingProblem, seg_of: dict[str, int]
) -> dict[int, int]:
    """For each node of ``sp`` a backward op reads (through views), the first segment whose backward reads it.

    A value kept for the backward is held by the stage whose backward reads it: a layer's input, made by
    the layer before, is kept by this layer's stage (which received it), not by the stage that sent it.
    """
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    out: dict[int, int] = {}
    for i, name in enumerate(sp.nodes):
        node = by_name.get(name)
        if node is None:
            continue
        todo, seen, first = list(node.users), set(), None
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            if is_view(u):
                todo.extend(u.users)
            elif u.meta.get("autopar_phase") == "backward" and u.name in seg_of:
                first = seg_of[u.name] if first is None else min(first, seg_of[u.name])
        if first is not None:
            out[i] = first
    return out


def _add_activation_memory(
    f: _SegmentFigures,
    sp: ShardingProblem,
    choice: list[int],
    index_seg: list[int],
    reader_seg: dict[int, int],
    buffers: list[Buffer] = (),
) -> None:
    """Per micro-batch: the bytes kept across the forward/backward turn, and the peak of the rest.

    A value live across the turn is kept for the backward, by the segment whose backward
    reads it (``reader_seg``; the segment that made it where no backward op reads it). The
    turn follows the last forward op: autograd's saved-tensor handles are backward nodes
    traced inside the forward (a detach where a value is saved), and the first of them is no turn.

    ``buffers``: the tensors the answer's changes of placement make on their readers' side
    (:func:`autopar.search.sharding.step_memory.edge_buffers`), counted by their reader's
    segment the same way. One lives across the turn where its reader is a view whose views
    the backward reads (an activation gathered, then split into the queries, keys and values
    attention saves): each micro-batch in flight holds it.
    """
    p = sp.problem
    backward = set(sp.backward_nodes)
    held = set(sp.held_nodes)  # counted with the states
    not_forward = backward | held
    turn = max((p.node_intervals[i][0] for i in range(len(choice)) if i not in not_forward), default=-1) + 1
    n_nodes = len(p.node_costs)
    skip = {n_nodes + k for k in getattr(sp, "grad_items", ())}  # gradients: counted with the states
    item_node, intervals, item_memory = p.items()
    events: list[dict[int, float]] = [{} for _ in f.trans]

    def count(v: int, s: int, e: int, mem: float) -> None:
        """``mem`` bytes made for node ``v`` (its output, or a tensor its input was moved into), live over [s, e)."""
        seg = index_seg[v]
        if s < turn < e and v not in backward:
            f.saved[reader_seg.get(v, seg)] += mem
        else:
            ev = events[seg]
            ev[s] = ev.get(s, 0.0) + mem
            ev[e] = ev.get(e, 0.0) - mem

    for idx, (v, (s, e), row) in enumerate(
        zip(item_node.tolist(), intervals.tolist(), item_memory, strict=True)
    ):
        if v in held or idx in skip:
            continue
        if row[choice[v]]:
            count(v, s, e, row[choice[v]])
    for s, e, mem, edge in buffers:  # a backward op's moved input is moved in the backward graph
        count(p.edges[edge][1], s, e, mem)
    for seg, ev in enumerate(events):
        live = top = 0.0
        for t in sorted(ev):
            live += ev[t]
            top = max(top, live)
        f.trans[seg] = top


def _add_boundary_bytes(
    f: _SegmentFigures,
    captured: CapturedGraph,
    sp: ShardingProblem,
    choice: list[int],
    seg_of: dict[str, int],
    mesh_shape: tuple[int, ...],
    m: int,
    activation_scale: float,
) -> None:
    """Bytes crossing each cut: forward values a later segment reads, local shards, per micro-batch."""
    strategy_of = {name: sp.strategies[i][choice[i]] for i, name in enumerate(sp.nodes)}
    for n in captured.gm.graph.nodes:
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
            f.boundary[j] += local


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
    the per-step figures (states, optimizer, gradient sync) do not change, nor do
    the parameters a micro-batch moves to its ops (``forward_fixed_s``, ``backward_fixed_s``).
    """
    if measured == microbatches:
        return segments
    f = measured / microbatches
    return [
        replace(
            s,
            forward_s=(s.forward_s - s.forward_fixed_s) * f + s.forward_fixed_s,
            backward_s=(s.backward_s - s.backward_fixed_s) * f + s.backward_fixed_s,
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
