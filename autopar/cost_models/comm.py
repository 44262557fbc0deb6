"""Time of a collective on one mesh axis, from ring formulas (REFERENCES.md).

Analytic rather than profiled because plans are made for clusters the user
may not have. Ring algorithms are what NCCL uses for large messages, which
dominate a training step; tree / NVLS algorithms win on small messages and
large n, and their gap is left to ``efficiency`` (calibrated later against
published measurements) rather than modelled here.

Conventions, shared by every function below:

- ``nbytes`` for all_gather and reduce_scatter is the FULL buffer (the
  gathered output / the unsharded input), so the same number costs both
  halves of a sharded step; for all_reduce and all_to_all it is the buffer
  each rank holds; for broadcast and send_recv the buffer sent.
- ``n`` is the number of ranks in the group; n == 1 costs nothing.
- ``link.bandwidth`` is bytes/s per GPU per direction; ``efficiency``
  (default ``LINK_EFFICIENCY``) multiplies it: the fraction of the line rate
  NCCL's bus bandwidth reaches on large messages, calibrated by
  ``benchmarks/calibrate.py``.
- A group across nodes with several ranks in a node runs one ring per NIC
  (:func:`ring_bandwidth`): a DGX node has one NIC per GPU.
- Gradients and ZeRO's gathers go in buckets (:func:`bucketed_time`): the
  latency term is paid per bucket, not per small tensor; a tensor larger than
  a bucket is one collective.

Nothing here compares ``nbytes`` with a number unless it is one, so a sympy
expression for the size passes through and the time stays symbolic.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from typing import Any

from autopar.hardware.cluster import Cluster, Link, MeshShape

logger = logging.getLogger(__name__)

LINK_EFFICIENCY = 1.0
"""Fraction of the link's line rate a collective's bus bandwidth reaches; read at call time. benchmarks/
calibrate.py fits it at its cap, 1.0: with NCCL's latency model (:func:`latency`) the line rate is what NCCL's
own tuning model assumes for large ring collectives."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


def _check(kind: str, nbytes: Any, n: int) -> None:
    """Reject unknown kinds and impossible sizes early: a silent 0 would make the solver pick them."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; use one of {', '.join(COLLECTIVES)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"group size n must be a positive integer, got {n!r}; pass the mesh axis size")
    if isinstance(nbytes, numbers.Real) and nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}; pass the buffer size in bytes")


def _is_zero(x: Any) -> bool:
    return isinstance(x, numbers.Real) and x == 0


def latency_hops(kind: str, n: int) -> int:
    """Number of sequential α-latency steps of ``kind`` on a ring of ``n`` ranks.

    all_reduce is a reduce-scatter then an all-gather, 2(n-1) steps; the
    other ring collectives take n-1; a point-to-point send takes 1.
    """
    _check(kind, 0, n)
    if n == 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "send_recv":
        return 1
    return n - 1


def bus_bytes(kind: str, nbytes: Any, n: int) -> Any:
    """Bytes each rank sends (the busiest rank, for broadcast) under the conventions above.

    This is the numerator of the bandwidth term: time = latency + bus_bytes / bw.
    """
    _check(kind, nbytes, n)
    if n == 1:
        return 0
    if kind == "all_reduce":
        return nbytes * (2 * (n - 1) / n)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return nbytes * ((n - 1) / n)
    # broadcast (pipelined ring: every rank but the last forwards the whole buffer) and send_recv.
    return nbytes


def collective_time(
    kind: str,
    nbytes: Any,
    n: int,
    link: Link,
    efficiency: float | None = None,
) -> Any:
    """Seconds for one ``kind`` collective of ``nbytes`` over ``n`` ranks on ``link``.

    - all_reduce: 2(n-1)·α + 2(n-1)/n·B/bw
    - all_gather, reduce_scatter, all_to_all: (n-1)·α + (n-1)/n·B/bw
      (α per hop and once per collective as NCCL's model has them: :func:`latency`)
    - broadcast: (n-1)·α + B/bw (pipelined ring: the buffer is cut into
      chunks that stream down the ring, so the pipe fills in n-1 hops and
      then moves B at link speed)
    - send_recv: α + B/bw
    - n == 1 or nbytes == 0: 0 (no collective is issued)
    """
    _check(kind, nbytes, n)
    eff = LINK_EFFICIENCY if efficiency is None else efficiency
    if isinstance(eff, bool) or not isinstance(eff, numbers.Real) or not eff > 0:
        raise ValueError(f"efficiency must be a positive number, got {eff!r}; pass e.g. 0.8")
    if n == 1 or _is_zero(nbytes):
        return 0.0
    # Multiply by 1/bw (0 for an infinite link) rather than divide, so a symbolic size stays finite.
    per_byte = 1.0 / (ring_bandwidth(kind, link) * eff)
    return latency(kind, n, link) + bus_bytes(kind, nbytes, n) * per_byte


RINGS_PER_NIC_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def ring_bandwidth(kind: str, link: Link) -> float:
    """Bytes/s per GPU a ``kind`` collective's bus bandwidth reaches on ``link``, before ``LINK_EFFICIENCY``.

    A ring across nodes crosses the network once a node and direction; with
    ``link.ranks_per_node`` = k of the group's ranks in each node, NCCL builds
    one ring (channel) per NIC, each carrying 1/k of the buffer through its
    own GPU's NIC, while every GPU's NVLink carries its share of all k rings:
    the bus bandwidth is k times a GPU's NIC, up to the NVLink hops
    (NCCL's tuning model, ``src/graph/tuning.cc``: ``busBw = nChannels · bw``).
    A DGX node has one NIC per GPU, which the per-GPU inter-node bandwidth is.
    A point-to-point send uses one NIC; an all-to-all sends each GPU's part
    for other nodes through its own NIC: both at ``link.bandwidth``.
    """
    if link.intra_bandwidth is None or link.ranks_per_node <= 1 or kind not in RINGS_PER_NIC_KINDS:
        return link.bandwidth
    return min(link.ranks_per_node * link.bandwidth, link.intra_bandwidth)


def latency(kind: str, n: int, link: Link) -> float:
    """Seconds of latency of one ``kind`` collective over ``n`` ranks on ``link``, as NCCL's tuning model counts it.

    Once the collective's base, then each ring hop at its own link's latency: a group
    across nodes with ``link.ranks_per_node`` ranks a node crosses the network
    ``nodes − 1`` times a pass (twice that for an all-reduce), the other hops staying
    inside a node; NCCL charges a ring all-reduce across nodes 1.4 times that (its
    "plateau effect of ring", src/graph/tuning.cc, for compute capability 8.0 and up).
    """
    hops = latency_hops(kind, n)
    if link.intra_latency_s is None:
        return link.base_latency_s + hops * link.latency_s
    nodes = -(-n // max(link.ranks_per_node, 1))
    crossings = min(hops, (nodes - 1) * (2 if kind == "all_reduce" else 1) if kind != "send_recv" else 1)
    hop_time = crossings * link.latency_s + (hops - crossings) * link.intra_latency_s
    return link.base_latency_s + hop_time * (1.4 if kind == "all_reduce" and nodes > 1 else 1.0)


def bucket_count(sizes: Sequence[float], bucket_bytes: float, weights: Sequence[float] | None = None) -> float:
    """How many collectives send tensors of ``sizes`` bytes in buckets of ``bucket_bytes``.

    Tensors are packed into a bucket until it holds ``bucket_bytes``, and a tensor
    at least that large is sent whole, never cut: DDP gives it a bucket of its own
    (``_compute_bucket_assignment_by_size``), Megatron-Core's gradient buffer closes
    a bucket on it, FSDP reduces a unit's flat parameter at once, and autopar's
    runtime sends every gradient in one collective. Counted without the order:
    one collective per large tensor, the small ones' bytes in full buckets.
    ``weights``: how many tensors each size stands for (a folded layer's).
    """
    ws = weights if weights is not None else [1.0] * len(sizes)
    large = sum(w for s, w in zip(sizes, ws, strict=True) if s >= bucket_bytes)
    small = sum(s * w for s, w in zip(sizes, ws, strict=True) if s < bucket_bytes)
    return large + (math.ceil(small / bucket_bytes - 1e-9) if small > 0 else 0)


def bucketed_time(
    kind: str,
    sizes: Sequence[float],
    n: int,
    link: Link,
    bucket_bytes: float,
    weights: Sequence[float] | None = None,
) -> tuple[float, float]:
    """(seconds, collectives) of tensors of ``sizes`` bytes of ``kind`` sent in buckets (:func:`bucket_count`).

    Gradient reduction and ZeRO's gathers are issued in buckets (DDP's
    ``bucket_cap_mb``, FSDP's flat parameters), not one collective per small tensor
    nor one for the whole model: the latency term is paid once per bucket. Every path
    that costs them (the analytic data-parallel model, the sharding MILP's
    estimate) calls this, so the same bytes cost the same seconds.
    """
    ws = weights if weights is not None else [1.0] * len(sizes)
    nbytes = sum(s * w for s, w in zip(sizes, ws, strict=True))
    if n == 1 or _is_zero(nbytes):
        return 0.0, 0
    pieces = max(1.0, bucket_count(sizes, bucket_bytes, ws))
    return pieces * collective_time(kind, nbytes / pieces, n, link), pieces


def share_of_bucket(kind: str, nbytes: float, n: int, link: Link, bucket_bytes: float) -> float:
    """One tensor's part of :func:`bucketed_time`, linear in its bytes as an edge of the MILP must be.

    A tensor smaller than a bucket pays its share of a full bucket's collective; a
    larger one is a collective of its own. Summed over the tensors, this is
    :func:`bucketed_time` to within one bucket's latency.
    """
    if nbytes >= bucket_bytes:
        return collective_time(kind, nbytes, n, link)
    return collective_time(kind, bucket_bytes, n, link) * nbytes / bucket_bytes


def axis_collective_time(
    kind: str,
    nbytes: Any,
    cluster: Cluster,
    mesh: MeshShape,
    axis: str,
    efficiency: float | None = None,
) -> Any:
    """:func:`collective_time` on a mesh axis: group size and link come from the cluster's layout."""
    return collective_time(kind, nbytes, mesh.axis_size(axis), cluster.axis_link(mesh, axis), efficiency)
