"""Cost a plan as it stands: the estimate of the placements it holds, none of them searched.

A plan's own estimate is the search's (:mod:`autopar.search.sharding.problem`).
A plan edited by hand — recompute marks added (``"full"`` on whole layers
through :func:`autopar.search.sharding.recompute.with_recompute`), a layout swapped in,
another micro-batch count — keeps an estimate that is no longer its own.
:func:`estimate_plan` costs it with the same cost model, on the graph the
runtime runs: the captured graph with the plan's recompute marks carried out
(:func:`autopar.search.sharding.recompute.apply_recompute`: replayed ops are backward
ops, their originals die after the forward), each node at the strategy its
placement names.  The search costs a fixed recompute setting on that graph
too (:mod:`autopar.search.sharding.recompute_settings`), so a plan re-costed as it
stands gets its own estimate back.
"""

from __future__ import annotations

import logging
from typing import Any

from autopar.core.errors import PlanError
from autopar.core.mesh import SHARDING_AXES
from autopar.cost_models.estimate import Estimate
from autopar.cost_models.graph_cache import captured_with_stats
from autopar.cost_models.memory import precision_spec
from autopar.hardware.cluster import Cluster
from autopar.plans.plan import Plan
from autopar.search.sharding.answer import evaluate
from autopar.search.sharding.balanced_shards import holds_balanced
from autopar.search.sharding.derived import with_microbatches
from autopar.search.sharding.instance import ShardingProblem
from autopar.search.sharding.problem import build_problem
from autopar.search.sharding.recompute import apply_recompute
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.strategies import enumerate_strategies
from autopar.solver import Solution

log = logging.getLogger(__name__)


def chosen_strategies(sp: ShardingProblem, placements: dict[str, dict[str, Any]], zero: int) -> list[int]:
    """The index, per problem node, of the strategy whose placements (and ZeRO stage) the plan names.

    ``zero`` is the plan's stage, which a dp-replicated parameter without its own
    ``"zero"`` takes when it is 1 or 2 (as the runtime does).  A node the plan does
    not place, or places in no strategy it has, is a PlanError naming it.
    """
    params = set(sp.param_nodes)
    default = zero if zero in (1, 2) else 0
    choice = []
    for i, name in enumerate(sp.nodes):
        entry = placements.get(name)
        if entry is None:
            raise PlanError(f"the plan places no {name!r}: it was made for a different graph; plan again")
        stage = int(entry.get("zero", default) or 0) if i in params else 0
        for k, s in enumerate(sp.strategies[i]):
            if (
                list(s.outputs) == entry["outputs"]
                and list(s.inputs) == entry["inputs"]
                and (i not in params or s.zero == (stage if s.outputs[0][sp.dp_dim or 0].is_replicate() else 0))
                and not s.recompute
            ):
                choice.append(k)
                break
        else:
            raise PlanError(f"{name}: the plan's placement {entry['outputs']} is none of the op's strategies")
    return choice


def estimate_plan(
    plan: Plan, model, example_inputs, *, loss_fn=None, example_targets=None
) -> Estimate:
    """The estimate of ``plan`` as it stands (see the module docstring), for its cluster, precision and batch.

    ``model`` and ``example_inputs`` are the ones it was planned for (shapes are
    enough: the model may be on the meta device).
    """
    if not plan.placements:
        raise PlanError("the plan has no per-op placements to cost; plan it with a cluster of several devices")
    if plan.mesh.get("pp", 1) != 1:
        raise PlanError("estimate_plan costs dp x tp plans; this one has pipeline stages")
    cluster = Cluster.from_dict(plan.cluster)
    precision = precision_spec(plan.precision, plan.reduce_dtype)
    captured, _ = captured_with_stats(
        model, example_inputs, loss_fn, example_targets, batch=plan.global_batch_size
    )
    captured, placements = apply_recompute(captured, plan.placements)
    mesh = cluster.check_mesh(dp=plan.mesh["dp"], tp=plan.mesh.get("tp", 1), pp=1)
    request = MeshRequest(captured, cluster, mesh, precision, plan.optimizer)  # no limit: costed as it is
    shape, links = request.shape, request.links
    strategies = enumerate_strategies(
        captured.gm, shape, SHARDING_AXES, balance_masks=holds_balanced(placements), batch=captured.batch_size
    )
    sp = build_problem(request, strategies)
    sp = with_microbatches(sp, max(plan.microbatches, 1))
    choice = chosen_strategies(sp, placements, plan.zero)
    limit = plan.estimate.memory_limit or float(cluster.memory_bytes)
    costs = sp.problem.node_costs
    solution = Solution(choice, sum(costs[i][c] for i, c in enumerate(choice)), "given", 0.0, 0.0, "none")
    est = evaluate(
        sp, solution, shape, cluster, plan.global_batch_size, limit, links, precision.compute_dtype
    )
    log.info("plan re-costed: step %.4g s, peak %.4g bytes", est.step_time_s, est.memory.peak)
    return est
