"""Read the numbers the cost model needs off a captured joint graph, once.

The result is plain data (``GraphStats``): every configuration the search
costs afterwards reuses it without touching torch.
"""

from __future__ import annotations

import hashlib
import math
import operator

from autopar.capture.graph import extend_gradient_chain
from autopar.capture.joint import CapturedGraph, node_phase
from autopar.cost_models.compute import graph_compute, is_view, node_bytes
from autopar.cost_models.memory import saved_activation_bytes
from autopar.cost_models.step import GraphStats


def model_fingerprint(names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> str:
    """A short hash of parameter names and shapes: tells one model from another."""
    h = hashlib.sha256()
    for name, shape in names_and_shapes:
        h.update(f"{name}:{tuple(shape)};".encode())
    return h.hexdigest()[:16]


def graph_stats(captured: CapturedGraph, frozen_params: int = 0) -> GraphStats:
    """The cost model's numbers of ``captured``; ``frozen_params``: the model's parameters that do not train
    (:func:`autopar.capture.joint.frozen_parameter_count`), which the graph holds as fixed state."""
    gm = captured.gm
    compute = graph_compute(gm, node_phase, batch_free_nodes(captured))

    def storage_view(node) -> bool:
        return node.target is not operator.getitem and is_view(node)

    saved_float, saved_other = saved_activation_bytes(gm, node_phase, storage_view)
    transient = max(
        (node_bytes(n) for n in gm.graph.nodes if n.op == "call_function" and node_phase(n) == "backward"),
        default=0,
    )
    float_sizes = [p.dtype.itemsize for p in captured.params if p.dtype.is_floating_point]
    numels = [_numel(p.shape) for p in captured.params]
    return GraphStats(
        model=captured.model_name,
        fingerprint=model_fingerprint([(p.name, p.shape) for p in captured.params]),
        num_params=sum(numels),
        batch_size=captured.batch_size,
        compute=compute,
        saved_float_bytes=saved_float,
        saved_other_bytes=saved_other,
        traced_float_size=max(float_sizes, default=4),
        largest_param_numel=max(numels, default=0),
        param_groups=len({p.name.rsplit(".", 1)[0] for p in captured.params}),
        peak_transient_bytes=transient,
        param_names=[p.name for p in captured.params],
        param_numels=numels,
        state_bytes=sum(math.prod(b.shape) * b.dtype.itemsize for b in captured.buffers),
        frozen_params=frozen_params,
    )


def batch_free_nodes(captured: CapturedGraph) -> set[str]:
    """Nodes whose values are the same size at any batch: parameters and their views, gradients, and backward
    nodes that only make gradients and are as large as what they make (a bias gradient's ``sum`` before its
    ``view``, the two halves of a tied weight's gradient; not the activation a weight gradient's matmul reads).

    The analytic model scales a graph captured at one batch to another; these
    bytes it must not scale (an embedding's table is read once, whatever the batch).
    """
    gm = captured.gm
    out = {p.placeholder for p in captured.params}
    for node in gm.graph.nodes:  # views of parameters, in graph order
        src = node.args[0] if node.args else None
        if is_view(node) and getattr(src, "name", None) in out:
            out.add(node.name)
    return extend_gradient_chain(list(gm.graph.nodes), out | set(captured.grads.values()))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
