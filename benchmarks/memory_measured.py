"""Estimated against measured peak memory of a training step, per ZeRO stage and recompute setting.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_measured.py          (2 gloo processes, about a minute)
    PYTHONPATH=. .venv/bin/python benchmarks/memory_measured.py --precision bf16-mixed
    PYTHONPATH=. .venv/bin/python benchmarks/memory_measured.py --pipelines   (2 stages on 2 processes)
    PYTHONPATH=. .venv/bin/python benchmarks/memory_measured.py --pipelines --precision bf16-mixed
    PYTHONPATH=. .venv/bin/python benchmarks/memory_measured.py --pipelines --dp 2   (ZeRO 0-3, 4 processes)

GPT-2 with 2 layers of hidden 128 on sequences of 64 (``examples.models.gpt2_tiny_long``),
AdamW (fp32, or bf16 copies of fp32 masters under ``--precision bf16-mixed``),
data parallel over 2 CPU processes.  For each ZeRO stage (0-3) and recompute
setting:

* ``none`` — the search's plan with ``fixed={"zero": z, "recompute": "none"}``; its own estimate;
* ``op-level`` — the search's plan with 85% of that memory: the MILP recomputes
  forward ops of its choice to fit; its own estimate;
* ``full`` — the search's plan with ``fixed={"zero": z, "recompute": "full"}``
  (every layer replayed from its input); its own estimate.

Every plan then runs on 2 processes in one launch; each rank measures the peak
bytes of live tensors over a step (``pm.measure_step_memory``: train_step,
optimizer step, zero_grad) and the table shows estimate, measurement and their
ratio per rank.

``--pipelines``: the same model as a pipeline of 2 stages on 2 processes under
each schedule (GPipe, 1F1B, interleaved with two chunks a rank) at 2 micro-batches
with recompute none and full and at 4 without; each rank against its stage's
estimate (``plan.stages[...]["memory_bytes"]``). With ``--dp 2`` each stage runs
over 2 ranks (4 processes), at 2 micro-batches without recompute, under every
ZeRO stage.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.verify.memory_check import measure_plans, pipeline_plans, setting_plans  # noqa: E402
from examples.models import gpt2_tiny_long  # noqa: E402

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2, help="gradient accumulation steps per step")
    parser.add_argument("--precision", default="fp32", help="fp32 (default), bf16-mixed or fp16-mixed")
    parser.add_argument("--pipelines", action="store_true", help="pipelines of 2 stages per schedule instead")
    parser.add_argument("--dp", type=int, default=1, help="with --pipelines: ranks a stage, under every ZeRO stage")
    args = parser.parse_args()
    if args.dp < 1 or (args.dp > 1 and not args.pipelines):
        parser.error("--dp takes a positive number of ranks a stage, and only with --pipelines")
    logging.basicConfig(level=logging.ERROR)
    if args.pipelines:
        _pipelines(args.precision, args.dp)
        return

    t = time.perf_counter()
    cases = setting_plans(gpt2_tiny_long, args.processes, microbatches=args.microbatches, precision=args.precision)
    planned = time.perf_counter() - t
    t = time.perf_counter()
    measured = measure_plans(gpt2_tiny_long, args.processes, [c.plan for c in cases])
    ran = time.perf_counter() - t
    print(
        f"GPT-2 2 x 128, sequence 64, global batch 8 in {args.microbatches} micro-batches, {args.precision} AdamW, "
        f"dp={args.processes} on CPU "
        f"(planning {planned:.0f} s, one launch {ran:.0f} s)"
    )
    print("| ZeRO | recompute | rank | estimated (MiB) | measured (MiB) | measured / estimated |")
    print("|---:|---|---:|---:|---:|---:|")
    for k, case in enumerate(cases):
        for rank, per_plan in enumerate(measured):
            got = per_plan[k].peak_bytes
            print(
                f"| {case.zero} | {case.recompute} | {rank} | {case.estimate.memory.peak / MIB:.2f} | "
                f"{got / MIB:.2f} | {got / case.estimate.memory.peak:.3f} |"
            )


def _pipelines(precision: str, dp: int) -> None:
    t = time.perf_counter()
    if dp == 1:
        plans = pipeline_plans(gpt2_tiny_long, precision=precision)
    else:
        plans = pipeline_plans(gpt2_tiny_long, precision=precision, settings=[(2, "none")], dp=dp, zeros=range(4))
    planned = time.perf_counter() - t
    t = time.perf_counter()
    measured = measure_plans(gpt2_tiny_long, 2 * dp, plans)
    ran = time.perf_counter() - t
    print(
        f"GPT-2 2 x 128, sequence 64, global batch 8, {precision} AdamW, pp=2 x dp={dp} on CPU "
        f"(planning {planned:.0f} s, one launch {ran:.0f} s)"
    )
    print(
        "| schedule | micro-batches | recompute | ZeRO | rank | estimated (MiB) | measured (MiB) "
        "| measured / estimated |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for k, plan in enumerate(plans):
        stage = {s["device"]: s["memory_bytes"] for s in plan.stages}
        for rank, per_plan in enumerate(measured):
            got, estimate = per_plan[k].peak_bytes, stage[rank // dp]  # the mesh is pp x dp
            print(
                f"| {plan.schedule} | {plan.microbatches} | {plan.recompute} | {plan.zero} | {rank} | "
                f"{estimate / MIB:.2f} | {got / MIB:.2f} | {got / estimate:.3f} |"
            )


if __name__ == "__main__":
    main()
