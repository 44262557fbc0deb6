"""ZeRO stages chosen by the sharding MILP: per parameter, as the memory limit tightens."""

from __future__ import annotations

import pytest

import autopar
from autopar.core.placements import REPLICATE as R
from examples.models import gpt2_tiny


@pytest.fixture(scope="module")
def tiny():
    model, batch = gpt2_tiny()
    return model, batch, autopar.Cluster.local(4)


def _stages(plan: autopar.Plan) -> dict[str, int]:
    """Each parameter's stage: 3 when its placement shards it over dp, else its placement's ``zero``."""
    return {
        e["param"]: 3 if e["outputs"][0][0] != R else e["zero"]
        for e in plan.placements.values()
        if "param" in e
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fixed_stage_sets_every_parameter_and_the_memory_breakdown(tiny, stage):
    model, batch, cluster = tiny
    plan = autopar.plan(model, batch, cluster, precision="fp32", fixed={"dp": 4, "zero": stage})
    assert plan.zero == stage and set(_stages(plan).values()) == {stage}
    mem, n = plan.estimate.memory, plan.num_params
    assert mem.params == pytest.approx(4 * n / (4 if stage == 3 else 1))
    assert mem.grads == pytest.approx(4 * n / (4 if stage >= 2 else 1))
    # AdamW's two fp32 moments; under ZeRO-1/2 in fp32 also the chunk of the parameter the optimizer steps
    assert mem.optimizer == pytest.approx((8 + 4 * (stage in (1, 2))) * n / (4 if stage >= 1 else 1))
    at = mem.at_peak  # params and optimizer state whole, the gradients made by the peak, activations, buffers
    assert at["params"] == mem.params and at["optimizer"] == mem.optimizer and at["grads"] <= mem.grads
    assert (at["activations"], at["buffers"]) == (mem.activations, mem.buffers) and mem.activations > 0
    assert mem.peak == pytest.approx(sum(at.values())) and mem.peak_at


def test_search_walks_through_zero_stages_to_an_infeasibility_message(tiny):
    model, batch, cluster = tiny
    roomy = autopar.plan(model, batch, cluster, precision="fp32", fixed={"dp": 4})
    assert set(_stages(roomy).values()) == {0} or roomy.estimate.memory.optimizer < 8 * roomy.num_params
    need = roomy.estimate.memory.peak
    seen, last_time = set(), roomy.estimate.step_time_s
    for fraction in (0.7, 0.4):
        plan = autopar.plan(
            model, batch, cluster, precision="fp32", fixed={"dp": 4}, memory_limit=need * fraction
        )
        assert plan.estimate.fits and plan.estimate.memory.peak <= need * fraction * (1 + 1e-6)
        assert plan.estimate.step_time_s >= last_time * (1 - 1e-9)  # memory is bought with time
        last_time = plan.estimate.step_time_s
        seen |= set(_stages(plan).values())
    assert seen & {1, 2, 3}  # the tight plans shard model states over dp
    with pytest.raises(autopar.PlanError) as err:
        autopar.plan(model, batch, cluster, precision="fp32", memory_limit=need * 0.05)
    msg = str(err.value)
    assert "the smallest memory that would fit is" in msg and "\n" not in msg
    number, unit = msg.split("would fit is ")[1].split(":")[0].split()
    smallest = float(number) * {"KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    assert need * 0.05 < smallest < need * 0.4  # what the 0.4 plan fitted in, at most


def test_nothing_fits_names_the_proven_least_memory_only_when_it_is_over_the_limit():
    """The MILP's memory rows leave out the buffers of values being moved, so their bound on the least peak
    can sit under a limit no answer fits (a tiny ResNet: 47.6 KB against 70 KB): then the message names the
    least memory an answer found needs, or nothing, never the bound as what would fit."""
    from types import SimpleNamespace

    from autopar.api.flat_plan import least_need

    def result(choice, peak, bound):
        return SimpleNamespace(
            solution=SimpleNamespace(choice=choice, stats=SimpleNamespace(min_peak_memory=bound)),
            estimate=SimpleNamespace(memory=SimpleNamespace(peak=peak)),
        )

    over = [result([], None, 2e6), result([], None, 3e6)]
    assert least_need(over, 1e6) == "the smallest memory that would fit is 2 MB"
    under = [result([], None, 47.6e3), result([0], 190e3, None)]
    assert least_need(under, 70e3) == "the least any plan found needs is 190 KB"
    assert least_need([result([], None, 47.6e3)], 70e3) == ""
