"""How the plan changes as device memory shrinks: a 7B LLaMA shape on one 8-GPU H100 node.

    .venv/bin/python benchmarks/memory_sweep.py              (80 GB down to infeasible; a few minutes)
    .venv/bin/python benchmarks/memory_sweep.py --limits 80 40 20

For each memory limit the whole search runs (every dp × tp mesh, each
parameter's ZeRO stage, micro-batches) and the row shows what it chose:
the mesh, the share of parameters at each ZeRO stage (3: sharded over dp
by its placement; 1 and 2: optimizer state, and gradients, split over dp),
the forward ops recomputed in the backward (how many, and the time they
add to the step), the micro-batch count, the estimated step time and peak
memory per device, and the memory breakdown. Below the smallest memory any
plan fits in, the row is the planner's one-line error, which names that
smallest memory.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from autopar.plans.data import param_zero_stage  # noqa: E402
from examples.models import llama  # noqa: E402

GB = 1e9


def stage_shares(plan: autopar.Plan, shapes: dict[str, int]) -> str:
    """Share of parameter elements at each ZeRO stage, e.g. ``0:12% 3:88%``."""
    weight: dict[int, int] = {}
    for entry in plan.placements.values():
        if "param" in entry:
            stage = param_zero_stage(entry)
            weight[stage] = weight.get(stage, 0) + shapes[entry["param"]]
    total = sum(weight.values()) or 1
    return " ".join(f"{z}:{100 * w / total:.0f}%" for z, w in sorted(weight.items()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limits", type=float, nargs="+", default=[80, 60, 40, 30, 24, 20, 16, 12, 8])
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences of 2048 tokens)")
    parser.add_argument("--time-limit", type=float, default=20.0, help="solver seconds per plan")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    model, inputs = llama(32, 4096, 32, 11008, seq=2048, batch=1)
    shapes = {n: math.prod(p.shape) for n, p in model.named_parameters()}
    cluster = autopar.Cluster.preset("dgx-h100", nodes=1)
    print(
        f"LLaMA-7B shape ({sum(shapes.values()) / 1e9:.2f}B parameters), {cluster.describe()}, "
        f"global batch {args.batch} x 2048, bf16-mixed AdamW"
    )
    header = (
        f"{'limit':>6}  {'mesh':>5}  {'ZeRO stage: share of params':<28} {'recompute':>15} {'mb':>3}  {'step':>8}  {'peak':>8}  "
        f"{'params':>7} {'grads':>7} {'optim':>7} {'activ':>7}  {'plan':>6}"
    )
    print(header)
    print("-" * len(header))
    for limit in args.limits:
        t = time.perf_counter()
        try:
            plan = autopar.plan(
                model,
                inputs,
                cluster,
                global_batch_size=args.batch,
                memory_limit=limit * GB,
                time_limit_s=args.time_limit,
            )
        except autopar.PlanError as err:
            print(f"{limit:>5.0f}G  {err}")
            break
        m = plan.estimate.memory
        ops = sum(1 for e in plan.placements.values() if "recompute" in e)
        recompute = f"{ops} ops +{plan.estimate.recompute_s * 1e3:.0f}ms" if ops else "none"
        print(
            f"{limit:>5.0f}G  {plan.mesh['dp']:>2}x{plan.mesh['tp']:<2}  {stage_shares(plan, shapes):<28} "
            f"{recompute:>15} {plan.microbatches:>3}  {plan.estimate.step_time_s:>7.3f}s  {m.peak / GB:>6.1f}GB  "
            f"{m.params / GB:>6.1f}G {m.grads / GB:>6.1f}G {m.optimizer / GB:>6.1f}G {m.activations / GB:>6.1f}G  "
            f"{time.perf_counter() - t:>5.1f}s"
        )


if __name__ == "__main__":
    main()
