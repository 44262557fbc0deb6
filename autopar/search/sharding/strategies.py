"""Strategies: for every node of the joint graph, its candidate shardings on a device mesh.

The solver picks one strategy per node; this pass only says what is *possible*.
Everything it returns is plain data (autopar's placements in tuples), so the
solver, the cost models and the plan never see a DTensor object.

Where the rules come from, and why:

* **DTensor first.** PyTorch's DTensor already knows, per ATen op, which input
  placements give which output placement (its "op strategies").  We feed those
  functions ``OpStrategy`` inputs that hold *every* candidate placement of each
  producer (the way meta-pytorch/autoparallel uses them), so each rule lists all
  its options rather than one runtime choice.  Three kinds exist in torch 2.13 and
  are tried in the order DTensor's own propagator uses: single-mesh-dim rules
  (expanded here across the mesh), full op-strategy functions, and strategies
  derived by tracing an op's decomposition.
* **autopar's own rules** (:mod:`autopar.search.sharding.strategy_rules`) where DTensor has
  none or lacks a useful one: the CPU flash-attention kernels, factory ops.
* **Followers** (``getitem``) mirror their source strategy by strategy, so the
  solver can tie them to it instead of choosing freely.
* **Anything else is replicated**, with one warning per op name, never a crash.

A placement (:mod:`autopar.core.placements`) is, per mesh dim, R (replicate),
S(d) (shard tensor dim ``d``) or P (partial sum; DTensor's masked partial of a
vocab-sharded embedding is a partial sum too).  A partial that reduces by another
operation is P(avg), P(max)...: a mean-reduced loss over a batch-sharded input
is P(avg) and without it data parallelism would have to gather the logits.
Strided shards have no such placement; strategies that need them are dropped
(the same result stays reachable through the strategies kept, the all-R one at
worst).

This module walks the graph and asks the rules, in the order above.  The
records it hands on are in :mod:`autopar.search.sharding.node_strategies`; the
rules' answers are made into strategies on the whole mesh, and pruned, by
:mod:`autopar.search.sharding.strategy_rows`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import time
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import placement_types as dt
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import (
    _fill_single_dim_strategy_placeholders,
    _insert_single_dim_replication_strategy,
)

from autopar.core.mesh import SHARDING_AXES, fake_mesh
from autopar.core.placements import Placements, Row, from_dtensor, replicated, to_dtensor_all
from autopar.ops import experts as experts_op
from autopar.search.sharding import reshape_shards, strategy_rules
from autopar.search.sharding.balanced_shards import Balance, balance_of, balanced_variants
from autopar.search.sharding.dtensor_rules import costs_off, decomposition_rows, with_rule
from autopar.search.sharding.node_keys import (
    NodeKey,
    is_tensor_node,
    node_keys,
    output_vals,
    tensor_inputs,
    tensor_meta,
)
from autopar.search.sharding.node_strategies import NodeStrategies, Strategy
from autopar.search.sharding.placement_sets import tensor_placements
from autopar.search.sharding.strategy_rows import expand_rows, from_op_strategy, partials_offered, prune

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- mesh


@functools.lru_cache(maxsize=16)
def _names_for(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> tuple[str, ...]:
    if len(mesh_dim_names) == len(mesh_shape):
        return tuple(mesh_dim_names)
    if tuple(mesh_dim_names) == SHARDING_AXES:
        return (
            SHARDING_AXES[: len(mesh_shape)]
            if len(mesh_shape) <= 2
            else tuple(f"d{i}" for i in range(len(mesh_shape)))
        )
    raise ValueError(f"mesh_dim_names {mesh_dim_names} do not match mesh_shape {mesh_shape}")


# ---------------------------------------------------------------------------- the pass


def unruled_ops(strategies: dict[str, NodeStrategies]) -> set[str]:
    """The ops :func:`enumerate_strategies` replicated for want of a sharding rule (those its warning names)."""
    return {ns.op for ns in strategies.values() if ns.rule == "replicated-fallback"}


def enumerate_strategies(
    gm: fx.GraphModule,
    mesh_shape: tuple[int, ...],
    mesh_dim_names: tuple[str, ...] = SHARDING_AXES,
    balance_masks: bool = False,
    batch: int = 0,
) -> dict[str, NodeStrategies]:
    """Candidate strategies for every placeholder, constant and call node of ``gm``.

    Strategies that split a causal kernel's sequence have twins in head-tail order
    (:mod:`autopar.search.sharding.balanced_shards`); ``balance_masks``: those of kernels
    given a mask tensor too. ``batch``: the batch ``gm`` was captured at; a reshape then also
    gets the local placements that hold only at some micro-batch counts (``Strategy.only_at``).

    ``gm`` is the joint graph from :func:`autopar.capture.joint.capture` (every node has
    ``meta["val"]``).  The output node is not an op and gets no entry.  Identical
    layers cost one computation: results are memoized per (op, input tensor metas,
    input candidate placements, other arguments).
    """
    mesh_shape = tuple(int(n) for n in mesh_shape)
    names = _names_for(mesh_shape, tuple(mesh_dim_names))
    t0 = time.perf_counter()
    enum = _Enumerator(fake_mesh(mesh_shape, names), mesh_shape, node_keys(gm), balance_of(gm, balance_masks), batch)
    out: dict[str, NodeStrategies] = {}
    with costs_off():
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            out[node.name] = enum.visit(node)
    for op, count in sorted(enum.fallback.items()):
        log.warning("no sharding rule for %s (%d node%s): replicated", op, count, "" if count == 1 else "s")
    log.info(
        "strategies: %d nodes on mesh %s in %.2f s (%d computed, %d memo hits)",
        len(out),
        mesh_shape,
        time.perf_counter() - t0,
        enum.misses,
        enum.hits,
    )
    return out


class _Enumerator:
    """State of one enumeration: the strategies so far and the memo."""

    def __init__(
        self,
        mesh: DeviceMesh,
        mesh_shape: tuple[int, ...],
        keys: dict[fx.Node, NodeKey],
        balance: Balance | None = None,
        batch: int = 0,
    ) -> None:
        self.balance = balance or Balance()
        self.batch = batch
        self.mesh = mesh
        self.mesh_shape = mesh_shape
        self.keys = keys
        self.prop = DTensor._op_dispatcher.sharding_propagator
        self.done: dict[fx.Node, NodeStrategies] = {}
        self.memo: dict[Any, tuple[str, list[Strategy]]] = {}
        self.fallback: Counter[str] = Counter()
        self.hits = 0
        self.misses = 0
        self._cands: dict[fx.Node, tuple[Placements, ...]] = {}
        self.constant: set[fx.Node] = set()  # nodes computed from no graph input: the model's constants

    # -- candidates of a producer, as DTensor input ----------------------------------

    def candidates(self, node: fx.Node) -> tuple[Placements, ...]:
        """The distinct placements ``node``'s (single) output can have."""
        got = self._cands.get(node)
        if got is None:
            ns = self.done[node]
            seen: dict[Placements, None] = {}
            for s in ns.strategies:
                p = s.outputs[0] if s.outputs else None
                if p is not None:
                    seen.setdefault(p, None)
            if not seen:  # a producer whose output the rules never placed: treat as replicated
                seen[replicated(len(self.mesh_shape))] = None
            got = tuple(seen)
            self._cands[node] = got
        return got

    def op_strategy(
        self, node: fx.Node, pad: int = 0, only: dict[fx.Node, Placements] | None = None
    ) -> OpStrategy:
        """``node``'s candidates as a DTensor input.

        ``pad`` repeats them up to that many: some DTensor rules (nll_loss) read input
        *i*'s strategy at the index of input 0's, assuming one runtime placement each;
        they only take shapes or replicate from those partners, so repeating the list
        keeps them in range and changes nothing.  ``only`` pins some nodes to one
        placement (see :meth:`_dtensor`).
        """
        tm = tensor_meta(node.meta["val"])
        cands = (only[node],) if only and node in only else self.candidates(node)
        if pad > len(cands):
            cands = tuple(itertools.islice(itertools.cycle(cands), pad))
        return OpStrategy(
            [
                OpSpec(DTensorSpec(self.mesh, to_dtensor_all(p), tensor_meta=tm))
                for p in cands
            ]
        )

    # -- dispatch ---------------------------------------------------------------------

    def visit(self, node: fx.Node) -> NodeStrategies:
        if node.op == "get_attr" or (node.op == "call_function" and all(a in self.constant for a in node.all_input_nodes)):
            self.constant.add(node)
        ns = self._visit(node)
        self.done[node] = ns
        return ns

    def _visit(self, node: fx.Node) -> NodeStrategies:
        op_name = str(node.target) if node.op == "call_function" else node.op
        if node.op in ("placeholder", "get_attr"):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                strats = [Strategy((p,), ()) for p in tensor_placements(val.shape, self.mesh_shape)]
            else:
                strats = [Strategy((None,), ())]
            return NodeStrategies(node.name, op_name, [], strats, "placeholder")
        if node.op != "call_function":
            return self._replicated(node, op_name, warn=True)
        if node.target is operator.getitem:
            return self._follower(node)
        nk = self.keys[node]
        inputs = nk.inputs
        outs = output_vals(node)
        if not any(isinstance(v, torch.Tensor) for v in outs):
            # Symbolic-size arithmetic and the like: nothing to place.
            return self._replicated(node, op_name, warn=False)

        # what the strategies depend on: the graph's part (node_keys), the producers' candidates, and whether the
        # node may hold a head-tail shard
        twins = bool(self.balance.lengths) and node.name not in self.balance.fixed
        own = tuple(a.op == "placeholder" for a in inputs) if twins else ()
        key = None if nk.template is None else (nk.template, tuple(self.candidates(a) for a in nk.slots), twins, own)
        cached = self.memo.get(key) if key is not None else None
        if cached is not None:
            self.hits += 1
            rule, strats = cached
        else:
            self.misses += 1
            rule, strats = self._compute(node, inputs, outs)
            if twins and strats:
                strats = strats + balanced_variants(strats, inputs, outs, own, self.balance.lengths, self.mesh_shape)
            if key is not None:
                self.memo[key] = (rule, strats)
        if not strats:
            # an op on the model's constants (a tensor literal copied, a mask built from shapes) computes the
            # same whole value on every rank, as a factory does: replicated is its rule, not a fallback
            constant = node in self.constant
            ns = self._replicated(node, op_name, warn=not constant)
            if constant:
                ns.rule = "autopar"
            return ns
        return NodeStrategies(node.name, op_name, [a.name for a in inputs], list(strats), rule)

    def _compute(
        self, node: fx.Node, inputs: list[fx.Node], outs: tuple[Any, ...]
    ) -> tuple[str, list[Strategy]]:
        op = node.target
        in_shapes = [tuple(a.meta["val"].shape) for a in inputs]
        out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in outs]
        own = strategy_rules.rule_for(op)
        if own is not None:
            single = own(node)
            strats = expand_rows(single, len(outs), out_shapes, self.mesh_shape)
            if op in experts_op.EXPERT_OPS:
                strats = [s for s in strats if experts_op.ep_axes(s.inputs, op is torch.ops.autopar.experts_backward.default) is not None]
            return "autopar", self._prune(strats, inputs, in_shapes, out_shapes)
        if not inputs:
            # Factory ops (arange, full, zeros, scalar_tensor...): every rank makes the whole tensor.
            r = replicated(len(self.mesh_shape))
            return "autopar", [Strategy(tuple(r if s is not None else None for s in out_shapes), ())]
        if not isinstance(op, torch._ops.OpOverload):
            return "replicated-fallback", []
        try:
            strats = self._dtensor(node, inputs, outs, in_shapes, out_shapes)
        except Exception as e:  # a rule that chokes on our inputs is a missing rule, not a crash
            log.debug("DTensor strategy for %s (%s) failed: %s: %s", node.name, op, type(e).__name__, e)
            return "replicated-fallback", []
        strats = self._prune(strats, inputs, in_shapes, out_shapes)
        if op in reshape_shards.RESHAPES:
            more = self._contiguous_reshapes(inputs[0], strats, in_shapes[0], out_shapes[0])
            strats = self._prune(strats + more, inputs, in_shapes, out_shapes) if more else strats
        return "dtensor", strats

    def _contiguous_reshapes(
        self, source: fx.Node, strats: list[Strategy], in_shape: tuple[int, ...], out_shape: tuple[int, ...] | None
    ) -> list[Strategy]:
        """A reshape's strategies for the producer's placements DTensor's rule calls strided but that keep
        every rank's elements (:mod:`autopar.search.sharding.reshape_shards`): run locally.

        Those that keep them only on a micro-batch's graph (the batch cut to one sequence a rank: the
        flatten of a language model's sequence-split logits under context parallelism over the dp
        axis's ranks) are offered at those counts alone (``only_at``). The batch is taken to lead both
        shapes, as the runtime resizes it (:func:`autopar.cost_models.graph_cache.resize_batch`).
        """
        if out_shape is None:
            return []
        offered = {s.inputs[0] for s in strats}
        cands = [c for c in self.candidates(source) if c not in offered]
        mesh = self.mesh_shape
        found = {(c, out): () for c in cands for out in reshape_shards.reshaped_placements(in_shape, c, out_shape, mesh)}
        for key, m in reshape_shards.local_at_one_row(in_shape, out_shape, cands, mesh, self.batch).items():
            found.setdefault(key, (m,))
        return [Strategy((out,), (c,), only_at=counts) for (c, out), counts in found.items()]

    # -- DTensor ------------------------------------------------------------------

    def _schema(
        self,
        node: fx.Node,
        op: torch._ops.OpOverload,
        pad: int = 0,
        only: dict[fx.Node, Placements] | None = None,
    ) -> OpSchema:
        def wrap(a: Any) -> Any:
            if is_tensor_node(a):
                return self.op_strategy(a, pad, only)
            if isinstance(a, fx.Node):
                return a.meta.get("val")
            if isinstance(a, (list, tuple)) and a and any(is_tensor_node(e) for e in a):
                children = [wrap(e) for e in a]
                if all(isinstance(c, OpStrategy) for c in children):
                    return TupleStrategy(tuple(children) if isinstance(a, tuple) else children)
                return children
            if isinstance(a, (list, tuple)):
                return type(a)(wrap(e) for e in a)
            return a

        args = tuple(wrap(a) for a in node.args)
        kwargs = {k: wrap(v) for k, v in node.kwargs.items()}
        info = self.prop.op_to_schema_info.get(op) or self.prop.op_to_schema_info_for_single_dim_strategy.get(
            op
        )
        return OpSchema(op, args, kwargs, schema_info=info)

    def _dtensor(
        self,
        node: fx.Node,
        inputs: list[fx.Node],
        outs: tuple[Any, ...],
        in_shapes: list[tuple[int, ...]],
        out_shapes: list[tuple[int, ...] | None],
    ) -> list[Strategy]:
        prop = self.prop
        op = with_rule(node.target, prop)
        schema = self._schema(node, op)
        single = prop.op_single_dim_strategy_funcs.get(op)
        if single is not None:
            metas = tuple(tensor_meta(v) for v in outs)
            out_meta: Any = metas[0] if len(metas) == 1 else metas
            rules = single.func(op, schema.args_meta, schema.kwargs_meta)
            n_out = len(rules[0]) - len(inputs) if rules else len(outs)
            rules = _insert_single_dim_replication_strategy(rules, n_out, len(inputs), out_meta)
            rules = _fill_single_dim_strategy_placeholders({dt.Shard(0)}, rules)
            plain: list[Row] = []
            for r in rules:
                row = [None if p is None else from_dtensor(p, j >= n_out) for j, p in enumerate(r)]
                if any(s is None and p is not None for s, p in zip(row, r, strict=True)):
                    continue  # a strided shard: not a placement autopar has
                plain.append(row)
            return expand_rows(plain, n_out, out_shapes, self.mesh_shape)
        func = prop.op_strategy_funcs.get(op)
        if func is None:
            found = decomposition_rows(self.prop, self.mesh, schema, op, inputs)
            if found is None:
                return []
            rows, n_out = found
            return expand_rows(rows, n_out, out_shapes, self.mesh_shape)
        try:
            results = [func(schema)]
        except IndexError:
            pad = max(len(self.candidates(a)) for a in inputs)
            results = [func(self._schema(node, op, pad))]
        except Exception as e:
            # Rules loop over input 0's placements and raise on the first they cannot
            # take (a view that would unflatten an uneven shard): one bad candidate
            # sinks all.  Ask again one candidate of input 0 at a time.
            log.debug("%s: %s; retrying per candidate of %s", node.name, e, inputs[0].name)
            results = []
            for c in self.candidates(inputs[0]):
                try:
                    results.append(func(self._schema(node, op, 0, {inputs[0]: c})))
                except Exception:
                    continue
            if not results:
                raise
        strats: list[Strategy] = []
        for result in results:
            if not isinstance(result, OpStrategy):
                raise TypeError(f"{type(result).__name__} result")
            strats += from_op_strategy(result, op, len(inputs), out_shapes, self.mesh_shape)
        return strats

    # -- the strategies kept -----------------------------------------------------------

    def _prune(
        self,
        strats: list[Strategy],
        inputs: list[fx.Node],
        in_shapes: list[tuple[int, ...]],
        out_shapes: list[tuple[int, ...] | None],
    ) -> list[Strategy]:
        """:func:`autopar.search.sharding.strategy_rows.prune`, given what ``inputs``' producers offer."""
        offered = [partials_offered(self.candidates(a)) for a in inputs]
        return prune(strats, offered, in_shapes, out_shapes, self.mesh_shape)

    # -- followers and fallbacks -------------------------------------------------------

    def _follower(self, node: fx.Node) -> NodeStrategies:
        src, idx = node.args[0], node.args[1]
        op_name = str(node.target)
        if not isinstance(src, fx.Node) or src not in self.done or not isinstance(idx, int):
            return self._replicated(node, op_name, warn=True)
        strats = []
        for s in self.done[src].strategies:
            p = s.outputs[idx] if idx < len(s.outputs) else None
            strats.append(Strategy((p,), (p,)))
        return NodeStrategies(node.name, op_name, [src.name], strats, "follower")

    def _replicated(self, node: fx.Node, op_name: str, warn: bool) -> NodeStrategies:
        r = replicated(len(self.mesh_shape))
        inputs = tensor_inputs(node)
        outs = tuple(r if isinstance(v, torch.Tensor) else None for v in output_vals(node))
        if warn:
            self.fallback[op_name] += 1
        return NodeStrategies(
            node.name,
            op_name,
            [a.name for a in inputs],
            [Strategy(outs, (r,) * len(inputs))],
            "replicated-fallback",
        )
