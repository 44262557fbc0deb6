"""LLaMA-2-70B on 64 H100s (8 DGX nodes): the plan, why it fits in 80 GB, and how long planning takes.

    .venv/bin/python benchmarks/plan_70b.py                  (every mesh, pipelines included; minutes)
    .venv/bin/python benchmarks/plan_70b.py --pp 1           (dp x tp meshes only)
    .venv/bin/python benchmarks/plan_70b.py --pp 1 --dp 8 --tp 8
    .venv/bin/python benchmarks/plan_70b.py --batch 512 --json plan.json

The LLaMA-2-70B shape (80 layers, hidden 8192, 64 heads sharing 8 KV heads,
intermediate 28672, vocab 32000) on sequences of 4096, on the meta device;
global batch 1024 sequences (4M tokens), bf16-mixed AdamW, the H100's 80 GB.
Prints the plan's summary (what is sharded, what is recomputed, the memory at
its peak against the limit), the planning time and the planner's own peak
resident memory.  Too slow for the test suite; ``tests/test_search.py`` plans
smaller LLaMA shapes.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from examples.models import llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024, help="global batch, in sequences of 4096 tokens")
    parser.add_argument("--pp", type=int, default=None, help="fix the pipeline size (1: no pipeline)")
    parser.add_argument("--dp", type=int, default=None, help="fix the data-parallel size")
    parser.add_argument("--tp", type=int, default=None, help="fix the tensor-parallel size")
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds in all")
    parser.add_argument("--json", help="save the plan here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    start = time.perf_counter()
    model, inputs = llama(80, 8192, 64, 28672, vocab=32000, seq=4096, batch=1, kv_heads=8)
    cluster = autopar.Cluster.preset("dgx-h100", nodes=8)
    fixed = {k: v for k, v in (("pp", args.pp), ("dp", args.dp), ("tp", args.tp)) if v is not None} or None
    plan = autopar.plan(
        model, inputs, cluster, global_batch_size=args.batch, fixed=fixed, time_limit_s=args.time_limit
    )
    took = time.perf_counter() - start
    print(plan.summary(width=120))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"planned in {took:.0f} s (model built on the meta device, capture included); planner RSS {rss:.1f} GB")
    if args.json:
        plan.save(args.json)


if __name__ == "__main__":
    main()
