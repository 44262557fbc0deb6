"""Step time and memory of a pipeline: contiguous stages, micro-batches, a schedule.

The model's forward is cut into ``K`` *segments* (a layer, the embedding, the
head: the units a cut cannot split); a pipeline of ``p`` stages is a choice of
``p − 1`` cut points among them.  Every figure of a segment is plain data
(:class:`Segment`), read off a solved sharding of the graph, so this module
knows nothing of torch and costs a cut set in microseconds.

Per stage ``s`` (its segments summed; times per micro-batch unless noted):

    F_s, B_s      forward and backward compute, tensor-parallel collectives included
    w_s = F_s + B_s
    c_j           sending the activations that cross cut ``j`` (and their gradients back):
                  2 · (α + bytes_j / bw) on the pipeline axis' link
    u_s           per step, after the last backward: optimizer update
                  + max(gradient sync − B_s, its last bucket)   (the sync hides under the last backward)

Step time, ``m`` micro-batches:

    GPipe, 1F1B     T = Σ_s w_s + Σ_j c_j + (m − 1) · max_s w_s + max_s u_s
    interleaved     chunks of ``v`` per device, device d holds chunks d, d + p, ...:
                    T = m · max_d W_d + (p − 1) · max_c w_c + Σ_j c_j + max_d u_d,   W_d = Σ_{c of d} w_c

With balanced stages, ``w_s = t``, the GPipe/1F1B line is ``(m + p − 1) · t``:
the bubble is ``(p − 1) / m`` of the useful work, and ``(p − 1) / (v·m)``
interleaved (REFERENCES.md, Pipelines).  The first form is Alpa's stage-slicing
objective; the sum term charges the fill and drain at the real (unbalanced)
stage times.

Memory of stage ``s`` (0-based), with ``S_s`` its saved activations per
micro-batch, ``X_s`` its largest transient and ``M_s`` its model states (with
several micro-batches on autopar's runtime, its gradients twice: the sum of the
earlier micro-batches' beside those the backward makes, :func:`held_bytes`):

    GPipe        M_s + m · S_s + X_s                       (every micro-batch's activations held)
    1F1B         M_s + min(m, p − s) · S_s + X_s           (at most p − s in flight)
    interleaved  M_d + min(m·v, (v − 1)·p + 2·(p − 1 − d) + 1) · S_d / v + X_d   (torch's warm-up depth)

The second copy of the gradients is live only from a stage's second backward on,
when GPipe, and 1F1B with all ``m ≤ p − s`` micro-batches in flight, hold one fewer:
there ``M_s + max(n · S_s, (n − 1) · S_s + G_s) + X_s`` with ``n`` the depth above
and ``G_s`` the gradients (:func:`stage_activations`). An interleaved rank runs a
backward graph per chunk, so the second copy is one chunk's, during that chunk's
backwards after its first: the rank's peak is the most, over its schedule's forwards
and backwards, of ``Σ_c n_c · S_c`` plus, at a later backward of chunk ``c``, ``G_c``
(:class:`ChunkDepth`, :func:`interleaved_activations`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.cost_models import overlap

SCHEDULES = ("1F1B", "GPipe", "interleaved")
_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved", "interleaved1f1b": "interleaved"}


def schedule_name(name: str) -> str:
    """The canonical name of a schedule ("GPipe", "1F1B", "interleaved"), any case or punctuation accepted."""
    key = str(name).replace("-", "").replace("_", "").replace(" ", "").lower()
    if key not in _NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    return _NAMES[key]


@dataclass(frozen=True)
class Segment:
    """One piece of the model between two possible cut points; figures per device of its stage."""

    name: str
    forward_s: float = 0.0  # per micro-batch
    backward_s: float = 0.0  # per micro-batch, recompute included
    saved_bytes: float = 0.0  # activations kept from the forward for the backward, per micro-batch
    transient_bytes: float = 0.0  # other memory live while it runs, one micro-batch
    state_bytes: float = 0.0  # parameters, gradients and optimizer state
    optimizer_s: float = 0.0  # per step: the update of its parameters (and ZeRO's gather of them)
    grad_sync_s: float = 0.0  # per step: gradient synchronisation over the data-parallel axis
    grad_tail_s: float = 0.0  # the part of grad_sync_s no backward can hide (the last bucket)
    boundary_bytes: float = 0.0  # sent to the next stage per micro-batch when a cut follows it
    params: int = 0  # parameter elements (whole, not per device): for the summary
    # the parts of forward_s / backward_s that a smaller micro-batch does not shrink: parameters moved to
    # the ops that read them (ZeRO-3's gathers), once per micro-batch whatever its size
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    grad_bytes: float = 0.0  # the gradients' part of state_bytes (held once more while micro-batches accumulate)
    # parameters it reads whose states are counted with an earlier segment (a head tied to the embedding):
    # (parameter, that segment's name, state bytes, gradient bytes); a stage without that segment holds a copy
    tied: tuple[tuple[str, str, float, float], ...] = ()


@dataclass(frozen=True)
class StageFigures:
    """The sums (and maxima) of a run of segments that form one stage or chunk."""

    first: int  # index of its first segment
    end: int  # one past its last segment
    forward_s: float
    backward_s: float
    saved_bytes: float
    transient_bytes: float
    state_bytes: float
    optimizer_s: float
    grad_sync_s: float
    grad_tail_s: float
    params: int
    grad_bytes: float = 0.0

    @property
    def work_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def tail_s(self) -> float:
        """Per step after the pipeline drains: the update, and the gradient sync the last backward did not hide."""
        return self.optimizer_s + max(self.grad_sync_s - self.backward_s, self.grad_tail_s, 0.0)


def tied_copies(segments: list[Segment], first: int, end: int) -> tuple[float, float]:
    """(state bytes, gradient bytes) of the parameters ``segments[first:end]`` read but whose states are counted
    with a segment outside them: the copy the stage holds of a parameter another stage holds too (the runtime
    unties it, :func:`autopar.search.pipeline.stages.untie_across_stages`), once per parameter."""
    inside = {s.name for s in segments[first:end]}
    copies: dict[str, tuple[float, float]] = {}
    for s in segments[first:end]:
        for param, owner, states, grads in s.tied:
            if owner not in inside:
                copies[param] = (states, grads)
    return sum(c[0] for c in copies.values()), sum(c[1] for c in copies.values())


def stage_figures(segments: list[Segment], first: int, end: int) -> StageFigures:
    """Figures of the stage made of ``segments[first:end]``."""
    run = segments[first:end]
    tied_states, tied_grads = tied_copies(segments, first, end)
    return StageFigures(
        first=first,
        end=end,
        forward_s=sum(s.forward_s for s in run),
        backward_s=sum(s.backward_s for s in run),
        saved_bytes=sum(s.saved_bytes for s in run),
        transient_bytes=max((s.transient_bytes for s in run), default=0.0),
        state_bytes=sum(s.state_bytes for s in run) + tied_states,
        optimizer_s=sum(s.optimizer_s for s in run),
        grad_sync_s=sum(s.grad_sync_s for s in run),
        grad_tail_s=sum(s.grad_tail_s for s in run),
        params=sum(s.params for s in run),
        grad_bytes=sum(s.grad_bytes for s in run) + tied_grads,
    )


def held_bytes(fig: Segment | StageFigures, microbatches: int) -> float:
    """Bytes a stage holds over the whole step: its model states and, while micro-batches accumulate, the sum
    of the earlier ones' gradients.

    autopar's runtime adds each micro-batch's gradients, which a stage's backward graph
    returns, into ``.grad`` after the graph ran (:mod:`autopar.runtime.grad_accumulation`),
    so from the second micro-batch on the sum is live beside the gradients the backward
    makes, as :func:`autopar.search.sharding.step_memory.accumulated` has it for a step
    without a pipeline; a runtime that adds them into one buffer as the backward makes
    them (:data:`autopar.cost_models.overlap.Runtime.grads_accumulate_in_place`) holds them once.
    """
    return fig.state_bytes + (fig.grad_bytes if grads_held_twice(microbatches) else 0.0)


def grads_held_twice(microbatches: int) -> bool:
    """Whether a step of ``microbatches`` holds the earlier micro-batches' gradient sum beside the gradients a
    backward makes (:func:`held_bytes`)."""
    return microbatches > 1 and not overlap.RUNTIME.grads_accumulate_in_place


def in_flight(schedule: str, stage: int, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Micro-batches of activations stage (device) ``stage`` holds at its peak, in units of its whole share."""
    if schedule == "GPipe":
        return float(microbatches)
    if schedule == "1F1B":
        return float(min(microbatches, stages - stage))
    if schedule == "interleaved":
        depth = min(microbatches * chunks, (chunks - 1) * stages + 2 * (stages - 1 - stage) + 1)
        return depth / chunks
    raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")


def later_in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> float:
    """Micro-batches of activations a GPipe or 1F1B stage holds at each backward after its first: the earlier
    micro-batches' gradient sum is live beside them, and not yet at the first.

    1F1B runs a forward before each later backward while micro-batches remain, so its
    depth returns to that of the first; once every micro-batch is in flight (GPipe, and
    1F1B when ``m <= p - s``) each backward frees one.
    """
    first = in_flight(schedule, stage, stages, microbatches)
    return first if schedule != "GPipe" and microbatches > first else first - 1


def stage_activations(
    saved: float, grads: float, schedule: str, stage: int, stages: int, microbatches: int
) -> tuple[float, float]:
    """(activations, the earlier micro-batches' gradient sum) a GPipe or 1F1B stage holds at its peak, whichever
    of its first backward and its later ones holds more: ``saved`` its activations per micro-batch, ``grads``
    its gradients (:func:`held_bytes`)."""
    first = in_flight(schedule, stage, stages, microbatches) * saved
    twice = grads if grads_held_twice(microbatches) else 0.0
    later = later_in_flight(schedule, stage, stages, microbatches) * saved
    return (later, twice) if later + twice > first else (first, 0.0)


@dataclass(frozen=True)
class ChunkDepth:
    """An interleaved rank at one point of its schedule: the micro-batches in flight on each of its chunks,
    and the chunk whose backward runs with its earlier micro-batches' gradient sum beside it (-1 at a forward,
    or a chunk's first backward)."""

    live: tuple[int, ...]
    summing: int = -1


def interleaved_activations(
    mine: Sequence[Segment | StageFigures], rows: Sequence[ChunkDepth], microbatches: int
) -> tuple[float, float]:
    """(activations, the gradient sum held twice) at the peak of an interleaved rank holding chunks ``mine``,
    over the points ``rows`` of its schedule (:func:`autopar.cost_models.schedule.chunk_depths`)."""
    twice = grads_held_twice(microbatches)

    def parts(row: ChunkDepth) -> tuple[float, float]:
        saved = sum(n * x.saved_bytes for n, x in zip(row.live, mine, strict=True))
        return saved, (mine[row.summing].grad_bytes if twice and row.summing >= 0 else 0.0)

    return max((parts(row) for row in rows), key=sum)


def stage_memory(fig: StageFigures, schedule: str, stage: int, stages: int, microbatches: int) -> float:
    """Peak bytes of a (non-interleaved) stage under ``schedule``."""
    activations, twice = stage_activations(fig.saved_bytes, fig.grad_bytes, schedule, stage, stages, microbatches)
    return fig.state_bytes + activations + twice + fig.transient_bytes


@dataclass
class PipelineTime:
    """A pipeline's step, split the way a person reads it."""

    step_s: float
    work_s: float  # m · the slowest stage (device): the time no schedule can remove
    bubble_s: float  # fill and drain, and imbalance: step − work − p2p − tail
    p2p_s: float  # activation and gradient transfers on the critical path
    tail_s: float  # optimizer and exposed gradient sync of the slowest stage
    stage_work_s: list[float] = field(default_factory=list)  # per stage (device), one micro-batch


def p2p_times(segments: list[Segment], cuts: list[int], p2p) -> float:
    """Σ over cuts of sending the crossing activations forward and their gradients back."""
    return sum(2.0 * p2p(segments[c - 1].boundary_bytes) for c in cuts)


def pipeline_time(
    segments: list[Segment],
    cuts: list[int],
    microbatches: int,
    schedule: str,
    p2p,
    chunks: int = 1,
) -> PipelineTime:
    """Step time of cutting ``segments`` before each index in ``cuts`` (sorted, 0 < c < K).

    ``p2p(nbytes)`` is the seconds of one send on the pipeline axis.  For the
    interleaved schedule the cuts make ``p · chunks`` pieces, dealt to devices
    round-robin; otherwise ``len(cuts) + 1`` stages.
    """
    bounds = [0, *cuts, len(segments)]
    pieces = [stage_figures(segments, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    comm = p2p_times(segments, cuts, p2p)
    m = microbatches
    if schedule == "interleaved" and chunks > 1:
        p = len(pieces) // chunks
        if p * chunks != len(pieces):
            raise ValueError(f"{len(pieces)} pieces do not deal into {chunks} chunks per device")
        per_device = [sum(pieces[c].work_s for c in range(d, len(pieces), p)) for d in range(p)]
        tails = [
            sum(pieces[c].optimizer_s for c in range(d, len(pieces), p))
            + max(
                sum(pieces[c].grad_sync_s for c in range(d, len(pieces), p))
                - sum(pieces[c].backward_s for c in range(d, len(pieces), p)),
                sum(pieces[c].grad_tail_s for c in range(d, len(pieces), p)),
                0.0,
            )
            for d in range(p)
        ]
        work = m * max(per_device)
        step = work + (p - 1) * max(x.work_s for x in pieces) + comm + max(tails)
        return PipelineTime(step, work, step - work - comm - max(tails), comm, max(tails), per_device)
    per_stage = [x.work_s for x in pieces]
    tail = max(x.tail_s for x in pieces)
    step = sum(per_stage) + comm + (m - 1) * max(per_stage) + tail
    work = m * max(per_stage)
    return PipelineTime(step, work, step - work - comm - tail, comm, tail, per_stage)


def pipeline_memory(
    segments: list[Segment],
    cuts: list[int],
    microbatches: int,
    schedule: str,
    chunks: int = 1,
    depths: Sequence[Sequence[ChunkDepth]] | None = None,
) -> list[float]:
    """Peak bytes per device of the cut set (see the module docstring).

    ``depths`` (interleaved): per device, the micro-batches in flight on each of its chunks
    at each of its forwards and backwards, as its schedule runs them
    (:func:`autopar.cost_models.schedule.chunk_depths`); the device then holds the most of
    ``Σ_c n_c · S_c``, with a chunk's gradient sum at its later backwards, over them. Without
    them, the warm-up depth spread evenly over its chunks, beside every chunk's gradient sum.
    """
    bounds = [0, *cuts, len(segments)]
    pieces = [stage_figures(segments, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    if schedule == "interleaved" and chunks > 1:
        p = len(pieces) // chunks
        out = []
        for d in range(p):
            mine = pieces[d::p]
            if depths is not None:
                held = sum(x.state_bytes for x in mine) + sum(interleaved_activations(mine, depths[d], microbatches))
            else:
                saved = in_flight("interleaved", d, p, microbatches, chunks) * sum(x.saved_bytes for x in mine)
                held = sum(held_bytes(x, microbatches) for x in mine) + saved
            out.append(held + max(x.transient_bytes for x in mine))
        return out
    p = len(pieces)
    return [stage_memory(x, schedule, s, p, microbatches) for s, x in enumerate(pieces)]
