"""A capture that traces four layers of a repeated stack equals the trace of all of them, node for node.

``capture_folded`` (:mod:`autopar.capture.fold`) writes the joint graph of L layers
from a four-layer trace. These tests hold it to the whole model's trace with
canonical names: same node names, ops, arguments, module paths, phases, shapes and
dtypes, same loss, gradients and placeholders. Dropout stays on (the GPT keeps its
default), and a mixture of experts and a model whose layers branch on their index
are among the cases.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autopar
from autopar.capture.fold import capture_folded, repeated_stack
from autopar.capture.joint import CapturedGraph, capture
from autopar.capture.unroll import fingerprint
from autopar.codegen.transfer import same_graph
from examples import families
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
    # two dense layers before six of experts (DeepSeek-V3 has three before fifty-eight): the dense ones traced whole
    "deepseek-v3 with dense first layers": (lambda: families.deepseek_v3(layers=8, dense=2), True),
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
    parent, attr, path, _ = repeated_stack(model)
    assert (parent, attr, path) == (model, "layers", "layers")


def test_every_node_of_a_folded_capture_stands_on_a_template_node_of_the_same_op() -> None:
    """The fold record (:class:`autopar.capture.graph.Fold`): each node of the L-layer graph maps onto a node of
    the four-layer trace with the same op and shapes; the first middle layer stands for L - 3 layers, every
    other template layer for one."""
    from collections import Counter

    model, inputs = llama(9, 64, 4, 128, seq=16)
    c = capture_folded(model, inputs)
    fold = c.fold
    assert fold is not None and fold.layers == 9 and fold.stack == "model.layers"
    template = {n.name: n for n in fold.template.gm.graph.nodes}
    for n in c.gm.graph.nodes:
        if n.op == "output":
            continue
        t = template[fold.origin[n.name]]
        assert t.op == n.op and (n.op == "placeholder" or t.target == n.target), n.name
        assert getattr(t.meta.get("val"), "shape", None) == getattr(n.meta.get("val"), "shape", None), n.name
    per_layer = Counter(fold.template_layer[o][0] for o in fold.origin.values() if o in fold.template_layer)
    one = per_layer[0]
    assert per_layer == {0: one, 1: (9 - 3) * one, 2: one, 3: one}
    assert capture(model, inputs).fold is None  # traced whole: nothing to stand on


@pytest.mark.parametrize("layers", [8, 11, "deepseek-v3"])
def test_the_folded_problem_costs_and_holds_what_the_whole_graph_does(layers: int | str) -> None:
    """The sharding problem of the four traced layers, its first middle layer counted L - 3 times
    (:mod:`autopar.search.sharding.fold`), gives every answer the objective, estimated step and peak memory
    that answer copied to all L layers gives on the whole graph's problem: the unrestricted optimum, its layout
    under a memory limit (which makes it recompute), the seed layouts, and (objective and step) random
    answers with every layer choosing alike. "deepseek-v3": two dense layers, traced whole, before six of
    experts; its peak is in the run's first layer's backward, while the middle layer's input gradient is live."""
    import random

    from autopar import Cluster
    from autopar.cost_models.memory import precision_spec
    from autopar.search.sharding.answer import evaluate
    from autopar.search.sharding.derived import restrict
    from autopar.search.sharding.fold import fold_problem, unfold_choice
    from autopar.search.sharding.mesh_solve import _fit_exactly, prepare_mesh
    from autopar.search.sharding.request import MeshRequest
    from autopar.search.sharding.seeds import seed_filter
    from autopar.search.sharding.step_memory import step_memory
    from autopar.solver import solve_strategies
    from autopar.solver.evaluate import objective_of

    # a small vocabulary: the layers' activations, not the logits, are what a memory limit cuts
    if layers == "deepseek-v3":
        model, inputs = families.deepseek_v3(layers=8, dense=2)
    else:
        model, inputs = llama(layers, 64, 4, 128, vocab=64, seq=64, batch=8)
    c = capture_folded(model, inputs)
    cluster = Cluster.local(4)
    mesh = cluster.check_mesh(dp=2, tp=2, pp=1)
    prec = precision_spec("bf16-mixed")

    def prepared(captured):
        return prepare_mesh(MeshRequest(captured, cluster, mesh, prec, "adamw", float("inf"), recompute=True))

    full, template = prepared(c), prepared(c.fold.template)
    folded = fold_problem(template.sp, c.fold)

    def figures(sp, choice):
        est = evaluate(sp, SimpleNamespace(choice=choice), (2, 2), cluster, 8, float("inf"), full.links)
        return objective_of(sp.problem, choice), est.step_time_s, step_memory(sp, choice, (2, 2)).peak

    def check(choice, memory=True):
        whole = figures(full.sp, unfold_choice(full.sp, folded, choice, c.fold))
        mine = figures(folded, choice)
        assert mine[:2] == pytest.approx(whole[:2], rel=1e-9)
        if memory:
            assert mine[2] == pytest.approx(whole[2], rel=1e-9)
        return mine

    # the figures of whatever answer a solve ends on are compared: the mixture's need not be proven optimal
    limit = 2 if layers == "deepseek-v3" else 10
    free = solve_strategies(folded.problem, time_limit_s=limit).choice
    _, _, peak = check(free)
    # a pipeline's figures per segment: the template's, each middle one standing for its layers
    from autopar.search.pipeline.segments import layer_figures
    from autopar.search.pipeline.stages import forward_segments

    whole_segments = layer_figures(
        c, full.sp, unfold_choice(full.sp, folded, free, c.fold), forward_segments(c), (2, 2), 1, 0.5, full.links
    )
    mine_segments = layer_figures(c, folded, free, forward_segments(c), (2, 2), 1, 0.5, full.links)
    assert [s.name for s in mine_segments] == [s.name for s in whole_segments]
    for a, b in zip(mine_segments, whole_segments, strict=True):
        # every figure but the name and the tied parameters' entries (tuples, compared alike below)
        assert dataclasses.astuple(a)[1:-1] == pytest.approx(dataclasses.astuple(b)[1:-1], rel=1e-9, abs=1e-15), a.name
        assert [t[:2] for t in a.tied] == [t[:2] for t in b.tied], a.name
        assert [x for t in a.tied for x in t[2:]] == pytest.approx([x for t in b.tied for x in t[2:]], rel=1e-9)
    params = {p.placeholder: p.name for p in c.fold.template.params}
    # LLaMA: the free answer's layout held, recompute left open, so that what the limit takes must come out of
    # the activations by recomputing them (with the layout open too, another layout may fit without it, as a solve
    # stopped on its time limit can leave one that does). The mixture: ZeRO held to stage 0, the rest open (its
    # peak, in the first layer's backward, is not one recomputing cuts)
    free_at = dict(zip(folded.nodes, (folded.strategies[i][k] for i, k in enumerate(free)), strict=True))

    def free_layout(name: str, s) -> bool:
        f = free_at[name]
        return (s.outputs, s.inputs, s.zero, s.only_at) == (f.outputs, f.inputs, f.zero, f.only_at)

    mixture = layers == "deepseek-v3"
    laid_out = restrict(folded.problem, folded, (lambda name, s: not s.zero) if mixture else free_layout)
    for share in (0.97, 0.9):
        tight = replace(laid_out, memory_limit=share * peak)
        # solved as the mesh search solves: again, seeing the buffers at its peak, while its answer is over the
        # limit by buffers on edges, which the MILP's memory rows leave out (the tiny mixture moves values so)
        solved = _fit_exactly(
            folded, tight, solve_strategies(tight, time_limit_s=limit), (2, 2), share * peak,
            lambda p: solve_strategies(p, time_limit_s=limit),
        )
        recomputing = solved.choice
        held = check(recomputing)[2]
        assert held <= share * peak * (1 + 1e-9)
        if not mixture:
            assert any(folded.strategies[i][k].recompute for i, k in enumerate(recomputing))
    for kind in ("megatron", "zero3"):
        problem = restrict(folded.problem, folded, seed_filter(kind, params, False))
        check(solve_strategies(problem, time_limit_s=limit).choice)
    rng = random.Random(0)
    # forbidden moves included: costs agree, though the memory of a forbidden move is moot; not the strategies
    # forbidden at one micro-batch (a reshape local only once a micro-batch is one sequence: Strategy.only_at)
    allowed = [[k for k, s in enumerate(ss) if not s.only_at] for ss in folded.strategies]
    for _ in range(3):
        choice = [rng.choice(ks) for ks in allowed]
        for group in folded.problem.groups or []:
            for v in group:
                choice[v] = choice[group[0]]
        check(choice, memory=False)


def test_the_mesh_search_on_the_folded_problem_finds_the_plan_the_whole_graph_gives() -> None:
    """``search_meshes`` solves each mesh on the four traced layers folded to all of them and carries the best
    answer onto the whole graph: the same meshes as solving the whole graph, the same step times and peaks on
    those both solve to optimality, a best plan at least as fast as any of those, the best
    one's placements naming every node of the whole graph; under a binding limit the answer carried over
    recomputes and fits there."""
    from autopar import Cluster
    from autopar.cost_models.memory import precision_spec
    from autopar.search.sharding.mesh import search_meshes

    model, inputs = llama(8, 64, 4, 128, vocab=64, seq=64, batch=8)
    c = capture_folded(model, inputs)
    # each search's, shared by its three meshes: the meshes proven optimal within it are compared, the others only
    # ranked. A mesh proven optimal stops at once (about a second each here), so the budget is paid only by a
    # machine slow enough to need it
    budget_s = 30.0
    cluster = Cluster.local(4)
    prec = precision_spec("bf16-mixed")
    runs = {fold: search_meshes(c, cluster, prec, "adamw", float("inf"), budget_s, fold=fold) for fold in (True, False)}
    (best, every), (whole_best, whole_every) = runs[True], runs[False]
    assert [r.mesh for r in every] == [r.mesh for r in whole_every]
    # a mesh whose MILP stops at its time limit (dp 2 x tp 2 here, "feasible") may end on another answer in
    # each search, as the machine's load has it; where both prove their answer optimal, they are the same
    proven = [(m, w) for m, w in zip(every, whole_every, strict=True) if m.solution.status == w.solution.status == "optimal"]
    assert proven
    for mine, whole in proven:
        assert mine.estimate.step_time_s == pytest.approx(whole.estimate.step_time_s, rel=1e-6), mine.mesh
        assert mine.estimate.memory.peak == pytest.approx(whole.estimate.memory.peak, rel=1e-6), mine.mesh
    assert best.estimate.step_time_s <= min(w.estimate.step_time_s for _, w in proven) * (1 + 1e-6)
    assert best.sp.template is None  # carried onto the whole graph
    names = {n.name for n in c.gm.graph.nodes if n.op != "output"}
    assert set(best.placements) == set(whole_best.placements) and set(best.placements) <= names

    limit = 5e6  # every mesh's unlimited answer peaks above 7 MB
    best, _ = search_meshes(c, cluster, prec, "adamw", limit, 6.0)
    assert best.sp.template is None and len(best.solution.choice) == len(best.sp.nodes)
    assert best.estimate.fits and best.estimate.memory.peak <= limit
    assert any(best.sp.strategies[i][k].recompute for i, k in enumerate(best.solution.choice))


@pytest.mark.parametrize("name", [name for name, (_, clean) in CASES.items() if clean])
def test_the_whole_graphs_strategies_read_off_the_templates_are_those_enumerated(name: str) -> None:
    """``unfold_strategies``: each node of the whole graph gets the strategies of the template node it stands on,
    inputs renamed, and they are what enumerating the whole graph gives, node for node."""
    from autopar.search.sharding.fold import unfold_strategies
    from autopar.search.sharding.strategies import enumerate_strategies

    model, inputs = CASES[name][0]()
    c = capture_folded(model, inputs)
    assert c.fold is not None
    for shape in [(2, 2), (4, 1)]:
        template = enumerate_strategies(c.fold.template.gm, shape)
        assert unfold_strategies(c, template) == enumerate_strategies(c.gm, shape)


def test_a_stack_whose_first_layers_differ_folds_the_run_after_them() -> None:
    """DeepSeek-V3's dense layers before its mixtures of experts: the run of like layers after them is folded,
    the dense ones traced whole and standing for themselves (the whole-trace equality is the test above)."""
    model, inputs = families.deepseek_v3(layers=8, dense=2)
    assert repeated_stack(model)[3] == 2
    folded = capture_folded(model, inputs)
    assert folded.fold is not None and (folded.fold.first, folded.fold.layers) == (2, 6)
    traced = {info.name for info in folded.fold.template.params}
    assert any(".layers.1." in n for n in traced) and any(".layers.5." in n for n in traced)
    assert not any(".layers.6." in n for n in traced)  # the run's four: layers 2 to 5
