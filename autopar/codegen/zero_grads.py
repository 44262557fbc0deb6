"""ZeRO-1/2 gradients as they leave a rank's local graph: a data-parallel partial sum, or this rank's flat chunk.

The runtime steps a ZeRO-1/2 parameter as flat chunks over the data-parallel
ranks (:mod:`autopar.runtime.zero`); the shard pass
(:func:`autopar.codegen.shard.shard_graph`) hands it each such gradient in the
form its stage reads, converted as soon as the backward makes it so that under
ZeRO-2 the whole gradient dies there.  :func:`flat_chunk_numel` is the unit of
ownership both sides share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from autopar.capture.joint import graph_results
from autopar.codegen.redistribute import local_of, redistribute
from autopar.core.placements import PARTIAL, REPLICATE, SUM, Placements, to_dtensor_all


def flat_chunk_numel(numel: int, parts: int) -> int:
    """Elements in one rank's part of a tensor flattened, zero-padded to a multiple of ``parts`` and cut in ``parts``.

    ZeRO-1/2's unit of ownership (DeepSpeed's flat partitions): every rank owns
    the same number of elements whatever the tensor's shape or its
    tensor-parallel split, so optimizer state and gradients divide evenly.
    """
    return -(-numel // parts)


def zero_gradient(g: DTensor, spec: Placements, stage: int, mesh: DeviceMesh) -> tuple[torch.Tensor, Placements]:
    """A ZeRO-1/2 parameter's gradient as it leaves the graph, and the placement of the whole gradient.

    The data-parallel sum is not completed here when it is still pending: under
    ZeRO-1 the partial sum leaves the graph and the runtime reduce-scatters it
    once per step (after accumulating micro-batches locally); under ZeRO-2 it is
    reduce-scattered flat right here, so only this rank's chunk outlives the
    graph.  A gradient the plan already sharded over dp is gathered (what the
    plan did for this replicated parameter anyway); a replicated one is cut locally.
    """
    first = g.placements[0]
    summed = isinstance(first, Partial)
    keep = (first if first.reduce_op == SUM else Partial(SUM)) if summed else Replicate()
    local = local_of(redistribute(g, (keep, *to_dtensor_all(spec[1:]))))
    if stage == 1:
        return local, (PARTIAL if summed else REPLICATE, *spec[1:])
    n = mesh.size(0)
    flat = local.reshape(-1)
    pad = flat_chunk_numel(flat.numel(), n) * n - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    if summed:
        return funcol.reduce_scatter_single(flat, SUM, 0, (mesh, 0)), tuple(spec)
    return flat.view(n, -1)[mesh.get_coordinate()[0]].clone(), tuple(spec)


def early_zero_gradients(
    gm: fx.GraphModule,
    stages: list[int],
    grad_pl: list[tuple],
    early: dict[int, torch.Tensor],
    mesh: DeviceMesh,
    reduce_dtype: torch.dtype | None = None,
) -> dict[fx.Node, Callable[[Any], None]]:
    """Per gradient node of a ZeRO parameter, what the interpreter calls with its value.

    A ZeRO gradient is brought to its returned form as soon as the backward produces it, so that its
    reduction is traced there and the whole gradient dies there; under ZeRO-2 that is the memory saved.
    The converted gradient goes into ``early`` and its placement into ``grad_pl``; with a
    ``reduce_dtype`` (mixed precision) it is cast to it first, so that it is reduced and kept in it.
    """
    _, grad_nodes, _ = graph_results(gm, len(stages))
    on_value = {}
    for i, node in enumerate(grad_nodes):
        if stages[i] and isinstance(node, fx.Node) and node not in on_value:

            def convert(g: Any, i: int = i) -> None:
                if reduce_dtype is not None and g.dtype.is_floating_point:
                    g = g.to(reduce_dtype)
                early[i], grad_pl[i] = zero_gradient(g, grad_pl[i], stages[i], mesh)

            on_value[node] = convert
    return on_value
