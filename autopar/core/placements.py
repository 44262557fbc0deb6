"""Placements of a tensor on a device mesh: one :class:`Placement` per mesh dim.

A placement says how one mesh dim holds a tensor: replicated, sharded on one
tensor dim, or as a partial result awaiting a reduction (a sum unless named).
Plans write them as text, ``"R"``, ``"S(d)"``, ``"P"`` / ``"P(op)"``; that text
is read (:func:`parse`) where JSON or ONNX metadata is read and written
(``str``) where it is written or printed, and nowhere else.  Everything in
between carries :class:`Placement` values and asks them questions
(:meth:`Placement.is_shard`, ...), so the plain form has one reader and one
writer.

autopar keeps its own type rather than DTensor's placement objects so that
plans and cost models hold plain, ordered, torch-free values: DTensor's kinds
include private ones (``_MaskPartial``, ``_StridedShard``) that autopar maps
or refuses when it reads DTensor's rules (:func:`from_dtensor`), and it
converts back (:func:`to_dtensor`) only where DTensor runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import placement_types as dt

_REPLICATE, _SHARD, _PARTIAL = "R", "S", "P"
"""The letters of the plain form, which are also the kinds a :class:`Placement` can be."""

SUM = "sum"
"""The reduction of a partial that names none."""

AVG = "avg"
"""The reduction of a mean-reduced loss's partial (DTensor's ``Partial("avg")``)."""


@dataclass(frozen=True, order=True)
class Placement:
    """How one mesh dim holds a tensor.

    Frozen and ordered: tuples of placements key caches and sets (the
    strategies' memo, the resharding planner's cache) and sort in views.  Build
    one with :data:`REPLICATE`, :func:`shard`, :func:`partial` or :func:`parse`;
    the fields are the plain form's parts.
    """

    kind: str
    dim: int = -1  # the tensor dim a shard splits
    reduce_op: str = SUM  # the reduction a partial awaits

    def __hash__(self) -> int:
        # the generated hash rebuilds a tuple of the fields on every call; placements key
        # hot caches (every strategy of every node), so the hash is computed once
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash((self.kind, self.dim, self.reduce_op))
            object.__setattr__(self, "_hash", h)
            return h

    def __reduce__(self):
        # without the cached hash: a string's hash differs from process to process
        return (Placement, (self.kind, self.dim, self.reduce_op))

    def is_replicate(self) -> bool:
        return self.kind == _REPLICATE

    def is_shard(self, dim: int | None = None) -> bool:
        """A shard (of tensor dim ``dim``, when given)."""
        return self.kind == _SHARD and (dim is None or self.dim == dim)

    def is_partial(self, reduce_op: str | None = None) -> bool:
        """A partial result (awaiting ``reduce_op``, when given)."""
        return self.kind == _PARTIAL and (reduce_op is None or self.reduce_op == reduce_op)

    def __str__(self) -> str:
        if self.kind == _SHARD:
            return f"S({self.dim})"
        if self.kind == _PARTIAL and self.reduce_op != SUM:
            return f"P({self.reduce_op})"
        return self.kind

    __repr__ = __str__  # tuples of placements print as the plain form in messages


Placements = tuple[Placement, ...]
"""One placement per mesh dim, e.g. ``(shard(0), REPLICATE)``."""

Row = list[Placement | None]
"""A single-mesh-dim sharding rule: one placement per output, then per tensor input (None: not a tensor)."""

REPLICATE = Placement(_REPLICATE)
PARTIAL = Placement(_PARTIAL)
"""A partial sum."""


def shard(dim: int) -> Placement:
    """Tensor dim ``dim`` split over the mesh dim."""
    return Placement(_SHARD, dim=dim)


def partial(reduce_op: str = SUM) -> Placement:
    """A partial result that ``reduce_op`` completes."""
    return Placement(_PARTIAL, reduce_op=reduce_op)


def replicated(ndim: int) -> Placements:
    """Whole on every rank of a mesh of ``ndim`` dims."""
    return (REPLICATE,) * ndim


def parse(text: str) -> Placement:
    """The placement a plan writes as ``text``: ``"R"``, ``"S(d)"``, ``"P"`` or ``"P(op)"``."""
    if text == _REPLICATE:
        return REPLICATE
    if text == _PARTIAL:
        return PARTIAL
    if len(text) > 3 and text[1] == "(" and text[-1] == ")":
        inner = text[2:-1]
        if text[0] == _SHARD and inner.lstrip("-").isdigit():
            return shard(int(inner))
        if text[0] == _PARTIAL:
            return partial(inner)
    raise ValueError(f"not a placement: {text!r}")


def parse_all(texts: Iterable[str]) -> Placements:
    """One placement per mesh dim, from the plain forms a plan lists."""
    return tuple(parse(t) for t in texts)


def texts(placements: Iterable[Placement]) -> list[str]:
    """The plain forms of ``placements``, as a plan's JSON lists them."""
    return [str(p) for p in placements]


def text(placements: Iterable[Placement]) -> str:
    """One line for people: ``S(0),R``."""
    return ",".join(str(p) for p in placements)


def to_dtensor(p: Placement) -> dt.Placement:
    """DTensor's placement object for ``p``."""
    if p.is_replicate():
        return dt.Replicate()
    if p.is_shard():
        return dt.Shard(p.dim)
    return dt.Partial(p.reduce_op)


def to_dtensor_all(placements: Iterable[Placement]) -> tuple[dt.Placement, ...]:
    """DTensor's placements for a tensor placed ``placements``, one per mesh dim."""
    return tuple(to_dtensor(p) for p in placements)


def from_dtensor(p: dt.Placement, is_input: bool = False) -> Placement | None:
    """The placement a DTensor placement stands for, or None if autopar has no such kind.

    DTensor's vocab-sharded embedding asks for its *indices* as a ``_MaskPartial``:
    the indices are whole on every rank and the op masks the rows it does not own,
    so as an input that is a replica.  As an output it is a true partial sum.
    """
    if isinstance(p, dt.Replicate):
        return REPLICATE
    if type(p) is dt.Shard:  # _StridedShard subclasses Shard and is not a plain shard
        return shard(p.dim)
    if isinstance(p, dt._MaskPartial):
        return REPLICATE if is_input else PARTIAL
    if isinstance(p, dt.Partial):
        return partial(p.reduce_op)
    return None


def local_box(
    shape: Sequence[int], spec: Sequence, coord: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[list[int], list[int]]:
    """This rank's part of a tensor of ``shape`` placed ``spec``: its shape and where it starts.

    ``spec`` holds autopar's placements or DTensor's (both answer ``is_shard()`` and ``.dim``).
    Mesh dims split in order, as DTensor does (a tensor dim sharded by mesh dims 0 and 1 is
    cut in ``n0`` chunks, each cut in ``n1``).  Shards divide evenly (the strategy pass offers
    no other).  Plain integers: DTensor's own helper computes the offset with tensors, which a
    trace cannot read back.
    """
    local, offset = [int(s) for s in shape], [0] * len(shape)
    for p, c, n in zip(spec, coord, mesh_shape, strict=True):
        if p.is_shard():
            local[p.dim] //= n
            offset[p.dim] += c * local[p.dim]
    return local, offset
