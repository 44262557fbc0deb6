"""Two shortcuts to a rank's local graph, each held to give the graph the long way gives, code for code.

- The sharding interpreter runs the ops DTensor would run on the local shards unchanged itself, skipping
  DTensor's dispatch (``autopar.codegen.shard_interpreter.SKIP_DTENSOR_DISPATCH``).
- In a job of CPU processes, the ranks but the first take rank 0's captured graph, sent as bytes
  (:mod:`autopar.runtime.shared_capture`), instead of capturing the model themselves.

Random dp 2 x tp 2 layouts (every op's strategy drawn among all it has) of HuggingFace's LLaMA (rotary
embeddings, grouped-query attention) and GPT-2 (Conv1D, a tied head, dropout), traced for the last rank,
whose coordinates are (1, 1): partial sums held as zeros there, shards at an offset. ``examples/families.py``
builds both from their default configs. Every family of that file, on the first and the last rank, under
random and flowing layouts, traced the same both ways when the shortcut was written; these two keep it so.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.capture.joint import capture
from autopar.codegen import shard, shard_interpreter
from autopar.codegen.transfer import transfer_placements
from autopar.runtime.shared_capture import _from_bytes, _to_bytes
from autopar.verify.oracle import layout_plan
from examples import families

pytest.importorskip("transformers")


@pytest.fixture
def last_of_four():
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_skipping_dtensor_dispatch_traces_the_same_graph(last_of_four, monkeypatch, name):
    torch.manual_seed(0)
    model, inputs = families.FAMILIES[name]()
    plan = layout_plan(model, inputs, autopar.Cluster.local(4), 2, 2, "random")
    captured = capture(model, inputs)
    chosen, _ = transfer_placements(plan.placements, captured, (2, 2))
    skipped = shard.shard_graph(captured, chosen, last_of_four).gm.code
    monkeypatch.setattr(shard_interpreter, "SKIP_DTENSOR_DISPATCH", False)
    dispatched = shard.shard_graph(captured, chosen, last_of_four).gm.code
    assert skipped == dispatched
    assert "all_gather_into_tensor" in skipped  # a layout that moves values, not one every op reads as it comes


@pytest.mark.parametrize("name", ["mixtral", "falcon"])
def test_a_capture_sent_as_bytes_traces_the_same_graph(last_of_four, name):
    """Mixtral (autopar's own experts op) and Falcon (a real tensor constant in the graph, from a
    ``torch.tensor`` literal in its forward)."""
    torch.manual_seed(0)
    model, inputs = families.FAMILIES[name]()
    plan = layout_plan(model, inputs, autopar.Cluster.local(4), 2, 2, "flowing")
    captured = capture(model, inputs)
    sent = _from_bytes(_to_bytes(captured))
    assert sent.gm is not captured.gm and dataclasses.replace(sent, gm=None) == dataclasses.replace(captured, gm=None)
    codes = []
    for c in (captured, sent):
        chosen, _ = transfer_placements(plan.placements, c, (2, 2))
        codes.append(shard.shard_graph(c, chosen, last_of_four).gm.code)
    assert codes[0] == codes[1]
