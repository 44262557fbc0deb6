"""The work a fused attention kernel runs, as against the FLOPs counted for it.

``flop_counter``'s formula counts a kernel's whole square of scores, and MFU
counts those FLOPs; a causal kernel runs half of them, and the query shards of
a causal kernel split on the sequence (context parallelism) run unequal shares.
Kept apart from :mod:`autopar.cost_models.compute`, which counts FLOPs and
bytes and turns them into a roofline time, because these answers need no
device: the strategy pass reads them to know which kernels get head-tail twins
(:mod:`autopar.search.sharding.balanced_shards`), the graph's facts and the
sharding problem to charge each kernel and each of its query splits its share
(:mod:`autopar.search.sharding.problem`), and the roofline times that share at
the attention kernel's FLOP/s.

* :func:`attention_work`: a causal kernel skips the blocks above the diagonal,
  half the counted FLOPs (:data:`CAUSAL_WORK`); any other runs them all.
* :func:`causal_imbalance`: a causal kernel's split queries take as long as the
  busiest shard: the last of ``n`` contiguous shards, ``(2n - 1) / n`` times the
  mean; in head-tail order, where rank ``r`` of ``n`` holds chunks ``r`` and
  ``2n-1-r`` of ``2n``, every rank the mean.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def _argument(node: fx.Node, name: str) -> Any:
    """The value of argument ``name`` of an op node (positional or keyword, else its schema default)."""
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == name:
            if not arg.kwarg_only and i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, arg.default_value)
    return None


def is_attention_kernel(node: fx.Node) -> bool:
    """A fused attention op, forward or backward (SDPA's flash / efficient / cuDNN kernels, autopar's own)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    name = node.target._schema.name
    return "scaled_dot_product" in name or name.startswith("autopar::dropout_attention")


CAUSAL_WORK = 0.5  # the share of the counted FLOPs a causal kernel runs


def attention_work(node: fx.Node) -> float:
    """The fraction of a fused attention kernel's counted FLOPs it runs; 0 for any other op.

    A causal kernel skips the blocks above the diagonal of the scores: it runs
    half the FLOPs (FlashAttention's benchmarks count a causal kernel's FLOPs as
    half of ``flop_counter``'s, whose formula counts the whole square); any
    other runs them all.
    """
    if not is_attention_kernel(node):
        return 0.0
    return CAUSAL_WORK if _argument(node, "is_causal") is True else 1.0


def causal_imbalance(pieces: int, balanced: int = 1) -> float:
    """The busiest query shard's work over the mean, a causal kernel's queries cut in ``pieces`` contiguous
    shards of the sequence, each then split in head-tail order over ``balanced`` ranks (context parallelism).

    A query at position ``x`` (a fraction of the sequence) attends the keys up to
    it, so the queries in ``[x0, x1)`` do work in proportion to ``x1² - x0²``.
    Contiguous shard ``r`` of ``n`` does ``(2r + 1) / n²`` of the kernel's work: the
    last ``(2n - 1) / n`` times the mean, and every rank waits for it at the next
    collective.  In head-tail order (Megatron-LM's and torch's load balance) rank
    ``r`` of ``m`` holds chunks ``r`` and ``2m-1-r`` of ``2m``; the sum below gives
    each the mean, ``((2r + 1) + (4m - 2r - 1)) / (2m)²  = 1 / m``.
    """
    width, m = 1.0 / pieces, balanced
    chunks = [(0,)] if m == 1 else [(r, 2 * m - 1 - r) for r in range(m)]  # each rank's, in its block
    step = width / (1 if m == 1 else 2 * m)
    busiest = max(
        sum((b * width + (c + 1) * step) ** 2 - (b * width + c * step) ** 2 for c in held)
        for b in range(pieces)
        for held in chunks
    )
    return busiest * pieces * m
