"""Attention with dropout as one fused op, drawing its mask from autopar's keyed random numbers.

``F.scaled_dot_product_attention(..., dropout_p > 0)`` runs on GPUs as one
fused kernel (flash / memory-efficient attention) that keeps no attention
matrix: the backward recomputes the probabilities from the log-sum-exp and the
dropout mask from the RNG's seed and offset.  Traced on CPU it decomposes into
the math path instead (scores, softmax, ``bernoulli`` on the whole
batch × heads × seq × seq matrix, two batched matmuls), which a plan would
then cost and keep in memory as if a GPU materialized it: for GPT-2 1.7B at
sequence 2048, several GB per layer that no GPU run holds.

Capture therefore writes attention with dropout as ``autopar::dropout_attention``
(returns the output and the log-sum-exp, as flash attention does) with its
backward ``autopar::dropout_attention_backward``: FLOPs, saved tensors and
sharding (batch or heads) those of flash attention.  Both draw the mask with
:func:`autopar.ops.rng.random_tensor` under the same key, the last four arguments
(op number, the shape of the whole batch's score tensor, this shard's offset
into it, the mesh stream): the sharding pass fills them in per rank, as for
any random op (:mod:`autopar.search.sharding.random_ops`), so the backward regenerates
the forward's mask, any plan draws what the plan says, and under
``rng="exact"`` what one device draws.  Here on CPU both are computed by the
math path; the memory they use at run time is the math path's.
"""

from __future__ import annotations

import math

import torch
from torch.utils import flop_counter

from autopar.ops import rng  # noqa: F401  (registers torch.ops.autopar.random)

KEY_ARGS = ("op", "global_shape", "offset", "stream")  # the draw's key: filled in per rank when sharded


def _expand_kv(q: torch.Tensor, t: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
    """Key or value heads repeated to the query's (grouped-query attention)."""
    if enable_gqa and t.shape[-3] != q.shape[-3]:
        return t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3)
    return t


def causal_diagonal(sq: int, sk: int, global_shape: list[int], offset: list[int]) -> int:
    """The diagonal of ``tril`` that keeps a causal mask's part for a shard of the score tensor.

    The whole mask keeps key ``j`` for query ``i`` where ``j <= i + SK - SQ``
    (SDPA's alignment to the bottom right); a shard starting at query ``o_q`` and
    key ``o_k`` keeps local ``(i, j)`` where ``j <= i + o_q - o_k + SK - SQ``.  Without
    a key (``global_shape`` empty) the shard is the whole tensor.
    """
    if not global_shape:
        return sk - sq
    return int(offset[-2]) - int(offset[-1]) + int(global_shape[-1]) - int(global_shape[-2])


def _scores(q, k, attn_mask, is_causal, scale, global_shape=(), offset=()) -> torch.Tensor:
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * s
    sq, sk = scores.shape[-2], scores.shape[-1]
    if is_causal:
        diagonal = causal_diagonal(sq, sk, list(global_shape), list(offset))
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    return scores


def _keep_mask(shape, p, device, op, global_shape, offset, stream) -> torch.Tensor:
    whole = list(global_shape) if global_shape else list(shape)
    start = list(offset) if offset else [0] * len(shape)
    u = torch.ops.autopar.random(list(shape), torch.float32, device, op, whole, start, list(stream), False)
    return u < 1.0 - p


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities from the scores and their log-sum-exp (zero where a row is all masked)."""
    finite = torch.isfinite(lse).unsqueeze(-1)
    return torch.where(finite, torch.exp(scores - lse.unsqueeze(-1)), torch.zeros((), device=scores.device))


@torch.library.custom_op("autopar::dropout_attention", mutates_args=())
def dropout_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    op: int,
    global_shape: list[int],
    offset: list[int],
    stream: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp of the scores) of attention whose probabilities are dropped with ``dropout_p``."""
    k, v = _expand_kv(query, key, enable_gqa), _expand_kv(query, value, enable_gqa)
    scores = _scores(query, k, attn_mask, is_causal, scale, global_shape, offset)
    lse = torch.logsumexp(scores, dim=-1)
    keep = _keep_mask(scores.shape, dropout_p, query.device, op, global_shape, offset, stream)
    probs = _probs(scores, lse) * keep / (1.0 - dropout_p)
    return torch.matmul(probs, v.float()).to(query.dtype).contiguous(), lse.contiguous()


@dropout_attention.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, op, global_shape, offset, stream):  # noqa: ANN001, ANN202
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("autopar::dropout_attention_backward", mutates_args=())
def dropout_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    op: int,
    global_shape: list[int],
    offset: list[int],
    stream: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`dropout_attention`: probabilities from the log-sum-exp, the mask drawn again."""
    k, v = _expand_kv(query, key, enable_gqa), _expand_kv(query, value, enable_gqa)
    s = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = _scores(query, k, attn_mask, is_causal, scale, global_shape, offset)
    probs = _probs(scores, logsumexp)
    keep = _keep_mask(scores.shape, dropout_p, query.device, op, global_shape, offset, stream)
    dropped = probs * keep / (1.0 - dropout_p)
    g = grad_out.float()
    dv = torch.matmul(dropped.transpose(-2, -1), g)
    d_dropped = torch.matmul(g, v.float().transpose(-2, -1))
    d_probs = d_dropped * keep / (1.0 - dropout_p)
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
    dq = torch.matmul(d_scores, k.float()) * s
    dk = torch.matmul(d_scores.transpose(-2, -1), query.float()) * s
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        dk = dk.unflatten(-3, (key.shape[-3], groups)).sum(-3)
        dv = dv.unflatten(-3, (key.shape[-3], groups)).sum(-3)
    return tuple(g.to(t.dtype).contiguous() for g, t in ((dq, query), (dk, key), (dv, value)))


@dropout_attention_backward.register_fake
def _(grad_out, query, key, value, out, logsumexp, attn_mask, dropout_p, is_causal, scale, enable_gqa, op, global_shape, offset, stream):  # noqa: ANN001, ANN202, E501
    # dense, as the real kernel returns them (a fake of another layout would mislead the views after it)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    query, key, value, attn_mask, *rest = inputs
    ctx.save_for_backward(query, key, value, attn_mask, *output)
    ctx.rest = rest


def _backward(ctx, grad_out, grad_lse):  # noqa: ANN001, ANN202
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.autopar.dropout_attention_backward(
        grad_out, query, key, value, out, lse, attn_mask, *ctx.rest
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


dropout_attention.register_autograd(_backward, setup_context=_setup)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with dropout, as the fused op (key unset: the whole tensor, op 0)."""
    return torch.ops.autopar.dropout_attention(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa), 0, [], [], []
    )[0]


# FLOPs: those of flash attention, whose formulas read (query, key, value) and (grad_out, query, key, value)
flop_counter.register_flop_formula(torch.ops.autopar.dropout_attention)(
    lambda q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(q, k, v)
)
flop_counter.register_flop_formula(torch.ops.autopar.dropout_attention_backward)(
    lambda g, q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_backward_flop_count(g, q, k, v)
)
