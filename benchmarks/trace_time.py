"""Tracing a rank's graph: the sharding interpreter with and without DTensor's dispatch of the ops it runs unchanged.

    PYTHONPATH=. python benchmarks/trace_time.py                    (every family of examples/families.py)
    PYTHONPATH=. python benchmarks/trace_time.py --only llama,t5 --layout flowing

``parallelize`` traces each rank's local graph (:func:`autopar.codegen.shard.shard_graph`): the joint graph
re-run node by node on DTensors under ``make_fx``. For an op DTensor would run on the local shards with its
arguments unchanged, the interpreter runs it so itself (``SKIP_DTENSOR_DISPATCH``) instead of letting
DTensor enumerate the op's strategies again to find the one the plan already chose; the traced graph is
the same, code for code (checked here on every row, and by tests/test_rank_trace.py).

Each family (its default config, ``examples/families.py``) under a random dp 2 x tp 2 layout (``--layout``:
"random" draws every op's strategy among all it has, "flowing" follows its producers), traced for the last
of 4 ranks on a fake process group in this one process: a trace first to warm the caches, then the two ways
alternately, ``--repeats`` times each; the table gives the medians and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from autopar.capture.joint import capture  # noqa: E402
from autopar.codegen import shard, shard_interpreter  # noqa: E402
from autopar.codegen.transfer import transfer_placements  # noqa: E402
from autopar.verify.oracle import layout_plan  # noqa: E402
from examples import families  # noqa: E402


def _trace(captured, chosen, mesh, skip: bool) -> tuple[float, str]:
    shard_interpreter.SKIP_DTENSOR_DISPATCH = skip
    start = time.perf_counter()
    code = shard.shard_graph(captured, chosen, mesh).gm.code
    return time.perf_counter() - start, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated families (default: all)")
    parser.add_argument("--layout", default="random", choices=["random", "flowing"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(families.FAMILIES)
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    four = autopar.Cluster.local(4)
    rows, totals = [], [0.0, 0.0]
    for name in names:
        torch.manual_seed(0)
        model, inputs = families.FAMILIES[name]()
        plan = layout_plan(model, inputs, four, 2, 2, args.layout)
        captured = capture(model, inputs)
        chosen, _ = transfer_placements(plan.placements, captured, (2, 2))
        _trace(captured, chosen, mesh, True)  # warm
        times: dict[bool, list[float]] = {True: [], False: []}
        codes = set()
        for _ in range(args.repeats):
            for skip in (False, True):
                t, code = _trace(captured, chosen, mesh, skip)
                times[skip].append(t)
                codes.add(code)
        skipped, dispatched = statistics.median(times[True]), statistics.median(times[False])
        totals[0] += skipped
        totals[1] += dispatched
        nodes = len(captured.gm.graph.nodes)
        rows.append((name, nodes, dispatched, skipped, "yes" if len(codes) == 1 else "NO"))
        print(f"{name:>12} {nodes:6d} nodes  dispatched {dispatched:6.2f} s  skipped {skipped:6.2f} s", flush=True)
    shard_interpreter.SKIP_DTENSOR_DISPATCH = True
    dist.destroy_process_group()
    print(f"\n{args.layout} dp 2 x tp 2 layouts, last of 4 ranks; medians of {args.repeats}\n")
    print("| family | joint nodes | DTensor's dispatch s | skipped s | skipped / dispatch | same code |")
    print("|---|--:|--:|--:|--:|---|")
    for name, nodes, dispatched, skipped, same in rows:
        print(f"| {name} | {nodes} | {dispatched:.2f} | {skipped:.2f} | {skipped / dispatched:.3f} | {same} |")
    print(f"| total | | {totals[1]:.2f} | {totals[0]:.2f} | {totals[0] / totals[1]:.3f} | |")


if __name__ == "__main__":
    main()
