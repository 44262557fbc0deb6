"""The edges of the sharding problem: E_uv, what bringing a value to where its reader needs it costs.

One step of :func:`autopar.search.sharding.problem.build_problem` per kind of
edge (the formulation is in that module's docstring): data edges from a
producer to each op that reads it, the gradient synchronisation edge of every
parameter, and the edge that brings an in-place updated buffer's new value
back to the buffer.  Each edge's matrix prices every pair of strategies by the
collectives DTensor's redistribution would run
(:func:`autopar.cost_models.reshard.grad_sync_steps`) on the mesh's links;
repeated layers ask for the same matrices, which are built once.
"""

from __future__ import annotations

import operator

import numpy as np

from autopar.capture.joint import graph_results
from autopar.cost_models import overlap
from autopar.cost_models.comm import collective_time, share_of_bucket
from autopar.cost_models.reshard import INF, grad_sync_steps
from autopar.hardware.cluster import Link
from autopar.search.sharding.build_context import BuildContext, Terms
from autopar.search.sharding.instance import EdgeInfo

# A cost the solver must avoid but that keeps the matrix finite (a forbidden transition).
FORBIDDEN_S = 1e6


def data_edges(ctx: BuildContext, t: Terms) -> None:
    """E_uv for every value an op reads from another problem node, in graph order."""
    for v in t.names:
        node = ctx.facts.by_name[v]
        for k, u in enumerate(ctx.strategies[v].inputs):
            if u not in t.index:
                continue
            follower = node.target is operator.getitem and k == 0
            out_idx = node.args[1] if follower else 0
            # a getitem moves its own value (the shard pass's follower), so its own place on the chain decides
            # the dtype: the weight gradients of an op with several outputs leave it through getitems on the chain
            scale = _reduce_scale(ctx, u, out_idx, v if follower else u)
            _add_edge(ctx, t, EdgeInfo(u, v, out_idx, _edge_bytes(ctx, u, out_idx), "data", k, scale))


def grad_sync_edges(ctx: BuildContext, t: Terms) -> None:
    """The edge (grad of p → p) of every parameter: where its gradient is synchronised."""
    for p in ctx.captured.params:
        g = ctx.captured.grads.get(p.name)
        if g in t.index and p.placeholder in t.index:
            t.grad_edges.append(len(t.edges))
            info = EdgeInfo(g, p.placeholder, 0, _edge_bytes(ctx, g, 0), "grad-sync", -1, _reduce_scale(ctx, g, 0))
            _add_edge(ctx, t, info)


def buffer_update_edges(ctx: BuildContext, t: Terms) -> None:
    """A buffer the forward updates in place gets its new value back in its own placement."""
    captured = ctx.captured
    _, _, updates = graph_results(captured.gm, len(captured.params))
    for b, node in zip(captured.updated, updates, strict=True):
        ph = captured.buffers[b].placeholder
        if node.name in t.index and ph in t.index and node.name != ph:
            _add_edge(ctx, t, EdgeInfo(node.name, ph, 0, _edge_bytes(ctx, node.name, 0), "buffer-update", -1))


def _reduce_scale(ctx: BuildContext, u: str, out_idx: int, moved: str | None = None) -> float:
    """A gradient on the chain is reduced in the plan's reduce dtype (:attr:`EdgeInfo.reduce_scale`).

    ``moved``: the node whose value the runtime moves (``u``, or the getitem that takes
    output ``out_idx`` of it); its place on the chain decides."""
    if (moved or u) not in ctx.gradient_chain or not ctx.facts.out_float[u][out_idx]:
        return 1.0
    return ctx.precision.reduce_bytes / ctx.precision.activation_bytes


def _edge_bytes(ctx: BuildContext, u: str, out_idx: int) -> float:
    """Global bytes of ``u``'s output ``out_idx``, floating-point values at the training dtype."""
    return ctx.facts.out_bytes[u][out_idx] * (ctx.scale if ctx.facts.out_float[u][out_idx] else 1)


def _add_edge(ctx: BuildContext, t: Terms, info: EdgeInfo) -> None:
    iu, iv = t.index[info.src], t.index[info.dst]
    t.edges.append((iu, iv))
    t.edge_costs.append(resharding_matrix(ctx, t, info))
    t.edge_info.append(info)


def resharding_matrix(ctx: BuildContext, t: Terms, info: EdgeInfo) -> list[float]:
    """E_uv, row-major over (strategy of u, strategy of v): seconds to bring the value where v needs it.

    A strategy list holds few distinct placements of one value (many strategies differ only
    in their other inputs and outputs), so the moves are priced once per distinct pair and the
    matrix is spread from that table.
    """
    iu, iv = t.index[info.src], t.index[info.dst]
    pos, out_idx = info.input_pos, info.output
    need_id, need = ctx.memo.needs.get((t.list_ids[iv], pos), (-1, ()))
    if need_id < 0:
        need = _distinct(
            (s.outputs[0], s.zero) if pos < 0 else (s.inputs[pos] if pos < len(s.inputs) else None, 0)
            for s in t.strats[iv]
        )
        need_id = len(ctx.memo.needs)
        ctx.memo.needs[(t.list_ids[iv], pos)] = (need_id, need)
    have_id, haves = ctx.memo.haves.get((t.list_ids[iu], out_idx), (-1, ()))
    if have_id < 0:
        haves = _distinct(a.outputs[out_idx] if out_idx < len(a.outputs) else None for a in t.strats[iu])
        have_id = len(ctx.memo.haves)
        ctx.memo.haves[(t.list_ids[iu], out_idx)] = (have_id, haves)
    # a parameter is gathered where an op computes with it, not into a view of it: the backward reads
    # such views, and the gathered parameter would stay alive from the forward to the backward
    pinned = info.src in ctx.params and info.kind == "data" and ctx.facts.view[info.dst]
    bucketed = info.kind == "grad-sync"
    key = (have_id, need_id, info.nbytes, pinned, bucketed, info.reduce_scale, info.kind)
    row = ctx.memo.matrices.get(key)
    if row is None:  # repeated layers ask for the same matrix: build it once
        (have_values, have_of), (need_values, need_of) = haves, need
        ids = ctx.memo.placement_ids
        have_keys = [ids.setdefault(h, len(ids)) for h in have_values]
        need_keys = [ids.setdefault(b, len(ids)) for b, _ in need_values]
        table = np.array(
            [
                [
                    _move_time(ctx, h, b, info.moved_bytes(h, b), z, pinned, bucketed, (hk, nk))
                    for (b, z), nk in zip(need_values, need_keys, strict=True)
                ]
                for h, hk in zip(have_values, have_keys, strict=True)
            ]
        ).reshape(len(have_values), len(need_values))
        row = ctx.memo.matrices[key] = table[have_of][:, need_of].ravel().tolist()
    return row


def _distinct(values) -> tuple[list, np.ndarray]:
    """The distinct values, in first-seen order, and the index of each value among them."""
    first: dict = {}
    index = [first.setdefault(v, len(first)) for v in values]
    return list(first), np.array(index, dtype=np.int64)


def _move_time(
    ctx: BuildContext, have, need, nbytes: float, zero: int, pinned: bool, bucketed: bool, ids: tuple[int, int]
) -> float:
    """Seconds to bring a value placed ``have`` to ``need`` (FORBIDDEN_S where it cannot be).

    ``ids``: the two placements' numbers in ``ctx.memo.placement_ids``, the memo's key for them.

    ``bucketed``: a gradient's synchronisation, sent in buckets with the other gradients, costs its share
    of a full bucket's collective, ``t(bucket) · bytes / bucket``, or, larger than a bucket (the
    runtime's, :func:`autopar.cost_models.overlap.bucket_bytes`), a collective of its own
    (:func:`autopar.cost_models.comm.share_of_bucket`): linear in its bytes, as the objective needs,
    and summing to the estimate's bucketed time (:func:`autopar.cost_models.comm.bucketed_time`)
    to within one bucket's latency.
    """
    if have is None or need is None:
        return 0.0
    key = (*ids, nbytes, zero, bucketed)
    t = ctx.memo.moves.get(key)
    if t is None:
        steps = grad_sync_steps(have, need, zero, nbytes, ctx.mesh_shape, ctx.dp_dim)
        t = INF if steps is None else _steps_time(steps, ctx.mesh_shape, ctx.links, bucketed)
        t = ctx.memo.moves[key] = FORBIDDEN_S if t == INF else t
    return FORBIDDEN_S if pinned and t > 0 else t


def _steps_time(
    steps: list[tuple[str, int, float]], mesh_shape: tuple[int, ...], links: list[Link], bucketed: bool = False
) -> float:
    if bucketed:
        return sum(
            share_of_bucket(kind, b, mesh_shape[d], links[d], overlap.bucket_bytes(mesh_shape[d]))
            for kind, d, b in steps
        )
    return sum(collective_time(kind, b, mesh_shape[d], links[d]) for kind, d, b in steps)
