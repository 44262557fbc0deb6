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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Placement, Shard

from autopar.core.placements import local_box
from autopar.ops.dropout_attention import causal_diagonal

aten = torch.ops.aten

# kernel -> (where its query is, where its is_causal flag is) among its positional arguments
CAUSAL_FLAG: dict[Any, tuple[int, int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (1, 7),
}


def causal_rows(sq: int, sk: int, diagonal: int, like: torch.Tensor) -> torch.Tensor:
    """A (sq, sk) additive mask in ``like``'s dtype (the CPU kernels take no other): 0 keeps key ``j`` for
    query ``i`` where ``j <= i + diagonal``, -inf drops it."""
    rows = torch.arange(sq, device=like.device).unsqueeze(-1)
    cols = torch.arange(sk, device=like.device).unsqueeze(0)
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(cols <= rows + diagonal, zero, torch.full((), float("-inf"), dtype=like.dtype, device=like.device))


def at_offset(
    target: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    whole: tuple[torch.Size, torch.Size],
    q_spec: Sequence[Placement],
    coord: Sequence[int],
    mesh_shape: Sequence[int],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``target``'s local arguments with its causal flag turned into this shard's mask, where it needs one.

    ``whole`` is the (query, key) shapes of the whole tensors; ``q_spec`` the query's
    placement on the mesh and ``coord`` this rank's coordinate.  Unchanged unless the
    kernel is causal and its query is split on the sequence (dim 2).
    """
    where = CAUSAL_FLAG.get(target)
    if where is None:
        return tuple(args), kwargs
    q_at, flag_at = where
    causal = args[flag_at] if len(args) > flag_at else kwargs.get("is_causal", False)
    if not causal or not any(isinstance(p, Shard) and p.dim == 2 for p in q_spec):
        return tuple(args), kwargs
    if kwargs.get("attn_mask") is not None:
        raise ValueError(f"{target}: is_causal with a mask tensor; SDPA takes one or the other")
    q_shape, k_shape = whole
    scores = [*q_shape[:-1], k_shape[-2]]
    local, offset = local_box(scores, q_spec, coord, mesh_shape)
    diagonal = causal_diagonal(local[-2], local[-1], scores, offset)
    mask = causal_rows(local[-2], local[-1], diagonal, args[q_at])
    new_args, new_kwargs = list(args), {**kwargs, "attn_mask": mask}
    if len(new_args) > flag_at:
        new_args[flag_at] = False
    else:
        new_kwargs["is_causal"] = False
    return tuple(new_args), new_kwargs
