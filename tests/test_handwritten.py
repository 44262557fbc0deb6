"""Models as users write them by hand (examples/handwritten.py): every op has a sharding rule, and they train
like one device.

The one-process check fails on any "no sharding rule" warning but for the ops
left replicated on purpose below. The slow check trains each model under a
random dp 2 x tp 2 layout (every op's strategy drawn among those its
neighbours allow) on 4 processes, 3 AdamW steps within 1e-5 of one device,
dropout under ``rng="exact"``. In the suite it trains nanoGPT (whose random
layout holds two bias gradients in head-tail shards, which the graph once
returned in the wrong order), the U-Net (GroupNorm, transposed convolution,
interpolation) and the MobileNet-like network (depthwise convolution,
hardswish's and ReLU6's rules); tests/test_runtime.py
trains the LSTM, the click model and Meta's LLaMA in its own launch. ``AUTOPAR_HANDWRITTEN=all`` trains
every model here; a comma-separated list, those.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import autopar
from autopar.capture.joint import capture
from autopar.search.sharding.strategies import enumerate_strategies, unruled_ops
from autopar.verify.oracle import check_plans, factory_layout_plan
from examples import handwritten

# replicated on purpose: their layouts hold state no rule splits (an RNN kernel's workspace, an EmbeddingBag's
# offsets into the flattened ids)
LEFT_REPLICATED = ("mkldnn_rnn_layer", "_embedding_bag")
TRAINED = ["nanogpt", "unet", "mobilenet_like"]
FOUR = autopar.Cluster.local(4)


@pytest.mark.parametrize("name", list(handwritten.HANDWRITTEN))
def test_every_op_has_a_sharding_rule(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = handwritten.HANDWRITTEN[name]()
    left = unruled_ops(enumerate_strategies(capture(model, inputs).gm, (2, 2)))
    assert all(any(op in left_op for op in LEFT_REPLICATED) for left_op in left), left


def _random(name: str) -> autopar.Plan:
    return factory_layout_plan(handwritten.HANDWRITTEN[name], FOUR, 2, 2, "flowing")


@pytest.mark.slow
def test_handwritten_models_train_like_one_device() -> None:
    chosen = os.environ.get("AUTOPAR_HANDWRITTEN", "")
    names = list(handwritten.HANDWRITTEN) if chosen == "all" else chosen.split(",") if chosen else TRAINED
    cases = [(handwritten.HANDWRITTEN[n], functools.partial(_random, n)) for n in names]
    checks = check_plans(cases, FOUR, rng="exact")
    bad = [f"{n}: {c}" for n, c in zip(names, checks, strict=True) if not c.ok(1e-5)]
    assert not bad, "models that do not train like one device:\n" + "\n".join(bad)
    for c in checks:
        assert len(c.losses) == 3 and c.losses[0] != c.losses[2]  # three real steps
