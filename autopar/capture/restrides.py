"""``as_strided`` calls that only restride dims of size 1, traced as the views they are.

A kernel may set the strides of a size-1 dim by ``as_strided`` (ATen's
``adaptive_avg_pool2d`` to a 1 x 1 output does, when it takes an input with a
size-1 dim for channels-last: Swin's pooler), and autograd differentiates it
as ``as_strided`` into a zero tensor then ``as_strided_scatter``. No
sharding rule can split an arbitrary ``as_strided`` (it addresses memory, not
elements), so each would be replicated. But a restride that leaves every
element where a contiguous view puts it *is* a view: traced as ``view``, and
its scatter as a ``view`` of the source, DTensor's view rules shard them.

:data:`DECOMPOSITIONS` is the ``make_fx`` decomposition table capture traces
the joint graph with; any other ``as_strided`` is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

aten = torch.ops.aten


def _contiguous_strides(size: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(int(n), 1)
    return strides[::-1]


def _is_view(base: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: Any) -> bool:
    """Whether ``base.as_strided(size, stride, offset)`` reads ``base``'s elements in order, all of them."""
    if not base.is_contiguous() or int(offset or 0) != base.storage_offset() or base.numel() != _numel(size):
        return False
    want = _contiguous_strides(size)
    return all(int(n) == 1 or int(s) == w for n, s, w in zip(size, stride, want, strict=True))


def _numel(size: Sequence[int]) -> int:
    out = 1
    for n in size:
        out *= int(n)
    return out


def as_strided(x: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: Any = None) -> Any:
    if not _is_view(x, size, stride, storage_offset):
        return NotImplemented
    return aten.view.default(x, list(size))


def as_strided_scatter(
    base: torch.Tensor, src: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: Any = None
) -> Any:
    """The whole of ``base`` overwritten by ``src``: ``src`` in ``base``'s shape."""
    if not _is_view(base, size, stride, storage_offset):
        return NotImplemented
    if not src.is_contiguous():
        src = aten.clone.default(src, memory_format=torch.contiguous_format)
    return aten.view.default(src, list(base.shape))


DECOMPOSITIONS = {aten.as_strided.default: as_strided, aten.as_strided_scatter.default: as_strided_scatter}
