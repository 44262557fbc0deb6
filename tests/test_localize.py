"""Tests for autopar.verify.localize: the nodes whose values a plan computes unlike one device."""

from __future__ import annotations

import pytest

import autopar
from autopar.capture.joint import capture
from autopar.core.errors import PlanError
from autopar.core.placements import REPLICATE as R
from autopar.core.placements import shard as S
from autopar.verify.localize import differences
from autopar.verify.oracle import factory_layout_plan
from examples import families

pytest.importorskip("transformers")


def test_the_first_difference_is_the_node_the_plan_runs_wrong() -> None:
    """Mamba-2's chunked scan (``cumsum`` over its last dim) run split along that dim, as DTensor's scan rule
    once allowed: each rank scans its half alone. The nodes before it agree with one device; it is the first
    that does not, named with the placements it ran in. The plan as drawn (a flowing layout, its masks'
    infinities included) computes every value one device does."""
    make = families.FAMILIES["mamba2"]
    two = autopar.Cluster.local(2)
    plan = factory_layout_plan(make, two, 1, 2, "flowing")
    model, inputs = make()
    graph = capture(model, inputs).gm.graph
    scan = next(
        n for n in graph.nodes
        if str(n.target) == "aten.cumsum.default" and n.args[1] == -1 and n.meta["val"].shape[-1] % 2 == 0
    )
    assert differences(make, two, plan) == []
    dim = scan.meta["val"].dim() - 1
    plan.placements[scan.name] = {**plan.placements[scan.name], "inputs": [(R, S(dim))], "outputs": [(R, S(dim))]}
    found = differences(make, two, plan)
    assert found, "a scan run on halves of its dim computes other values"
    assert found[0].node == scan.name and found[0].strategy == f"(R, S({dim})) -> (R, S({dim}))", str(found[0])
    assert found[0].error > 1e-2 * found[0].scale


def test_a_plan_for_another_cluster_is_refused_in_one_line() -> None:
    make = families.FAMILIES["mamba2"]
    plan = factory_layout_plan(make, autopar.Cluster.local(2), 1, 2, "flowing")
    with pytest.raises(PlanError, match="the plan is for 2 devices but the cluster has 4"):
        differences(make, autopar.Cluster.local(4), plan)
