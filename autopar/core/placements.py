"""Placements of a tensor on a device mesh: one :class:`Placement` per mesh dim.

A placement says how one mesh dim holds a tensor: replicated, sharded on one
tensor dim, or as a partial result awaiting a reduction (a sum unless named).
Plans write them as text, ``"R"``, ``"S(d)"``, ``"B(d)"``, ``"P"`` / ``"P(op)"``; that text
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

``B(d)`` is a shard in head-tail order, context parallelism's load balance for
causal attention (Megatron-LM's, and torch's ``_HeadTailLoadBalancer``): the
dim is cut in ``2n`` chunks over a mesh dim of ``n`` ranks and rank ``r`` holds
chunks ``r`` and ``2n-1-r``, so each rank's queries attend as many keys under a
causal mask.  It is a shard (``is_shard()``: sizes, memory and most costs are a
shard's) whose elements are not one contiguous run: :func:`local_boxes` gives
its two pieces, and :func:`balanced_route` the steps that change its order.  To
DTensor it is a plain ``Shard(d)`` of the tensor permuted into that order
(:func:`head_tail`), which every op that treats the positions of the dim alike
(element-wise ops, matmuls over other dims, reductions over it) computes on
unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import placement_types as dt

_REPLICATE, _SHARD, _PARTIAL = "R", "S", "P"
"""The letters of the plain form, which are also the kinds a :class:`Placement` can be."""

_BALANCED = "B"
"""The plain form's letter of a shard in head-tail order (a shard, ``balanced``)."""

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
    balanced: bool = False  # a shard in head-tail order (the plain form's B(d))

    def __hash__(self) -> int:
        # the generated hash rebuilds a tuple of the fields on every call; placements key
        # hot caches (every strategy of every node), so the hash is computed once
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash((self.kind, self.dim, self.reduce_op, self.balanced))
            object.__setattr__(self, "_hash", h)
            return h

    def __reduce__(self):
        # without the cached hash: a string's hash differs from process to process
        return (Placement, (self.kind, self.dim, self.reduce_op, self.balanced))

    def is_replicate(self) -> bool:
        return self.kind == _REPLICATE

    def is_shard(self, dim: int | None = None) -> bool:
        """A shard (of tensor dim ``dim``, when given)."""
        return self.kind == _SHARD and (dim is None or self.dim == dim)

    def is_balanced(self, dim: int | None = None) -> bool:
        """A shard in head-tail order (of tensor dim ``dim``, when given)."""
        return self.balanced and (dim is None or self.dim == dim)

    def is_partial(self, reduce_op: str | None = None) -> bool:
        """A partial result (awaiting ``reduce_op``, when given)."""
        return self.kind == _PARTIAL and (reduce_op is None or self.reduce_op == reduce_op)

    def __str__(self) -> str:
        if self.kind == _SHARD:
            return f"{_BALANCED if self.balanced else _SHARD}({self.dim})"
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


def balanced(dim: int) -> Placement:
    """Tensor dim ``dim`` split over the mesh dim in head-tail order: ``2n`` chunks, rank ``r`` holding chunks
    ``r`` and ``2n-1-r``."""
    return Placement(_SHARD, dim=dim, balanced=True)


def head_tail(n: int) -> list[int]:
    """The ``2n`` chunks of a dim in the order ``n`` ranks hold them in head-tail order: 0, 2n-1, 1, 2n-2, ..."""
    return [c for r in range(n) for c in (r, 2 * n - 1 - r)]


def partial(reduce_op: str = SUM) -> Placement:
    """A partial result that ``reduce_op`` completes."""
    return Placement(_PARTIAL, reduce_op=reduce_op)


def replicated(ndim: int) -> Placements:
    """Whole on every rank of a mesh of ``ndim`` dims."""
    return (REPLICATE,) * ndim


def parse(text: str) -> Placement:
    """The placement a plan writes as ``text``: ``"R"``, ``"S(d)"``, ``"B(d)"``, ``"P"`` or ``"P(op)"``."""
    if text == _REPLICATE:
        return REPLICATE
    if text == _PARTIAL:
        return PARTIAL
    if len(text) > 3 and text[1] == "(" and text[-1] == ")":
        inner = text[2:-1]
        if text[0] == _SHARD and inner.lstrip("-").isdigit():
            return shard(int(inner))
        if text[0] == _BALANCED and inner.lstrip("-").isdigit():
            return balanced(int(inner))
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
    """DTensor's placement object for ``p`` (a head-tail shard: DTensor's shard of the permuted tensor)."""
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

    DTensor's vocab-sharded embedding, and its gather from a source split along the
    gather dim, ask for their *indices* as a ``_MaskPartial``: the indices are whole on
    every rank and the op masks the rows it does not own (DTensor in its dispatch,
    autopar's sharding interpreter in its own handlers of the two), so as an input that
    is a replica.  As an output it is a true partial sum.  Other partials of DTensor's own
    (a p-norm's) are no kind autopar has.
    """
    if isinstance(p, dt.Replicate):
        return REPLICATE
    if type(p) is dt.Shard:  # _StridedShard subclasses Shard and is not a plain shard
        return shard(p.dim)
    if isinstance(p, dt._MaskPartial):
        return REPLICATE if is_input else PARTIAL
    if type(p) is dt.Partial:
        return partial(p.reduce_op)
    # any other partial completes by more than its reduce_op: a p-norm's ``_NormPartial`` (reduce_op "sum")
    # sums the p-th powers and takes the root, which a P of the shards' norms would add up as they are
    return None


def local_boxes(
    shape: Sequence[int], spec: Sequence, coord: Sequence[int], mesh_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """This rank's pieces of a tensor of ``shape`` placed ``spec``: each piece's shape and where it starts, in
    the order the rank holds them (concatenated along the head-tail dim); one piece without a head-tail shard.

    ``spec`` holds autopar's placements or DTensor's (both answer ``is_shard()`` and ``.dim``).
    Mesh dims split in order, as DTensor does (a tensor dim sharded by mesh dims 0 and 1 is
    cut in ``n0`` chunks, each cut in ``n1``); a head-tail shard cuts each piece in ``2n``
    and keeps two, so it is the last mesh dim to split its tensor dim.  Shards divide evenly
    (the strategy pass offers no other).  Plain integers: DTensor's own helper computes the
    offset with tensors, which a trace cannot read back.
    """
    boxes = [([int(s) for s in shape], [0] * len(shape))]
    for p, c, n in zip(spec, coord, mesh_shape, strict=True):
        if not p.is_shard():
            continue
        d, cut = p.dim, []
        chunks = (c, 2 * n - 1 - c) if getattr(p, "balanced", False) else (c,)
        for local, offset in boxes:
            size = local[d] // (2 * n if len(chunks) == 2 else n)
            for j in chunks:
                piece, start = list(local), list(offset)
                piece[d], start[d] = size, offset[d] + j * size
                cut.append((piece, start))
        boxes = cut
    return boxes


def local_box(
    shape: Sequence[int], spec: Sequence, coord: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[list[int], list[int]]:
    """This rank's part of a tensor of ``shape`` placed ``spec``, one contiguous box: its shape and where it
    starts (:func:`local_boxes`; a head-tail shard holds two boxes, and is refused here)."""
    boxes = local_boxes(shape, spec, coord, mesh_shape)
    if len(boxes) != 1:
        raise ValueError(f"placement {tuple(spec)} holds {len(boxes)} pieces on a rank: use local_boxes")
    return boxes[0]


def balanced_at(spec: Sequence[Placement]) -> tuple[int, int] | None:
    """(mesh dim, tensor dim) of the head-tail shard of ``spec``, if it has one (it has at most one)."""
    return next(((a, p.dim) for a, p in enumerate(spec) if p.is_balanced()), None)


Stage = tuple[Placements, tuple[int, int, bool] | None]
"""A step of :func:`balanced_route`: the placements to redistribute to as DTensor does, then a local reorder
(mesh dim, tensor dim, into head-tail order or back) or none."""


def balanced_route(src: Placements, dst: Placements) -> list[Stage] | None:
    """The steps from ``src`` to ``dst`` when they hold a tensor dim in different orders; None when DTensor's
    redistribution of the two as plain shards is right (no head-tail shard changes).

    A head-tail shard left behind is gathered on its mesh dim (the other mesh dims as
    ``src``) and put back in natural order locally; one taken on is reached from a
    replica, or from a partial sum (which a reorder keeps), on its mesh dim (the
    others as ``dst``), reordered locally and then cut (a local slice, or the
    reduce-scatter of the partial).  Either way the reordered dim is whole over that
    mesh dim and split only by earlier ones, which cut it into runs the reorder
    keeps: a head-tail shard is the last mesh dim to split its tensor dim.
    """
    have, want = balanced_at(src), balanced_at(dst)
    if have == want and (have is None or _earlier_cuts(src, have) == _earlier_cuts(dst, want)):
        return None
    stages: list[Stage] = []
    now = tuple(src)
    if have is not None:
        a, d = have
        now = tuple(REPLICATE if i == a else p for i, p in enumerate(src))
        stages.append((now, (a, d, False)))
    if want is not None:
        a, d = want
        keep = now[a] if now[a].is_partial(SUM) else REPLICATE
        stages.append((tuple(keep if i == a else p for i, p in enumerate(dst)), (a, d, True)))
    stages.append((tuple(dst), None))
    return stages


def _earlier_cuts(spec: Sequence[Placement], at: tuple[int, int]) -> tuple[int, ...]:
    return tuple(i for i in range(at[0]) if spec[i].is_shard(at[1]))
