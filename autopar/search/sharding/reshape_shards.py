"""Reshapes that keep every rank's elements where DTensor's view rule sees a strided shard.

Flattening ``(batch, sequence, ...)`` into ``(batch·sequence, ...)``, as a language
model's loss does with its logits, turns a sequence split (context or sequence
parallelism) into a strided shard: DTensor's view rule says so, and autopar drops
strided shards.  Yet where the dims before the split one are 1 on every rank (the
batch split down to one sequence per rank, or a batch of one) each rank's elements
of the merged dim are one contiguous run, the very run a plain shard of the merged
dim gives the rank: the reshape is local, with no communication.  This module finds
such pairs of placements (:func:`reshaped_placements`); the strategy pass offers
them and the sharding pass runs them on the local tensors.  A head-tail shard
(``B(d)``) holds two runs a rank; the reshape is local when the other side holds
the same two, in the same order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from autopar.core.placements import Placement, Placements, balanced, local_boxes, shard
from autopar.search.sharding.placement_sets import divides, split_ways

Groups = list[tuple[list[int], list[int]]]

RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
"""The reshapes of the joint graph (``reshape`` is traced as a view, or a copy and a view)."""


def merge_groups(a: Sequence[int], b: Sequence[int]) -> Groups | None:
    """The dims of shapes ``a`` and ``b`` paired into groups of equal size, in order (a contiguous reshape
    merges or splits within a group only); None when no such pairing exists."""
    if math.prod(a) != math.prod(b) or not a or not b:
        return None
    groups: Groups = []
    i = j = 0
    while i < len(a) and j < len(b):
        ga, gb = [i], [j]
        pa, pb = a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                ga.append(i - 1)
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
                gb.append(j - 1)
            else:
                return None
        groups.append((ga, gb))
    groups[-1][0].extend(range(i, len(a)))  # trailing dims of size 1
    groups[-1][1].extend(range(j, len(b)))
    return groups


def _run(shape: Sequence[int], local: list, offset: list, dims: list[int]) -> tuple[int, int] | None:
    """The rank's elements of ``dims`` flattened, as (start, length) when they are one run, else None."""
    k = len(dims) - 1
    while k >= 0 and local[dims[k]] == shape[dims[k]]:
        k -= 1
    if any(local[d] != 1 for d in dims[:max(k, 0)]):
        return None
    start, stride = 0, 1
    for d in reversed(dims):
        start += offset[d] * stride
        stride *= shape[d]
    return start, math.prod(local[d] for d in dims)


def same_elements(
    a: Sequence[int], a_spec: Placements, b: Sequence[int], b_spec: Placements, mesh: Sequence[int]
) -> bool:
    """Whether every rank holds the same elements of a tensor of shape ``a`` placed ``a_spec`` and of its
    reshape to ``b`` placed ``b_spec``."""
    groups = merge_groups(a, b)
    if groups is None or any(
        pa.is_partial() != pb.is_partial() or (pa.is_shard() and a[pa.dim] % n) or (pb.is_shard() and b[pb.dim] % n)
        for pa, pb, n in zip(a_spec, b_spec, mesh, strict=True)
    ):
        return False
    for coord in _probes(a, a_spec, b, b_spec, mesh):
        boxes_a, boxes_b = local_boxes(a, a_spec, coord, mesh), local_boxes(b, b_spec, coord, mesh)
        if len(boxes_a) != len(boxes_b):
            return False
        for (la, oa), (lb, ob) in zip(boxes_a, boxes_b, strict=True):
            for ga, gb in groups:
                ra = _run(a, la, oa, ga)
                if ra is None or ra != _run(b, lb, ob, gb):
                    return False
    return True


def _probes(a: Sequence[int], a_spec: Placements, b: Sequence[int], b_spec: Placements, mesh: Sequence[int]):
    """The ranks whose elements :func:`same_elements` compares: every rank, or, where both sides split
    evenly in plain shards, the first rank and each one a step from it along one mesh dim.

    A plain even split puts a rank's box at offsets linear in its mesh coordinates, with the same
    sizes on every rank, so each side's run of a merged group starts at a linear function of the
    coordinates with a length that does not depend on them: two such functions agree everywhere when
    they agree at zero and one step along each mesh dim (DeepSeek-V3's 2,048-rank meshes: 2,048 ranks
    compared for each pair of placements, now 3). A head-tail shard holds two runs that do not move
    linearly: every rank is compared.
    """
    plain = not any(p.is_balanced() for p in (*a_spec, *b_spec))
    if plain and divides(a_spec, a, mesh) and divides(b_spec, b, mesh):
        zero = (0,) * len(mesh)
        return [zero] + [tuple(int(i == k) for i in range(len(mesh))) for k, n in enumerate(mesh) if n > 1]
    return itertools.product(*(range(n) for n in mesh))


def reshaped_placements(a: Sequence[int], a_spec: Placements, b: Sequence[int], mesh: Sequence[int]) -> list[Placements]:
    """The placements of the reshape of ``a`` to ``b`` that hold, on every rank, the elements ``a_spec`` holds
    there, for an ``a_spec`` that splits a dim merged with others or split into others (the case DTensor
    calls strided); [] for any other."""
    groups = merge_groups(a, b)
    if groups is None:
        return []
    group_of = {d: g for g in groups for d in g[0]}
    if not any(p.is_shard() and (len(group_of[p.dim][0]) > 1 or len(group_of[p.dim][1]) > 1) for p in a_spec):
        return []
    options: list[list[Placement]] = []
    for p in a_spec:
        if not p.is_shard():
            options.append([p])
            continue
        options.append([balanced(d) if p.is_balanced() else shard(d) for d in group_of[p.dim][1]])
    inner_a = _splits_inner(a_spec, [g[0] for g in groups])
    return [
        tuple(o)
        for o in itertools.product(*options)
        if (inner_a or _splits_inner(o, [g[1] for g in groups])) and same_elements(a, a_spec, b, tuple(o), mesh)
    ]


def _splits_inner(spec: Sequence[Placement], groups: list[list[int]]) -> bool:
    """Whether ``spec`` splits a dim that is not the first of its group: what DTensor calls strided (a split
    of the first dim alone is DTensor's own reshape rule, left to it)."""
    first = {g[0] for g in groups}
    return any(p.is_shard() and p.dim not in first for p in spec)


def local_at_one_row(
    a: Sequence[int], b: Sequence[int], candidates: Sequence[Placements], mesh: Sequence[int], batch: int
) -> dict[tuple[Placements, Placements], int]:
    """(placement of ``a``, placement of its reshape to ``b``) -> the micro-batch count at which alone the
    pair keeps every rank's elements: where the batch (leading both shapes) is cut so that a rank holds one
    row of the leading dim, the dims before a split are 1 on every rank (the flatten of sequence-split
    logits under context parallelism over the dp axis's ranks, at one sequence a micro-batch).

    Only where the leading dim is merged with others or split, at the counts where a rank's share of
    either side's leading dim can be one row, for the placements that split a dim of that group.
    """
    groups = merge_groups(a, b) if batch > 1 else None
    if not groups or a[0] % batch or b[0] % batch or len(groups[0][0]) + len(groups[0][1]) <= 2:
        return {}
    lead = groups[0][0]
    splits = {math.prod(n for n, keep in zip(mesh, sub, strict=True) if keep) for sub in itertools.product((0, 1), repeat=len(mesh))}
    counts = sorted({d // p for d in (a[0], b[0]) for p in splits if d % p == 0})
    split_lead = [c for c in candidates if any(p.is_shard() and p.dim in lead for p in c)]
    found: dict[tuple[Placements, Placements], int] = {}
    for m in (m for m in counts if m > 1 and batch % m == 0):
        am, bm = (a[0] // m, *a[1:]), (b[0] // m, *b[1:])
        for c in split_lead:
            if _leads_with_one_row(am, c, lead, mesh):
                for out in reshaped_placements(am, c, bm, mesh):
                    found.setdefault((c, out), m)
    return found


def _leads_with_one_row(shape: Sequence[int], spec: Placements, lead: list[int], mesh: Sequence[int]) -> bool:
    """Whether every dim of ``lead`` before the last one ``spec`` splits holds one row on a rank (a merge of
    those dims can then be one run a rank); what :func:`reshaped_placements` checks in full, over the
    ranks, only where this holds."""
    ways = split_ways(spec, mesh)
    split = [d for d in lead if ways.get(d, 1) > 1]
    return not split or all(shape[d] == ways.get(d, 1) for d in lead if d < split[-1])
