"""The recompute settings a plan can be fixed to, as Megatron-LM names them, written as recompute marks.

``fixed={"recompute": ...}`` takes what Megatron-LM's
``--recompute-granularity`` (and DeepSpeed's activation checkpointing) lets a
user say:

* ``"none"`` — every activation the backward reads is kept from the forward.
* ``"selective"`` — Megatron's selective recompute (Korthikanti et al. 2022):
  the *attention core* of every layer is recomputed, nothing else.  The core
  is what lies between the query / key / value projections and the attention
  output: the scores matmul, scaling and mask, softmax, attention dropout and
  the probabilities-times-values matmul (:func:`attention_core`); where the
  graph has a fused attention op (``scaled_dot_product_*`` kernels,
  ``autopar::dropout_attention``) the core is that op.  Those values are
  the ``5·a·s/h`` term of a layer's activations, quadratic in the sequence.
* ``"op-sac"`` — torchtitan's per-op selective activation checkpointing
  (``activation_checkpoint.mode = "selective"``, ``selective_ac_option = "op"``;
  ``torchtitan/parallelisms/parallelize_llama.py``, ``_save_list`` and
  ``_custom_policy``, at pytorch/torchtitan 9dec370): in every layer the
  outputs of the attention kernels and of every other ``aten.mm`` (the first,
  third, ... in the layer's forward order; a projection with a bias, which
  torchtitan's Llama has not, is an ``aten.addmm`` and counts as one) are saved
  and everything else is recomputed (:func:`op_sac_marks`).  In a Llama layer that keeps the q and v
  projections and the MLP's gate and down projections and replays the norms,
  the rotary embedding, the k, output and up projections and the element-wise
  ops.  torchtitan also keeps the down projection's output, which no backward
  op reads; autopar frees it after the forward.
* ``"full"`` — Megatron's full checkpointing of every layer: only the layers'
  inputs are kept, and each layer's forward is replayed before its backward
  (:func:`autopar.search.sharding.recompute.full_recompute_nodes`).

Without the key the sharding MILP chooses op by op (:data:`OP_LEVEL` names
that choice in a plan).  A setting is carried out by the same marks the
runtime honours (:func:`autopar.search.sharding.recompute.apply_recompute`);
:func:`apply_setting` returns the graph that runs, on which the planner costs
the setting: the replayed ops are backward ops there (their FLOPs charged
again) and their originals die after the forward.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from autopar.capture.joint import CapturedGraph, node_module, node_phase
from autopar.cost_models.compute import is_view
from autopar.search.sharding.recompute import (
    FULL,
    KEY,
    SELECTIVE,
    apply_recompute,
    can_recompute,
    full_recompute_nodes,
    layer_of,
    layer_outputs,
    recompute_layers,
)

aten = torch.ops.aten

NONE = "none"
OP_SAC = "op-sac"
SETTINGS = (NONE, SELECTIVE, OP_SAC, FULL)  # what fixed["recompute"] takes
OP_LEVEL = "op-level"  # Plan.recompute of a plan whose marks the MILP chose op by op

_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}
_MATMUL = {aten.bmm.default, aten.mm.default, aten.matmul.default, aten.baddbmm.default}
# the matmuls torchtitan's per-op policy counts: its Llama's projections are aten.mm; a projection with a
# bias is the same matmul as aten.addmm
_LINEAR = {aten.mm.default, aten.addmm.default}


def is_fused_attention(node: fx.Node) -> bool:
    """A forward attention kernel: ``q, k, v -> out`` in one op (SDPA's flash / efficient / cudnn kernels)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    name = target._schema.name
    return ("scaled_dot_product" in name or name == "autopar::dropout_attention") and "backward" not in name


def _reads_parameter(node: fx.Node, params: set[str]) -> bool:
    """Whether an input of ``node`` is a parameter, directly or through views (a projection, not attention)."""
    todo = list(node.all_input_nodes)
    while todo:
        a = todo.pop()
        if a.name in params:
            return True
        if is_view(a):
            todo.extend(a.all_input_nodes)
    return False


def _nearest(start: fx.Node, step, stop, inside) -> set[fx.Node]:
    """The ``stop`` nodes first reached from ``start`` along ``step`` (inputs or users) within ``inside``."""
    found, seen, todo = set(), {start}, list(step(start))
    while todo:
        n = todo.pop()
        if n in seen or n not in inside:
            continue
        seen.add(n)
        if stop(n):
            found.add(n)
        else:
            todo.extend(step(n))
    return found


def _between(sources: set[fx.Node], sinks: set[fx.Node], inside: set[fx.Node]) -> set[fx.Node]:
    """Nodes of ``inside`` on a path from a source to a sink, both included."""
    down, todo = set(), list(sources)
    while todo:
        n = todo.pop()
        if n in down or n not in inside:
            continue
        down.add(n)
        if n not in sinks:
            todo.extend(n.users)
    up, todo = set(), list(sinks)
    while todo:
        n = todo.pop()
        if n in up or n not in inside:
            continue
        up.add(n)
        if n not in sources:
            todo.extend(n.all_input_nodes)
    return down & up


def attention_core(captured: CapturedGraph) -> dict[str, list[str]]:
    """Per layer, the forward nodes of its attention core (see the module docstring), in graph order.

    A fused attention op is a core with the ``getitem``\\ s that unpack it.  Without
    one, a softmax whose input comes from a matmul of two activations (the
    scores: no parameter among its inputs, unlike a router's logits) and whose
    output reaches another such matmul (the context) marks a core: every node
    on a path from the scores matmul to the context matmul.  Only nodes that can
    be replayed (:func:`autopar.search.sharding.recompute.can_recompute`) are listed.
    """
    params = {p.placeholder for p in captured.params}
    nodes = list(captured.gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_layer: dict[str, set[fx.Node]] = {}
    for n in nodes:
        if node_phase(n) == "forward" and n.op == "call_function":
            layer = layer_of(node_module(n))
            if layer is not None:
                by_layer.setdefault(layer, set()).add(n)

    def matmul_of_activations(n: fx.Node) -> bool:
        return n.target in _MATMUL and not _reads_parameter(n, params)

    out: dict[str, list[str]] = {}
    for layer, inside in by_layer.items():
        core: set[fx.Node] = set()
        for n in inside:
            if is_fused_attention(n):
                core.add(n)
                core.update(u for u in n.users if u.target is operator.getitem and u in inside)
            elif n.target in _SOFTMAX:
                scores = _nearest(n, lambda x: x.all_input_nodes, lambda x: x.target in _MATMUL, inside)
                context = _nearest(n, lambda x: list(x.users), lambda x: x.target in _MATMUL, inside)
                scores = {m for m in scores if matmul_of_activations(m)}
                context = {m for m in context if matmul_of_activations(m)}
                if scores and context:
                    core |= _between(scores, context, inside)
        kept = sorted((n for n in core if can_recompute(n)), key=order.__getitem__)
        if kept:
            out[layer] = [n.name for n in kept]
    return out


def _op_sac_saved(nodes: list[fx.Node]) -> set[fx.Node]:
    """What torchtitan's per-op policy saves of one layer's forward nodes: every other projection matmul
    (the first, third, ...) and the attention kernels, with the ``getitem``\\ s that unpack them."""
    saved: set[fx.Node] = set()
    count = 0
    for n in nodes:
        if n.target in _LINEAR:
            count += 1
            if count % 2:
                saved.add(n)
        elif is_fused_attention(n):
            saved.add(n)
            saved.update(u for u in n.users if u.target is operator.getitem)
    return saved


def op_sac_marks(captured: CapturedGraph) -> dict[str, list[str]]:
    """Per layer, the forward nodes torchtitan's per-op checkpointing recomputes (see the module docstring).

    Every replayable forward node of the layer except what the policy saves and
    the layer's outputs (the next layer's input, which a checkpointed block keeps).
    """
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    out: dict[str, list[str]] = {}
    for layer, names in recompute_layers(captured).items():
        nodes = [by_name[name] for name in names]
        keep = _op_sac_saved(nodes) | {by_name[name] for name in layer_outputs(captured, layer)}
        chosen = [n.name for n in nodes if _replayable_apart_from(n, keep)]
        if chosen:
            out[layer] = chosen
    return out


def _replayable_apart_from(n: fx.Node, keep: set[fx.Node]) -> bool:
    """Whether ``n`` can be replayed without replaying a node of ``keep``: an op and the ``getitem``\\ s
    that unpack it are replayed together, or not at all."""
    op = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else n
    unit = {op, *(u for u in op.users if u.target is operator.getitem)}
    return n.op == "call_function" and not unit & keep and can_recompute(n)


def setting_marks(captured: CapturedGraph, how: str) -> dict[str, str]:
    """Node name -> recompute mark that carries out setting ``how`` ("none": no marks)."""
    if how == SELECTIVE:
        return {name: SELECTIVE for names in attention_core(captured).values() for name in names}
    if how == OP_SAC:  # carried out by per-node marks, as the MILP's own op-level choices are
        return {name: SELECTIVE for names in op_sac_marks(captured).values() for name in names}
    if how == FULL:
        layers = recompute_layers(captured)
        # every forward node of a layer with something to replay carries the mark (the runtime reads the layer)
        replaying = [layer for layer in layers if full_recompute_nodes(captured, layer)]
        return {name: FULL for layer in replaying for name in layers[layer]}
    return {}


def apply_setting(captured: CapturedGraph, how: str) -> tuple[CapturedGraph, dict[str, str]]:
    """The graph that runs under setting ``how`` (replays in place, as the runtime makes it) and its marks."""
    marks = setting_marks(captured, how)
    if not marks:
        return captured, marks
    rewritten, _ = apply_recompute(captured, {name: {KEY: mark} for name, mark in marks.items()})
    return rewritten, marks


def mark_placements(
    placements: dict[str, dict], marks: dict[str, str], clones: Iterable[str]
) -> dict[str, dict]:
    """Placements solved on the graph :func:`apply_setting` made, as a plan holds them.

    The clones' entries are dropped (the runtime makes the clones again, each
    placed as its original) and every marked node's entry carries its mark.
    """
    drop = set(clones)
    out = {name: dict(entry) for name, entry in placements.items() if name not in drop}
    for name, mark in marks.items():
        if name in out:
            out[name][KEY] = mark
    return out
