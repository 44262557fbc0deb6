"""The order in which the pipeline search costs its meshes before anything was previewed.

Costing a pipeline mesh takes seconds at scale and a time limit reaches only some of
them, so the meshes most likely to be fastest go first: those whose stages hold their
parameter states with room to spare (:data:`ROOMY_STATES`), then by tensor-parallel size.
Once meshes are costed, :class:`autopar.search.pipeline.preview.Preview` takes over.
"""

from __future__ import annotations

import math

from autopar.capture.joint import CapturedGraph
from autopar.cost_models.memory import Precision, model_state_bytes
from autopar.hardware.cluster import MeshShape

ROOMY_STATES = 0.5
"""Pipeline meshes whose stages hold their parameters, gradients and ZeRO-1 optimizer state in
at most this share of the memory limit are costed first: the others need ZeRO-3 or heavy
recompute to fit, and are rarely the fastest (LLaMA-3-405B on 16,384 H100s: fewest stages
first spent the search's time on pp = 2 and 4, which fit only that way, and returned dp 512 x
tp 8 x pp 4 at 15.8 s a step against 7.4 s for Meta's pp = 16 layout)."""


def pipeline_order(
    captured: CapturedGraph, prec: Precision, optimizer: str, limit: float, meshes: list[MeshShape], tp_ref: int
) -> list[MeshShape]:
    """Pipeline meshes in the order the search costs them when nothing was previewed.

    Those whose stages hold their states in ``ROOMY_STATES`` of the limit first, then by
    tensor-parallel size nearest ``tp_ref``, fewest stages, smallest tp.
    """

    def key(m: MeshShape) -> tuple:
        cramped = stage_states(captured, prec, optimizer, m) > ROOMY_STATES * limit
        return (cramped, abs(math.log2(m.tp / tp_ref)), m.pp, m.tp)

    return sorted(meshes, key=key)


def stage_states(captured, prec, optimizer: str, mesh: MeshShape) -> float:
    """Per-device bytes of a stage's parameter states on ``mesh`` with tp sharding them all and ZeRO-1 over dp."""
    return _states(captured, prec, optimizer, mesh.pp * mesh.tp, zero=1, dp=mesh.dp)


def total_state_bytes(captured: CapturedGraph, prec: Precision, optimizer: str) -> float:
    """The model's parameters, gradients and optimizer state in bytes, unsharded: past a node's memory,
    the planner searches pipelines first (Megatron-LM keeps tensor parallelism inside a node, pipelines across)."""
    return _states(captured, prec, optimizer, 1, zero=0, dp=1)


def _states(captured: CapturedGraph, prec: Precision, optimizer: str, split: int, zero: int, dp: int) -> float:
    """Bytes of parameters, gradients and optimizer state per device: the model's parameters split ``split``
    ways, and ZeRO stage ``zero`` over ``dp`` ranks."""
    states = model_state_bytes(sum(math.prod(p.shape) for p in captured.params) / split, prec, optimizer, zero, dp)
    return states.params + states.grads + states.optimizer
