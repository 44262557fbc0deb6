"""Time to move a tensor from one placement on the mesh to another.

A placement lists, per mesh dim, "R" (replicated), "S(d)" (sharded on
tensor dim d) or "P" (a partial sum awaiting reduction; "P(avg)", "P(max)"
for other reductions, which cost the same). A change on one
mesh dim is one collective over that dim's ranks:

    from \\ to   R               S(j)              P
    R            -               local slice       local (zero the copies)
    S(i)         all-gather      all-to-all (i≠j)  not allowed
    P            all-reduce      reduce-scatter    -

Mesh dims are taken one at a time (as DTensor's redistribution does), each
collective acting on the tensor's size local to the other dims. Pure
Python: the solver side uses it.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

from autopar.cluster import Link
from autopar.cost_models.comm import collective_time

Placements = tuple[str, ...]

_SHARD = re.compile(r"S\((\d+)\)")

INF = math.inf


def shard_dim(p: str) -> int | None:
    m = _SHARD.fullmatch(p)
    return int(m.group(1)) if m else None


def shard_factor(placements: Placements, mesh_shape: Sequence[int]) -> int:
    """How many pieces the tensor is cut into: the product of the sizes of the mesh dims that shard it."""
    f = 1
    for p, n in zip(placements, mesh_shape, strict=True):
        if p.startswith("S"):
            f *= n
    return f


def transition(src: str, dst: str) -> str | None:
    """The collective that turns ``src`` into ``dst`` on one mesh dim; None when local; "forbidden"."""
    if src == dst:
        return None
    if src == "R":
        return None  # slicing a replica or zeroing copies needs no communication
    if src.startswith("P"):  # "P" (sum) or "P(avg)", "P(max)", ...: reduce first
        return "reduce_scatter" if dst.startswith("S") else "all_reduce"
    # src is a shard
    if dst == "R":
        return "all_gather"
    if dst.startswith("P"):
        return "forbidden"
    return "all_to_all"


def collectives_between(
    src: Placements, dst: Placements, nbytes: float, mesh_shape: Sequence[int]
) -> list[tuple[str, int, float]] | None:
    """(kind, mesh dim, bytes) of each collective that turns ``src`` into ``dst``; None if not allowed.

    Bytes follow ``comm.collective_time``'s convention: the full buffer for
    all-gather / reduce-scatter / all-reduce, each rank's buffer for all-to-all.
    """
    if any(transition(a, b) == "forbidden" for a, b in zip(src, dst, strict=True)):
        return None
    steps = _dtensor_steps(tuple(src), tuple(dst), tuple(int(n) for n in mesh_shape))
    return [(kind, d, nbytes * fraction) for kind, d, fraction in steps]


_KIND = {
    ("S", "R"): "all_gather",
    ("P", "R"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("S", "S"): "all_to_all",
}


@functools.lru_cache(maxsize=65536)
def _dtensor_steps(
    src: Placements, dst: Placements, mesh_shape: tuple[int, ...]
) -> tuple[tuple[str, int, float], ...]:
    """The collectives DTensor's redistribution runs for ``src`` → ``dst``, each with its share of the bytes.

    Asks DTensor's own planner (the one ``DTensor.redistribute`` follows at run
    time) on a shape-only mesh and a tensor whose dims every mesh size divides,
    so that nested shards of one tensor dim (which force gathering an inner
    mesh dim before an outer one changes) and the order of the mesh dims are
    DTensor's, not a re-derivation.
    """
    import torch
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from autopar.passes.strategies import _placement_obj, fake_mesh

    def plain(p: str):  # every partial is a sum to DTensor's planner; autopar rescales averages first
        return _placement_obj("P" if p.startswith("P") else p)

    dims = [shard_dim(p) for p in (*src, *dst)]
    ndim = max([d for d in dims if d is not None], default=0) + 1
    size = math.prod(mesh_shape) ** 2  # every dim splits evenly however the mesh shards it
    shape = torch.Size([size] * ndim)
    meta = TensorMeta(shape, tuple(size ** (ndim - 1 - i) for i in range(ndim)), torch.float32)
    mesh = fake_mesh(mesh_shape, tuple(f"d{i}" for i in range(len(mesh_shape))))
    a = DTensorSpec(mesh, tuple(plain(p) for p in src), meta)
    b = DTensorSpec(mesh, tuple(plain(p) for p in dst), meta)
    out = []
    current = list(src)
    for info in _gen_transform_infos(a, b):
        d = info.mesh_dim
        have, want = info.src_dst_placements
        kind = _KIND.get((_letter(have), _letter(want)))
        after = _plain_str(want)
        if kind is not None and have != want:  # else a local slice, zeroing copies, or nothing
            # the tensor the group holds: local to every other mesh dim as placed at this step
            others = tuple(p if i != d else "R" for i, p in enumerate(current))
            fraction = 1.0 / shard_factor(others, mesh_shape)
            if kind == "all_to_all":
                fraction /= mesh_shape[d]
            out.append((kind, d, fraction))
        current[d] = after
    return tuple(out)


def _plain_str(p) -> str:
    letter = _letter(p)
    return f"S({p.dim})" if letter == "S" else letter


def _letter(p) -> str:
    name = type(p).__name__
    return "S" if name == "Shard" else "P" if "Partial" in name else "R"


def redistribute_time(
    src: Placements, dst: Placements, nbytes: float, mesh_shape: Sequence[int], links: Sequence[Link]
) -> float:
    """Seconds to turn a tensor of ``nbytes`` (global) placed ``src`` into ``dst``; inf if not allowed."""
    if src == dst:
        return 0.0
    steps = collectives_between(src, dst, nbytes, mesh_shape)
    if steps is None:
        return INF
    return sum(collective_time(kind, b, mesh_shape[d], links[d]) for kind, d, b in steps)
