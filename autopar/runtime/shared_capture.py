"""One capture for a job of CPU processes: rank 0 traces the model, every other rank takes its graph.

Every rank of a job must run the same joint graph, and capture is deterministic:
each rank capturing the model itself gives the same graph at N times the work.
On GPUs that work runs on each rank's own CPU cores, in parallel; a job of CPU
processes (gloo on one host: the tests, the demo) runs all N captures on the
same cores, where they were half of ``parallelize``'s time at 4 ranks. There,
rank 0 captures and the others receive its graph, as they receive its weights
(DDP's rule): torch.fx's ``GraphPickler`` carries each node's fake value and
metadata, and loading it costs a tenth of a capture.

Ranks on GPUs still capture each their own graph: it names the rank's device
(factory ops' ``device=``), so rank 0's would not fit them. A graph that cannot
be sent (``GraphPickler`` refuses it) and a capture that fails on rank 0 are
captured by every rank itself: the failure is then every rank's, with its own
one-line message, not a rank waiting on a graph that never comes.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options

from autopar.capture.graph import CapturedGraph, graph_digest
from autopar.core.errors import RuntimeMismatchError

log = logging.getLogger(__name__)

_ALL_OF_IT = Options(ops_filter=None, node_metadata_key_filter=None)
_EACH = "every rank captures its own"  # what rank 0 sends in place of a graph it cannot send


def capture_once(make: Callable[[], CapturedGraph], device: torch.device) -> CapturedGraph:
    """``make()``'s graph on every rank: made by rank 0 and sent to the others when the job runs on CPUs.

    Where every rank captures its own graph, the ranks check that they traced the same one
    (:func:`same_graph_on_every_rank`).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    if device.type != "cpu":
        return same_graph_on_every_rank(make())
    if dist.get_rank() == 0:
        try:
            captured = make()
        except BaseException:
            dist.broadcast_object_list([None], src=0)  # the others capture, and fail, themselves
            raise
        data = _to_bytes(captured)
        dist.broadcast_object_list([_EACH if data is None else data], src=0)
        return same_graph_on_every_rank(captured) if data is None else captured
    box = [None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return make()
    return same_graph_on_every_rank(make()) if box[0] == _EACH else _from_bytes(box[0])


def same_graph_on_every_rank(captured: CapturedGraph) -> CapturedGraph:
    """``captured``, once every rank has traced the same graph (:func:`autopar.capture.graph.graph_digest`).

    A model whose forward iterates a set of strings traces its ops in the order of the process's hash
    seed, which Python draws anew for every process (``torchrun`` sets none): ranks that traced other
    orders would issue their collectives in other orders and wait on each other for ever. Every rank
    raises the same one-line error instead.
    """
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, graph_digest(captured.gm))
    other = next((r for r, d in enumerate(digests) if d != digests[0]), None)
    if other is not None:
        raise RuntimeMismatchError(
            f"rank {other} traced another graph of {captured.model_name} than rank 0 (its ops in another order): "
            "a forward that iterates a set follows each process's hash seed; launch every rank with the same "
            "PYTHONHASHSEED (e.g. PYTHONHASHSEED=0)"
        )
    return captured


def _to_bytes(captured: CapturedGraph) -> bytes | None:
    """The graph as bytes; None for one that holds what only its own process has (a fold's template, a
    re-capture function) or that ``GraphPickler`` refuses."""
    if captured.fold is not None or captured.recapture is not None:
        return None
    try:
        graph = GraphPickler.dumps(captured.gm, _ALL_OF_IT)
        return pickle.dumps((graph, dataclasses.replace(captured, gm=None)))
    except Exception as e:  # noqa: BLE001 — any refusal means: every rank captures itself
        log.info("every rank captures its own graph: rank 0's cannot be sent (%s)", e)
        return None


def _from_bytes(data: bytes) -> CapturedGraph:
    graph, rest = pickle.loads(data)
    return dataclasses.replace(rest, gm=GraphPickler.loads(graph, FakeTensorMode()))
