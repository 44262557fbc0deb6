"""The captured joint graph, and how the later passes read it.

:class:`CapturedGraph` is what capture hands on: the joint forward+backward graph
with its parameters, buffers and inputs named. The helpers here read what capture
recorded on every node (its module path, its phase) and the graph's results, so a
pass that only reads a captured graph need not know how it was traced.
"""

from __future__ import annotations

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


def graph_results(gm: fx.GraphModule | fx.Graph, params: int) -> tuple[Any, list[Any], list[Any]]:
    """The joint graph's loss node, gradient nodes (one per parameter) and buffer-update nodes."""
    g = gm.graph if isinstance(gm, fx.GraphModule) else gm
    out = next(n for n in reversed(g.nodes) if n.op == "output").args[0]
    return out[0], list(out[1 : 1 + params]), list(out[1 + params :])


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
