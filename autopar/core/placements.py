"""Placements of a tensor on a device mesh: one per mesh dim, in the plain form plans keep.

``"R"`` (replicated), ``"S(d)"`` (tensor dim ``d`` split over the mesh dim), ``"P"`` /
``"P(op)"`` (a partial result awaiting a reduction, sum unless named). This module is the
one place that reads and writes that form and converts it to and from DTensor's
placement objects.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _MaskPartial

Placements = tuple[str, ...]
"""One placement per mesh dim, e.g. ``("S(0)", "R")``."""


def shard_dim(p: str) -> int | None:
    """The tensor dim of ``"S(d)"``, else None."""
    return int(p[2:-1]) if p.startswith("S(") and p.endswith(")") else None


def to_dtensor(p: str) -> Placement:
    """DTensor's placement object for the plain form ``p``."""
    if p == "R":
        return Replicate()
    if p == "P":
        return Partial()
    if p.startswith("P(") and p.endswith(")"):
        return Partial(p[2:-1])
    d = shard_dim(p)
    if d is not None:
        return Shard(d)
    raise ValueError(f"not a placement: {p!r}")


def from_dtensor(p: Placement, is_input: bool = False) -> str | None:
    """The plain form of a DTensor placement, or None if the plain form cannot say it.

    DTensor's vocab-sharded embedding asks for its *indices* as a ``_MaskPartial``:
    the indices are whole on every rank and the op masks the rows it does not own,
    so as an input that is "R".  As an output it is a true partial sum ("P").
    """
    if isinstance(p, Replicate):
        return "R"
    if type(p) is Shard:  # _StridedShard subclasses Shard and is not a plain shard
        return f"S({p.dim})"
    if isinstance(p, _MaskPartial):
        return "R" if is_input else "P"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return None
