"""Rules' answers made into strategies on the whole mesh, and the strategies kept.

The rules the strategy pass asks answer in two forms: rows of one placement per
mesh dim (DTensor's single-mesh-dim rules, autopar's own rules, DTensor's
decompositions), which :func:`expand_rows` combines across the mesh, and
DTensor's ``OpStrategy``, which :func:`from_op_strategy` reads back as autopar's
placements.  :func:`prune` then drops what no plan should hold.  None of this
walks the graph or asks a rule, which is what
:mod:`autopar.search.sharding.strategies` does; it is kept apart so that the
pass reads as the order in which rules are asked, and these conversions, which
depend only on the mesh's shape, can be read (and changed) on their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import placement_types as dt
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpStrategy

from autopar.core.placements import AVG, SUM, Placement, Placements, Row, from_dtensor
from autopar.search.sharding.node_strategies import Strategy
from autopar.search.sharding.placement_sets import canonical, divides

Shape = tuple[int, ...]


def plain(placements: Iterable[dt.Placement], mesh_shape: Shape, is_input: bool = False) -> Placements | None:
    """DTensor's placements as autopar's, canonical on the mesh; None where one has no autopar form."""
    out = []
    for p in placements:
        s = from_dtensor(p, is_input)
        if s is None:
            return None
        out.append(s)
    return canonical(tuple(out), mesh_shape)


def from_op_strategy(
    result: OpStrategy,
    op: torch._ops.OpOverload,
    n_in: int,
    out_shapes: list[Shape | None],
    mesh_shape: Shape,
) -> list[Strategy]:
    """The strategies of a DTensor ``OpStrategy`` for an op with ``n_in`` tensor inputs, those whose every
    placement autopar has."""
    n_out = len(out_shapes)
    strats: list[Strategy] = []
    for spec in result.strategies:
        o = spec.output_specs
        if isinstance(o, DTensorSpec):
            o_list: list[Any] = [o] * n_out if n_out > 1 else [o]
        elif isinstance(o, (tuple, list)):
            o_list = list(o)
        else:
            o_list = [None] * n_out
        if len(o_list) < n_out:
            o_list += [None] * (n_out - len(o_list))
        outs: list[Placements | None] = []
        ok = True
        for s, shape in zip(o_list, out_shapes, strict=False):
            if shape is None:
                outs.append(None)
                continue
            if not isinstance(s, DTensorSpec):
                ok = False
                break
            p = plain(s.placements, mesh_shape)
            if p is None:
                ok = False
                break
            outs.append(p)
        if not ok:
            continue
        i_specs = spec.input_specs
        if i_specs is None:
            i_specs = [o_list[0]] * n_in
        if len(i_specs) != n_in:
            raise ValueError(f"{op}: {len(i_specs)} input specs for {n_in} tensor inputs")
        ins: list[Placements | None] = []
        for s in i_specs:
            p = plain(s.placements, mesh_shape, is_input=True) if isinstance(s, DTensorSpec) else None
            if p is None and isinstance(s, DTensorSpec):
                ok = False
                break
            ins.append(p)
        if ok:
            strats.append(Strategy(tuple(outs), tuple(ins)))
    return strats


def mesh_rows(rows: list[Row], mesh_shape: Shape) -> Iterable[list[Placements | None]]:
    """Per-mesh-dim rules → full-mesh rows: one rule per mesh dim, every combination."""
    ndim = len(mesh_shape)
    for combo in itertools.product(rows, repeat=ndim):
        width = len(combo[0])
        row: list[Placements | None] = []
        bad = False
        for j in range(width):
            col = tuple(r[j] for r in combo)
            if all(c is None for c in col):
                row.append(None)
            elif any(c is None for c in col):
                bad = True
                break
            else:
                reductions = {c.reduce_op for c in col if c is not None and c.is_partial()}
                if len(reductions) > 1 and reductions != {SUM, AVG}:
                    bad = True  # DTensor has no tensor partial by max on one dim and sum on another
                    break
                row.append(canonical(col, mesh_shape))  # type: ignore[arg-type]
        if not bad:
            yield row


def expand_rows(rules: list[Row], n_out: int, out_shapes: list[Shape | None], mesh_shape: Shape) -> list[Strategy]:
    """The strategies of single-mesh-dim ``rules`` (``n_out`` outputs, then inputs) on the whole mesh; a
    non-tensor output (``out_shapes`` None) has no placement."""
    strats = []
    for row in mesh_rows(rules, mesh_shape):
        outs = tuple(row[:n_out])
        if len(outs) < len(out_shapes):
            outs += (None,) * (len(out_shapes) - len(outs))
        outs = tuple(p if s is not None else None for p, s in zip(outs, out_shapes, strict=False))
        strats.append(Strategy(outs, tuple(row[n_out:])))
    return strats


def partials_offered(candidates: Iterable[Placements]) -> set[tuple[int, Placement]]:
    """The (mesh dim, partial) pairs a producer with these candidate placements can hand over."""
    return {(d, p) for c in candidates for d, p in enumerate(c) if p.is_partial()}


def prune(
    strats: list[Strategy],
    offered: list[set[tuple[int, Placement]]],
    in_shapes: list[Shape],
    out_shapes: list[Shape | None],
    mesh_shape: Shape,
) -> list[Strategy]:
    """Drop strategies whose shards do not divide, invented partials, and exact duplicates.

    ``offered`` holds, per tensor input, the partials its producer can hand over
    (:func:`partials_offered`).  An *invented partial*: on some mesh dim the strategy wants inputs as partials
    of one kind, yet none of those inputs' producers can ever hand over that partial
    there and no input is sharded there, so each would be cut into pieces locally
    only for the op's result to be reduced later.  Computing on the whole inputs is never worse, so linear ops
    (whose DTensor rules list every partial kind) stop spreading P(avg) over rotary
    tables and masks.  A partial one input really brings (a row-parallel matmul's
    output) may still pull its partners along: that is the residual add of
    sequence parallelism.
    """
    ms = mesh_shape
    kept: dict[Strategy, None] = {}
    for s in strats:
        if len(s.inputs) != len(in_shapes):
            continue
        if any(
            p is not None and shape is not None and not divides(p, shape, ms)
            for p, shape in zip(s.outputs, out_shapes, strict=False)
        ):
            continue
        if any(
            p is not None and not divides(p, shape, ms)
            for p, shape in zip(s.inputs, in_shapes, strict=True)
        ):
            continue
        if invents_partial(s, offered):
            continue
        kept.setdefault(s, None)
    return list(kept)


def invents_partial(s: Strategy, offered: list[set[tuple[int, Placement]]]) -> bool:
    """Whether ``s`` wants a partial on a mesh dim that no input's producer offers there and no input is
    split on (:func:`prune`)."""
    wanted: dict[tuple[int, Placement], bool] = {}
    sharded: set[int] = set()
    for p, have in zip(s.inputs, offered, strict=True):
        if p is None:
            continue
        for d, q in enumerate(p):
            if q.is_partial():
                wanted[(d, q)] = wanted.get((d, q), False) or (d, q) in have
            elif q.is_shard():
                sharded.add(d)
    # A contraction over shards (addmm's row-parallel form) makes its own partial;
    # its bias, cut into a partial to be added once, is not an invention.
    return any(not real and d not in sharded for (d, _), real in wanted.items())
