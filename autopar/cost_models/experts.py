"""Expert parallelism's cost: the all-to-alls that move tokens to their experts and back, and imbalance.

Stated assumption: routing is uniform, each token's ``k`` choices are ``k`` distinct experts
drawn alike, so a rank of an ``ep``-way group sends ``(ep - 1) / ep`` of its pairs' rows away
and gets as many back: one all-to-all of the pairs' bytes each way.  The step waits for the
busiest rank of the group, whose all-to-all bytes and experts' FLOPs are those of the most
pairs any rank receives.  ``autopar::experts`` is dropless, as Megatron-Core's MoE is by
default (``TransformerConfig.moe_expert_capacity_factor``: "None means no token will be
dropped. The default is None"; its inputs are padded to a capacity only when one is set) and
as torchtitan's is (``MoEArgs`` in torchtitan/models/moe/moe.py has no capacity): the busiest
rank receives what routing sends it, not a capacity.  Under
uniform routing that is a statistical quantity (:func:`busiest_rank_share`): with ``T``
tokens a rank, ``E`` experts, ``k`` choices, the pairs a rank's ``E / ep`` experts receive
have mean ``T k`` and variance ``T k (1 - 1/ep) (E - k) / (E - 1)`` (a hypergeometric draw per
token), and the busiest of ``ep`` such counts (summing to a constant) exceeds the mean by
``e_ep sqrt(T k (E - k) / (E - 1))`` in expectation, ``e_ep`` the expected maximum of ``ep``
standard normals: 1.005 times the mean for Mixtral-8x7B at 8 sequences of 4,096 tokens a rank
over ep 8.  The 1.25 GShard and the Switch Transformer train with is a capacity (as is
DeepSpeed-MoE's, whose ``MoE`` layer defaults to ``capacity_factor=1.0, drop_tokens=True``):
the experts compute on buffers padded to that many times the mean whatever the routing, and
tokens past it are dropped.  ``autopar.plan(capacity_factor=...)`` charges such a figure instead
(a router that pads, or an imbalance measured on real routing, which the uniform assumption
does not see); routing stays dropless whatever it is.

``autopar::experts`` moves its rows twice in the forward (dispatch, combine) and
four times in its backward (it recomputes the forward's two, then sends the
gradients to the experts and back).
"""

from __future__ import annotations

import functools
import math

from autopar.cost_models.comm import collective_time
from autopar.hardware.cluster import Link

CAPACITY_FACTOR = None  # the default of ``autopar.plan(capacity_factor=...)``: the expected busiest rank
FORWARD_ALL_TO_ALLS = 2
BACKWARD_ALL_TO_ALLS = 4


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0 for one; 1.4236 for eight), by quadrature."""
    if n <= 1:
        return 0.0
    step, total = 1e-3, 0.0
    for i in range(-9000, 9001):  # x n phi(x) Phi(x)^(n-1) over [-9, 9]
        x = i * step
        phi = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * phi * cdf ** (n - 1)
    return total * step


def busiest_rank_share(tokens: float, k: int, experts: int, ep: int) -> float:
    """The expected pairs of the busiest of ``ep`` ranks over the mean, under uniform dropless routing.

    ``tokens`` a rank's tokens at once, each choosing ``k`` of ``experts`` distinct experts, ``experts / ep``
    of them on each rank.  Normal approximation of the counts; at most ``ep`` (every pair on one rank).
    """
    if ep <= 1 or tokens <= 0 or experts <= k:
        return 1.0
    spread = math.sqrt((experts - k) / ((experts - 1) * tokens * k))
    return min(1.0 + expected_max_normal(ep) * spread, float(ep))


def all_to_all_seconds(pair_bytes: float, ep: int, link: Link, backward: bool, capacity_factor: float) -> float:
    """Seconds of the op's all-to-alls on one rank: ``pair_bytes`` the rows of its (token, choice) pairs,
    the busiest rank's ``capacity_factor`` times them."""
    if capacity_factor < 1:
        raise ValueError(f"capacity_factor {capacity_factor} is below 1: the busiest rank gets at least the mean")
    count = BACKWARD_ALL_TO_ALLS if backward else FORWARD_ALL_TO_ALLS
    return count * collective_time("all_to_all", pair_bytes * capacity_factor, ep, link)
