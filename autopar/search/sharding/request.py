"""The question one mesh's sharding search answers, as one value.

Enumerating strategies, building the MILP instance and solving it all ask the
same thing: how to shard this graph, on this mesh of this cluster, training in
this precision with this optimizer, under this memory limit. :class:`MeshRequest`
is that question; :func:`autopar.search.sharding.mesh.solve_mesh`,
:func:`autopar.search.sharding.mesh_solve.prepare_mesh`,
:func:`autopar.search.pipeline.mesh.prepare_pipeline_mesh`,
:func:`autopar.search.sharding.problem.build_problem` and
:func:`autopar.search.sharding.build_context.make_context` take it whole rather
than as a row of arguments each passes on to the next.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture.joint import CapturedGraph
from autopar.core.mesh import SHARDING_AXES
from autopar.cost_models.compute import ComputeEfficiency
from autopar.cost_models.memory import Precision
from autopar.hardware.cluster import Cluster, Link, MeshShape


@dataclass(frozen=True, eq=False)
class MeshRequest:
    """How to shard ``captured`` on ``mesh`` of ``cluster``: the inputs of one mesh's search.

    ``memory_limit`` is bytes per device (None: the problem has no memory rows);
    ``efficiency`` overrides the device's calibrated compute efficiency; ``recompute``
    lets the MILP recompute activations in the backward (offered only under a limit).
    """

    captured: CapturedGraph
    cluster: Cluster
    mesh: MeshShape
    precision: Precision
    optimizer: str
    memory_limit: float | None = None
    efficiency: ComputeEfficiency | None = None
    recompute: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """The sharding mesh's shape, (dp, tp): pipeline stages are not a placement dim."""
        return (self.mesh.dp, self.mesh.tp)

    @property
    def links(self) -> list[Link]:
        return mesh_links(self.cluster, self.mesh)

    @property
    def activation_scale(self) -> float:
        return activation_scale(self.captured, self.precision)


def mesh_links(cluster: Cluster, mesh: MeshShape) -> list[Link]:
    """The link each sharding axis of ``mesh`` communicates over, in the order of ``SHARDING_AXES``."""
    return [cluster.axis_link(mesh, axis) for axis in SHARDING_AXES]


def activation_scale(captured: CapturedGraph, precision: Precision) -> float:
    """Activation bytes per traced byte: the graph is traced in its parameters' float dtype, trained in ``precision``'s."""
    traced = max((p.dtype.itemsize for p in captured.params if p.dtype.is_floating_point), default=4)
    return precision.activation_bytes / traced
