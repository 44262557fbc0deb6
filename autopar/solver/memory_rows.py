"""Memory rows: the time steps at which a memory limit can bind, and sums over them.

A node's memory is held over a live interval of a global time order. A limit on the
total live memory is one row per time step, but most steps are implied by a
neighbour (their live set is a subset of the neighbour's), so only the locally
maximal ones are kept. The reductions (:mod:`autopar.solver.reduce`), the
heuristics and the MILP all read memory through these rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class MemoryRows:
    """The time steps whose memory rows can matter, and where each node's live interval falls.

    Only segments of the time axis on which the live set is locally maximal are kept:
    something starts at the segment's first step and something ends right after its last.
    Any other segment's live set is a subset of a neighbouring segment's, and memory is
    non-negative, so its row is implied by that neighbour's.
    """

    times: np.ndarray  # first time step of each kept row, increasing
    r0: np.ndarray  # per node: first kept row at which it is live
    r1: np.ndarray  # per node: one past the last such row (r0 == r1: live at no kept row)

    @property
    def count(self) -> int:
        return len(self.times)


def memory_rows(intervals: np.ndarray, all_segments: bool = False) -> MemoryRows:
    """Rows for live intervals ``[start, end)`` given as an (N, 2) integer array.

    ``all_segments`` keeps every segment between consecutive interval boundaries (no
    implied-row removal), which the unreduced formulation uses as a reference.
    """
    starts, ends = intervals[:, 0], intervals[:, 1]
    live = ends > starts
    if not live.any():
        zero = np.zeros(len(starts), dtype=np.int64)
        return MemoryRows(np.zeros(0, dtype=np.int64), zero, zero.copy())
    s, e = starts[live], ends[live]
    bounds = np.unique(np.concatenate([s, e]))
    if all_segments:
        times = bounds[:-1]
    else:
        times = bounds[:-1][np.isin(bounds[:-1], s) & np.isin(bounds[1:], e)]
    r0 = np.searchsorted(times, starts, "left")
    r1 = np.where(live, np.searchsorted(times, ends, "left"), r0)
    return MemoryRows(times, r0.astype(np.int64), r1.astype(np.int64))


def range_sums(r0: np.ndarray, r1: np.ndarray, weights: np.ndarray, n_rows: int) -> np.ndarray:
    """Per row, the sum of ``weights[i]`` over items ``i`` whose range ``[r0, r1)`` covers it."""
    if n_rows == 0:
        return np.zeros(0)
    delta = np.bincount(r0, weights, minlength=n_rows + 1) - np.bincount(r1, weights, minlength=n_rows + 1)
    return np.cumsum(delta[:n_rows])

