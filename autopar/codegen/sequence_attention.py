"""A causal attention kernel on a query shard of the sequence: the mask at the shard's offset.

Context parallelism splits attention's queries on the sequence and gathers the
keys and values (:func:`autopar.search.sharding.strategy_rules.sequence_rows`).
A kernel told ``is_causal`` masks its local scores from the top-left corner,
which is the whole sequence's mask only for the shard at offset 0: the shard of
queries ``o .. o + n`` must keep keys ``0 .. o + i``.  The CPU flash kernels take
a mask tensor instead, so the sharding pass hands them this rank's rows of the
causal mask (built from ``arange``: nothing is communicated) and no flag.
``autopar::dropout_attention`` applies the offset itself, from the key the pass
gives it (:func:`autopar.ops.dropout_attention.causal_diagonal`).

A query shard in head-tail order (``B(2)``, context parallelism's load balance)
holds two runs of queries: the kernel runs once per run (:func:`on_pieces`),
each a contiguous shard at its own offset, and their outputs are joined: the
per-query ones (output, log-sum-exp, query gradient) concatenated, the key and
value gradients (sums over the queries) added.  Attention is independent per
query, so this is exact, and it keeps every kernel's own causal mask, dropout
key and mask rows as they are for a contiguous shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Placement

from autopar.core.placements import local_boxes
from autopar.ops.dropout_attention import causal_diagonal

aten = torch.ops.aten

# kernel -> (where its query is, where its is_causal flag is) among its positional arguments
CAUSAL_FLAG: dict[Any, tuple[int, int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (1, 7),
}

# kernel -> (where its per-query tensors are among its positional arguments, whether each output is per query
# (else a sum over the queries)); a mask passed as ``attn_mask`` is per query where it has the queries' rows
PER_QUERY: dict[Any, tuple[tuple[int, ...], tuple[bool, ...]]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: ((0,), (True, True)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ((0, 1, 4, 5), (True, False, False)),
    torch.ops.autopar.dropout_attention.default: ((0, 3), (True, True)),
    torch.ops.autopar.dropout_attention_backward.default: ((0, 1, 4, 5, 6), (True, False, False)),
}
SEQ = 2  # the queries' dim in every per-query tensor (batch, heads, seq, ...)

Box = tuple[list[int], list[int]]


def score_boxes(whole: tuple[torch.Size, torch.Size], q_spec: Sequence[Placement], coord, mesh_shape) -> list[Box]:
    """This rank's pieces of the kernel's score tensor (the query's leading dims, then the keys), in the order
    its query shard holds them: one for a contiguous shard, two in head-tail order."""
    q_shape, k_shape = whole
    return local_boxes([*q_shape[:-1], k_shape[-2]], q_spec, coord, mesh_shape)


def on_pieces(
    target: Any, args: Sequence[Any], kwargs: dict[str, Any], boxes: list[Box], run: Callable[..., Any]
) -> tuple[torch.Tensor, ...]:
    """``run(args, kwargs, box)`` (the kernel on one run of queries) once per piece of a query shard, the
    outputs joined: per-query ones concatenated on the sequence, the others added."""
    at, per_query = PER_QUERY[target]
    total = sum(box[0][SEQ] for box in boxes)
    outs, start = [], 0
    for box in boxes:
        rows = box[0][SEQ]

        def cut(x: Any, start: int = start, rows: int = rows) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() > SEQ and x.shape[SEQ] == total:
                return x.narrow(SEQ, start, rows)
            return x  # a mask broadcast over the queries

        piece_args = tuple(cut(x) if i in at else x for i, x in enumerate(args))
        piece_kwargs = {k: cut(v) if k == "attn_mask" else v for k, v in kwargs.items()}
        outs.append(run(piece_args, piece_kwargs, box))
        start += rows
    if len(outs) == 1:
        return outs[0]
    return tuple(
        torch.cat([o[i] for o in outs], SEQ) if per_query[i] else sum((o[i] for o in outs[1:]), outs[0][i])
        for i in range(len(outs[0]))
    )


def causal_rows(sq: int, sk: int, diagonal: int, like: torch.Tensor) -> torch.Tensor:
    """A (sq, sk) additive mask in ``like``'s dtype (the CPU kernels take no other): 0 keeps key ``j`` for
    query ``i`` where ``j <= i + diagonal``, -inf drops it."""
    rows = torch.arange(sq, device=like.device).unsqueeze(-1)
    cols = torch.arange(sk, device=like.device).unsqueeze(0)
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(cols <= rows + diagonal, zero, torch.full((), float("-inf"), dtype=like.dtype, device=like.device))


def run_causal(
    target: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    whole: tuple[torch.Size, torch.Size],
    q_spec: Sequence[Placement],
    coord: Sequence[int],
    mesh_shape: Sequence[int],
) -> Any:
    """A CPU flash kernel on this rank's query shard: once per piece of it, each with its rows of the mask.

    ``whole`` is the (query, key) shapes of the whole tensors; ``q_spec`` the query's
    placement on the mesh and ``coord`` this rank's coordinate.  A kernel that is not
    causal, or whose query is not split on the sequence (dim 2), keeps its flag.
    """
    split = _split(q_spec)

    def run(a: Sequence[Any], kw: dict[str, Any], box: Box) -> Any:
        a, kw = _masked(target, a, kw, whole, box, split)
        return target(*a, **kw)

    boxes = score_boxes(whole, q_spec, coord, mesh_shape)
    if len(boxes) == 1:
        return run(args, kwargs, boxes[0])
    return on_pieces(target, args, kwargs, boxes, run)


def _split(q_spec: Sequence[Any]) -> bool:
    """Whether ``q_spec`` (autopar's placements or DTensor's) splits the queries' sequence."""
    return any(p.is_shard(SEQ) for p in q_spec)


def _masked(
    target: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    whole: tuple[torch.Size, torch.Size],
    box: Box,
    split: bool,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a CPU flash kernel for the queries of score box ``box``: a causal flag turned into those
    rows of the whole mask where the queries are ``split`` (whole, the flag is right as it is)."""
    where = CAUSAL_FLAG.get(target)
    if where is None:
        return tuple(args), kwargs
    q_at, flag_at = where
    causal = args[flag_at] if len(args) > flag_at else kwargs.get("is_causal", False)
    if not causal or not split:
        return tuple(args), kwargs
    if kwargs.get("attn_mask") is not None:
        raise ValueError(f"{target}: is_causal with a mask tensor; SDPA takes one or the other")
    q_shape, k_shape = whole
    scores = [*q_shape[:-1], k_shape[-2]]
    local, offset = box
    diagonal = causal_diagonal(local[-2], local[-1], scores, offset)
    mask = causal_rows(local[-2], local[-1], diagonal, args[q_at])
    new_args, new_kwargs = list(args), {**kwargs, "attn_mask": mask}
    if len(new_args) > flag_at:
        new_args[flag_at] = False
    else:
        new_kwargs["is_causal"] = False
    return tuple(new_args), new_kwargs
