"""Time to move a tensor from one placement on the mesh to another.

A placement (:mod:`autopar.core.placements`) lists, per mesh dim, R
(replicated), S(d) (sharded on tensor dim d) or P (a partial sum awaiting
reduction; P(avg), P(max) for other reductions). A change on one mesh dim, by itself, is one
collective over that dim's ranks or none:

    from \\ to   R               S(j)              P
    R            -               local slice       local (zero the copies)
    S(i)         all-gather      all-to-all (i≠j)  not allowed
    P            all-reduce      reduce-scatter    -

How the changes of several mesh dims combine is not re-derived here: the
steps are DTensor's own.  :func:`collectives_between` asks DTensor's
redistribution planner (``torch.distributed.tensor._redistribute.
_gen_transform_infos_non_cached``, the one ``DTensor.redistribute`` follows
when the runtime, :func:`autopar.codegen.redistribute.redistribute`, moves a value) for the
transform steps on a shape-only mesh, with a tensor that every mesh dim
divides evenly.  That settles what a per-mesh-dim table cannot: a tensor dim
sharded over several mesh dims is cut outermost mesh dim first, so an outer
shard can change only once the inner ones are gathered ((R, S(1)) → (S(1),
S(1)) gathers on mesh dim 1 first; (S(2), S(2)) → (R, S(2)) gathers twice),
and the order DTensor visits mesh dims sets how big each collective is.

Each step with a collective is charged on the tensor its group holds: the
tensor's bytes divided by the sizes of the other mesh dims that shard it at
that step.  Bytes follow the runtime's accounting
(``LocalGraph.collective_records``): the output (the full buffer) of an
all-gather, the input of a reduce-scatter or all-reduce, and each rank's
input of an all-to-all.  Steps that only slice or zero locally, and steps on
a mesh dim of size 1 (DTensor skips them), cost nothing.  Partials are
rewritten first as the runtime does before it calls DTensor: a partial
average that changes is rescaled locally into a partial sum, and a partial
of another kind than the one it must become is reduced to a replica (one
all-reduce) and then kept as the new partial locally.

A head-tail shard (``B(d)``) is a shard of the tensor in another order: between
two placements that keep the order, DTensor's steps are the plain shards'; where
the order changes, the runtime's route
(:func:`autopar.core.placements.balanced_route`) is costed stage by stage, its
local reorders free (a copy of the local tensor, as a slice is).

The plan of a (src, dst, mesh shape) is memoized as a fraction of the
tensor's bytes per step, so the planner's many thousands of calls cost a
cache look-up each.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

from autopar.core.mesh import fake_mesh
from autopar.core.placements import (
    AVG,
    PARTIAL,
    REPLICATE,
    Placement,
    Placements,
    balanced_route,
    from_dtensor,
    partial,
    to_dtensor_all,
)
from autopar.cost_models.comm import collective_time
from autopar.hardware.cluster import Link

INF = math.inf


def shard_factor(placements: Placements, mesh_shape: Sequence[int]) -> int:
    """How many pieces the tensor is cut into: the product of the sizes of the mesh dims that shard it."""
    f = 1
    for p, n in zip(placements, mesh_shape, strict=True):
        if p.is_shard():
            f *= n
    return f


def transition(src: Placement, dst: Placement) -> str | None:
    """The collective that turns ``src`` into ``dst`` on one mesh dim alone; None when local; "forbidden".

    Only the single-mesh-dim view: :func:`collectives_between` is the one to
    ask for a whole placement, as nested shards change the steps.
    """
    if src == dst:
        return None
    if src.is_replicate():
        return None  # slicing a replica or zeroing copies needs no communication
    if src.is_partial():  # a sum, or an average, a max, ...: reduce first
        return "reduce_scatter" if dst.is_shard() else "all_reduce"
    # src is a shard
    if dst.is_replicate():
        return "all_gather"
    if dst.is_partial():
        return "forbidden"
    return "all_to_all"


def collectives_between(
    src: Placements, dst: Placements, nbytes: float, mesh_shape: Sequence[int]
) -> list[tuple[str, int, float]] | None:
    """(kind, mesh dim, bytes) of each collective that turns ``src`` into ``dst``, in order; None if not allowed.

    The collectives DTensor's redistribution runs (see the module docstring),
    for a tensor of ``nbytes`` (global) whose shards divide evenly.  Bytes
    follow ``comm.collective_time``'s convention: the full buffer for
    all-gather / reduce-scatter / all-reduce, each rank's buffer for all-to-all.
    """
    steps = _steps(tuple(src), tuple(dst), tuple(mesh_shape))
    if steps is None:
        return None
    return [(kind, d, nbytes * fraction) for kind, d, fraction in steps]


@functools.lru_cache(maxsize=1 << 16)
def _steps(
    src: Placements, dst: Placements, mesh_shape: tuple[int, ...]
) -> tuple[tuple[str, int, float], ...] | None:
    """:func:`collectives_between` per byte of the tensor: (kind, mesh dim, fraction of the bytes); None if not allowed."""
    if len(src) != len(mesh_shape) or len(dst) != len(mesh_shape):
        raise ValueError(f"placements {src} -> {dst} do not match mesh shape {mesh_shape}")
    route = balanced_route(src, dst)
    if route is None:
        return _plain_steps(src, dst, mesh_shape)
    out: list[tuple[str, int, float]] = []
    now = src
    for stage, _ in route:  # the order of a dim changes: the runtime's stages, each as DTensor runs it
        steps = _plain_steps(now, stage, mesh_shape)
        if steps is None:
            return None
        out += steps
        now = stage
    return tuple(out)


def _plain_steps(
    src: Placements, dst: Placements, mesh_shape: tuple[int, ...]
) -> tuple[tuple[str, int, float], ...] | None:
    """:func:`_steps` of a change DTensor runs as it is (a head-tail shard as a plain one)."""
    if any(transition(a, b) == "forbidden" for a, b in zip(src, dst, strict=True)):
        return None
    have, step = _runtime_request(src, dst)
    if have == step:
        return ()
    sizes = tuple(int(n) for n in mesh_shape)
    out = []
    current = list(have)
    for d, after, kind in _dtensor_transforms(have, step, sizes):
        if kind is not None and sizes[d] > 1:  # DTensor issues nothing over a single rank
            # the tensor the group works on: the global one cut by the other mesh dims as placed now
            others = tuple(REPLICATE if i == d else p for i, p in enumerate(current))
            fraction = 1.0 / shard_factor(others, sizes)
            if kind == "all_to_all":
                fraction /= sizes[d]  # each rank's own shard
            out.append((kind, d, fraction))
        current[d] = after
    return tuple(out)


def _runtime_request(src: Placements, dst: Placements) -> tuple[Placements, Placements]:
    """The (from, to) the runtime hands to ``DTensor.redistribute`` for ``src`` → ``dst``.

    Mirrors :func:`autopar.codegen.redistribute.redistribute`: a partial average that is to
    change becomes a partial sum locally (rescaled); a wanted partial the value
    is not already in is asked of DTensor as a replica, then kept as a partial
    locally (DTensor makes no partial from another placement with communication).
    """
    have = tuple(PARTIAL if a == _AVG and b != a else a for a, b in zip(src, dst, strict=True))
    step = tuple(REPLICATE if b.is_partial() and a != b else b for a, b in zip(have, dst, strict=True))
    return have, step


_AVG = partial(AVG)


def _kind(was: Placement, now: Placement) -> str | None:
    """The collective of one DTensor transform step on one mesh dim; None for a local one."""
    if was.is_shard():
        return "all_gather" if now.is_replicate() else "all_to_all" if now.is_shard() else None
    if was.is_partial():
        return "all_reduce" if now.is_replicate() else "reduce_scatter" if now.is_shard() else None
    return None


def _dtensor_transforms(
    src: Placements, dst: Placements, mesh_shape: tuple[int, ...]
) -> list[tuple[int, Placement, str | None]]:
    """DTensor's redistribution plan for ``src`` → ``dst``: (mesh dim, placement after, collective or None) per step.

    The steps of ``_gen_transform_infos_non_cached`` (DTensor's planner, with the
    strategy it picks at run time), for a tensor whose every dim each mesh dim
    divides.  Run on a fake mesh, so it needs no process group.
    """
    ndim = max([p.dim for p in (*src, *dst) if p.is_shard()], default=0) + 1
    mesh, meta = _fake_mesh_and_meta(mesh_shape, ndim)
    a = DTensorSpec(mesh, to_dtensor_all(src), meta)
    b = DTensorSpec(mesh, to_dtensor_all(dst), meta)
    out = []
    for info in _gen_transform_infos_non_cached(a, b):
        was, now = (from_dtensor(p) for p in info.src_dst_placements)
        kind = _kind(was, now)
        if kind == "all_to_all" and was == now:
            kind = None  # same shard on both sides: nothing moves
        out.append((info.mesh_dim, now, kind))
    return out


@functools.lru_cache(maxsize=64)
def _fake_mesh_and_meta(mesh_shape: tuple[int, ...], ndim: int):
    """A shape-only mesh and a tensor of ``ndim`` dims that every mesh dim, alone or together, divides.

    Kept alive here: DTensor caches its planners per live mesh.
    """
    size = max(math.prod(mesh_shape), 1)
    meta = TensorMeta(
        torch.Size([size] * ndim), tuple(size ** (ndim - 1 - i) for i in range(ndim)), torch.float32
    )
    mesh = fake_mesh(mesh_shape, tuple(f"d{i}" for i in range(len(mesh_shape))))
    return mesh, meta


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


def grad_sync_steps(
    have: Placements,
    need: Placements,
    zero: int,
    nbytes: float,
    mesh_shape: tuple[int, ...],
    dp_dim: int | None,
) -> list[tuple[str, int, float]] | None:
    """The collectives that bring a value placed ``have`` to ``need`` (None: not possible).

    For the gradient of a ZeRO-1/2 parameter (``zero`` > 0): the gradient is brought to
    the parameter's placement on the other mesh dims, and its dp-partial sum is then
    reduce-scattered over dp into flat chunks (a gradient that is not partial over dp is
    cut locally), as :mod:`autopar.runtime.zero` does.
    """
    if not zero or dp_dim is None:
        return collectives_between(have, need, nbytes, mesh_shape)
    summed = have[dp_dim].is_partial()
    keep = tuple((have[d] if summed else REPLICATE) if d == dp_dim else need[d] for d in range(len(mesh_shape)))
    steps = collectives_between(have, keep, nbytes, mesh_shape)
    if steps is None:
        return None
    if summed:
        local = nbytes / shard_factor(keep, mesh_shape)  # the whole buffer each dp rank reduces
        steps = [*steps, ("reduce_scatter", dp_dim, local)]
    return steps
