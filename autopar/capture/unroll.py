"""A joint graph of L repeated layers, written from the trace of four.

Tracing is what capture spends its time on (torch.export, then the joint trace:
about 0.3 s a LLaMA-7B layer on one core), and a transformer is one layer
repeated. So the planner traces the model with its layer stack cut to four
layers (the first, two middle ones, the last) and writes the joint graph of all
L from it: the first middle layer's forward is copied L - 2 times in order, its
backward L - 2 times in reverse, each copy reading the copy before or after it
where the template read its neighbour; every layer gets its parameter
placeholders and gradient outputs, and autograd sequence numbers shifted by
whole layers.

The copy is exact only if every middle layer traces like the template. That is
checked where it can be: the two traced middle layers must have the same ops in
the same order (forward and backward), read their inputs alike relative to their
own layer, and carry sequence numbers exactly one layer apart; every reference
must stay within one layer of its own, and nothing outside the layers may read a
middle one (a loss summed over every layer, as a mixture of experts' load
balancing can be, would need all of them). A layer whose Python branches on its
own index in a way the four traced layers do not show cannot be seen from here:
the graph names are canonical (:func:`canonical_names`), so the runtime's full
trace has the same names exactly when it has the same ops (:func:`fingerprint`
tells the two apart), and the runtime carries a plan over by op alignment
(:mod:`autopar.codegen.transfer`) where they differ.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from autopar.capture.graph import CapturedGraph, Fold, TensorInfo, graph_results

TEMPLATE_LAYERS = 4
"""Layers traced: the first, two middle ones (to check that they agree), the last."""

_KINDS = ("ph", "fwd", "bwd")

_SUFFIX = re.compile(r"_\d+$")


class NotUnrollable(Exception):
    """The traced layers do not repeat cleanly; the message says where."""


def _layer_of_name(name: str, stack: str, first: int = 0) -> int | None:
    """Layer index of a qualified name under ``stack`` ("model.layers.7.mlp.up.weight" -> 7), counted from the
    repeated run's first layer ``first``; None for a name outside the run (a layer before it is shared code)."""
    if not name.startswith(stack + "."):
        return None
    head = name[len(stack) + 1 :].split(".", 1)[0]
    return int(head) - first if head.isdigit() and int(head) >= first else None


def _renamed(name: str, stack: str, layer: int, first: int = 0) -> str:
    """``name`` of a layer of the run moved to the run's ``layer`` (both counted from ``first``)."""
    rest = name[len(stack) + 1 :].split(".", 1)
    return f"{stack}.{layer + first}" + (f".{rest[1]}" if len(rest) > 1 else "")


def _placeholder_name(prefix: str, name: str) -> str:
    """What capture names a placeholder (``_name_placeholders``): the qualified name, made an identifier."""
    return re.sub(r"\W|^(?=\d)", "_", prefix + name)


@dataclass
class _Template:
    """Where each node of the four-layer graph sits: (layer, part, position) or shared (None)."""

    where: dict[fx.Node, tuple[int, str, int] | None]
    parts: dict[tuple[int, str], list[fx.Node]]  # (layer, "ph" | "fwd" | "bwd") -> nodes in order
    shared_before: list[fx.Node]  # body nodes before the first layer's forward
    shared_between: list[fx.Node]  # after the last layer's forward, before its backward
    shared_after: list[fx.Node]  # after the first layer's backward
    seq_lo: list[int]  # the smallest autograd sequence number of each layer's forward
    seq_end: int  # one past the last layer's
    seq_step: int  # how far apart consecutive middle layers' sequence numbers are


def _signature(nodes: list[fx.Node]) -> list[tuple[str, str]]:
    """What must agree between copies: the op, or for a placeholder its shape and dtype."""

    def one(n: fx.Node) -> tuple[str, str]:
        if n.op == "placeholder":
            val = n.meta.get("val")
            return n.op, f"{tuple(getattr(val, 'shape', ()))}:{getattr(val, 'dtype', None)}"
        return n.op, str(n.target)

    return [one(n) for n in nodes]


def _template(c: CapturedGraph, stack: str, first: int = 0) -> _Template:
    """Split the traced graph into shared parts and per-layer parts; raise when they do not repeat.

    The run of layers starts at ``first``: the layers before it are shared code, like the embedding."""
    nodes = list(c.gm.graph.nodes)
    infos = {i.placeholder: i for i in [*c.params, *c.buffers, *c.inputs]}
    last = TEMPLATE_LAYERS - 1
    where: dict[fx.Node, tuple[int, str, int] | None] = {}
    parts: dict[tuple[int, str], list[fx.Node]] = {(t, k): [] for t in range(TEMPLATE_LAYERS) for k in _KINDS}
    body: list[fx.Node] = []
    for n in nodes:
        if n.op == "placeholder":
            info = infos.get(n.name)
            t = _layer_of_name(info.name, stack, first) if info is not None else None
            where[n] = None if t is None else (t, "ph", len(parts[(t, "ph")]))
            if t is not None:
                parts[(t, "ph")].append(n)
        elif n.op != "output":
            body.append(n)
    split = body.index(next(n for n in nodes if n.name == c.loss)) + 1
    label = [_layer_of_module(n, stack, first) for n in body]
    spans = _spans(label, split)
    for (t, kind), (lo, hi) in spans.items():
        parts[(t, kind)] = body[lo:hi]
        for pos, n in enumerate(body[lo:hi]):
            if label[lo + pos] not in (t, None):
                raise NotUnrollable(f"{n.name} of layer {label[lo + pos]} runs inside layer {t}")
            where[n] = (t, kind, pos)
    shared_before = body[: spans[(0, "fwd")][0]]
    shared_between = body[spans[(last, "fwd")][1] : spans[(last, "bwd")][0]]
    shared_after = body[spans[(0, "bwd")][1] :]
    for i, n in enumerate(body):
        if n not in where:
            if label[i] is not None:
                raise NotUnrollable(f"{n.name} of layer {label[i]} runs outside the layers")
            where[n] = None
    for kind in _KINDS:
        if _signature(parts[(1, kind)]) != _signature(parts[(2, kind)]):
            raise NotUnrollable(f"the middle layers' {kind} parts differ")
        if _pattern(parts[(1, kind)], where) != _pattern(parts[(2, kind)], where):
            raise NotUnrollable(f"the middle layers' {kind} parts read different values")
    seq_lo, seq_end, seq_step = _sequence_numbers(parts)
    return _Template(where, parts, shared_before, shared_between, shared_after, seq_lo, seq_end, seq_step)


def _sequence_numbers(parts: dict[tuple[int, str], list[fx.Node]]) -> tuple[list[int], int, int]:
    """Where each layer's autograd sequence numbers start and end, and the step between middle layers.

    A backward node carries the ``seq_nr`` of the forward op it differentiates (the
    pipeline search reads it), so the copies get theirs shifted by whole layers; the
    two middle layers must be exactly one step apart for that to be the trace's.
    """

    def numbers(t: int, kind: str) -> list[int | None]:
        return [n.meta.get("seq_nr") for n in parts[(t, kind)]]

    lo = []
    for t in range(TEMPLATE_LAYERS):
        found = [s for s in numbers(t, "fwd") if s is not None]
        if not found:
            raise NotUnrollable(f"layer {t} has no autograd sequence numbers")
        lo.append(min(found))
    step = lo[2] - lo[1]
    end = max(s for s in numbers(TEMPLATE_LAYERS - 1, "fwd") if s is not None) + 1

    def outside(s: int) -> bool:  # before the layers or after them (gradient sums carry the last op's)
        return s < lo[0] or s >= end

    for kind in ("fwd", "bwd"):
        for a, b in zip(numbers(1, kind), numbers(2, kind), strict=True):
            if (
                a is None
                and b is None
                or a is not None
                and b is not None
                and (b - a == step or a == b and outside(a))
            ):
                continue
            raise NotUnrollable("the middle layers' autograd sequence numbers are not one layer apart")
    return lo, end, step


def _spans(label: list[int | None], split: int) -> dict[tuple[int, str], tuple[int, int]]:
    """[start, end) of each layer's forward (before ``split``) and backward, from where each layer starts.

    A layer runs from its first op to the next layer's first op; the last one to
    run in each direction, to its own last op. The first and the last layer may
    differ from the middle ones (the first layer's input may need no gradient).
    """
    last = TEMPLATE_LAYERS - 1

    def first(t: int, lo: int, hi: int) -> int:
        i = next((i for i in range(lo, hi) if label[i] == t), None)
        if i is None:
            raise NotUnrollable(f"layer {t} has no {'forward' if lo == 0 else 'backward'} ops")
        return i

    f = [first(t, 0, split) for t in range(TEMPLATE_LAYERS)]
    b = [first(t, split, len(label)) for t in range(TEMPLATE_LAYERS)]
    if f != sorted(f) or b != sorted(b, reverse=True):
        raise NotUnrollable("the layers do not run in order")
    spans = {(t, "fwd"): (f[t], f[t + 1]) for t in range(last)}
    spans[(last, "fwd")] = (f[last], max(i for i in range(split) if label[i] == last) + 1)
    spans |= {(t, "bwd"): (b[t], b[t - 1]) for t in range(1, TEMPLATE_LAYERS)}
    spans[(0, "bwd")] = (b[0], max(i for i in range(split, len(label)) if label[i] == 0) + 1)
    return spans


def _pattern(nodes: list[fx.Node], where: dict[fx.Node, tuple[int, str, int] | None]) -> list[str]:
    """Each node's arguments with the values it reads written relative to its own layer."""

    def ref(m: fx.Node, t: int) -> str:
        w = where.get(m)
        return f"shared:{m.name}" if w is None else f"{w[0] - t:+d}:{w[1]}:{w[2]}"

    out = []
    for n in nodes:
        t = where[n][0] if where.get(n) else 0
        out.append(repr(fx.map_arg((n.args, n.kwargs), lambda m, t=t: ref(m, t))))
    return out


def _layer_of_module(n: fx.Node, stack: str, first: int = 0) -> int | None:
    return _layer_of_name(n.meta.get("autopar_module", ""), stack, first)


def _target_layer(t_from: int | None, j: int, t_to: int, layers: int) -> int:
    """The layer a node of template layer ``t_from`` (copied as layer ``j``) reads for template layer ``t_to``."""
    if t_from is None:  # shared code reads the first or the last layer only
        if t_to not in (0, TEMPLATE_LAYERS - 1):
            raise NotUnrollable("code outside the layers reads a middle layer")
        return 0 if t_to == 0 else layers - 1
    if abs(t_to - t_from) > 1:
        raise NotUnrollable("a layer reads a layer that is not its neighbour")
    return j + (t_to - t_from)


def unroll(
    c: CapturedGraph, stack: str, layers: int, params: list[TensorInfo], fixed: list[TensorInfo], first: int = 0
) -> CapturedGraph:
    """The joint graph of ``layers`` repeated layers under ``stack`` from ``c``, the trace with four of them.

    ``first``: the index of the run's first layer; the ``first`` layers before it (DeepSeek-V3's
    dense layers before its mixtures of experts) are traced whole, as shared code. ``params`` and ``fixed`` list the full model's trainable parameters and its fixed
    state (buffers), in the joint graph's order, with shapes and dtypes (placeholder
    names are filled here). Raises :class:`NotUnrollable` when the traced layers do not
    repeat cleanly.
    """
    if c.updated:
        raise NotUnrollable("the forward updates buffers")
    w = _Writer(c, _template(c, stack, first), stack, layers, first)
    infos = w.placeholders([*params, *fixed], len(params))
    infos += w.inputs()
    w.body()
    w.results(infos[: len(params)])
    gm = canonical_names(c.gm, w.new)
    n_params, n_fixed = len(params), len(fixed)
    loss, grad_nodes, _ = graph_results(gm, n_params)
    grad_names = {p.name: g.name for p, g in zip(infos[:n_params], grad_nodes, strict=True) if g is not None}
    # canonical_names keeps the order of the nodes it renames
    origin = {
        m.name: w.origin[n].name for n, m in zip(w.new.nodes, gm.graph.nodes, strict=True) if n in w.origin
    }
    layer_of = {n.name: where[:2] for n, where in w.tpl.where.items() if where is not None}
    return CapturedGraph(
        gm,
        infos[:n_params],
        infos[n_params : n_params + n_fixed],
        infos[n_params + n_fixed :],
        loss.name,
        grad_names,
        c.batch_size,
        c.model_name,
        [],
        fold=Fold(c, stack, layers, origin, layer_of, first),
    )


class _Writer:
    """Writes the L-layer graph from the template, node by node: shared nodes once, layer nodes per layer.

    ``copied`` maps a traced node outside the layers to its copy; ``layered`` maps
    (layer, part, position) to the copy of the template node at that position of that
    part, for the layer it was written for.
    """

    def __init__(self, c: CapturedGraph, tpl: _Template, stack: str, layers: int, first: int = 0):
        self.c, self.tpl, self.stack, self.layers, self.first = c, tpl, stack, layers, first
        self.new = fx.Graph()
        self.copied: dict[fx.Node, fx.Node] = {}
        self.layered: dict[tuple[int, str, int], fx.Node] = {}
        self.ph_nodes = {n.name: n for n in c.gm.graph.nodes if n.op == "placeholder"}
        self.origin: dict[fx.Node, fx.Node] = {}  # each node written -> the template node it stands for

    def fold_layer(self, j: int) -> int:
        """The traced layer that layer ``j`` stands on in a fold (:class:`Fold`): layer L-2 on the second middle one."""
        return 2 if j == self.layers - 2 and self.layers > 3 else self.template_layer(j)

    def template_layer(self, j: int) -> int:
        """The traced layer that layer ``j`` is written from: the first, the first middle one or the last."""
        return 0 if j == 0 else TEMPLATE_LAYERS - 1 if j == self.layers - 1 else 1

    def arg(self, m: fx.Node, t_from: int | None, j: int) -> fx.Node:
        """The copy that a node of traced layer ``t_from``, written as layer ``j``, reads where it read ``m``."""
        w = self.tpl.where[m]
        if w is None:
            return self.copied[m]
        t_to, kind, pos = w
        return self.layered[(_target_layer(t_from, j, t_to, self.layers), kind, pos)]

    def seq_nr(self, s: int, t: int | None, j: int) -> int:
        """Sequence number ``s`` of traced layer ``t`` shifted to layer ``j`` (whole layers past the template)."""
        tpl = self.tpl
        if s < tpl.seq_lo[0]:
            return s
        if s >= tpl.seq_end:
            return s + (self.layers - TEMPLATE_LAYERS) * tpl.seq_step
        t_s = max(k for k in range(TEMPLATE_LAYERS) if tpl.seq_lo[k] <= s)
        return s + (_target_layer(t, j, t_s, self.layers) - t_s) * tpl.seq_step

    def copy(self, n: fx.Node, t: int | None, j: int) -> fx.Node:
        out = self.new.node_copy(n, lambda m: self.arg(m, t, j))
        out.meta = dict(n.meta)
        if "seq_nr" in n.meta:
            out.meta["seq_nr"] = self.seq_nr(n.meta["seq_nr"], t, j)
        if t is not None and "autopar_module" in n.meta:
            mod = n.meta["autopar_module"]
            if _layer_of_name(mod, self.stack, self.first) is not None:
                out.meta["autopar_module"] = _renamed(mod, self.stack, j, self.first)
        return out

    def placeholders(self, state: list[TensorInfo], n_params: int) -> list[TensorInfo]:
        """A placeholder for each parameter and buffer of the full model, in its order."""
        stack, first = self.stack, self.first
        by_name = {i.name: i for i in [*self.c.params, *self.c.buffers]}
        infos: list[TensorInfo] = []
        for k, info in enumerate(state):
            j = _layer_of_name(info.name, stack, first)
            src = by_name[info.name if j is None else _renamed(info.name, stack, self.template_layer(j), first)]
            traced = self.ph_nodes[src.placeholder]
            node = self.new.placeholder(_placeholder_name("p_" if k < n_params else "b_", info.name))
            node.meta = dict(traced.meta)
            if j is not None and "autopar_module" in node.meta:
                node.meta["autopar_module"] = _renamed(node.meta["autopar_module"], stack, j, first)
            if "seq_nr" in node.meta:
                node.meta["seq_nr"] = self.seq_nr(node.meta["seq_nr"], None if j is None else self.template_layer(j), j)
            if j is None:
                self.copied[traced] = node
                self.origin[node] = traced
            else:
                _, kind, pos = self.tpl.where[traced]
                self.layered[(j, kind, pos)] = node
                self.origin[node] = self.tpl.parts[(self.fold_layer(j), kind)][pos]
            infos.append(TensorInfo(info.name, node.name, info.shape, info.dtype))
        return infos

    def inputs(self) -> list[TensorInfo]:
        """The model's inputs, as traced."""
        for i in self.c.inputs:
            node = self.ph_nodes[i.placeholder]
            self.copied[node] = out = self.new.node_copy(node)
            self.origin[out] = node
            out.meta = dict(node.meta)
            if "seq_nr" in node.meta:
                out.meta["seq_nr"] = self.seq_nr(node.meta["seq_nr"], None, -1)
        return list(self.c.inputs)

    def body(self) -> None:
        """Shared nodes before the layers, every layer's forward, shared nodes between, backwards reversed, the rest."""
        tpl = self.tpl
        self.shared(tpl.shared_before)
        for j in range(self.layers):
            self.layer(self.template_layer(j), "fwd", j)
        self.shared(tpl.shared_between)
        for j in reversed(range(self.layers)):
            self.layer(self.template_layer(j), "bwd", j)
        self.shared(tpl.shared_after)

    def shared(self, nodes: list[fx.Node]) -> None:
        for n in nodes:
            self.copied[n] = self.copy(n, None, -1)
            self.origin[self.copied[n]] = n

    def layer(self, t: int, kind: str, j: int) -> None:
        stands_on = self.tpl.parts[(self.fold_layer(j), kind)]
        for pos, n in enumerate(self.tpl.parts[(t, kind)]):
            self.layered[(j, kind, pos)] = out = self.copy(n, t, j)
            self.origin[out] = stands_on[pos]

    def results(self, params: list[TensorInfo]) -> None:
        """The output: the loss, then each parameter's gradient (its layer's copy)."""
        c, stack, first = self.c, self.stack, self.first
        loss_t, grads_t, _ = graph_results(c.gm, len(c.params))
        grad_of = dict(zip([p.name for p in c.params], grads_t, strict=True))
        grads = []
        for p in params:
            j = _layer_of_name(p.name, stack, first)
            t = None if j is None else self.template_layer(j)
            g = grad_of[p.name if t is None else _renamed(p.name, stack, t, first)]
            grads.append(None if g is None else self.arg(g, t, -1 if j is None else j))
        out = self.new.output((self.arg(loss_t, None, -1), *grads))
        out.meta = dict(next(n for n in reversed(c.gm.graph.nodes) if n.op == "output").meta)
        if "seq_nr" in out.meta:
            out.meta["seq_nr"] = self.seq_nr(out.meta["seq_nr"], None, -1)


def canonical_names(gm: fx.GraphModule, graph: fx.Graph | None = None) -> fx.GraphModule:
    """``gm`` rebuilt with its nodes named by their op alone, in graph order (``mm``, ``mm_1``, ...).

    A trace leaves gaps in the numbering where dead code was dropped; after this the
    names depend only on the sequence of ops, so two graphs with the same ops have the
    same names. Placeholders keep theirs (they name what they hold). The graph is
    rebuilt because a graph's namespace remembers every name it ever gave. ``graph``, when
    given, is renamed in place of ``gm``'s own (``gm`` then only lends its attributes).
    The module's code is generated when it is first called: the planner never calls it.
    """
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in (graph or gm.graph).nodes:
        args = fx.map_arg(n.args, env.__getitem__)
        kwargs = fx.map_arg(n.kwargs, env.__getitem__)
        name = n.name if n.op == "placeholder" else None if n.op == "output" else _SUFFIX.sub("", _base(n))
        m = new.create_node(n.op, n.target, args, kwargs, name=name, type_expr=n.type)
        m.meta = dict(n.meta)
        env[n] = m
    with _use_lazy_graph_module(True):  # fx.GraphModule itself would generate the code now
        return _make_graph_module(gm, new)


def _base(n: fx.Node) -> str:
    """The name a trace gives an op's node before numbering: the op's name."""
    target = n.target
    if n.op == "call_function":
        name = getattr(target, "__name__", str(target))
        return name.split(".")[0] if hasattr(target, "overloadpacket") else name
    if n.op == "get_attr":
        return str(target).replace(".", "_")
    return str(target)


def fingerprint(gm: fx.GraphModule) -> str:
    """A short digest of the graph's op sequence and wiring, by node name."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        h.update(f"{n.name}={n.op}:{n.target}({','.join(a.name for a in n.all_input_nodes)})\n".encode())
    return h.hexdigest()[:16]


def with_canonical_names(c: CapturedGraph) -> CapturedGraph:
    """``c`` with :func:`canonical_names` applied, its loss and gradient names following."""
    order = {n.name: i for i, n in enumerate(c.gm.graph.nodes)}
    gm = canonical_names(c.gm)
    nodes = list(gm.graph.nodes)
    c.gm, c.loss = gm, nodes[order[c.loss]].name
    c.grads = {p: nodes[order[g]].name for p, g in c.grads.items()}
    return c
