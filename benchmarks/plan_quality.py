"""Is the searched plan at least as good as the layouts people set by hand? One cost model for all.

    .venv/bin/python benchmarks/plan_quality.py              (GPT and LLaMA shapes; a few minutes)
    .venv/bin/python benchmarks/plan_quality.py --quick      (small shapes, one node)

For each model and cluster the MILP's plan (every dp × tp mesh searched)
is compared with three baselines, each costed by the same model by fixing
the parameters' placements and letting the solver place the rest:

* pure data parallel: mesh dp = all devices, every parameter replicated;
* ZeRO-3 alone: mesh dp = all devices, every parameter sharded over dp;
* Megatron: for each tp > 1 that divides a node, column-parallel first
  linears (q, k, v, gate, up, c_attn, c_fc), row-parallel second ones
  (o, down, c_proj), vocab-parallel embedding and head, replicated norms;
  the best tp is reported.

Each row prints the step time of each and the ratio best-baseline / plan
(≥ 1 means the search found a plan at least as fast). The search solves
these same layouts as seeds beside the unrestricted MILP
(``autopar.search.sharding.seeds``), so a ratio below 1 can only come from the
solver's time limits; the "found by" column of a plan's summary says
whether the MILP or a seed won.

    .venv/bin/python benchmarks/plan_quality.py --scale      (GPT 39B-175B on 512-1536 A100s; pipelines)

At scale the whole ``autopar.plan`` (meshes with and without a pipeline, most
promising first, ``time_limit_s=40``) is timed and compared with the best hand-set
Megatron-LM configuration costed by the same model: for every tp ≤ 8 and pp
that divides the layers, Megatron's layout inside each stage, the layers
split evenly over the stages, 1F1B, the best micro-batch count.  The
shapes and GPU counts are those of Narayanan et al. 2021 (Table 1).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar import Cluster  # noqa: E402
from autopar.api.planner import plan as autopar_plan  # noqa: E402
from autopar.cost_models.graph_cache import captured_with_stats  # noqa: E402
from autopar.cost_models.memory import PRECISIONS  # noqa: E402
from autopar.search.pipeline.mesh import solve_pipeline_mesh  # noqa: E402
from autopar.search.sharding.mesh import search_meshes, solve_mesh  # noqa: E402
from autopar.search.sharding.request import MeshRequest  # noqa: E402
from autopar.search.sharding.seeds import seed_filter  # noqa: E402
from autopar.search.sharding.strategies import enumerate_strategies  # noqa: E402
from examples.models import gpt, llama  # noqa: E402


def run(name: str, build, cluster: Cluster, batch: int, time_limit: float) -> dict:
    model, inputs = build()
    t = time.perf_counter()
    captured, _ = captured_with_stats(model, inputs, batch=batch)
    prec = PRECISIONS["bf16-mixed"]
    limit = float(cluster.memory_bytes)
    best, _ = search_meshes(captured, cluster, prec, "adamw", limit, time_limit)
    plan_s = time.perf_counter() - t
    params = {p.placeholder: p.name for p in captured.params}
    conv1d = type(model).__name__.startswith("GPT2")
    world = cluster.world_size
    out = {"model": name, "devices": world, "plan": best.estimate.step_time_s if best else float("inf")}
    out["plan_mesh"] = f"{best.mesh.dp}x{best.mesh.tp}" if best else "-"
    out["plan_s"] = plan_s
    dp_mesh = cluster.check_mesh(dp=world, tp=1)
    strategies = enumerate_strategies(captured.gm, (world, 1), ("dp", "tp"))
    for kind in ("dp", "zero3"):
        # recompute as the search solves its seeds: the same problem, so a ratio >= 1 by construction
        request = MeshRequest(captured, cluster, dp_mesh, prec, "adamw", limit, recompute=True)
        res = solve_mesh(request, time_limit / 4, allowed=seed_filter(kind, params, conv1d), strategies=strategies)
        out[kind] = res.estimate.step_time_s if res.estimate.fits else float("inf")
    best_meg, best_tp = float("inf"), None
    tp = 2
    while tp <= min(cluster.gpus_per_node, world):
        if batch % (world // tp) == 0:
            mesh = cluster.check_mesh(dp=world // tp, tp=tp)
            request = MeshRequest(captured, cluster, mesh, prec, "adamw", limit, recompute=True)
            res = solve_mesh(request, time_limit / 4, allowed=seed_filter("megatron", params, conv1d))
            if res.estimate.fits and res.estimate.step_time_s < best_meg:
                best_meg, best_tp = res.estimate.step_time_s, tp
        tp *= 2
    out["megatron"], out["megatron_tp"] = best_meg, best_tp
    return out


# Narayanan et al. 2021, Table 1: (name, layers, hidden, heads, GPUs, global batch)
SCALE = [
    ("GPT 39B", 48, 8192, 64, 512, 1536),
    ("GPT 76B", 60, 10240, 80, 768, 1792),
    ("GPT 146B", 80, 12288, 96, 1536, 2304),
    ("GPT 175B", 96, 12288, 96, 1024, 1536),
]


def hand_set_megatron(captured, cluster: Cluster, layers: int, time_limit: float) -> tuple[float, str]:
    """The fastest Megatron-LM configuration set by hand, costed by autopar's model: (step, "tp x pp x dp")."""
    prec = PRECISIONS["bf16-mixed"]
    limit = float(cluster.memory_bytes)
    world = cluster.world_size
    best = (float("inf"), "-")
    params = {p.placeholder: p.name for p in captured.params}
    seed = seed_filter("megatron", params, True)
    for tp in (1, 2, 4, 8):
        for pp in range(1, layers + 1):
            if layers % pp or world % (tp * pp) or captured.batch_size % (world // (tp * pp)):
                continue
            mesh = cluster.check_mesh(dp=world // (tp * pp), tp=tp, pp=pp)
            request = MeshRequest(captured, cluster, mesh, prec, "adamw", limit, recompute=True)
            if pp == 1:
                res = solve_mesh(request, time_limit, allowed=seed)
                step = res.estimate.step_time_s if res.estimate.fits else float("inf")
            else:
                res = solve_pipeline_mesh(request, time_limit, layouts=("megatron",), even_cuts=True)
                step = res.estimate.step_time_s if res is not None else float("inf")
            if step < best[0]:
                best = (step, f"{tp}x{pp}x{mesh.dp}")
    return best


def scale(time_limit: float) -> None:
    print(
        f"{'model':<9} {'GPUs':>5} {'plan (tp x pp x dp, schedule, m)':>34} {'step':>8} {'MFU':>6} "
        f"{'hand-set Megatron':>18} {'step':>8} {'Megatron / plan':>16} {'planning':>9}"
    )
    for name, layers, hidden, heads, gpus, batch in SCALE:
        model, inputs = gpt(layers, hidden, heads)
        cluster = Cluster.preset("dgx-a100", nodes=gpus // 8)
        t = time.perf_counter()
        plan = autopar_plan(model, inputs, cluster, global_batch_size=batch, time_limit_s=time_limit)
        plan_s = time.perf_counter() - t
        captured, _ = captured_with_stats(model, inputs, batch=batch)
        meg_step, meg_mesh = hand_set_megatron(captured, cluster, layers, 5.0)
        m = plan.mesh
        shape = f"{m['tp']}x{m['pp']}x{m['dp']}, {plan.schedule or '-'}, {plan.microbatches}"
        step = plan.estimate.step_time_s
        print(
            f"{name:<9} {gpus:>5} {shape:>34} {step:>7.2f}s {plan.estimate.mfu * 100:>5.1f}% "
            f"{meg_mesh:>18} {meg_step:>7.2f}s {meg_step / step:>16.3f} {plan_s:>8.1f}s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes on one node")
    parser.add_argument(
        "--time-limit", type=float, default=None, help="solver seconds per plan (default 30; 40 with --scale)"
    )
    parser.add_argument("--scale", action="store_true", help="GPT 39B-175B on 512-1536 A100s, with pipelines")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.scale:
        scale(args.time_limit or 40.0)
        return
    args.time_limit = args.time_limit or 30.0
    one_node = Cluster.preset("dgx-h100", nodes=1)
    eight = Cluster.preset("dgx-h100", nodes=8)
    cases = [
        ("GPT 350M", lambda: gpt(24, 1024, 16, seq=1024), one_node, 64),
        ("LLaMA 1B-shape", lambda: llama(16, 2048, 16, 5632, seq=2048), one_node, 32),
    ]
    if not args.quick:
        cases += [
            ("GPT 1.3B", lambda: gpt(24, 2048, 16, seq=2048), eight, 512),
            ("LLaMA 7B", lambda: llama(32, 4096, 32, 11008, seq=2048), eight, 512),
        ]
    print(
        f"{'model':<16} {'GPUs':>5} {'plan (mesh)':>18} {'pure DP':>9} {'ZeRO-3':>9} {'Megatron (tp)':>15} "
        f"{'best baseline / plan':>21} {'planning':>9}"
    )
    for name, build, cluster, batch in cases:
        r = run(name, build, cluster, batch, args.time_limit)
        base = min(r["dp"], r["zero3"], r["megatron"])
        meg = f"{r['megatron']:.3f}s ({r['megatron_tp']})" if r["megatron_tp"] else "-"
        print(
            f"{name:<16} {r['devices']:>5} {r['plan']:>10.3f}s ({r['plan_mesh']:>5}) {r['dp']:>8.3f}s "
            f"{r['zero3']:>8.3f}s {meg:>15} {base / r['plan']:>21.3f} {r['plan_s']:>8.1f}s"
        )


if __name__ == "__main__":
    main()
