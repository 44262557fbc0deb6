"""Recompute: drop chosen forward activations after the forward and compute them again in the backward.

A joint graph keeps every forward value that the backward reads alive from
the forward to its backward use: that is the activation memory.  Recompute
trades it for compute: the value is freed after its last *forward* use, and
a copy of the op that made it (a *clone*) runs again right before its first
*backward* use, from inputs that were kept.  The runtime needs no help for
this: fx code generation frees every value after its last use, so rewiring
the backward's reads to a clone placed late in the graph is all it takes.

The plan says what to recompute, in the placement entry of a forward node:

* ``"recompute": "selective"`` — that node's output is dropped after its last
  forward use and recomputed right before its first backward use, from its
  inputs.  An input that is itself recomputed is read from its clone (so
  chains of cheap ops are replayed together); any other input stays alive
  until the clone has read it.
* ``"recompute": "full"`` on any forward node of a *layer* — Megatron's full
  activation checkpointing of that layer: every recomputable forward node of
  the layer except its outputs (the values forward nodes outside the layer
  read: the checkpoint boundaries, kept) is dropped after the forward, and
  the whole set is replayed, in forward order, right before the first
  backward use of any of them.  What no backward op reads, directly or
  through another replayed node, is not replayed (it would be dead code).

A *layer* is one block of a repeated stack: the module path up to and
including its first numeric component (``transformer.h.3`` of
``transformer.h.3.attn.c_attn``, ``model.layers.3`` of
``model.layers.3.mlp``).  Nodes outside any numbered block (embeddings, the
final norm, the loss) belong to no layer.

An op and the ``getitem`` nodes that unpack its tuple are one unit: marking
either marks both (a ``getitem`` replayed from the kept tuple would keep
every element of the tuple alive, saving nothing).  Only deterministic ops
are replayed (:func:`can_recompute`): a random op is, when autopar draws its
numbers from a key (:mod:`autopar.ops.rng`), and otherwise a replay would draw
another mask and the backward would differentiate another function.

:func:`apply_recompute` is a graph-to-graph pass: it returns a new
:class:`~autopar.capture.joint.CapturedGraph` (same placeholders, parameters,
gradients and loss, so everything that maps names onto tensors still holds)
and placements with one entry per clone, and leaves its inputs untouched.
The analysis helpers (:func:`saved_activations`, :func:`recompute_layers`,
:func:`layer_outputs`, :func:`full_recompute_nodes`, :func:`can_recompute`)
are pure functions of the captured graph, for the planner that chooses what
to recompute.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator
import re
from collections.abc import Iterable

import torch
import torch.fx as fx

from autopar.capture.joint import CapturedGraph, node_module, node_phase
from autopar.core.errors import PlanError
from autopar.search.sharding.random_ops import RANDOM_OPS

log = logging.getLogger(__name__)

KEY = "recompute"
SELECTIVE = "selective"
FULL = "full"
SETTINGS = (SELECTIVE, FULL)
SUFFIX = "_recompute"  # clone names: the original's name and this (fx adds _1, _2 if taken)

_NUMERIC = re.compile(r"^\d+$")
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")
_HANDLE_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _graph(g: CapturedGraph | fx.GraphModule | fx.Graph) -> fx.Graph:
    if isinstance(g, CapturedGraph):
        return g.gm.graph
    return g.graph if isinstance(g, fx.GraphModule) else g


def _is_forward(node: fx.Node) -> bool:
    return node_phase(node) == "forward"


def _backward_users(node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` in the backward; the graph's output is not one (the loss is returned, not saved)."""
    return [u for u in node.users if u.op != "output" and node_phase(u) == "backward"]


def _is_handle(node: fx.Node) -> bool:
    """A saved-tensor handle: the ``detach`` autograd takes of a forward value it saves (tanh's output, ...).

    Capture traces it where autograd saves the value, in the middle of the
    forward, and tags it backward (no forward node reads it).  It aliases the
    value, so replaying the value means replaying its handles too, next to it.
    """
    return node.target in _HANDLE_OPS and node_phase(node) == "backward"


def _handles(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if _is_handle(u)]


def _readers(node: fx.Node) -> list[fx.Node]:
    """Backward nodes that read ``node``'s value, directly or through its saved-tensor handles."""
    out = []
    for u in _backward_users(node):
        out.extend(_readers(u) if _is_handle(u) else [u])
    return out


# ---------------------------------------------------------------- analysis


def saved_activations(gm: CapturedGraph | fx.GraphModule | fx.Graph) -> list[str]:
    """Forward nodes that at least one backward node reads, in graph order: what the backward keeps alive.

    A value autograd saves by handle (a ``detach`` of it, see :func:`_is_handle`) counts: the handle is a
    backward node that reads it.
    """
    return [n.name for n in _graph(gm).nodes if _is_forward(n) and _backward_users(n)]


def layer_of(module_path: str) -> str | None:
    """The layer a module path belongs to: the path up to its first numeric component; None outside one.

    ``"transformer.h.3.attn"`` -> ``"transformer.h.3"``, ``"model.layers.3"`` ->
    ``"model.layers.3"``, ``"transformer.ln_f"`` -> None.  Repeated blocks are
    held in ``nn.ModuleList`` / ``nn.Sequential``, whose children are named by
    their index, so the first index in the path names the block.
    """
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if _NUMERIC.match(part):
            return ".".join(parts[: i + 1])
    return None


def recompute_layers(captured: CapturedGraph | fx.GraphModule | fx.Graph) -> dict[str, list[str]]:
    """The forward nodes of each layer (see :func:`layer_of`), layers in order of appearance."""
    layers: dict[str, list[str]] = {}
    for n in _graph(captured).nodes:
        if _is_forward(n):
            layer = layer_of(node_module(n))
            if layer is not None:
                layers.setdefault(layer, []).append(n.name)
    return layers


def layer_outputs(captured: CapturedGraph | fx.GraphModule | fx.Graph, layer: str) -> list[str]:
    """The checkpoint boundaries of ``layer``: its forward nodes that forward nodes outside it read.

    The graph's output counts as outside (a layer that computes the loss keeps it).
    """
    out = []
    for n in _graph(captured).nodes:
        if _is_forward(n) and layer_of(node_module(n)) == layer:
            if any(
                u.op == "output" or (_is_forward(u) and layer_of(node_module(u)) != layer) for u in n.users
            ):
                out.append(n.name)
    return out


def _dropout_p(node: fx.Node) -> float | None:
    """The ``dropout_p`` argument of an op that has one (attention kernels), with its schema default."""
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            if arg.kwarg_only or i >= len(node.args):
                value = node.kwargs.get("dropout_p", arg.default_value)
            else:
                value = node.args[i]
            return float(value) if isinstance(value, (int, float)) else None
    return None


def why_not_recompute(node: fx.Node) -> str | None:
    """Why ``node`` cannot be replayed in the backward, or None when it can (see :func:`can_recompute`)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return f"it is a {node.op}, not an op"
    if node.op != "call_function":
        return f"{node.op} nodes are not replayed"
    target = node.target
    if target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node):
            reason = why_not_recompute(src)
            return None if reason is None else f"it unpacks {src.name}, and {reason}"
        return None
    if not isinstance(target, torch._ops.OpOverload):
        # Python-level functions in an ATen graph are operator.* on sizes: deterministic
        if getattr(target, "__module__", None) in ("_operator", "operator"):
            return None
        return f"{target} is not an ATen op"
    if target.namespace in _COLLECTIVE_NAMESPACES or "wait_tensor" in target.name():
        return f"{target} is a collective"
    if target._schema.is_mutable:
        return f"{target} mutates its input"
    if torch.Tag.nondeterministic_seeded in target.tags and target not in RANDOM_OPS:
        p = _dropout_p(node)
        if p is None or p > 0:  # attention kernels are tagged for their dropout; without it they are exact
            return f"{target} draws random numbers (a replay would draw others)"
    return None


def can_recompute(node: fx.Node) -> bool:
    """Whether ``node`` can be replayed in the backward and give exactly the value it gave in the forward.

    Yes for deterministic ATen ops, views and ``getitem`` (when the op it
    unpacks is replayable: they are replayed together), and for the random
    ops autopar draws itself (``native_dropout``, ``bernoulli``, ``rand*``:
    :mod:`autopar.search.sharding.random_ops`), whose numbers are keyed by the op, the
    step and the micro-batch, so a replay draws them again, as Megatron-LM
    restores the RNG state for its recompute.  No for placeholders and
    constants (nothing to replay), other random ops (attention kernels with
    dropout, ``multinomial``), ops that mutate their inputs, and collectives.
    """
    return why_not_recompute(node) is None


def _unit(node: fx.Node) -> list[fx.Node]:
    """``node`` with the op it unpacks or the ``getitem``s that unpack it: what is replayed together."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return [node, *(u for u in node.users if u.target is operator.getitem and _is_forward(u))]


def full_recompute_nodes(captured: CapturedGraph | fx.GraphModule | fx.Graph, layer: str) -> list[str]:
    """The nodes ``"full"`` recompute of ``layer`` drops after the forward and replays, in forward order.

    Every recomputable forward node of the layer except its outputs, and
    except ``getitem``s of an op that is not itself replayed.
    """
    g = _graph(captured)
    boundary = set(layer_outputs(g, layer))
    chosen: set[fx.Node] = set()
    for n in g.nodes:
        if (
            _is_forward(n)
            and layer_of(node_module(n)) == layer
            and n.name not in boundary
            and n.target is not operator.getitem
            and can_recompute(n)
        ):
            chosen.add(n)
    for n in list(chosen):
        chosen.update(
            u
            for u in n.users
            if u.target is operator.getitem and u.name not in boundary and layer_of(node_module(u)) == layer
        )
    return [n.name for n in g.nodes if n in chosen]


def with_recompute(
    placements: dict[str, dict],
    selective: Iterable[str] = (),
    full_layers: Iterable[str] = (),
    captured: CapturedGraph | None = None,
) -> dict[str, dict]:
    """A copy of ``placements`` with ``"selective"`` on the named nodes and ``"full"`` on the named layers.

    Marks go into existing entries only (the key lives in a node's placement).
    A layer is marked on every one of its forward nodes (any one would do);
    ``captured`` is needed for ``full_layers``.
    """
    out = {name: dict(entry) for name, entry in placements.items()}
    for name in selective:
        if name not in out:
            raise PlanError(f"recompute: {name!r} has no placement entry to mark")
        out[name][KEY] = SELECTIVE
    full_layers = list(full_layers)
    if full_layers:
        if captured is None:
            raise ValueError("with_recompute: full_layers needs the captured graph")
        layers = recompute_layers(captured)
        for layer in full_layers:
            if layer not in layers:
                raise PlanError(f"recompute: no layer {layer!r} in the graph (layers: {', '.join(layers)})")
            for name in layers[layer]:
                if name in out:
                    out[name][KEY] = FULL
    return out


# ---------------------------------------------------------------- the pass


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph: same node names, meta copied (values shared)."""
    g = fx.Graph()
    g._codegen = copy.deepcopy(gm.graph._codegen)
    val_map: dict[fx.Node, fx.Node] = {}
    result, old_out = g.graph_copy(gm.graph, val_map, return_output_node=True)
    new_out = g.output(result, type_expr=old_out.type)
    new_out.meta = copy.copy(old_out.meta)
    renamed = [(a.name, b.name) for a, b in val_map.items() if a.name != b.name]
    if renamed:  # cannot happen in a fresh namespace; the plan's names would no longer match
        raise PlanError(f"recompute: copying the graph renamed {renamed[0][0]} to {renamed[0][1]}")
    new = fx.GraphModule(gm, g, class_name=type(gm).__name__)
    new.meta = copy.copy(getattr(gm, "meta", {}))
    return new


def _marked_sets(g: fx.Graph, placements: dict[str, dict]) -> tuple[set[fx.Node], list[set[fx.Node]]]:
    """The nodes the plan marks selective (units included) and, per layer marked full, its replayed set."""
    nodes = {n.name: n for n in g.nodes}
    selective: set[fx.Node] = set()
    full: dict[str, None] = {}
    for name, entry in placements.items():
        how = entry.get(KEY) if isinstance(entry, dict) else None
        if how is None:
            continue
        node = nodes.get(name)
        if node is None:
            raise PlanError(f"recompute: the plan marks {name!r}, which is not a node of the graph")
        if how not in SETTINGS:
            raise PlanError(f"recompute: {name} is marked {how!r}; the settings are 'selective' and 'full'")
        if not _is_forward(node):
            raise PlanError(
                f"recompute: {name} is not a forward node (phase {node_phase(node)!r}); only forward values "
                "are saved for the backward"
            )
        if how == FULL:
            layer = layer_of(node_module(node))
            if layer is None:
                raise PlanError(
                    f"recompute: {name} is marked 'full' but its module {node_module(node)!r} is in no "
                    "numbered layer; mark it 'selective'"
                )
            full[layer] = None
            continue
        reason = why_not_recompute(node)
        if reason is not None:
            raise PlanError(f"recompute: cannot recompute {name}: {reason}")
        for member in _unit(node):
            if member is not node and why_not_recompute(member) is not None:
                raise PlanError(
                    f"recompute: cannot recompute {name}: {member.name} must be replayed with it and "
                    f"{why_not_recompute(member)}"
                )
            selective.add(member)
    groups = [{nodes[n] for n in full_recompute_nodes(g, layer)} for layer in full]
    return selective, groups


def _schedule(
    g: fx.Graph, marked: set[fx.Node], groups: list[set[fx.Node]]
) -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """Which marked nodes are replayed, and before which node index each one's clone goes.

    A node is replayed when a backward node reads it (itself or through a
    saved-tensor handle) or a replayed node reads it.  Its clone goes before
    its first backward read; a ``full`` layer's set goes before the first
    backward read of any of its members; and every clone precedes the clones
    that read it (the minimum is pushed from users to their inputs, in
    reverse forward order).
    """
    order = {n: i for i, n in enumerate(g.nodes)}
    forward = sorted(marked, key=order.__getitem__)
    needed: set[fx.Node] = set()
    for n in reversed(forward):
        if _readers(n) or any(u in needed for u in n.users):
            needed.add(n)
    never = len(order)
    pos = {n: min((order[u] for u in _readers(n)), default=never) for n in needed}
    for group in groups:
        members = group & needed
        first = min((pos[n] for n in members), default=never)
        for n in members:
            pos[n] = first
    for n in reversed(forward):
        if n in needed:
            pos[n] = min([pos[n], *(pos[u] for u in n.users if u in needed)])
    replayed = [n for n in forward if n in needed]
    return replayed, pos


def _clone(
    g: fx.Graph, n: fx.Node, clone_of: dict[fx.Node, fx.Node], placements: dict[str, dict], out: dict
) -> None:
    """Insert a clone of ``n`` at the graph's insertion point, then clones of its saved-tensor handles."""
    args = fx.map_arg(n.args, lambda a: clone_of.get(a, a))
    kwargs = fx.map_arg(n.kwargs, lambda a: clone_of.get(a, a))
    clone = g.create_node(n.op, n.target, args, kwargs, name=n.name + SUFFIX, type_expr=n.type)
    clone.meta = copy.copy(n.meta)
    clone.meta["autopar_phase"] = "backward"
    clone.meta["autopar_recompute_of"] = n.name
    clone_of[n] = clone
    if n.name in placements:
        out[clone.name] = {k: copy.deepcopy(v) for k, v in placements[n.name].items() if k != KEY}
    for h in _handles(n):
        if h.users:
            _clone(g, h, clone_of, placements, out)


def apply_recompute(captured: CapturedGraph, placements: dict[str, dict]) -> tuple[CapturedGraph, dict]:
    """The captured graph with the plan's ``"recompute"`` marks carried out, and placements for its clones.

    Returns a new CapturedGraph (the graph copied; placeholders, gradients and
    the loss keep their names) in which every replayed forward node has a
    clone placed as the module docstring says, with its backward users
    rewired to the clone, so that the original dies after its last forward
    use.  A saved-tensor handle (:func:`_is_handle`) of a replayed node is
    cloned right after the node's clone and its users rewired to that; the
    original handle is left without users.  Clones copy their original's
    meta with ``autopar_phase`` set to "backward" and ``autopar_recompute_of``
    naming the original; their placement entry is a copy of the original's
    without the ``"recompute"`` key.  Without any mark, the inputs come back
    unchanged (the same objects).  A mark that cannot be honoured raises a
    one-line PlanError naming the node.
    """
    if not any(isinstance(e, dict) and KEY in e for e in placements.values()):
        return captured, placements
    gm = _copy_graph_module(captured.gm)
    g = gm.graph
    selective, groups = _marked_sets(g, placements)
    marked = selective.union(*groups)
    replayed, pos = _schedule(g, marked, groups)
    anchors = list(g.nodes)
    order = {n: i for i, n in enumerate(anchors)}
    # what to rewire, read before any clone exists: backward users of each replayed node and of its handles
    rewire = []
    todo = list(replayed)
    while todo:
        n = todo.pop()
        handles = [h for h in _handles(n) if h.users]
        rewire.append((n, [u for u in _backward_users(n) if not _is_handle(u)]))
        todo.extend(handles)
    clone_of: dict[fx.Node, fx.Node] = {}
    out_placements = dict(placements)
    for n in sorted(replayed, key=lambda n: (pos[n], order[n])):
        with g.inserting_before(anchors[pos[n]]):
            _clone(g, n, clone_of, placements, out_placements)
    for n, users in rewire:
        for u in users:
            u.replace_input_with(n, clone_of[n])
    g.lint()
    gm.recompile()
    log.info(
        "recompute: %d of %d marked forward nodes replayed in the backward (%d selective, %d full layers)",
        len(replayed),
        len(marked),
        len(selective),
        len(groups),
    )
    return dataclasses.replace(captured, gm=gm, fold=None), out_placements


def recomputed(gm: fx.GraphModule | CapturedGraph) -> dict[str, str]:
    """Clone name -> original name for every node :func:`apply_recompute` inserted."""
    return {
        n.name: n.meta["autopar_recompute_of"] for n in _graph(gm).nodes if "autopar_recompute_of" in n.meta
    }
