"""ParallelModule: one rank's share of the model, trained by running its local joint graph.

The local joint graph (:mod:`autopar.codegen.shard`) maps this rank's parameter,
state and input shards to the loss and this rank's gradient shards, with every
collective inside.  A training step is one call of that graph per micro-batch,
without autograd: the backward is already in the graph.  The module owns the
parameter shards as ``nn.Parameter``s, so any torch optimizer steps them;
under ZeRO-1/2 (:mod:`autopar.runtime.zero`) the optimizer steps this dp
rank's flat chunks of them instead, and ``make_optimizer`` wires that up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.capture.graph import TensorInfo
from autopar.capture.joint import CapturedGraph, input_tensors
from autopar.codegen.local_graph import LocalGraph
from autopar.core.errors import RuntimeMismatchError
from autopar.core.placements import REPLICATE, SUM, Placements, to_dtensor_all
from autopar.ops import rng as rng_state
from autopar.plans.plan import Plan
from autopar.runtime.checkpoint import Layout, load_layout, save_layout, sharded_layout
from autopar.runtime.device import on_device
from autopar.runtime.grad_accumulation import GradAccumulator
from autopar.runtime.graph_call import call_graph
from autopar.runtime.loss_weights import label_chain, microbatch_weights
from autopar.runtime.memory_tracker import StepMemory, track_memory
from autopar.runtime.precision import LossScaler, PrecisionPolicy, cast, scale_steps
from autopar.runtime.zero import ZeroChunks, shards_and_chunks

log = logging.getLogger(__name__)


def _local_part(
    t: torch.Tensor,
    mesh: DeviceMesh,
    spec: Placements,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """This rank's shard of ``t`` (held whole) for placements ``spec``: a copy on ``device``, in ``dtype``.

    Every weight, buffer and input a rank holds is made here, so it lives on the
    rank's device (:func:`autopar.runtime.device.on_device`).
    """
    coord = mesh.get_coordinate()
    for i, p in enumerate(spec):
        if p.is_shard():
            t = t.chunk(mesh.size(i), p.dim)[coord[i]]
        elif not p.is_replicate():
            raise RuntimeMismatchError(f"a placement of {p} cannot hold a model's weights or inputs")
    t = t.detach()
    out = on_device(t, device if device is not None else t.device, dtype)
    return (out if out is not t else t.clone()).contiguous()


def check_input_count(tensors: list[torch.Tensor], specs: list) -> None:
    """Refuse inputs of another form than the example inputs the plan was made for."""
    if len(tensors) != len(specs):
        raise RuntimeMismatchError(
            f"the plan's model takes {len(specs)} input tensors, these inputs hold {len(tensors)}; "
            "pass inputs of the same form as the example inputs"
        )


def batch_placement(
    t: torch.Tensor,
    spec: Placements,
    info: TensorInfo,
    microbatches: int,
    dp_size: int,
    local_batch: bool,
) -> Placements:
    """The placement ``t`` (a whole batch, or with ``local_batch`` this rank's data-parallel part) is cut by.

    The graph holds one micro-batch of the global batch (example input
    ``info``); a batch of another size is refused, and so is a local batch
    for a plan that does not split every input by batch over dp. An input
    that is not a batch (``info.batched`` False: a (1, T) tensor every sample
    shares) is given whole, on every rank, as the example was.
    """
    shape = info.shape
    if not info.batched:
        if t.shape != shape:
            raise RuntimeMismatchError(
                f"input {info.name} has shape {tuple(t.shape)}, the plan expects {shape} (it is not a batch of "
                "samples: every micro-batch takes it whole); re-plan for these inputs"
            )
        return spec
    if local_batch:
        if not spec[0].is_shard(0) and dp_size > 1:
            raise RuntimeMismatchError(
                "this plan does not split every input by batch over the data-parallel ranks; "
                "pass the global batch (local_batch=False)"
            )
        spec = (REPLICATE, *spec[1:])  # the rank's part of the batch is already its data-parallel shard
    expected = shape[0] * microbatches // (dp_size if local_batch else 1) if shape else None
    if t.dim() and t.shape[0] != expected:
        raise RuntimeMismatchError(
            f"input {info.name} has batch {t.shape[0]}, the plan expects {expected}"
            f"{' per data-parallel rank' if local_batch else ''}; re-plan for this batch size"
        )
    return spec


def micro_part(t: torch.Tensor, info: TensorInfo, microbatches: int, k: int) -> torch.Tensor:
    """Micro-batch ``k``'s part of input ``t``: its k-th chunk of the batch, or all of it where it is not a
    batch (``info.batched``) or has no dim."""
    return t.chunk(microbatches, 0)[k] if info.batched and t.dim() else t


def full_tensor(
    local: torch.Tensor, mesh: DeviceMesh, spec: Placements, shape: tuple[int, ...]
) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's shard under ``spec`` on ``mesh`` (a collective)."""
    if all(p.is_replicate() for p in spec):
        return local.detach().clone()
    stride = torch.empty(shape, device="meta").stride()
    dt = DTensor.from_local(
        local.detach(), mesh, to_dtensor_all(spec), run_check=False, shape=torch.Size(shape), stride=stride
    )
    return dt.full_tensor()


def model_aliases(model: nn.Module) -> dict[str, str]:
    """Every name of a parameter or buffer (tied ones included) to the name capture knows it by."""
    whole = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {
        name: next(n for n, q in whole.items() if q is t)
        for name, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
    }


class RankModule(nn.Module):
    """What a rank's module of either kind offers besides running its step: evaluation and the optimizer.

    Subclasses hold ``shards`` (this rank's parameter shards), ``_zero``
    (:class:`ZeroChunks` or None) and ``train_step``.
    """

    shards: nn.ParameterList
    _zero: ZeroChunks | None
    microbatches: int
    dp_size: int
    precision: PrecisionPolicy
    _scaler: LossScaler | None

    def _init_precision(self, policy: PrecisionPolicy | None, device: torch.device | None) -> None:
        """Train in ``policy``'s dtypes (:mod:`autopar.runtime.precision`; None: the model's own, fp32)
        on ``device`` (:mod:`autopar.runtime.device`; None: the CPU)."""
        self.device = device if device is not None else torch.device("cpu")
        self.precision = policy or PrecisionPolicy.of("fp32")
        self._scaler = LossScaler(device=self.device) if self.precision.loss_scaling else None

    def _scale_args(self) -> list[torch.Tensor]:
        """What the graph takes after its inputs: the loss scale under fp16, nothing otherwise."""
        if self._scaler is None:
            return []
        return [torch.tensor(self._scaler.scale, dtype=torch.float32, device=self.device)]

    def _init_rng(self, mode: str, seed: int, rows: int) -> None:
        """Random ops draw under ``mode`` ("fast" or "exact", :mod:`autopar.ops.rng`) from ``seed``.

        ``rows``: the batch of one micro-batch, the generated graph's batch.
        """
        self.rng = rng_state.check_mode(mode)
        self.seed = int(seed)
        self.steps = 0  # training steps run: part of every draw's key
        self._rows = rows

    def _draws(self, microbatch: int, local_batch: bool) -> contextlib.AbstractContextManager:
        """The random-number state for one call of a generated graph: this step, this micro-batch."""
        return rng_state.using(
            rng_state.RngState(
                mode=self.rng,
                seed=self.seed,
                step=self.steps,
                microbatch=microbatch,
                microbatches=self.microbatches,
                batch=self._rows,
                dp_size=self.dp_size,
                local_batch=local_batch,
            )
        )

    def forward(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """The loss on one batch, without touching gradients (evaluation)."""
        params = [*self.shards, *(self._zero.chunks if self._zero else ())]
        saved = [p.grad for p in params]
        loss = self.train_step(inputs, targets)
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        return loss

    def measure_step_memory(
        self, inputs: Any, optimizer: torch.optim.Optimizer, targets: Any = None, *, local_batch: bool = False
    ) -> StepMemory:
        """One training step (``train_step``, ``optimizer.step()``, ``zero_grad()``) with this rank's peak memory.

        Counts parameters, buffers, ZeRO chunks, gradients, optimizer state and
        everything the step allocates (:mod:`autopar.runtime.memory_tracker`).
        Measure a step after the first: optimizer state is created lazily.
        """
        chunks = self._zero.chunks if self._zero is not None else None
        with track_memory(self, chunks, optimizer) as m:
            self.train_step(inputs, targets, local_batch=local_batch)
            m.refresh()  # the gradients the graph returned are gradients now, not activations
            optimizer.step()
            optimizer.zero_grad()
        return m.result()

    def make_optimizer(
        self, cls: Callable[..., torch.optim.Optimizer], *args: Any, **kwargs: Any
    ) -> torch.optim.Optimizer:
        """``cls`` over this rank's parameter shards (element-wise optimizers step shards exactly).

        Under ZeRO-1/2 the optimizer holds this dp rank's flat chunk of each
        such parameter in its place, so its state is 1/dp; hooks on it refresh
        the chunks from the parameters before each step and all-gather the
        stepped chunks into the parameters after it.  Build the optimizer this
        way: one over ``pm.parameters()`` would see no gradients for those.
        A rank that trains nothing (a pipeline stage of frozen layers) gets an
        optimizer with one empty parameter group (torch refuses an empty list):
        its ``step()`` does nothing, as the job expects it to be called everywhere.
        """
        if self._zero is None:
            params = list(self.shards.parameters())
            opt = cls(params or [{"params": []}], *args, **kwargs)
        else:
            params = [self._zero.chunk(i) if i in self._zero else p for i, p in enumerate(self.shards)]
            opt = cls(params or [{"params": []}], *args, **kwargs)
            self._zero.attach(opt)
        if self._scaler is not None:
            scale_steps(opt, self._scaler)
        return opt

    def save(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Write a checkpoint directory that any plan, or one device, can load (a collective: call on every rank).

        Each rank writes only its shards (and its optimizer state, ZeRO chunks
        included) under the model's own names with ``torch.distributed.checkpoint``;
        see :mod:`autopar.runtime.checkpoint`.  ``optimizer``: the one ``make_optimizer`` built.
        Under mixed precision the weights written are the fp32 masters, and under
        fp16 the loss scaler's state is kept beside them.
        """
        mesh = dict(zip(self.mesh.mesh_dim_names or (), self.mesh.shape, strict=False))
        extra = {"loss_scale": self._scaler.state_dict()} if self._scaler is not None else None
        save_layout(self._checkpoint_layout(), path, optimizer, f"{type(self).__name__} {mesh}", extra)

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read a checkpoint written under any plan (or by ``save_single``) into this rank's shards (a collective).

        With ``optimizer`` (built by ``make_optimizer``), its state and
        hyperparameters are restored too.  A checkpoint of another model is
        refused on every rank before anything is read.
        """
        info = load_layout(self._checkpoint_layout(), path, optimizer)
        if self._scaler is not None and info.get("loss_scale"):
            self._scaler.load_state_dict(info["loss_scale"])  # fp16: the loss scale the saved run had reached
        if self._zero is not None:
            self._zero.after_load()  # the chunks follow the loaded parameters, or the copies the loaded masters

    def _checkpoint_layout(self) -> Layout:
        """What this rank holds, as :mod:`autopar.runtime.checkpoint` hands it to DCP."""
        raise NotImplementedError

    def _gather_stages(self, mine: dict[str, Any]) -> dict[str, Any]:
        """Per-name values of this rank's tensors, completed with those only other stages hold (a collective)."""
        return mine


class ParallelModule(RankModule):
    """The model on this rank: parameter shards, the local joint graph, and the plan it came from."""

    def __init__(
        self,
        model: nn.Module,
        captured: CapturedGraph,
        local: LocalGraph,
        mesh: DeviceMesh,
        plan: Plan,
        rng: str = "fast",
        seed: int = 0,
        precision: PrecisionPolicy | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self.graph = local.gm
        self._init_precision(precision, device)
        self._collectives = local.collectives()
        self._inputs_of = functools.partial(input_tensors, model)
        n_params, n_state = len(captured.params), len(captured.buffers)
        self._param_specs = local.arg_placements[:n_params]
        self._state_specs = local.arg_placements[n_params : n_params + n_state]
        self._input_specs = local.arg_placements[n_params + n_state :]
        self._infos = captured.params + captured.buffers
        self._input_infos = list(captured.inputs)
        whole = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self._aliases = model_aliases(model)
        self.param_names = [p.name for p in captured.params]
        self.state_names = [b.name for b in captured.buffers]
        for i, (b, spec) in enumerate(zip(captured.buffers, self._state_specs, strict=True)):
            self.register_buffer(f"state_{i}", _local_part(whole[b.name], mesh, spec, device=self.device))
        self.dp_size = mesh.size(0)
        self.dp_rank = mesh.get_coordinate()[0]
        self.microbatches = max(int(plan.microbatches), 1)
        self._init_rng(rng, seed, captured.batch_size)
        self._labels = label_chain(captured) if self.microbatches > 1 else None
        self._dp_partial = [spec[0].is_partial(SUM) for spec in local.grad_placements]
        self._updated = list(local.updated)  # buffers the forward updates in place (BatchNorm's statistics)
        self.zero_stages = list(local.zero_stages) or [0] * len(captured.params)
        self.shards, self._zero = shards_and_chunks(
            [
                _local_part(whole[p.name], mesh, spec, device=self.device)
                for p, spec in zip(captured.params, self._param_specs, strict=True)
            ],
            [p.dtype for p in captured.params],
            self.zero_stages,
            mesh.get_group(0),
            self.dp_rank,
            self.dp_size,
        )

    # ------------------------------------------------------------------ running

    def _local_inputs(self, inputs: Any, targets: Any, local_batch: bool) -> tuple[list, list[float]]:
        """(tensor, placement) per input, and each micro-batch's weight in the step (``loss_weights``)."""
        tensors = [on_device(t, self.device) for t in self._inputs_of(inputs, targets)]
        check_input_count(tensors, self._input_specs)
        out = [
            (t, batch_placement(t, spec, info, self.microbatches, self.dp_size, local_batch))
            for t, spec, info in zip(tensors, self._input_specs, self._input_infos, strict=True)
        ]
        group = self.mesh.get_group(0) if local_batch and self.dp_size > 1 else None
        return out, microbatch_weights(self._labels, tensors, self.microbatches, group, self._input_infos)

    def _micro(self, pairs: list, k: int) -> list[torch.Tensor]:
        return [
            _local_part(micro_part(t, info, self.microbatches, k), self.mesh, spec, info.dtype, self.device)
            for (t, spec), info in zip(pairs, self._input_infos, strict=True)
        ]

    def train_step(self, inputs: Any, targets: Any = None, *, local_batch: bool = False) -> torch.Tensor:
        """Forward and backward on one (global) batch; returns the loss, the same on every rank.

        Gradients are added to each shard's ``.grad`` (as ``loss.backward()`` would),
        each micro-batch weighted by its share of the batch's loss (``loss_weights``); under ZeRO-1/2 to the ``.grad``
        of this rank's chunk of the parameter instead (ZeRO-1 reduces once, at
        the end of the step; ZeRO-2 in the graph, per micro-batch).
        """
        pairs, weights = self._local_inputs(inputs, targets, local_batch)
        total = None
        sink = GradAccumulator(self.shards, self.zero_stages, self._zero, self._dp_partial)
        with torch.no_grad():
            # what the graph reads: in its dtypes (the compute dtype's copies of the masters under mixed precision)
            params = [cast(p, info.dtype) for p, info in zip(self.shards, self._infos, strict=False)]
            state = [
                cast(getattr(self, f"state_{i}"), info.dtype)
                for i, info in enumerate(self._infos[len(self.shards) :])
            ]
            scale = self._scale_args()
            for k in range(self.microbatches):
                with self._draws(k, local_batch):
                    loss, *results = call_graph(self.graph, *params, *state, *self._micro(pairs, k), *scale)
                grads = results[: len(self.shards)]
                for b, value in zip(self._updated, results[len(self.shards) :], strict=True):
                    state[b] = value  # the buffer as the forward left it: the next micro-batch reads it
                share = weights[k]
                loss = loss.float()
                total = loss * share if total is None else total + loss * share
                sink.add(dict(enumerate(grads)), share if self.microbatches > 1 else None)
                del grads, results
            sink.finish()
        for b in self._updated:
            getattr(self, f"state_{b}").copy_(state[b])
        self.steps += 1
        return total

    def collectives(self) -> dict[str, int]:
        """How many of each collective one micro-batch of a training step runs on this rank."""
        return dict(self._collectives)

    # ------------------------------------------------------------------ state

    def _full(self, local: torch.Tensor, spec: Placements, shape: tuple[int, ...]) -> torch.Tensor:
        return full_tensor(local, self.mesh, spec, shape)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights and buffers under the model's own names (a collective: call on every rank)."""
        state = [getattr(self, f"state_{i}") for i in range(len(self._state_specs))]
        canonical = {}
        for i, (info, local, spec) in enumerate(
            zip(self._infos, [*self.shards, *state], [*self._param_specs, *self._state_specs], strict=True)
        ):
            if self._zero is not None and self._zero.masters and i in self._zero:
                local = self._zero.full_master(i)  # the fp32 master, not the graph's copy of it
            canonical[info.name] = self._full(local, spec, info.shape)
        return {alias: canonical[name] for alias, name in self._aliases.items() if name in canonical}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """The unsharded gradients by parameter name (a collective: call on every rank).

        Under ZeRO-1/2, where each rank holds only its chunk of the reduced
        gradient after ``train_step``, the chunks are all-gathered for the
        call: the same whole gradient one device would have, built on demand.
        """
        out = {}
        for i, (info, p, spec) in enumerate(
            zip(self._infos[: len(self.shards)], self.shards, self._param_specs, strict=True)
        ):
            g = self._zero.full_grad(i) if self._zero is not None and i in self._zero else p.grad
            out[info.name] = None if g is None else self._full(g, spec, info.shape)
        return out

    def _checkpoint_layout(self) -> Layout:
        n = len(self.shards)
        state = [getattr(self, f"state_{i}") for i in range(len(self._state_specs))]
        tensors = zip(self._infos, [*self.shards, *state], [*self._param_specs, *self._state_specs], strict=True)
        held = [(info, t, spec, i if i < n else None) for i, (info, t, spec) in enumerate(tensors)]
        return sharded_layout(self.mesh, held, self._zero, self._infos)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, by the model's names (no collective: under mixed precision a ZeRO-1/2
        parameter's is the compute dtype's copy, its fp32 master chunked over dp; full_state_dict has it)."""
        state = [getattr(self, f"state_{i}") for i in range(len(self._state_specs))]
        return {info.name: t.detach() for info, t in zip(self._infos, [*self.shards, *state], strict=True)}

    def extra_repr(self) -> str:
        mesh = dict(zip(self.mesh.mesh_dim_names or (), self.mesh.shape, strict=False))
        rank = dist.get_rank() if dist.is_initialized() else 0
        zero = {s: self.zero_stages.count(s) for s in (1, 2) if s in self.zero_stages}
        return f"rank={rank}, mesh={mesh}, params={len(self.shards)}" + (f", zero={zero}" if zero else "")
