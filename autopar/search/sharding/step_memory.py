"""What a training step holds beyond the graph's values, and the peak memory of a chosen answer.

The sharding problem (:mod:`autopar.search.sharding.problem`) costs each node's
output over its live interval, and each parameter's value and optimizer state
over the whole step.  The runtime (:mod:`autopar.runtime`) holds more:

* **gradients** — a parameter's gradient exists from the backward op that
  makes it to the optimizer step, at the size its placement and ZeRO stage
  leave on the rank (whole, its dp shard, or its flat chunk).  With several
  micro-batches the sum of the earlier ones is live over the whole step too
  (:func:`accumulated`), unless the runtime adds each micro-batch's gradient
  into one buffer as it is made (Megatron-Core's ``main_grad``:
  :data:`autopar.cost_models.overlap.Runtime.grads_accumulate_in_place`), whose
  gradients are then held once, over the whole step.  These are memory items of the parameters'
  strategies (:func:`parameter_items`), so that the MILP's limit sees them;
* **a gradient being reduced** — the backward's gradient stays alive until
  its reduction has completed, and the runtime keeps one reduction in flight
  (:func:`autopar.codegen.collective_order.schedule_collectives`): until the next
  gradient is made.  ZeRO-1 reduces once, after the step's last micro-batch:
  each chunk then exists beside its whole gradient (:func:`gradient_buffers`);
* **redistributed values** — every data edge whose two ends' placements
  differ makes a new tensor on the reader's side (the collective's output:
  a parameter gathered for ZeRO-3, an activation gathered or reduced), alive
  from where the runtime issues the collective (once its input exists, and
  not before the previous such value is first read: one prefetched ahead) to
  after its reader, and the readers of that reader's views, which alias it;
  an all-gather along a tensor dim other than 0 holds the gathered tensor
  twice for a moment (gathered on dim 0, then concatenated on its own dim)
  (:func:`edge_buffers`).

The last two depend on the strategies of both ends of an edge, which a
node's memory item cannot express; :func:`step_memory` counts them exactly
for a chosen answer, and where that peak is over the limit the search solves
again, under a lower limit or with the buffers at that peak as memory items
(:func:`peak_items`; :func:`autopar.search.sharding.mesh_solve._fit_exactly`).  The
sharding problem forbids gathering a parameter into a view, which the
backward could keep alive from the forward on: parameters are gathered where
an op computes with them, as FSDP does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch.fx as fx

from autopar.cost_models import overlap
from autopar.cost_models.compute import is_view
from autopar.cost_models.estimate import MemoryEstimate
from autopar.cost_models.reshard import collectives_between, grad_sync_steps, shard_factor
from autopar.search.sharding.instance import ShardingProblem
from autopar.solver import StrategyProblem

if TYPE_CHECKING:
    from autopar.capture.joint import CapturedGraph

Item = tuple[int, tuple[int, int], list[float]]


def in_flight_until(made: list[tuple[int, int]], at: int, end: int) -> int:
    """End of a gradient's reduction made at ``at``: waited for before the next gradient's reduction starts."""
    later = [m for m, _ in made if m > at]
    return min(later, default=end - 1) + 1


def _storage_owner(node: fx.Node) -> fx.Node:
    """The op whose output ``node`` is a view of (itself when it is no view): where its storage is made."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node) and node.args[0].op != "placeholder":
        node = node.args[0]
    return node


def parameter_items(
    captured: CapturedGraph,
    by_name: dict[str, fx.Node],
    order: dict[str, int],
    end: int,
    index: dict[str, int],
    state_parts: dict[int, list[tuple[float, float, float]]],
) -> list[Item]:
    """Each parameter's gradient as a memory item: live from the op that makes it (see the module docstring)."""
    made: list[tuple[int, int]] = []  # (position of the op that makes the gradient, parameter's problem index)
    for p in captured.params:
        i, g = index.get(p.placeholder), captured.grads.get(p.name)
        if i is not None and g in order:
            made.append((order[_storage_owner(by_name[g]).name], i))
    # from the op's output on (the gradient synced, if it is reduced) to the optimizer step
    return [(i, (at + 1, end), [x[1] for x in state_parts[i]]) for at, i in sorted(made)]


def accumulated(items: list[Item], grad_items: list[int]) -> list[int]:
    """Add to ``items`` (several micro-batches) the gradients accumulated over the step; all gradient items.

    autopar's runtime adds each micro-batch's gradients, which the graph returns, into ``.grad``
    (or ZeRO-1's whole gradient, ZeRO-2's chunk) after it ran: the sum of the earlier
    micro-batches is live over the whole step, beside the gradients this micro-batch makes.
    A runtime that adds them into one buffer as the backward makes them
    (:data:`autopar.cost_models.overlap.Runtime.grads_accumulate_in_place`) holds each
    gradient once, over the whole step: its items are stretched, none added.
    """
    if overlap.RUNTIME.grads_accumulate_in_place:
        for k in grad_items:
            v, iv, row = items[k]
            items[k] = (v, (0, iv[1]), row)
        return list(grad_items)
    first = len(items)
    items += [(v, (0, iv[1]), list(row)) for v, iv, row in (items[k] for k in grad_items)]
    return [*grad_items, *range(first, len(items))]


def _readers_end(node: fx.Node, order: dict[str, int]) -> int:
    """One past the last op that reads ``node``'s value, following its views."""
    last = order[node.name] + 1
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or u.op == "output":
                continue
            seen.add(u)
            last = max(last, order[u.name] + 1)
            if is_view(u):
                todo.append(u)
    return last


Buffer = tuple[int, int, float, int]
"""(start, end, bytes, edge): memory one edge of a chosen answer holds over ``[start, end)``."""


def data_buffer(sp: ShardingProblem, e: int, a: int, b: int, mesh_shape: Sequence[int]) -> tuple[float, bool] | None:
    """(bytes, gathered twice) of the tensor data edge ``e`` makes on its reader's side with its ends at strategies
    ``a`` and ``b``; None where it makes none.

    Bytes are local to one rank; values from a batch are divided by the micro-batch count. An all-gather
    along a tensor dim other than 0 holds the gathered tensor twice for a moment (gathered on dim 0, then
    concatenated along its own dim).
    """
    iu, iv = sp.problem.edges[e]
    info = sp.edge_info[e]
    have, need = info.have(sp.strategies[iu][a]), info.need(sp.strategies[iv][b])
    if have is None or need is None or tuple(have) == tuple(need):
        return None
    nbytes = info.moved_bytes(have, need)
    steps = collectives_between(tuple(have), tuple(need), nbytes, mesh_shape)
    makes_partial = any(n.is_partial() and not h.is_partial() for h, n in zip(have, need, strict=True))
    if steps is None or not (steps or makes_partial):
        return None  # a local slice of a replica is a view: no new memory
    # a parameter or buffer (a placeholder) is whole at every micro-batch; the test of the op first keeps this cheap
    whole = sp.facts.by_name[info.src].op == "placeholder" and (iu in sp.param_nodes or iu in sp.state_nodes)
    local = nbytes / shard_factor(tuple(need), mesh_shape) / (1 if whole else sp.microbatches)
    twice = any(kind == "all_gather" and have[d].is_shard() and have[d].dim != 0 for kind, d, _ in steps)
    return local, twice


def edge_buffers(sp: ShardingProblem, choice: list[int], mesh_shape: Sequence[int]) -> list[Buffer]:
    """(start, end, bytes, edge) of the new tensor each data edge of the chosen answer makes on its reader's side
    (:func:`data_buffer`).

    Starts follow the runtime's schedule: a collective is issued once its input exists,
    and not before the previous redistributed value is first read (one ahead).
    """
    facts = sp.facts
    found = []
    for e, (iu, iv) in enumerate(sp.problem.edges):
        info = sp.edge_info[e]
        if info.kind != "data":
            continue
        made = data_buffer(sp, e, choice[iu], choice[iv], mesh_shape)
        if made is None:
            continue
        u, v = info.src, info.dst
        reader = facts.by_name[v]
        ready = 0 if facts.by_name[u].op == "placeholder" else facts.order[u] + 1
        stop = _readers_end(reader, facts.order) if is_view(reader) else facts.order[v] + 1  # a view aliases it
        found.append((facts.order[v], ready, stop, *made, e))
    found.sort()
    out = []
    previous_read = 0
    ghosts, weights = sp.phantoms, sp.edge_weight
    for read, ready, stop, local, twice, e in found:
        start = min(max(ready, previous_read), read)
        out.append((start, stop, local, e))
        if twice:
            out.append((read, read + 1, local, e))
        previous_read = read
        if ghosts is not None and weights is not None and weights[e] > 1:  # a folded middle layer's edge
            span = ghosts.span(start, stop)
            if span is not None:
                out.append((*span, local * ghosts.count, e))
    return out


def gradient_buffer(sp: ShardingProblem, e: int, a: int, b: int, mesh_shape: Sequence[int]) -> tuple[float, bool] | None:
    """(bytes, held at the step's end) of gradient edge ``e``'s buffer with its ends at strategies ``a`` and ``b``;
    None where it holds none (see :func:`gradient_buffers`)."""
    iu, iv = sp.problem.edges[e]
    info, param = sp.edge_info[e], sp.strategies[iv][b]
    have, need = info.have(sp.strategies[iu][a]), param.outputs[0]
    if have is None or need is None:
        return None
    if param.zero == 1:
        dp_n = mesh_shape[sp.dp_dim] if sp.dp_dim is not None else 1
        return sp.state_parts[iv][b][1] / dp_n, True
    nbytes = info.moved_bytes(have, need)
    if grad_sync_steps(tuple(have), tuple(need), param.zero, nbytes, mesh_shape, sp.dp_dim):
        return nbytes / shard_factor(tuple(have), mesh_shape), False
    return None


def gradient_buffers(sp: ShardingProblem, choice: list[int], mesh_shape: Sequence[int]) -> list[Buffer]:
    """(start, end, bytes, edge) of each gradient as the backward made it while its reduction is in flight.

    A gradient made in another placement than its parameter takes (a partial sum over
    dp, a shard to gather, a whole gradient to cut into ZeRO-2 chunks) is reduced in the
    graph, one reduction in flight: the value made lives until the next gradient is made.
    ZeRO-1 reduces after the step's last micro-batch instead: each parameter's chunk
    then exists beside its whole gradient.
    """
    facts = sp.facts
    end = facts.n_nodes
    made = sorted(
        (facts.order[_storage_owner(facts.by_name[sp.edge_info[e].src]).name], e) for e in sp.grad_edges
    )
    out = []
    for at, e in made:
        iu, iv = sp.problem.edges[e]
        held = gradient_buffer(sp, e, choice[iu], choice[iv], mesh_shape)
        if held is not None:
            nbytes, at_end = held
            out.append((end - 1, end, nbytes, e) if at_end else (at + 1, in_flight_until(made, at, end), nbytes, e))
    return out


def peak_items(
    sp: ShardingProblem, problem: StrategyProblem, choice: list[int], mesh_shape: Sequence[int]
) -> list[Item]:
    """Memory items that make the MILP see the buffers live at the chosen answer's peak, whatever the answer.

    A buffer's size depends on the strategies of both ends of its edge, which a node's item cannot
    express; the item goes on one end and charges each of its strategies the most the buffer holds
    under any strategy ``problem`` allows the other end (the end whose charges add up to less), over
    the interval the buffer took in this answer. Conservative where the other end's strategies differ,
    exact for the pairs that hold the most.
    """
    _, at, buffers = _peak(sp, choice, mesh_shape)
    grads = set(sp.grad_edges)
    items: list[Item] = []
    for start, stop, nbytes, e in buffers:
        if not (start <= at < stop and nbytes > 0):
            continue
        iu, iv = sp.problem.edges[e]
        size = gradient_buffer if e in grads else data_buffer
        seen = size(sp, e, choice[iu], choice[iv], mesh_shape)
        assert seen is not None and seen[0] > 0
        allowed_u = [a for a, c in enumerate(problem.node_costs[iu]) if math.isfinite(c)] or [choice[iu]]
        allowed_v = [b for b, c in enumerate(problem.node_costs[iv]) if math.isfinite(c)] or [choice[iv]]
        table = np.zeros((len(sp.strategies[iu]), len(sp.strategies[iv])))
        for a in allowed_u:
            for b in allowed_v:
                held = size(sp, e, a, b, mesh_shape)
                if held is not None and held[1] == seen[1]:  # held over the same interval
                    table[a, b] = held[0]
        table *= nbytes / seen[0]  # a folded layer's span holds the buffer of each layer it stands for
        on_v, on_u = table.max(axis=0), table.max(axis=1)
        node, row = (iv, on_v) if on_v.sum() <= on_u.sum() else (iu, on_u)
        items.append((node, (start, stop), row.tolist()))
    return items


def step_memory(sp: ShardingProblem, choice: list[int], mesh_shape: Sequence[int]) -> MemoryEstimate:
    """Peak bytes per device of the chosen answer over the step, and what is live at the peak.

    Parameters, the fixed state (buffers, frozen parameters: counted in ``params``) and
    optimizer state are live throughout; gradients, activations and buffers
    (redistributed values, gradients in flight, gathered parameters) over their intervals.  ``grads`` is every gradient (what ZeRO-2 and 3 divide);
    ``activations``, ``buffers`` and ``at_peak`` are taken at the peak.
    """
    return _peak(sp, choice, mesh_shape)[0]


def _peak(sp: ShardingProblem, choice: list[int], mesh_shape: Sequence[int]) -> tuple[MemoryEstimate, int, list[Buffer]]:
    """:func:`step_memory`'s answer, the time step of its peak, and the answer's edge buffers."""
    p = sp.problem
    params = set(sp.param_nodes)
    parts = [sp.state_parts[i][choice[i]] for i in sp.param_nodes if i in sp.state_parts]
    fixed = sum(p.node_memory[i][choice[i]] for i in sp.state_nodes)
    states = sum(p.node_memory[i][choice[i]] for i in sp.param_nodes) + fixed
    n = len(p.node_costs)
    kinds = ("grads", "activations", "buffers")
    item_node, intervals, item_memory = p.items()
    memory = np.fromiter((row[choice[v]] for v, row in zip(item_node.tolist(), item_memory, strict=True)), float)
    kind = np.where(np.isin(item_node, list(params)), 2, 1)
    kind[[n + j for j in sp.grad_items]] = 0
    keep = memory != 0
    keep[list(sp.held_nodes)] = False  # a parameter's (a buffer's) own item is its state
    buffers = [*edge_buffers(sp, choice, mesh_shape), *gradient_buffers(sp, choice, mesh_shape)]
    starts = np.concatenate([intervals[keep, 0], np.array([b[0] for b in buffers], dtype=np.int64)])
    stops = np.concatenate([intervals[keep, 1], np.array([b[1] for b in buffers], dtype=np.int64)])
    sizes = np.concatenate([memory[keep], np.array([b[2] for b in buffers], dtype=float)])
    which = np.concatenate([kind[keep], np.full(len(buffers), 2, dtype=np.int64)])
    times = np.unique(np.concatenate([starts, stops]))
    delta = np.zeros((len(times), 3))
    np.add.at(delta, (np.searchsorted(times, starts), which), sizes)
    np.add.at(delta, (np.searchsorted(times, stops), which), -sizes)
    live = np.cumsum(delta, axis=0)
    best, at = [0.0, 0.0, 0.0], -1
    totals = live.sum(axis=1).tolist()
    top = 0.0
    for k, total in enumerate(totals):  # the first time the total rises past the peak so far
        if total > top * (1 + 1e-12) or at < 0:
            top, at = total, int(times[k])
            best = live[k].tolist()
    param_bytes = sum(x[0] for x in parts) + fixed
    optimizer = sum(x[2] for x in parts)
    estimate = MemoryEstimate(
        params=param_bytes,
        grads=sum(x[1] for x in parts),
        optimizer=optimizer,
        activations=best[1],
        buffers=best[2],
        peak=states + max(sum(best), 0.0),
        at_peak={
            "params": param_bytes,
            "optimizer": optimizer,
            **{kind: x for kind, x in zip(kinds, best, strict=True)},
        },
        peak_at=_where(sp, at),
    )
    return estimate, at, buffers


def _where(sp: ShardingProblem, t: int) -> str:
    """The op running at time ``t``: its phase and module (where a reader finds the peak)."""
    facts = sp.facts
    if t < 0 or facts is None:
        return ""
    names = sorted(facts.order, key=facts.order.get)
    if t >= len(names):
        return "after the backward"
    node = facts.by_name[names[t]]
    if node.op == "output":
        return "end of the backward: every gradient made"
    phase = node.meta.get("autopar_phase", "")
    module = node.meta.get("autopar_module", "")
    return f"{phase} {module or '(top level)'} at {node.name}".strip()
