"""A hand-set layout as placements on one mesh: the seed's parameter placements, the rest of the graph solved.

A seed (:mod:`autopar.search.sharding.seeds`) restricts only the parameters'
placements; :func:`layout_placements` solves every other node under that
restriction, with no memory limit, on the graph it is given.  Plans of the
analytic data-parallel path carry the dp (or zero3) layout's placements made
this way (:func:`autopar.api.data_parallel.data_parallel_placements`), and the
correctness oracle runs the layouts as plans (:mod:`autopar.verify.oracle`).
Where the layout leaves nothing to choose (one device: one strategy per node),
the placements are read off the strategies without building the problem
(:func:`forced_placements`): the same answer, without the seconds a large
model's build and solve take.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.capture.joint import CapturedGraph
from autopar.core.errors import PlanError
from autopar.core.mesh import SHARDING_AXES
from autopar.cost_models.memory import Precision
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.search.sharding.answer import placements_of
from autopar.search.sharding.batch_dims import scaled_dims
from autopar.search.sharding.filters import keyed, node_key
from autopar.search.sharding.mesh import solve_mesh
from autopar.search.sharding.node_strategies import NodeStrategies, Strategy
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.seeds import layout_filter
from autopar.search.sharding.strategies import enumerate_strategies

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
    batch_activations: bool = False,
) -> dict[str, dict]:
    """Placements of a hand-set layout ("dp", "zero3", "megatron") on a dp × tp ``mesh``, the rest solved.

    ``split_batch`` also splits every input by batch over the data-parallel
    axis, as DDP and FSDP do, even where the cost model would rather not (save
    where the layout splits the sequence over that axis: "cp_dp").
    ``batch_activations`` keeps every activation that carries the batch (its
    leading dim a multiple of the batch) from being replicated over the
    data-parallel axis, as DDP and FSDP run: without it a ZeRO-3 layout may
    compute a small layer whole on every rank with its weights left sharded,
    moving activations instead of weights, which the analytic data-parallel
    model that costs such a plan does not count.
    """
    inputs = {i.placeholder for i in captured.inputs}
    seed = layout_filter(kind, captured, (mesh.dp, mesh.tp))
    batched = _batch_carrying(captured) if batch_activations else set()

    def allowed(node: str, strategy: Strategy) -> bool:
        if split_batch and node in inputs and not kind.startswith("cp_dp") and not strategy.outputs[0][0].is_shard(0):
            return False
        if node in batched and strategy.outputs[0][0].is_replicate():
            return False
        return seed(node, strategy)

    seed_key = node_key(seed)
    allowed = keyed(allowed, lambda node: (node in inputs, node in batched, seed_key(node)))
    request = MeshRequest(captured, cluster, mesh, precision, optimizer, float("inf"))
    strategies = enumerate_strategies(captured.gm, request.shape, SHARDING_AXES, balance_masks=kind.endswith("_balanced"))
    forced = forced_placements(captured, strategies, allowed)
    if forced is not None:
        return forced
    res = solve_mesh(request, LAYOUT_TIME_LIMIT_S, allowed=allowed, strategies=strategies)
    if not res.placements:
        where = {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}
        raise PlanError(f"no {kind} layout found for {captured.model_name} on mesh {where}")
    return res.placements


def _batch_carrying(captured: CapturedGraph) -> set[str]:
    """Forward and backward ops whose (first) output's dim 0 scales with the batch: the activations.

    Which dims scale is read off a second capture where the graph has one (:func:`scaled_dims`); without
    one, a dim 0 that is a multiple of the batch is taken to. The guess alone held a position embedding's
    (T, H) rows at a micro-batch of 2 (T = 16) to be split over dp: its readers were then laid out
    Megatron's way over the dp ranks (a LoRA fine-tune's frozen MLP, column- then row-parallel), where the
    analytic model that costs the layout counts data parallelism.
    """
    batch = captured.batch_size
    scaled = scaled_dims(captured)
    params = {p.placeholder for p in captured.params}
    out = set()
    for node in captured.gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or node.name in params or not hasattr(val, "shape") or val.dim() == 0:
            continue
        dims = scaled.get(node.name) if scaled is not None else None
        if dims is not None and dims[0] is not None:
            carries = dims[0][0]
        else:
            lead = int(val.shape[0])
            carries = batch > 1 and lead >= batch and lead % batch == 0
        if carries:
            out.add(node.name)
    return out


def forced_placements(
    captured: CapturedGraph, strategies: dict[str, NodeStrategies], allowed: Callable[[str, Strategy], bool]
) -> dict[str, dict] | None:
    """The placements when every node has one strategy and the layout allows it (one device); None otherwise.

    Then the sharding problem has one answer and no memory limit to miss, so solving
    it would return exactly these: on one device every placement is replicated, and
    building and solving the problem of a large model would cost seconds for nothing.
    """
    nodes, chosen = [], []
    for node in captured.gm.graph.nodes:  # the problem's nodes, in its order
        ns = strategies.get(node.name)
        if ns is None or not ns.strategies:
            continue
        if len(ns.strategies) != 1 or not allowed(node.name, ns.strategies[0]):
            return None
        nodes.append(node.name)
        chosen.append(ns.strategies[0])
    return placements_of(captured, nodes, chosen, dp_dim=0)
