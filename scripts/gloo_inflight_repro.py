"""Gloo's heap corruption (``malloc(): unaligned tcache chunk detected``) without autopar's graphs.

    PYTHONPATH=. .venv/bin/python scripts/gloo_inflight_repro.py                 # 12 jobs of 300 steps
    PYTHONPATH=. .venv/bin/python scripts/gloo_inflight_repro.py --threads 1     # groups with one worker thread
    PYTHONPATH=. .venv/bin/python scripts/gloo_inflight_repro.py --pattern one   # one collective in flight at a time
    PYTHONPATH=. .venv/bin/python scripts/gloo_inflight_repro.py --pattern sync  # dist.all_reduce / all_gather

Four local processes; ranks {0, 1} and {2, 3} form groups, as a tp axis does.
Each step issues twelve functional all-reduces and all-gathers on the group
(``--pattern many``) and only then waits for them, the pattern that
``autopar.codegen.collective_order.schedule_collectives`` forbids; ``--pattern one``
waits for each before the next, as autopar's graphs do; ``--pattern sync``
calls torch.distributed's blocking collectives instead. The abort is rare on
an idle machine and frequent with the CPUs oversubscribed: run two copies at
once on 2 cores. A job whose rank is killed (exit code -6 or -11) counts as a
failure; the script prints each job and the count, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from autopar.core.errors import LaunchError
from autopar.runtime.launch import launch

SHAPES = [(1, 16, 128), (16, 256), (8, 64), (1, 8, 4, 16), (), (32,)]


def _job(pattern: str, steps: int, threads: int | None) -> None:
    rank = dist.get_rank()
    options = None
    if threads is not None:
        options = dist.ProcessGroupGloo._Options()
        options._threads = threads
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    groups = [dist.new_group([0, 1], pg_options=options), dist.new_group([2, 3], pg_options=options)]
    name = groups[rank // 2].group_name
    ops = torch.ops._c10d_functional
    if pattern == "sync":
        for _ in range(steps):
            for shape in SHAPES:
                dist.all_reduce(torch.randn(shape), group=groups[rank // 2])
                x = torch.randn(shape or (1,))
                out = torch.empty((2 * x.shape[0], *x.shape[1:]))
                dist.all_gather_into_tensor(out, x, group=groups[rank // 2])
        return
    for _ in range(steps):
        pending = []
        for shape in SHAPES:
            pending.append(ops.all_reduce(torch.randn(shape), "sum", name))
            if pattern == "one":
                ops.wait_tensor(pending.pop())
            pending.append(ops.all_gather_into_tensor(torch.randn(shape or (1,)), 2, name))
            if pattern == "one":
                ops.wait_tensor(pending.pop())
        for t in pending:
            ops.wait_tensor(t)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pattern", choices=["many", "one", "sync"], default="many")
    parser.add_argument(
        "--threads", type=int, default=None, help="worker threads per gloo group (gloo's default: 2)"
    )
    args = parser.parse_args()
    failed = 0
    for job in range(args.jobs):
        try:
            launch(_job, 4, args.pattern, args.steps, args.threads)
            print(f"job {job}: ok", flush=True)
        except LaunchError as exc:
            failed += 1
            print(f"job {job}: {exc}", flush=True)
    print(
        f"{failed} of {args.jobs} jobs failed (pattern {args.pattern}, threads {args.threads or 'default'})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
