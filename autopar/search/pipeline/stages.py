"""Pipeline stages on the captured joint graph: where cuts may go, and which stage runs each node.

A pipeline cuts the *forward* into contiguous stages; everything else follows.

* **Segments.**  The forward nodes, in graph (execution) order, grouped into
  maximal runs that belong to the same block: a layer of a repeated stack
  (``transformer.h.3``, see :func:`autopar.search.sharding.recompute.layer_of`) or,
  outside any stack, the module that ran them (``transformer.wte``,
  ``lm_head``; the top level for the loss).  A cut goes between two segments,
  never inside one, so a stage is whole layers and modules.
* **Stages.**  A plan names the first forward node of every stage; a forward
  node belongs to the stage its position falls in.  A backward node belongs to
  the stage of the forward op it differentiates (the ``seq_nr`` autograd tags
  it with; a recomputed clone, to the stage of its original); a backward node
  with neither belongs to the lowest stage among the backward nodes it reads
  (the backward runs from the last stage to the first), or, reading none, to
  the highest stage among the forward nodes it reads.  Finally every backward
  node is lowered to at most the stage of each backward node it reads, so that
  backward values only ever travel to earlier stages.
* **Tied parameters.**  A parameter read by several stages (GPT-2's token
  embedding, which is also its output projection) is untied, as Megatron-LM
  does: each further stage gets its own copy (a new placeholder, placed like
  the original) read by that stage's nodes, and the gradient that autograd
  summed over all uses is split into one sum per stage.  At run time the
  copies start equal and their gradients are summed across the stages before
  every optimizer step, so they stay equal.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.capture.joint import CapturedGraph, TensorInfo, graph_results, node_module, node_phase
from autopar.core.errors import PlanError
from autopar.search.sharding.recompute import _copy_graph_module, layer_of

aten = torch.ops.aten


@dataclass(frozen=True)
class GraphSegment:
    """A run of forward nodes a cut cannot split."""

    name: str  # the block: "transformer.h.3", "lm_head", "" (top level)
    nodes: tuple[str, ...]  # forward node names, in graph order

    @property
    def first(self) -> str:
        return self.nodes[0]


def _forward_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op != "placeholder" and node_phase(n) == "forward"]


def _block(node: fx.Node) -> str:
    module = node_module(node)
    return layer_of(module) or module


def forward_segments(captured: CapturedGraph | fx.GraphModule) -> list[GraphSegment]:
    """The forward in graph order as segments (see the module docstring)."""
    gm = captured.gm if isinstance(captured, CapturedGraph) else captured
    segments: list[tuple[str, list[str]]] = []
    for n in _forward_nodes(gm):
        block = _block(n)
        if n.target is operator.getitem or not segments or segments[-1][0] != block:
            if n.target is operator.getitem and segments:  # a tuple's parts stay with the op that made it
                segments[-1][1].append(n.name)
                continue
            segments.append((block, [n.name]))
        else:
            segments[-1][1].append(n.name)
    return [GraphSegment(name, tuple(nodes)) for name, nodes in segments]


def segment_of_nodes(
    captured: CapturedGraph | fx.GraphModule, segments: list[GraphSegment]
) -> dict[str, int]:
    """The segment index of every non-placeholder node (forward by position, backward as stages are)."""
    return _assign(captured.gm if isinstance(captured, CapturedGraph) else captured, segments)


def stage_of_nodes(captured: CapturedGraph | fx.GraphModule, firsts: list[str]) -> dict[str, int]:
    """The stage of every non-placeholder node, for stages starting at forward nodes ``firsts``."""
    gm = captured.gm if isinstance(captured, CapturedGraph) else captured
    forward = _forward_nodes(gm)
    index = {n.name: i for i, n in enumerate(forward)}
    missing = [f for f in firsts if f not in index]
    if missing:
        raise PlanError(
            f"the plan cuts its pipeline at {missing[0]!r}, which is not a forward op of this model's graph: "
            "it was made for another graph; plan again"
        )
    starts = [index[f] for f in firsts]
    if starts[0] != 0 or starts != sorted(set(starts)):
        raise PlanError(
            "the plan's pipeline stages do not start at the first forward op in order; plan again"
        )
    spans = []
    for s, start in enumerate(starts):
        end = starts[s + 1] if s + 1 < len(starts) else len(forward)
        spans.append(GraphSegment(str(s), tuple(n.name for n in forward[start:end])))
    return _assign(gm, spans)


def _assign(gm: fx.GraphModule, spans: list[GraphSegment]) -> dict[str, int]:
    where: dict[str, int] = {name: i for i, span in enumerate(spans) for name in span.nodes}
    forward_by_seq: dict[int, str] = {}
    for n in gm.graph.nodes:
        if n.name in where and "seq_nr" in n.meta:
            forward_by_seq.setdefault(n.meta["seq_nr"], n.name)
    out = dict(where)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or n.name in out:
            continue
        inputs = [a for a in n.all_input_nodes if a.op != "placeholder"]
        back = [out[a.name] for a in inputs if a.name in out and a.name not in where]
        source = n.meta.get("autopar_recompute_of")
        if source is None and n.meta.get("autograd_backward"):
            source = forward_by_seq.get(n.meta.get("seq_nr"))
        if source in where:
            stage = where[source]
        elif back:
            stage = min(back)
        else:
            fwd = [where[a.name] for a in inputs if a.name in where]
            stage = max(fwd) if fwd else len(spans) - 1
        if back:
            stage = min(stage, min(back))
        if (
            n.target is operator.getitem
            and n.args
            and isinstance(n.args[0], fx.Node)
            and n.args[0].name in out
        ):
            stage = out[n.args[0].name]
        out[n.name] = stage
    return out


# ---------------------------------------------------------------------------------------- tied parameters


def _grad_sum_leaves(node: fx.Node, owner: fx.Node) -> list[fx.Node] | None:
    """The addends of the sum autograd formed for a parameter's gradient, or None when it is no such sum."""
    if node.target is not aten.add.Tensor:
        return None
    leaves, todo = [], [node]
    while todo:
        n = todo.pop()
        if n.target is aten.add.Tensor and (n is node or len(n.users) == 1):
            todo.extend(a for a in n.args if isinstance(a, fx.Node))
        else:
            leaves.append(n)
    return leaves


def untie_across_stages(
    captured: CapturedGraph, placements: dict[str, dict], stage_of: dict[str, int]
) -> tuple[CapturedGraph, dict[str, dict], dict[str, int], list[list[tuple[str, int]]]]:
    """Give every further stage that reads a parameter its own copy of it (see the module docstring).

    Returns the new captured graph, placements and stage map with entries for
    the copies, and the ties: per untied parameter, ``(placeholder, stage)`` of
    the original and of each copy.  A parameter
    read by one stage, or whose gradient is not a plain sum over its uses,
    is left alone (its gradient then travels between stages like any value).
    """
    plan = _parameters_to_untie(captured, stage_of)
    if not plan:
        return captured, placements, stage_of, []

    new_gm = _copy_graph_module(captured.gm)
    g = new_gm.graph
    nodes = {n.name: n for n in g.nodes}
    out_node = next(n for n in reversed(g.nodes) if n.op == "output")
    loss, grads, updates = graph_results(g, len(captured.params))
    placements = dict(placements)
    stage_of = dict(stage_of)
    params = list(captured.params)
    ties: list[list[tuple[str, int]]] = []
    last_ph = [n for n in g.nodes if n.op == "placeholder"][len(captured.params) - 1]
    for i, info, users_by_stage, by_stage in plan:
        ph = nodes[info.placeholder]
        stages = sorted(users_by_stage)
        tie = [(info.placeholder, stages[0])]
        ties.append(tie)
        for k, s in enumerate(stages):
            addends = [nodes[leaf.name] for leaf in by_stage[s]]
            total = _stage_gradient(g, out_node, addends, s, stage_of, placements)
            if k == 0:
                grads[i] = total
                continue
            with g.inserting_after(last_ph):
                twin = g.placeholder(f"{info.placeholder}_stage{s}")
            twin.meta = copy.copy(ph.meta)
            last_ph = twin
            for u in users_by_stage[s]:
                nodes[u.name].replace_input_with(ph, twin)
            entry = copy.deepcopy(placements[info.placeholder])
            placements[twin.name] = entry
            tie.append((twin.name, s))
            params.append(TensorInfo(info.name, twin.name, info.shape, info.dtype))
            grads.append(total)
    out_node.args = ((loss, *grads, *updates),)
    g.eliminate_dead_code()
    _order_placeholders(g, params, captured)
    g.lint()
    new_gm.recompile()
    new = dataclasses.replace(captured, gm=new_gm, params=params, fold=None)
    return new, placements, stage_of, ties


def _parameters_to_untie(
    captured: CapturedGraph, stage_of: dict[str, int]
) -> list[tuple[int, TensorInfo, dict[int, list[fx.Node]], dict[int, list[fx.Node]]]]:
    """The parameters read by several stages whose gradient is a sum with one set of addends per such stage.

    Each as (index, parameter, its readers per stage, its gradient's addends per stage).
    """
    gm = captured.gm
    _, grads, _ = graph_results(gm, len(captured.params))
    plan: list[tuple[int, TensorInfo, dict[int, list[fx.Node]], dict[int, list[fx.Node]]]] = []
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for i, info in enumerate(captured.params):
        ph = phs[info.placeholder]
        users_by_stage: dict[int, list[fx.Node]] = {}
        for u in ph.users:
            if u.op != "output":
                users_by_stage.setdefault(stage_of[u.name], []).append(u)
        if len(users_by_stage) < 2:
            continue
        grad = grads[i]
        leaves = _grad_sum_leaves(grad, ph) if isinstance(grad, fx.Node) else None
        if not leaves:
            continue
        by_stage: dict[int, list[fx.Node]] = {}
        for leaf in leaves:
            by_stage.setdefault(stage_of.get(leaf.name, -1), []).append(leaf)
        if set(by_stage) != set(users_by_stage):
            continue
        plan.append((i, info, users_by_stage, by_stage))
    return plan


def _stage_gradient(
    g: fx.Graph,
    out_node: fx.Node,
    addends: list[fx.Node],
    stage: int,
    stage_of: dict[str, int],
    placements: dict[str, dict],
) -> fx.Node:
    """One stage's part of a parameter's gradient: the sum of its addends, added in that stage.

    Each sum reads both terms as the first addend holds its value and keeps that placement (a partial sum
    plus a partial sum, shards plus shards): not the first addend's own entry, whose inputs are that op's.
    """
    first = placements.get(addends[0].name) or {}
    held = (first.get("outputs") or [None])[0]
    with g.inserting_before(out_node):
        total = addends[0]
        for a in addends[1:]:
            total = g.call_function(aten.add.Tensor, (total, a))
            total.meta = copy.copy(addends[0].meta)
            stage_of[total.name] = stage
            entry = {k: copy.deepcopy(v) for k, v in first.items() if k not in ("op", "args", "inputs", "outputs")}
            sum_entry = {"op": str(aten.add.Tensor), "args": [total.args[0].name, a.name], "inputs": [held, held]}
            placements[total.name] = {**entry, **sum_entry, "outputs": [held]} if first else {}
    return total


def _order_placeholders(g: fx.Graph, params: list[TensorInfo], captured: CapturedGraph) -> None:
    """Placeholders in the order CapturedGraph promises: parameters (originals, then copies), buffers, inputs."""
    order = [p.placeholder for p in params] + [b.placeholder for b in captured.buffers]
    order += [x.placeholder for x in captured.inputs]
    by_name = {n.name: n for n in g.nodes if n.op == "placeholder"}
    first_op = next(n for n in g.nodes if n.op != "placeholder")
    for name in order:  # each goes right before the first op, after those placed before it
        first_op.prepend(by_name[name])
