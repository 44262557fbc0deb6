"""The sharding search picks the layouts practitioners pick: Megatron tensor parallel for a wide layer
at a small batch, plain data parallel for a narrow layer at a large batch."""

import math
import time

import pytest
import torch

import autopar
from autopar import Cluster
from autopar.capture.graph import node_module, node_phase
from autopar.capture.joint import capture
from autopar.core.placements import PARTIAL as P
from autopar.core.placements import REPLICATE as R
from autopar.core.placements import shard as S
from autopar.cost_models.memory import precision_spec
from autopar.hardware.cluster import MeshShape
from autopar.plans.records import Fixed
from autopar.search.pipeline.mesh import pipeline_meshes
from autopar.search.pipeline.order import ROOMY_STATES, pipeline_order, stage_states
from autopar.search.pipeline.preview import CARRIED_SLOW, HOPELESS, Preview
from autopar.search.pipeline.stages import forward_segments
from autopar.search.sharding.coarsen import repeated_groups
from autopar.search.sharding.mesh import flat_tp_sizes, search_meshes
from examples.models import llama, llama_tiny


def _tp(plan, param_suffix):
    """tp placement of the parameters whose name ends with ``param_suffix``."""
    found = {
        e["outputs"][0][1]
        for e in plan.placements.values()
        if e.get("param", "").endswith(param_suffix)
    }
    assert found, param_suffix
    return found


def _forward_activation_collectives(plan, module_prefix, min_bytes):
    """Collectives between activations (not parameters, not gradient sync) into one layer's forward ops.

    A collective belongs to the op that reads its result: the gather of the residual stream into a
    layer's first op is the layer's, whether its norm runs before the gather or after it. Collectives
    of fewer than ``min_bytes`` (statistics of a norm: latency, not bandwidth) are left out.
    """

    def inside(module):
        return module == module_prefix or module.startswith(module_prefix + ".")

    return [
        c
        for c in plan.solver.charged
        if c.reason == "data"
        and inside(c.dst_module)
        and c.phase == "forward"
        and not c.src_param
        and c.bytes >= min_bytes
    ]


@pytest.fixture(scope="module")
def wide_plan():
    model, inputs = llama(2, 8192, 64, 28672, vocab=8192, seq=1024, batch=1)
    return autopar.plan(model, inputs, Cluster.preset("dgx-h100"), global_batch_size=1)


def test_wide_layer_small_batch_is_megatron_tensor_parallel(wide_plan):
    plan = wide_plan
    assert plan.mesh == {"dp": 1, "tp": 8, "pp": 1}
    # Linear weights are (out, in): column-parallel shards dim 0, row-parallel dim 1
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"):
        assert _tp(plan, name) == {S(0)}, name
    for name in ("o_proj.weight", "down_proj.weight"):
        assert _tp(plan, name) == {S(1)}, name
    attention = [e for e in plan.placements.values() if "scaled_dot_product" in e["op"] and "backward" not in e["op"]]
    assert attention and all(e["inputs"][0][1] == S(1) for e in attention)  # split by heads
    # one all-reduce, or one reduce-scatter + all-gather pair, per sub-block (attention, MLP) of a layer
    # inside the stack (the first one's input comes in whatever layout the embedding leaves it in)
    activation = 1024 * 8192 * 2  # one (seq, hidden) activation in bf16
    kinds = [c.kind for c in _forward_activation_collectives(plan, "model.layers.1", activation / 100)]
    assert "all_to_all" not in kinds
    assert kinds.count("all_reduce") + kinds.count("reduce_scatter") == 2, kinds
    assert kinds.count("all_gather") == kinds.count("reduce_scatter"), kinds


def test_narrow_layer_large_batch_is_data_parallel():
    model, inputs = llama(4, 512, 8, 1408, vocab=4096, seq=512, batch=1)
    plan = autopar.plan(model, inputs, Cluster.preset("dgx-h100"), global_batch_size=256)
    mesh = (plan.mesh["dp"], plan.mesh["tp"])
    sharded_dims = [d for d, n in enumerate(mesh) if n > 1]
    matmuls = [e for e in plan.placements.values() if e["op"] in ("aten.mm.default", "aten.addmm.default")]
    forward = [e for e in matmuls if not any(p.is_partial() for out in e["outputs"] for p in out)]
    assert forward
    # every activation matmul splits the batch over all devices: no tensor parallelism of activations
    for e in plan.placements.values():
        if e["op"] == "aten.mm.default" and e["module"].startswith("model.layers"):
            rows, cols = e["inputs"]
            if all(rows[d] == S(0) for d in sharded_dims):
                continue  # activations (batch*seq) x weight: data parallel
            # weight-gradient matmuls contract over the batch: partial sums, reduced once per step
            assert all(o == P for o in e["outputs"][0] if o != R), e
    # the forward moves parameters (when they are stored sharded), never activations
    forward = [c for c in plan.solver.charged if c.phase == "forward" and c.bytes > 1e4]
    assert all(c.src_param for c in forward), forward[:3]


def test_meshes_inside_a_node_come_first_and_a_deadline_leaves_the_rest_out():
    """The search order (tensor parallel inside a node, largest first) and the time limit as a deadline."""
    assert flat_tp_sizes(Cluster.preset("dgx-h100", nodes=8), 512) == [8, 4, 2, 1, 16, 32, 64]
    assert flat_tp_sizes(Cluster.preset("dgx-h100", nodes=8), 512, tp=2) == [2]
    # tensor parallel inside a pipeline stays on a node's devices: no tp of 3 or 6 on 8-GPU nodes
    tps = {m.tp for m in pipeline_meshes(Cluster.preset("dgx-a100", nodes=96), 1536, 62, Fixed())}
    assert tps == {1, 2, 4, 8}

    model, inputs = llama_tiny()
    captured = capture(model, inputs)
    cluster = Cluster.local(4)
    prec = precision_spec("fp32")
    _, every = search_meshes(captured, cluster, prec, "adamw", float("inf"), 5.0)
    assert [r.mesh.tp for r in every] == [4, 2, 1]
    notes: list[str] = []
    best, first = search_meshes(captured, cluster, prec, "adamw", float("inf"), 5.0, deadline=0.0, notes=notes)
    assert [r.mesh.tp for r in first] == [4] and best is first[0]
    assert notes == ["meshes: time limit reached after 1 of 3 dp x tp meshes"]  # what the plan's record says


def test_the_first_pipeline_of_a_neighbouring_tp_is_costed_however_it_previews():
    """Figures carried over from a mesh without a pipeline preview a tp's pipelines up to 15% slow (GPT 39B on
    512 A100s: tp = 8 previewed past the costed tp = 4 pipeline, then costed faster), so the first pipeline of
    half or twice the fastest costed tp is costed; once its tp has been costed, the preview may rule it out."""
    preview = Preview.__new__(Preview)  # the rule alone: previewed steps given, no graph
    preview.figures, preview.tried, preview.flat_best = {4: None, 8: None}, set(), 10.0
    preview.costed_shapes, preview.best_recomputed = set(), False
    preview.best, preview.best_mesh = (math.inf, 0), None
    steps = {4: 9.0, 8: 11.0}
    preview.step = lambda mesh: steps[mesh.tp]
    tp4, tp8, tp8_deeper = MeshShape(32, 4, 4), MeshShape(32, 8, 2), MeshShape(16, 8, 4)
    assert not preview.hopeless(tp8)  # nothing costed yet: every tp with figures gets a pipeline costed
    preview.costed(tp4, 8.97)
    assert not preview.hopeless(tp8)  # 11 > 1.1 x 8.97, but tp = 8 has no costed pipeline yet
    steps[8] = 8.97 * (1 + HOPELESS) * (1 + CARRIED_SLOW) * 1.01
    assert preview.hopeless(tp8)  # past the margin of figures carried over too
    steps[8] = 11.0
    preview.costed(tp8, 8.65)
    assert 11.0 > 8.65 * (1 + HOPELESS) and preview.hopeless(tp8_deeper)


def test_a_hopeless_first_pipeline_of_a_tp_leaves_the_meshes_behind_it_in_the_search(monkeypatch) -> None:
    """The first pipeline of a tp goes ahead of the previewed order and is hopeless only under a wider margin,
    so when it is ruled out the meshes previewed faster behind it are still costed; the others are left out,
    and the note counts them."""
    from types import SimpleNamespace

    from autopar.search.pipeline import rounds as pipeline_rounds

    lead, close, far = MeshShape(8, 4, 2), MeshShape(4, 8, 2), MeshShape(2, 8, 4)
    steps = {lead: 1.3, close: 1.05, far: 1.5}
    preview = SimpleNamespace(
        order=lambda ms: [m for m in (lead, close, far) if m in ms],
        hopeless=lambda m: steps[m] > 1.1,
        costed=lambda *a, **k: None,
        learn=lambda *a, **k: None,
        flat_best=1.0,
    )
    costed = []
    monkeypatch.setattr(pipeline_rounds, "prepare_pipeline_mesh", lambda request, **k: SimpleNamespace(mesh=request.mesh))
    monkeypatch.setattr(pipeline_rounds, "solve_pipeline", lambda pm, *a, **k: costed.append(pm.mesh))
    notes: list[str] = []
    args = (None, Cluster.local(64), precision_spec("fp32"), "adamw", float("inf"), [lead, close, far], 60.0)
    pipeline_rounds.search_pipelines(*args, preview=preview, notes=notes)
    assert costed == [close]
    assert notes[0] == "pipelines: 2 of 3 meshes left out, previewed more than 10% slower than the best plan"


def test_every_copy_of_a_middle_layer_shares_its_variables_weights_and_gradient_sums_included() -> None:
    """A layer's weights (placeholders, named by their layer) and the backward's gradient sums on
    the residual stream (no autograd node of their own) are matched across copies like every
    other node: left out, each copy's choice would be free, and the memory rows of the stack
    would not repeat from one layer to the next."""
    model, inputs = llama(6, 64, 4, 128, seq=16)
    c = capture(model, inputs)
    names = {n.name for n in c.gm.graph.nodes if n.op != "output"}
    grouped = {name for g in repeated_groups(c.gm, names) for name in g}
    middle = [n for n in c.gm.graph.nodes if ".layers.2." in node_module(n) or "_layers_2_" in n.name]
    weights = [n for n in middle if n.op == "placeholder"]
    sums = [n for n in middle if n.target == torch.ops.aten.add.Tensor and node_phase(n) == "backward"]
    assert len(weights) == 9 and sums
    assert not [n.name for n in middle if n.name not in grouped]


def test_pipelines_whose_stages_hold_their_states_with_room_are_costed_first() -> None:
    """Before anything is previewed, the fewest stages whose parameters, gradients and ZeRO-1
    optimizer state take at most half the limit go first: fewer stages that fit only by
    ZeRO-3 or heavy recompute spent LLaMA-3-405B's search on 16,384 H100s (15.8 s a step
    against 7.4 s for Meta's pp = 16 layout)."""
    model, inputs = llama(8, 64, 4, 128, seq=16)
    c = capture(model, inputs)
    cluster = Cluster.preset("dgx-h100", nodes=8)
    meshes = pipeline_meshes(cluster, 512, len(forward_segments(c)), Fixed())
    prec = precision_spec("bf16-mixed")
    stage = {m: stage_states(c, prec, "adamw", m) for m in meshes}
    limit = stage[min((m for m in meshes if m.tp == 8), key=lambda m: m.pp)] * 0.6 / ROOMY_STATES
    order = pipeline_order(c, prec, "adamw", limit, meshes, tp_ref=8)
    roomy = [m for m in order if stage[m] <= ROOMY_STATES * limit]
    assert order[: len(roomy)] == roomy and len(roomy) < len(order)
    assert order[0].tp == 8 and order[0].pp == min(m.pp for m in roomy if m.tp == 8) > 2


def test_a_seeded_pipeline_far_slower_than_the_best_flat_plan_is_not_polished(monkeypatch) -> None:
    """The MILP round polishes the fastest seeded pipelines, but not one more than HOPELESS slower than
    the best plan without a pipeline: the margin at which the seed round leaves a mesh uncosted."""
    from types import SimpleNamespace

    from autopar.search.pipeline import rounds as pipeline_rounds

    polished = []
    monkeypatch.setattr(pipeline_rounds, "solve_pipeline", lambda pm, *a, **k: polished.append(pm))

    def seeded(step: float):
        solution = SimpleNamespace(choice=[0])
        return SimpleNamespace(estimate=SimpleNamespace(step_time_s=step), sharding=SimpleNamespace(solution=solution))

    entries = [("slow", seeded(1.0 * (1 + HOPELESS) * 1.01)), ("close", seeded(1.05))]
    pipeline_rounds._milp_round(entries, time.perf_counter() + 60, 0.0, ("1F1B",), None, flat_best=1.0)
    assert polished == ["close"]
    pipeline_rounds._milp_round(entries, time.perf_counter() + 60, 0.0, ("1F1B",), None)  # no flat plan: both
    assert polished == ["close", "close", "slow"]


def test_a_pipeline_with_twice_the_stages_of_the_fastest_is_costed_however_it_previews() -> None:
    """Figures of a costed pipeline carry the recompute its stages' memory forced; twice the stages hold half
    the states and may need none, so they preview slow (LLaMA-3-405B on 16,384 H100s: pp = 16 ruled out
    behind pp = 8's 13.0 s, and costed 10.1 s). When the fastest recomputes, that mesh goes first and is not
    hopeless until costed."""
    preview = Preview.__new__(Preview)  # the rule alone: previewed steps given, no graph
    preview.figures, preview.tried, preview.flat_best = {8: None}, set(), math.inf
    preview.best, preview.best_mesh, preview.costed_shapes = (math.inf, 0), None, set()
    pp4, pp8, pp16, pp32 = MeshShape(512, 8, 4), MeshShape(256, 8, 8), MeshShape(128, 8, 16), MeshShape(64, 8, 32)
    steps = {pp4: 15.0, pp8: 13.0, pp16: 15.0, pp32: 14.0}
    preview.step = steps.get
    preview.costed(pp8, 13.0)  # without recompute: the previews stand
    assert preview.hopeless(pp16)
    preview.best = (math.inf, 0)
    preview.costed(pp8, 13.0, recomputed=True)
    assert 15.0 > 13.0 * (1 + HOPELESS) and not preview.hopeless(pp16) and preview.hopeless(pp4)
    assert preview.order([pp32, pp16])[0] == pp16  # ahead of pp = 32, which previews faster
    preview.costed(pp16, 14.9)  # costed, and slower: the rule no longer holds it back
    assert preview.hopeless(pp16) and preview.order([pp32, pp16]) == [pp32, pp16]


def test_a_restriction_asks_a_keyed_filter_once_per_strategy_list_and_key_with_the_same_masks() -> None:
    """``restrict`` shares a mask between nodes with the same strategy list and filter key (the copies of a
    repeated layer): every seed, ZeRO and micro-batch filter, alone and combined, forbids exactly what the
    same filter asked node by node forbids, and asks far fewer questions."""
    from autopar.search.sharding.derived import restrict
    from autopar.search.sharding.mesh_solve import both, prepare_mesh, zero_filter
    from autopar.search.sharding.microbatches import microbatch_filter
    from autopar.search.sharding.request import MeshRequest
    from autopar.search.sharding.seeds import seed_filter

    model, inputs = llama(8, 64, 4, 128, seq=16, batch=8)
    c = capture(model, inputs)
    cluster = Cluster.local(8)
    mesh = cluster.check_mesh(dp=2, tp=4, pp=1)
    mp = prepare_mesh(MeshRequest(c, cluster, mesh, precision_spec("bf16-mixed"), "adamw", float("inf")))
    sp = mp.sp
    params = {p.placeholder: p.name for p in c.params}
    filters = {
        "megatron": seed_filter("megatron", params, False),
        "zero1": zero_filter(sp, 1),
        "zero3": zero_filter(sp, 3),
        "microbatches": microbatch_filter(c, (2, 4), 4),
    }
    filters["megatron+zero3"] = both(sp, filters["megatron"], filters["zero3"])
    filters["microbatches+megatron"] = both(sp, filters["microbatches"], filters["megatron"])
    for name, f in filters.items():
        asked = []

        def counted(node: str, s, f=f, asked=asked) -> bool:
            asked.append(node)
            return f(node, s)

        plain = restrict(sp.problem, sp, lambda node, s, f=f: f(node, s))  # no key: every node asked
        counted.node_key = f.node_key
        shared = restrict(sp.problem, sp, counted)
        assert shared.node_costs == plain.node_costs and shared.groups == plain.groups, name
        forbidden = sum(math.isinf(x) for row in plain.node_costs for x in row)
        assert forbidden > 0 or name == "microbatches", name
        assert len(asked) < sum(len(s) for s in sp.strategies) / 2, name


def _timed_pipeline_search(monkeypatch, polish_s: float) -> tuple[list, tuple, tuple[MeshShape, MeshShape]]:
    """search_pipelines on two meshes on a clock where preparing a mesh takes 1 s, solving its seed layouts 4 s
    and polishing it ``polish_s``: (the calls made, the arguments but the time limit, the two meshes). The second
    mesh's pipeline is the faster (0.9 s a step against 1.0)."""
    from types import SimpleNamespace

    from autopar.search.pipeline import rounds as pipeline_rounds

    first, second = MeshShape(8, 4, 2), MeshShape(4, 8, 2)
    clock = [0.0]
    monkeypatch.setattr(pipeline_rounds.time, "perf_counter", lambda: clock[0])

    def prepare(request, **k):
        clock[0] += 1.0
        return SimpleNamespace(mesh=request.mesh)

    calls = []

    def solve(pm, left, **k):
        polish = k.get("layouts") == ()
        clock[0] += polish_s if polish else 4.0
        calls.append((pm.mesh, "polish" if polish else "seeds"))
        solution = SimpleNamespace(choice=[0])
        step = 1.0 if pm.mesh == first else 0.9
        return SimpleNamespace(estimate=SimpleNamespace(step_time_s=step), sharding=SimpleNamespace(solution=solution))

    monkeypatch.setattr(pipeline_rounds, "prepare_pipeline_mesh", prepare)
    monkeypatch.setattr(pipeline_rounds, "solve_pipeline", solve)
    args = (None, Cluster.local(64), precision_spec("fp32"), "adamw", float("inf"), [first, second])
    return calls, args, (first, second)


def test_the_pipeline_seed_round_leaves_time_to_polish_the_best_mesh(monkeypatch) -> None:
    """Another pipeline mesh is costed only if, at what costing one took, the MILP's polish of the best still fits
    in the time left: on a clock where preparing a mesh takes 1 s and solving it 4 s, a 12-s search costs one mesh
    and polishes it, where a second mesh would have left no time for the polish."""
    from autopar.search.pipeline import rounds as pipeline_rounds

    calls, args, (first, _) = _timed_pipeline_search(monkeypatch, polish_s=4.0)
    notes: list[str] = []
    pipeline_rounds.search_pipelines(*args, 12.0, notes=notes)
    assert calls == [(first, "seeds"), (first, "polish")]
    assert notes == ["pipelines: time limit reached after 1 of 2 meshes"]
    calls, args, _ = _timed_pipeline_search(monkeypatch, polish_s=4.0)  # a clock from 0 again
    pipeline_rounds.search_pipelines(*args, 30.0)  # room for both, and the polish
    assert [c[1] for c in calls] == ["seeds", "seeds", "polish", "polish"]


def test_time_the_pipeline_rounds_leave_costs_the_meshes_not_reached(monkeypatch) -> None:
    """The seed round stops where another mesh would leave no time to polish the best; once polished (here in 1 s,
    less than the 4 s a solve took), the time left costs the next mesh, as it ends before the limit: a 13-s search
    costs the first mesh, polishes it, then costs the second (and has no time left to polish that one). Before,
    it stopped after the first polish with 7 s of its 13 unspent. With ``spare_s=3`` (the planner's
    full-recompute pass after it), the second mesh, which would end at 11 s, is left: the time after the first
    polish ends 3 s before the limit."""
    from autopar.search.pipeline import rounds as pipeline_rounds

    calls, args, (first, second) = _timed_pipeline_search(monkeypatch, polish_s=1.0)
    notes: list[str] = []
    found = pipeline_rounds.search_pipelines(*args, 13.0, notes=notes)
    assert calls == [(first, "seeds"), (first, "polish"), (second, "seeds")]
    assert notes == ["pipelines: no time left for the MILP on 1 meshes"]
    assert sorted(r.estimate.step_time_s for r in found) == [0.9, 1.0]
    calls, args, _ = _timed_pipeline_search(monkeypatch, polish_s=1.0)
    pipeline_rounds.search_pipelines(*args, 13.0, spare_s=3.0)
    assert calls == [(first, "seeds"), (first, "polish")]


def test_the_pipeline_search_keeps_time_for_the_full_recompute_pass_only_while_it_may_run() -> None:
    """The planner's spare for the pass after the pipelines (:func:`autopar.api.planner._full_recompute_spare`): kept
    while no pipeline found both fits and is idle for at most IDLE_PIPELINE of its work, none once one does (the
    pass then does not run)."""
    from types import SimpleNamespace

    from autopar.api import planner

    def found(fits: bool, bubble: float) -> SimpleNamespace:
        return SimpleNamespace(estimate=SimpleNamespace(fits=fits, bubble_s=bubble, step_time_s=1.0))

    keep = 2 * planner.FULL_RECOMPUTE_AT_LEAST
    assert planner._full_recompute_spare([]) == keep
    assert planner._full_recompute_spare([found(False, 0.1)]) == keep  # none fits
    assert planner._full_recompute_spare([found(True, 0.9)]) == keep  # 90% of the step idle: 9 times its work
    assert planner._full_recompute_spare([found(True, 0.9), found(True, 0.2)]) == 0.0


def test_meshes_without_a_pipeline_keep_a_quarter_of_their_share_once_a_pipeline_fits(monkeypatch) -> None:
    """A model whose states outgrow a node has its pipelines searched first; the meshes without one are then
    costed with their seed layouts only, in OPTIONAL_FLAT of their share of the time limit (LLaMA-2-70B on 64
    H100s: given the whole share they took 16 of the search's 36 s and lost by 4.5%)."""
    from types import SimpleNamespace

    from autopar.api import planner

    model, inputs = llama(8, 64, 4, 128, seq=16)
    c = capture(model, inputs)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    fits = SimpleNamespace(estimate=SimpleNamespace(fits=True, step_time_s=1.0), mesh=MeshShape(dp=2, tp=2, pp=2))
    budgets = []
    monkeypatch.setattr(planner, "total_state_bytes", lambda *a: math.inf)  # the states outgrow the node
    monkeypatch.setattr(planner, "_pipelines", lambda *a, **k: [fits])
    monkeypatch.setattr(planner, "plan_flat", lambda *a, **k: budgets.append((a[7], a[9])))
    monkeypatch.setattr(planner, "unfold_pipeline", lambda pipe, request: pipe)
    monkeypatch.setattr(planner, "_pipelined", lambda *a, **k: "pipelined")
    prec = precision_spec("bf16-mixed")
    assert planner._plan_sharded(c, cluster, 8, prec, "adamw", 80e9, Fixed(), 60.0) == "pipelined"
    assert budgets == [(pytest.approx(60.0 * 0.4 * planner.OPTIONAL_FLAT), True)]


def test_meshes_without_a_pipeline_are_costed_beside_the_pipeline_search_and_in_full_if_none_fits(monkeypatch) -> None:
    """The seed-layout costing of the meshes without a pipeline runs on a second thread while the pipelines
    are searched (HiGHS solves outside the GIL: on two cores they overlap); if no pipeline fits, those meshes
    are then searched in full, with their whole share."""
    import threading
    from types import SimpleNamespace

    from autopar.api import planner

    model, inputs = llama(8, 64, 4, 128, seq=16)
    c = capture(model, inputs)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    unfit = SimpleNamespace(estimate=SimpleNamespace(fits=False, step_time_s=1.0), mesh=MeshShape(dp=2, tp=2, pp=2))
    flat_started, calls, overlapped = threading.Event(), [], []

    def pipelines(*a, **k):
        overlapped.append(flat_started.wait(timeout=30))  # the flat search started while this one runs
        return [unfit]

    def plan_flat(*a, **k):
        calls.append((a[7], a[9]))
        flat_started.set()

    monkeypatch.setattr(planner, "total_state_bytes", lambda *a: math.inf)  # the states outgrow the node
    monkeypatch.setattr(planner, "_pipelines", pipelines)
    monkeypatch.setattr(planner, "plan_flat", plan_flat)
    monkeypatch.setattr(planner, "unfold_pipeline", lambda pipe, request: pipe)
    monkeypatch.setattr(planner, "_pipelined", lambda *a, **k: "pipelined")
    prec = precision_spec("bf16-mixed")
    assert planner._plan_sharded(c, cluster, 8, prec, "adamw", 80e9, Fixed(), 60.0) == "pipelined"
    assert overlapped == [True]
    assert calls == [(pytest.approx(60.0 * 0.4 * planner.OPTIONAL_FLAT), True), (pytest.approx(60.0 * 0.4), False)]


def test_megatron_beside_zero3_is_a_seed_of_the_full_search_where_no_other_seed_fits(monkeypatch) -> None:
    """Beside a tp axis, Megatron's layout with the parameters also split over dp is a seed where no other fits:
    tiny LLaMA at one sequence a rank on dp 2 x tp 2 under 560 KB, where Megatron's layout, context parallelism
    and context parallelism over the dp ranks do not fit (the seeds-only search proves it in about a second) and
    the local batch of one cannot be cut into micro-batches. The full search tries it when the other seeds found
    nothing and finds an answer at one micro-batch (524 KB, the unrestricted MILP's in one run); costed with seed
    layouts only (beside a pipeline search), the mesh does not try it (its 5 s were the last 5 s of LLaMA-2-70B's
    plan)."""
    from autopar.search.sharding import mesh as mesh_search

    tried: list[str] = []
    layout_filter = mesh_search.layout_filter

    def recording(kind, *args, **kwargs):
        tried.append(kind)
        return layout_filter(kind, *args, **kwargs)

    monkeypatch.setattr(mesh_search, "layout_filter", recording)
    model, inputs = llama_tiny()
    captured = capture(model, {k: v[:2] for k, v in inputs.items()})
    cluster = Cluster.local(4)
    prec = precision_spec("fp32")
    seeds_only, _ = search_meshes(captured, cluster, prec, "adamw", 560_000, 10.0, tp=2, milp=False, require_one=False)
    assert seeds_only is None
    assert "megatron" in tried and "megatron_zero3" not in tried
    tried.clear()
    best, _ = search_meshes(captured, cluster, prec, "adamw", 560_000, 10.0, tp=2)
    assert best is not None and best.estimate.fits and best.microbatches == 1
    assert "megatron_zero3" in tried


def _flat_answer(dp, tp, step):
    """A mesh without a pipeline as its search answers it: it fits, its step, its problem's build times."""
    from types import SimpleNamespace

    return SimpleNamespace(
        estimate=SimpleNamespace(fits=True, step_time_s=step), mesh=MeshShape(dp=dp, tp=tp, pp=1),
        solution=SimpleNamespace(choice=[0]), timings={"strategies_s": 0.2, "build_s": 0.3},
    )


def test_meshes_without_a_pipeline_that_win_after_all_are_searched_in_full(monkeypatch) -> None:
    """Costed with their seed layouts only (the states outgrow a node: a pipeline was expected to win), the meshes
    without a pipeline are searched in full when their best beats every pipeline (Mixtral-8x7B on 64 H100s: seeds
    given a quarter of a second each answered 7.05 s where dp 64 under ZeRO-3 costs 6.93 s): those within HOPELESS
    of the best, best first, each keeping the faster answer, in the time left before the deadline and no more. On a
    clock where a mesh's search takes its problem's build (0.5 s) and all the solve time it is given: two meshes
    share 20 s; with 2.5 s left one mesh is searched (1 s of solving), with none left none, and the notes say so."""
    from autopar.api import flat_plan

    clock = [0.0]
    monkeypatch.setattr(flat_plan.time, "perf_counter", lambda: clock[0])

    searched = []

    def search(captured, cluster, prec, optimizer, limit, fixed, share, **k):
        searched.append(((fixed.dp, fixed.tp), share))
        clock[0] += 0.5 + share
        better = {(4, 2): _flat_answer(4, 2, 0.95)}.get((fixed.dp, fixed.tp), _flat_answer(fixed.dp, fixed.tp, 1.2))
        return better, [better]

    monkeypatch.setattr(flat_plan, "_search", search)

    def polish(seeded, deadline):
        searched.clear()
        notes: list[str] = []
        flat, began = flat_plan.FlatFound(seeded[0], seeded, [], 6.0), clock[0]
        polished = flat_plan.polish_flat(None, None, None, "adamw", 80e9, Fixed(), flat, deadline, notes)
        assert clock[0] <= max(deadline, began) + 1e-9  # nothing searched past the deadline
        return polished, notes

    seeded = [_flat_answer(2, 4, 1.00), _flat_answer(4, 2, 1.05), _flat_answer(8, 1, 1.50)]
    polished, notes = polish(seeded, 20.0)
    assert [m for m, _ in searched] == [(2, 4), (4, 2)]  # dp 8's 1.5 s is more than HOPELESS behind
    assert searched[0][1] == pytest.approx(9.5) and searched[1][1] == pytest.approx(9.5)
    assert polished.best.estimate.step_time_s == 0.95 and polished.results[0] is seeded[0]
    assert [r.estimate.step_time_s for r in polished.results] == [1.00, 0.95, 1.50] and notes == []

    clock[0] = 17.5
    polished, notes = polish(seeded + [_flat_answer(1, 8, 1.08)], 20.0)
    assert searched == [((2, 4), pytest.approx(flat_plan.POLISH_AT_LEAST))]
    assert polished.best is seeded[0]
    assert notes == [
        "meshes without a pipeline: 1 of 3 searched in full before the time limit; the rest keep their seed "
        "layouts' answers"
    ]
    clock[0] = 21.0
    polished, notes = polish(seeded, 20.0)
    assert searched == [] and polished.results == seeded
    assert notes == ["meshes without a pipeline: no time left to search them in full; their seed layouts' answers stand"]


def test_meshes_without_a_pipeline_searched_in_full_keep_to_the_time_limit(monkeypatch) -> None:
    """The planner searches the winning meshes without a pipeline in full only in the time the pipelines left:
    Mixtral-8x7B on 64 H100s took 63.55 s of its 60 s limit when that search had at least 6 s whatever was left.
    On a clock where the pipelines end at 59.5 s of 60 s, none is searched and the call's notes say why; where they
    end at 30 s, the search ends by 60 s; and a pipeline that wins leaves them as they are. The best pipeline is
    carried onto the whole graph only when it wins (Mixtral's took 2.6 s after the deadline to lose)."""
    from types import SimpleNamespace

    from autopar.api import flat_plan, planner

    clock = [0.0]
    monkeypatch.setattr(planner.time, "perf_counter", lambda: clock[0])

    seeded = [_flat_answer(2, 4, 1.00), _flat_answer(4, 2, 1.05)]
    searched = []

    def search(captured, cluster, prec, optimizer, limit, fixed, share, **k):
        searched.append((fixed.dp, fixed.tp))
        clock[0] += 0.5 + share
        return _flat_answer(fixed.dp, fixed.tp, 0.9), []

    model, inputs = llama(8, 64, 4, 128, seq=16)
    c = capture(model, inputs)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    monkeypatch.setattr(planner, "total_state_bytes", lambda *a: math.inf)  # the states outgrow the node
    monkeypatch.setattr(planner, "plan_flat", lambda *a, **k: flat_plan.FlatFound(seeded[0], list(seeded), [], 6.0))
    monkeypatch.setattr(flat_plan, "_search", search)
    monkeypatch.setattr(planner, "flat_result", lambda *a: a[-1])
    unfolded = []
    monkeypatch.setattr(planner, "unfold_pipeline", lambda pipe, request: unfolded.append(pipe) or pipe)
    monkeypatch.setattr(planner, "_pipelined", lambda *a, **k: "pipelined")
    prec = precision_spec("bf16-mixed")
    for pipes_end, pipe_step, polished in ((59.5, 2.0, []), (30.0, 2.0, [(2, 4), (4, 2)]), (30.0, 0.5, [])):
        pipe = SimpleNamespace(estimate=SimpleNamespace(fits=True, step_time_s=pipe_step), mesh=MeshShape(dp=2, tp=2, pp=2))

        def pipelines(*a, pipe=pipe, pipes_end=pipes_end, **k):
            clock[0] = pipes_end
            return [pipe]

        monkeypatch.setattr(planner, "_pipelines", pipelines)
        clock[0], notes = 0.0, []
        searched.clear(), unfolded.clear()
        answer = planner._plan_sharded(c, cluster, 8, prec, "adamw", 80e9, Fixed(), 60.0, notes)
        assert searched == polished and clock[0] <= 60.0
        assert unfolded == ([pipe] if pipe_step < 1.0 else [])
        if pipe_step < 1.0:
            assert answer == "pipelined"
        else:
            assert answer.best.estimate.step_time_s == (0.9 if polished else 1.0)
        assert ("no time left" in "; ".join(notes)) == (pipes_end > 59)


def test_no_solve_of_a_mesh_is_given_time_past_solve_by(monkeypatch) -> None:
    """``solve_by`` (the searches in full of the meshes without a pipeline that run after the pipelines, in the
    time left) overrules the least a mesh's seeds and MILP otherwise get (a quarter of the seeds' share, half the
    mesh's for the MILP, a second for each solve of a call): past it each seed is solved with no time (its greedy
    start), and once one fits the MILP does not run; before it, no solve is given more than the time left."""
    from autopar.search.sharding import mesh as mesh_module

    model, inputs = llama_tiny()
    captured = capture(model, {k: v[:4] for k, v in inputs.items()})
    given = []
    solve = mesh_module.solve_prepared

    def recording(mp, time_limit_s, **k):
        given.append((time_limit_s, k.get("allowed") is not None))
        left = max(k["solve_by"] - time.perf_counter(), 0.0) if k["solve_by"] is not None else None
        assert left is not None and time_limit_s <= left + 0.1  # the time left when the budget was worked out
        return solve(mp, time_limit_s, **k)

    monkeypatch.setattr(mesh_module, "solve_prepared", recording)
    args = (captured, Cluster.local(4), precision_spec("fp32"), "adamw", math.inf, 10.0)
    best, _ = search_meshes(*args, tp=2, dp=2, solve_by=time.perf_counter() - 1.0)
    assert best is not None and given and all(t == 0.0 and seed for t, seed in given)
    given.clear()
    search_meshes(*args, tp=2, dp=2, solve_by=time.perf_counter() + 3.0)
    assert given and given[0][0] < 3.0  # the seeds' 5 s cut to the time left (each call checked in `recording`)
    given.clear()
    # room past the call's own 10 s for the seeds and the MILP on any machine: with 6 s, a slow one spent it all
    # on the seed (its 5 s share, capped by the time left) and rightly skipped the MILP
    search_meshes(*args, tp=2, dp=2, solve_by=time.perf_counter() + 30.0)
    assert given and not all(seed for _, seed in given)
