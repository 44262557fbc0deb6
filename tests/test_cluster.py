"""Cluster, device table, presets, mesh shapes and axis links."""

from __future__ import annotations

import json
import math

import pytest

from autopar.core.errors import ClusterError
from autopar.cost_models.comm import latency
from autopar.hardware.cluster import (
    DEVICES,
    PRESETS,
    Cluster,
    DeviceSpec,
    MeshShape,
    get_device,
)


def _ordered_factorizations_3(n: int) -> int:
    """Brute-force count of ordered triples (a, b, c) with a·b·c == n."""
    return sum(1 for a in range(1, n + 1) for b in range(1, n + 1) if n % (a * b) == 0)


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize(
    "name, bf16, fp32, tf32, mem, hbm, nvlink, ib",
    [
        ("V100-32GB", 125e12, 15.7e12, 15.7e12, 32e9, 0.9e12, 150e9, 12.5e9),
        ("A100-40GB", 312e12, 19.5e12, 156e12, 40e9, 1.6e12, 300e9, 25e9),
        ("A100-80GB", 312e12, 19.5e12, 156e12, 80e9, 2.0e12, 300e9, 25e9),
        ("H100-80GB", 989e12, 67e12, 494e12, 80e9, 3.35e12, 450e9, 50e9),
        ("H200-141GB", 989e12, 67e12, 494e12, 141e9, 4.8e12, 450e9, 50e9),
        ("B200", 2250e12, 80e12, 1100e12, 180e9, 8e12, 900e9, 50e9),
    ],
)
def test_device_figures(name, bf16, fp32, tf32, mem, hbm, nvlink, ib):
    d = DEVICES[name]
    assert d.name == name
    assert d.peak_flops["bf16"] == bf16
    assert d.peak_flops["fp16"] == bf16
    assert d.peak_flops["fp32"] == fp32
    assert d.peak_flops["tf32"] == tf32
    assert d.memory_bytes == mem
    assert isinstance(d.memory_bytes, int)
    assert d.hbm_bandwidth == hbm
    assert d.intra_node_bandwidth == nvlink
    assert d.inter_node_bandwidth == ib
    # a ring hop's latency in NCCL's tuning model (Simple protocol): NVLink 3.4 us, network 14 us
    assert d.intra_node_latency_s == pytest.approx(3.4e-6)
    assert d.inter_node_latency_s == pytest.approx(14e-6)
    assert d.source


def test_cpu_device_is_nominal():
    d = DEVICES["cpu"]
    assert d.peak_flops["fp32"] == 1e11
    assert d.intra_node_bandwidth == 10e9
    assert d.memory_bytes == 16e9
    assert "nominal" in d.source


@pytest.mark.parametrize(
    "alias, canonical",
    [
        ("h100", "H100-80GB"),
        ("H100", "H100-80GB"),
        ("h100-80gb", "H100-80GB"),
        ("a100", "A100-80GB"),
        ("A100-40GB", "A100-40GB"),
        ("a100-40gb", "A100-40GB"),
        ("a100_80gb", "A100-80GB"),
        ("v100", "V100-32GB"),
        ("h200", "H200-141GB"),
        ("b200", "B200"),
        ("CPU", "cpu"),
    ],
)
def test_device_aliases(alias, canonical):
    assert get_device(alias).name == canonical
    assert Cluster(device=alias).device == canonical


def test_unknown_device_lists_known():
    with pytest.raises(ClusterError) as err:
        get_device("tpu-v5")
    msg = str(err.value)
    assert "tpu-v5" in msg
    for name in DEVICES:
        assert name in msg
    with pytest.raises(ClusterError):
        Cluster(device="mi300x")


def test_flops_dtype_names():
    d = DEVICES["H100-80GB"]
    assert d.flops("bf16") == d.flops("bfloat16") == d.flops("torch.bfloat16") == 989e12
    assert d.flops("torch.float32") == 67e12
    with pytest.raises(ClusterError, match="fp8"):
        d.flops("fp8")


def test_device_spec_validation():
    good = DEVICES["A100-80GB"].to_dict()
    assert DeviceSpec.from_dict(good) == DEVICES["A100-80GB"]
    with pytest.raises(ClusterError, match="tf32"):
        DeviceSpec.from_dict({**good, "peak_flops": {"bf16": 1.0, "fp16": 1.0, "fp32": 1.0}})
    with pytest.raises(ClusterError, match="memory_bytes"):
        DeviceSpec.from_dict({**good, "memory_bytes": 0})
    with pytest.raises(ClusterError, match="malformed"):
        DeviceSpec.from_dict({"name": "x"})


# ---------------------------------------------------------------- clusters


@pytest.mark.parametrize(
    "preset, device",
    [
        ("dgx-v100", "V100-32GB"),
        ("dgx-a100", "A100-80GB"),
        ("dgx-a100-40gb", "A100-40GB"),
        ("dgx-h100", "H100-80GB"),
        ("dgx-h200", "H200-141GB"),
        ("h200", "H200-141GB"),
        ("dgx-b200", "B200"),
        ("b200", "B200"),
        ("DGX-H100", "H100-80GB"),
    ],
)
def test_presets(preset, device):
    c = Cluster.preset(preset, nodes=2)
    spec = DEVICES[device]
    assert c.device == device
    assert c.device_spec == spec
    assert c.nodes == 2 and c.gpus_per_node == 8 and c.world_size == 16
    assert c.intra_node_bandwidth == spec.intra_node_bandwidth
    assert c.inter_node_bandwidth == spec.inter_node_bandwidth
    assert c.memory_bytes == spec.memory_bytes
    assert c.backend == "nccl"


def test_unknown_preset_lists_known():
    with pytest.raises(ClusterError) as err:
        Cluster.preset("dgx-z9000")
    msg = str(err.value)
    assert "dgx-z9000" in msg
    for name in PRESETS:
        assert name in msg


def test_defaults_and_overrides():
    c = Cluster(nodes=2, gpus_per_node=8, device="A100-80GB")
    assert c.world_size == 16
    assert c.intra_node_bandwidth == 300e9 and c.inter_node_bandwidth == 25e9
    assert c.memory_bytes == 80_000_000_000
    c2 = Cluster(nodes=2, device="a100", inter_node_bandwidth=12.5e9, memory_bytes=60_000_000_000)
    assert c2.inter_node_bandwidth == 12.5e9 and c2.memory_bytes == 60_000_000_000
    assert c2.intra_node_bandwidth == 300e9
    assert Cluster() == Cluster(nodes=1, gpus_per_node=8, device="a100")


def test_local():
    c = Cluster.local(4)
    assert c.device == "cpu" and c.backend == "gloo"
    assert c.nodes == 1 and c.gpus_per_node == 4 and c.world_size == 4
    link = c.axis_link(c.check_mesh(), "dp")
    assert link.name == "gloo" and link.bandwidth == 10e9
    assert Cluster(device="cpu").backend == "gloo"


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"nodes": 0}, "nodes"),
        ({"nodes": 1.5}, "nodes"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"nodes": True}, "nodes"),
        ({"intra_node_bandwidth": 0}, "intra_node_bandwidth"),
        ({"inter_node_bandwidth": -5.0}, "inter_node_bandwidth"),
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"backend": "mpi"}, "backend"),
        ({"device": "cpu", "backend": "nccl"}, "gloo"),
    ],
)
def test_validation(kwargs, word):
    with pytest.raises(ClusterError, match=word):
        Cluster(**kwargs)


def test_describe():
    assert (
        Cluster.preset("dgx-h100", nodes=8).describe()
        == "8 nodes x 8 H100-80GB (64 devices), NVLink 450 GB/s in a node, 50 GB/s between"
    )
    assert (
        Cluster.preset("dgx-a100").describe() == "1 node x 8 A100-80GB (8 devices), NVLink 300 GB/s in a node"
    )
    assert "gloo" in Cluster.local(2).describe()


@pytest.mark.parametrize(
    "cluster",
    [
        Cluster.preset("dgx-h100", nodes=8),
        Cluster(
            nodes=3, gpus_per_node=4, device="v100", inter_node_bandwidth=6.25e9, memory_bytes=16_000_000_000
        ),
        Cluster.local(3),
        Cluster(nodes=2, device=DeviceSpec.from_dict({**DEVICES["H100-80GB"].to_dict(), "name": "my-gpu"})),
    ],
)
def test_dict_round_trip(cluster):
    d = cluster.to_dict()
    back = Cluster.from_dict(json.loads(json.dumps(d)))
    assert back == cluster
    assert back.to_dict() == d
    assert back.device_spec == cluster.device_spec


def test_from_dict_rejects_unknown_keys():
    d = Cluster().to_dict()
    with pytest.raises(ClusterError, match="gpus"):
        Cluster.from_dict({**d, "gpus": 8})


# ---------------------------------------------------------------- meshes


@pytest.mark.parametrize("world", [1, 6, 8, 12, 64, 1024])
def test_mesh_enumeration_count(world):
    c = Cluster(nodes=1, gpus_per_node=world)
    shapes = c.mesh_shapes()
    assert len(shapes) == _ordered_factorizations_3(world)
    assert len(set(shapes)) == len(shapes)
    assert all(s.size == world for s in shapes)


def test_mesh_enumeration_64_and_bounds():
    c = Cluster.preset("dgx-h100", nodes=8)
    assert len(c.mesh_shapes()) == 28  # 2^6 into 3 ordered factors: C(8, 2)
    bounded = c.mesh_shapes(max_tp=8, max_pp=4)
    assert all(s.tp <= 8 and s.pp <= 4 for s in bounded)
    assert len(bounded) == sum(1 for s in c.mesh_shapes() if s.tp <= 8 and s.pp <= 4)
    assert MeshShape(dp=64, tp=1, pp=1) in bounded


def test_check_mesh():
    c = Cluster.preset("dgx-h100", nodes=8)
    assert c.check_mesh() == MeshShape(64, 1, 1)
    assert c.check_mesh(tp=8, pp=2) == MeshShape(4, 8, 2)
    assert c.check_mesh(dp=8, tp=8, pp=1).size == 64
    with pytest.raises(ClusterError) as err:
        c.check_mesh(dp=3)
    assert str(err.value) == (
        "mesh dp=3 x tp=1 x pp=1 = 3 devices does not match the cluster's 64 devices; "
        "choose sizes whose product is 64"
    )
    with pytest.raises(ClusterError, match="divide"):
        c.check_mesh(tp=3)
    with pytest.raises(ClusterError, match="tp"):
        c.check_mesh(tp=0)


def test_mesh_shape_strides():
    m = MeshShape(dp=4, tp=8, pp=2)
    assert (m.stride("tp"), m.stride("dp"), m.stride("pp")) == (1, 8, 32)
    assert m.axis_size("dp") == 4
    with pytest.raises(ClusterError, match="axis"):
        m.stride("sp")
    with pytest.raises(ClusterError):
        MeshShape(dp=0, tp=1, pp=1)


# ---------------------------------------------------------------- axis links


def test_axis_links_dgx_h100():
    c = Cluster.preset("dgx-h100", nodes=8)
    m = c.check_mesh(tp=8)  # dp=8 across nodes
    tp = c.axis_link(m, "tp")
    assert tp.name == "nvlink" and tp.intra_node and tp.bandwidth == 450e9 and tp.latency_s == 3.4e-6
    assert tp.base_latency_s == 8.4e-6 and tp.intra_latency_s is None  # NCCL's once-a-collective latency
    dp = c.axis_link(m, "dp")
    assert dp.name == "infiniband" and not dp.intra_node and dp.bandwidth == 50e9 and dp.latency_s == 14e-6
    assert dp.ranks_per_node == 1  # one rank of each dp group per node: every hop crosses the network
    pp = c.axis_link(m, "pp")
    assert pp.bandwidth == math.inf and pp.latency_s == 0
    # dp over all 64 GPUs (tp 1): 8 ranks a node, 7 of a pass's 63 hops cross the network
    flat = c.axis_link(c.check_mesh(dp=64), "dp")
    assert flat.ranks_per_node == 8 and flat.intra_latency_s == 3.4e-6
    assert latency("all_gather", 64, flat) == pytest.approx(8.4e-6 + 7 * 14e-6 + 56 * 3.4e-6)
    assert latency("all_reduce", 64, flat) == pytest.approx(8.4e-6 + 1.4 * (14 * 14e-6 + 112 * 3.4e-6))

    m16 = c.check_mesh(tp=16)
    assert c.axis_link(m16, "tp").name == "infiniband"


def test_axis_links_layout():
    c = Cluster.preset("dgx-h100", nodes=8)
    # tp=2, dp=4 share a node (stride 2, 4 ranks = 8 GPUs); pp=8 crosses nodes.
    m = c.check_mesh(tp=2, dp=4, pp=8)
    assert c.axis_link(m, "tp").intra_node
    assert c.axis_link(m, "dp").intra_node
    assert not c.axis_link(m, "pp").intra_node
    # tp=4, dp=4: dp stride 4 spans 16 ranks, two nodes.
    m = c.check_mesh(tp=4, dp=4, pp=4)
    assert c.axis_link(m, "tp").intra_node
    assert not c.axis_link(m, "dp").intra_node
    # tp=8, pp=8: pp stride 8 puts each stage on its own node.
    m = c.check_mesh(tp=8, pp=8)
    assert c.axis_link(m, "pp").name == "infiniband"
    assert c.axis_link(m, "dp").bandwidth == math.inf


def test_axis_link_non_power_of_two():
    # 3 nodes x 4 GPUs: tp=3 groups {0,1,2}, {3,4,5} straddle node 0/1.
    c = Cluster(nodes=3, gpus_per_node=4, device="a100")
    m = c.check_mesh(tp=3)
    assert not c.axis_within_node(m, "tp")
    assert c.axis_within_node(c.check_mesh(tp=2), "tp")
    assert c.axis_within_node(c.check_mesh(tp=4), "tp")
    assert not c.axis_within_node(c.check_mesh(tp=6), "tp")


def test_axis_link_single_node_and_overrides():
    c = Cluster(nodes=1, gpus_per_node=8, device="h100", intra_node_bandwidth=400e9)
    for mesh in c.mesh_shapes():
        for axis in ("dp", "tp", "pp"):
            link = c.axis_link(mesh, axis)
            assert link.intra_node
            if mesh.axis_size(axis) > 1:
                assert link.bandwidth == 400e9


def test_axis_link_wrong_mesh():
    c = Cluster.preset("dgx-h100", nodes=8)
    with pytest.raises(ClusterError, match="64"):
        c.axis_link(MeshShape(dp=8, tp=1, pp=1), "dp")
