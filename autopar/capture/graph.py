"""The captured joint graph, and how the later passes read it.

:class:`CapturedGraph` is what capture hands on: the joint forward+backward graph
with its parameters, buffers and inputs named. The helpers here read what capture
recorded on every node (its module path, its phase) and the graph's results, so a
pass that only reads a captured graph need not know how it was traced.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


@dataclass(frozen=True)
class TensorInfo:
    """One graph input: a parameter, a buffer or a user input."""

    name: str  # params/buffers: qualified name in the user's model; inputs: "input_ids", "arg0", "target0"
    placeholder: str  # node name of its placeholder in the joint graph
    shape: tuple[int, ...]
    dtype: torch.dtype
    # user inputs: whether dim 0 is the batch, which data-parallel ranks and micro-batches split; False for a
    # tensor shared by all samples (``position_ids`` of shape (1, T) beside (B, T) ids) or not of samples at all
    # (a graph's edge list), which each micro-batch takes whole (:func:`autopar.capture.inputs.batched_flags`)
    batched: bool = True


@dataclass
class CapturedGraph:
    """The joint graph and the names needed to read it.

    ``gm(*params, *buffers, *inputs)`` returns ``(loss, *grads, *updates)``:
    one grad slot per entry of ``params`` (``None`` where a parameter gets no
    gradient), then the new value of every buffer the forward mutates in place
    (BatchNorm's running statistics and counter), ``updated[k]`` naming the
    index in ``buffers`` of the k-th.  Whoever runs the graph stores those
    values into the buffers after the call, as the eager forward would have.
    Parameters with ``requires_grad=False`` are listed under ``buffers``: the
    graph treats them as fixed state.
    """

    gm: fx.GraphModule
    params: list[TensorInfo]
    buffers: list[TensorInfo]
    inputs: list[TensorInfo]
    loss: str
    grads: dict[str, str]
    batch_size: int
    model_name: str
    updated: list[int] = field(default_factory=list)
    # the busiest expert-parallel rank's (token, choice) pairs over the mean; None: its expectation under
    # uniform routing (autopar.cost_models.experts)
    capacity_factor: float | None = None
    # how the graph was written from a trace of four of its layers (None: traced whole); a graph
    # rewritten from this one is no longer that graph and must not carry it
    fold: Fold | None = None
    # the same model captured at another batch (a planner's capture; None: not at hand), from which
    # autopar.search.sharding.batch_dims reads which dims of each value scale with the batch
    recapture: Callable[[int], CapturedGraph] | None = field(default=None, repr=False, compare=False)

    def unbatched_inputs(self) -> list[str]:
        """The inputs that are not batches of samples nor shared by every sample (a graph's edge list beside its
        node features, ``(40,)`` beside ``(16, 8)``): a micro-batch can neither take a part of them nor take
        them whole. A shared input (dim 0 of 1 beside the batch) goes whole to every micro-batch."""
        return [i.name for i in self.inputs if not i.batched and i.shape and i.shape[0] != 1]


@dataclass
class Fold:
    """What a graph written from a four-layer trace (:mod:`autopar.capture.unroll`) stands on.

    ``template`` is the trace of the model with its stack's run of ``layers`` like layers cut
    to four: the first, two middle ones, the last (layer numbers here count from the run's
    first, the stack's layer ``first``; a stack whose first layers differ from the rest, as
    DeepSeek-V3's dense layers before its mixtures of experts, keeps those whole, standing
    for themselves like the code outside the stack). ``origin`` maps every node of the full
    graph to the template node it stands for: layer 0 and layer L-1 to the traced first
    and last, layer L-2 to the second traced middle layer, and every other middle layer
    (1 .. L-3) to the first traced middle layer, which so stands for L-3 layers; a node
    outside the stack stands for itself. ``template_layer`` gives each template node of
    the stack its layer (0-3) and part: its placeholders ("ph"), its forward ("fwd", the ops
    between the previous layer's and the next one's, in graph order) or its backward ("bwd").
    With every layer choosing alike, a problem on the template
    whose first middle layer counts L-3 times is the whole graph's
    (:mod:`autopar.search.sharding.fold`).
    """

    template: CapturedGraph
    stack: str
    layers: int
    origin: dict[str, str]
    template_layer: dict[str, tuple[int, str]]
    first: int = 0  # the stack's index of the run's first layer: those before it are traced whole


def graph_results(gm: fx.GraphModule | fx.Graph, params: int) -> tuple[Any, list[Any], list[Any]]:
    """The joint graph's loss node, gradient nodes (one per parameter) and buffer-update nodes."""
    g = gm.graph if isinstance(gm, fx.GraphModule) else gm
    out = next(n for n in reversed(g.nodes) if n.op == "output").args[0]
    return out[0], list(out[1 : 1 + params]), list(out[1 + params :])


def graph_digest(gm: fx.GraphModule | fx.Graph) -> str:
    """A digest of every node's name, op and the nodes it reads, in the graph's order.

    What the ranks of a job must agree on to run the same collectives in the same order; the values a
    node is traced with (a factory op's device, on GPUs each rank's own) are left out.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    h = hashlib.sha1()
    for n in graph.nodes:
        reads = [a.name for a in n.all_input_nodes]
        h.update(f"{n.name} {n.op} {n.target if n.op == 'call_function' else ''} {reads}\n".encode())
    return h.hexdigest()


def node_module(node: fx.Node) -> str:
    """Module path in the user's model that ``node`` came from; "" for top level."""
    return node.meta.get("autopar_module", "")


def node_phase(node: fx.Node) -> str:
    """ "input" for placeholders, "forward" for the loss and its ancestors, else "backward"."""
    return node.meta.get("autopar_phase", "input" if node.op == "placeholder" else "backward")


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def tensor_nodes(graph: fx.Graph | fx.GraphModule) -> list[fx.Node]:
    """Nodes whose value is a single tensor (placeholders, ops, constants), in graph order."""
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return [n for n in g.nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def _numel(node: fx.Node) -> int:
    shape = getattr(node.meta.get("val"), "shape", None)
    return math.prod(int(d) for d in shape) if shape is not None else 0


def gradient_chain(gm: fx.GraphModule | fx.Graph, params: int) -> set[str]:
    """Names of the nodes that only make parameter gradients: the gradients, and backward nodes whose every
    reader is one of them and as large (a weight gradient's matmul and the transpose or view after it, a
    bias's ``sum`` then its ``view``, a norm's ``getitem``; not the activation gradient a weight gradient's
    matmul reads, whose moves are on the backward's critical path).

    A value on the chain that is still a partial sum is a gradient waiting for its
    reduction, wherever on the chain the plan puts it: the search costs it as
    gradient synchronisation and in the plan's ``reduce_dtype``, and the shard pass
    casts it to that dtype before reducing it.
    """
    g = gm.graph if isinstance(gm, fx.GraphModule) else gm
    _, grads, _ = graph_results(g, params)
    return extend_gradient_chain(list(g.nodes), {n.name for n in grads if isinstance(n, fx.Node)})


def extend_gradient_chain(nodes: list[fx.Node], grads: set[str]) -> set[str]:
    """:func:`gradient_chain` from the gradients' names, over ``nodes`` (the graph's, in graph order)."""
    out = set(grads)
    for node in reversed(nodes):
        if node.op != "call_function" or node.meta.get("autopar_phase") != "backward" or node.name in out:
            continue
        users = [u for u in node.users if u.op != "output"]
        size = _numel(node)
        if users and size and all(u.name in out and _numel(u) == size for u in users):
            out.add(node.name)
    return out
