"""Expert parallelism's cost: the all-to-alls that move tokens to their experts and back, and imbalance.

Stated assumption: routing is uniform, each of a rank's (token, choice) pairs
picks any expert alike, so a rank of an ``ep``-way group sends ``(ep - 1) / ep``
of its pairs' rows away and gets as many back: one all-to-all of the pairs'
bytes each way.  Real routers are not uniform: the busiest rank receives
``capacity_factor`` times the mean (1.25, the capacity factor GShard and the
Switch Transformer train with, unless the user sets another), and the step
waits for it: its all-to-all bytes and its experts' FLOPs are scaled by it.
Dropless routing drops nothing: the factor is a cost, never a limit.

``autopar::experts`` moves its rows twice in the forward (dispatch, combine) and
four times in its backward (it recomputes the forward's two, then sends the
gradients to the experts and back).
"""

from __future__ import annotations

from autopar.cost_models.comm import collective_time
from autopar.hardware.cluster import Link

CAPACITY_FACTOR = 1.25  # the default of ``autopar.plan(capacity_factor=...)`` and CapturedGraph
FORWARD_ALL_TO_ALLS = 2
BACKWARD_ALL_TO_ALLS = 4


def all_to_all_seconds(
    pair_bytes: float, ep: int, link: Link, backward: bool, capacity_factor: float = CAPACITY_FACTOR
) -> float:
    """Seconds of the op's all-to-alls on one rank: ``pair_bytes`` the rows of its (token, choice) pairs."""
    if capacity_factor < 1:
        raise ValueError(f"capacity_factor {capacity_factor} is below 1: the busiest rank gets at least the mean")
    count = BACKWARD_ALL_TO_ALLS if backward else FORWARD_ALL_TO_ALLS
    return count * collective_time("all_to_all", pair_bytes * capacity_factor, ep, link)
