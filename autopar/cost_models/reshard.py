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
    out = []
    current = list(src)
    for d, (a, b) in enumerate(zip(src, dst, strict=True)):
        kind = transition(a, b)
        if kind == "forbidden":
            return None
        if kind is not None:
            # bytes local to the other mesh dims at this point (this dim counted as unsharded)
            others = tuple(p if i != d else "R" for i, p in enumerate(current))
            local = nbytes / shard_factor(others, mesh_shape)
            out.append((kind, d, local / mesh_shape[d] if kind == "all_to_all" else local))
        current[d] = b
    return out


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
