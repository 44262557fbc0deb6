"""``autopar.parallelize``: inside each rank of a launched job, the plan becomes a ParallelModule.

Order: check the job against the plan (world size, model) before any
collective runs → agree on the weights (rank 0's, as DDP does) → capture the
model at the plan's micro-batch → recompute as the plan marks it → the local
joint graph of this rank → the module that owns this rank's shards.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.api.data_parallel import data_parallel_placements
from autopar.api.planner import plan as make_plan
from autopar.capture.inputs import batched_flags, input_tensors
from autopar.capture.joint import capture, node_phase
from autopar.codegen.shard import shard_graph
from autopar.codegen.stage_split import split_stages
from autopar.codegen.transfer import transfer_name, transfer_placements
from autopar.core.errors import RuntimeMismatchError
from autopar.core.mesh import SHARDING_AXES, world_size
from autopar.cost_models.graph_cache import example_batch, offer_recapture, resize_batch
from autopar.cost_models.graph_stats import model_fingerprint
from autopar.cost_models.memory import precision_spec
from autopar.cost_models.pipeline import schedule_name
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.ops.rng import check_mode
from autopar.plans.plan import Plan
from autopar.runtime.device import on_device, rank_device
from autopar.runtime.parallel_module import ParallelModule
from autopar.runtime.pipeline_module import PipelineParallelModule
from autopar.runtime.precision import PrecisionPolicy
from autopar.runtime.shared_capture import capture_once
from autopar.runtime.zero import zero_stages
from autopar.search.pipeline.stages import stage_of_nodes, untie_across_stages
from autopar.search.sharding.recompute import apply_recompute

log = logging.getLogger(__name__)


def _process_group(cluster: Cluster, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives, and object broadcasts, run on this rank's GPU
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise RuntimeMismatchError(
            "parallelize runs inside each rank of a job: start it with autopar.launch(fn, cluster) or torchrun"
        )
    dist.init_process_group(cluster.backend or "gloo", timeout=timedelta(seconds=120))


def _agree_on_plan(make_plan: Callable[[], Plan]) -> Plan:
    """Rank 0's plan on every rank: solver time limits make independent solves differ."""
    box = [make_plan().to_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def _check(plan: Plan, model: nn.Module, cluster: Cluster) -> None:
    world = dist.get_world_size()
    planned = world_size(plan.mesh)
    if world != planned:
        raise RuntimeMismatchError(
            f"the plan is for {planned} devices but this job has {world} ranks; launch {planned} ranks or re-plan"
        )
    if cluster.world_size != world:
        raise RuntimeMismatchError(
            f"the cluster has {cluster.world_size} devices but this job has {world} ranks; "
            "pass the cluster the job runs on"
        )
    trainable = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    if model_fingerprint(trainable) != plan.fingerprint:
        raise RuntimeMismatchError(
            f"the plan was made for another model ({plan.model}, {plan.num_params:,} parameters; parameter names "
            f"or shapes differ from this {type(model).__name__}): plan this model"
        )
    if plan.mesh.get("pp", 1) > 1 and not plan.stages:
        raise RuntimeMismatchError("the plan has pp > 1 but no pipeline stages; plan again")


def _broadcast_weights(model: nn.Module, device: torch.device) -> None:
    """Every rank starts from rank 0's weights, as DDP does (sent from the rank's device: NCCL sends GPU memory)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            sent = on_device(t.data, device)
            dist.broadcast(sent, src=0)
            if sent is not t.data:
                t.data.copy_(sent)


def _with_data_parallel_placements(plan: Plan, captured, cluster: Cluster) -> Plan:
    """A data-parallel plan saved before such plans carried their placements, completed as ``autopar.plan`` now does.

    Runs on rank 0 only (:func:`_agree_on_plan`): every rank then runs the same placements.
    """
    log.warning(
        "the plan has no per-op placements (a data-parallel plan saved by an older autopar): solving its "
        "data-parallel layout on rank 0; plan again to skip this"
    )
    mesh = MeshShape(dp=plan.mesh["dp"], tp=plan.mesh.get("tp", 1), pp=plan.mesh.get("pp", 1))
    placements = data_parallel_placements(
        captured, cluster, mesh, plan.zero, precision_spec(plan.precision, plan.reduce_dtype), plan.optimizer
    )
    return dataclasses.replace(plan, placements=placements)


def parallelize(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Any,
    *,
    plan: Plan | None = None,
    loss_fn: Callable[..., Any] | None = None,
    example_targets: Any = None,
    rng: str = "fast",
    seed: int | None = None,
    **plan_options: Any,
) -> ParallelModule:
    """This rank's ParallelModule for ``model`` under ``plan`` (planned on rank 0 when None).

    Call on every rank of the job, with the same model (weights are taken from
    rank 0) and example inputs of the plan's global batch.

    ``rng``: how random ops (dropout, ``bernoulli``, ``rand*``) draw (:mod:`autopar.ops.rng`).
    ``"fast"`` (the default) is Megatron-LM's semantics: each data-parallel rank
    draws its own numbers, tensor-parallel ranks the same numbers for a
    replicated tensor and their own for the shards of a sharded one.
    ``"exact"`` keys every element by its index in the global batch, so any
    plan draws what one device draws under ``"exact"``.  ``seed``: the base of
    every draw's key; None takes rank 0's ``torch.initial_seed()``.
    """

    check_mode(rng)
    device = rank_device(cluster)  # before any process group: NCCL without CUDA fails here, in one line
    _process_group(cluster, device)
    if dist.get_world_size() != cluster.world_size:
        raise RuntimeMismatchError(
            f"the cluster has {cluster.world_size} devices but this job has {dist.get_world_size()} ranks; "
            "pass the cluster the job runs on"
        )
    if plan is None:
        plan = _agree_on_plan(
            lambda: make_plan(
                model,
                example_inputs,
                cluster,
                loss_fn=loss_fn,
                example_targets=example_targets,
                **plan_options,
            )
        )
    _check(plan, model, cluster)  # before any collective: a mismatched job must not hang
    policy = PrecisionPolicy.of(plan.precision, plan.reduce_dtype)
    _broadcast_weights(model, device)
    seed = _agree_on_seed(seed)
    micro = plan.global_batch_size // max(plan.microbatches, 1)
    captured = capture_once(
        lambda: capture(
            model,
            resize_batch(example_inputs, micro),
            loss_fn=loss_fn,
            example_targets=resize_batch(example_targets, micro, example_batch(example_inputs)),
            compute_dtype=policy.param_dtype,
            device=device,
            # told at the examples' batch: at a micro-batch of one sample a shared (1, T) input looks batched
            batched=batched_flags(input_tensors(model, example_inputs, example_targets)),
        ),
        device,
    )
    if not plan.placements:
        # the batch dims read off a second capture, as at plan time (layouts._batch_carrying)
        offer_recapture(captured, model, example_inputs, loss_fn, example_targets)
        plan = _agree_on_plan(lambda old=plan: _with_data_parallel_placements(old, captured, cluster))
    shape = (plan.mesh["dp"], plan.mesh.get("tp", 1))
    # made on the graph at the global batch (a data-parallel plan's: at this micro-batch already),
    # carried onto this micro-batch's graph
    chosen, names = transfer_placements(plan.placements, captured, shape)
    firsts = [transfer_name(s["first"], plan.placements, names) for s in plan.stages]
    missing = [p.placeholder for p in captured.params if p.placeholder not in chosen]
    if missing:
        raise RuntimeMismatchError(
            f"the plan places no {missing[0]!r}: it was made for a different graph of {plan.model}; plan again"
        )
    captured, chosen = apply_recompute(captured, chosen)  # the plan's "recompute" marks; none: unchanged
    if plan.mesh.get("pp", 1) > 1:
        return _pipeline_module(model, captured, chosen, plan, cluster, firsts, rng, seed, policy, device)
    mesh = init_device_mesh(cluster.device_type, shape, mesh_dim_names=SHARDING_AXES)
    stages = zero_stages(captured.params, chosen, plan)
    local = shard_graph(captured, chosen, mesh, stages, **_trace_options(policy, device))
    log.info("rank %d: local graph with %s", dist.get_rank(), dict(local.collectives()))
    return ParallelModule(model, captured, local, mesh, plan, rng, seed, policy, device)


def _trace_options(policy: PrecisionPolicy, device: torch.device) -> dict[str, Any]:
    """What the shard pass adds for the plan's precision (gradients reduced in its dtype, fp16's loss scale)
    and the rank's device."""
    return {"reduce_dtype": policy.reduce_dtype, "loss_scale": policy.loss_scaling, "device": device}


def _agree_on_seed(seed: int | None) -> int:
    """``seed``, or rank 0's ``torch.initial_seed()``: every rank must key its draws alike."""
    box = [seed if seed is not None else torch.initial_seed()]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _pipeline_module(
    model: nn.Module,
    captured,
    chosen: dict,
    plan: Plan,
    cluster: Cluster,
    firsts: list[str],
    rng: str,
    seed: int,
    policy: PrecisionPolicy,
    device: torch.device,
):
    """This rank's stages of a pipeline plan: the whole local graph on its stage's sub-mesh, cut to its stages."""

    pp, dp, tp = plan.mesh["pp"], plan.mesh["dp"], plan.mesh.get("tp", 1)
    mesh = init_device_mesh(cluster.device_type, (pp, dp, tp), mesh_dim_names=("pp", *SHARDING_AXES))
    schedule_name(plan.schedule or "1F1B")
    stage_of = stage_of_nodes(captured, firsts)
    captured, chosen, stage_of, ties = untie_across_stages(captured, chosen, stage_of)
    phase_of = {n.name: node_phase(n) for n in captured.gm.graph.nodes}
    stages = zero_stages(captured.params, chosen, plan)
    options = _trace_options(policy, device)
    local = shard_graph(captured, chosen, mesh["dp", "tp"], stages, keep_sources=True, **options)
    me = mesh.get_coordinate()[0]
    mine = [s for s in range(len(firsts)) if s % pp == me]
    programs = split_stages(local.gm, stage_of, phase_of, len(firsts), mine, len(captured.params), captured.updated)
    index = {p.placeholder: i for i, p in enumerate(captured.params)}
    tied = [[(index[ph], s) for ph, s in tie] for tie in ties]
    log.info("rank %d: pipeline stages %s of %d", dist.get_rank(), mine, len(firsts))
    return PipelineParallelModule(model, captured, local, mesh, plan, programs, tied, rng, seed, policy, device)
