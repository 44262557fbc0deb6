"""Where a micro-batch's gradients go, by the parameter's ZeRO stage.

A training step runs its graph (or a pipeline's stage graphs) once per
micro-batch; each run returns this rank's gradients for that micro-batch,
already weighted by its share of the loss.  They are summed over the
step as ``loss.backward()`` would sum them, into what the optimizer reads:

* no ZeRO (or ZeRO-3, whose graph returns the reduced shard): the shard's ``.grad``
  (under mixed precision the shard is the fp32 master, and the gradient is cast to it);
* ZeRO-2: the graph already reduce-scattered the gradient to this dp rank's
  chunk, which is summed into the chunk's ``.grad``;
* ZeRO-1: the whole local gradient is summed over the micro-batches and
  reduced to the chunk once, in :meth:`GradAccumulator.finish`, as DeepSpeed's
  stage 1 reduces once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from autopar.runtime.zero import ZeroChunks


def _owned(g: torch.Tensor, given: set[int]) -> torch.Tensor:
    """``g`` itself when it alone owns its storage, else a copy: a gradient the graph returns becomes ``.grad``.

    Copying every gradient would hold two of each at the end of the step; a
    view into a larger buffer (a slice of a fused gradient) or a storage
    another gradient already holds is copied, so that ``.grad`` neither keeps
    the rest of that buffer alive nor shares it.
    """
    storage = g.untyped_storage()
    whole = g.is_contiguous() and storage.nbytes() == g.numel() * g.element_size()
    if not whole or storage.data_ptr() in given:
        return g.clone()
    given.add(storage.data_ptr())
    return g


class GradAccumulator:
    """One step's gradients, summed over micro-batches into each parameter's (or ZeRO chunk's) ``.grad``.

    ``dp_partial[k]``: shard ``k``'s gradient leaves the graph as a dp-partial
    sum (placement ``P`` on the dp axis), which ZeRO-1 must reduce-scatter;
    otherwise it is already reduced and ZeRO-1 only cuts this rank's chunk.
    ``copy``: a ``.grad`` never takes a returned gradient's storage (a pipeline
    stage's gradients may share it with the values it sends back, still in flight).
    """

    def __init__(
        self,
        shards: nn.ParameterList,
        zero_stages: Sequence[int],
        zero: ZeroChunks | None,
        dp_partial: Sequence[bool],
        copy: bool = False,
    ) -> None:
        self.shards, self.zero_stages, self.zero, self.dp_partial = shards, zero_stages, zero, dp_partial
        self.copy = copy
        self._partial: dict[int, tuple[torch.Tensor, bool]] = {}  # ZeRO-1: whole local gradients

    def add(self, grads: dict[int, torch.Tensor | None], weight: float | None = None) -> None:
        """Add one graph call's gradients by shard index, times ``weight`` (its micro-batch's share) if given."""
        given: set[int] = set()  # storages of this call already handed to a .grad
        for k, g in grads.items():
            if g is not None:
                self._add(k, g if weight is None else g * weight, given)

    def _add(self, k: int, g: torch.Tensor, given: set[int]) -> None:
        stage = self.zero_stages[k]
        if stage == 1:
            held = self._partial.get(k)
            self._partial[k] = (
                (g, self.dp_partial[k]) if held is None else (held[0].add_(g), self.dp_partial[k])
            )
        elif stage == 2:
            self.zero.add_grad(k, g)
        else:
            p = self.shards[k]
            if p.grad is not None:
                p.grad.add_(g)
            elif g.dtype != p.dtype:  # mixed precision: into the fp32 gradient of the master
                p.grad = g.to(p.dtype)
            else:
                p.grad = g.clone() if self.copy else _owned(g, given)

    def finish(self) -> None:
        """ZeRO-1's reduction of the summed gradients to this rank's chunks (a collective over dp)."""
        if self._partial:
            self.zero.reduce_partials(self._partial)
        self._partial = {}
