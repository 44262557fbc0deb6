"""Pipeline parallelism: stage cuts (exact), the graph split, and training like one device.

* The cut search (:mod:`autopar.search.pipeline.cuts`) against every cut set of
  random models, with memory limits, for each schedule; and the cuts and
  micro-batch count autopar.plan's search picks for a real model against every
  (cut set, micro-batch count) costed by the same model.
* The split (:mod:`autopar.codegen.stage_split`) in one process: the stage
  graphs of a GPT-2 with tied embeddings, run one after another, give the
  joint graph's loss and gradients exactly.
* Several processes (slow): GPT-2 and LLaMA tiny with 4 layers, GPipe, 1F1B
  and interleaved 1F1B, pp = 2 x dp = 2 and pp = 2 x tp = 2 on 4 processes
  in one launch, hand-cut and searched plans: 3 AdamW steps against one
  device (relative L2 error 1e-5), full_state_dict included.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.capture.joint import capture, node_phase
from autopar.codegen.shard import shard_graph
from autopar.codegen.stage_split import split_stages
from autopar.core.placements import REPLICATE as R
from autopar.cost_models.memory import precision_spec
from autopar.cost_models.pipeline import Segment, pipeline_memory, pipeline_time
from autopar.cost_models.schedule import schedule_actions
from autopar.hardware.cluster import MeshShape
from autopar.search.pipeline.cuts import best_cuts, brute_force_cuts
from autopar.search.pipeline.mesh import solve_pipeline_mesh
from autopar.search.pipeline.segments import rescale
from autopar.search.pipeline.stages import forward_segments, stage_of_nodes, untie_across_stages
from autopar.search.sharding.microbatches import microbatch_divides
from autopar.search.sharding.request import MeshRequest
from autopar.verify.oracle import check_plans, loss_split_layout, plan_with_pipeline, shell_plan
from examples.handwritten import nanogpt_last_block
from examples.models import gpt2_tiny4, gpt2_tiny4_padded, gpt2_tiny4_shared_positions, llama_tiny4

TOL = 1e-5


def _random_segments(rng: random.Random, k: int) -> list[Segment]:
    return [
        Segment(
            f"s{i}",
            forward_s=rng.uniform(0.1, 2),
            backward_s=rng.uniform(0.2, 4),
            saved_bytes=rng.uniform(0, 10),
            transient_bytes=rng.uniform(0, 3),
            state_bytes=rng.uniform(0, 20),
            optimizer_s=rng.uniform(0, 1),
            grad_sync_s=rng.uniform(0, 3),
            grad_tail_s=rng.uniform(0, 0.3),
            boundary_bytes=rng.uniform(0, 5),
        )
        for i in range(k)
    ]


def _p2p(nbytes: float) -> float:
    return 0.01 + nbytes / 10


def test_cuts_are_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(2, 9)
        segments = _random_segments(rng, k)
        p, m = rng.randint(1, k), rng.randint(1, 8)
        schedule = rng.choice(["1F1B", "GPipe"])
        limit = rng.choice([math.inf, rng.uniform(10, 80)])
        dp = best_cuts(segments, p, m, schedule, _p2p, limit)
        bf = brute_force_cuts(segments, p, m, schedule, _p2p, limit)
        assert (dp is None) == (bf is None), (k, p, m, schedule, limit)
        if dp is not None:
            assert dp.time.step_s == pytest.approx(bf.time.step_s, rel=1e-12)
            assert max(dp.memory) <= limit and dp.exact


def test_every_stage_holds_a_parameter():
    """A stage of only the loss would be balanced but has nothing for its optimizer to step: not cut so."""
    layer = {"forward_s": 1.0, "backward_s": 2.0, "params": 100}
    segments = [Segment("l0", **layer), Segment("l1", **layer), Segment("loss", forward_s=2.0, backward_s=4.0)]
    for search in (best_cuts, brute_force_cuts):
        got = search(segments, 2, 4, "1F1B", lambda b: 0.0)
        assert got.cuts == [1], search  # not [2], which leaves the loss alone on the last stage
    assert best_cuts(segments, 3, 4, "1F1B", lambda b: 0.0) is None  # three stages cannot all hold one
    # interleaved: a device needs a parameter among its chunks, not every chunk
    assert best_cuts(segments * 2, 2, 4, "interleaved", lambda b: 0.0, chunks=2) is not None


def test_pipeline_cost_is_the_textbook_formula_on_balanced_stages():
    segments = [Segment(f"s{i}", forward_s=1.0, backward_s=2.0, saved_bytes=1.0) for i in range(8)]
    for p, m in [(2, 4), (4, 8), (8, 8)]:
        cuts = [8 * s // p for s in range(1, p)]
        t = pipeline_time(segments, cuts, m, "1F1B", lambda b: 0.0)
        work = 3.0 * 8 / p
        assert t.step_s == pytest.approx((m + p - 1) * work)  # bubble (p-1)/m of the work
        assert t.bubble_s == pytest.approx((p - 1) * work)
        one_f_one_b = pipeline_memory(segments, cuts, m, "1F1B")
        gpipe = pipeline_memory(segments, cuts, m, "GPipe")
        assert one_f_one_b[0] == pytest.approx(min(m, p) * 8 / p) and gpipe[0] == pytest.approx(m * 8 / p)
    # interleaved: (p - 1) / (v m) of the work
    t = pipeline_time(segments, [2, 4, 6], 4, "interleaved", lambda b: 0.0, chunks=2)
    assert t.step_s == pytest.approx((4 + 1 / 2) * 12.0)


def test_stage_memory_holds_the_summed_gradients_and_the_chunks_the_schedule_keeps_in_flight(monkeypatch):
    from autopar.cost_models import overlap
    from autopar.cost_models.pipeline import ChunkDepth
    from autopar.cost_models.schedule import chunk_depths, in_flight_counts, interleaved_runs
    from autopar.search.pipeline.cuts import stage_memory_of

    segments = [Segment(f"s{i}", saved_bytes=1.0, state_bytes=10.0, grad_bytes=2.0) for i in range(4)]
    # one micro-batch: the gradients once; several: the sum of the earlier ones beside those being made
    # (each stage: states 20, of them gradients 4, and 2 saved a micro-batch, 2 of them in flight on the first)
    assert pipeline_memory(segments, [2], 1, "1F1B") == pytest.approx([20.0 + 2, 20.0 + 2])
    assert pipeline_memory(segments, [2], 4, "1F1B") == pytest.approx([24.0 + 2 * 2, 24.0 + 1 * 2])
    # a runtime adding each micro-batch's gradients into one buffer holds them once (Megatron-Core's main_grad)
    monkeypatch.setattr(overlap, "RUNTIME", overlap.Runtime(grads_accumulate_in_place=True))
    assert pipeline_memory(segments, [2], 4, "1F1B") == pytest.approx([20.0 + 4, 20.0 + 2])
    monkeypatch.setattr(overlap, "RUNTIME", overlap.AUTOPAR_RUNTIME)
    # interleaved 1F1B, 2 ranks x 2 chunks, 4 micro-batches: rank 0's warm-up runs 4 of its first chunk while
    # 1 of its second is in flight, more of the first than the warm-up depth spread evenly (5 / 2 of each)
    depths = chunk_depths(2, 2, 4)
    assert max(row.live[0] for row in depths[0]) == 4 and ChunkDepth((4, 1)) in depths[0]
    # each chunk runs its own backward graph: the second copy of the gradients is one chunk's, during that
    # chunk's backwards after its first (states 10 + grads 2 a segment, nothing saved: 20 a rank and one 2)
    flat = [Segment(f"s{i}", state_bytes=10.0, grad_bytes=2.0) for i in range(4)]
    assert stage_memory_of(flat, [1, 2, 3], 4, "interleaved", 2) == pytest.approx([22.0, 22.0])
    assert stage_memory_of(flat, [1, 2, 3], 1, "interleaved", 2) == pytest.approx([20.0, 20.0])
    assert any(row.summing == 0 for row in depths[0]) and any(row.summing == 1 for row in depths[0])
    # a count torch's interleaved schedule refuses (7 on 3 ranks: rounds of 2) is never costed as one
    assert not interleaved_runs(3, 7) and interleaved_runs(3, 8) and interleaved_runs(3, 2)
    with pytest.raises(ValueError):
        schedule_actions("interleaved", 3, 6, 7)
    assert chunk_depths(3, 2, 7) == chunk_depths(3, 2, 8)  # costed as the next count it runs
    # past 4 x ranks micro-batches a rank goes through the counts of 4 x ranks (chunk_depths writes that many)
    for ranks in (2, 3, 4):
        whole = in_flight_counts(schedule_actions("interleaved", ranks, 2 * ranks, 7 * ranks), ranks, 2)
        assert [set(r) for r in chunk_depths(ranks, 2, 7 * ranks)] == [set(r) for r in whole]
    heavy = [Segment("a", saved_bytes=10.0, state_bytes=1.0), *(Segment(f"s{i}", saved_bytes=1.0) for i in range(3))]
    even = pipeline_memory(heavy, [1, 2, 3], 4, "interleaved", chunks=2)
    ran = stage_memory_of(heavy, [1, 2, 3], 4, "interleaved", 2)
    assert even[0] == pytest.approx(1 + 2.5 * 11) and ran[0] == pytest.approx(1 + 4 * 10 + 1)


def test_a_stage_holds_its_copy_of_a_parameter_tied_to_another_stage():
    from autopar.search.pipeline.cuts import _Ranges

    # "head" reads the embedding's table, whose states (8, gradients 2) count with "embed"
    tied = (("wte", "embed", 8.0, 2.0),)
    segments = [Segment("embed", state_bytes=8.0, grad_bytes=2.0), Segment("mid"), Segment("head", tied=tied)]
    assert pipeline_memory(segments, [], 1, "1F1B") == pytest.approx([8.0])  # one stage: one copy
    assert pipeline_memory(segments, [2], 1, "1F1B") == pytest.approx([8.0, 8.0])  # the head's stage: its own
    assert pipeline_memory(segments, [2], 4, "1F1B") == pytest.approx([10.0, 10.0])  # summed gradients too
    # the cut search's figures: (states, gradients, ...), the tied copy's in the head's stage alone
    assert _Ranges(segments, 4).figures(2, 3)[2][:2] == pytest.approx((8.0, 2.0))
    assert _Ranges(segments, 4).figures(0, 3)[2][:2] == pytest.approx((8.0, 2.0))


def test_the_gradient_sum_is_held_from_a_stages_second_backward_on():
    """With several micro-batches the earlier ones' summed gradients are live beside a backward's only from
    a stage's second backward on. GPipe, and 1F1B with every micro-batch in flight, hold one micro-batch
    fewer by then; 1F1B's steady state runs a forward before each later backward, back to the full depth."""
    a = Segment("a", saved_bytes=4.0, state_bytes=8.0, grad_bytes=3.0)
    b = Segment("b", saved_bytes=4.0, state_bytes=8.0, grad_bytes=6.0)
    assert pipeline_memory([a], [], 2, "GPipe") == pytest.approx([8 + max(2 * 4, 4 + 3)])
    assert pipeline_memory([b], [], 2, "GPipe") == pytest.approx([8 + max(2 * 4, 4 + 6)])
    # 2 stages, 1F1B: stage 0 holds 2 in flight; at 2 micro-batches its second backward holds 1, at 4 still 2
    assert pipeline_memory([a, b], [1], 2, "1F1B") == pytest.approx([8 + 2 * 4, 8 + 4 + 6])
    assert pipeline_memory([a, b], [1], 4, "1F1B") == pytest.approx([8 + 2 * 4 + 3, 8 + 4 + 6])
    assert pipeline_memory([a, b], [1], 1, "1F1B") == pytest.approx([8 + 4, 8 + 4])  # no sum to hold


def test_interleaved_small_cases_are_enumerated_exactly():
    rng = random.Random(1)
    segments = _random_segments(rng, 8)
    got = best_cuts(segments, 2, 4, "interleaved", _p2p, chunks=2)
    every = [
        pipeline_time(segments, list(c), 4, "interleaved", _p2p, chunks=2).step_s
        for c in itertools.combinations(range(1, 8), 3)
    ]
    assert got.exact and got.time.step_s == pytest.approx(min(every))


def test_schedules_come_from_torch_pipelining():
    one = schedule_actions("1F1B", 2, 2, 4)
    assert [str(a) for a in one[0] if "F" in str(a) and "SEND" not in str(a) and "RECV" not in str(a)][:2] == [
        "0F0",
        "0F1",
    ]
    assert [str(a) for a in schedule_actions("gpipe", 2, 2, 2)[1]] == [
        "1RECV_F0",
        "1F0",
        "1RECV_F1",
        "1F1",
        "1B0",
        "1SEND_B0",
        "1B1",
        "1SEND_B1",
    ]
    inter = schedule_actions("interleaved", 2, 4, 2)
    assert {a.stage_index for a in inter[0]} == {0, 2} and {a.stage_index for a in inter[1]} == {1, 3}


def test_searched_cuts_and_microbatches_equal_the_brute_force_optimum():
    """The search's answer against every (cut set, micro-batch count) of the same costed segments."""
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4()
    captured = capture(model, inputs)
    cluster = autopar.Cluster.local(4)
    mesh = MeshShape(dp=1, tp=2, pp=2)
    prec = precision_spec("fp32")
    res = solve_pipeline_mesh(MeshRequest(captured, cluster, mesh, prec, "adamw", math.inf, recompute=True), 5.0)
    link = cluster.axis_link(mesh, "pp")
    from autopar.cost_models.comm import collective_time

    def p2p(b):
        return collective_time("send_recv", b, 2, link) if b > 0 else 0.0

    best = None
    local = captured.batch_size // mesh.dp
    # only the counts the chosen placements run at: an answer that splits the batch dim over tp (the
    # embedding's output as S(0) on tp) cannot run a micro-batch of one sample, and the search costs
    # such an answer only at the counts it divides (a narrowed answer stands in at the others)
    sp, choice = res.sharding.sp, res.sharding.solution.choice
    runnable = [
        k
        for k in range(2, local + 1)
        if local % k == 0 and microbatch_divides(captured, sp, choice, (mesh.dp, mesh.tp), k)
    ]
    assert res.microbatches in runnable
    for m in runnable:
        segs = rescale(res.segments, res.microbatches, m)
        for cuts in itertools.combinations(range(1, len(segs)), mesh.pp - 1):
            t = pipeline_time(segs, list(cuts), m, "1F1B", p2p).step_s
            if best is None or t < best[0] - 1e-15:
                best = (t, m, list(cuts))
    assert res.estimate.step_time_s == pytest.approx(best[0], rel=1e-9)
    assert (res.microbatches, res.cuts) == (best[1], best[2])
    # every layer keeps its activations per micro-batch in flight: the forward/backward turn is after the
    # last forward op, not at autograd's first saved-tensor handle (a detach traced inside layer 0)
    layers = [s for s in res.segments if s.name.startswith("transformer.h.")]
    assert len(layers) == 4 and len({s.saved_bytes for s in layers}) == 1
    assert layers[0].saved_bytes > layers[0].transient_bytes > 0


# ---------------------------------------------------------------- the split, in one process


class _SpareTable(torch.nn.Module):
    """A buffer the forward never reads (as a rotary embedding's ``original_inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.ones(4))
        self.register_buffer("spare", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.table).square().mean()


def test_tensors_no_stage_reads_are_kept_by_the_first_stage():
    from autopar.runtime.pipeline_module import _unread

    captured = capture(_SpareTable(), (torch.randn(2, 4),))
    names = [t.name for t in captured.params + captured.buffers]
    assert "spare" in names
    assert _unread(captured) == {names.index("spare")}


@pytest.fixture
def one_rank():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_stage_graphs_compose_to_the_joint_graph(one_rank):
    """Forward of stages 0..2, then backward of 2..0, in one process: the joint graph's loss and gradients."""
    torch.manual_seed(0)
    model, inputs = gpt2_tiny4()
    captured = capture(model, inputs)
    placements = {
        n.name: {"outputs": [(R, R)], "inputs": [(R, R)] * len(n.all_input_nodes)}
        for n in captured.gm.graph.nodes
        if n.op != "output"
    }
    segments = forward_segments(captured)
    layers = [s for s in segments if s.name.startswith("transformer.h.")]
    firsts = [segments[0].first, layers[1].first, layers[3].first]
    stage_of = stage_of_nodes(captured, firsts)
    untied, placements, stage_of, ties = untie_across_stages(captured, placements, stage_of)
    assert [[s for _, s in t] for t in ties] == [[0, 2]]  # the token embedding is also the output head
    phase_of = {n.name: node_phase(n) for n in untied.gm.graph.nodes}
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    local = shard_graph(untied, placements, mesh, {}, keep_sources=True)
    graphs = split_stages(local.gm, stage_of, phase_of, 3, [0, 1, 2], len(untied.params))
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    args = [named[p.name].detach() for p in untied.params] + [named[b.name] for b in untied.buffers]
    args += [inputs[i.name] for i in untied.inputs]
    sent, saved, loss = [], {}, None
    for g in graphs:
        out = g.forward(*[args[a] for a in g.forward_args], *sent)
        n = len(g.send_forward)
        sent, saved[g.stage] = list(out[:n]), list(out[n : n + len(g.saved)])
        if g.has_loss:
            loss = out[-1]
    grads: dict[int, torch.Tensor] = {}
    back: list[torch.Tensor] = []
    for g in reversed(graphs):
        out = g.backward(*[args[a] for a in g.backward_args], *saved[g.stage], *back)
        n = len(g.send_backward)
        back = list(out[:n])
        grads.update(zip(g.grads, out[n:], strict=True))
    ref_loss, *ref_grads = captured.gm(
        *[named[p.name].detach() for p in captured.params],
        *[named[b.name] for b in captured.buffers],
        *[inputs[i.name] for i in captured.inputs],
    )
    assert torch.equal(loss, ref_loss)
    total = {}
    for i, p in enumerate(untied.params):  # a tied parameter's copies add up to its gradient
        if i in grads:
            total[p.name] = total.get(p.name, 0) + grads[i]
    for p, g in zip(captured.params, ref_grads, strict=True):
        torch.testing.assert_close(total[p.name], g, rtol=1e-6, atol=1e-7)


def test_a_gradient_summed_inside_a_stage_reads_its_terms_as_they_are_held():
    """T5's shared embedding is read twice by the first stage (the encoder's and the decoder's token
    embeddings) and once by the last (the tied head): untied, the first stage's gradient of it is a sum the
    untying adds, which must read both terms in the placement the first one is held in. A plan the search
    gives under a short time limit made both embeddings' backwards partial sums from batch shards, and the
    sum took over the first one's own entry: it re-cut its terms to batch shards, added the shards and
    declared them a partial sum, and the gradient came out half the parameter's rows."""
    from autopar.core.placements import PARTIAL as P
    from autopar.core.placements import shard as S
    from examples.families import t5

    torch.manual_seed(0)
    model, inputs = t5()
    captured = capture(model, inputs)
    placements = {
        n.name: {"op": str(n.target), "outputs": [(R, R)], "inputs": [(R, R)] * len(n.all_input_nodes)}
        for n in captured.gm.graph.nodes
        if n.op != "output"
    }
    backwards = [n.name for n in captured.gm.graph.nodes if n.target is torch.ops.aten.embedding_dense_backward.default]
    for name in backwards:
        placements[name] = {**placements[name], "inputs": [(S(0), R), (S(0), R)], "outputs": [(P, R)]}
    segments = forward_segments(captured)
    decoder = next(s for s in segments if s.name.startswith("decoder.block."))
    stage_of = stage_of_nodes(captured, [segments[0].first, decoder.first])
    untied, after, _, ties = untie_across_stages(captured, placements, stage_of)
    assert ties
    added = {n.name for n in untied.gm.graph.nodes if n.op == "call_function"} - set(placements)
    sums = sorted(added)
    assert sums, "no stage sums two terms of a gradient"
    for name in sums:
        entry = after[name]
        assert entry["op"] == "aten.add.Tensor" and entry["inputs"] == [(P, R)] * 2 and entry["outputs"] == [(P, R)]


# ---------------------------------------------------------------- several processes


@functools.cache
def _base(factory, n: int, tp: int) -> autopar.Plan:
    """The plan a hand-cut pipeline starts from; its placements are replaced (no search)."""
    torch.manual_seed(0)
    model, inputs = factory()
    return shell_plan(model, inputs, autopar.Cluster.local(n), n // tp, tp)


def _hand(
    factory, n: int, pp: int, schedule: str, microbatches: int, tp: int = 1, layout="dp", chunks=1, seed=0
):
    torch.manual_seed(0)
    model, inputs = factory()
    cluster = autopar.Cluster.local(n)
    base = _base(factory, n, tp)
    return plan_with_pipeline(
        base,
        model,
        inputs,
        cluster,
        pp,
        schedule=schedule,
        microbatches=microbatches,
        layout=layout,
        chunks=chunks,
        seed=seed,
    )


def _searched(factory, n: int, **fixed):
    torch.manual_seed(0)
    model, inputs = factory()
    return autopar.plan(model, inputs, autopar.Cluster.local(n), fixed=fixed, precision="fp32", time_limit_s=10)


def _assert_all_match(cases, checks) -> None:
    bad = [
        f"{f.__name__} {p.mesh} {p.schedule} ({p.solver.status}): {c}"
        for (f, p), c in zip(cases, checks, strict=True)
        if not c.ok(TOL)
    ]
    assert not bad, "pipelines that do not train like one device:\n" + "\n".join(bad)
    for c in checks:
        assert len(c.losses) == 3 and c.losses[0] != c.losses[2]


@pytest.mark.slow
def test_pipelines_on_4_processes_train_like_one_device():
    # each schedule once: the schedule's order does not depend on the model (1F1B runs in four cases below;
    # AUTOPAR_EXTENDED=1 adds LLaMA's dp 2 x pp 2 under it, 4.4 CPU-s a rank)
    # GPipe's with position_ids of shape (1, T) every sample shares, taken whole by every micro-batch of one
    # sample (where the rank's capture at that batch cannot tell them from the batch)
    shared = _hand(gpt2_tiny4_shared_positions, 4, 2, "GPipe", 8, tp=2, layout="megatron")
    cases = [(gpt2_tiny4_shared_positions, shared)]
    if os.environ.get("AUTOPAR_EXTENDED"):
        cases += [(llama_tiny4, _hand(llama_tiny4, 4, 2, "1F1B", 2))]
    cases += [
        (gpt2_tiny4, _hand(gpt2_tiny4, 4, 2, "1F1B", 4, tp=2, layout="megatron")),
        (llama_tiny4, _hand(llama_tiny4, 4, 2, "interleaved", 2, chunks=2)),
        # a first stage of frozen layers: no gradient crosses the cut back, and its ranks step no parameter
        (nanogpt_last_block, _hand(nanogpt_last_block, 4, 2, "1F1B", 2)),
    ]
    # Padded labels: micro-batches of one sequence with the loss split over tp, and ranks fed their own part.
    one_sequence = functools.partial(_hand, gpt2_tiny4_padded, 4, 2, "1F1B", 8, tp=2, layout="flowing")
    searched = _searched(gpt2_tiny4, 4, pp=2, schedule="1F1B")  # the search's own cuts and micro-batches
    assert len(searched.stages) == 2
    cases += [
        (gpt2_tiny4, searched),
        (gpt2_tiny4_padded, loss_split_layout(lambda seed: one_sequence(seed=seed))),
        (gpt2_tiny4_padded, _hand(gpt2_tiny4_padded, 4, 2, "1F1B", 2)),
    ]
    assert all(p.mesh["pp"] == 2 for _, p in cases)
    assert {p.mesh["dp"] for _, p in cases} == {1, 2}
    local_batch = [False] * (len(cases) - 1) + [True]
    _assert_all_match(cases, check_plans(cases, autopar.Cluster.local(4), local_batch=local_batch))


def test_the_seed_round_solves_each_layout_once_with_placements_that_divide_every_micro_batch(monkeypatch):
    """The pipeline search's seed round ranks meshes: each seed layout is solved once, with only the
    placements that divide a micro-batch at the most micro-batches (its answer holds at every count),
    not first without them and then again narrowed (LLaMA-2-70B on 64 H100s: 27.6 s -> 23 s, the same plan)."""
    from autopar.search.pipeline import mesh as pipeline_mesh

    torch.manual_seed(0)
    model, inputs = gpt2_tiny4()
    captured = capture(model, inputs)
    cluster = autopar.Cluster.local(4)
    mesh = MeshShape(dp=1, tp=2, pp=2)
    request = MeshRequest(captured, cluster, mesh, precision_spec("fp32"), "adamw", math.inf, recompute=True)
    pm = pipeline_mesh.prepare_pipeline_mesh(request)
    solves = []
    real = pipeline_mesh.solve_strategies
    monkeypatch.setattr(pipeline_mesh, "solve_strategies", lambda *a, **k: solves.append(1) or real(*a, **k))
    one = pipeline_mesh.solve_pipeline(pm, 5.0, milp=False, layouts=("megatron",), dividing_only=True)
    assert len(solves) == 1
    sharding = one.sharding
    shape = (mesh.dp, mesh.tp)
    assert all(microbatch_divides(pm.solved, pm.sp, sharding.solution.choice, shape, m) for m in pm.counts)
    both = pipeline_mesh.solve_pipeline(pm, 5.0, milp=False, layouts=("megatron",))
    assert len(solves) >= 2  # the layout without the restriction first (and narrowed where it does not divide)
    assert both.estimate.step_time_s <= one.estimate.step_time_s * (1 + 1e-9)


def test_the_milp_round_polishes_its_meshes_side_by_side_and_keeps_what_is_faster(monkeypatch):
    """The MILP round's meshes are independent and their solves run in HiGHS, outside the GIL: they are
    polished on threads side by side (each would wait forever at the barrier alone), each given the
    whole round's time; a polish replaces its mesh's seeded answer only when faster."""
    import threading
    import time
    from types import SimpleNamespace

    from autopar.search.pipeline import rounds as pipeline_rounds

    def result(step):
        return SimpleNamespace(estimate=SimpleNamespace(step_time_s=step), sharding=SimpleNamespace(
            solution=SimpleNamespace(choice=[0])))

    seeded = [("pm-a", result(2.0)), ("pm-b", result(1.0)), ("pm-c", result(3.0))]
    together = threading.Barrier(2, timeout=30)
    given = {}

    def polish(pm, left, **kwargs):
        together.wait()
        given[pm] = left
        return result({"pm-a": 1.5, "pm-b": 1.2}[pm])

    monkeypatch.setattr(pipeline_rounds, "solve_pipeline", polish)
    pipeline_rounds._milp_round(seeded, time.perf_counter() + 100.0, 2.0, ("1F1B",), None)
    assert sorted(given) == ["pm-a", "pm-b"]  # the MILP_MESHES fastest
    assert all(left == pytest.approx(pipeline_rounds.MILP_ROUND_OF * 2.0) for left in given.values())
    assert [r.estimate.step_time_s for _, r in seeded] == [1.5, 1.0, 3.0]
