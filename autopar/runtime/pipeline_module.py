"""PipelineParallelModule: one rank's pipeline stage(s) of the model, trained by a pipeline schedule.

The rank sits at (pipeline stage, data-parallel, tensor-parallel) coordinate
(p, d, t) of the plan's pp × dp × tp mesh, pipeline outermost as in
Megatron-LM.  It holds only the parameters its stages read: the shards of
them its (d, t) coordinate owns on the stage's dp × tp sub-mesh.  A training
step splits the batch into the plan's micro-batches and runs the schedule
(:mod:`autopar.runtime.pipeline`); gradients land in ``.grad`` as in
:class:`~autopar.runtime.parallel_module.ParallelModule` (each micro-batch
weighted by its share of the loss, :mod:`autopar.runtime.loss_weights`;
ZeRO-1/2 chunks alike), the gradients of a parameter untied
across stages (:func:`autopar.search.pipeline.stages.untie_across_stages`) are summed
over the stages holding it, and the loss is sent from the last stage to every
rank, so ``train_step`` returns the same loss everywhere.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture.joint import CapturedGraph, input_tensors
from autopar.codegen.local_graph import LocalGraph
from autopar.codegen.stage_split import StageGraphs
from autopar.core.placements import SUM, Placements
from autopar.cost_models.schedule import schedule_actions
from autopar.plans.plan import Plan
from autopar.runtime.checkpoint import Layout, sharded_layout
from autopar.runtime.device import on_device
from autopar.runtime.grad_accumulation import GradAccumulator
from autopar.runtime.loss_weights import label_chain, microbatch_weights
from autopar.runtime.parallel_module import (
    RankModule,
    _local_part,
    batch_placement,
    check_input_count,
    full_tensor,
    micro_part,
    model_aliases,
)
from autopar.runtime.pipeline import StageRunner, run_schedule
from autopar.runtime.precision import PrecisionPolicy, cast
from autopar.runtime.zero import shards_and_chunks

log = logging.getLogger(__name__)


def _unread(captured: CapturedGraph) -> set[int]:
    """Indices (parameters, then buffers) of the model's tensors the graph never reads.

    No stage holds them for its work (a rotary table's unused ``original_inv_freq``),
    yet they belong to the model's state: the first stage keeps them, so that
    ``full_state_dict`` and checkpoints have every tensor a plan without a pipeline has.
    """
    users = {n.name: len(n.users) for n in captured.gm.graph.nodes if n.op == "placeholder"}
    infos = captured.params + captured.buffers
    return {i for i, info in enumerate(infos) if not users.get(info.placeholder)}


class PipelineParallelModule(RankModule):
    """The stages of one pipeline rank: parameter shards, stage graphs, the schedule that runs them."""

    def __init__(
        self,
        model: nn.Module,
        captured: CapturedGraph,
        local: LocalGraph,
        mesh: DeviceMesh,
        plan: Plan,
        programs: list[StageGraphs],
        ties: list[list[tuple[int, int]]],
        rng: str = "fast",
        seed: int = 0,
        precision: PrecisionPolicy | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.mesh = mesh  # pp x dp x tp
        self._init_precision(precision, device)
        self.stage_mesh = mesh["dp", "tp"]
        self.programs = programs
        self.pp_size = mesh.size(0)
        self.pp_rank, self.dp_rank, self.tp_rank = mesh.get_coordinate()
        self.dp_size = mesh.size(1)
        self.microbatches = max(int(plan.microbatches), 1)
        self._init_rng(rng, seed, captured.batch_size)
        self._labels = label_chain(captured) if self.microbatches > 1 else None
        self.stages = sum(1 for _ in plan.stages) or self.pp_size
        self.schedule = plan.schedule or "1F1B"
        n_params, n_state = len(captured.params), len(captured.buffers)
        self._n_params, self._n_state = n_params, n_state
        self._specs = local.arg_placements
        self._infos = captured.params + captured.buffers
        self._input_specs = local.arg_placements[n_params + n_state :]
        self._input_infos = list(captured.inputs)
        self._inputs_of = lambda inputs, targets: input_tensors(model, inputs, targets)
        held = sorted(
            {a for g in programs for a in (*g.forward_args, *g.backward_args) if a < n_params + n_state}
            | {i for g in programs for i in g.grads}
            | (_unread(captured) if self.pp_rank == 0 else set())
        )
        self._params = [i for i in held if i < n_params]  # global parameter indices this rank holds
        self._state = [i for i in held if i >= n_params]
        self._slot = {i: k for k, i in enumerate(self._params)}
        whole = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self._aliases = model_aliases(model)
        sub = self.stage_mesh
        for k, i in enumerate(self._state):
            self.register_buffer(
                f"state_{k}", _local_part(whole[self._infos[i].name], sub, self._specs[i], device=self.device)
            )
        self._state_slot = {i: k for k, i in enumerate(self._state)}
        stages = list(local.zero_stages) or [0] * n_params
        self.zero_stages = [stages[i] for i in self._params]
        self._dp_partial = [local.grad_placements[i][0].is_partial(SUM) for i in self._params]
        self.shards, self._zero = shards_and_chunks(
            [
                _local_part(whole[self._infos[i].name], sub, self._specs[i], device=self.device)
                for i in self._params
            ],
            [self._infos[i].dtype for i in self._params],
            self.zero_stages,
            sub.get_group(0),
            self.dp_rank,
            self.dp_size,
        )
        self._actions = schedule_actions(self.schedule, self.pp_size, self.stages, self.microbatches)[
            self.pp_rank
        ]
        self._tie_groups = self._make_tie_groups(ties)
        self._collectives = local.collectives()

    # ------------------------------------------------------------------ set-up

    def _rank_of_stage(self, stage: int) -> int:
        return int(self.mesh.mesh[stage % self.pp_size, self.dp_rank, self.tp_rank])

    def _make_tie_groups(self, ties: list[list[tuple[int, int]]]) -> list[tuple[list[int], Any]]:
        """Per tie: this rank's copies (parameter slots) and the group of the ranks holding one.

        ``new_group`` is collective over the world: every rank creates every group, in the same order.
        """
        out = []
        mesh = self.mesh.mesh
        for tie in ties:
            stages = sorted({s % self.pp_size for _, s in tie})
            mine_group = None
            for d in range(mesh.shape[1]):
                for t in range(mesh.shape[2]):
                    ranks = sorted({int(mesh[s, d, t]) for s in stages})
                    group = dist.new_group(ranks) if len(ranks) > 1 else None
                    if d == self.dp_rank and t == self.tp_rank:
                        mine_group = group
            slots = [self._slot[i] for i, _ in tie if i in self._slot]
            if slots:
                out.append((slots, mine_group))
        return out

    # ------------------------------------------------------------------ running

    def _micro_inputs(
        self, inputs: Any, targets: Any, local_batch: bool
    ) -> tuple[list[list[torch.Tensor]], list[float]]:
        """This rank's inputs per micro-batch, and each micro-batch's weight in the step (``loss_weights``)."""
        tensors = [on_device(t, self.device) for t in self._inputs_of(inputs, targets)]
        check_input_count(tensors, self._input_specs)
        per_mb: list[list[torch.Tensor]] = [[] for _ in range(self.microbatches)]
        for t, spec, info in zip(tensors, self._input_specs, self._input_infos, strict=True):
            spec = batch_placement(t, spec, info, self.microbatches, self.dp_size, local_batch)
            for k in range(self.microbatches):
                part = micro_part(t, info, self.microbatches, k)
                per_mb[k].append(_local_part(part, self.stage_mesh, spec, info.dtype, self.device))
        scale = self._scale_args()
        per_mb = [[*mb, *scale] for mb in per_mb]  # the loss scale (fp16) is read like an input
        group = self.stage_mesh.get_group(0) if local_batch and self.dp_size > 1 else None
        return per_mb, microbatch_weights(self._labels, tensors, self.microbatches, group, self._input_infos)

    def train_step(self, inputs: Any, targets: Any = None, *, local_batch: bool = False) -> torch.Tensor:
        """Forward and backward of one (global) batch through the pipeline; the loss, the same on every rank."""
        micro, weights = self._micro_inputs(inputs, targets, local_batch)
        first_input = self._n_params + self._n_state
        sink = GradAccumulator(self.shards, self.zero_stages, self._zero, self._dp_partial, copy=True)
        m = self.microbatches
        # what the graphs read: in their dtypes (mixed precision: copies of the masters), detached: the stage graphs
        # are pure functions, and a tensor that requires grad makes module hooks (MemTracker's) hook its autograd
        with torch.no_grad():
            params = [cast(p, self._infos[i].dtype).detach() for p, i in zip(self.shards, self._params, strict=True)]

        def args(slots: list[int], mb: int) -> list[torch.Tensor]:
            out = []
            for a in slots:
                if a < self._n_params:
                    out.append(params[self._slot[a]])
                elif a < first_input:
                    out.append(cast(getattr(self, f"state_{self._state_slot[a]}"), self._infos[a].dtype))
                else:
                    out.append(micro[mb][a - first_input])
            return out

        def on_grads(mb: int, indices: list[int], grads: list[torch.Tensor | None]) -> None:
            by_slot = {self._slot[i]: g for i, g in zip(indices, grads, strict=True)}
            sink.add(by_slot, weights[mb] if m > 1 else None)

        def on_updates(slots: list[int], values: list[torch.Tensor]) -> None:
            # a new tensor, not written in place: a backward still to run may hold the old one (stage_split)
            for a, value in zip(slots, values, strict=True):
                setattr(self, f"state_{self._state_slot[a]}", value)

        runners = {g.stage: StageRunner(g, args, on_grads, on_updates) for g in self.programs}
        with torch.no_grad():
            draws = functools.partial(self._draws, local_batch=local_batch)
            run_schedule(self._actions, runners, self.stages, self._rank_of_stage, draws, self.device)
            sink.finish()
            self._sum_tied_grads()
            losses = [x.float() * weights[mb] for r in runners.values() for mb, x in sorted(r.losses.items())]
            loss = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
            last = self._rank_of_stage(self.stages - 1)
            dist.broadcast(loss, src=last, group=self.mesh.get_group(0))
        self.steps += 1
        return loss

    def _grad_holder(self, k: int) -> nn.Parameter:
        return self._zero.chunk(k) if self._zero is not None and k in self._zero else self.shards[k]

    def _sum_tied_grads(self) -> None:
        """A parameter untied across stages: every copy's gradient becomes the sum over all copies."""
        for slots, group in self._tie_groups:
            holders = [self._grad_holder(k) for k in slots]
            grads = [h.grad for h in holders if h.grad is not None]
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(holders[0])
            if group is not None:
                dist.all_reduce(total, group=group)
            for h in holders:
                h.grad = total.clone()

    def collectives(self) -> dict[str, int]:
        """Collectives of one micro-batch of the whole local graph (all stages) on this rank's sub-mesh."""
        return dict(self._collectives)

    # ------------------------------------------------------------------ state

    def _full(self, local: torch.Tensor, spec: Placements, shape: tuple[int, ...]) -> torch.Tensor:
        return full_tensor(local, self.stage_mesh, spec, shape)

    def _gather_stages(self, mine: dict[str, Any]) -> dict[str, Any]:
        every: list[dict | None] = [None] * self.pp_size
        dist.all_gather_object(every, mine, group=self.mesh.get_group(0))
        out: dict[str, torch.Tensor | None] = {}
        for part in every:
            for k, v in (part or {}).items():
                if out.get(k) is None:
                    out[k] = v
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights and buffers under the model's own names (a collective: call on every rank)."""
        mine = {}
        for k, i in enumerate(self._params):
            local = self.shards[k]
            if self._zero is not None and self._zero.masters and k in self._zero:
                local = self._zero.full_master(k)  # the fp32 master, not the graph's copy of it
            mine[self._infos[i].name] = self._full(local, self._specs[i], self._infos[i].shape)
        for k, i in enumerate(self._state):
            local = getattr(self, f"state_{k}")
            mine[self._infos[i].name] = self._full(local, self._specs[i], self._infos[i].shape)
        canonical = self._gather_stages(mine)
        return {alias: canonical[name] for alias, name in self._aliases.items() if name in canonical}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """The unsharded gradients by parameter name (a collective: call on every rank)."""
        mine = {}
        for k, i in enumerate(self._params):
            p = self.shards[k]
            g = self._zero.full_grad(k) if self._zero is not None and k in self._zero else p.grad
            mine[self._infos[i].name] = (
                None if g is None else self._full(g, self._specs[i], self._infos[i].shape)
            )
        return self._gather_stages(mine)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, by the model's names (no collective: under mixed precision a ZeRO-1/2
        parameter's is the compute dtype's copy, its fp32 master chunked over dp; full_state_dict has it)."""
        out = {self._infos[i].name: self.shards[k].detach() for k, i in enumerate(self._params)}
        out.update({self._infos[i].name: getattr(self, f"state_{k}") for k, i in enumerate(self._state)})
        return out

    def _checkpoint_layout(self) -> Layout:
        held = [(self._infos[i], self.shards[k], self._specs[i], k) for k, i in enumerate(self._params)]
        held += [
            (self._infos[i], getattr(self, f"state_{k}"), self._specs[i], None)
            for k, i in enumerate(self._state)
        ]
        return sharded_layout(self.stage_mesh, held, self._zero, self._infos)

    def extra_repr(self) -> str:
        return (
            f"stages={[g.stage for g in self.programs]} of {self.stages}, schedule={self.schedule}, "
            f"microbatches={self.microbatches}, params={len(self.shards)}"
        )
