"""The buffers at an answer's peak, made memory items, let the MILP see that answer's exact peak.

A buffer on an edge (a value redistributed, a gradient reduced in flight) depends on the strategies of
both its ends, which the MILP's memory rows do not see; :func:`peak_items` puts it on one end at the
most it holds under any strategy of the other, so that the answer that peaked over a limit is seen there
by the solve that follows (:func:`autopar.search.sharding.mesh_solve._fit_exactly`).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from autopar import Cluster
from autopar.capture.joint import capture
from autopar.cost_models.memory import precision_spec
from autopar.search.sharding.mesh_solve import prepare_mesh
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.step_memory import edge_buffers, gradient_buffers, peak_items, step_memory
from autopar.solver import solve_strategies
from autopar.solver.evaluate import peak_memory_of
from examples.models import llama_tiny


@pytest.fixture(scope="module")
def tiny_mesh():
    """Tiny LLaMA (its shipped config) at one sequence a rank on dp 2 x tp 2, in fp32 with AdamW."""
    model, inputs = llama_tiny()
    captured = capture(model, {k: v[:2] for k, v in inputs.items()})
    cluster = Cluster.local(4)
    mesh = cluster.check_mesh(dp=2, tp=2, pp=1)
    return prepare_mesh(MeshRequest(captured, cluster, mesh, precision_spec("fp32"), "adamw", float("inf"))).sp


def _answers(sp, count: int) -> list[list[int]]:
    """The unlimited optimum and random answers (each node a strategy it allows)."""
    rng = random.Random(0)
    p = sp.problem
    allowed = [[j for j, c in enumerate(row) if c < float("inf")] or [0] for row in p.node_costs]
    out = [solve_strategies(p, time_limit_s=2).choice]
    out += [[rng.choice(a) for a in allowed] for _ in range(count)]
    return out


def test_an_answers_peak_items_make_its_seen_peak_at_least_its_exact_peak(tiny_mesh) -> None:
    sp = tiny_mesh
    shape = (2, 2)
    checked = 0
    for choice in _answers(sp, 12):
        exact = step_memory(sp, choice, shape).peak
        seen = peak_memory_of(sp.problem, choice)
        items = peak_items(sp, sp.problem, choice, shape)
        buffers = [*edge_buffers(sp, choice, shape), *gradient_buffers(sp, choice, shape)]
        assert sum(b[2] for b in buffers) > 0  # every answer here redistributes something
        if exact > seen:  # buffers at the peak: the rows alone miss them
            assert items
            checked += 1
        with_items = replace(sp.problem, memory_items=[*(sp.problem.memory_items or []), *items])
        assert peak_memory_of(with_items, choice) >= exact * (1 - 1e-9)
    assert checked >= 3  # the random answers hold buffers at their peaks
