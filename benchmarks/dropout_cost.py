"""What dropout costs a plan: the same model planned with HuggingFace's dropout (0.1) and without it.

    .venv/bin/python benchmarks/dropout_cost.py            # about two minutes

Dropout is element-wise and random: sharded like its input, each rank drawing
its own elements' numbers (``autopar.ops.rng``), it costs a memory-bound pass and
a saved mask, and attention's dropout lives inside the fused attention kernel
(``autopar.ops.dropout_attention``) as it does on a GPU.  A planner that
replicates a random op draws the whole global batch's mask on every device;
one that costs attention dropout on the math path keeps a
batch × heads × seq × seq matrix per layer.  Either would show here as a step
far slower than without dropout.

GPT-2 1.7B (24 layers, hidden 2304, 24 heads, vocab 51200, sequence 2048) on 4
DGX A100 nodes, global batch 512, bf16-mixed AdamW: fixed to dp = 32 (pure data
parallel, as a user would fix it) and searched.  Prints one table, dropout 0.1
against 0 as a ratio of step times in the same run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from examples.models import gpt  # noqa: E402


def _plan(dropout: float, fixed: dict | None) -> tuple[autopar.Plan, float]:
    model, inputs = gpt(24, 2304, 24, vocab=51200, seq=2048, batch=1, dropout=dropout)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=4)
    start = time.perf_counter()
    plan = autopar.plan(model, inputs, cluster, global_batch_size=512, fixed=fixed)
    return plan, time.perf_counter() - start


def _shape(plan: autopar.Plan) -> str:
    m = plan.mesh
    return f"dp {m['dp']} x tp {m['tp']} x pp {m.get('pp', 1)}, ZeRO-{plan.zero}, m = {plan.microbatches}"


def main() -> None:
    print("| plan | dropout | mesh | step (s) | MFU | dropout 0.1 / 0 | planning (s) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, fixed in (("fixed dp = 32", {"dp": 32}), ("searched", None)):
        rows = [(p, *_plan(p, fixed)) for p in (0.0, 0.1)]
        base = rows[0][1].estimate.step_time_s
        for p, plan, took in rows:
            est = plan.estimate
            print(
                f"| {name} | {p} | {_shape(plan)} | {est.step_time_s:.3f} | {est.mfu * 100:.1f}% | "
                f"{est.step_time_s / base:.3f} | {took:.1f} |"
            )


if __name__ == "__main__":
    main()
