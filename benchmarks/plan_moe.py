"""Mixtures of experts at scale, default options, against hand-set layouts costed by the same model.

    .venv/bin/python benchmarks/plan_moe.py                       (both models)
    .venv/bin/python benchmarks/plan_moe.py --model mixtral --time-limit 60
    .venv/bin/python benchmarks/plan_moe.py --model mixtral --batch 64   (another global batch)

Mixtral-8x7B (HuggingFace MixtralConfig's defaults: 32 layers, 8 experts, top-2) on
64 H100s (8 DGX nodes) at 512 sequences of 4096 tokens, and a DeepSeek-V3-shaped model
(DeepseekV3Config's defaults: 61 layers, the first 3 dense, hidden 7168, 256 routed
experts, top-8, one shared expert) on 2,048 H100s (256 nodes) at 15,360 sequences of
4096 tokens (DeepSeek-V3's final batch), on the meta device, bf16-mixed AdamW, 80 GB.
Each model is planned with the default search, then its reference layouts are costed
with ``fixed`` (the search chooses what they leave open):

- Mixtral: the experts not split (``ep`` 1: every expert on every rank of its stage,
  tensor parallelism inside them impossible with [gate; up] concatenated); the same on
  dp 8 x tp 8 under ZeRO-3 (the layout the search stopped 11% short of at 7b7b877); ep 8
  over the second axis of dp 8 x tp 8, the rest searched (NeMo's performance
  summary, containers 25.02 and 25.04, trains Mixtral-8x7B on 64 GPUs at TP 1, PP 1, EP 8:
  docs.nvidia.com/nemo-framework/user-guide/latest/performance/performance-summary.html, on
  B200 and GB200 in FP8, which are not modelled); and Megatron-LM's recommended training
  layout, TP 1 x EP 8 x PP 4 (examples/mixtral/README.md: "For training, the recommended model
  parallel config is TP1EP8PP4"), here pp 4 x dp 2 x tp 8 with the experts split over the
  8 and the rest searched (Megatron's 16 data-parallel ranks are 2 x 8 here; its distributed
  optimizer is left to the search, whose ZeRO shards over the 2 of dp only);
- DeepSeek-V3: its published layout (DeepSeek-V3 Technical Report, 2024, section 3.2:
  PP 16, EP 64 across 8 nodes, ZeRO-1 data parallelism), here pp 16 x dp 64 x tp 2 with
  the experts split over the 64 ranks of dp (the second axis of 2 splits the batch
  unless the search finds better).

Routing is assumed uniform and dropless, as Megatron-Core's MoE routes by default (no
capacity factor) and torchtitan's does: the busiest expert-parallel rank is charged its
expected share of the pairs, 1.005 times the mean at Mixtral's 32,768 tokens a rank over
ep 8 (:mod:`autopar.cost_models.experts`). The rows at 7b7b877 and 666e10c were charged a
fixed 1.25, the capacity GShard and the Switch Transformer pad every expert's buffer to,
which a dropless router does not.
``ref / plan`` is the reference's step time over the plan's: above 1, the plan is faster
(steps to the millisecond and the ratio to four places: 1.000 against 1.000 said nothing).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from examples.models import deepseek_v3, mixtral  # noqa: E402

MODELS = {
    "mixtral": dict(
        make=mixtral,
        nodes=8,
        batch=512,
        refs={
            "ep 1": {"ep": 1},
            "ep 1, dp 8 x tp 8, ZeRO-3": {"ep": 1, "dp": 8, "tp": 8, "zero": 3},
            "ep 8 (NeMo: TP 1 x EP 8)": {"ep": 8, "dp": 8, "tp": 8},
            "Megatron-LM: TP 1 x EP 8 x PP 4": {"pp": 4, "dp": 2, "tp": 8, "ep": 8},
        },
    ),
    "deepseek_v3": dict(
        make=deepseek_v3,
        nodes=256,
        batch=15360,
        refs={"DeepSeek-V3 (PP 16 x EP 64, ZeRO-1)": {"pp": 16, "dp": 64, "tp": 2, "ep": 64, "zero": 1}},
    ),
}


def _mesh(plan: autopar.Plan) -> str:
    m = plan.mesh
    ep = f" (ep {m['ep']})" if m.get("ep", 1) > 1 else ""
    return f"dp {m['dp']} x tp {m['tp']} x pp {m['pp']}{ep}, ZeRO-{plan.zero}, {plan.microbatches} mb"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--time-limit", type=float, default=60.0, help="the plan's time_limit_s (default: the API's)")
    parser.add_argument("--batch", type=int, help="the global batch in sequences (default: each model's own)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for name in args.model:
        spec = MODELS[name]
        cluster = autopar.Cluster.preset("dgx-h100", nodes=spec["nodes"])
        start = time.perf_counter()
        model, inputs = spec["make"]()
        batch = args.batch or spec["batch"]
        plan = autopar.plan(model, inputs, cluster, global_batch_size=batch, time_limit_s=args.time_limit)
        took = time.perf_counter() - start
        print(plan.summary(width=120))
        rows.append((name, cluster.world_size, "plan", plan, took, plan))
        for label, fixed in spec["refs"].items():
            ref = autopar.plan(
                model, inputs, cluster, global_batch_size=batch, fixed=fixed, time_limit_s=args.time_limit
            )
            rows.append((name, cluster.world_size, label, ref, None, plan))
    print()
    print("| model | GPUs | layout | mesh | step s | fits | planning s | ref / plan |")
    print("|---|--:|---|---|--:|---|--:|--:|")
    for name, gpus, label, p, took, plan in rows:
        ratio = p.estimate.step_time_s / plan.estimate.step_time_s
        planning = f"{took:.0f}" if took is not None else ""
        print(
            f"| {name} | {gpus} | {label} | {_mesh(p)} | {p.estimate.step_time_s:.3f} | {p.estimate.fits} "
            f"| {planning} | {ratio:.4f} |"
        )


if __name__ == "__main__":
    main()
