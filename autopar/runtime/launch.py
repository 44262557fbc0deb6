"""Local launcher: run a function on every rank of a cluster of local processes.

``autopar.launch(fn, cluster, *args)`` is torchrun for one machine without a
command line: it starts ``cluster.world_size`` processes, gives each torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), starts the
process group on the cluster's backend (gloo for ``Cluster.local``), calls
``fn(*args)`` and returns what every rank returned, in rank order.

A rank that raises or dies ends the job: the launcher stops the other ranks at
once, so none hangs in a collective waiting for it, and raises
:class:`~autopar.core.errors.LaunchError` naming the rank and its error.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.core.errors import LaunchError
from autopar.hardware.cluster import Cluster

log = logging.getLogger(__name__)


PRELOAD = ["autopar"]
"""Modules the fork server imports once, so that every rank starts with them loaded.

Ranks are forked from a fork server (Python 3.14's default start method on
Linux) rather than spawned: a spawned rank imports torch and autopar again,
seconds of CPU each, which on a small machine is most of a short job. The fork
server only imports: a rank forked from it inherits no thread, CUDA context or
process group of the caller, which is what makes a plain fork unsafe with torch. Append to this list before the
first launch to load more (a test suite adds its model zoo).
"""


def _context() -> Any:
    """The fork server where the platform has one, spawn elsewhere (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _job_store(timeout_s: float) -> dist.TCPStore:
    """The job's rendezvous store, served by the launcher on a port the OS picks and it keeps.

    The launcher holds the port for the job's whole life. Choosing a free port
    and leaving rank 0 to bind it later lets another job (a second launcher
    on the same machine, or any socket's ephemeral port) take it in between,
    and ranks of two jobs then meet in one store.
    """
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def _worker(fn, rank, world, port, backend, args, results, collective_timeout_s) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    faulthandler.enable()  # a rank killed by a signal prints where it was
    try:
        timeout = timedelta(seconds=collective_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        # plain pickle: tensors sent through torch's shared-memory reductions die with the process
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the job
        log.debug("rank %d failed", rank, exc_info=True)
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
        results.put((rank, False, f"{type(exc).__name__}: {exc}{at}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _died(rank: int, exitcode: int, then: str) -> LaunchError:
    """The error for a rank that exited without returning: by its exit code, or the signal that killed it."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        how = f"was killed by {name} (a native crash in torch or its backend)"
        return LaunchError(f"rank {rank} {how} before returning; {then}", signal=-exitcode)
    return LaunchError(f"rank {rank} died (exit code {exitcode}) before returning; {then}")


def _died_silently(procs: list, done: dict, reporter: int, grace_s: float = 2.0) -> int | None:
    """A rank that exited with an error code without reporting, waiting ``grace_s`` for its exit."""
    deadline = time.monotonic() + grace_s
    while True:
        for r, p in enumerate(procs):
            if r != reporter and r not in done and p.exitcode not in (None, 0):
                return r
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def launch(
    fn: Callable[..., Any],
    cluster: Cluster | int,
    *args: Any,
    timeout_s: float = 900.0,
    collective_timeout_s: float = 120.0,
    crash_retries: int = 0,
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of ``cluster`` (a Cluster or a process count); results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). The job is
    stopped after ``timeout_s`` seconds, and a collective that waits longer than
    ``collective_timeout_s`` fails on its rank. A job whose rank is killed by a
    signal runs again, with a warning, up to ``crash_retries`` times: torch's gloo
    backend on rare occasions corrupts its heap in a collective's worker thread
    (``scripts/gloo_inflight_repro.py`` shows it without autopar). A rank that
    raises fails the job at once.
    """
    for attempt in range(crash_retries + 1):
        try:
            return _launch_once(fn, cluster, args, timeout_s, collective_timeout_s)
        except LaunchError as exc:
            if exc.signal is None or attempt == crash_retries:
                raise
            log.warning("%s; running the job again (%d of %d)", exc, attempt + 1, crash_retries)
    raise AssertionError("unreachable")


def _launch_once(
    fn: Callable[..., Any], cluster: Cluster | int, args: tuple, timeout_s: float, collective_timeout_s: float
) -> list[Any]:
    """One run of the job: see :func:`launch`."""
    if isinstance(cluster, int):
        cluster = Cluster.local(cluster)
    world = cluster.world_size
    backend = cluster.backend or "gloo"
    ctx = _context()
    results = ctx.Queue()
    store = _job_store(collective_timeout_s)
    port = store.port
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world, port, backend, args, results, collective_timeout_s),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise _died(dead[0], procs[dead[0]].exitcode, "the other ranks were stopped") from None
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"the job did not finish within {timeout_s:.0f} s; all ranks were stopped"
                    ) from None
                continue
            if not ok:
                dead = _died_silently(procs, out, rank)
                if dead is not None:  # the others' errors are only the echo of a lost peer
                    then = f"rank {rank} then failed and the other ranks were stopped"
                    raise _died(dead, procs[dead].exitcode, then)
                raise LaunchError(f"rank {rank} failed: {value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return [out[r] for r in range(world)]
