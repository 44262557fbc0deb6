"""Run a pipeline schedule over the graph stages of one rank.

The *order* of work comes from ``torch.distributed.pipelining``: its schedule
classes write, per rank, the list of actions a schedule takes (forward or
backward of a stage on a micro-batch) and its lowering pass inserts the sends
and receives between neighbouring stages in an order that cannot deadlock.
GPipe is ``ScheduleGPipe``'s order, 1F1B is the order ``Schedule1F1B``
runs, interleaved 1F1B is ``ScheduleInterleaved1F1B``'s.

The *work* is autopar's: a stage is not an ``nn.Module`` run under autograd
but two graphs (:mod:`autopar.codegen.stage_split`), the forward and the
backward of the stage's share of the local joint graph, with every tensor- and
data-parallel collective inside.  The executor here runs those graphs for each
action, keeps what a forward saves for its backward until that backward runs,
and moves the values that cross stages with ``isend`` / ``irecv`` between the
ranks that hold neighbouring stages at the same data- and tensor-parallel
coordinate.  Each transfer has its own tag, so a receive can only ever match
its own send.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    _Action,
    _ComputationType,
)

from autopar.codegen.stage_split import StageGraphs, ValueSpec
from autopar.runtime.graph_call import call_graph

log = logging.getLogger(__name__)

@dataclass
class StageRunner:
    """One stage of this rank: its graphs and how to read its arguments for a micro-batch."""

    graphs: StageGraphs
    args: Callable[[list[int], int], list[torch.Tensor]]  # (argument slots, micro-batch) -> tensors
    on_grads: Callable[[int, list[int], list[torch.Tensor | None]], None]  # micro-batch, parameter indices, gradients
    on_updates: Callable[[list[int], list[torch.Tensor]], None] = lambda slots, values: None  # new buffer values
    saved: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    received_back: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    to_send: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    to_send_back: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # by micro-batch


def _tag(direction: int, boundary: int, microbatch: int, index: int, stages: int) -> int:
    """A distinct tag per transfer: direction (0 forward, 1 backward), cut, micro-batch, tensor."""
    return ((microbatch * 2 + direction) * stages + boundary) * 4096 + index


def run_schedule(
    actions: list[_Action],
    runners: dict[int, StageRunner],
    stages: int,
    peer: Callable[[int], int],
    draws: Callable[[int], contextlib.AbstractContextManager] = lambda mb: contextlib.nullcontext(),
    device: torch.device | None = None,
) -> None:
    """Run this rank's ``actions``; ``peer(stage)`` is the global rank holding ``stage`` at this coordinate.

    Each forward and backward runs inside ``draws(micro-batch)``: the state its random ops draw under.
    Values received from other stages land on ``device`` (the rank's; None: the CPU).
    """
    exchange = _Exchange(stages, peer, device)
    for a in actions:
        s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
        runner = runners[s]
        if kind in (RECV_F, RECV_B):
            exchange.post_receive(kind, runner.graphs, s, mb)
        # a cut may carry no value one way (no receive is posted then): no gradient flows back into a stage
        # that trains nothing (frozen layers below the trained ones); the schedule lists its send all the same
        elif kind == SEND_F:
            exchange.send(runner.to_send.pop(mb, []), peer(s + 1), 0, s, mb)
        elif kind == SEND_B:
            exchange.send(runner.to_send_back.pop(mb, []), peer(s - 1), 1, s - 1, mb)
        elif kind == FORWARD:
            _forward(runners, s, mb, stages, exchange, draws)
        elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
            _backward(runners, s, mb, exchange, draws)
    exchange.finish()


class _Exchange:
    """This rank's point-to-point transfers: receives posted and not yet waited on, sends in flight."""

    def __init__(self, stages: int, peer: Callable[[int], int], device: torch.device | None = None) -> None:
        self.stages, self.peer, self.device = stages, peer, device
        self.pending_recv: dict[tuple[str, int, int], tuple[list[torch.Tensor], list]] = {}
        self.sends: dict[tuple[int, int], list] = {}  # (direction, cut) -> the last micro-batch's sends in flight

    def post_receive(self, kind: _ComputationType, g: StageGraphs, s: int, mb: int) -> None:
        # a receive dropped before its wait would let the backend write into freed memory
        key = ("f" if kind == RECV_F else "b", s, mb)
        if key in self.pending_recv:
            raise RuntimeError(f"pipeline schedule posts receive {key} twice")
        if not (g.recv_forward if kind == RECV_F else g.recv_backward):
            return  # nothing crosses the cut this way (see ``run_schedule``)
        if kind == RECV_F:
            self.pending_recv[key] = self._recv(g.recv_forward, self.peer(s - 1), 0, s - 1, mb)
        else:
            self.pending_recv[key] = self._recv(g.recv_backward, self.peer(s + 1), 1, s, mb)

    def _recv(
        self, specs: list[ValueSpec], src: int, direction: int, boundary: int, mb: int
    ) -> tuple[list[torch.Tensor], list]:
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
        works = [
            dist.irecv(b, src=src, tag=_tag(direction, boundary, mb, i, self.stages)) for i, b in enumerate(bufs)
        ]
        return bufs, works

    def send(self, tensors: list[torch.Tensor], dst: int, direction: int, boundary: int, mb: int) -> None:
        """Send one micro-batch's values over a cut, once the previous micro-batch's over it have arrived.

        A send's tensors live until it is waited for. Waited for at the end of the step, as
        ``torch.distributed.pipelining``'s runtime does, a stage would hold every micro-batch's
        values it sent (m of them each way) beside its activations; waited for here, at most the
        previous micro-batch's. In the schedules autopar runs (GPipe, 1F1B, interleaved 1F1B;
        ``tests/test_pipeline.py`` trains under each) the wait does not deadlock: the receiving
        stage takes a cut's micro-batches in order and posts each receive before it computes that
        micro-batch, which it reaches before this stage can run the next one (in the steady state
        this stage's backward needs the receiver's gradient of it; in the warm-up the receiver
        waits for nothing else).
        """
        stream = (direction, boundary)
        for _, w in self.sends.pop(stream, []):
            w.wait()
        sent = []
        for i, t in enumerate(tensors):
            t = t.contiguous()
            sent.append((t, dist.isend(t, dst=dst, tag=_tag(direction, boundary, mb, i, self.stages))))
        self.sends[stream] = sent

    def wait(self, key: tuple[str, int, int]) -> list[torch.Tensor]:
        bufs, works = self.pending_recv.pop(key)
        for w in works:
            w.wait()
        return bufs

    def finish(self) -> None:
        """Wait for every send; a receive never waited on is a schedule error."""
        for sent in self.sends.values():
            for _, w in sent:
                w.wait()
        self.sends = {}
        if self.pending_recv:
            raise RuntimeError(f"pipeline schedule never consumed receives {sorted(self.pending_recv)}")


def _forward(
    runners: dict[int, StageRunner],
    s: int,
    mb: int,
    stages: int,
    exchange: _Exchange,
    draws: Callable[[int], contextlib.AbstractContextManager],
) -> None:
    """Stage ``s``'s forward of micro-batch ``mb``: its activations saved, its outputs handed on or queued."""
    runner = runners[s]
    g = runner.graphs
    if mb in runner.received:
        received = runner.received.pop(mb)
    else:
        received = exchange.wait(("f", s, mb)) if g.recv_forward else []
    with draws(mb):
        out = call_graph(g.forward, *runner.args(g.forward_args, mb), *received)
    n_send, n_saved = len(g.send_forward), len(g.saved)
    sent = list(out[:n_send])
    runner.saved[mb] = list(out[n_send : n_send + n_saved])
    if g.updates:
        runner.on_updates(g.updates, list(out[n_send + n_saved : n_send + n_saved + len(g.updates)]))
    if g.has_loss:
        runner.losses[mb] = out[-1]
    if s + 1 < stages and s + 1 in runners:  # the next stage is on this rank: hand over directly
        runners[s + 1].received[mb] = sent
    elif g.send_forward:
        runner.to_send[mb] = sent


def _backward(
    runners: dict[int, StageRunner],
    s: int,
    mb: int,
    exchange: _Exchange,
    draws: Callable[[int], contextlib.AbstractContextManager],
) -> None:
    """Stage ``s``'s backward of micro-batch ``mb``: gradients to ``on_grads``, input gradients handed back."""
    runner = runners[s]
    g = runner.graphs
    if g.recv_backward:
        grads_in = runner.received_back.pop(mb) if mb in runner.received_back else exchange.wait(("b", s, mb))
    else:
        grads_in = []
    with draws(mb):
        out = call_graph(g.backward, *runner.args(g.backward_args, mb), *runner.saved.pop(mb), *grads_in)
    n_back = len(g.send_backward)
    back = list(out[:n_back])
    runner.on_grads(mb, g.grads, list(out[n_back:]))
    if s > 0 and s - 1 in runners:
        runners[s - 1].received_back[mb] = back
    elif g.send_backward:
        runner.to_send_back[mb] = back
