"""LLaMA-3-405B on 8,192 and 16,384 H100s, default options, against Meta's published layout.

    .venv/bin/python benchmarks/plan_405b.py                      (both cluster sizes)
    .venv/bin/python benchmarks/plan_405b.py --gpus 16384 --time-limit 60

The Llama 3 405B shape (126 layers, hidden 16384, 128 heads sharing 8 KV heads,
intermediate 53248, vocab 128256) on sequences of 8192, on the meta device; a
global batch of 2048 sequences (16M tokens), bf16-mixed AdamW, the H100's 80 GB,
DGX H100 nodes. Each row plans with the default search (capture included in the
planning time), then costs Meta's layout (The Llama 3 Herd of Models, 2024,
Table 4: tp 8, pp 16, dp 64 on 8,192 GPUs and dp 128 on 16,384) with the same
model: ``fixed`` pins dp, tp and pp, and the search chooses the rest (ZeRO
stage, recompute, micro-batches, schedule) as for any plan. ``Meta / plan`` is
the layout's step time over the plan's: above 1, the plan is faster.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from examples.models import llama  # noqa: E402

META_TP, META_PP = 8, 16
BATCH = 2048  # sequences of 8192 tokens: 16M tokens a step


def _mesh(plan: autopar.Plan) -> str:
    m = plan.mesh
    return f"dp {m['dp']} x tp {m['tp']} x pp {m.get('pp', 1)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--time-limit", type=float, default=60.0, help="the plan's time_limit_s (default: the API's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for gpus in args.gpus:
        cluster = autopar.Cluster.preset("dgx-h100", nodes=gpus // 8)
        start = time.perf_counter()
        model, inputs = llama(126, 16384, 128, 53248, vocab=128256, seq=8192, batch=1, kv_heads=8)
        plan = autopar.plan(model, inputs, cluster, global_batch_size=BATCH, time_limit_s=args.time_limit)
        took = time.perf_counter() - start
        fixed = {"dp": gpus // (META_TP * META_PP), "tp": META_TP, "pp": META_PP}
        meta = autopar.plan(model, inputs, cluster, global_batch_size=BATCH, fixed=fixed, time_limit_s=args.time_limit)
        rows.append((gpus, plan, took, meta))
        print(plan.summary(width=120))
    print()
    print("| GPUs | plan | step s | zero | mb | planning s | Meta's layout | step s | Meta / plan |")
    print("|--:|---|--:|--:|--:|--:|---|--:|--:|")
    for gpus, plan, took, meta in rows:
        a, b = plan.estimate.step_time_s, meta.estimate.step_time_s
        print(
            f"| {gpus} | {_mesh(plan)} | {a:.3f} | {plan.zero} | {plan.microbatches} | {took:.1f} | "
            f"{_mesh(meta)} (zero {meta.zero}, {meta.microbatches} mb) | {b:.3f} | {b / a:.4f} |"
        )


if __name__ == "__main__":
    main()
