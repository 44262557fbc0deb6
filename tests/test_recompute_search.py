"""Recompute chosen by the sharding MILP: op by op, only where memory asks for it."""

from __future__ import annotations

import pytest

import autopar
from autopar.capture import capture, node_phase
from autopar.passes.recompute import apply_recompute, can_recompute
from examples.models import gpt2_tiny


@pytest.fixture(scope="module")
def tiny():
    model, batch = gpt2_tiny()
    cluster = autopar.Cluster.local(2)
    fixed = {"dp": 2, "zero": 0}
    roomy = autopar.plan(model, batch, cluster, precision="fp32", fixed=fixed)
    return model, batch, cluster, fixed, roomy


def _marked(plan: autopar.Plan) -> list[str]:
    return [n for n, e in plan.placements.items() if "recompute" in e]


def test_nothing_is_recomputed_when_memory_is_plenty(tiny):
    *_, roomy = tiny
    assert roomy.recompute == "none" and not _marked(roomy) and roomy.estimate.recompute_s == 0


def test_tight_memory_recomputes_forward_ops_and_pays_for_them_in_time(tiny):
    model, batch, cluster, fixed, roomy = tiny
    limit = 0.85 * roomy.estimate.memory.peak
    plan = autopar.plan(model, batch, cluster, precision="fp32", fixed=fixed, memory_limit=limit)
    assert plan.estimate.fits and plan.estimate.memory.peak <= limit * (1 + 1e-6)
    assert plan.microbatches == 1  # recompute, not gradient accumulation, made it fit
    assert plan.recompute == "selective" and _marked(plan)
    assert plan.estimate.memory.activations < roomy.estimate.memory.activations
    assert plan.estimate.memory.model_states == pytest.approx(roomy.estimate.memory.model_states)
    assert 0 < plan.estimate.recompute_s < plan.estimate.compute_s
    assert plan.estimate.step_time_s > roomy.estimate.step_time_s
    # every mark is on a forward op that can be replayed, and the runtime's pass takes them all
    captured = capture(model, batch)
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    assert all(node_phase(nodes[n]) == "forward" and can_recompute(nodes[n]) for n in _marked(plan))
    rewritten, placements = apply_recompute(captured, plan.placements)
    assert any(n.name.endswith("_recompute") for n in rewritten.gm.graph.nodes)
    assert "recompute" in plan.summary()


def test_fixed_none_keeps_every_activation(tiny):
    model, batch, cluster, fixed, roomy = tiny
    limit = 0.8 * roomy.estimate.memory.peak
    plan = autopar.plan(
        model, batch, cluster, precision="fp32", fixed={**fixed, "recompute": "none"}, memory_limit=limit
    )
    assert not _marked(plan) and plan.recompute == "none"
    assert plan.microbatches > 1 or not plan.estimate.fits  # accumulation, or over the limit with a warning
    with pytest.raises(autopar.PlanError, match="fix 'none'"):
        autopar.plan(model, batch, cluster, fixed={"recompute": "full"})
