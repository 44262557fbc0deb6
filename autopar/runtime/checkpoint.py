"""Checkpoints: weights and optimizer state written under one plan, read under any other (or on one device).

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory keyed by the
model's own names, so it does not depend on the plan that wrote it:

* ``model.<name>`` — every parameter and buffer, tied weights once (under the
  first name, as ``capture`` and ``named_parameters()`` see them);
* ``optim.<name>.<key>`` — the optimizer's state of that parameter (AdamW's
  ``exp_avg``, ``exp_avg_sq``, ``step``), laid out like the parameter where it
  has its shape;
* ``autopar`` — the format version and, with an optimizer, its class and param
  groups (hyperparameters, parameters by name).

Each rank hands DCP only what it holds: a parameter shard is a DTensor with
the plan's placements, so DCP writes each piece once and, under another plan,
reads each rank's new piece from whichever files hold it (DCP's resharding).
One device uses the same format through DCP's no-process-group path.

ZeRO-1/2 optimizer state is a flat chunk of a parameter's local tensor,
handed to DCP as the boxes it covers (:mod:`autopar.runtime.checkpoint_chunks`).

Under a pipeline plan each rank holds only its stages' parameters, on its
stage's dp × tp sub-mesh: the ranks of all stages together write every
weight once (a weight untied across stages, :func:`autopar.search.pipeline.stages.untie_across_stages`,
is laid out alike on every stage that holds it, so DCP keeps one copy), and a
load reads into each rank only what its stages hold.

A load checks the checkpoint against the model (names, shapes, optimizer
class) on every rank first, and raises :class:`~autopar.core.errors.CheckpointError`
on all ranks alike before any tensor is read, so a bad path cannot hang a job.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.capture.joint import TensorInfo
from autopar.core.errors import CheckpointError
from autopar.core.placements import Placements, to_dtensor_all
from autopar.runtime.checkpoint_chunks import FlatChunk, LoadPlanner, SavePlanner
from autopar.runtime.zero import ZeroChunks

log = logging.getLogger(__name__)

FORMAT = 1
INFO = "autopar"
MODEL = "model."
OPTIM = "optim."


# ---------------------------------------------------------------- what one rank holds


@dataclass
class _Weight:
    """One parameter or buffer as this rank holds it."""

    name: str  # the model's (first) name
    local: torch.Tensor  # this rank's tensor: its shard under a plan, the whole tensor on one device
    shape: tuple[int, ...]  # the whole tensor's shape
    placements: tuple[Placement, ...] | None = None  # over the layout's mesh; None: a plain tensor
    offset: tuple[int, ...] = ()  # where ``local`` sits in the whole tensor
    chunk: tuple[int, int, int] | None = None  # ZeRO-1/2: (start, stop, numel) of this rank's flat chunk
    master: torch.Tensor | None = None  # mixed precision under ZeRO-1/2: the fp32 chunk ``local`` is a copy of


@dataclass
class Layout:
    """The tensors of one rank (its shards under a plan, or a whole model) and how to hand them to DCP."""

    weights: list[_Weight]  # one per name
    owners: dict[int, tuple[_Weight, bool]]  # id(optimizer param) -> (weight, it is the weight's ZeRO chunk)
    mesh: DeviceMesh | None
    model: dict[str, tuple[int, ...]]  # every weight of the model (not only this rank's): name -> shape
    # further local copies of a weight (and of its master chunk)
    copies: list[tuple[_Weight, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def wrap(self, w: _Weight, local: torch.Tensor) -> torch.Tensor:
        """``local`` (laid out like ``w.local``) as DCP should see it: a DTensor under a plan."""
        if w.placements is None:
            return local
        stride = torch.empty(w.shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, w.placements, run_check=False, shape=torch.Size(w.shape), stride=stride
        )

    def flat(self, w: _Weight, chunk: torch.Tensor) -> FlatChunk:
        start, stop, _ = w.chunk
        return FlatChunk(chunk, tuple(w.local.shape), w.offset, w.shape, start, stop)

    def weight(self, w: _Weight) -> Any:
        """The weight as DCP should see it: its fp32 master chunk where it has one, else its local tensor."""
        return self.flat(w, w.master.detach()) if w.master is not None else self.wrap(w, w.local.detach())

    def optimizer_params(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, _Weight, bool]]:
        """Each parameter the optimizer steps, with the weight it belongs to."""
        out = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self.owners:
                    raise CheckpointError(
                        f"the optimizer steps a tensor of shape {tuple(p.shape)} that is not a parameter of this "
                        "model: build it over this model (pm.make_optimizer(...) under a plan)"
                    )
                out.append((p, *self.owners[id(p)]))
        return out


def sharded_layout(
    mesh: DeviceMesh,
    held: list[tuple[TensorInfo, torch.Tensor, Placements, int | None]],
    zero: ZeroChunks | None,
    model: list[TensorInfo],
) -> Layout:
    """What one rank holds under a plan, from ``(info, local tensor, spec, parameter slot)`` per tensor.

    The slot indexes the rank's parameters (its ZeRO chunks); a buffer has
    none.  A name held twice (a weight untied across two stages of this rank)
    is one weight: DCP sees the first copy, the others follow it on load.
    ``model`` is every weight of the model, for the check that a checkpoint
    is of this model.  Under mixed precision a ZeRO-1/2 parameter's weight is
    written from its fp32 master chunk, not from the compute dtype's copy.
    """
    weights, owners, by_name, copies = [], {}, {}, []
    for info, local, spec, slot in held:
        master = zero.chunk(slot) if zero is not None and zero.masters and slot in zero else None
        w = by_name.get(info.name)
        if w is None:
            places = to_dtensor_all(spec)
            _, offset = compute_local_shape_and_global_offset(tuple(info.shape), mesh, places)
            w = by_name[info.name] = _Weight(info.name, local, tuple(info.shape), places, tuple(offset))
            w.master = master
            weights.append(w)
        else:
            copies.append((w, local, master))
        if slot is None:
            continue
        if zero is not None and slot in zero:
            n = zero.chunk_numel[slot]
            start = min(zero.rank * n, local.numel())
            w.chunk = (start, min(start + n, local.numel()), n)
            owners[id(zero.chunk(slot))] = (w, True)
        owners[id(local)] = (w, False)
    return Layout(weights, owners, mesh, {i.name: tuple(i.shape) for i in model}, copies)


def _single_layout(model: nn.Module) -> Layout:
    weights, owners = [], {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        w = _Weight(name, t, tuple(t.shape))
        weights.append(w)
        owners[id(t)] = (w, False)
    return Layout(weights, owners, None, {w.name: w.shape for w in weights})


# ---------------------------------------------------------------- save


def _like_param(p: torch.Tensor, key: str, v: Any) -> bool:
    """Whether an optimizer state value is laid out like its parameter (resharded with it) or is a scalar.

    A 0-dim parameter's 0-dim state is ambiguous by shape; ``step`` is the
    scalar of torch's optimizers, the rest (``exp_avg``, ...) follow the parameter.
    """
    return isinstance(v, torch.Tensor) and v.shape == p.shape and (v.dim() > 0 or key != "step")


def _saved_state(layout: Layout, p: torch.Tensor, w: _Weight, chunked: bool, key: str, v: Any) -> Any:
    """One optimizer state value as DCP should see it (laid out like its parameter where it has its shape)."""
    if not isinstance(v, torch.Tensor):
        return v
    if _like_param(p, key, v):
        return layout.flat(w, v.detach()) if chunked else layout.wrap(w, v.detach())
    if v.dim() and layout.distributed and (chunked or any(not q.is_replicate() for q in w.placements)):
        raise CheckpointError(
            f"the optimizer state {key!r} of {w.name} has shape {tuple(v.shape)}, neither its parameter's "
            f"{tuple(p.shape)} nor a scalar, so it cannot be resharded: checkpoint element-wise optimizers "
            "(SGD, Adam, AdamW, ...) under a plan"
        )
    return v.detach()


def _state_dict(
    layout: Layout, optimizer: torch.optim.Optimizer | None, writer: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    sd: dict[str, Any] = {f"{MODEL}{w.name}": layout.weight(w) for w in layout.weights}
    info: dict[str, Any] = {"format": FORMAT, "writer": writer, "optimizer": None, **(extra or {})}
    if optimizer is not None:
        params = layout.optimizer_params(optimizer)
        name_of = {id(p): w.name for p, w, _ in params}
        like = []  # the keys laid out like their parameter (a 0-dim parameter's can't tell by shape)
        for p, w, chunked in params:
            for key, v in optimizer.state.get(p, {}).items():
                k = f"{OPTIM}{w.name}.{key}"
                sd[k] = _saved_state(layout, p, w, chunked, key, v)
                if _like_param(p, key, v):
                    like.append(k)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        ours = {"class": type(optimizer).__name__, "param_groups": groups, "like_param": like}
        info["optimizer"] = _merge_over_ranks(ours) if layout.distributed else ours
    sd[INFO] = info
    return sd


def _merge_over_ranks(ours: dict[str, Any]) -> dict[str, Any]:
    """The optimizer entry of the whole job from every rank's (a collective).

    DCP writes one copy of a non-tensor entry; under a pipeline each rank's
    optimizer steps only its stages' parameters, so the entry lists the
    parameters of every rank: group ``g`` holds the names of every rank's group ``g``.
    """
    every: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, ours)
    groups: list[dict[str, Any]] = []
    for entry in every:
        for pos, g in enumerate(entry["param_groups"]):
            if pos == len(groups):
                groups.append({**g, "params": []})
            groups[pos]["params"] = list(dict.fromkeys([*groups[pos]["params"], *g["params"]]))
    like = sorted({k for entry in every for k in entry["like_param"]})
    return {"class": ours["class"], "param_groups": groups, "like_param": like}


def save_layout(
    layout: Layout,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None,
    writer: str,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``layout`` (and ``optimizer``'s state) to ``path``; ``extra``: plain values kept beside them."""
    t0 = time.perf_counter()
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"cannot save a checkpoint to {path}: it is a file; pass a directory")
    sd = _state_dict(layout, optimizer, writer, extra)
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, checkpoint_id=path, planner=SavePlanner(), no_dist=not layout.distributed)
    what = "weights and optimizer state" if optimizer is not None else "weights"
    log.info("saved %s to %s in %.2f s", what, path, time.perf_counter() - t0)


# ---------------------------------------------------------------- load


def _read_info(path: str) -> tuple[Metadata, dict[str, Any]]:
    """The checkpoint's DCP metadata and autopar entry, read by this process alone (no collective)."""
    if not os.path.isdir(path):
        raise CheckpointError(
            f"no checkpoint at {path}: the directory does not exist; pass the directory pm.save() wrote"
        )
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"{path} is not a checkpoint (it has no .metadata file: the save did not finish, or it is "
            "another directory); pass the directory pm.save() wrote"
        )
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - an unreadable file is one readable line
        raise CheckpointError(f"cannot read the checkpoint at {path}: {exc}; save it again") from exc
    if not isinstance(metadata.state_dict_metadata.get(INFO), BytesStorageMetadata):
        raise CheckpointError(
            f"{path} is a torch.distributed.checkpoint but not autopar's (no {INFO!r} entry); "
            "save with pm.save() or autopar.runtime.checkpoint.save_single()"
        )
    box: dict[str, Any] = {INFO: None}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(box, checkpoint_id=path, planner=LoadPlanner(), no_dist=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read the checkpoint at {path}: {exc}; save it again") from exc
    info = box[INFO]
    if not isinstance(info, dict) or info.get("format", 0) > FORMAT:
        raise CheckpointError(
            f"{path} was written by a newer autopar (format {info}); upgrade autopar to load it"
        )
    return metadata, info


def _check_model(path: str, metadata: Metadata, layout: Layout) -> None:
    """Same names and shapes as the model, or a one-line error naming the first difference."""
    saved = {k[len(MODEL) :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL)}
    ours = layout.model
    missing = [n for n in ours if n not in saved]
    extra = [n for n in saved if n not in ours]
    for names, what in [(missing, "it has no {}"), (extra, "it holds {}, which this model lacks")]:
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise CheckpointError(
                f"the checkpoint at {path} is of a different model: {what.format(repr(names[0]))}{more}; "
                "load it into the model that saved it"
            )
    for name, shape in ours.items():
        md = saved[name]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != shape:
            size = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(
                f"the checkpoint at {path} holds {name!r} as {size} but this model's is {shape}: it is of a "
                "differently sized model; build the model with the checkpoint's configuration"
            )


def _check_optimizer(path: str, info: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    saved = info.get("optimizer")
    if saved is None:
        raise CheckpointError(
            f"the checkpoint at {path} holds no optimizer state (it was saved without optimizer=); "
            "load it with optimizer=None, or save with the optimizer"
        )
    ours = type(optimizer).__name__
    if saved["class"] != ours:
        raise CheckpointError(
            f"the checkpoint at {path} holds {saved['class']} state but the optimizer is {ours}: build a "
            f"{saved['class']} to load it, or load with optimizer=None"
        )
    return saved


def _agree(layout: Layout, check: Any) -> Any:
    """``check()`` on every rank; if it fails anywhere, the same CheckpointError on every rank (no hang)."""
    error, result = None, None
    try:
        result = check()
    except CheckpointError as exc:
        error = str(exc)
    if layout.distributed:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        elsewhere = next((e for e in errors if e is not None), None)
        if error is None and elsewhere is not None:
            error = f"another rank could not load the checkpoint: {elsewhere}"
    if error is not None:
        raise CheckpointError(error)
    return result


def _optimizer_targets(
    layout: Layout, metadata: Metadata, optimizer: torch.optim.Optimizer, like_param: set[str]
) -> tuple[dict[str, Any], list[tuple[torch.Tensor, str, dict[str, str]]]]:
    """Where each saved optimizer value of this rank's parameters is read into, and the keys per parameter."""
    saved_keys: dict[str, dict[str, str]] = {}  # name -> state key -> checkpoint key
    for k in metadata.state_dict_metadata:
        if k.startswith(OPTIM):
            name, key = k[len(OPTIM) :].rsplit(".", 1)
            saved_keys.setdefault(name, {})[key] = k
    targets: dict[str, Any] = {}
    per_param = []
    for p, w, chunked in layout.optimizer_params(optimizer):
        keys = saved_keys.get(w.name, {})
        for k in keys.values():
            md = metadata.state_dict_metadata[k]
            if isinstance(md, BytesStorageMetadata):
                targets[k] = None  # replaced by the saved object
                continue
            dtype = md.properties.dtype
            if k in like_param:  # laid out like its parameter
                if chunked:
                    targets[k] = layout.flat(w, torch.zeros(p.shape, dtype=dtype, device=p.device))
                else:
                    targets[k] = layout.wrap(w, torch.empty(w.local.shape, dtype=dtype, device=p.device))
            else:  # a scalar (AdamW's step) or whole: DCP keeps it on the CPU, load_state_dict moves it
                targets[k] = torch.empty(md.size, dtype=dtype)
        per_param.append((p, w.name, keys))
    return targets, per_param


def _local_value(v: Any) -> Any:
    return v.chunk if isinstance(v, FlatChunk) else v.to_local() if isinstance(v, DTensor) else v


def _restore_optimizer(
    optimizer: torch.optim.Optimizer,
    sd: dict[str, Any],
    per_param: list[tuple[torch.Tensor, str, dict[str, str]]],
    saved: dict[str, Any],
) -> None:
    """Loaded values into the optimizer through its own ``load_state_dict`` (devices, dtypes, hooks).

    Hyperparameters come from the checkpoint, as with torch's
    ``load_state_dict``; each of the optimizer's groups takes the saved group
    holding its first parameter (or the group at its position).
    """
    state: dict[int, dict[str, Any]] = {}
    used: set[str] = set()
    for i, (_, _, keys) in enumerate(per_param):
        for key, k in keys.items():
            v = _local_value(sd[k])
            if k in used and isinstance(v, torch.Tensor):  # a weight's second copy: state of its own
                v = v.clone()
            used.add(k)
            state.setdefault(i, {})[key] = v
    saved_groups = saved["param_groups"]
    group_of = {name: g for g in saved_groups for name in g["params"]}
    name_of = {id(p): name for p, name, _ in per_param}
    groups, index = [], 0
    for pos, g in enumerate(optimizer.param_groups):
        first = name_of[id(g["params"][0])] if g["params"] else None
        src = group_of.get(first) or (saved_groups[pos] if pos < len(saved_groups) else g)
        hyper = {k: v for k, v in src.items() if k != "params"}
        groups.append({**hyper, "params": list(range(index, index + len(g["params"])))})
        index += len(g["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_layout(
    layout: Layout, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Read ``path`` into ``layout`` (and ``optimizer``); the checkpoint's own entry (what ``extra`` saved)."""
    t0 = time.perf_counter()
    path = os.fspath(path)
    read: dict[str, Any] = {}

    def check() -> tuple[Metadata, dict[str, Any] | None]:
        metadata, info = _read_info(path)
        read.update(info)
        _check_model(path, metadata, layout)
        saved = _check_optimizer(path, info, optimizer) if optimizer is not None else None
        if optimizer is not None:
            layout.optimizer_params(optimizer)
        return metadata, saved

    metadata, saved = _agree(layout, check)
    # weights are read in place: the DTensors (and master chunks) wrap the parameters' own storage
    sd: dict[str, Any] = {f"{MODEL}{w.name}": layout.weight(w) for w in layout.weights}
    per_param: list = []
    if optimizer is not None:
        targets, per_param = _optimizer_targets(layout, metadata, optimizer, set(saved["like_param"]))
        sd.update(targets)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=path, planner=LoadPlanner(), no_dist=not layout.distributed)
    with torch.no_grad():
        for w, copy, master in layout.copies:
            copy.copy_(w.local)
            if master is not None and w.master is not None:
                master.copy_(w.master)
    if optimizer is not None:
        _restore_optimizer(optimizer, sd, per_param, saved)
    what = "weights and optimizer state" if optimizer is not None else "weights"
    log.info("loaded %s from %s in %.2f s", what, path, time.perf_counter() - t0)
    return read


# ---------------------------------------------------------------- public


def save_single(
    model: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Save a single-device model (and a plain torch optimizer over it) in the format ``pm.load`` reads.

    Needs no process group (DCP's single-process path), even inside a job.
    """
    save_layout(_single_layout(model), path, optimizer, "single device")


def load_single(
    model: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load a checkpoint written under any plan (or by ``save_single``) into a whole model on one device.

    The weights are copied into the model's tensors in place; the optimizer
    (over ``model.parameters()``) takes the saved state and hyperparameters.
    """
    load_layout(_single_layout(model), path, optimizer)


def _gather_chunk(zero: ZeroChunks, w: _Weight, chunk: torch.Tensor) -> torch.Tensor:
    out = torch.empty(w.chunk[2] * zero.size, dtype=chunk.dtype, device=chunk.device)
    dist.all_gather_single(out, chunk.detach().contiguous(), group=zero.group)
    return out[: w.local.numel()].view(w.local.shape)


def full_optimizer_state(owner: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's state by parameter name, every tensor whole (under a plan: a collective on every rank).

    ``owner``: a single-device model, or a rank's parallel module (which knows
    its checkpoint layout). For tests and inspection: it builds each whole
    tensor on every rank, ZeRO chunks all-gathered first; a checkpoint never does.
    """
    parallel = hasattr(owner, "_checkpoint_layout")
    layout = owner._checkpoint_layout() if parallel else _single_layout(owner)
    out: dict[str, dict[str, Any]] = {}
    for p, w, chunked in layout.optimizer_params(optimizer):
        entry = out.setdefault(w.name, {})
        for key in sorted(optimizer.state.get(p, {})):
            v = optimizer.state[p][key]
            if parallel and _like_param(p, key, v):
                local = _gather_chunk(owner._zero, w, v) if chunked else v.detach()
                v = layout.wrap(w, local).full_tensor()
            entry[key] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return owner._gather_stages(out) if parallel else out
