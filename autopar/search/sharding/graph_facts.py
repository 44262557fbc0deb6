"""What the sharding problem reads from a joint graph that no mesh changes, read once per graph.

Planning builds one sharding problem per mesh shape (and the search tries a
dozen), so the FLOP formulas, byte counts, live intervals and recompute
candidates are read here once rather than once per strategy of every node of
every mesh (:func:`autopar.search.sharding.problem.build_problem`).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.cost_models.attention import attention_work
from autopar.cost_models.compute import is_view, node_flops
from autopar.search.sharding.recompute import can_recompute


def _tensor_bytes(val) -> float:
    if hasattr(val, "numel") and hasattr(val, "element_size"):
        return float(val.numel()) * val.element_size()
    return 0.0


def _output_vals(node: fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]


@dataclass
class GraphFacts:
    """What build_problem reads from the graph that no mesh changes (see the module docstring)."""

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
    attention: dict[str, float] = field(default_factory=dict)  # fused attention kernels: attention_work


_FACTS: weakref.WeakKeyDictionary[fx.GraphModule, GraphFacts] = weakref.WeakKeyDictionary()


def graph_facts(gm: fx.GraphModule) -> GraphFacts:
    """The facts of ``gm``, read once and kept while ``gm`` lives (and its node count is unchanged)."""
    facts = _FACTS.get(gm)
    if facts is not None and facts.n_nodes == len(gm.graph.nodes):
        return facts
    nodes = list(gm.graph.nodes)
    order = {n.name: i for i, n in enumerate(nodes)}
    facts = GraphFacts(len(nodes), order, {n.name: n for n in nodes}, {}, {}, {}, {}, {}, {}, {}, set(), {})
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
        if attention_work(node):
            facts.attention[name] = attention_work(node)
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
    nodes: list[fx.Node], order: dict[str, int], owner: dict[fx.Node, tuple], storage_end: dict, facts: GraphFacts
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

