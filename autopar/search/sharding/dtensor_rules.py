"""DTensor's sharding rules as the strategy pass reads them.

Which rule an op has (its own, its in-place twin's, or one traced through its
decomposition), the rows a decomposition gives, which ops DTensor runs on the
local shards unchanged, and a gate that stops DTensor's
rules from pricing redistributions the pass throws away.  Kept apart from
:mod:`autopar.search.sharding.strategies`, which walks the graph, because
these lean on DTensor's private registry and change with torch releases.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.tensor._ops.utils as dt_utils
import torch.fx as fx
from torch._decomp import decomposition_table
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import placement_types as dt
from torch.distributed.tensor._decompositions import DecompShardingStrategy
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy
from torch.utils import _pytree as pytree

from autopar.core.placements import Row, from_dtensor
from autopar.search.sharding import strategy_rules
from autopar.search.sharding.node_keys import tensor_meta

_quiet = threading.local()


@functools.cache
def _install_cost_gate() -> None:
    """Let DTensor's rules skip pricing redistributions while this pass runs.

    Every DTensor strategy function prices, for each strategy, the move from each
    candidate input placement (``generate_redistribute_costs``): about 85% of the
    time here, for numbers this pass throws away (autopar's own cost models price
    moves on the real links).  The gate wraps the one function those prices come
    from and answers 0.0 only on a thread inside :func:`costs_off`;
    everyone else (DTensor running for real, other threads) gets the original.
    """
    original = dt_utils.redistribute_cost

    @functools.wraps(original)
    def gated(current: DTensorSpec, target: DTensorSpec, *args: Any, **kwargs: Any) -> float:
        mode = getattr(_quiet, "on", False)
        if mode == "match":  # a placement on a mesh dim of one device moves nothing, as DTensor prices it
            if current.placements == target.placements:
                return 0.0
            sizes = current.mesh.shape
            pairs = zip(current.placements, target.placements, strict=True)
            return float(sum(a != b and sizes[i] > 1 for i, (a, b) in enumerate(pairs)))
        if mode:
            return 0.0
        return original(current, target, *args, **kwargs)

    dt_utils.redistribute_cost = gated


@contextlib.contextmanager
def costs_off(mode: bool | str = True) -> Iterator[None]:
    """DTensor's rules price no redistribution on this thread while inside (see :func:`_install_cost_gate`).

    ``mode="match"``: a move costs the number of mesh dims whose placements differ, so that
    DTensor, dispatching an op whose inputs are laid out as one of its strategies reads them, picks that
    strategy, as it would on real prices, without computing them (what :mod:`autopar.codegen.shard_interpreter` needs).
    """
    _install_cost_gate()
    before = getattr(_quiet, "on", False)
    _quiet.on = mode
    try:
        yield
    finally:
        _quiet.on = before


def with_rule(op: torch._ops.OpOverload, prop: Any) -> torch._ops.OpOverload:
    """``op``, or its in-place twin when only the twin has a DTensor rule (``copy`` → ``copy_``).

    Functionalization turns a model's in-place ops into their functional forms,
    for some of which DTensor registers only the in-place op.  Both compute the
    same values, so the in-place op's placements hold for the functional one.
    """
    ruled = (prop.op_single_dim_strategy_funcs, prop.op_strategy_funcs)
    if any(op in r for r in ruled):
        return op
    packet = getattr(torch.ops.aten, f"{op._schema.name.split('::')[-1]}_", None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    return twin if twin is not None and any(twin in r for r in ruled) else op


@functools.cache
def dispatches_unchanged(op: Any) -> bool:
    """Whether DTensor dispatches ``op``, on inputs laid out as one of its strategies reads them, as the op run on
    the local shards with its arguments as given, its outputs in that strategy's placements.

    So the sharding interpreter (:mod:`autopar.codegen.shard_interpreter`) runs such an op on the shards itself and skips
    DTensor enumerating its strategies again (about half of tracing a rank's graph). Not so for an op DTensor
    has no rule of its own for (it decomposes it or refuses), one it hands to a custom handler or treats as
    random, one whose size or shape arguments it rewrites to local ones (views, factories, squeeze, group
    norm's sizes), or one returning anything but tensors.
    """
    if not isinstance(op, torch._ops.OpOverload):
        return False
    dispatcher = DTensor._op_dispatcher
    prop = dispatcher.sharding_propagator
    if op not in prop.op_strategy_funcs and op not in prop.op_single_dim_strategy_funcs:
        return False
    rewritten = (
        prop.op_to_shape_and_stride_idx,
        prop.op_to_scalar_shape_adjuster,
        prop.squeeze_op_to_dims_variant,
        dispatcher._custom_op_handlers,
        dispatcher._random_ops,
    )
    if any(op in table for table in rewritten) or op is torch.ops.aten._local_scalar_dense.default:
        return False
    returns = op._schema.returns
    return bool(returns) and all(str(r.type) in ("Tensor", "List[Tensor]", "Tensor[]") for r in returns)


@functools.cache
def decomposition(op: Any) -> Any:
    """The decomposition ``op``'s strategies come from, when neither DTensor (for it or its in-place twin) nor
    autopar has a rule for it; else None.

    Those strategies hold for the decomposition run on DTensors, whose ops see
    the whole tensor's sizes (``mse_loss_backward``'s ``2 / numel``), not for
    ``op`` run on each shard as DTensor's dispatch then does: the sharding
    interpreter runs the decomposition.
    """
    if not isinstance(op, torch._ops.OpOverload) or strategy_rules.rule_for(op) is not None:
        return None
    prop = DTensor._op_dispatcher.sharding_propagator
    twin = with_rule(op, prop)
    if twin in prop.op_single_dim_strategy_funcs or twin in prop.op_strategy_funcs:
        return None
    if not DecompShardingStrategy.has_decomp(op):
        return None
    return decomposition_table.get(op, op.decompose)


def decomposition_rows(
    prop: Any, mesh: DeviceMesh, schema: OpSchema, op: torch._ops.OpOverload, inputs: list[fx.Node]
) -> tuple[list[Row], int] | None:
    """DTensor's decomposition path: trace the op's decomposition per input placement.

    Its public entry wants one runtime placement per input; we give each input a
    spec whose placements seed the option set it explores (R, P and every shard).
    """
    if not DecompShardingStrategy.has_decomp(op):
        return None
    decomp = prop.decomp_strategy
    decomp.ensure_schema_info(op)
    fake = decomp._get_fake_mesh("cpu")
    metas = [tensor_meta(a.meta["val"]) for a in inputs]

    def spec_of(a: Any) -> Any:
        if isinstance(a, OpStrategy):
            return DTensorSpec(
                mesh,
                (dt.Replicate(),) * mesh.ndim,
                tensor_meta=a.strategies[0].output_spec.tensor_meta,
            )
        if isinstance(a, TupleStrategy):
            return [spec_of(c) for c in a.children]
        if isinstance(a, list):
            return [spec_of(c) for c in a]
        return a

    spec_schema = OpSchema(
        op,
        tuple(spec_of(a) for a in schema.args_schema),
        {k: spec_of(v) for k, v in schema.kwargs_schema.items()},
        schema_info=prop.op_to_schema_info.get(op),
    )
    options: list[list[dt.Placement]] = []
    for m in metas:
        opts: list[dt.Placement] = [dt.Replicate(), dt.Partial()]
        opts += [dt.Shard(d) for d in range(len(m.shape)) if m.shape[d] > 1]
        options.append(opts)
    # DTensor reads one placement per argument leaf, tensor or not (``floor_divide(x, 2)``): None for the rest
    leaves = pytree.tree_leaves((spec_schema.args_schema, spec_schema.kwargs_schema))
    is_spec = [isinstance(leaf, DTensorSpec) for leaf in leaves]
    if sum(is_spec) != len(metas):
        return None
    rows: list[Row] = []
    for combo in itertools.product(*options):
        tensors = iter(combo)
        per_leaf = tuple(next(tensors) if s else None for s in is_spec)
        try:
            res = decomp._propagate_through_decomp(spec_schema, per_leaf, fake)
        except NotImplementedError:
            return None
        except Exception:
            continue
        res_t = res if isinstance(res, tuple) else (res,)
        n_res = len(res_t)
        row = [
            from_dtensor(p, j >= n_res) if p is not None else None
            for j, p in enumerate((*res_t, *combo))
        ]
        if any(r is None and p is not None for r, p in zip(row, (*res_t, *combo), strict=True)):
            continue
        rows.append(row)
    if not rows:
        return None
    return rows, len(rows[0]) - len(metas)
