"""The placements one tensor can take on a mesh: which divide its shape, and one name for each.

Shards must divide evenly (uneven shards are ruled out, not padded), and a mesh
dim of size 1 holds the whole tensor whatever its placement is called.  The
strategy pass, the plan transfer and the tests ask these questions of placements
and shapes alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autopar.core.placements import REPLICATE, Placement, Placements, shard


def split_ways(placements: Placements, mesh_shape: Sequence[int]) -> dict[int, int]:
    """Tensor dim -> how many pieces the mesh dims that shard it cut it into (dims not sharded: absent)."""
    ways: dict[int, int] = {}
    for p, n in zip(placements, mesh_shape, strict=True):
        if p.is_shard():
            ways[p.dim] = ways.get(p.dim, 1) * n
    return ways


def divides(placements: Placements, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Whether every sharded tensor dim splits evenly over the mesh dims that shard it.

    Uneven shards are ruled out, not padded: divisibility is a constraint of the plan.
    """
    ways = split_ways(placements, mesh_shape)
    if any(d < 0 or d >= len(shape) for d in ways):
        return False
    return all(int(shape[d]) % w == 0 for d, w in ways.items())


def canonical(placements: Placements, mesh_shape: Sequence[int]) -> Placements:
    """A mesh dim of size 1 holds the whole tensor whatever it is called: call it replicated.

    This keeps a (64, 1) mesh from listing each strategy several times over.
    """
    if all(n > 1 for n in mesh_shape):
        return placements
    return tuple(REPLICATE if n == 1 else p for p, n in zip(placements, mesh_shape, strict=True))


def tensor_placements(shape: Sequence[int], mesh_shape: Sequence[int]) -> list[Placements]:
    """Every placement of a graph input: R or S(d) per mesh dim, shards dividing evenly.

    No partial: an input holds real values, not pieces of a sum.  Dims of size 1
    stay replicated, and mesh dims of size 1 are only replicated.
    """
    per_dim: list[list[Placement]] = []
    for n in mesh_shape:
        opts = [REPLICATE]
        if n > 1:
            opts += [shard(d) for d, size in enumerate(shape) if int(size) > 1 and int(size) % n == 0]
        per_dim.append(opts)
    return [p for p in itertools.product(*per_dim) if divides(p, shape, mesh_shape)]
