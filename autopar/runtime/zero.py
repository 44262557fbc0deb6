"""ZeRO-1 and ZeRO-2 at run time: optimizer state (and gradients) of replicated parameters split over dp.

A parameter the plan replicates over the data-parallel axis is held whole by
every dp rank (its tensor-parallel shard of it, that is: "local" below).
Under ZeRO-1/2 each dp rank owns one *flat chunk* of it: the local tensor
flattened, zero-padded to a multiple of the dp size and cut into equal
pieces, as DeepSpeed's flat partitions.  The optimizer is built over these
chunks, so its state is 1/dp of plain data parallelism's; after each step the
chunks are all-gathered back into the local parameter, which the graph reads
whole.

Why flat chunks rather than dim-0 chunks of the parameter: every rank owns
exactly the same number of elements whatever the shape (a bias of 64 on 3
ranks, a vocabulary not divisible by dp), and the chunk does not depend on
how tensor parallelism already split the parameter — a dim-0 dp chunk of a
column-parallel weight that tp split on dim 0 too would need DTensor's
private strided-shard placement.  Element-wise optimizers (SGD, Adam, AdamW,
...) step a flat chunk exactly as they step the tensor it came from.

Gradients:

* ZeRO-1 — the graph returns each gradient as a dp-partial sum; micro-batches
  accumulate locally in the whole local buffer (ZeRO-1 keeps whole
  gradients) and at the end of ``train_step`` one reduce-scatter per
  parameter leaves the rank its reduced chunk and frees the buffer: one
  gradient synchronisation per step, 2Ψ of traffic with the all-gather.
* ZeRO-2 — the graph itself reduce-scatters each gradient into this rank's
  chunk as soon as the backward produces it (one in flight), per
  micro-batch; the whole gradient never outlives the graph.

Either way, between ``train_step`` and ``optimizer.step()`` a rank holds only
the ``.grad`` of its chunks.

Under mixed precision (:mod:`autopar.runtime.precision`) the chunks are the fp32
*master* weights and the whole local parameter is only the graph's copy in the
compute dtype, as in Megatron-LM's distributed optimizer: the chunks are cut
from the fp32 weights once, stepped, cast and all-gathered into the copies
after each step, and never refreshed from the copies (which would round them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from autopar.codegen.zero_grads import flat_chunk_numel
from autopar.plans.plan import Plan

log = logging.getLogger(__name__)


def zero_stages(params: Sequence, chosen: dict[str, dict], plan: Plan) -> dict[str, int]:
    """ZeRO stage (1 or 2) of each dp-replicated parameter, by placeholder; the others are left out.

    The stage of a parameter is its placement entry's ``"zero"`` key, else the
    plan's stage when that is 1 or 2.  Parameters the placement shards over dp
    are ZeRO-3 by their placement and are not listed; nor is anything when the
    dp axis has one rank (nothing to split).
    """
    if plan.mesh.get("dp", 1) <= 1:
        return {}
    default = plan.zero if plan.zero in (1, 2) else 0
    out = {}
    for p in params:
        entry = chosen.get(p.placeholder, {})
        stage = int(entry.get("zero", default) or 0)
        if stage <= 0 or not entry["outputs"][0][0].is_replicate():
            continue
        if stage > 2:
            log.warning(
                "%s is replicated over dp but marked ZeRO-%d: sharding its optimizer state and gradients "
                "(ZeRO-2); ZeRO-3 comes from a parameter placement sharded over dp",
                p.name,
                stage,
            )
            stage = 2
        out[p.placeholder] = stage
    return out


def shards_and_chunks(
    local: list[torch.Tensor],
    dtypes: list[torch.dtype],
    stages: list[int],
    group: dist.ProcessGroup,
    rank: int,
    size: int,
) -> tuple[nn.ParameterList, ZeroChunks | None]:
    """A rank's parameters from its ``local`` tensors (the model's dtype), and its ZeRO-1/2 chunks.

    ``dtypes``: what the graph reads each parameter as.  A parameter the optimizer
    steps whole (no ZeRO, ZeRO-3) is kept as given (the fp32 master under mixed
    precision); a ZeRO-1/2 parameter is kept in the graph's dtype, its master
    being the chunks (see the module docstring).
    """
    shards = nn.ParameterList(
        nn.Parameter(t.to(d) if s in (1, 2) and t.dtype != d else t)
        for t, d, s in zip(local, dtypes, stages, strict=True)
    )
    if not any(stages):
        return shards, None
    mixed = any(p.dtype != t.dtype for p, t in zip(shards, local, strict=True))
    return shards, ZeroChunks(shards, stages, group, rank, size, masters=local if mixed else None)


class ZeroChunks:
    """This dp rank's flat chunks of the ZeRO-1/2 parameters, and the moves between chunks and parameters.

    ``chunks`` is an ``nn.ParameterList`` (not registered in the
    ParallelModule, so ``pm.parameters()`` stays the parameters the graph
    reads); the optimizer steps it.
    """

    def __init__(
        self,
        shards: nn.ParameterList,
        stages: list[int],
        group: dist.ProcessGroup,
        rank: int,
        size: int,
        masters: list[torch.Tensor] | None = None,
    ):
        """``masters``: the fp32 local tensors to cut the chunks from, when ``shards`` are low-precision copies."""
        self.group, self.rank, self.size = group, rank, size
        self.shards = shards
        self.masters = masters is not None  # the chunks are the truth, the shards their copies
        self.stage = {i: s for i, s in enumerate(stages) if s}
        self.chunk_numel = {i: flat_chunk_numel(shards[i].numel(), size) for i in self.stage}
        self.slot = {i: k for k, i in enumerate(self.stage)}  # param index -> index in chunks
        source = masters if masters is not None else [p.detach() for p in shards]
        self.chunks = nn.ParameterList(nn.Parameter(self._chunk_of(source[i], i)) for i in self.stage)

    def __contains__(self, i: int) -> bool:
        return i in self.stage

    def chunk(self, i: int) -> nn.Parameter:
        return self.chunks[self.slot[i]]

    def _padded(self, t: torch.Tensor, i: int) -> torch.Tensor:
        flat = t.reshape(-1)
        pad = self.chunk_numel[i] * self.size - flat.numel()
        return torch.nn.functional.pad(flat, (0, pad)) if pad else flat

    def _chunk_of(self, t: torch.Tensor, i: int) -> torch.Tensor:
        n = self.chunk_numel[i]
        flat = t.reshape(-1)
        part = flat[self.rank * n : (self.rank + 1) * n]
        if part.numel() < n:
            part = torch.nn.functional.pad(part, (0, n - part.numel()))
        return part.clone()

    # ------------------------------------------------------------------ gradients

    def add_grad(self, i: int, chunk_grad: torch.Tensor) -> None:
        p = self.chunk(i)
        if p.grad is not None:
            p.grad.add_(chunk_grad)
        else:
            p.grad = chunk_grad if chunk_grad.dtype == p.dtype else chunk_grad.to(p.dtype)

    def reduce_partials(self, partial: dict[int, tuple[torch.Tensor, bool]]) -> None:
        """ZeRO-1's once-per-step reduction: each whole (local) gradient to this rank's chunk, summed over dp.

        ``partial[i]`` is ``(gradient, summed)``: a dp-partial sum to be
        reduce-scattered, or a gradient the plan already reduced, of which the
        chunk is cut locally.  One reduction at a time: gloo's CPU collectives
        corrupt the heap with several in flight on one group (see
        :func:`autopar.codegen.collective_order.schedule_collectives`), and nothing is left
        to overlap them with at the end of the step.
        """
        for i, (g, summed) in partial.items():
            if not summed:
                self.add_grad(i, self._chunk_of(g, i))
                continue
            out = torch.empty(self.chunk_numel[i], dtype=g.dtype, device=g.device)
            dist.reduce_scatter_single(out, self._padded(g, i).contiguous(), group=self.group)
            self.add_grad(i, out)

    def full_grad(self, i: int) -> torch.Tensor | None:
        """The reduced local gradient of parameter ``i``, gathered from every rank's chunk (a collective)."""
        g = self.chunk(i).grad  # None on every rank alike: the graph returns no gradient for this parameter
        return None if g is None else self._gather(g, i)

    # ------------------------------------------------------------------ parameters

    def _gather(self, chunk: torch.Tensor, i: int) -> torch.Tensor:
        out = torch.empty(self.chunk_numel[i] * self.size, dtype=chunk.dtype, device=chunk.device)
        dist.all_gather_single(out, chunk.detach().contiguous(), group=self.group)
        return out[: self.shards[i].numel()].view(self.shards[i].shape)

    def full_master(self, i: int) -> torch.Tensor:
        """The whole local fp32 master of parameter ``i``, gathered from every rank's chunk (a collective)."""
        return self._gather(self.chunk(i).detach(), i)

    def load_from_params(self) -> None:
        """Each chunk from its parameter: the parameters are the truth (a load or an edit between steps).

        Not under mixed precision, where the chunks are the masters and the parameters their rounded copies.
        """
        if self.masters:
            return
        with torch.no_grad():
            for i in self.stage:
                self.chunk(i).copy_(self._chunk_of(self.shards[i].detach(), i))

    def gather_params(self) -> None:
        """After the optimizer stepped the chunks: every dp rank's chunks back into the whole local parameters.

        One all-gather at a time, as in :meth:`reduce_partials`; in the parameters' dtype (the
        compute dtype under mixed precision, as Megatron-LM gathers bf16 parameters).
        """
        with torch.no_grad():
            for i in self.stage:
                p, n = self.shards[i], self.chunk_numel[i] * self.size
                direct = p.is_contiguous() and p.numel() == n
                out = p.detach().view(-1) if direct else torch.empty(n, dtype=p.dtype, device=p.device)
                chunk = self.chunk(i).detach().to(p.dtype).contiguous()
                dist.all_gather_single(out, chunk, group=self.group)
                if not direct:
                    p.copy_(out[: p.numel()].view(p.shape))

    def after_load(self) -> None:
        """After a checkpoint was read: the copies follow the loaded masters, or the chunks the loaded parameters."""
        if self.masters:
            self.gather_params()
        else:
            self.load_from_params()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hooks on ``optimizer``: chunks refreshed from the parameters before a step, gathered after it."""
        optimizer.register_step_pre_hook(lambda *_: self.load_from_params())
        optimizer.register_step_post_hook(lambda *_: self.gather_params())
