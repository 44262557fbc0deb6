"""How much memory a training step really holds on this rank: the peak bytes of live tensors.

The estimate (:mod:`autopar.cost_models.memory`) is a model; this is the
measurement it can be checked against, and it works on CPU ranks where no
allocator keeps statistics.  It is PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker`` (a TorchDispatchMode
that follows every tensor storage created under it, by weak reference, and
sorts it as parameter, gradient, optimizer state, activation, ...), wrapped
so that autopar's runtime is tracked from the first op:

* what exists before the step (parameters, buffers, this rank's ZeRO
  chunks, gradients, optimizer state) is registered up front, since the
  tracker only sees storages created under it or handed to it;
* gradients the local graph returns are made inside the graph, where the
  tracker counts them as activations; :meth:`MemoryTracker.refresh` re-sorts
  whatever the roots hold in ``.grad`` and in optimizer state after
  ``train_step`` (``ParallelModule.measure_step_memory`` does it for you);
* MemTracker also keeps per-module snapshots and refuses a root module
  called twice, taking it for a second iteration: the local graph is one
  module called once per micro-batch, so a root module called again starts
  its module snapshot afresh (autopar reads only the per-storage totals,
  which do not depend on those snapshots).

The peak total is exact for the storages tracked (sizes of live storages,
no allocator rounding on CPU); the breakdown is the sorting at the moment of
the peak, so a gradient still inside the graph counts as an activation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

log = logging.getLogger(__name__)

# MemTracker's categories (its _MemRefType values) under shorter names
_CATEGORY = {
    "Parameter": "params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "activations",  # the backward's temporaries; the local graph runs no autograd, so rarely used
    "Other": "other",
}


class _StorageTracker(MemTracker):
    """MemTracker that accepts a root module called more than once (see the module docstring)."""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # raised before it changed anything: forget the module's last call
            del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)


@dataclass
class StepMemory:
    """Peak bytes of live tensors on this rank, and what they were at that moment."""

    peak_bytes: int
    breakdown: dict[str, int] = field(
        default_factory=dict
    )  # params, buffers, grads, optimizer, activations, other

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in self.breakdown.items() if v)
        return f"peak {self.peak_bytes / 2**20:.2f} MiB ({parts})"


class MemoryTracker:
    """A running measurement; read ``peak_bytes``, ``breakdown`` or ``current_bytes`` at any time."""

    def __init__(self, roots: tuple[nn.Module | torch.optim.Optimizer | torch.Tensor, ...]) -> None:
        self._roots = tuple(r for r in roots if r is not None)
        self._tracker = _StorageTracker()
        self._tracker.track_external(*self._roots)

    def refresh(self) -> None:
        """Re-sort the roots' parameters, gradients and optimizer state (call after gradients appear)."""
        self._tracker.track_external(*self._roots)

    def _sum(self, snapshot: dict) -> tuple[int, dict[str, int]]:
        total, parts = 0, dict.fromkeys(dict.fromkeys(_CATEGORY.values()), 0)
        for dev_snap in snapshot.values():
            for key, nbytes in dev_snap.items():
                name = getattr(key, "value", key)
                if name == "Total":
                    total += int(nbytes)
                else:
                    parts[_CATEGORY.get(name, "other")] += int(nbytes)
        return total, parts

    @property
    def peak_bytes(self) -> int:
        return self._sum(self._tracker.get_tracker_snapshot("peak"))[0]

    @property
    def current_bytes(self) -> int:
        return self._sum(self._tracker.get_tracker_snapshot("current"))[0]

    @property
    def breakdown(self) -> dict[str, int]:
        """Bytes by kind at the peak."""
        return self._sum(self._tracker.get_tracker_snapshot("peak"))[1]

    def result(self) -> StepMemory:
        total, parts = self._sum(self._tracker.get_tracker_snapshot("peak"))
        return StepMemory(total, parts)


@contextmanager
def track_memory(*roots: nn.Module | torch.optim.Optimizer | torch.Tensor | None) -> Iterator[MemoryTracker]:
    """Measure the peak bytes of live tensors inside the block on this rank.

    ``roots`` are what the block finds already in memory and should count:
    modules (their parameters, buffers and gradients), optimizers (their
    state), tensors.  Example::

        with track_memory(pm, opt) as m:
            pm.train_step(batch); m.refresh(); opt.step(); opt.zero_grad()
        m.peak_bytes, m.breakdown
    """
    tracker = MemoryTracker(tuple(roots))
    with tracker._tracker:
        yield tracker
    log.debug("step memory: %s", tracker.result())
