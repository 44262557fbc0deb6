"""The cost model's verdict on one configuration: step time, utilization and memory per device.

Plain data every path builds (the data-parallel model, the per-op search, the pipeline
search, re-costing a plan) and a :class:`~autopar.plans.plan.Plan` carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MemoryEstimate:
    """Bytes per device, by category. ``peak`` is what must fit in the device."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0  # communication buckets, gathered ZeRO-3 parameters, backward workspace
    peak: float = 0.0
    # what is live at the peak (params, optimizer, grads made so far, activations, buffers), and where it is
    at_peak: dict[str, float] = field(default_factory=dict)
    peak_at: str = ""

    @property
    def model_states(self) -> float:
        """Parameters + gradients + optimizer state: what the ZeRO paper counts."""
        return self.params + self.grads + self.optimizer


@dataclass
class Estimate:
    """The cost model's verdict on one configuration (per step, per device)."""

    step_time_s: float = 0.0
    samples_per_s: float = 0.0
    mfu: float = 0.0  # model FLOPs utilization: model_flops / (step time x devices x peak FLOP/s)
    hfu: float = 0.0  # hardware FLOPs utilization: the same with hardware_flops (recompute included)
    memory: MemoryEstimate = field(default_factory=MemoryEstimate)
    memory_limit: float = 0.0
    fits: bool = True
    compute_s: float = 0.0  # forward + backward compute, all micro-batches
    comm_s: float = 0.0  # total communication time (overlapped or not)
    exposed_comm_s: float = 0.0  # the part of comm_s that compute does not hide
    optimizer_s: float = 0.0
    recompute_s: float = 0.0  # the forward ops run again in the backward (part of compute_s)
    bubble_s: float = 0.0
    model_flops: float = 0.0  # per step, whole cluster, without recompute
    hardware_flops: float = 0.0  # per step, whole cluster, the forward ops recomputed included
    collectives: list[dict[str, Any]] = field(
        default_factory=list
    )  # {"kind", "axis", "bytes", "count", "time_s"}

    @property
    def hfu_differs(self) -> bool:
        """Whether HFU says more than MFU: the plan runs forward ops again, which MFU does not count."""
        return self.hfu > self.mfu * (1 + 1e-6)
