"""Runtime overhead: autopar's generated code against the native torch way of running the same plan.

    PYTHONPATH=. python benchmarks/runtime_overhead.py [--steps 12]

On 2 gloo processes, one training step (forward, backward, AdamW step) of a
feed-forward block where compute dominates (width 1024, hidden 4096, batch 128):

* data parallel: autopar's data-parallel layout against ``DistributedDataParallel``;
* tensor parallel: autopar's Megatron layout against ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel``.

The two runs of a pair alternate step by step in the same processes, so the
machine's noise hits both; the table gives medians and the ratio ours / torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from autopar.verify.oracle import plan_with_layout  # noqa: E402

WIDTH, HIDDEN, BATCH = 1024, 4096, 128


class FeedForward(nn.Module):
    """up_proj → GELU → down_proj, returning its mean-squared error (LLaMA's MLP names, so Megatron's layout applies)."""

    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(WIDTH, HIDDEN)
        self.down_proj = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (self.down_proj(nn.functional.gelu(self.up_proj(x))) - target).pow(2).mean()


def feed_forward():
    return FeedForward(), (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))


def _time(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _bench(plan_dict: dict, kind: str, steps: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model, (x, y) = feed_forward()
    pm = autopar.parallelize(model, autopar.Cluster.local(2), (x, y), plan=autopar.Plan.from_dict(plan_dict))
    ours_opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-4)

    torch.manual_seed(0)
    ref, _ = feed_forward()
    if kind == "dp":
        ref = DistributedDataParallel(ref)
        rank, world = dist.get_rank(), dist.get_world_size()
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    else:
        mesh = init_device_mesh("cpu", (2,))
        ref = parallelize_module(ref, mesh, {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
        xs, ys = x, y
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)

    def ours() -> None:
        pm.train_step((x, y))
        ours_opt.step()
        ours_opt.zero_grad()

    def torch_way() -> None:
        ref(xs, ys).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    for _ in range(2):  # warm-up
        ours()
        torch_way()
    t_ours, t_ref = [], []
    for _ in range(steps):
        dist.barrier()
        t_ours.append(_time(ours))
        dist.barrier()
        t_ref.append(_time(torch_way))
    return {"ours": statistics.median(t_ours), "torch": statistics.median(t_ref)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    cluster = autopar.Cluster.local(2)
    rows = []
    for kind, mesh, layout, reference in [
        ("data parallel", {"dp": 2, "tp": 1}, "dp", "DistributedDataParallel"),
        ("tensor parallel", {"dp": 1, "tp": 2}, "megatron", "parallelize_module (Colwise/Rowwise)"),
    ]:
        torch.manual_seed(0)
        model, inputs = feed_forward()
        plan = autopar.plan(model, inputs, cluster, fixed=mesh, precision="fp32")
        plan = plan_with_layout(plan, model, inputs, cluster, layout)
        times = autopar.launch(
            _bench, cluster, plan.to_dict(), layout if layout == "dp" else "tp", args.steps
        )
        t = times[0]
        rows.append((kind, reference, t["ours"], t["torch"]))
    print(
        f"\nstep time on 2 gloo processes, median of {args.steps} (FeedForward {WIDTH}x{HIDDEN}, batch {BATCH})"
    )
    print("| plan | torch reference | autopar (ms) | torch (ms) | ratio |\n|---|---|---:|---:|---:|")
    for kind, reference, ours, ref in rows:
        print(f"| {kind} | {reference} | {ours * 1e3:.1f} | {ref * 1e3:.1f} | {ours / ref:.3f} |")


if __name__ == "__main__":
    main()
