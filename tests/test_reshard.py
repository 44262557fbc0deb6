"""Redistribution costs: which collective each placement change needs, and its time."""

import math

import pytest

from autopar.cluster import Cluster, MeshShape
from autopar.cost_models.comm import collective_time
from autopar.cost_models.reshard import collectives_between, redistribute_time, shard_factor

CLUSTER = Cluster.preset("dgx-h100", nodes=2)
MESH = MeshShape(dp=2, tp=8, pp=1)
SHAPE = (2, 8)
LINKS = [CLUSTER.axis_link(MESH, "dp"), CLUSTER.axis_link(MESH, "tp")]


def test_shard_factor():
    assert shard_factor(("S(0)", "S(1)"), SHAPE) == 16
    assert shard_factor(("R", "S(1)"), SHAPE) == 8
    assert shard_factor(("P", "R"), SHAPE) == 1


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        (("R", "R"), ("R", "S(1)"), []),
        (("R", "P"), ("R", "R"), [("all_reduce", 1, 1e9)]),
        (("R", "P"), ("R", "S(0)"), [("reduce_scatter", 1, 1e9)]),
        (("S(0)", "S(1)"), ("S(0)", "R"), [("all_gather", 1, 0.5e9)]),
        (("R", "S(0)"), ("R", "S(1)"), [("all_to_all", 1, 1e9 / 8)]),
        (("P", "P"), ("R", "R"), [("all_reduce", 0, 1e9), ("all_reduce", 1, 1e9)]),
    ],
)
def test_collectives_between(src, dst, expected):
    assert collectives_between(src, dst, 1e9, SHAPE) == expected


def test_forbidden_and_times():
    assert collectives_between(("S(0)", "R"), ("P", "R"), 1e9, SHAPE) is None
    assert redistribute_time(("S(0)", "R"), ("P", "R"), 1e9, SHAPE, LINKS) == math.inf
    # tp stays inside a node (NVLink); dp crosses nodes (InfiniBand): the same all-reduce is slower on dp
    t_tp = redistribute_time(("R", "P"), ("R", "R"), 1e9, SHAPE, LINKS)
    assert t_tp == pytest.approx(collective_time("all_reduce", 1e9, 8, LINKS[1]))
    t_dp = redistribute_time(("P", "R"), ("R", "R"), 1e9, SHAPE, LINKS)
    assert t_dp > t_tp * 2


def test_nested_shards_follow_dtensor():
    """Two mesh dims sharding one tensor dim: the outer one cannot change while the inner one holds its shard."""
    # (R, S(1)) -> (S(1), S(1)): the tp shard a rank holds changes, so tp gathers first
    assert collectives_between(("R", "S(1)"), ("S(1)", "S(1)"), 1024.0, (2, 2)) == [("all_gather", 1, 1024.0)]
    # (S(2), S(2)) -> (R, S(2)): gather tp, then dp, then slice tp again
    assert collectives_between(("S(2)", "S(2)"), ("R", "S(2)"), 1024.0, (2, 2)) == [
        ("all_gather", 1, 512.0),
        ("all_gather", 0, 1024.0),
    ]
    # different tensor dims stay independent: one gather on the dim that changes, local to the other
    assert collectives_between(("S(0)", "S(1)"), ("R", "S(1)"), 1024.0, (2, 2)) == [("all_gather", 0, 512.0)]
