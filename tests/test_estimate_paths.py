"""One layout, one step time: the analytic data-parallel model, the sharding MILP and ``estimate_plan`` agree.

A plan's step time must not depend on which path of the planner costed it, or
the planner's choice between paths (and between meshes costed by different
paths) would follow the paths' differences rather than the layouts'. Data
parallelism with each ZeRO stage is the layout all three can cost: the
analytic model by formula (:mod:`autopar.cost_models.step`), the MILP as the
solution of its problem restricted to that layout, ``estimate_plan`` as the
placements read back and costed again. One process; the model lives on the
meta device.
"""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.cost_models.graph_cache import captured_with_stats
from autopar.cost_models.memory import precision_spec
from autopar.search.recost import estimate_plan
from autopar.search.sharding.mesh import solve_mesh
from autopar.search.sharding.request import MeshRequest
from examples.models import gpt

GBS = 32


@pytest.fixture(scope="module")
def setup():
    model, inputs = gpt(2, 2048, 16, vocab=8192, seq=1024)  # wide enough that its GEMMs dominate, as in training
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    return model, inputs, cluster


def _layout(captured, zero: int):
    """Data parallelism at ``zero``: every parameter whole on every rank (ZeRO 0-2) or split over dp (3)."""
    params = {p.placeholder for p in captured.params}
    inputs = {i.placeholder for i in captured.inputs}

    def allowed(node: str, s) -> bool:
        out = s.outputs[0]
        if node in inputs:
            return out[0].is_shard(0) and out[1].is_replicate()
        if node not in params:
            return True
        if zero == 3:
            return out[0].is_shard() and out[1].is_replicate()
        return all(p.is_replicate() for p in out) and s.zero == zero

    return allowed


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_layout_costs_the_same_on_every_path(setup, zero):
    model, inputs, cluster = setup
    n = cluster.world_size
    analytic = autopar.plan(
        model, inputs, cluster, global_batch_size=GBS, fixed={"dp": n, "tp": 1, "zero": zero, "microbatches": 1}
    )
    assert analytic.solver.status.startswith("optimal (exhaustive)")  # the analytic path costed it
    captured, _ = captured_with_stats(model, inputs, batch=GBS)
    mesh = cluster.check_mesh(dp=n, tp=1, pp=1)
    allowed = _layout(captured, zero)
    res = solve_mesh(MeshRequest(captured, cluster, mesh, precision_spec("bf16-mixed"), "adamw", float("inf")), 30.0, allowed)
    sp, choice = res.sp, res.solution.choice
    assert all(allowed(sp.nodes[i], sp.strategies[i][c]) for i, c in enumerate(choice))  # the layout asked for
    placed = dataclasses.replace(analytic, placements=res.placements)
    again = estimate_plan(placed, model, inputs)
    steps = {"analytic": analytic.estimate.step_time_s, "milp": res.estimate.step_time_s, "recost": again.step_time_s}
    assert steps["recost"] == pytest.approx(steps["milp"], rel=1e-9), steps
    assert steps["milp"] == pytest.approx(steps["analytic"], rel=0.01), steps
    assert again.optimizer_s == pytest.approx(analytic.estimate.optimizer_s, rel=0.01)
