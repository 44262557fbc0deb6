"""Long context: LLaMA-3-8B at 131,072 tokens a sequence on 64 H100s, the default search beside context parallelism.

    .venv/bin/python benchmarks/plan_long_context.py
    .venv/bin/python benchmarks/plan_long_context.py --seq 262144 --time-limit 60

LLaMA-3-8B's shape (32 layers, hidden 4096, 32 heads sharing 8 KV heads, intermediate
14336, vocab 128256) calling scaled-dot-product attention with ``is_causal`` as
torchtitan does, on the meta device, batch 8 (one sequence per data-parallel rank of
dp 8), bf16-mixed AdamW, 80 GB, on 8 DGX H100 nodes. The default search is run, then
context-parallel layouts are costed with ``fixed`` (the search chooses the rest):

- cp 8 over the second axis beside dp 8 (torchtitan's FSDP beside context parallelism);
- cp 8 over the dp axis's ranks beside tp 8 (Megatron-LM's ``--context-parallel-size 8``
  beside ``--tensor-model-parallel-size 8``; the batch is then whole on every rank).

``ref / plan`` is the layout's step time over the default plan's: above 1, the default is faster.
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

REFS = {"dp 8 x cp 8": {"cp": 8, "dp": 8}, "cp 8 (dp ranks) x tp 8": {"cp": 8, "tp": 8}}


def _mesh(plan: autopar.Plan) -> str:
    m = plan.mesh
    cp = f" (cp {m['cp']})" if m.get("cp", 1) > 1 else ""
    return f"dp {m['dp']} x tp {m['tp']} x pp {m['pp']}{cp}, ZeRO-{plan.zero}, {plan.recompute}, {plan.microbatches} mb"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=131072, help="tokens a sequence (default 131,072)")
    parser.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="the plan's time_limit_s (default: the API's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    cluster = autopar.Cluster.preset("dgx-h100", nodes=8)
    model, inputs = llama(32, 4096, 32, 14336, vocab=128256, seq=args.seq, kv_heads=8, attention="causal")
    rows = []
    start = time.perf_counter()
    plan = None
    try:
        plan = autopar.plan(model, inputs, cluster, global_batch_size=args.batch, time_limit_s=args.time_limit)
        rows.append(("default search", plan, time.perf_counter() - start))
        print(plan.summary(width=120))
    except autopar.PlanError as err:
        print(f"default search: {err}")
    for label, fixed in REFS.items():
        start = time.perf_counter()
        ref = autopar.plan(
            model, inputs, cluster, global_batch_size=args.batch, fixed=fixed, time_limit_s=args.time_limit
        )
        rows.append((label, ref, time.perf_counter() - start))
    print()
    print(f"LLaMA-3-8B, {args.batch} x {args.seq:,} tokens, 64 H100s")
    print()
    print("| layout | mesh | step s | peak GB | fits | planning s | ref / plan |")
    print("|---|---|--:|--:|---|--:|--:|")
    for label, p, took in rows:
        ratio = f"{p.estimate.step_time_s / plan.estimate.step_time_s:.3f}" if plan is not None else ""
        print(
            f"| {label} | {_mesh(p)} | {p.estimate.step_time_s:.2f} | {p.estimate.memory.peak / 1e9:.1f} "
            f"| {p.estimate.fits} | {took:.0f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
