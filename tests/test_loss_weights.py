"""A mean class loss over kept labels: captured as sum / total weight, micro-batches weighted by kept labels.

Training on padded batches like one device is checked on several processes in
``tests/test_runtime.py`` and ``tests/test_pipeline.py`` (``gpt2_tiny4_padded``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autopar.capture.joint import capture
from autopar.runtime.loss_weights import label_chain, microbatch_weights
from examples.models import gpt2_tiny4_padded

aten = torch.ops.aten


def _run(cg, model, inputs):
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    args = [state[p.name] for p in cg.params] + [state[b.name] for b in cg.buffers]
    return cg.gm(*args, *inputs)


def test_padded_causal_lm_loss_is_a_sum_over_kept_labels_and_matches_eager():
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4_padded()
    cg = capture(model, inputs)
    loss_node = next(n for n in cg.gm.graph.nodes if n.name == cg.loss)
    assert loss_node.target is aten.div.Tensor
    loss, *grads = _run(cg, model, [inputs[i.name] for i in cg.inputs])
    ref = model(**inputs).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    params = dict(model.named_parameters())
    for info, g in zip(cg.params, grads, strict=True):
        torch.testing.assert_close(g, params[info.name].grad, rtol=1e-5, atol=1e-7, msg=info.name)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_microbatch_weights_are_each_microbatch_share_of_the_kept_labels(m):
    model, inputs = gpt2_tiny4_padded()
    cg = capture(model, inputs)
    chain = label_chain(cg)
    assert chain is not None and chain.ignore_index == -100
    tensors = [inputs[i.name] for i in cg.inputs]
    kept = (inputs["labels"][:, 1:] != -100).sum(1).double()  # the causal shift drops each first label
    want = [float(k.sum() / kept.sum()) for k in kept.chunk(m)]
    got = microbatch_weights(chain, tensors, m)
    assert got == pytest.approx(want, rel=1e-12)
    assert len(set(got)) == (1 if m == 1 else m)  # the shares differ: 1/m would be wrong


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_plain_cross_entropy_with_ignored_targets_is_rewritten_and_exact():
    torch.manual_seed(0)
    model, x = Classifier(), torch.randn(6, 8)
    y = torch.tensor([0, -100, 3, 4, -100, 1])
    loss_fn = functools.partial(nn.functional.cross_entropy, ignore_index=-100)
    cg = capture(model, x, loss_fn=loss_fn, example_targets=y)
    chain = label_chain(cg)
    assert chain is not None and chain.kept({0: x, 1: y}) == 4.0
    loss, *_ = _run(cg, model, [x, y])
    torch.testing.assert_close(loss, loss_fn(model(x), y), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "loss_fn",
    [
        functools.partial(nn.functional.cross_entropy, label_smoothing=0.1),
        functools.partial(nn.functional.cross_entropy, reduction="sum"),
        lambda out, y: nn.functional.mse_loss(out, nn.functional.one_hot(y, 5).float()),
    ],
    ids=["label-smoothing", "sum", "mse"],
)
def test_other_losses_keep_equal_microbatch_weights(loss_fn):
    torch.manual_seed(0)
    model, x, y = Classifier(), torch.randn(6, 8), torch.tensor([0, 1, 3, 4, 2, 1])
    cg = capture(model, x, loss_fn=loss_fn, example_targets=y)
    assert label_chain(cg) is None
    assert microbatch_weights(None, [x, y], 3) == [1 / 3] * 3
    loss, *_ = _run(cg, model, [x, y])
    torch.testing.assert_close(loss, loss_fn(model(x), y), rtol=1e-6, atol=0)
