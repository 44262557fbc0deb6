"""Transfer: a plan's placements, made on one capture of the model, onto a capture at another batch size.

A plan names its placements by the node names of the graph it was searched on,
captured at the global batch; the runtime captures the model again at the
micro-batch.  The two graphs are the same op for op at every batch size but
one: tracing specializes a dim of size 1 (an ``expand`` to the same shape is
dropped, a matmul reshapes by ``view`` where it would ``clone``), so a graph of
one-row micro-batches has a few ops fewer or other, and every later node's
name shifts.  Read by name, the placements would then land on the wrong ops.
The same holds for a model whose trace orders its ops by a set of strings
(HuggingFace's ExaoneMoe builds its masks so): a process of another hash seed
traces the same ops in another order, the same names on other nodes.  Each
entry records the nodes its op reads (``"args"``), so such a graph is told
from the plan's.

:func:`transfer_placements` aligns the two graphs' op sequences (op and module
path per node, as a diff aligns lines) and carries each entry over to the node
it aligns with, when it is one of the strategies the strategy pass offers that
node (an aligned node of the same op may read other shapes).  A node left without an entry gets the
strategy that moves the fewest of its inputs from where their producers put
them: any strategy the strategy pass offers is exact, so this changes what the
step costs, never what it computes, and it touches only the handful of cheap
ops the specialization changed.
"""

from __future__ import annotations

import copy
import difflib
import logging

import torch.fx as fx

from autopar.capture.joint import CapturedGraph, node_module
from autopar.search.sharding.balanced_shards import holds_balanced
from autopar.search.sharding.node_keys import input_names, tensor_inputs
from autopar.search.sharding.node_strategies import NodeStrategies, Strategy
from autopar.search.sharding.strategies import enumerate_strategies

log = logging.getLogger(__name__)


def _op(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else node.op


def same_graph(placements: dict[str, dict], captured: CapturedGraph) -> bool:
    """Whether ``placements`` name exactly ``captured``'s nodes, with the same ops reading the same nodes.

    The inputs are compared where the plan records them (``"args"``; plans written before it compare ops
    alone): a model that orders its ops by a set of strings traces another order in a process of another
    hash seed, the same names on other nodes.
    """
    nodes = [n for n in captured.gm.graph.nodes if n.op != "output"]
    return len(nodes) == len(placements) and all(
        n.name in placements
        and placements[n.name].get("op", _op(n)) == _op(n)
        and placements[n.name].get("args", input_names(n)) == input_names(n)
        for n in nodes
    )


def align(placements: dict[str, dict], captured: CapturedGraph) -> dict[str, str]:
    """Plan node name -> node name of ``captured``, for the nodes whose op (and module) line up and whose
    inputs are the nodes the plan node's inputs map to."""
    plan_names = list(placements)
    plan_keys = [(e.get("op"), e.get("module", "")) for e in placements.values()]
    nodes = [n for n in captured.gm.graph.nodes if n.op != "output"]
    keys = [(_op(n), node_module(n)) for n in nodes]
    if not all(e.get("module") is not None for e in placements.values()):
        keys = [(op, "") for op, _ in keys]  # an older plan without module paths: align on ops alone
        plan_keys = [(op, "") for op, _ in plan_keys]
    matcher = difflib.SequenceMatcher(None, plan_keys, keys, autojunk=False)
    pairs = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            pairs[plan_names[block.a + k]] = nodes[block.b + k]
    # a pair stands where each node its plan node reads (as the plan records them) maps to the node it reads,
    # or neither maps to any: the pairs run in both graphs' order (the matching is monotone), so a node's
    # inputs are decided before it
    mapping: dict[str, str] = {}
    image: set[str] = set()
    for name, node in pairs.items():
        reads, have = placements[name].get("args"), input_names(node)
        if reads is not None and (
            len(reads) != len(have)
            or any(mapping[a] != b if a in mapping else b in image for a, b in zip(reads, have, strict=True))
        ):
            continue
        mapping[name] = node.name
        image.add(node.name)
    return mapping


def _moves(s: Strategy, node: fx.Node, chosen: dict[str, dict]) -> int:
    """How many of ``node``'s inputs strategy ``s`` reads in another placement than their producer's."""
    count = 0
    for want, a in zip(s.inputs, tensor_inputs(node), strict=False):
        have = chosen.get(a.name, {}).get("outputs", [None])
        if want is not None and have and want != have[0]:
            count += 1
    return count


def _offered(entry: dict, ns: NodeStrategies) -> bool:
    """Whether ``entry``'s placements are one of the strategies the strategy pass offers its node."""
    ins, outs = tuple(entry.get("inputs", ())), tuple(entry.get("outputs", ()))
    return any(tuple(s.inputs) == ins and tuple(s.outputs) == outs for s in ns.strategies)


def _entry(node: fx.Node, s: Strategy) -> dict:
    return {
        "op": _op(node),
        "module": node_module(node),
        "args": input_names(node),
        "outputs": list(s.outputs),
        "inputs": list(s.inputs),
    }


def _pick(ns: NodeStrategies, node: fx.Node, chosen: dict[str, dict]) -> Strategy:
    """The strategy for a node left without an entry: a follower follows its source's chosen output."""
    if ns.rule == "follower" and node.args and isinstance(node.args[0], fx.Node):
        src = chosen.get(node.args[0].name)
        idx = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else 0
        if src is not None and idx < len(src["outputs"]):
            want = src["outputs"][idx]
            for s in ns.strategies:
                if s.outputs and s.outputs[0] is not None and s.outputs[0] == want:
                    return s
    return min(ns.strategies, key=lambda s: _moves(s, node, chosen))


def transfer_placements(
    placements: dict[str, dict], captured: CapturedGraph, mesh_shape: tuple[int, ...]
) -> tuple[dict[str, dict], dict[str, str]]:
    """``placements`` carried onto ``captured``'s nodes, and the plan-name -> node-name map used.

    Unchanged (the same dict) when the plan's names are ``captured``'s.
    """
    if same_graph(placements, captured):
        return placements, {name: name for name in placements}
    mapping = align(placements, captured)
    nodes = [n for n in captured.gm.graph.nodes if n.op != "output"]
    by_run = {run: plan for plan, run in mapping.items()}
    strategies = enumerate_strategies(captured.gm, mesh_shape, balance_masks=holds_balanced(placements))
    chosen: dict[str, dict] = {}
    missing: list[fx.Node] = []
    for n in nodes:
        entry = placements.get(by_run.get(n.name, ""))
        if entry is not None and _offered(entry, strategies[n.name]):  # offered: its shards divide the node's shapes
            chosen[n.name] = {**copy.deepcopy(entry), "args": input_names(n)}
        else:
            missing.append(n)
    if missing:
        anew = set(missing)
        for n in nodes:  # graph order: producers are chosen before their readers
            if n in anew:
                chosen[n.name] = _entry(n, _pick(strategies[n.name], n, chosen))
        chosen = {n.name: chosen[n.name] for n in nodes}
    log.info(
        "placements carried onto a graph of batch %d: %d of %d nodes aligned, %d placed anew",
        captured.batch_size,
        len(nodes) - len(missing),
        len(nodes),
        len(missing),
    )
    return chosen, mapping


def transfer_name(name: str, placements: dict[str, dict], mapping: dict[str, str]) -> str:
    """The node of the new graph that plan node ``name`` became, or the next plan node's that has one."""
    names = list(placements)
    start = names.index(name) if name in names else len(names)
    for later in names[start:]:
        if later in mapping:
            return mapping[later]
    raise KeyError(f"no node of the new graph lines up with {name!r} or any node after it")
