"""The demo: plan a HuggingFace GPT-2, run the plan on 4 local processes, check it against one device.

    make demo            (or: python examples/demo.py)

1. Plan GPT-2 small for a node of eight H100s (the model on the meta device:
   planning reads shapes, not weights) and print the plan.
2. Plan a small GPT-2 with real weights and GPT-2's default dropout for 4 CPU
   processes over gloo, train it 3 AdamW steps under that plan and 3 steps on
   one process, both with ``rng="exact"`` (every plan then draws the dropout
   masks one device draws), and print both losses per step and whether
   gradients and weights matched.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.verify.oracle import check_plan  # noqa: E402
from examples.models import gpt2_mini, gpt2_small  # noqa: E402


def main() -> None:
    model, example_inputs = gpt2_small()
    cluster = autopar.Cluster.preset("dgx-h100", nodes=1)
    print(f"1. Planning HuggingFace GPT2LMHeadModel (GPT-2 small) for {cluster.describe()}\n")
    plan = autopar.plan(model, example_inputs, cluster, global_batch_size=256)
    print(plan.summary())

    local = autopar.Cluster.local(4)
    torch.manual_seed(0)
    model, example_inputs = gpt2_mini()
    print(f"\n2. Planning a 4-layer GPT-2 with real weights and dropout 0.1 for {local.describe()}\n")
    plan = autopar.plan(model, example_inputs, local, precision="fp32")
    print(plan.summary())
    print('\nTraining 3 AdamW steps under this plan on 4 processes, and on one, with rng="exact" ...')
    start = time.perf_counter()
    check = check_plan(gpt2_mini, local, plan, rng="exact")
    print(
        f"(done in {time.perf_counter() - start:.0f} s; collectives per step on rank 0: {check.collectives})\n"
    )
    print(f"{'step':>4}  {'loss, 4 processes':>18}  {'loss, one process':>17}")
    for i, (a, b) in enumerate(zip(check.losses, check.reference_losses, strict=True)):
        print(f"{i + 1:>4}  {a:>18.6f}  {b:>17.6f}")
    verdict = "MATCH" if check.ok() else "MISMATCH"
    print(f"\n{verdict}: largest difference from the one-process run: {check}")
    if not check.ok():
        sys.exit(1)


if __name__ == "__main__":
    main()
