"""Build the sharding MILP instance from a joint graph, its strategies and the cost models.

The formulation
---------------
Take a mesh of shape (n_1, ..., n_k) with links L_1..L_k, a data-parallel mesh
dim d (D = n_d ranks; none when d is None), k_mb micro-batches and a memory
limit M per device. Every node v of the joint graph that has strategies S_v
becomes a node of the solver's ``StrategyProblem`` with a choice
x_v ∈ {0, 1}^{S_v}, Σ_s x_v[s] = 1, and the solver
(:func:`autopar.solver.solve_strategies`) finds

    minimise    Σ_v c_v · x_v  +  Σ_{(u, v) ∈ E} x_uᵀ E_uv x_v
    subject to  Σ_{items i live at t} m_i · x_{v(i)}  ≤  M      for every position t of the graph
                x_u = x_v                                       for u, v in one group

where each family of sets, terms and rows is added by one step, run in this
order by :func:`build_problem`:

Strategies S_v (:func:`candidate_strategies`)
    S_v    = v's placements (:mod:`autopar.search.sharding.strategies`); a user input
             keeps those sharded on dim 0 (the batch) over d: that is what makes d
             the data-parallel dim
    S_loss = those of the loss's strategies that return it whole (replicated): the runtime
             returns the loss whole, and a partial loss's reduction would then be a move
             no edge charges
    S_p   ∪= {(s, z) : s ∈ S_p replicated over d, z ∈ {1, 2}}     ZeRO-1/2, when D > 1 (:func:`zero_variants`)
    S_v   ∪= {(s, r) : s ∈ S_v}                                    recomputed in the backward, for v
             recomputable and only under a memory limit (:func:`recompute_variants`)
    c_v[s] = ∞ for s that holds at some micro-batch counts K_s alone, unless k_mb ∈ K_s
             (``Strategy.only_at``: a flatten of the sequence split, local once a micro-batch is one
             sequence; its cost is kept in ``ShardingProblem.held`` and restored by ``with_microbatches``)

Node costs c_v and node memory m_v, live over v's interval [t_v, e_v)
    op v (:func:`compute_row`):
        c_v[s] = (1 + r_s) roofline(F_v / W(s), B_v(s))    r_s = 1: the op runs again in the backward
        W(s)   = Π n_j over mesh dims j where any placement of s is not replicated (the work is split)
        B_v(s) = Σ local bytes of v's inputs and outputs under s (0 for a view)
        m_v[s] = Σ local bytes of v's outputs / k_mb        (0 for a view)
    input v (:func:`input_row`):
        c_v[s] = 0,  m_v[s] = local bytes / k_mb
    fixed state v (a buffer or a frozen parameter), live throughout, as its module holds it (:func:`input_row`):
        c_v[s] = 0,  m_v[s] = local bytes
    parameter p with n = n_p(s) local elements, live throughout (:func:`parameter_row`):
        c_p[s, z] = n (b_g + 2 b_o + b_p) / D^[z>0] / β_mem  +  [z>0] all-gather_d(n b_p)
        m_p[s, z] = n (b_p + (b_o + [z>0] b_copy) / D^[z>0])
    (b_p, b_g, b_o: bytes per element of parameter, gradient and optimizer state;
    b_copy: in fp32, the chunk of the parameter the optimizer steps, which no
    master copy already is; β_mem: the device's memory bandwidth. The gradient
    is a memory item below: it lives from the backward op that makes it.)

Memory items m_i = (node v(i), interval, row over S_v(i)), beyond each node's own
    recomputable v with recompute gap [g_0, g_1) (:func:`recompute_items`):
        v's own interval shrinks to [t_v, g_0);
        m_v[s] (1 - r_s) over [g_0, g_1)                   kept for the backward unless recomputed
        m_v[s]          over [g_1, e_v)                    live again in the backward
        r_s · (local bytes of input a) over [f_a, g_1)     an input freed at f_a < g_1 is kept to recompute v
    output j of a tuple-valued op alive through its getitem after the op ends at e_v
    (a saved mean, a mask) (:func:`tuple_output_items`):
        local bytes of output j under s over [e_v, e_j)
    gradient of p (:func:`gradient_items`; :mod:`autopar.search.sharding.step_memory`):
        n b_g / D^[z=2] from the op that makes it to the end of the step, and with
        k_mb > 1 the sum of the earlier micro-batches' over the whole step

Edges E_uv[a, b] (seconds): the steps of :mod:`autopar.search.sharding.resharding_edges`,
every matrix built by its :func:`resharding_matrix`
    data (:func:`data_edges`), producer u → consumer v:
        E_uv[a, b] = redistribute(u's output under a → the placement v reads it in under b);
        FORBIDDEN_S where u is a parameter, v a view of it and anything moves: a parameter is
        gathered where an op computes with it, not into a view the backward would keep alive
    gradient synchronisation (:func:`grad_sync_edges`), grad of p → p:
        E[a, (b, z)] = bring the gradient to p's placement b; a partial sum over d is
        all-reduced, or reduce-scattered over d for z > 0 or p sharded over d; each collective
        costs its bytes' share of a full bucket's, t(BUCKET) · bytes / BUCKET, since gradients
        are sent in buckets, or t(bytes) for a gradient larger than a bucket, which is sent whole
        (the estimate costs the buckets themselves: autopar.search.sharding.answer)
    buffer update (:func:`buffer_update_edges`), new value of an in-place updated buffer → the buffer:
        E[a, b] = redistribute(new value under a → the buffer's placement under b)

Groups (:func:`repeated_layer_groups`, applied by the mesh search, not by
:func:`build_problem`: re-costing one given answer needs no ties)
    the nodes of repeated layers whose strategy lists are the same take the same
    strategy, and so do an op replayed in the backward and its original.

ZeRO. A parameter sharded over d is ZeRO-3 by its placement: its parameter,
gradient and optimizer state are all 1/D, and every use pays an all-gather on
its data edges. ZeRO-1 and 2 (the variants z above) cost the same 2Ψ of
traffic as plain data parallelism (a reduce-scatter, once per step for ZeRO-1
and once per micro-batch for ZeRO-2 as the runtime does, then the all-gather
of the stepped chunks), part of it after the backward instead of under it,
for 1/D of the optimizer state (and gradients).

Gradient accumulation over k_mb micro-batches runs the graph k_mb times on
1/k_mb of the batch: compute and activation traffic add up to the same,
gradient synchronisation happens once, and 1/k_mb of the activations are
live at a time; so k_mb divides the activation memory terms and leaves the
rest (:func:`autopar.search.sharding.derived.with_microbatches` derives one count's problem from another's).

The solver core sees numbers only; :class:`ShardingProblem` keeps the map back
to node names and placements.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch.fx as fx

from autopar.cost_models import experts as experts_cost
from autopar.cost_models.attention import CAUSAL_WORK, causal_imbalance
from autopar.cost_models.comm import collective_time
from autopar.cost_models.compute import roofline_time
from autopar.ops import experts as experts_op
from autopar.search.sharding.build_context import BuildContext, NodeRow, Terms, make_context
from autopar.search.sharding.coarsen import repeated_groups
from autopar.search.sharding.context_parallel import QUERY_AT, query_axes
from autopar.search.sharding.instance import ShardingProblem
from autopar.search.sharding.node_strategies import NodeStrategies, Strategy
from autopar.search.sharding.recompute import recomputed
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.resharding_edges import buffer_update_edges, data_edges, grad_sync_edges
from autopar.search.sharding.step_memory import accumulated, parameter_items
from autopar.solver import StrategyProblem


def build_problem(
    request: MeshRequest,
    strategies: dict[str, NodeStrategies],
    dp_dim: int | None = 0,
    microbatches: int = 1,
) -> ShardingProblem:
    """The MILP instance for ``request``'s mesh: the steps of the module docstring's formulation, in order.

    ``request.recompute``: with a memory limit, each recomputable activation also gets
    its strategies again, recomputed in the backward.
    """
    ctx = make_context(request, strategies, dp_dim, microbatches)
    terms = Terms()
    for step in (
        node_terms,
        activation_items,
        gradient_items,
        data_edges,
        grad_sync_edges,
        buffer_update_edges,
    ):
        step(ctx, terms)
    return _assemble(ctx, terms, request.memory_limit)


def node_terms(ctx: BuildContext, t: Terms) -> None:
    """Every node with strategies becomes a problem node: S_v, c_v, m_v and its live interval."""
    facts = ctx.facts
    for node in ctx.captured.gm.graph.nodes:
        ns = ctx.strategies.get(node.name)
        if ns is None or not ns.strategies:
            continue
        name = node.name
        kind = "param" if name in ctx.params else "state" if name in ctx.state else "placeholder"
        kind = kind if node.op == "placeholder" else "op"
        gap = facts.recompute_gap.get(name) if ctx.recompute else None
        options = candidate_strategies(ctx, name, ns, gap is not None)
        ids = tuple(map(id, options))
        t.list_ids.append(ctx.memo.list_numbers.setdefault(ids, len(ctx.memo.list_numbers)))
        interval = (0, facts.n_nodes) if kind in ("param", "state") else facts.interval[name]
        if gap is not None:
            interval = (interval[0], gap[0])  # after the forward, the recompute items take over
        if name in facts.backward:
            t.backward.append(len(t.names))
        if kind == "param":
            t.params.append(len(t.names))
        elif kind == "state":
            t.state.append(len(t.names))
        t.rows.append(node_row(ctx, name, kind, ns, options, ids))
        t.kinds.append(kind)
        t.gaps.append(gap)
        t.flops.append(facts.flops[name])
        t.names.append(name)
        t.strats.append(options)
        t.intervals.append(interval)
    t.index = {n: i for i, n in enumerate(t.names)}


def candidate_strategies(ctx: BuildContext, name: str, ns: NodeStrategies, recomputable: bool) -> list[Strategy]:
    """S_v: a node's strategies, a user input's as a data loader hands it out, with the ZeRO and recompute
    variants.

    A data loader gives each dp rank its part of the batch (the input split on dim 0 over dp) or, where the
    dp axis's ranks split the sequence instead (context parallelism over them, Megatron-LM's loader), its
    part of every sequence (dim 1 over dp): the only layout left once a micro-batch is smaller than dp.
    """
    options = list(ns.strategies)
    if name == ctx.captured.loss:  # returned whole on every rank: its reduction is an edge the objective sees
        whole = [s for s in options if s.outputs[0] is not None and all(p.is_replicate() for p in s.outputs[0])]
        options = whole or options
    if name in ctx.inputs and ctx.dp_dim is not None:
        loaded = [s for s in options if s.outputs[0] is not None and _loaded(s.outputs[0][ctx.dp_dim])]
        options = loaded or options
    if name in ctx.params:
        options = zero_variants(ctx, options)
    if recomputable:
        options = recompute_variants(ctx, options)
    return options


def _loaded(p) -> bool:
    """Whether a data loader hands an input out in placement ``p`` over dp: split on the batch or the sequence
    (in natural order: a loader does not reorder a sequence into head-tail chunks)."""
    return (p.is_shard(0) or p.is_shard(1)) and not p.is_balanced()


def zero_variants(ctx: BuildContext, options: list[Strategy]) -> list[Strategy]:
    """A dp-replicated parameter's strategies, then each again under ZeRO-1 and ZeRO-2."""
    if ctx.dp_n == 1:
        return options
    out = list(options)
    for z in (1, 2):
        for s in options:
            if s.outputs[0] is not None and s.outputs[0][ctx.dp_dim].is_replicate():
                v = ctx.memo.variants.get((id(s), z))
                if v is None:
                    v = ctx.memo.variants[(id(s), z)] = replace(s, zero=z)
                out.append(v)
    return out


def recompute_variants(ctx: BuildContext, options: list[Strategy]) -> list[Strategy]:
    """A recomputable activation's strategies, then each again recomputed in the backward."""
    out = list(options)
    for s in options:
        v = ctx.memo.variants.get((id(s), -1))
        if v is None:
            v = ctx.memo.variants[(id(s), -1)] = replace(s, recompute=True)
        out.append(v)
    return out


def node_row(
    ctx: BuildContext, name: str, kind: str, ns: NodeStrategies, options: list[Strategy], ids: tuple[int, ...]
) -> NodeRow:
    """The node's row of terms, built once for all the nodes with the same strategies and sizes."""
    facts = ctx.facts
    out_bytes = facts.out_bytes[name]
    in_bytes = [facts.whole_bytes.get(inp) for inp in ns.inputs] if kind == "op" else []
    attention = facts.attention.get(name, 0.0)
    routed = ns.op if ns.op in experts_op.EXPERT_OP_NAMES else None
    causal_q = QUERY_AT.get(ns.op) if attention == CAUSAL_WORK else None
    key = (
        kind, ids, tuple(out_bytes), tuple(in_bytes), facts.flops[name], attention, facts.view[name],
        facts.element_size.get(name), routed, causal_q,
    )
    row = ctx.memo.rows.get(key)
    if row is None:
        if kind == "param":
            row = parameter_row(ctx, options, out_bytes, max(facts.element_size[name], 1))
        elif kind in ("placeholder", "state"):
            row = input_row(ctx, options, out_bytes, per_microbatch=kind == "placeholder")
        else:
            row = compute_row(ctx, options, out_bytes, in_bytes, facts.flops[name], facts.view[name], attention)
            if routed is not None:
                expert_parallel_terms(ctx, row, options, in_bytes, routed, *_routing(ctx, ns))
            if causal_q is not None:
                causal_shard_terms(ctx, row, options, causal_q)
        ctx.memo.rows[key] = row
    return row


def parameter_row(ctx: BuildContext, options: list[Strategy], out_bytes: list[float], elem: int) -> NodeRow:
    """c_p and m_p: the optimizer update of the local shard (and ZeRO's all-gather), parameter and state."""
    b_param, b_grad = ctx.precision.param_bytes, ctx.precision.grad_bytes
    row = NodeRow([], [])
    for s in options:
        numel = sum(ctx.local(out_bytes, s.outputs)) / elem
        opt_div = ctx.dp_n if s.zero else 1
        grad_div = ctx.dp_n if s.zero == 2 else 1
        ag = (
            collective_time("all_gather", numel * b_param, ctx.dp_n, ctx.links[ctx.dp_dim]) if s.zero else 0.0
        )
        row.costs.append(numel * ctx.opt_traffic / opt_div / ctx.mem_bw + ag)
        opt = ctx.b_opt + (ctx.b_copy if s.zero else 0)
        row.parts.append((numel * b_param, numel * b_grad / grad_div, numel * opt / opt_div))
        row.memory.append(row.parts[-1][0] + row.parts[-1][2])  # the gradient is an item: it lives from the backward
        row.gather.append(ag)
    return row


def input_row(ctx: BuildContext, options: list[Strategy], out_bytes: list[float], per_microbatch: bool) -> NodeRow:
    """c_v = 0 and m_v: a user input's local bytes, one micro-batch of them; a buffer's or a frozen
    parameter's, all of them (every micro-batch reads the same)."""
    row = NodeRow([], [])
    for s in options:
        row.costs.append(0.0)
        row.memory.append(sum(ctx.local(out_bytes, s.outputs)) / (ctx.microbatches if per_microbatch else 1))
    return row


def compute_row(
    ctx: BuildContext,
    options: list[Strategy],
    out_bytes: list[float],
    in_bytes: list,
    node_flops: float,
    view: bool,
    attention: float = 0.0,
) -> NodeRow:
    """c_v: the roofline time of an op's local work (twice when recomputed); m_v: its local outputs.

    ``attention``: a fused attention kernel's share of its FLOPs it runs (0 for other ops).
    """
    scale, k = ctx.scale, ctx.microbatches
    row = NodeRow([], [])
    for s in options:
        out_local = ctx.local(out_bytes, s.outputs)
        ins = ctx.local(in_bytes, s.inputs)
        flops = node_flops / ctx.split(s)
        nbytes = 0.0 if view else (sum(ins) + sum(out_local))
        t = roofline_time(flops, nbytes, ctx.device, ctx.precision.compute_dtype, ctx.efficiency, scale, attention)
        row.costs.append(2 * t if s.recompute else t)  # a recomputed op runs again in the backward
        row.in_parts.append([b * scale / k for b in ins])
        # with k micro-batches a step runs the graph k times on 1/k of the batch: the same
        # total compute and traffic, 1/k of the activations live at once
        row.memory.append(0.0 if view else sum(out_local) * scale / k)
        row.parts.append([0.0 if view else b * scale / k for b in out_local])
    return row


def _routing(ctx: BuildContext, ns: NodeStrategies) -> tuple[int, tuple[int, int]]:
    """k of an experts op, and (tokens, experts): its top-k index input is (tokens, k), its experts' weights
    (experts, ., .)."""
    first = 1 if ns.op == experts_op.BACKWARD_NAME else 0
    index, weights = ns.inputs[first + 1], ns.inputs[first + 3]
    shape = {n.name: n.meta["val"].shape for n in ctx.captured.gm.graph.nodes if n.name in (index, weights)}
    return int(shape[index][-1]), (int(shape[index][0]), int(shape[weights][0]))


def expert_parallel_terms(
    ctx: BuildContext, row: NodeRow, options: list[Strategy], in_bytes: list, op: str, k: int, shapes: tuple[int, int]
) -> None:
    """An experts op's strategies that split the experts pay their all-to-alls, and the busiest rank's share
    of the expert FLOPs (:mod:`autopar.cost_models.experts`: uniform dropless routing, its expected busiest
    rank at the tokens a rank holds, or the ``capacity_factor`` the user gave).

    The tokens are a rank's for the step: with m micro-batches each exchange holds 1/m of them and its
    busiest rank's excess is sqrt(m) times larger, which the rows, built once for every count, leave out."""
    backward = op == experts_op.BACKWARD_NAME
    first = 1 if backward else 0
    for i, s in enumerate(options):
        axes = experts_op.ep_axes(s.inputs, backward) or []
        if not axes:
            continue
        a = axes[0]
        factor = ctx.capacity_factor
        if factor is None:
            tokens, experts = shapes[0] / ctx.pieces(s.inputs[first + 1]), shapes[1]
            factor = experts_cost.busiest_rank_share(tokens, k, experts, ctx.mesh_shape[a])
        pairs = ctx.local([in_bytes[first]], [s.inputs[first]])[0] * ctx.scale * k
        extra = experts_cost.all_to_all_seconds(pairs, ctx.mesh_shape[a], ctx.links[a], backward, factor)
        row.costs[i] = row.costs[i] * factor + extra


def causal_shard_terms(ctx: BuildContext, row: NodeRow, options: list[Strategy], q_at: int) -> None:
    """A causal attention kernel whose queries are split on the sequence (context parallelism) takes as long
    as its busiest shard: the last of contiguous shards, any in head-tail order
    (:func:`autopar.cost_models.attention.causal_imbalance`)."""
    for i, s in enumerate(options):
        axes = query_axes(s.inputs, q_at)
        q = s.inputs[q_at]
        pieces = math.prod(ctx.mesh_shape[a] for a in axes if not q[a].is_balanced())
        balanced = math.prod(ctx.mesh_shape[a] for a in axes if q[a].is_balanced())
        row.costs[i] *= causal_imbalance(pieces, balanced)


def activation_items(ctx: BuildContext, t: Terms) -> None:
    """The memory items of activations beyond their node's own interval, node by node."""
    for i in range(len(t.names)):
        if t.gaps[i] is not None:
            recompute_items(ctx, t, i)
        if t.kinds[i] == "op":
            tuple_output_items(ctx, t, i)


def recompute_items(ctx: BuildContext, t: Terms, i: int) -> None:
    """A recomputable activation: kept over its gap unless recomputed, live again in the backward."""
    name, gap, row, options = t.names[i], t.gaps[i], t.rows[i], t.strats[i]
    assert gap is not None
    end = ctx.facts.interval[name][1]
    kept = [0.0 if s.recompute else m for s, m in zip(options, row.memory, strict=True)]
    t.items.append((i, gap, kept))
    if end > gap[1]:
        t.items.append((i, (gap[1], end), list(row.memory)))
    late = ctx.facts.late_inputs[name]
    for k, inp in enumerate(ctx.strategies[name].inputs):
        if inp in late:  # an input that would be freed earlier is kept for the recomputation
            kept_input = [
                x[k] if s.recompute and k < len(x) else 0.0 for s, x in zip(options, row.in_parts, strict=True)
            ]
            t.items.append((i, (late[inp], gap[1]), kept_input))


def tuple_output_items(ctx: BuildContext, t: Terms, i: int) -> None:
    """Outputs of a tuple-valued op alive after the op through their getitem (a saved mean, a mask)."""
    end = t.intervals[i][1]
    for k, stop in ctx.facts.tuple_tails.get(t.names[i], []):
        t.items.append((i, (end, stop), [part[k] if k < len(part) else 0.0 for part in t.rows[i].parts]))


def gradient_items(ctx: BuildContext, t: Terms) -> None:
    """Each parameter's gradient, from the op that makes it; with micro-batches, their running sum too."""
    facts = ctx.facts
    state_parts = {i: t.rows[i].parts for i in t.params}
    grads = parameter_items(ctx.captured, facts.by_name, facts.order, facts.n_nodes, t.index, state_parts)
    t.grad_items = list(range(len(t.items), len(t.items) + len(grads)))
    t.items += grads
    if ctx.microbatches > 1:
        t.grad_items = accumulated(t.items, t.grad_items)


def _assemble(ctx: BuildContext, t: Terms, memory_limit: float | None) -> ShardingProblem:
    """The solver's problem and the map back onto the graph, from the steps' terms."""
    costs = [r.costs for r in t.rows]
    held = {
        (i, j): (costs[i][j], s.only_at) for i, options in enumerate(t.strats) for j, s in enumerate(options) if s.only_at
    }
    for i, j in held:  # rows are shared by the nodes of a memoized row: copy before forbidding
        if ctx.microbatches not in held[(i, j)][1]:
            costs[i] = [math.inf if k == j else c for k, c in enumerate(costs[i])]
    problem = StrategyProblem(
        node_costs=costs,
        node_memory=[r.memory for r in t.rows],
        node_intervals=t.intervals,
        edges=t.edges,
        edge_costs=t.edge_costs,
        memory_limit=memory_limit,
        node_names=t.names,
        memory_items=t.items or None,
    )
    by_name = ctx.facts.by_name
    return ShardingProblem(
        problem,
        t.names,
        t.strats,
        t.edge_info,
        t.grad_edges,
        t.backward,
        t.params,
        t.flops,
        {i: t.rows[i].parts for i in t.params},
        {i: t.rows[i].gather for i in t.params},
        ctx.dp_dim,
        grad_items=t.grad_items,
        facts=ctx.facts,
        microbatches=ctx.microbatches,
        replayed=[i for i, name in enumerate(t.names) if "autopar_recompute_of" in by_name[name].meta],
        list_ids=t.list_ids,
        state_nodes=t.state,
        held=held,
        reopened=tuple(ij for ij, (_, counts) in held.items() if ctx.microbatches in counts),
    )


def repeated_layer_groups(gm: fx.GraphModule, sp: ShardingProblem) -> list[list[int]] | None:
    """The groups x_u = x_v: repeated layers' nodes with the same strategies, replayed ops with their originals."""
    index = {name: i for i, name in enumerate(sp.nodes)}
    options = {name: sp.strategies[i] for name, i in index.items()}
    groups = repeated_groups(gm, set(index), lambda a, b, o=options: o[a] == o[b])
    # a replayed op runs as its original is placed (the runtime copies the original's entry): one choice
    groups += [
        [clone, source]
        for clone, source in recomputed(gm).items()
        if clone in index and source in index and options[clone] == options[source]
    ]
    return [[index[n] for n in g] for g in groups] or None
