"""The order of a pipeline schedule: which forward, backward, send and receive each pipeline rank runs when.

Written by ``torch.distributed.pipelining``'s schedule classes (GPipe is
``ScheduleGPipe``'s order, 1F1B the order ``Schedule1F1B`` runs, interleaved 1F1B
``ScheduleInterleaved1F1B``'s), with its lowering pass inserting the sends and
receives between neighbouring stages in an order that cannot deadlock. The runtime
executes it (:mod:`autopar.runtime.pipeline`); the plan's pictures draw it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    _Action,
    _add_send_recv,
)

from autopar.cost_models.pipeline import ChunkDepth, schedule_name


@dataclass
class _StageStub:
    """What torch's schedule classes read off a stage to write their action lists."""

    stage_index: int
    num_stages: int
    group_rank: int
    group_size: int
    submod: object = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def schedule_actions(schedule: str, ranks: int, stages: int, microbatches: int) -> dict[int, list[_Action]]:
    """Every rank's actions (compute, sends and receives) for ``stages`` stages on ``ranks`` pipeline ranks.

    Stage ``s`` runs on rank ``s % ranks`` (round-robin, as interleaved 1F1B
    deals them).  Actions other than forward, backward, send and receive
    (FSDP's unshard / reshard, gradient reduction) are dropped: autopar's
    graphs reduce their gradients themselves.
    """
    schedule = schedule_name(schedule)
    if schedule in ("GPipe", "1F1B"):
        if stages != ranks:
            raise ValueError(f"{schedule} runs one stage per rank; use the interleaved schedule for more")
        if schedule == "GPipe":
            order = ScheduleGPipe(_StageStub(0, stages, 0, ranks), microbatches).pipeline_order
        else:
            order = _one_f_one_b(stages, microbatches)
        compute = {
            r: [a for a in acts if a is not None and a.computation_type in (FORWARD, FULL_BACKWARD)]
            for r, acts in order.items()
        }
        actions = _add_send_recv(compute, stage_to_rank=lambda s: s % ranks, num_stages=stages)
    else:
        per_rank = stages // ranks
        if per_rank * ranks != stages:
            raise ValueError(f"{stages} stages do not deal evenly onto {ranks} pipeline ranks")
        stubs = [_StageStub(k * ranks, stages, 0, ranks) for k in range(per_rank)]
        actions = ScheduleInterleaved1F1B(stubs, microbatches).pipeline_order_with_comms
    keep = (FORWARD, FULL_BACKWARD, SEND_F, RECV_F, SEND_B, RECV_B)
    return {r: [a for a in acts if a.computation_type in keep] for r, acts in actions.items()}


def _one_f_one_b(stages: int, microbatches: int) -> dict[int, list[_Action]]:
    """Each stage's compute order under ``Schedule1F1B``: its warm-up forwards, then a backward and a forward.

    The order torch's ``Schedule1F1B._step_microbatches`` runs (stage ``s``
    warms up with ``min(m, p − s)`` forwards, so at most ``p − s`` micro-batches
    are in flight), written as actions for the send/receive lowering: that
    class's own action list (``pipeline_order``) is written for its
    visualiser and does not match what it runs.
    """
    out = {}
    for s in range(stages):
        warm = min(microbatches, stages - s)
        acts = [_Action(s, FORWARD, i) for i in range(warm)]
        f, b = warm, 0
        while f < microbatches:
            acts += [_Action(s, FULL_BACKWARD, b), _Action(s, FORWARD, f)]
            f, b = f + 1, b + 1
        acts += [_Action(s, FULL_BACKWARD, i) for i in range(b, microbatches)]
        out[s] = acts
    return out


@functools.cache
def chunk_depths(ranks: int, chunks: int, microbatches: int) -> tuple[tuple[ChunkDepth, ...], ...]:
    """Interleaved 1F1B as the runtime runs it: per pipeline rank, after each of its forwards and at each
    backward of a chunk after that chunk's first, the micro-batches in flight (run forward, backward not
    yet) on each of its ``chunks`` chunks (:class:`autopar.cost_models.pipeline.ChunkDepth`).

    Its warm-up runs more forwards of a rank's first chunk than of its last, so the
    activations it holds are not ``depth / chunks`` of every chunk's: a rank whose first
    chunk saves the most holds more (:func:`autopar.cost_models.pipeline.pipeline_memory`).

    Past ``4 · ranks`` micro-batches the counts a rank goes through are those of ``4 · ranks``
    (the warm-up fills, then each backward retires a micro-batch as a forward starts one),
    so the schedule is written at that many: torch's writes it in time quadratic in the
    micro-batches (3.4 s at 960 micro-batches on 16 ranks).
    """
    written = min(microbatches, 4 * ranks)
    while not interleaved_runs(ranks, written):  # a count torch refuses: the next it runs holds at least as many
        written += 1
    return in_flight_counts(schedule_actions("interleaved", ranks, ranks * chunks, written), ranks, chunks)


def interleaved_runs(ranks: int, microbatches: int) -> bool:
    """Whether ``ScheduleInterleaved1F1B`` runs ``microbatches`` on ``ranks`` pipeline ranks: it deals them in
    rounds of ``max(1, m // ranks)`` and refuses a count those rounds do not divide (7 on 3 ranks)."""
    rounds = max(1, microbatches // ranks)
    return microbatches >= 1 and microbatches % rounds == 0


def in_flight_counts(
    actions: dict[int, list[_Action]], ranks: int, chunks: int
) -> tuple[tuple[ChunkDepth, ...], ...]:
    """Per rank of ``actions``, the distinct in-flight counts of its chunks after each of its forwards, and
    at each backward of a chunk after its first (the chunk's earlier gradient sum live beside it)."""
    out = []
    for _, acts in sorted(actions.items()):
        live, done = [0] * chunks, [0] * chunks
        seen = []
        for a in acts:
            c = a.stage_index // ranks
            if a.computation_type == FORWARD:
                live[c] += 1
                seen.append(ChunkDepth(tuple(live)))
            elif a.computation_type == FULL_BACKWARD:
                if done[c]:
                    seen.append(ChunkDepth(tuple(live), c))
                live[c] -= 1
                done[c] += 1
        out.append(tuple(dict.fromkeys(seen)))
    return tuple(out)
