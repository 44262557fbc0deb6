"""A capture that traces four layers of a repeated stack equals the trace of all of them, node for node.

``capture_folded`` (:mod:`autopar.capture.fold`) writes the joint graph of L layers
from a four-layer trace. These tests hold it to the whole model's trace with
canonical names: same node names, ops, arguments, module paths, phases, shapes and
dtypes, same loss, gradients and placeholders. Dropout stays on (the GPT keeps its
default), and a mixture of experts and a model whose layers branch on their index
are among the cases.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import autopar
from autopar.capture.fold import capture_folded, repeated_stack
from autopar.capture.joint import CapturedGraph, capture
from autopar.capture.unroll import fingerprint
from autopar.codegen.transfer import same_graph
from examples.models import gpt, llama, llama_tiny6

transformers = pytest.importorskip("transformers")


def _node(n: torch.fx.Node, seq_rank: dict[int, int]) -> tuple:
    """What must agree; autograd sequence numbers by rank (the counter is the process's, not the trace's)."""
    val = n.meta.get("val")
    return (
        n.name,
        n.op,
        str(n.target),
        str(n.args),
        str(n.kwargs),
        n.meta.get("autopar_module"),
        n.meta.get("autopar_phase"),
        seq_rank.get(n.meta.get("seq_nr")),
        n.meta.get("autograd_backward"),
        tuple(getattr(val, "shape", ())),
        str(getattr(val, "dtype", "")),
    )


def _ranks(nodes: list[torch.fx.Node]) -> dict[int, int]:
    return {s: k for k, s in enumerate(sorted({n.meta["seq_nr"] for n in nodes if "seq_nr" in n.meta}))}


def _same(a: CapturedGraph, b: CapturedGraph) -> None:
    na, nb = list(a.gm.graph.nodes), list(b.gm.graph.nodes)
    assert len(na) == len(nb)
    ra, rb = (_ranks(nodes) for nodes in (na, nb))
    diff = [(_node(x, ra), _node(y, rb)) for x, y in zip(na, nb, strict=True) if _node(x, ra) != _node(y, rb)]
    assert not diff, diff[:3]
    assert (a.loss, a.grads, a.params, a.buffers, a.inputs) == (
        b.loss,
        b.grads,
        b.params,
        b.buffers,
        b.inputs,
    )
    assert fingerprint(a.gm) == fingerprint(b.gm)


def _mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    ids = torch.randint(0, 128, (4, 16))
    return transformers.MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids}


class _Block(nn.Module):
    def __init__(self, index: int, odd: int) -> None:
        super().__init__()
        self.layer_idx, self.odd = index, odd
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return x + (torch.tanh(y) if self.layer_idx % self.odd == self.odd - 1 else torch.relu(y))


class _Stack(nn.Module):
    """Layers that branch on their own index in the forward: every ``odd``-th one differs."""

    def __init__(self, odd: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(i, odd) for i in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


# name -> (factory, whether the four traced layers repeat cleanly)
CASES = {
    "llama": (lambda: llama(8, 64, 4, 128, seq=16), True),
    "gpt with dropout": (lambda: gpt(6, 64, 4, vocab=128, seq=16), True),
    "mixtral": (_mixtral, True),
    "first layer's input needs no gradient": (lambda: (_Stack(9), torch.randn(4, 16)), True),
    "branches every 2nd layer": (lambda: (_Stack(2), torch.randn(4, 16)), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_folded_capture_equals_the_whole_trace(name: str, caplog) -> None:
    torch.manual_seed(0)
    make, folds = CASES[name]
    model, inputs = make()
    assert repeated_stack(model) is not None
    with caplog.at_level(logging.INFO, logger="autopar.capture.fold"):
        folded = capture_folded(model, inputs)
    assert any("tracing all of them" in r.getMessage() for r in caplog.records) != folds
    _same(folded, capture(model, inputs))


def test_a_branch_the_four_traced_layers_do_not_show_changes_the_fingerprint() -> None:
    """Layer 7 differs, by its index, in a way layers 0 to 3 do not show: the two graphs
    differ, and the fingerprint (what a run-time capture is checked against) says so."""
    torch.manual_seed(0)
    model, x = _Stack(8), torch.randn(4, 16)
    folded, whole = capture_folded(model, x), capture(model, x)
    assert fingerprint(folded.gm) != fingerprint(whole.gm)


def test_a_plan_made_on_the_folded_capture_names_the_nodes_the_runtime_traces() -> None:
    """The planner traces four of llama_tiny6's layers; the runtime all six: the plan's placements
    name the runtime graph's nodes exactly (tests/test_runtime.py trains a folded plan of mlp_deep on 4 processes)."""
    torch.manual_seed(0)
    model, inputs = llama_tiny6()
    plan = autopar.plan(model, inputs, autopar.Cluster.local(4), fixed={"dp": 2, "tp": 2}, precision="fp32")
    assert same_graph(plan.placements, capture(model, inputs))


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))


def test_the_stack_is_the_outermost_list_not_the_experts_inside_each_layer() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(_Experts() for _ in range(6))
    parent, attr, path = repeated_stack(model)
    assert (parent, attr, path) == (model, "layers", "layers")
