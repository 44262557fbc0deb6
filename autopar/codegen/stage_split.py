"""Split one rank's local joint graph into the forward and backward graph of each pipeline stage.

The shard pass (:func:`autopar.codegen.shard.shard_graph` with ``keep_sources``)
gives every rank the local joint graph of the *whole* model on its stage's
data × tensor-parallel sub-mesh, each node tagged with the captured node it
came from; :func:`autopar.search.pipeline.stages.stage_of_nodes` says which stage runs
each captured node.  This pass cuts the local graph into, per stage ``s``,

    F_s(params, state, inputs, received)      -> (sent forward, saved, updates, [loss])
    B_s(params, state, inputs, saved, grads)  -> (sent backward, parameter gradients)

that a pipeline schedule runs once per micro-batch each, in any interleaving.
What crosses between graphs, by the value's producer (stage, phase) and its
readers:

* **forward channel s → s+1**: every value a forward node of stage ≤ s
  produced that a node (forward or backward) of a stage > s reads.  A value
  skipping stages is relayed through the ones between (torch's pipelining
  runtimes connect adjacent stages only).
* **saved, F_s → B_s**: values F_s has (made or received) that B_s reads, and
  values F_s made that the backward of an earlier stage reads (B_s sends them
  on).
* **backward channel s → s−1**: every value made in a stage ≥ s (by either
  phase) that the backward of a stage < s reads: the gradients of the forward
  channel's activations, and relays.

Placeholders (parameters, fixed state, micro-batch inputs) are handed to each
graph that reads them, and nodes computed from placeholders alone (the views
the trace puts on its arguments) are recomputed in each graph that reads them:
they are free.  A node the shard pass traced outside any captured node (the
gradient reductions and conversions at the end of the trace, the loss made
whole) belongs to the stage and phase of what it reads.

Buffers the forward updates in place (``CapturedGraph.updated``): the new value
of each is a result of the forward of the stage that computes it (of the first
stage that reads the buffer, when it is computed from placeholders alone), for
the runtime to store after each micro-batch's forward, so the next micro-batch
reads it as one device would.  A backward that reads such a buffer gets the
value its own micro-batch's forward read, handed over with the saved values,
since later forwards may have updated the buffer by the time it runs.  A buffer
updated by one stage and read by the forward of another is refused: the order
in which the two stages see the micro-batches depends on the schedule.

Each graph's collectives are then scheduled on their own
(:func:`autopar.codegen.collective_order.schedule_collectives`): a collective and its wait
always land in the same graph, since the trace puts every collective right
before its first reader.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.capture.joint import graph_results
from autopar.codegen.collective_order import schedule_collectives
from autopar.codegen.shard import source_of
from autopar.core.errors import PlanError

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class ValueSpec:
    """A tensor that one graph hands to another: its local shape and dtype on this rank."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class StageGraphs:
    """One stage's forward and backward graph, and how their arguments and results line up."""

    stage: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    # argument slots of the local joint graph (its placeholder positions) each graph reads, in order
    forward_args: list[int]
    backward_args: list[int]
    recv_forward: list[ValueSpec]  # forward's last arguments
    send_forward: list[ValueSpec]  # forward's first results
    saved: list[ValueSpec]  # forward's results after those; backward's arguments after its slots
    recv_backward: list[ValueSpec]  # backward's last arguments
    send_backward: list[ValueSpec]  # backward's first results
    grads: list[int] = field(default_factory=list)  # parameter index of each of backward's other results
    has_loss: bool = False  # forward's last result is the loss
    updates: list[int] = field(default_factory=list)  # argument slot of the buffer each update is for


def _spec(node: fx.Node) -> ValueSpec:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"{node.name} crosses a pipeline stage but is not a tensor ({type(val).__name__})")
    return ValueSpec(node.name, tuple(val.shape), val.dtype)


def place_nodes(
    gm: fx.GraphModule, stage_of: dict[str, int], phase_of: dict[str, str]
) -> dict[fx.Node, tuple[str, int] | None]:
    """(phase, stage) of every computing node of the local graph; None for placeholder-only nodes.

    ``stage_of`` and ``phase_of`` are keyed by captured node names (the sources).
    """
    where: dict[fx.Node, tuple[str, int] | None] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        src = source_of(n)
        if src in stage_of:
            where[n] = (phase_of[src], stage_of[src])
            continue
        ins = [where[a] for a in n.all_input_nodes if a.op != "placeholder"]
        ins = [x for x in ins if x is not None]
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in where:
            where[n] = where[n.args[0]]
        elif not ins:
            where[n] = None  # computed from placeholders only
        elif any(p == BACKWARD for p, _ in ins):
            where[n] = (BACKWARD, min(s for p, s in ins if p == BACKWARD))
        else:
            where[n] = (FORWARD, max(s for _, s in ins))
    return where


@dataclass
class _Flow:
    """Where every value of the local graph is made and read, and the channels between stages."""

    gm: fx.GraphModule
    where: dict[fx.Node, tuple[str, int] | None]
    readers: dict[fx.Node, list[tuple[str, int]]]  # (phase, stage) of every node reading each value
    order: dict[fx.Node, int]
    slot: dict[fx.Node, int]  # placeholder -> argument position
    forward_channel: list[list[fx.Node]]  # [s]: sent from stage s to s + 1
    backward_channel: list[list[fx.Node]]  # [s]: sent from stage s to s - 1
    loss: fx.Node
    loss_stage: int
    grads: list  # the local graph's gradient results, by parameter
    grad_stage: dict[int, int]  # parameter index -> stage whose backward makes its gradient
    updates: dict[int, list[tuple[int, fx.Node]]]  # stage -> (buffer's argument slot, new value) its forward makes
    mutated: dict[fx.Node, list[tuple[str, int]]]  # placeholder of each updated buffer -> who reads it


def split_stages(
    gm: fx.GraphModule,
    stage_of: dict[str, int],
    phase_of: dict[str, str],
    stages: int,
    mine: list[int],
    params: int,
    updated: list[int] = (),
) -> list[StageGraphs]:
    """The forward and backward graphs of stages ``mine`` (see the module docstring).

    ``params``: the local graph's parameter count (its first results after the loss are
    their gradients); ``updated``: ``CapturedGraph.updated``, the buffer of each update after them.
    """
    where = place_nodes(gm, stage_of, phase_of)
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    loss, grads, new_values = graph_results(gm, params)
    phs = [n for n in nodes if n.op == "placeholder"]

    def reading(n: fx.Node) -> list[tuple[str, int]]:
        """(phase, stage) of every node that reads ``n``, through placeholder-only nodes."""
        out = []
        for u in n.users:
            if u is output:
                continue
            w = where.get(u)
            out.extend(reading(u) if w is None else [w])
        return out

    readers = {n: reading(n) for n in nodes if where.get(n) is not None}
    mutated = {phs[params + b]: reading(phs[params + b]) for b in updated}
    updates: dict[int, list[tuple[int, fx.Node]]] = {}
    for b, value in zip(updated, new_values, strict=True):
        ph = phs[params + b]
        if value is ph:
            continue
        forward_stages = sorted({st for p, st in mutated[ph] if p == FORWARD})
        made = where.get(value)
        stage = made[1] if made is not None else (forward_stages[0] if forward_stages else 0)
        if any(st != stage for st in forward_stages):
            raise PlanError(
                f"buffer {ph.name} is updated by pipeline stage {stage} and read by the forward of stage "
                f"{next(st for st in forward_stages if st != stage)}: cut the pipeline elsewhere"
            )
        updates.setdefault(stage, []).append((params + b, value))
    forward_channel: list[list[fx.Node]] = [[] for _ in range(stages)]
    backward_channel: list[list[fx.Node]] = [[] for _ in range(stages)]
    for n, rs in readers.items():
        phase, s = where[n]
        if phase == FORWARD:
            for c in range(s, max((r for _, r in rs), default=s)):
                forward_channel[c].append(n)
        for c in range(s, min((r for p, r in rs if p == BACKWARD), default=s), -1):
            backward_channel[c].append(n)
    flow = _Flow(
        gm=gm,
        where=where,
        readers=readers,
        order={n: i for i, n in enumerate(nodes)},
        slot={n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")},
        forward_channel=forward_channel,
        backward_channel=backward_channel,
        loss=loss,
        loss_stage=where[loss][1] if where.get(loss) else stages - 1,
        grads=grads,
        grad_stage={
            i: where[g][1] for i, g in enumerate(grads) if isinstance(g, fx.Node) and where.get(g) is not None
        },
        updates=updates,
        mutated=mutated,
    )
    return [_build(flow, s, stages) for s in mine]


def _build(flow: _Flow, s: int, stages: int) -> StageGraphs:
    received = flow.forward_channel[s - 1] if s > 0 else []
    sent = flow.forward_channel[s] if s < stages - 1 else []
    received_back = flow.backward_channel[s + 1] if s < stages - 1 else []
    sent_back = flow.backward_channel[s] if s > 0 else []
    f_nodes = [n for n, w in flow.where.items() if w == (FORWARD, s)]
    b_nodes = [n for n, w in flow.where.items() if w == (BACKWARD, s)]
    have_f = set(f_nodes) | set(received)
    saved = [
        n
        for n in sorted(have_f, key=flow.order.get)
        if any(r == (BACKWARD, s) for r in flow.readers.get(n, ()))
        or (n in f_nodes and any(p == BACKWARD and r < s for p, r in flow.readers.get(n, ())))
    ]
    # an updated buffer the backward reads: the value this micro-batch's forward read, saved with the rest
    saved += [ph for ph, rs in flow.mutated.items() if (BACKWARD, s) in rs]
    last = s == flow.loss_stage
    if last and flow.loss not in have_f:
        raise ValueError(f"the loss {flow.loss.name} is not computed by the last stage's forward")
    updates = flow.updates.get(s, [])
    results = [*sent, *saved, *(v for _, v in updates), *([flow.loss] if last else [])]
    forward, f_args = _subgraph(flow, f_nodes, received, results)
    mine = sorted(i for i, st in flow.grad_stage.items() if st == s)
    backward, b_args = _subgraph(
        flow, b_nodes, saved + list(received_back), [*sent_back, *(flow.grads[i] for i in mine)]
    )
    for g in (forward, backward):
        schedule_collectives(g.graph)
        g.recompile()
    return StageGraphs(
        stage=s,
        forward=forward,
        backward=backward,
        forward_args=f_args,
        backward_args=b_args,
        recv_forward=[_spec(n) for n in received],
        send_forward=[_spec(n) for n in sent],
        saved=[_spec(n) for n in saved],
        recv_backward=[_spec(n) for n in received_back],
        send_backward=[_spec(n) for n in sent_back],
        grads=mine,
        has_loss=last,
        updates=[slot for slot, _ in updates],
    )


def _subgraph(flow: _Flow, body, given, results) -> tuple[fx.GraphModule, list[int]]:
    """A graph computing ``results`` from the placeholders it reads, then ``given`` values, with ``body``'s nodes.

    Returns it and the local graph's placeholder slots it takes first, in order.
    """
    gm, where, slot = flow.gm, flow.where, flow.slot
    body_set = set(body)
    given_set = set(given)
    needed: set[fx.Node] = set()
    slots: set[fx.Node] = set()
    extra = [r for r in results if r not in body_set and r not in given_set]
    for r in extra:
        if r.op != "placeholder" and where.get(r) is not None:
            raise ValueError(f"{r.name} is a result of a graph that neither computes nor receives it")
        if r.op == "placeholder":
            slots.add(r)
        else:
            needed.add(r)
    todo = [*body, *extra]
    seen = set()
    while todo:  # placeholders and placeholder-only nodes the body reads
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for a in n.all_input_nodes:
            if a in given_set or a in body_set:
                continue
            if a.op == "placeholder":
                slots.add(a)
            elif where.get(a) is None:
                needed.add(a)
                todo.append(a)
            else:
                raise ValueError(f"{n.name} reads {a.name} from another graph without it being handed over")
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ordered_slots = sorted(slots, key=slot.get)
    for a in ordered_slots:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for a in given:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    keep = body_set | needed
    for n in gm.graph.nodes:
        if n in keep and n not in env:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[r] for r in results))
    g.eliminate_dead_code()
    return fx.GraphModule(gm, g), [slot[a] for a in ordered_slots]
