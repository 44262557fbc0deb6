"""What a node's candidate strategies depend on, read off the graph once for every mesh.

The strategies pass memoizes its rules per (op, input tensor metadata, input
candidate placements, other arguments), so identical layers cost one computation.
All of that key but the candidate placements is a property of the graph alone,
while the search enumerates strategies on every mesh shape it tries (a dozen, and
more once pipeline stages get their own meshes). Building the key from the node's
arguments took most of an enumeration once the rules themselves were memoized, so
the graph's part is built here once per graph: per node, its tensor inputs and a
number standing for everything in its key but its producers' candidates.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor._dtensor_spec import TensorMeta


def tensor_meta(v: Any) -> TensorMeta | None:
    if not isinstance(v, torch.Tensor):
        return None
    return TensorMeta(torch.Size(v.shape), tuple(v.stride()), v.dtype)


def is_tensor_node(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def output_vals(node: fx.Node) -> tuple[Any, ...]:
    v = node.meta.get("val")
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued argument nodes in the order DTensor flattens them: args, then kwargs."""
    flat = torch.utils._pytree.tree_leaves(
        (node.args, dict(node.kwargs)), is_leaf=lambda x: isinstance(x, fx.Node)
    )
    return [a for a in flat if is_tensor_node(a)]


def input_names(node: fx.Node) -> list[str]:
    """The names of ``node``'s tensor inputs, in :func:`tensor_inputs`' order.

    A plan's entry records them (``"args"``): two captures of a model can give the same names to other
    nodes (a model that iterates a set of strings orders its ops by the process's hash seed), and only
    the names a node reads tell a plan's node from another of the same op and name.
    """
    return [a.name for a in tensor_inputs(node)]


def freeze(x: Any) -> Any:
    """A hashable stand-in for a non-tensor argument (lists become tuples)."""
    if isinstance(x, (list, tuple)):
        return tuple(freeze(e) for e in x)
    if isinstance(x, dict):
        return tuple(sorted((k, freeze(v)) for k, v in x.items()))
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise TypeError("symbolic")
    return x


@dataclass(frozen=True)
class NodeKey:
    """The graph's part of a call node's memo key.

    Two nodes with the same ``template`` and the same candidates at their ``slots``
    have the same strategies: the template numbers (op, arguments with each tensor
    argument written as its metadata, output metadata).
    """

    inputs: list[fx.Node]  # tensor_inputs(node)
    slots: tuple[fx.Node, ...]  # the tensor arguments, in the order the template leaves them out
    template: int | None  # None: an argument cannot be hashed (a symbolic size), so no memo


_KEYS: weakref.WeakKeyDictionary[fx.GraphModule, tuple[fx.Graph, int, dict[fx.Node, NodeKey]]] = (
    weakref.WeakKeyDictionary()
)


def node_keys(gm: fx.GraphModule) -> dict[fx.Node, NodeKey]:
    """``NodeKey`` of every call node of ``gm``, built once per graph (rebuilt if its nodes change)."""
    got = _KEYS.get(gm)
    if got is not None and got[0] is gm.graph and got[1] == len(gm.graph.nodes):
        return got[2]
    numbers: dict[Any, int] = {}
    keys = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            slots: list[fx.Node] = []
            template = _template(node, slots)
            number = None if template is None else numbers.setdefault(template, len(numbers))
            keys[node] = NodeKey(tensor_inputs(node), tuple(slots), number)
    _KEYS[gm] = (gm.graph, len(gm.graph.nodes), keys)
    return keys


def _template(node: fx.Node, slots: list[fx.Node]) -> Any:
    def leave(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                slots.append(a)
                return ("T", tensor_meta(v))
            return ("V", freeze(v))
        if isinstance(a, (list, tuple)):
            return tuple(leave(e) for e in a)
        return freeze(a)

    try:
        key = (
            node.target,
            leave(node.args),
            tuple((k, leave(v)) for k, v in node.kwargs.items()),
            tuple(tensor_meta(v) for v in output_vals(node)),
        )
        hash(key)
    except TypeError:
        return None
    return key
