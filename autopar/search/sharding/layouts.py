"""A hand-set layout as placements on one mesh: the seed's parameter placements, the rest of the graph solved.

A seed (:mod:`autopar.search.sharding.seeds`) restricts only the parameters'
placements; :func:`layout_placements` solves every other node under that
restriction, with no memory limit, on the graph it is given.  Plans of the
analytic data-parallel path carry the dp (or zero3) layout's placements made
this way (:func:`autopar.api.data_parallel.data_parallel_placements`), and the
correctness oracle runs the layouts as plans (:mod:`autopar.verify.oracle`).
"""

from __future__ import annotations

from autopar.capture.joint import CapturedGraph
from autopar.core.errors import PlanError
from autopar.cost_models.memory import Precision
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.search.sharding.mesh import solve_mesh
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.seeds import seed_filter
from autopar.search.sharding.strategies import Strategy

# The solver's time limit for a layout: the seed leaves it little to choose.
LAYOUT_TIME_LIMIT_S = 30.0


def layout_placements(
    captured: CapturedGraph,
    cluster: Cluster,
    mesh: MeshShape,
    precision: Precision,
    optimizer: str,
    kind: str,
    split_batch: bool = False,
) -> dict[str, dict]:
    """Placements of a hand-set layout ("dp", "zero3", "megatron") on a dp × tp ``mesh``, the rest solved.

    ``split_batch`` also splits every input by batch over the data-parallel
    axis, as DDP and FSDP do, even where the cost model would rather not.
    """
    params = {p.placeholder: p.name for p in captured.params}
    inputs = {i.placeholder for i in captured.inputs}
    seed = seed_filter(kind, params, captured.model_name.startswith("GPT2"))

    def allowed(node: str, strategy: Strategy) -> bool:
        if split_batch and node in inputs and not strategy.outputs[0][0].is_shard(0):
            return False
        return seed(node, strategy)

    request = MeshRequest(captured, cluster, mesh, precision, optimizer, float("inf"))
    res = solve_mesh(request, LAYOUT_TIME_LIMIT_S, allowed=allowed)
    if not res.placements:
        where = {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}
        raise PlanError(f"no {kind} layout found for {captured.model_name} on mesh {where}")
    return res.placements
