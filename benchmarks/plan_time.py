"""How long planning takes, per phase, as models grow in layers and clusters in devices.

    .venv/bin/python benchmarks/plan_time.py                 (layers 8..80 on 64 GPUs, then 8..512 GPUs)
    .venv/bin/python benchmarks/plan_time.py --quick         (8 and 16 layers, 8 and 64 GPUs)
    .venv/bin/python benchmarks/plan_time.py --flat          (dp x tp meshes only, fixed={"pp": 1})

LLaMA-7B-shaped layers (hidden 4096, intermediate 11008, 32 heads, sequence
2048, vocab 32000) on DGX H100 nodes, global batch 256 (``--batch``). Phases:
capture (export + joint trace), then per mesh summed over all meshes (dp × tp,
and pp × dp × tp where the search tries pipelines): strategy enumeration, MILP
build, solve (the unrestricted problem and the seed layouts on it; for a
pipeline, also the placement of its stage cuts). "per mesh" is those three
divided by the number of meshes: what each further mesh shape adds to a
plan. The chosen plan's estimated step, and the solver's status of the chosen mesh and its
gap, are printed too.
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


def run(layers: int, gpus: int, time_limit: float, flat: bool = False, batch: int = 256) -> dict:
    """Plan one case; ``flat``: dp × tp meshes only (``fixed={"pp": 1}``), no pipelines."""
    model, inputs = llama(layers, 4096, 32, 11008, seq=2048)
    cluster = autopar.Cluster.preset("dgx-h100", nodes=max(gpus // 8, 1))
    t = time.perf_counter()
    fixed = {"pp": 1} if flat else None
    plan = autopar.plan(model, inputs, cluster, global_batch_size=batch, time_limit_s=time_limit, fixed=fixed)
    total = time.perf_counter() - t
    meshes = plan.solver.meshes
    return {
        "layers": layers,
        "gpus": cluster.world_size,
        "capture": plan.solver.capture_s or 0.0,
        "strategies": sum(m.timings.get("strategies_s", 0.0) for m in meshes),
        "build": sum(m.timings.get("build_s", 0.0) for m in meshes),
        # a pipeline mesh's solves and stage cuts are its pipeline_s
        "solve": sum(m.timings.get("solve_s", 0.0) + m.timings.get("pipeline_s", 0.0) for m in meshes),
        "meshes": len(meshes),
        "total": total,
        "status": plan.solver.status,
        "gap": plan.solver.gap,
        "mesh": plan.mesh_str(),
        "step": plan.estimate.step_time_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan (all meshes)")
    parser.add_argument("--flat", action="store_true", help="dp x tp meshes only: no pipeline configurations")
    parser.add_argument("--batch", type=int, default=256, help="global batch, in sequences of 2048 tokens")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        grid = [(8, 64), (16, 64), (8, 8)]
    else:
        grid = [(8, 64), (16, 64), (32, 64), (80, 64), (32, 8), (32, 512)]
    print(
        f"{'layers':>6} {'GPUs':>5} {'meshes':>6} {'capture':>8} {'strategies':>10} {'build':>7} {'solve':>7} "
        f"{'per mesh':>8} {'total':>7}  {'chosen mesh':<22} {'step':>8} {'status':<9} {'gap':>6}",
        flush=True,
    )
    for layers, gpus in grid:
        r = run(layers, gpus, args.time_limit, args.flat, args.batch)
        gap = "-" if r["gap"] is None else f"{r['gap'] * 100:.1f}%"
        per_mesh = (r["strategies"] + r["build"] + r["solve"]) / max(r["meshes"], 1)
        print(
            f"{r['layers']:>6} {r['gpus']:>5} {r['meshes']:>6} {r['capture']:>7.1f}s {r['strategies']:>9.1f}s "
            f"{r['build']:>6.1f}s {r['solve']:>6.1f}s {per_mesh:>7.2f}s {r['total']:>6.1f}s  "
            f"{r['mesh']:<22} {r['step']:>7.4f}s {r['status']:<9} {gap:>6}",
            flush=True,
        )


if __name__ == "__main__":
    main()
