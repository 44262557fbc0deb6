"""Find repeated layers, so that every copy of a layer shares one set of decision variables.

A 32-layer transformer has 32 copies of the same block: same ops, same
shapes, same strategies. Solving for each copy separately multiplies the
MILP's size by 32 for no gain, since the copies see the same costs (the
only difference is their neighbours, and those are copies too). Nodes are
matched across copies by their module path with the layer index taken out
("model.layers.7.mlp.up_proj" → "model.layers.*.mlp.up_proj"), their op,
their output shapes and their rank among such nodes in graph order. A copy
joins the groups only when its nodes match a middle copy's one for one (a
first or last layer that differs keeps its own variables), and a group only
when all its copies have the same strategies, so tying them can never make an
answer invalid.

Followers (views, element-wise ops) and dominated strategies are folded by
the solver's own reduction (``autopar.solver.reduce``), which works on the
plain problem and needs no knowledge of ops.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch.fx as fx

from autopar.capture.joint import node_module
from autopar.core.module_paths import layer_key


def _signature(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    shapes = tuple(tuple(v.shape) if hasattr(v, "shape") else None for v in vals)
    # a placeholder's target is its own name, which holds the layer's index: its module path matches it
    return (node.op, "" if node.op == "placeholder" else str(node.target), shapes)


def repeated_groups(gm: fx.GraphModule, candidates: set[str], same_strategies=None) -> list[list[str]]:
    """Groups of node names (one per layer copy) that can share decision variables.

    ``candidates`` limits the nodes considered (those in the problem);
    ``same_strategies(a, b)`` says whether two nodes have identical strategy
    lists (the solver needs that to tie them). The matching of copies depends on
    the graph alone, so it is done once per graph and candidate set (the search
    asks again for every mesh); only the strategy check is redone.
    """
    key = frozenset(candidates)
    per_graph = _MATCHED.setdefault(gm, {})
    matched = per_graph.get(key)
    if matched is None:
        per_graph.clear()  # one candidate set at a time is all the search needs
        matched = per_graph[key] = _matched_copies(gm, candidates)
    if same_strategies is None:
        return [list(g) for g in matched]
    return [list(g) for g in matched if all(same_strategies(g[0], other) for other in g[1:])]


_MATCHED: weakref.WeakKeyDictionary[fx.GraphModule, dict[frozenset, list[list[str]]]] = (
    weakref.WeakKeyDictionary()
)


def _matched_copies(gm: fx.GraphModule, candidates: set[str]) -> list[list[str]]:
    """Node names matched across every copy of each repeated layer, by module path, op, shapes and rank."""
    # per repeated-layer family: per layer index, the nodes in graph order
    families: dict[str, dict[int, list[fx.Node]]] = defaultdict(lambda: defaultdict(list))
    for node in gm.graph.nodes:
        if node.name not in candidates:
            continue
        key = layer_key(node_module(node))
        if key is None:
            continue
        family, layer = key
        families[family][layer].append(node)

    groups: list[list[str]] = []
    for layers in families.values():
        if len(layers) < 2:
            continue
        copies = [layers[i] for i in sorted(layers)]
        # match the k-th node of each signature across copies
        ranked = []
        for nodes in copies:
            count: dict[tuple, int] = defaultdict(int)
            table = {}
            for n in nodes:
                sig = _signature(n)
                table[(sig, count[sig])] = n
                count[sig] += 1
            ranked.append(table)
        # a copy whose nodes differ from a middle one's (a first or last layer that reads
        # or feeds something the others do not) keeps its own variables
        reference = set(ranked[len(ranked) // 2])
        aligned = [table for table in ranked if set(table) == reference]
        if len(aligned) < 2:
            continue
        for key in ranked[len(ranked) // 2]:
            groups.append([table[key].name for table in aligned])
    return groups
