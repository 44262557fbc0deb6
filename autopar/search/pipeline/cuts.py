"""Pipeline stage cuts: where to cut a model into ``p`` contiguous stages, exactly.

Given the model as ``K`` segments (:class:`autopar.cost_models.pipeline.Segment`),
a number of stages ``p``, micro-batches ``m`` and a schedule, choose cut
points ``0 < c_1 < ... < c_{p-1} < K`` minimising the step time of
:func:`autopar.cost_models.pipeline.pipeline_time` subject to every stage
fitting the memory limit.  For GPipe and 1F1B the objective is

    T(cuts) = Σ_s w_s + Σ_j c_j + (m − 1) · max_s w_s + max_s u_s

which is a sum and two maxima over stages.  A dynamic program over (stages
used, segments covered) keeps, for every prefix, the Pareto set of
(Σ w + Σ c, max w, max u) of its partial cut sets: T is non-decreasing in each
of the three, so a dominated prefix can never complete into the optimum, and
the program is exact (it returns the brute-force optimum; the tests check that
against every cut set of small models).  Memory is checked per stage as it is
closed, since a stage's memory depends only on its own segments and index, and
so is that the stage holds a parameter (the runtime steps an optimizer on each
stage's own parameters).
Cost: O(p · K² · F) for fronts of size F (a few tens on transformer layers).

Alpa's inter-op pass (``stage_construction.py``) solves the same slicing by
enumerating the maximum stage time and a DP on the sum; the Pareto front does
both in one pass.  Interleaved schedules deal chunks round-robin, which breaks
contiguity of a device's work: small cases are enumerated exactly, large ones
are cut into ``p·v`` chunks balanced by the same DP (max chunk work) and costed
as dealt.

Torch-free: numbers in, indices out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autopar.cost_models.pipeline import (
    PipelineTime,
    Segment,
    pipeline_memory,
    pipeline_time,
    stage_activations,
    tied_copies,
)
from autopar.cost_models.schedule import chunk_depths

# Enumerate every cut set when there are at most this many (interleaved schedules; tests).
EXHAUSTIVE_LIMIT = 2_000


@dataclass
class CutChoice:
    """The best cut set found for one (stages, micro-batches, schedule)."""

    cuts: list[int]
    time: PipelineTime
    memory: list[float]  # peak bytes per device
    exact: bool  # True: the optimum of the cost model over all cut sets


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def best_cuts(
    segments: list[Segment],
    stages: int,
    microbatches: int,
    schedule: str,
    p2p: Callable[[float], float],
    memory_limit: float = math.inf,
    chunks: int = 1,
) -> CutChoice | None:
    """The fastest cut of ``segments`` into ``stages`` stages that fits; None when no cut set fits."""
    k = len(segments)
    pieces = stages * (chunks if schedule == "interleaved" else 1)
    if stages < 1 or pieces > k:
        return None
    if pieces == 1:
        return _costed(segments, [], microbatches, schedule, p2p, memory_limit, chunks, exact=True)
    if schedule == "interleaved" and chunks > 1:
        if math.comb(k - 1, pieces - 1) <= EXHAUSTIVE_LIMIT:
            return brute_force_cuts(segments, stages, microbatches, schedule, p2p, memory_limit, chunks)
        cuts = _balanced_chunks(segments, pieces, p2p)
        return _costed(segments, cuts, microbatches, schedule, p2p, memory_limit, chunks, exact=False)
    return _pareto_dp(segments, stages, microbatches, schedule, p2p, memory_limit)


def _costed(segments, cuts, m, schedule, p2p, limit, chunks, exact) -> CutChoice | None:
    if not _every_device_holds_parameters(segments, cuts, schedule, chunks):
        return None
    memory = stage_memory_of(segments, cuts, m, schedule, chunks)
    if max(memory) > limit:
        return None
    return CutChoice(list(cuts), pipeline_time(segments, cuts, m, schedule, p2p, chunks), memory, exact)


def _every_device_holds_parameters(segments: list[Segment], cuts: list[int], schedule: str, chunks: int) -> bool:
    """Whether every pipeline device gets a parameter: the runtime steps an optimizer on each stage's own
    parameters, and an optimizer over none is refused (a model without parameters passes)."""
    if not any(s.params for s in segments):
        return True
    bounds = [0, *cuts, len(segments)]
    held = [sum(s.params for s in segments[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    if schedule == "interleaved" and chunks > 1:
        p = len(held) // chunks
        held = [sum(held[d::p]) for d in range(p)]
    return all(held)


def brute_force_cuts(
    segments: list[Segment],
    stages: int,
    microbatches: int,
    schedule: str,
    p2p: Callable[[float], float],
    memory_limit: float = math.inf,
    chunks: int = 1,
) -> CutChoice | None:
    """Every cut set, costed by the cost model: the reference the DP is tested against."""
    pieces = stages * (chunks if schedule == "interleaved" else 1)
    best = None
    for cuts in itertools.combinations(range(1, len(segments)), pieces - 1):
        choice = _costed(segments, list(cuts), microbatches, schedule, p2p, memory_limit, chunks, exact=True)
        if choice is not None and (best is None or choice.time.step_s < best.time.step_s):
            best = choice
    return best


def stage_memory_of(segments: list[Segment], cuts: list[int], m: int, schedule: str, chunks: int) -> list[float]:
    """Peak bytes per device of the cut set, an interleaved schedule's by the order the runtime runs it."""
    depths = chunk_depths((len(cuts) + 1) // chunks, chunks, m) if schedule == "interleaved" and chunks > 1 else None
    return pipeline_memory(segments, cuts, m, schedule, chunks, depths)


class _Ranges:
    """O(1) figures of any run of segments, from prefix sums (and a table of running maxima)."""

    def __init__(self, segments: list[Segment], microbatches: int) -> None:
        self.fwd = _prefix([s.forward_s for s in segments])
        self.bwd = _prefix([s.backward_s for s in segments])
        self.saved = _prefix([s.saved_bytes for s in segments])
        self.states = _prefix([s.state_bytes for s in segments])
        self.grads = _prefix([s.grad_bytes for s in segments])
        self.segments, self.any_tied = segments, any(s.tied for s in segments)
        self.opt = _prefix([s.optimizer_s for s in segments])
        self.sync = _prefix([s.grad_sync_s for s in segments])
        self.sync_tail = _prefix([s.grad_tail_s for s in segments])
        k = len(segments)
        # transient[i][j - i - 1]: the largest transient of segments[i:j]
        self.params = _prefix([s.params for s in segments])
        self.transient = []
        for i in range(k):
            row, top = [], 0.0
            for j in range(i, k):
                top = max(top, segments[j].transient_bytes)
                row.append(top)
            self.transient.append(row)

    def figures(self, i: int, j: int) -> tuple[float, float, tuple[float, float, float, float]]:
        """(work per micro-batch, tail per step, memory as (states, gradients, saved, transient)) of
        segments[i:j]."""
        back = self.bwd[j] - self.bwd[i]
        work = self.fwd[j] - self.fwd[i] + back
        sync = self.sync[j] - self.sync[i]
        tail = self.opt[j] - self.opt[i] + max(sync - back, self.sync_tail[j] - self.sync_tail[i], 0.0)
        held, grads = self.states[j] - self.states[i], self.grads[j] - self.grads[i]
        if self.any_tied:
            tied_states, tied_grads = tied_copies(self.segments, i, j)
            held, grads = held + tied_states, grads + tied_grads
        return (work, tail, (held, grads, self.saved[j] - self.saved[i], self.transient[i][j - i - 1]))


def _pareto_dp(segments, p, m, schedule, p2p, limit) -> CutChoice | None:
    k = len(segments)
    send = [2.0 * p2p(s.boundary_bytes) for s in segments]  # a cut after segment i costs send[i]
    ranges = _Ranges(segments, m)
    # front[j]: Pareto states covering segments[:j] with the stages closed so far:
    # (sum of work and sends, max work, max tail, cuts)
    front: dict[int, list[tuple[float, float, float, tuple[int, ...]]]] = {0: [(0.0, 0.0, 0.0, ())]}
    for s in range(p):
        nxt: dict[int, list] = {}
        last = s == p - 1
        for i, states in front.items():
            ends = [k] if last else range(i + 1, k - (p - 1 - s) + 1)
            for j in ends:
                work, tail, (held, grads, saved, transient) = ranges.figures(i, j)
                if held + sum(stage_activations(saved, grads, schedule, s, p, m)) + transient > limit:
                    continue
                if ranges.params[-1] and ranges.params[j] == ranges.params[i]:
                    continue  # a stage without a parameter: the runtime has nothing to step there
                add = work + (0.0 if j == k else send[j - 1])
                bucket = nxt.setdefault(j, [])
                for total, top, worst, cuts in states:
                    bucket.append(
                        (total + add, max(top, work), max(worst, tail), cuts if j == k else (*cuts, j))
                    )
        front = {j: _pareto(states) for j, states in nxt.items()}
        if not front:
            return None
    finals = front.get(k, [])
    if not finals:
        return None
    best = min(finals, key=lambda x: x[0] + (m - 1) * x[1] + x[2])
    return _costed(segments, list(best[3]), m, schedule, p2p, math.inf, 1, exact=True)


def _pareto(states: list[tuple]) -> list[tuple]:
    """States not dominated in (sum, max work, max tail); ties keep the first."""
    states = sorted(states, key=lambda x: (x[0], x[1], x[2]))
    kept: list[tuple] = []
    for st in states:
        if not any(o[1] <= st[1] and o[2] <= st[2] for o in kept):  # kept ones have sum <= st's
            kept.append(st)
    return kept


def _balanced_chunks(segments: list[Segment], pieces: int, p2p) -> list[int]:
    """Cuts into ``pieces`` contiguous chunks minimising the largest chunk's work (then the sum).

    The chunks' work adds up to the same total however they are cut, so "then the sum" is the
    fewest seconds of sends at the cuts. Two dynamic programmes over (chunks, segments covered),
    each O(pieces · k²) in numpy: the least largest chunk B (the linear partition problem),
    then the least sends over cuts whose every chunk does at most B.
    """
    k = len(segments)
    work = np.array(_prefix([s.forward_s + s.backward_s for s in segments]))
    # a chunk ending at j (< k) sends across a cut after segment j - 1; the last chunk sends nothing
    send = np.array([0.0] + [2.0 * p2p(s.boundary_bytes) for s in segments[:-1]] + [0.0])
    span = work[None, :] - work[:, None]  # span[i, j]: the work of segments[i:j]
    before = np.tri(k + 1, k + 1, -1, dtype=bool).T  # before[i, j]: i < j
    largest = np.full(k + 1, np.inf)
    largest[0] = 0.0
    for _ in range(pieces):
        largest = np.where(before, np.maximum(largest[:, None], span), np.inf).min(axis=0)
    bound = largest[k]
    sends = np.full(k + 1, np.inf)
    sends[0] = 0.0
    came_from = []
    for _ in range(pieces):
        total = np.where(before & (span <= bound), sends[:, None] + send[None, :], np.inf)
        came_from.append(total.argmin(axis=0))
        sends = total.min(axis=0)
    cuts, j = [], k
    for back in reversed(came_from):
        j = int(back[j])
        cuts.append(j)
    return sorted(cuts)[1:]
