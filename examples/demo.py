"""The demo: plan a HuggingFace GPT-2 for a node of eight H100s and print the plan.

    make demo            (or: python examples/demo.py)

The model is built from a config on the meta device: planning reads shapes,
not weights, so nothing is downloaded and no memory is spent on weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from examples.models import gpt2_small  # noqa: E402


def main() -> None:
    model, example_inputs = gpt2_small()
    cluster = autopar.Cluster.preset("dgx-h100", nodes=1)
    print(f"Planning HuggingFace GPT2LMHeadModel (GPT-2 small) for {cluster.describe()}\n")
    plan = autopar.plan(model, example_inputs, cluster, global_batch_size=256)
    print(plan.summary())


if __name__ == "__main__":
    main()
