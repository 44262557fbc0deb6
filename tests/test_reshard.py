"""Redistribution costs: which collective each placement change needs, and its time."""

import itertools
import math
from collections import Counter

import pytest

from autopar.core.placements import AVG, partial, to_dtensor_all
from autopar.core.placements import PARTIAL as P
from autopar.core.placements import REPLICATE as R
from autopar.core.placements import shard as S
from autopar.cost_models.comm import collective_time
from autopar.cost_models.reshard import collectives_between, redistribute_time, shard_factor
from autopar.hardware.cluster import Cluster, MeshShape

P_AVG = partial(AVG)
CLUSTER = Cluster.preset("dgx-h100", nodes=2)
MESH = MeshShape(dp=2, tp=8, pp=1)
SHAPE = (2, 8)
LINKS = [CLUSTER.axis_link(MESH, "dp"), CLUSTER.axis_link(MESH, "tp")]


def test_shard_factor():
    assert shard_factor((S(0), S(1)), SHAPE) == 16
    assert shard_factor((R, S(1)), SHAPE) == 8
    assert shard_factor((P, R), SHAPE) == 1


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        ((R, R), (R, S(1)), []),
        ((R, P), (R, R), [("all_reduce", 1, 1e9)]),
        ((R, P), (R, S(0)), [("reduce_scatter", 1, 1e9)]),
        ((S(0), S(1)), (S(0), R), [("all_gather", 1, 0.5e9)]),
        ((R, S(0)), (R, S(1)), [("all_to_all", 1, 1e9 / 8)]),
        ((P, P), (R, R), [("all_reduce", 0, 1e9), ("all_reduce", 1, 1e9)]),
    ],
)
def test_collectives_between(src, dst, expected):
    assert collectives_between(src, dst, 1e9, SHAPE) == expected


def test_forbidden_and_times():
    assert collectives_between((S(0), R), (P, R), 1e9, SHAPE) is None
    assert redistribute_time((S(0), R), (P, R), 1e9, SHAPE, LINKS) == math.inf
    # tp stays inside a node (NVLink); dp crosses nodes (InfiniBand): the same all-reduce is slower on dp
    t_tp = redistribute_time((R, P), (R, R), 1e9, SHAPE, LINKS)
    assert t_tp == pytest.approx(collective_time("all_reduce", 1e9, 8, LINKS[1]))
    t_dp = redistribute_time((P, R), (R, R), 1e9, SHAPE, LINKS)
    assert t_dp > t_tp * 2


def test_nested_shards_follow_dtensor():
    """Two mesh dims sharding one tensor dim: the outer one cannot change while the inner one holds its shard."""
    # (R, S(1)) -> (S(1), S(1)): the tp shard a rank holds changes, so tp gathers first
    assert collectives_between((R, S(1)), (S(1), S(1)), 1024.0, (2, 2)) == [("all_gather", 1, 1024.0)]
    # (S(2), S(2)) -> (R, S(2)): gather tp, then dp, then slice tp again
    assert collectives_between((S(2), S(2)), (R, S(2)), 1024.0, (2, 2)) == [
        ("all_gather", 1, 512.0),
        ("all_gather", 0, 1024.0),
    ]
    # different tensor dims stay independent: one gather on the dim that changes, local to the other
    assert collectives_between((S(0), S(1)), (R, S(1)), 1024.0, (2, 2)) == [("all_gather", 0, 512.0)]
    # the nested shard that must change is the outer one, the inner one moves with it
    assert collectives_between((S(1), S(1)), (S(1), R), 1024.0, (2, 2)) == [("all_gather", 1, 512.0)]
    assert collectives_between((R, S(1)), (S(1), R), 1024.0, (2, 2)) == [("all_gather", 1, 1024.0)]
    assert collectives_between((S(1), R), (S(1), S(1)), 1024.0, (2, 2)) == []
    # re-sharding a nested pair on another tensor dim: gather the inner shard, then swap the outer one
    assert collectives_between((S(0), S(0)), (S(1), S(1)), 1024.0, (2, 2)) == [
        ("all_gather", 1, 512.0),
        ("all_to_all", 0, 512.0),
    ]


def test_mesh_dim_order_sets_the_bytes():
    """DTensor reduces mesh dim 1 while dim 0 still shards: the all-reduce moves the dp-local half."""
    assert collectives_between((S(0), P), (R, R), 1024.0, (2, 4)) == [
        ("all_reduce", 1, 512.0),
        ("all_gather", 0, 1024.0),
    ]


def test_partials_of_other_kinds_as_the_runtime_moves_them():
    # an average reduces like a sum
    assert collectives_between((P_AVG, R), (R, R), 1024.0, SHAPE) == [("all_reduce", 0, 1024.0)]
    assert collectives_between((R, P_AVG), (R, S(0)), 1024.0, SHAPE) == [
        ("reduce_scatter", 1, 1024.0)
    ]
    # an average becomes a sum by a local rescale; a sum becomes an average through a replica
    assert collectives_between((P_AVG, R), (P, R), 1024.0, SHAPE) == []
    assert collectives_between((P, R), (P_AVG, R), 1024.0, SHAPE) == [("all_reduce", 0, 1024.0)]
    assert collectives_between((P_AVG, R), (P_AVG, S(1)), 1024.0, SHAPE) == []


def test_a_mesh_dim_of_one_rank_moves_nothing():
    assert collectives_between((R, S(0)), (R, R), 1024.0, (4, 1)) == []
    assert collectives_between((S(0), P), (R, R), 1024.0, (4, 1)) == [("all_gather", 0, 1024.0)]


def test_memoized_per_placement_pair():
    a = collectives_between((S(0), S(0)), (R, S(1)), 1e6, SHAPE)
    b = collectives_between((S(0), S(0)), (R, S(1)), 3e6, SHAPE)
    assert [x[:2] for x in a] == [x[:2] for x in b]
    assert [y[2] for y in b] == pytest.approx([3 * x[2] for x in a])


# ---------------------------------------------------------------- against the runtime


@pytest.fixture
def fake_world_8():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def _runtime_collectives(src, dst, mesh, shape) -> list[tuple[str, str, float]]:
    """The collectives the runtime's redistribution (traced) runs for ``src`` -> ``dst``, as the runtime counts them."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.codegen.local_graph import LocalGraph
    from autopar.codegen.redistribute import to_planned

    local = list(shape)
    for p, n in zip(src, mesh.shape, strict=True):
        if p.is_shard():
            local[p.dim] //= n
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))

    def move(x):
        t = DTensor.from_local(
            x, mesh, to_dtensor_all(src), run_check=False, shape=torch.Size(shape), stride=stride
        )
        return to_planned(t, dst).to_local()

    gm = make_fx(move, tracing_mode="fake")(torch.empty(local))
    return [(r["kind"], r["axis"], r["bytes"]) for r in LocalGraph(gm, [], []).collective_records(mesh)]


def _as_on_gloo(charged, mesh_shape) -> list[tuple[str, str, float]]:
    """Gloo has no all-to-all: DTensor all-gathers the group's tensor and keeps its chunk."""
    out = []
    for kind, d, b in charged:
        if kind == "all_to_all":
            kind, b = "all_gather", b * mesh_shape[d]
        out.append((kind, ("dp", "tp")[d], float(b)))
    return out


@pytest.mark.parametrize("mesh_shape", [(2, 4), pytest.param((4, 2), marks=pytest.mark.slow)])
def test_charged_collectives_are_the_runtime_ones(fake_world_8, mesh_shape):
    """Every placement pair on a 2-D mesh: the collectives charged are the ones the runtime traces, in order."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    shape = (8, 8)
    nbytes = 8 * 8 * 4.0
    cells = list(itertools.product([R, S(0), S(1), P, P_AVG], repeat=2))
    bad = []
    seen = Counter()
    for src, dst in itertools.product(cells, cells):
        charged = collectives_between(src, dst, nbytes, mesh_shape)
        if charged is None:
            continue
        seen[len(charged)] += 1
        got = _runtime_collectives(src, dst, mesh, shape)
        if got != _as_on_gloo(charged, mesh_shape):
            bad.append(f"{src} -> {dst}: runtime {got}, charged {charged}")
    assert not bad, "\n".join(bad)
    assert seen[2] > 0 and seen[0] > 0  # nested and two-step moves, and free ones, were among them
