"""Moving DTensors between placements, where DTensor's public API stops.

The shard pass (:mod:`autopar.codegen.shard`) runs the captured graph on
DTensors and brings every value to the placement the plan reads it in.
DTensor's ``redistribute`` does most of that; this module holds what it does
not: autopar's placements (a masked partial is a partial sum to autopar), a
partial average under gloo (no AVG reduction), a whole value made partial
without communication, a tensor every rank holds whole cut to its placement,
this rank's box of a tensor as plain integers (for keyed random numbers), and a
local shard re-laid out in the strides the capture recorded, and the reorders
a head-tail shard's changes of placement need (:func:`autopar.core.placements.balanced_route`,
which DTensor, seeing a plain shard of the permuted tensor, cannot know).  Each is a
function of a DTensor (or a tensor and a mesh) and placements, and nothing of
the plan or the graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autopar.core.placements import (
    AVG,
    REPLICATE,
    SUM,
    Placements,
    balanced_at,
    balanced_route,
    from_dtensor,
    head_tail,
    replicated,
    to_dtensor_all,
)


def dtensor_of(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...] | list[Placement],
    shape: torch.Size | tuple[int, ...],
    stride: tuple[int, ...],
) -> DTensor:
    """``local`` as this rank's shard of a DTensor placed ``placements``, whose whole tensor has ``shape``
    and ``stride``, made without ``from_local``.

    ``from_local`` goes through an autograd function that records a ``view`` of
    its input: one traced node per wrap, and on an output a kernel leaves
    undefined at run time (the CPU LSTM's workspace, a 0-element tensor when
    traced) a view of nothing, which fails.  The shard pass traces no autograd,
    so the DTensor holds ``local`` itself.
    """
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=local.requires_grad)


def local_of(x: DTensor) -> torch.Tensor:
    """This rank's shard of ``x``, read without ``to_local``.

    The shard pass traces a graph with no autograd in it; ``to_local`` would
    record an alias of every shard it reads and cost a millisecond of tracing
    each (a fifth of a small model's trace).
    """
    return x._local_tensor


def to_planned(x: Any, target: Placements | None, src: Placements | None = None) -> Any:
    """``x`` in autopar's placements ``target``: a DTensor redistributed, anything else (or no target) as it is.

    ``src``: the placement ``x`` holds in autopar's terms, where that may differ from the
    plain shards DTensor sees (a head-tail shard); omitted, ``x`` is in ``target``'s order.
    """
    if target is None or not isinstance(x, DTensor):
        return x
    route = balanced_route(tuple(src), tuple(target)) if src is not None else None
    if route is not None:
        for stage, reorder in route:
            x = to_planned(x, stage)
            if reorder is not None:
                x = reordered(x, *reorder)
        return x
    want = to_dtensor_all(target)
    if tuple(x.placements) == want:
        return x
    current = tuple(from_dtensor(p) for p in x.placements)
    if current == tuple(target):  # a masked partial is a partial sum to autopar: keep it
        return x
    return redistribute(x, want)


def natural_order(x: Any, held: Placements | None) -> Any:
    """``x``, held ``held``, with a head-tail shard gathered on its mesh dim and put back in natural order (the
    other mesh dims as held); ``x`` itself when ``held`` has none.

    What leaves the graph (the loss, a gradient, a buffer's new value) is then
    placed by DTensor's plain rules, which read every shard in natural order.
    """
    at = balanced_at(held) if held else None
    if at is None or not isinstance(x, DTensor):
        return x
    plain = tuple(REPLICATE if i == at[0] else p for i, p in enumerate(held))
    return to_planned(x, plain, tuple(held))


def reduces(x: Any, target: Placements | None) -> bool:
    """Whether bringing ``x`` to ``target`` reduces a partial sum (a collective that adds values up)."""
    if target is None or not isinstance(x, DTensor):
        return False
    return any(isinstance(h, Partial) and not w.is_partial() for h, w in zip(x.placements, target, strict=True))


def reordered(x: DTensor, mesh_dim: int, dim: int, balance: bool) -> DTensor:
    """``x`` with its local tensor's dim ``dim`` put in head-tail order for the ``n`` ranks of ``mesh_dim``
    (``balance``), or back in natural order: ``2n`` chunks moved locally, no communication."""
    order = head_tail(x.device_mesh.size(mesh_dim))
    local = local_of(x)
    chunks = local.chunk(len(order), dim)
    if balance:
        pieces = [chunks[c] for c in order]
    else:
        where = {c: i for i, c in enumerate(order)}
        pieces = [chunks[where[c]] for c in range(len(order))]
    return _relabel(torch.cat(pieces, dim), x, list(x.placements))


def to_planned_in(
    x: Any, target: Placements | None, dtype: torch.dtype, keep: bool, src: Placements | None = None
) -> Any:
    """:func:`to_planned`, a reduction of a value narrower than ``dtype`` run in ``dtype``.

    Mixed precision reduces gradients in fp32 (:mod:`autopar.runtime.precision`):
    the partial sums computed in bf16 are cast up, then added up.  ``keep``: the
    sum stays in ``dtype`` (a gradient the graph returns); otherwise it is cast
    back, since the op that reads it may need its operands in one dtype.
    """
    if not (reduces(x, target) and x.dtype.is_floating_point and x.dtype.itemsize < dtype.itemsize):
        return to_planned(x, target, src)
    out = to_planned(x.to(dtype), target, src)
    return out if keep else out.to(x.dtype)


def redistribute(x: DTensor, want: tuple[Placement, ...]) -> DTensor:
    """``x.redistribute(want)``, extended where DTensor's public redistribute stops.

    A partial average becomes a partial sum of the scaled value first (gloo has no
    AVG reduction); a whole value becomes a partial one locally (kept on the first
    rank of the mesh dim, zeros elsewhere for a sum), which DTensor keeps internal.
    """
    mesh = x.device_mesh
    have = list(x.placements)
    for i, p in enumerate(have):
        if isinstance(p, Partial) and p.reduce_op == AVG and want[i] != p:
            have[i] = Partial(SUM)
            x = _relabel(local_of(x) / mesh.size(i), x, have)
    step = tuple(Replicate() if isinstance(w, Partial) and have[i] != w else w for i, w in enumerate(want))
    if tuple(have) != step:
        x = x.redistribute(mesh, step)
    if step != want:
        coord = mesh.get_coordinate()
        local = local_of(x)
        for i, w in enumerate(want):
            if step[i] != w and w.reduce_op == SUM and coord[i] != 0:
                local = torch.zeros_like(local)
        x = _relabel(local, x, list(want))
    return x


def _relabel(local: torch.Tensor, like: DTensor, pls: list[Placement]) -> DTensor:
    return dtensor_of(local, like.device_mesh, pls, like.shape, like.stride())


def from_whole(t: torch.Tensor, mesh: DeviceMesh, want: tuple[Placement, ...]) -> DTensor:
    """``t``, held whole by every rank, as a DTensor placed ``want`` (no communication).

    A shard keeps this rank's chunk, contiguous as DTensor's own shards are (some CPU
    kernels read a strided operand as if it were dense: ``native_layer_norm_backward``'s
    mean and rstd); a partial sum keeps the value on the first rank of its mesh dim and
    zeros elsewhere, so that the ranks sum to it; any other partial (an average, a max)
    keeps the value on every rank, which it reduces to.
    """
    local = t
    coord = mesh.get_coordinate()
    for i, p in enumerate(want):
        if isinstance(p, Shard):
            local = local.chunk(mesh.size(i), p.dim)[coord[i]]
        elif isinstance(p, Partial) and p.reduce_op == SUM and coord[i] != 0:
            local = torch.zeros_like(local)
    if any(isinstance(p, Shard) for p in want):
        local = local.contiguous()
    return dtensor_of(local, mesh, want, t.shape, t.stride())


def from_whole_planned(t: torch.Tensor, mesh: DeviceMesh, target: Placements) -> DTensor:
    """``t``, held whole by every rank, in autopar's placements ``target`` (no communication): a head-tail
    shard is cut from a replica reordered locally."""
    if balanced_at(target) is None:
        return from_whole(t, mesh, to_dtensor_all(target))
    everywhere = replicated(mesh.ndim)
    return to_planned(from_whole(t, mesh, to_dtensor_all(everywhere)), target, everywhere)


def _layout_strides(shape: torch.Size, like: torch.Tensor) -> tuple[int, ...]:
    """Dense strides for ``shape`` that order the dims the way ``like``'s strides do."""
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
    strides = [0] * like.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def match_layout(x: DTensor, like: torch.Tensor) -> DTensor:
    """``x`` with its local tensor laid out like the captured value ``like``.

    The captured graph's views were recorded for its tensors' layouts (a
    ``view`` after a transpose is legal only on the right strides); a local
    shard produced another way (a kernel run on shards, a collective's output)
    can come out dense in another order.  Copy it into the captured order.
    """
    local = local_of(x)
    if local.dim() != like.dim() or not is_non_overlapping_and_dense(like):
        return x
    want = _layout_strides(local.shape, like)
    if all(local.stride(d) == want[d] for d in range(local.dim()) if local.shape[d] > 1):
        return x
    fixed = torch.empty_strided(local.shape, want, dtype=local.dtype, device=local.device).copy_(local)
    return _relabel(fixed, x, list(x.placements))
