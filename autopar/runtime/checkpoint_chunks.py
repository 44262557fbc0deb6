"""ZeRO chunks as ``torch.distributed.checkpoint`` items: the boxes of the parameter-shaped tensor a chunk covers.

ZeRO-1/2 optimizer state is a flat chunk of the dp-replicated local tensor
(:mod:`autopar.runtime.zero`), which no DTensor placement describes.  Rather
than all-gather it into the whole local tensor (the memory ZeRO exists to
save), :class:`FlatChunk` hands DCP the boxes of the parameter-shaped tensor
the chunk covers (a flat range of a row-major tensor is at most ``2·ndim − 1``
boxes): each rank writes and reads only its chunk, and the checkpoint looks
like any other.  The planners here are DCP's defaults with flat keys that look
a chunk's pieces up by offset.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of a row-major tensor of ``shape`` as boxes, in flat order.

    Each box is itself contiguous in the flat order, so box ``k`` is the next
    ``prod(sizes)`` elements of the range: a partial first row, whole rows,
    a partial last row, recursively.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    rest = tuple(shape[1:])
    inner = math.prod(rest)
    first, a = divmod(start, inner)
    last, b = divmod(stop, inner)

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(rest, lo, hi)]

    if first == last:
        return in_row(first, a, b)
    out = []
    if a:
        out += in_row(first, a, inner)
        first += 1
    if last > first:
        out.append(((first, *(0,) * len(rest)), (last - first, *rest)))
    if b:
        out += in_row(last, 0, b)
    return out


class FlatChunk:
    """One rank's ZeRO chunk of a parameter-shaped tensor, as DCP sees it: the boxes of the tensor it covers.

    ``chunk`` is the flat, zero-padded piece the optimizer holds (positions
    ``start .. stop`` of the flattened local tensor, then padding); the local
    tensor sits at ``local_offset`` in the whole tensor of shape ``size``.  DCP
    calls ``__create_write_items__`` / ``__create_chunk_list__`` for it (its
    ``_Checkpointable`` protocol) and our planners look pieces up by offset.
    """

    def __init__(
        self,
        chunk: torch.Tensor,
        local_shape: tuple[int, ...],
        local_offset: tuple[int, ...],
        size: tuple[int, ...],
        start: int,
        stop: int,
    ) -> None:
        self.chunk = chunk
        self._size = torch.Size(size)
        self.pieces: dict[tuple[int, ...], torch.Tensor] = {}
        boxes = flat_range_boxes(local_shape, start, stop)
        if math.prod(local_shape) == 0:  # an empty tensor still needs its (empty) entry in the checkpoint
            boxes = [(tuple(0 for _ in local_shape), tuple(local_shape))]
        pos = 0
        for offsets, sizes in boxes:
            n = math.prod(sizes)
            key = tuple(o + lo for o, lo in zip(offsets, local_offset, strict=True))
            self.pieces[key] = chunk[pos : pos + n].view(sizes)
            pos += n

    def size(self) -> torch.Size:
        return self._size  # DCP compares it with the saved size on load

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape),
                    properties=TensorProperties.create_from_tensor(piece),
                    size=self._size,
                ),
            )
            for offsets, piece in self.pieces.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=p.shape) for o, p in self.pieces.items()]


class SavePlanner(DefaultSavePlanner):
    """DCP's planner with a flat key space (our keys are already flat) and ZeRO chunks looked up by piece."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return (
            obj.pieces[tuple(index.offset)] if isinstance(obj, FlatChunk) else super().lookup_object(index)
        )


class LoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, flat keys, ZeRO chunks looked up by piece.

    ``set_up_planner`` skips DCP's meta-tensor initialisation, which knows
    only tensors and would drop a :class:`FlatChunk`; every target here is
    allocated on its device already.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return (
            obj.pieces[tuple(index.offset)] if isinstance(obj, FlatChunk) else super().lookup_tensor(index)
        )
