"""The sharding interpreter: the joint graph run node by node on DTensors, as a plan places every node.

Each argument is first redistributed to the placement the plan's strategy
reads it in, then the op runs.  DTensor does what would otherwise be written
by hand and get subtly wrong: local view sizes, redistribution between any two
placements, partial reductions.  Ops DTensor has no rule for (the CPU
flash-attention kernels, ops the strategy pass replicated) run on the local
tensors of their planned input placements, and their outputs are declared in
the planned output placements; the strategy pass only offered placements for
which that is exact.  A few ops whose DTensor strategy masks in its dispatch
(the vocabulary-parallel embedding, a gather across shards) or that a shard
cannot run as the whole does (a view of a permuted shard) have handlers here.

:mod:`autopar.codegen.shard` traces this run into a rank's local graph;
run eagerly on real shards it gives every node's value as the plan computes it
(:func:`autopar.codegen.shard.run_sharded`).
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from autopar.codegen import sequence_attention
from autopar.codegen.redistribute import (
    dtensor_of,
    from_whole_planned,
    local_of,
    match_layout,
    natural_order,
    to_planned,
    to_planned_in,
)
from autopar.core.placements import Placements, balanced_at, local_boxes, replicated, to_dtensor_all
from autopar.ops import experts as experts_op
from autopar.ops import rng  # noqa: F401  (registers torch.ops.autopar.random)
from autopar.search.sharding import random_ops, reshape_shards, strategy_rules
from autopar.search.sharding.dtensor_rules import decomposition, dispatches_unchanged

log = logging.getLogger(__name__)

aten = torch.ops.aten
# Ops whose DTensor dispatch is a handler narrower than DTensor's own strategies for them: convolutions go
# through ``_tp_conv``'s handler (a dim map, built for spatially split inputs), which refuses a batch split
# over two mesh dims that the single-dim strategy offers. Every strategy offered splits the batch and makes
# the weight's gradient a partial sum: the local convolution on the shards, run as such.
_RUN_LOCALLY = (aten.convolution.default, aten.convolution_backward.default)


# run on the local shards every op DTensor would run so (:func:`dispatches_unchanged`), without its dispatch;
# tests/test_rank_trace.py turns it off to hold the two traces equal
SKIP_DTENSOR_DISPATCH = True


@dataclass
class GradientCasts:
    """What mixed precision adds to the trace (:mod:`autopar.runtime.precision`).

    ``reduce_dtype``: every reduction of a value on the gradient chain
    (:func:`autopar.capture.joint.gradient_chain`) runs in it, wherever the plan
    puts it, and the graph returns the gradients (``grads``, the nodes that make
    them) in it; a value before them is cast back once reduced.  ``seed``: the
    node that starts the backward (``ones_like`` of the loss), multiplied by
    ``scale`` when the graph takes a loss scale (fp16).
    """

    reduce_dtype: torch.dtype | None = None
    chain: set[str] = field(default_factory=set)
    grads: set[str] = field(default_factory=set)
    seed: str | None = None
    scale: DTensor | None = None  # set while tracing



class ShardInterpreter(fx.Interpreter):
    """Runs the joint graph on DTensors, honouring the plan's placement of every node."""

    def __init__(
        self,
        gm: fx.GraphModule,
        plan_placements: dict[str, dict],
        mesh: DeviceMesh,
        on_value: dict[fx.Node, Callable[[Any], None]] | None = None,
        casts: GradientCasts | None = None,
    ) -> None:
        super().__init__(gm)
        self.plan = plan_placements
        self.mesh = mesh
        self.local_only: Counter = Counter()
        self.ran_whole: Counter = Counter()  # ops run whole on gathered inputs (:meth:`_run_whole`)
        self.on_value = on_value or {}  # called with a node's value as soon as it is computed
        self.random_ids = random_ops.op_numbers(gm.graph)
        self.casts = casts or GradientCasts()

    def run_node(self, n: fx.Node) -> Any:
        # traced nodes record ``n`` as their source ("from_node") when node meta is preserved
        with fx_traceback.set_current_meta(n, "autopar_shard"):
            out = self._run_planned(n)
            if n.name == self.casts.seed and self.casts.scale is not None:
                out = out * self.casts.scale.to(out.dtype)  # the backward starts from the scaled loss
            if n in self.on_value:
                self.on_value[n](natural_order(out, self._held(n)))
        return out

    def _move(self, x: Any, target: Placements | None, node: fx.Node, src: Placements | None = None) -> Any:
        """``x`` (the value of ``node``, held ``src`` where that is known) to ``target``; a gradient's reduction
        in the reduce dtype."""
        dtype = self.casts.reduce_dtype
        if dtype is not None and node.name in self.casts.chain:
            return to_planned_in(x, target, dtype, keep=node.name in self.casts.grads, src=src)
        return to_planned(x, target, src)

    def _held(self, node: fx.Node) -> Placements | None:
        """The placement the value of ``node`` (a single tensor) is held in: its planned output's."""
        entry = self.plan.get(node.name)
        outs = entry["outputs"] if entry else None
        return tuple(outs[0]) if outs and outs[0] else None

    def _run_planned(self, n: fx.Node) -> Any:
        if n.op not in ("call_function", "get_attr"):
            return super().run_node(n)
        entry = self.plan.get(n.name)
        if n.op == "get_attr":  # a constant of the model: whole on every rank, then as planned
            return self._whole(super().run_node(n), entry)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if entry is None:
            return n.target(*args, **kwargs)
        if n.target is operator.getitem:  # a follower: its value is moved once, for all its users
            out = n.target(*args, **kwargs)
            if entry["inputs"]:
                source, idx = n.args[0], n.args[1]
                outs = (self.plan.get(source.name) or {}).get("outputs") or ()
                held = tuple(outs[idx]) if isinstance(idx, int) and idx < len(outs) and outs[idx] else None
                out = self._move(out, tuple(entry["inputs"][0]) if entry["inputs"][0] else None, n, held)
            return self._declare(out, entry, n)
        if n.target in random_ops.RANDOM_OPS:
            args, kwargs = self._bring(n, args, kwargs, entry)
            return self._declare(self._random(n, args, kwargs, entry), entry, n)
        if n.target in random_ops.KEYED_KERNELS:
            args, kwargs = self._bring(n, args, kwargs, entry)
            return self._declare(self._keyed_kernel(n, args, kwargs, entry), entry, n)
        if not any(isinstance(a, DTensor) for a in pytree.tree_leaves((args, kwargs))):
            # a factory (arange, full, ...) or an op on constants: whole on every rank
            return self._whole(n.target(*args, **kwargs), entry)
        args, kwargs = self._bring(n, args, kwargs, entry)
        if n.target is aten.embedding.default and any(p.is_shard(0) for p in entry["inputs"][0] or ()):
            return self._declare(self._vocab_parallel_embedding(args, entry), entry, n)
        if n.target is aten.gather.default and self._gathers_across_shards(n, entry):
            return self._declare(self._masked_gather(n, args, entry), entry, n)
        if n.target in reshape_shards.RESHAPES and self._contiguous(n, entry):
            return self._declare(self._local_reshape(n, args, entry), entry, n)
        if strategy_rules.rule_for(n.target) is not None or n.target in _RUN_LOCALLY:
            # autopar's own rule, or DTensor's single-dim strategy: exact on local shards by construction
            return self._declare(self._local(n, args, kwargs, entry), entry, n)
        decomposed = decomposition(n.target)
        if decomposed is not None:  # the strategies were traced through it: run it on the DTensors
            try:
                return self._declare(decomposed(*args, **kwargs), entry, n)
            except (NotImplementedError, RuntimeError, AssertionError) as e:
                return self._declare(self._run_whole(n, args, kwargs, entry, e), entry, n)
        if SKIP_DTENSOR_DISPATCH and dispatches_unchanged(n.target) and self._outputs_planned(n, entry):
            # DTensor would pick the planned strategy (the inputs are laid out as it reads it) and run the op on
            # the local shards, its arguments unchanged: that, without enumerating the op's strategies again
            return self._declare(self._local(n, args, kwargs, entry), entry, n)
        if n.target is aten.view.default and self._shard_not_viewable(n, args[0], entry):
            args = (args[0].contiguous(), *args[1:])
        try:
            out = n.target(*args, **kwargs)
        except NotImplementedError:  # no DTensor rule: the strategy pass offered only what runs locally
            out = self._local(n, args, kwargs, entry)
        return self._declare(out, entry, n)

    @staticmethod
    def _outputs_planned(n: fx.Node, entry: dict) -> bool:
        tensors = [v for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)]
        outs = entry["outputs"]
        return len(outs) >= len(tensors) and all(p is not None for p in outs[: len(tensors)])

    def _bring(self, n: fx.Node, args: Any, kwargs: Any, entry: dict) -> tuple[Any, Any]:
        """The arguments as DTensors, each redistributed to the placement the plan reads it in."""
        args, kwargs = pytree.tree_map_only(torch.Tensor, self._replicated, (args, kwargs))
        wanted = iter(entry["inputs"])

        def bring(x: Any, node: Any) -> Any:
            if isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor):
                return self._move(x, next(wanted, None), node, self._held(node))
            return x

        node_leaves, spec = pytree.tree_flatten((n.args, dict(n.kwargs)))
        val_leaves = pytree.tree_leaves((args, kwargs))
        val_leaves = [bring(v, a) for v, a in zip(val_leaves, node_leaves, strict=True)]
        return pytree.tree_unflatten(val_leaves, spec)

    def _run_whole(self, n: fx.Node, args: Any, kwargs: Any, entry: dict, why: Exception) -> Any:
        """``n`` computed whole on every rank from its gathered inputs, then cut to its planned outputs.

        The safety net for a decomposition DTensor traced at planning time on a
        one-dimensional mesh but cannot run on this one (an op inside it with no
        rule here, e.g. ``log_sigmoid_forward`` inside
        ``binary_cross_entropy_with_logits``): exact for any op, at the price of
        gathers the estimate did not count, hence the warning.
        """
        op = str(n.target)
        if op not in self.ran_whole:
            first = str(why).strip().splitlines()[0] if str(why).strip() else type(why).__name__
            log.warning("ran %s whole on every rank, its inputs gathered: DTensor cannot run its "
                        "decomposition on the planned placements (%s)", op, first)
        self.ran_whole[op] += 1
        whole = replicated(self.mesh.ndim)
        wanted = iter(entry["inputs"])

        def gather(x: Any, node: Any) -> Any:
            if not (isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)):
                return x
            held = next(wanted, None)
            if not isinstance(x, DTensor):
                return x
            return local_of(to_planned(x, whole, tuple(held) if held else None))

        node_leaves, spec = pytree.tree_flatten((n.args, dict(n.kwargs)))
        val_leaves = pytree.tree_leaves((args, kwargs))
        local_args, local_kwargs = pytree.tree_unflatten(
            [gather(v, a) for v, a in zip(val_leaves, node_leaves, strict=True)], spec
        )
        return self._whole(n.target(*local_args, **local_kwargs), entry)

    def _random(self, n: fx.Node, args: Any, kwargs: Any, entry: dict) -> Any:
        """A random op on this rank's part of its output, from numbers keyed to that part (:mod:`autopar.ops.rng`).

        The output's placement decides the key: this rank's offset into the
        whole tensor (``"exact"`` mode) and its coordinate on each mesh axis
        that shards the output (``"fast"`` mode), so ranks holding copies draw
        the same numbers and ranks holding different shards draw their own.
        """
        spec = tuple(entry["outputs"][0])
        vals = n.meta["val"]
        whole = vals[0] if isinstance(vals, (tuple, list)) else vals
        device = torch.device(self.mesh.device_type)
        pieces = self._pieces(whole.shape, spec)
        cat = balanced_at(spec)

        def draw(normal: bool, dtype: torch.dtype) -> torch.Tensor:
            parts = [
                torch.ops.autopar.random(
                    list(shape), dtype, device, self.random_ids[n.name], list(whole.shape), list(offset), stream, normal
                )
                for shape, offset, stream in pieces
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts, cat[1])

        local_args, local_kwargs = pytree.tree_map_only(DTensor, local_of, (args, kwargs))
        out = random_ops.run_local(n.target, local_args, local_kwargs, draw, whole)
        return self._wrap(out, vals, entry)

    def _keyed_kernel(self, n: fx.Node, args: Any, kwargs: Any, entry: dict) -> Any:
        """A kernel that draws with a key of its own (attention with dropout) on this rank's shards.

        Its draws cover the score tensor (the query's leading dims, then the
        key's sequence), split as the query is: the key is this rank's box of
        it, as for any random op (:meth:`_random`).
        """
        q_at = random_ops.KEYED_KERNELS[n.target]
        q, k = n.args[q_at].meta["val"], n.args[q_at + 1].meta["val"]
        scores = [*q.shape[:-1], k.shape[-2]]
        pieces = self._pieces(scores, tuple(entry["inputs"][q_at]))
        streams = {tuple(offset): stream for _, offset, stream in pieces}
        local = pytree.tree_map_only(DTensor, local_of, args)

        def run(a: tuple, kw: dict, box: tuple[list[int], list[int]]) -> Any:
            offset = box[1]
            return n.target(*a[:-4], self.random_ids[n.name], scores, offset, streams[tuple(offset)], **kw)

        boxes = [(shape, offset) for shape, offset, _ in pieces]
        return self._wrap(sequence_attention.on_pieces(n.target, local, {}, boxes, run), n.meta["val"], entry)

    def _pieces(self, shape: Any, spec: Placements) -> list[tuple[list[int], list[int], list[int]]]:
        """This rank's pieces of a tensor of ``shape`` placed ``spec`` (:func:`autopar.core.placements.local_boxes`),
        each with the stream its random numbers are drawn from: per mesh dim, the chunk it is of those that
        mesh dim cuts (-1 where it does not cut), so that no two pieces of the tensor share a stream."""
        coord, sizes = self.mesh.get_coordinate(), self.mesh.shape
        out = []
        for local, offset in local_boxes(shape, spec, coord, sizes):
            stream = []
            for p, c in zip(spec, coord, strict=True):
                if not p.is_shard():
                    stream.append(-1)
                elif p.is_balanced():
                    stream.append(offset[p.dim] // local[p.dim] % (2 * sizes[len(stream)]))
                else:
                    stream.append(c)
            out.append((local, offset, stream))
        return out

    def _wrap(self, out: Any, vals: Any, entry: dict) -> Any:
        """Local outputs as DTensors in the placements ``entry`` declares, with the captured shapes."""
        flat_out, spec = pytree.tree_flatten(out)
        flat_val = pytree.tree_leaves(vals)
        outs = iter(entry["outputs"])
        wrapped = []
        for o, v in zip(flat_out, flat_val, strict=True):
            p = next(outs, None)
            if isinstance(o, torch.Tensor) and p is not None:
                o = dtensor_of(o, self.mesh, to_dtensor_all(p), v.shape, v.stride())
            wrapped.append(o)
        return pytree.tree_unflatten(wrapped, spec)

    def _replicated(self, t: torch.Tensor) -> DTensor:
        if isinstance(t, DTensor):
            return t
        return dtensor_of(t, self.mesh, (Replicate(),) * self.mesh.ndim, t.shape, t.stride())

    def _whole(self, out: Any, entry: dict | None) -> Any:
        """Tensors every rank holds whole, laid out as ``entry`` plans (replicated when it does not)."""
        flat, spec = pytree.tree_flatten(out)
        outs = iter(entry["outputs"] if entry else [])
        res = []
        for o in flat:
            if isinstance(o, torch.Tensor):
                o = from_whole_planned(o, self.mesh, tuple(next(outs, None) or replicated(self.mesh.ndim)))
            res.append(o)
        return pytree.tree_unflatten(res, spec)

    def _vocab_parallel_embedding(self, args: Any, entry: dict) -> Any:
        """Embedding with the table's rows split over mesh dims: look up the rows held, zeros elsewhere.

        The result is a partial sum over those mesh dims.  DTensor does the same
        with a masked partial whose mask lives in the placement and is spent by
        the first reduction, which breaks a value read twice; here the mask is
        applied at once and the placement is a plain partial sum.
        """
        weight, indices, *rest = args
        offset, rows = self._held_rows(entry["inputs"][0], 0, weight.shape[0])
        idx = local_of(indices) if isinstance(indices, DTensor) else indices
        outside = (idx < offset) | (idx >= offset + rows)
        local = aten.embedding.default(local_of(weight), (idx - offset).masked_fill(outside, 0), *rest)
        local = local.masked_fill(outside.unsqueeze(-1), 0)
        out_spec = entry["outputs"][0]
        return dtensor_of(
            local,
            self.mesh,
            to_dtensor_all(out_spec),
            torch.Size([*indices.shape, weight.shape[1]]),
            torch.empty([*indices.shape, weight.shape[1]], device="meta").stride(),
        )

    def _shard_not_viewable(self, n: fx.Node, x: Any, entry: dict) -> bool:
        """Whether ``n`` (a view) cannot view this rank's shard of ``x``, though it views the whole: a permuted
        tensor split on a dim beside the ones the view merges (Mamba-2's chunked scan) holds its shard at
        strides no view can merge. The shard is then made contiguous first: the same values, copied."""
        out = entry["outputs"][0] if entry["outputs"] else None
        if not isinstance(x, DTensor) or not out:
            return False
        shape = list(n.meta["val"].shape)
        for p, size in zip(out, self.mesh.shape, strict=True):
            if p.is_shard():
                shape[p.dim] //= size
        local = local_of(x)
        try:
            torch.empty_strided(local.shape, local.stride(), device="meta").view(shape)
        except (RuntimeError, ValueError):
            return True
        return False

    def _held_rows(self, spec: Placements, dim: int, size: int) -> tuple[int, int]:
        """Where this rank's rows of a tensor dim of ``size`` placed ``spec`` start, and how many it holds."""
        rows, offset, coord = size, 0, self.mesh.get_coordinate()
        for i, p in enumerate(spec):
            if p.is_shard(dim):
                rows //= self.mesh.size(i)
                offset += coord[i] * rows
        return offset, rows

    @staticmethod
    def _gathers_across_shards(n: fx.Node, entry: dict) -> bool:
        """Whether ``gather`` is planned on a source split along the dim it gathers from (its index whole there)."""
        source = entry["inputs"][0]
        dim = n.args[1] % n.args[0].meta["val"].dim()
        return bool(source) and any(p.is_shard(dim) for p in source)

    def _masked_gather(self, n: fx.Node, args: Any, entry: dict) -> Any:
        """``gather`` from a source split along its gather dim: each rank picks the entries it holds, zeros
        elsewhere, a partial sum over the splitting mesh dims (DTensor's masked-partial strategy, whose
        masking lives in its dispatch: run on the local shards as such, it indexed past them)."""
        source, dim, index = args[0], n.args[1] % n.args[0].meta["val"].dim(), args[2]
        offset, rows = self._held_rows(entry["inputs"][0], dim, source.shape[dim])
        idx = local_of(index) if isinstance(index, DTensor) else index
        outside = (idx < offset) | (idx >= offset + rows)
        local = aten.gather.default(local_of(source), dim, (idx - offset).masked_fill(outside, 0))
        self.local_only[str(n.target)] += 1
        return self._wrap(local.masked_fill(outside, 0), n.meta["val"], entry)

    def _contiguous(self, n: fx.Node, entry: dict) -> bool:
        """Whether ``n`` (a reshape) is planned as one DTensor calls strided that keeps each rank's elements."""
        src, out = entry["inputs"][0], entry["outputs"][0]
        if not src or not out:
            return False
        a, b = tuple(n.args[0].meta["val"].shape), tuple(n.meta["val"].shape)
        return tuple(out) in reshape_shards.reshaped_placements(a, tuple(src), b, tuple(self.mesh.shape))

    def _local_reshape(self, n: fx.Node, args: Any, entry: dict) -> Any:
        """A reshape on this rank's elements, which the planned placements hold on both sides."""
        local = local_of(args[0])
        shape = list(n.meta["val"].shape)
        for p, size in zip(entry["outputs"][0], self.mesh.shape, strict=True):
            if p.is_shard():
                shape[p.dim] //= size
        self.local_only[str(n.target)] += 1
        return self._wrap(aten.reshape.default(local, shape), n.meta["val"], entry)

    def _local(self, n: fx.Node, args: Any, kwargs: Any, entry: dict) -> Any:
        """Run ``n`` on local shards; its outputs are what the plan says they are."""
        self.local_only[str(n.target)] += 1
        local_args, local_kwargs = pytree.tree_map_only(DTensor, local_of, (args, kwargs))
        if n.target in strategy_rules.LOCAL_ARGUMENTS:
            local_args, local_kwargs = strategy_rules.LOCAL_ARGUMENTS[n.target](local_args, local_kwargs)
        if n.target in experts_op.EXPERT_OPS:
            axes = experts_op.ep_axes(
                [tuple(p) if p else None for p in entry["inputs"]], n.target is torch.ops.autopar.experts_backward.default
            )
            if axes:  # expert parallel: the op that sends the tokens to their experts' ranks and back
                group = self.mesh.get_group(axes[0]).group_name
                size = self.mesh.shape[axes[0]]
                out = experts_op.EP_VARIANT[n.target](*local_args, group, size)
                return self._wrap(out, n.meta["val"], entry)
        if n.target in sequence_attention.CAUSAL_FLAG:  # on a query shard: its rows of the mask, piece by piece
            q_at = sequence_attention.CAUSAL_FLAG[n.target][0]
            whole = (n.args[q_at].meta["val"].shape, n.args[q_at + 1].meta["val"].shape)
            out = sequence_attention.run_causal(
                n.target, local_args, local_kwargs, whole, tuple(entry["inputs"][q_at]),
                self.mesh.get_coordinate(), self.mesh.shape,
            )
            return self._wrap(out, n.meta["val"], entry)
        return self._wrap(n.target(*local_args, **local_kwargs), n.meta["val"], entry)

    def _declare(self, out: Any, entry: dict, node: fx.Node) -> Any:
        """Bring each output to the placement the plan chose for it, in the memory layout of the capture."""
        flat, spec = pytree.tree_flatten(out)
        vals = pytree.tree_leaves(node.meta.get("val"))
        outs = iter(entry["outputs"])
        res = []
        for k, o in enumerate(flat):
            p = next(outs, None) if isinstance(o, torch.Tensor) else None
            o = self._move(o, p, node)
            if isinstance(o, DTensor) and k < len(vals) and isinstance(vals[k], torch.Tensor):
                o = match_layout(o, vals[k])
            res.append(o)
        return pytree.tree_unflatten(res, spec)
