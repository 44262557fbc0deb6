"""The correctness oracle: a plan trains like the single-device model, or it is wrong.

``check_plan`` runs a few AdamW steps of the model twice — once eagerly on
one device, once under the plan on local processes — and compares, per step,
the loss, the gathered gradients of the first step and the parameters after
the last step.

An error is measured per group of tensors (gradients, parameters) as the
relative L2 error of the whole group, ``‖parallel − single‖ / ‖single‖``
over every element of every tensor: the usual relative error of a vector.
Not per tensor and not in the max norm, because Adam turns round-off into
steps of size ~lr wherever the true gradient is zero (GPT-2's key bias, GELU
units that never fire): such an element differs by up to lr·steps in *any*
two runs that sum in a different order — plain data parallelism with an
all-reduce included — so a max-norm or per-tensor measure reports the
optimizer's noise, not the plan's correctness.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import random
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autopar.api.parallelizer import parallelize
from autopar.api.planner import plan as make_plan
from autopar.capture.joint import CapturedGraph, capture
from autopar.core.errors import LaunchError
from autopar.core.placements import Placements
from autopar.cost_models.estimate import Estimate
from autopar.cost_models.graph_cache import captured_with_stats, resize_batch
from autopar.cost_models.memory import precision_spec
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.plans.plan import Plan
from autopar.runtime.launch import launch
from autopar.search.pipeline.stages import forward_segments
from autopar.search.sharding.layouts import layout_placements
from autopar.search.sharding.node_keys import input_names
from autopar.search.sharding.random_ops import is_random
from autopar.search.sharding.strategies import enumerate_strategies
from autopar.verify.reference import single_device_run, slice_batch, train

log = logging.getLogger(__name__)


@dataclass
class Check:
    """How far a parallel run drifted from the single-device run."""

    losses: list[float]
    reference_losses: list[float]
    loss_error: float
    grad_error: float
    param_error: float
    worst: str  # the tensor with the largest error
    collectives: dict[str, int] = field(default_factory=dict)
    # what rank 0 trained in: "graph" (its graphs' inputs), "masters" (what the optimizer steps),
    # "optimizer" (its state), "grads" (the masters' gradients): floating dtypes of each
    dtypes: dict[str, list[str]] = field(default_factory=dict)
    param_max_abs: float = 0.0  # the largest difference of any one parameter element after the last step

    def ok(self, tolerance: float = 1e-5) -> bool:
        return max(self.loss_error, self.grad_error, self.param_error) <= tolerance

    def __str__(self) -> str:
        return (
            f"loss {self.loss_error:.1e}, gradients {self.grad_error:.1e}, parameters {self.param_error:.1e} "
            f"(relative L2 error; largest difference: {self.worst})"
        )


def group_error(ours: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None]) -> tuple[float, str]:
    """‖ours − ref‖ / ‖ref‖ over all tensors of ``ref`` together, and the tensor with the largest difference.

    A name ``ref`` maps to None (a parameter the loss does not reach has no gradient) agrees only with None.
    """
    diff2 = ref2 = 0.0
    worst, name = -1.0, ""
    for key, b in ref.items():
        a = ours.get(key)
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape:
            return float("inf"), key
        d = (a.detach().double() - b.detach().double()).norm().item() ** 2
        diff2 += d
        ref2 += b.detach().double().norm().item() ** 2
        if d > worst:
            worst, name = d, key
    return (diff2**0.5) / (ref2**0.5 or 1.0), name


def random_placements(
    captured: CapturedGraph, mesh_shape: tuple[int, ...], seed: int, flowing: bool = False, balance_masks: bool = False
) -> dict[str, dict]:
    """A random valid plan: one strategy per node drawn at random (followers follow their source).

    Not the solver's choice: the oracle must hold for every plan the strategies
    allow, including the odd ones no cost model would pick.  ``flowing``: each
    op's strategy is drawn among those that take its inputs as their producers
    left them, where there are any, so that shardings run on through the graph
    (a placement change where none fits) instead of one between almost every
    two ops: a layout as varied, several times cheaper to trace and run.  ``balance_masks``: the strategies
    include the head-tail twins of kernels given a mask tensor (:mod:`autopar.search.sharding.balanced_shards`).
    """
    rng = random.Random(seed)
    strategies = enumerate_strategies(captured.gm, mesh_shape, balance_masks=balance_masks)
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    params = {p.placeholder: p.name for p in captured.params}
    picked: dict[str, int] = {}
    out = {}
    for name, ns in strategies.items():
        if ns.rule == "follower" and ns.inputs and ns.inputs[0] in picked:
            k = picked[ns.inputs[0]]
        else:
            fits = [
                i
                for i, s in enumerate(ns.strategies)
                if flowing and all(p is None or _made(out, a) == p for p, a in zip(s.inputs, ns.inputs, strict=True))
            ]
            k = rng.choice(fits) if fits else rng.randrange(len(ns.strategies))
        picked[name] = k
        s = ns.strategies[k]
        node = by_name[name]
        out[name] = {
            "op": str(node.target) if node.op == "call_function" else node.op,
            "args": input_names(node),
            "outputs": list(s.outputs),
            "inputs": list(s.inputs),
        }
        if name in params:
            out[name]["param"] = params[name]
    return out


def _made(placements: dict[str, dict], node: str) -> Placements | None:
    """The placement ``node``'s (first) output was given."""
    return placements[node]["outputs"][0] if node in placements and placements[node]["outputs"] else None


def plan_with_layout(
    plan: Plan, model, inputs, cluster: Cluster, layout: str, seed: int = 0, loss_fn=None, balance_masks: bool = False
) -> Plan:
    """``plan`` with its placements replaced by a hand-set layout ("dp", "zero3", "megatron"), "random" or
    "flowing" (random, following producers' placements: :func:`random_placements`).

    Hand-set layouts split the batch over the data-parallel axis, so that they
    exercise gradient synchronisation even on models too small for the cost
    model to want it.
    """
    micro = plan.global_batch_size // max(plan.microbatches, 1)
    captured, _ = captured_with_stats(model, inputs, loss_fn, batch=micro)  # the plan's own capture, if it was last
    shape = (plan.mesh["dp"], plan.mesh.get("tp", 1))
    if layout in ("random", "flowing"):
        chosen = random_placements(captured, shape, seed, flowing=layout == "flowing", balance_masks=balance_masks)
    else:
        mesh = MeshShape(dp=plan.mesh["dp"], tp=plan.mesh.get("tp", 1), pp=plan.mesh.get("pp", 1))
        prec = precision_spec(plan.precision, plan.reduce_dtype)
        chosen = layout_placements(captured, cluster, mesh, prec, plan.optimizer, layout, split_batch=True)
    return dataclasses.replace(
        plan, placements=chosen, solver=dataclasses.replace(plan.solver, status=f"{layout} layout (for testing)")
    )


def shell_plan(
    model, inputs, cluster: Cluster, dp: int, tp: int = 1, *, precision: str = "fp32", loss_fn=None
) -> Plan:
    """A plan of a dp x tp mesh (no pipeline, one micro-batch) without placements, made without a search: for a
    layout (:func:`plan_with_layout`) or a hand-cut pipeline (:func:`plan_with_pipeline`) to fill.

    Those replace every placement, so a search's answer would be thrown away;
    on the tiny test models the MILP of a fixed dp x tp mesh spends up to its
    time limit closing gaps of microseconds. This is the plan of one device of
    the cluster's kind (no search to speak of) moved to the mesh. Its
    estimate is left empty: it would be that of another layout
    (:func:`autopar.search.recost.estimate_plan` costs the one filled in).
    """
    one = dataclasses.replace(cluster, nodes=1, gpus_per_node=1)
    fixed = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "recompute": "none", "microbatches": 1}
    made = make_plan(model, inputs, one, fixed=fixed, precision=precision, loss_fn=loss_fn)
    if made.global_batch_size % dp:
        raise ValueError(f"a batch of {made.global_batch_size} does not split over dp {dp}; choose a divisor of it")
    return dataclasses.replace(
        made,
        cluster=cluster.to_dict(),
        cluster_description=cluster.describe(),
        mesh={"dp": dp, "tp": tp, "pp": 1},
        micro_batch_size=made.global_batch_size // dp,
        placements={},
        estimate=Estimate(),
        solver=dataclasses.replace(made.solver, status="no search (a shell for a layout)"),
    )


def layout_plan(
    model,
    inputs,
    cluster: Cluster,
    dp: int,
    tp: int,
    layout: str,
    *,
    seed: int = 0,
    precision: str = "fp32",
    loss_fn=None,
    balance_masks: bool = False,
) -> Plan:
    """The model on a dp x tp mesh under a hand-set or random ``layout`` (:func:`plan_with_layout`), made without
    a search (:func:`shell_plan`)."""
    shell = shell_plan(model, inputs, cluster, dp, tp, precision=precision, loss_fn=loss_fn)
    return plan_with_layout(shell, model, inputs, cluster, layout, seed, loss_fn, balance_masks)


def factory_layout_plan(
    factory: Callable[[], tuple[Any, Any]], cluster: Cluster, dp: int, tp: int, layout: str, *, seed: int = 0
) -> Plan:
    """:func:`layout_plan` of ``factory()``'s model, built after ``torch.manual_seed(0)`` as the checks build
    it."""
    torch.manual_seed(0)
    model, inputs = factory()
    return layout_plan(model, inputs, cluster, dp, tp, layout, seed=seed)


def loss_split_layout(make_plan: Callable[[int], Plan], tries: int = 50) -> Plan:
    """``make_plan(seed)`` (a random layout) for the first seed whose class loss splits its targets on every
    mesh dim of size > 1.

    For tests of padded batches: the shards of the loss then keep different
    numbers of labels, which an average of per-shard means gets wrong.
    """
    for seed in range(tries):
        plan = make_plan(seed)
        nll = next(v for v in plan.placements.values() if v["op"] == "aten.nll_loss_forward.default")
        sizes = [plan.mesh["dp"], plan.mesh.get("tp", 1)]
        if all(p.is_shard() for p, n in zip(nll["inputs"][1], sizes, strict=True) if n > 1):
            return plan
    raise ValueError(f"none of {tries} random layouts splits the loss's targets")


def plan_with_pipeline(
    plan: Plan,
    model,
    inputs,
    cluster: Cluster,
    pp: int,
    *,
    schedule: str = "1F1B",
    microbatches: int | None = None,
    layout: str = "dp",
    chunks: int = 1,
    seed: int = 0,
) -> Plan:
    """``plan`` made a pipeline by hand: ``pp`` ranks of ``chunks`` stages each, cut at even layer counts.

    The rest of the mesh is what ``plan`` leaves (dp shrinks by ``pp``, tp is
    kept); placements are the hand-set ``layout`` on that dp × tp sub-mesh.
    For tests and comparisons: ``autopar.plan`` chooses cuts itself.
    """

    tp = plan.mesh.get("tp", 1)
    dp = cluster.world_size // (pp * tp)
    m = microbatches or max(pp, plan.microbatches)
    base = dataclasses.replace(
        plan,
        mesh={"dp": dp, "tp": tp, "pp": pp},
        microbatches=m,
        micro_batch_size=plan.global_batch_size // (dp * m),
        schedule=schedule,
        placements={},
    )
    laid = plan_with_layout(base, model, inputs, cluster, layout, seed=seed)
    captured = capture(model, resize_batch(inputs, plan.global_batch_size // m))
    segments = forward_segments(captured)
    layers = [i for i, s in enumerate(segments) if s.name and s.name.rsplit(".", 1)[-1].isdigit()]
    n = pp * chunks
    if len(layers) < n:
        raise ValueError(f"{len(layers)} layers do not make {n} stages")
    starts = [0] + [layers[len(layers) * k // n] for k in range(1, n)]
    stages = [{"first": segments[i].first, "segment": segments[i].name} for i in starts]
    return dataclasses.replace(laid, stages=stages, solver=dataclasses.replace(laid.solver, status=f"{schedule} pipeline (hand cut)"))


def _rank_run(
    factory, cluster, plan_dict, local_batch, steps, lr, seed, loss_fn, rng="fast", precision: str = "fp32"
) -> tuple:
    """One case on this rank: (losses, first gradients, final state, collectives, dtypes); gradients and state
    on rank 0 only.  Without a plan, rank 0 plans in ``precision``."""
    torch.manual_seed(seed)
    model, inputs = factory()
    plan = Plan.from_dict(plan_dict) if plan_dict is not None else None
    options = {"precision": precision} if plan is None else {}
    pm = parallelize(model, cluster, inputs, plan=plan, loss_fn=loss_fn, rng=rng, seed=seed, **options)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=lr)
    feed = slice_batch(inputs, pm.dp_rank, pm.dp_size) if local_batch else inputs

    grads: list[str] = []

    def step() -> torch.Tensor:
        loss = pm.train_step(feed, local_batch=local_batch)
        grads[:] = run_dtypes(pm, opt)["grads"]  # before the optimizer's zero_grad drops them
        return loss

    losses, first = train(model, inputs, step, opt, steps, pm.full_grads)
    final = pm.full_state_dict()
    dtypes = {**run_dtypes(pm, opt), "grads": grads}
    if dist.get_rank() != 0:
        return losses, None, None, pm.collectives(), dtypes
    return losses, first, final, pm.collectives(), dtypes


def run_dtypes(pm, opt: torch.optim.Optimizer) -> dict[str, list[str]]:
    """The dtypes a rank trained in: what its graphs compute in, what the optimizer steps, its state, its gradients."""

    def names(tensors) -> list[str]:
        return sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()})

    graphs = [pm.graph] if hasattr(pm, "graph") else [g.forward for g in pm.programs]
    stepped = [p for group in opt.param_groups for p in group["params"]]
    return {
        "graph": names(n.meta["val"] for g in graphs for n in g.graph.nodes if n.op == "placeholder"),
        "masters": names(stepped),
        "optimizer": names(v for p in stepped for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim()),
        "grads": names(p.grad for p in stepped if p.grad is not None),
    }


CASE_TIMES = "AUTOPAR_CASE_TIMES"
"""An environment variable naming a file: rank 0 of every launch of :func:`check_plans` appends to it one JSON line
per case (world size, model factory, mesh, the plan's solver status, wall and CPU seconds of the case on that
rank), for finding where a test's time goes. Set it before the first launch: ranks are forked from a server that
keeps the environment it started with."""


def _rank_run_all(
    cases, cluster, steps, lr, seed, loss_fn, rng="fast", precision: str = "fp32", record: tuple | None = None
) -> list[tuple]:
    """``cases``: (factory, plan dict) or (factory, plan dict, local_batch).

    ``record``: (a directory, each case's number): this rank keeps each case's result there as it finishes,
    for :func:`_launch_resuming` to keep when another rank is killed later in the job.
    """
    out = []
    for k, (factory, plan, *local) in enumerate(cases):
        wall, cpu = time.perf_counter(), time.process_time()
        out.append(_rank_run(factory, cluster, plan, bool(local and local[0]), steps, lr, seed, loss_fn, rng, precision))
        if record is not None:
            path = os.path.join(record[0], f"{record[1][k]}.{dist.get_rank()}")
            with open(path + ".part", "wb") as f:
                pickle.dump(out[-1], f)
            os.replace(path + ".part", path)  # whole or absent: a rank killed while writing leaves no result
        if os.environ.get(CASE_TIMES) and dist.get_rank() == 0:
            row = {
                "world": dist.get_world_size(),
                "factory": getattr(factory, "__name__", repr(factory)),
                "mesh": plan and plan.get("mesh"),
                "status": plan and plan.get("solver", {}).get("status"),
                "s": round(time.perf_counter() - wall, 2),
                "cpu_s": round(time.process_time() - cpu, 2),
            }
            with open(os.environ[CASE_TIMES], "a") as f:
                f.write(json.dumps(row) + "\n")
    return out


def exact_rng_runs(
    factories: list[Callable], steps: int, lr: float, seed: int, loss_fn=None, precision: str = "fp32"
) -> list[tuple]:
    """The reference for models that draw random numbers: each trained by autopar on one process, ``rng="exact"``.

    An eager run draws its own masks; under ``rng="exact"`` every plan draws
    the masks one device draws under it, so a parallel run under it must
    match this one.  (Models without random ops are checked against eager
    PyTorch itself, which also checks that one-process run.)
    """
    one = Cluster.local(1)
    cases = [(factory, None, False) for factory in factories]
    runs = launch(_rank_run_all, one, cases, one, steps, lr, seed, loss_fn, "exact", precision)[0]
    return [(losses, first, final) for losses, first, final, *_ in runs]


def draws_random(factory: Callable[[], tuple[Any, Any]], seed: int = 0, loss_fn: Callable | None = None) -> bool:
    """Whether a training step of ``factory()``'s model draws random numbers (dropout, ``rand``...)."""
    torch.manual_seed(seed)
    model, inputs = factory()
    return any(is_random(n) for n in capture(model, inputs, loss_fn=loss_fn).gm.graph.nodes)


def _is_maker(plan: Any) -> bool:
    return plan is not None and not isinstance(plan, Plan) and callable(plan)


# a reference run: (model, micro-batches it accumulates, precision, reduce dtype)
RefKey = tuple[Callable, int, str, str]


def _reference_runs(keys: list[RefKey], steps: int, lr: float, seed: int, loss_fn, rng: str | None) -> list:
    """Every reference, in one launched process: see :func:`check_plans`."""
    one = Cluster.local(1)
    out = []
    for factory, microbatches, precision, reduce in keys:
        if rng == "exact" and draws_random(factory, seed, loss_fn):
            run = _rank_run(factory, one, None, False, steps, lr, seed, loss_fn, "exact", precision)
            out.append(run[:3])
        else:
            out.append(single_device_run(factory, steps, lr, seed, loss_fn, microbatches, precision, reduce))
    return out


def _references(keys: list[RefKey], steps: int, lr: float, seed: int, loss_fn, rng: str | None) -> dict:
    """The reference of each key, in this process (those under ``rng="exact"``: one launch per precision)."""
    drawing = [k for k in keys if rng == "exact" and draws_random(k[0], seed, loss_fn)]
    runs = {}
    for p in dict.fromkeys(k[2] for k in drawing):
        group = [k for k in drawing if k[2] == p]
        runs.update(zip(group, exact_rng_runs([k[0] for k in group], steps, lr, seed, loss_fn, p), strict=True))
    for k in keys:
        if k not in runs:
            runs[k] = single_device_run(k[0], steps, lr, seed, loss_fn, *k[1:])
    return runs


def check_plans(
    cases: list[tuple[Callable[[], tuple[Any, Any]], Plan | Callable[[], Plan] | None]],
    cluster: Cluster,
    *,
    steps: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    loss_fn: Callable | None = None,
    local_batch: bool | list[bool] = False,
    crash_retries: int = 1,
    rng: str | None = None,
    accumulate: bool = False,
    precision: str = "fp32",
) -> list[Check]:
    """``check_plan`` for several (factory, plan) cases in one launch of ``cluster``'s processes.

    ``accumulate``: each plan's reference runs its micro-batches one after another on
    one device (gradient accumulation), for models whose forward couples the samples
    of a batch (:func:`single_device_run`).

    Each case is compared with one device in its plan's precision
    (:mod:`autopar.verify.reference`: under mixed precision, one device running
    the same policy); ``precision`` is that of the cases without a plan (rank 0
    plans them) and the one the references are run in while plans are made.

    ``rng="exact"``: the cases run under ``parallelize(..., rng="exact")``, and
    the reference of a model that draws random numbers is the model trained by
    autopar on one process under it (:func:`exact_rng_runs`), so models with
    dropout on are checked exactly; the reference of any other model (and of
    every model without ``rng="exact"``) is eager PyTorch on one device.

    A case's plan may be given as a function that makes it: the references
    then run in a process of their own while the plans are made.

    ``local_batch`` (for all cases, or per case): each rank passes only its
    data-parallel part of the batch, ``train_step(..., local_batch=True)``, as
    a job with a sampler per rank does.  A launch whose rank is killed by a
    signal runs again, up to ``crash_retries`` times, with the cases not every
    rank had finished (:func:`_launch_resuming`).  A rank that raises, and
    every mismatch, fails at once.
    """
    local = local_batch if isinstance(local_batch, list) else [local_batch] * len(cases)
    factories = list(dict.fromkeys(factory for factory, _ in cases))  # one reference run per model

    def key(factory: Callable, plan: Plan | None) -> RefKey:
        if plan is None:
            return factory, 1, precision, "fp32"
        return factory, plan.microbatches if accumulate else 1, plan.precision, plan.reduce_dtype

    makers = any(_is_maker(plan) for _, plan in cases)
    runs: dict[RefKey, tuple] = {}
    if makers and not accumulate:
        # the references run in a process of their own while this one makes the plans: two cores busy
        early = [(factory, 1, precision, "fp32") for factory in factories]
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(launch, _reference_runs, Cluster.local(1), early, steps, lr, seed, loss_fn, rng)
            plans = [plan() if _is_maker(plan) else plan for _, plan in cases]
            runs = dict(zip(early, pending.result()[0], strict=True))
    else:
        plans = [plan() if _is_maker(plan) else plan for _, plan in cases]
    keys = [key(f, plan) for (f, _), plan in zip(cases, plans, strict=True)]
    runs.update(_references([k for k in dict.fromkeys(keys) if k not in runs], steps, lr, seed, loss_fn, rng))
    refs = [runs[k] for k in keys]
    wire = [
        (factory, plan.to_dict() if plan is not None else None, flag)
        for (factory, _), plan, flag in zip(cases, plans, local, strict=True)
    ]
    per_rank = _launch_resuming(wire, cluster, (steps, lr, seed, loss_fn, rng or "fast", precision), crash_retries)
    return [_compare([r[k] for r in per_rank], refs[k]) for k in range(len(cases))]


def _launch_resuming(wire: list, cluster: Cluster, args: tuple, crash_retries: int) -> list[list]:
    """Per rank, each case's result: the cases run in one launch; a launch whose rank is killed by a signal
    (gloo's rare heap corruption, :func:`autopar.runtime.launch.launch`) runs again, up to ``crash_retries``
    times, with only the cases not every rank had finished."""
    world = cluster.world_size
    results: dict[int, list] = {}
    with tempfile.TemporaryDirectory(prefix="autopar-cases-") as done:
        for attempt in range(crash_retries + 1):
            todo = [k for k in range(len(wire)) if k not in results]
            try:
                per_rank = launch(_rank_run_all, cluster, [wire[k] for k in todo], cluster, *args, (done, todo))
            except LaunchError as exc:
                if exc.signal is None or attempt == crash_retries:
                    raise
                for k in todo:
                    paths = [os.path.join(done, f"{k}.{r}") for r in range(world)]
                    if all(os.path.exists(p) for p in paths):
                        results[k] = [_load(p) for p in paths]
                left = len(wire) - len(results)
                log.warning("%s; running the %d cases not finished again (%d of %d)", exc, left, attempt + 1, crash_retries)
                continue
            for i, k in enumerate(todo):
                results[k] = [per_rank[r][i] for r in range(world)]
            break
    return [[results[k][r] for k in range(len(wire))] for r in range(world)]


def _load(path: str) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def check_plan(
    factory: Callable[[], tuple[Any, Any]],
    cluster: Cluster,
    plan: Plan | None = None,
    *,
    steps: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    loss_fn: Callable | None = None,
    rng: str | None = None,
) -> Check:
    """Train ``factory()``'s model under ``plan`` on ``cluster``'s local processes and on one device; compare.

    ``factory`` returns ``(model, inputs)`` with real weights; it must be
    picklable (a module-level function) and seeded calls must agree.
    """
    return check_plans([(factory, plan)], cluster, steps=steps, lr=lr, seed=seed, loss_fn=loss_fn, rng=rng)[0]


def _compare(per_rank: list[tuple], ref: tuple) -> Check:
    ref_losses, ref_grads, ref_params = ref
    losses, grads, params, collectives, dtypes = per_rank[0]
    loss_err = 0.0
    for other, *_ in per_rank:  # every rank's loss against the reference
        for a, b in zip(other, ref_losses, strict=True):
            loss_err = max(loss_err, abs(a - b) / max(abs(b), 1e-12))
    grad_err, grad_worst = group_error(grads, ref_grads)
    param_err, param_worst = group_error(params, ref_params)
    worst = max(
        [(loss_err, "loss"), (grad_err, f"grad of {grad_worst}"), (param_err, param_worst)],
        key=lambda e: e[0],
    )[1]
    max_abs = max(
        (
            (params[k].double() - v.double()).abs().max().item()
            for k, v in ref_params.items()
            if v.numel() and k in params and params[k].shape == v.shape
        ),
        default=float("inf") if set(ref_params) - set(params) else 0.0,
    )
    return Check(losses, ref_losses, loss_err, grad_err, param_err, worst, collectives, dtypes, max_abs)
