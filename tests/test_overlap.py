"""Tensor-parallel collectives overlapped with GEMMs, as Megatron-Core's runtime does: the estimate's exposure.

autopar's own runtime keeps tensor-parallel collectives on the critical path;
the calibration costs Megatron-Core's published runs with the runtime they ran
(:mod:`autopar.cost_models.overlap`). These tests hold the formula, and that a
tensor-parallel plan's estimate under the overlapping runtime hides no more
than its tensor-parallel collectives and no less than the formula says, on the
flat path and on the pipeline path. One process; the model lives on the meta device.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_models import overlap
from autopar.search.recost import estimate_plan
from examples.models import gpt


@pytest.fixture
def overlapping():
    """Estimates made inside describe a runtime that overlaps tensor-parallel collectives."""
    overlap.RUNTIME = overlap.Runtime(tp_comm_overlap=True)
    yield
    overlap.RUNTIME = overlap.AUTOPAR_RUNTIME


def test_exposed_part_of_tensor_parallel_collectives():
    assert overlap.tp_exposed(3.0, 10.0, 8) == 3.0  # autopar's runtime: all of it
    overlap.RUNTIME = overlap.Runtime(tp_comm_overlap=True)
    try:
        assert overlap.tp_exposed(3.0, 10.0, 8) == pytest.approx(3.0 / 8)  # one chunk of the eight
        assert overlap.tp_exposed(12.0, 10.0, 8) == pytest.approx(2.0)  # what outlasts the GEMMs
        assert overlap.tp_exposed(3.0, 10.0, 1) == 3.0  # no tensor parallelism, nothing to pipeline
    finally:
        overlap.RUNTIME = overlap.AUTOPAR_RUNTIME


@pytest.fixture(scope="module")
def tp_plan():
    model, inputs = gpt(2, 1024, 16, vocab=8192, seq=1024)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    plan = autopar.plan(
        model, inputs, cluster, global_batch_size=8, fixed={"dp": 1, "tp": 8, "zero": 0, "microbatches": 1}
    )
    return plan, model, inputs


def test_overlap_hides_only_tensor_parallel_collectives(tp_plan, overlapping):
    plan, model, inputs = tp_plan
    overlap.RUNTIME = overlap.AUTOPAR_RUNTIME
    serial = estimate_plan(plan, model, inputs)
    overlap.RUNTIME = overlap.Runtime(tp_comm_overlap=True)
    hidden = estimate_plan(plan, model, inputs)
    assert serial.exposed_comm_s > 0
    saved = serial.step_time_s - hidden.step_time_s
    # something hidden, and at most 7/8 of what was exposed: one chunk of every tp collective stays, and so
    # do the gradient reductions (already under the backward) and everything off the tp axis
    assert 0 < saved <= serial.exposed_comm_s * 7 / 8 * 1.0001
    assert hidden.compute_s == serial.compute_s and hidden.comm_s == pytest.approx(serial.comm_s)


def test_overlap_on_the_pipeline_path(overlapping):
    model, inputs = gpt(4, 1024, 16, vocab=8192, seq=1024)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    fixed = {"dp": 1, "tp": 4, "pp": 2, "zero": 0, "microbatches": 4, "schedule": "1F1B"}
    hidden = autopar.plan(model, inputs, cluster, global_batch_size=8, fixed=fixed)
    overlap.RUNTIME = overlap.AUTOPAR_RUNTIME
    serial = autopar.plan(model, inputs, cluster, global_batch_size=8, fixed=fixed)
    # overlap only lowers a layout's step, and the search takes the least: strictly less, since the
    # tensor-parallel layouts move activations over tp
    assert hidden.estimate.step_time_s < serial.estimate.step_time_s * (1 - 1e-3)


def test_gradients_accumulated_in_place_are_held_once():
    """Megatron-Core adds each micro-batch's gradients into one fp32 buffer as the backward makes them; autopar's
    runtime returns them beside the running sum. Under the first the gradients at the peak are the rank's
    fp32 gradients once; under the second twice (this micro-batch's and the sum), all else alike."""
    model, inputs = gpt(2, 512, 8, vocab=4096, seq=256)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    fixed = {"dp": 4, "tp": 2, "zero": 1, "recompute": "none", "microbatches": 4}  # tp: the per-op path
    held = {}
    for in_place in (False, True):
        overlap.RUNTIME = overlap.Runtime(grads_accumulate_in_place=in_place)
        try:
            plan = autopar.plan(model, inputs, cluster, global_batch_size=32, fixed=fixed)
        finally:
            overlap.RUNTIME = overlap.AUTOPAR_RUNTIME
        held[in_place] = plan.estimate.memory
    params = sum(p.numel() for p in model.parameters())
    assert held[True].grads == held[False].grads > 2 * params / 2  # fp32 gradients, as much of them on a rank
    assert held[True].at_peak["grads"] == pytest.approx(held[True].grads)
    assert held[False].at_peak["grads"] == pytest.approx(2 * held[False].grads)
    # the peak falls, by at most the copy no longer held (it may move to where activations are live)
    assert 0 < held[False].peak - held[True].peak <= held[True].grads * 1.0001
