"""Collective timing against hand-computed ring formulas."""

from __future__ import annotations

import math

import pytest

from autopar.cost_models import comm
from autopar.cost_models.comm import (
    COLLECTIVES,
    axis_collective_time,
    bucket_count,
    bucketed_time,
    bus_bytes,
    collective_time,
    latency,
    share_of_bucket,
)
from autopar.hardware.cluster import Cluster, Link

NVLINK = Link(bandwidth=450e9, latency_s=3e-6, name="nvlink", intra_node=True)
IB = Link(bandwidth=50e9, latency_s=8e-6, name="infiniband", intra_node=False)


def test_all_reduce_1gb_8_gpus_nvlink():
    t = collective_time("all_reduce", 1e9, 8, NVLINK)
    expected = 2 * 7 / 8 * 1e9 / 450e9 + 14 * 3e-6
    assert t == pytest.approx(expected, rel=1e-12)
    assert t == pytest.approx(3.931e-3, rel=1e-3)  # about 3.9 ms


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_half_ring_collectives(kind):
    # 16 ranks over InfiniBand, 2 GB full buffer: 15/16 * 2e9 / 50e9 + 15 * 8 us
    t = collective_time(kind, 2e9, 16, IB)
    assert t == pytest.approx(15 / 16 * 2e9 / 50e9 + 15 * 8e-6, rel=1e-12)
    assert t == pytest.approx(0.03762, rel=1e-4)


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    for n in (2, 4, 8, 64):
        ar = collective_time("all_reduce", 3e8, n, IB)
        rs = collective_time("reduce_scatter", 3e8, n, IB)
        ag = collective_time("all_gather", 3e8, n, IB)
        assert ar == pytest.approx(rs + ag, rel=1e-12)


def test_send_recv_and_broadcast():
    assert collective_time("send_recv", 1e8, 2, IB) == pytest.approx(8e-6 + 1e8 / 50e9)
    assert collective_time("broadcast", 1e8, 8, NVLINK) == pytest.approx(7 * 3e-6 + 1e8 / 450e9)


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_trivial_cases_cost_nothing(kind):
    assert collective_time(kind, 1e9, 1, NVLINK) == 0
    assert collective_time(kind, 0, 8, NVLINK) == 0
    assert bus_bytes(kind, 1e9, 1) == 0


def test_local_link_is_free_and_infinite_link_has_only_latency():
    c = Cluster.preset("dgx-h100", nodes=1)
    m = c.check_mesh(tp=8)
    assert axis_collective_time("all_reduce", 1e9, c, m, "dp") == 0
    inf = Link(bandwidth=math.inf, latency_s=1e-6, name="x", intra_node=True)
    assert collective_time("all_gather", 1e9, 4, inf) == pytest.approx(3e-6)


def test_bus_bytes():
    assert bus_bytes("all_reduce", 8e9, 8) == pytest.approx(14e9)
    assert bus_bytes("all_gather", 8e9, 8) == pytest.approx(7e9)
    assert bus_bytes("reduce_scatter", 8e9, 8) == pytest.approx(7e9)
    assert bus_bytes("all_to_all", 8e9, 8) == pytest.approx(7e9)
    assert bus_bytes("broadcast", 8e9, 8) == 8e9
    assert bus_bytes("send_recv", 8e9, 2) == 8e9


def test_efficiency_divides_bandwidth(monkeypatch):
    base = collective_time("all_gather", 1e9, 8, Link(450e9, 0.0, "nvlink", True))
    assert collective_time(
        "all_gather", 1e9, 8, Link(450e9, 0.0, "nvlink", True), efficiency=0.5
    ) == pytest.approx(2 * base)
    monkeypatch.setattr(comm, "LINK_EFFICIENCY", 0.8)
    assert collective_time("all_gather", 1e9, 8, Link(450e9, 0.0, "nvlink", True)) == pytest.approx(
        base / 0.8
    )
    with pytest.raises(ValueError, match="efficiency"):
        collective_time("all_gather", 1e9, 8, NVLINK, efficiency=0)


def test_bad_arguments():
    with pytest.raises(ValueError) as err:
        collective_time("allreduce", 1e9, 8, NVLINK)
    for kind in COLLECTIVES:
        assert kind in str(err.value)
    with pytest.raises(ValueError, match="n"):
        collective_time("all_reduce", 1e9, 0, NVLINK)
    with pytest.raises(ValueError, match="nbytes"):
        collective_time("all_reduce", -1, 8, NVLINK)
    with pytest.raises(ValueError):
        bus_bytes("gather", 1, 2)


def test_axis_collective_time_uses_the_axis_link():
    c = Cluster.preset("dgx-h100", nodes=8)
    m = c.check_mesh(tp=8)  # dp=8, one rank per node
    tp = axis_collective_time("all_reduce", 1e9, c, m, "tp")
    dp = axis_collective_time("all_reduce", 1e9, c, m, "dp")
    # NCCL's latency model: 8.4 us once, then a hop at 3.4 us over NVLink, at 14 us over the network (every
    # hop of dp, one rank a node), a ring all-reduce across nodes charged 1.4 times its hops
    assert tp == pytest.approx(2 * 7 / 8 * 1e9 / 450e9 + 8.4e-6 + 14 * 3.4e-6)
    assert dp == pytest.approx(2 * 7 / 8 * 1e9 / 50e9 + 8.4e-6 + 1.4 * 14 * 14e-6)


def test_symbolic_size_stays_symbolic():
    sympy = pytest.importorskip("sympy")
    b = sympy.Symbol("b", positive=True)
    t = collective_time("all_gather", 4 * b, 4, NVLINK)
    assert float(t.subs(b, 1e9)) == pytest.approx(collective_time("all_gather", 4e9, 4, NVLINK))
    free = Link(bandwidth=math.inf, latency_s=0.0, name="local", intra_node=True)
    assert collective_time("all_gather", b, 4, free) == 0


def test_a_group_with_several_ranks_a_node_runs_one_ring_per_nic():
    """dp 16 over two DGX H100 nodes (8 ranks a node) reaches 8 NICs' bandwidth, capped by NVLink; dp over
    one rank a node (tp 8 inside) reaches one NIC's; a point-to-point send always one NIC's."""
    c = Cluster.preset("dgx-h100", nodes=2)
    flat = c.axis_link(c.check_mesh(dp=16), "dp")
    strided = c.axis_link(c.check_mesh(dp=2, tp=8), "dp")
    assert comm.ring_bandwidth("all_reduce", flat) == min(8 * 50e9, 450e9)
    assert comm.ring_bandwidth("reduce_scatter", strided) == 50e9
    assert comm.ring_bandwidth("send_recv", flat) == 50e9
    # the same bytes on 16 ranks over two nodes cost little more than on 8 inside one, far less than one NIC's
    inside = collective_time("all_gather", 1e9, 8, c.intra_node_link)
    across = collective_time("all_gather", 1e9, 16, flat)
    assert inside < across < 1.5 * inside


def test_a_tensor_larger_than_a_bucket_is_sent_whole():
    """Small tensors share buckets; one at least a bucket large is one collective (DDP gives it a bucket of its
    own, the runtime sends every gradient whole), so its latency is paid once, not once per bucket's worth."""
    cap = 25e6
    assert bucket_count([10e6] * 5, cap) == 2
    assert bucket_count([1.9e9], cap) == 1
    assert bucket_count([1.9e9, 0.9e9, 10e6, 10e6], cap) == 3
    assert bucket_count([10e6, 30e6], cap, weights=[5.0, 2.0]) == 4  # a folded layer's tensors, counted 5 and 2 times
    t, pieces = bucketed_time("reduce_scatter", [1.9e9], 64, IB, cap)
    assert pieces == 1 and t == pytest.approx(collective_time("reduce_scatter", 1.9e9, 64, IB))
    assert bucketed_time("all_reduce", [1.9e9], 1, IB, cap) == (0.0, 0)


def test_the_milp_share_of_buckets_sums_to_the_bucketed_time():
    """Each gradient's edge in the MILP costs its share (linear in its bytes); over a model's tensors the sum is
    the estimate's bucketed time to within one bucket's latency."""
    cap = 25e6
    sizes = [1.9e9, 0.9e9, 30e6] + [3e6] * 40 + [64e3] * 100
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        shares = sum(share_of_bucket(kind, s, 64, IB, cap) for s in sizes)
        whole = bucketed_time(kind, sizes, 64, IB, cap)[0]
        assert abs(shares - whole) <= latency(kind, 64, IB) + 1e-12
        assert share_of_bucket(kind, 1.9e9, 64, IB, cap) == collective_time(kind, 1.9e9, 64, IB)
