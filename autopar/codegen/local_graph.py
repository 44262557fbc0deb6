"""The value the shard pass returns: one rank's joint graph and how its arguments and results are laid out.

Kept apart from :mod:`autopar.codegen.shard`, which makes it, because the
runtime reads it (its placements, the collectives it runs) without the pass.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autopar.codegen.collective_order import FUNCTIONAL_COLLECTIVES
from autopar.core.mesh import SHARDING_AXES
from autopar.core.placements import Placements


@dataclass
class LocalGraph:
    """One rank's joint graph and how its arguments and results are laid out.

    ``gm(*args)`` takes, in the captured graph's placeholder order, the local
    shard of every tensor whose placement is ``arg_placements[i]``, and returns
    ``(loss, *grads, *updates)`` with grads in ``grad_placements`` (None for a
    parameter without gradient) and the new value of each buffer the forward
    updates (``CapturedGraph.updated``) as the local shard of its own placement.
    ``zero_stages[i]`` is parameter ``i``'s ZeRO stage (0, 1 or 2).  Under ZeRO-1 its gradient is returned as a data-parallel
    partial sum (P on the dp axis) or, when the plan already reduced it,
    replicated (R); under ZeRO-2 the graph returns only this rank's flat
    chunk of the reduced gradient (see :func:`autopar.codegen.zero_grads.flat_chunk_numel`), and
    ``grad_placements[i]`` is the placement of the whole gradient it was cut from.
    """

    gm: fx.GraphModule
    arg_placements: list[Placements]
    grad_placements: list[Placements | None]
    zero_stages: list[int] = field(default_factory=list)
    updated: list[int] = field(default_factory=list)  # CapturedGraph.updated: the buffer of each update
    loss_scale: bool = False  # ``gm`` takes one more argument after the inputs: the loss scale (fp16)

    def collective_records(self, mesh: DeviceMesh, names: tuple[str, ...] = SHARDING_AXES) -> list[dict]:
        """Each collective of the graph as ``{"kind", "axis", "bytes"}``, in the estimate's terms.

        Bytes follow :func:`autopar.cost_models.reshard.collectives_between`: the
        full buffer of an all-gather (its output), a reduce-scatter or an
        all-reduce (its input), and each rank's buffer of an all-to-all.
        """
        axis_of = {mesh.get_group(i).group_name: names[i] for i in range(mesh.ndim)}
        kinds = {
            "all_reduce": "all_reduce",
            "all_gather_into_tensor": "all_gather",
            "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all",
        }
        out = []
        for n in self.gm.graph.nodes:
            op = getattr(n.target, "_opname", "") if n.op == "call_function" else ""
            if op not in kinds:
                continue
            val = n.args[0].meta["val"]
            nbytes = val.numel() * val.element_size()
            group = n.args[-1]
            size = mesh.size(list(axis_of).index(group)) if group in axis_of else 1
            if op == "all_gather_into_tensor":
                nbytes *= size
            out.append({"kind": kinds[op], "axis": axis_of.get(group, str(group)), "bytes": float(nbytes)})
        return out

    def collectives(self) -> Counter:
        """How many of each functional collective the graph runs per step."""
        return Counter(
            n.target._opname
            for n in self.gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "_opname", "") in FUNCTIONAL_COLLECTIVES
        )
