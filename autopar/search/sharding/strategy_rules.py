"""autopar's own sharding rules, for ops DTensor has no (useful) rule for.

A rule takes the fx node and returns *single-mesh-dim* rows: each row lists a
placement (R, S(d), P, or None for a non-tensor slot) for every
output, then for every tensor input in the order :func:`node_keys.tensor_inputs`
gives them.  :mod:`autopar.search.sharding.strategies` expands the rows across the mesh
(one row per mesh dim, every combination) and drops those whose shards do not
divide, exactly as it does for DTensor's single-dim rules.  The all-R row must
be listed: nothing is added implicitly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from autopar.core.placements import PARTIAL as P
from autopar.core.placements import REPLICATE as R
from autopar.core.placements import Placement, Row
from autopar.core.placements import shard as S
from autopar.ops import batch_norm  # noqa: F401  (registers torch.ops.autopar.batch_norm_*)
from autopar.ops import experts as experts_op  # noqa: F401  (registers torch.ops.autopar.experts*)
from autopar.search.sharding import random_ops
from autopar.search.sharding.node_keys import tensor_inputs

aten = torch.ops.aten

# The rows below spell placements R, S(d), P, as plans print them.


def _mask_placement(mask: object, dim: int) -> Placement:
    """Placement of an attention mask when q/k/v are sharded on ``dim``.

    A mask broadcast along that dim (size 1 there) stays whole on every rank.
    """
    if isinstance(mask, fx.Node):
        v = mask.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == 4 and v.shape[dim] != 1:
            return S(dim)
    return R


def _masks(node: fx.Node) -> list[object]:
    m = node.kwargs.get("attn_mask")
    return [m] if isinstance(m, fx.Node) else []


def sdpa_flash_cpu(node: fx.Node) -> list[Row]:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, ...) -> (out, logsumexp)``.

    q/k/v/out are (batch, heads, seq, head_dim) and logsumexp (batch, heads, seq):
    attention is independent per batch element and per head, so both shard on
    dim 0 or dim 1 with no communication (heads on dim 1 is Megatron's attention
    split); and per query, so the queries' sequence shards with the keys and
    values whole (context parallelism: :func:`sequence_rows`).
    """
    masks = _masks(node)
    rows: list[Row] = [[R, R, R, R, R] + [R] * len(masks)]
    for d in (0, 1):
        s = S(d)
        rows.append([s, s, s, s, s] + [_mask_placement(m, d) for m in masks])
    return rows + sequence_rows(2, 0, 3, masks)


def sdpa_flash_cpu_backward(node: fx.Node) -> list[Row]:
    """``..._for_cpu_backward(grad_out, q, k, v, out, logsumexp, ...) -> (dq, dk, dv)``.

    Same independence as the forward: batch or heads sharded throughout, or all R.
    """
    masks = _masks(node)
    rows: list[Row] = [[R] * (3 + 6 + len(masks))]
    for d in (0, 1):
        s = S(d)
        rows.append([s] * 9 + [_mask_placement(m, d) for m in masks])
    return rows + sequence_rows(3, 1, 6, masks)


def sequence_rows(outputs: int, grad_outs: int, inputs: int, masks: list[object]) -> list[Row]:
    """Context parallelism's row of an attention kernel: the queries split on the sequence (dim 2), the keys
    and values whole (every rank gathers them), and the mask's rows of this rank's queries.

    Exact on local shards: each query attends every key, so a query shard's output,
    log-sum-exp and gradient are those of its rows.  The forward is ``(out, lse, q, k, v)``;
    the backward ``(dq, dk, dv, grad_out, q, k, v, out, lse)``, whose key and value
    gradients sum over the queries: partial sums (reduce-scattered to the keys' shards,
    as torch's all-gather context parallelism does).  A causal mask passed as a flag
    (``is_causal``) is applied at the shard's offset by the sharding pass
    (:mod:`autopar.codegen.sequence_attention`); a mask tensor is split with the queries.
    ``outputs`` counts the kernel's outputs, ``grad_outs`` its leading gradient inputs and
    ``inputs`` its tensor inputs before the mask.
    """
    seq = S(2)
    if outputs == 2:  # forward: out, lse | q, k, v
        row: Row = [seq, seq, seq, R, R]
    else:  # backward: dq, dk, dv | grad_out, q, k, v, out, lse
        row = [seq, P, P] + [seq] * grad_outs + [seq, R, R, seq, seq]
    return [row + [_mask_placement(m, 2) for m in masks]]


def _positional_mask(node: fx.Node, index: int) -> list[object]:
    m = node.args[index] if len(node.args) > index else None
    return [m] if isinstance(m, fx.Node) else []


def _batch_or_heads(node: fx.Node, tensors: int, mask_at: int) -> list[Row]:
    """All R, or ``tensors`` outputs and inputs sharded on batch (dim 0) or heads (dim 1), then the mask."""
    masks = _positional_mask(node, mask_at)
    rows: list[Row] = [[R] * (tensors + len(masks))]
    for d in (0, 1):
        rows.append([S(d)] * tensors + [_mask_placement(m, d) for m in masks])
    backward = tensors == 9
    return rows + sequence_rows(3 if backward else 2, int(backward), 6 if backward else 3, masks)


def dropout_attention(node: fx.Node) -> list[Row]:
    """``autopar::dropout_attention(q, k, v, mask, ...) -> (out, logsumexp)``: as flash attention.

    Independent per batch element and per head, and its dropout mask is
    drawn per element of the score tensor by the shard that computes it.
    """
    return _batch_or_heads(node, 5, 3)


def dropout_attention_backward(node: fx.Node) -> list[Row]:
    """``autopar::dropout_attention_backward(grad_out, q, k, v, out, logsumexp, mask, ...) -> (dq, dk, dv)``."""
    return _batch_or_heads(node, 9, 6)


def batch_norm_sums(node: fx.Node) -> list[Row]:
    """``autopar::batch_norm_sums(x) -> (Σx, Σx²)`` per channel (dim 1 of x).

    A split of any other dim of x (batch, space) makes partial sums, which the
    statistics all-reduce: SyncBatchNorm's 2·C numbers.  A channel split keeps
    the sums split.
    """
    dims = [d for d in range(node.args[0].meta["val"].dim()) if d != 1]
    return [[R, R, R], [S(0), S(0), S(1)]] + [[P, P, S(d)] for d in dims]


def _tensors_at(node: fx.Node, *indices: int) -> int:
    """How many of the optional arguments at ``indices`` are tensors (weight, bias)."""
    return sum(isinstance(node.args[i], fx.Node) for i in indices)


def batch_norm_apply(node: fx.Node) -> list[Row]:
    """``autopar::batch_norm_apply(x, mean, invstd, weight?, bias?, n) -> y``: element-wise, per channel.

    A split of a non-channel dim of x with the per-channel vectors whole, or a
    channel split with the vectors split alike.
    """
    dims = [d for d in range(node.args[0].meta["val"].dim()) if d != 1]
    vectors = 2 + _tensors_at(node, 3, 4)
    rows: list[Row] = [[R, R] + [R] * vectors, [S(1), S(1)] + [S(0)] * vectors]
    return rows + [[S(d), S(d)] + [R] * vectors for d in dims]


def batch_norm_backward_reduce(node: fx.Node) -> list[Row]:
    """``autopar::batch_norm_backward_reduce(grad, x, mean) -> (Σgrad, Σgrad·(x − mean))`` per channel.

    Partial sums under a split of a non-channel dim of grad and x, split sums under a channel split.
    """
    dims = [d for d in range(node.args[1].meta["val"].dim()) if d != 1]
    rows: list[Row] = [[R] * 5, [S(0), S(0), S(1), S(1), S(0)]]
    return rows + [[P, P, S(d), S(d), R] for d in dims]


def batch_norm_backward_elemt(node: fx.Node) -> list[Row]:
    """``autopar::batch_norm_backward_elemt(grad, x, mean, invstd, weight?, Σgrad, Σgrad·(x − mean), n) -> dx``.

    Element-wise in grad and x given the whole batch's sums: as :func:`batch_norm_apply`.
    """
    dims = [d for d in range(node.args[1].meta["val"].dim()) if d != 1]
    vectors = 4 + _tensors_at(node, 4)
    rows: list[Row] = [[R] * (3 + vectors), [S(1), S(1), S(1)] + [S(0)] * vectors]
    return rows + [[S(d)] * 3 + [R] * vectors for d in dims]


def copy(node: fx.Node) -> list[Row]:
    """``aten.copy(self, src) -> out``: ``src``'s values in ``self``'s shape, what an in-place ``copy_``
    into a buffer becomes once functionalized.  Element-wise when the shapes agree; else whole.
    """
    out, src = node.meta["val"], node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
    rows: list[Row] = [[R, R, R]]
    if isinstance(src, torch.Tensor) and tuple(src.shape) == tuple(out.shape):
        rows += [[S(d)] * 3 for d in range(out.dim())]
    return rows


def fill_tensor(node: fx.Node) -> list[Row]:
    """``fill.Tensor(self, value) -> out``: ``self``'s shape, every element ``value`` (a 0-dim tensor).

    The functional form of ``x[..., 0] = t`` (T5's and BART's shift of the labels
    into decoder inputs). Each shard of ``self`` is filled whole from the replicated
    value, so the output takes any placement of ``self`` (DTensor has a rule for
    ``fill_.Scalar`` only, and ``fill.Tensor``'s decomposition goes through ``copy``).
    """
    dims = node.args[0].meta["val"].dim()
    return [[R, R, R]] + [[S(d), S(d), R] for d in range(dims)]


def grouped_mm(node: fx.Node) -> list[Row]:
    """A grouped matmul ``(input (S, K), weight (E, K, N), offs (E,)) -> (S, N)``: ``input``'s rows, grouped
    by the cumulative counts ``offs``, each times its expert's ``weight[e]``.

    HuggingFace's mixture-of-experts layers run it as ``transformers::grouped_mm_fallback``
    when traced in fp32. DTensor's rule for ``aten._grouped_mm`` (2-D x 3-D), which
    computes the same: whole; ``N`` split (column parallel); ``K`` split (a partial
    sum); a partial input or weight (linear in each). The rows (tokens) cannot be split:
    ``offs`` counts them over the whole input.
    """
    return [
        [R, R, R, R],
        [S(1), R, S(2), R],
        [P, S(1), S(1), R],
        [P, P, R, R],
        [P, R, P, R],
    ]


def grouped_mm_backward(node: fx.Node) -> list[Row]:
    """``(input, weight, offs, grad_out) -> (grad_input (S, K), grad_weight (E, K, N))`` of :func:`grouped_mm`.

    ``N`` split: ``grad_input = grad_out · weightᵀ`` sums over ``N`` (a partial) and
    ``grad_weight`` is split on ``N``; ``K`` split: both split on ``K``; a partial
    ``grad_out`` gives partial gradients (linear in it).
    """
    return [
        [R, R, R, R, R, R],
        [P, S(2), R, S(2), R, S(1)],
        [S(1), S(1), S(1), S(1), R, R],
        [P, P, R, R, R, P],
    ]


def experts(node: fx.Node) -> list[Row]:
    """``autopar::experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k), gate_up (E, 2I, H),
    down (E, H, I)) -> (T, H)``: each token through its top-k experts, dropless.

    Tokens are independent: split them (data parallel, the experts whole on every
    rank), or split them *and* the experts on the same mesh axis: expert
    parallelism, each rank computing its experts for every rank's tokens, which
    the op's expert-parallel form sends and brings back by all-to-all
    (:mod:`autopar.ops.experts`).  Linear in the routing weights: a partial sum of them.
    The experts' intermediate dim is not split: [gate; up] are concatenated on it.
    """
    return [
        [R, R, R, R, R, R],
        [S(0), S(0), S(0), S(0), R, R],
        [S(0), S(0), S(0), S(0), S(0), S(0)],
        [P, R, R, P, R, R],
    ]


def experts_backward(node: fx.Node) -> list[Row]:
    """``(grad, hidden, top_k_index, top_k_weights, gate_up, down) -> (grad_hidden, grad_weights,
    grad_gate_up, grad_down)`` of :func:`experts`: the tokens' split splits the token gradients and makes
    the experts' gradients partial sums; expert parallel, each rank's experts' gradients are whole
    (every token of the axis that chose them came to it); linear in ``grad``."""
    return [
        [R, R, R, R, R, R, R, R, R, R],
        [S(0), S(0), P, P, S(0), S(0), S(0), S(0), R, R],
        [S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0)],
        [P, P, P, P, P, R, R, R, R, R],
    ]


def elementwise(node: fx.Node) -> list[Row]:
    """An element-wise op DTensor has no rule for (activation backwards such as MobileNet's
    ``hardswish_backward``): every output and tensor input split alike on any dim of the outputs' shape, an
    input broadcast along it (size 1 there, or fewer dims) whole; else all whole."""
    outs = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
    outs = [t for t in outs if isinstance(t, torch.Tensor)]
    ins = [a.meta["val"] for a in tensor_inputs(node)]
    rows: list[Row] = [[R] * (len(outs) + len(ins))]
    shape = tuple(outs[0].shape)
    if any(tuple(t.shape) != shape for t in outs):
        return rows
    for d in range(len(shape)):
        if shape[d] == 1:
            continue
        row: Row = [S(d)] * len(outs)
        for t in ins:
            at = d - (len(shape) - t.dim())  # the input's dim broadcast against ``d``
            row.append(R if at < 0 or t.shape[at] == 1 else S(at) if t.shape[at] == shape[d] else None)
        if None not in row:
            rows.append(row)
    return rows


def prelu_backward(node: fx.Node) -> list[Row]:
    """``_prelu_kernel_backward(grad, x, weight) -> (grad_x, grad_weight)``, both of ``x``'s shape (the sum
    over the weight's broadcast dims comes after): element-wise, the weight whole where it is broadcast; or
    partial sums of ``grad`` giving partial sums of both (they are linear in it)."""
    return elementwise(node) + [[P, P, P, R, R]]


def stack(node: fx.Node) -> list[Row]:
    """``stack(tensors, dim)``: every input split alike on any dim, the output split on that dim (one further
    on past the new one), or all partial sums, or all whole.

    DTensor's rule follows one input's placement and offers a single strategy
    for many inputs: a GRU's per-step outputs stacked on time came out split on
    the batch only, which the flatten after it cannot keep.
    """
    ins = tensor_inputs(node)
    rank = ins[0].meta["val"].dim()
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = dim + rank + 1 if dim < 0 else dim
    rows: list[Row] = [[R] * (1 + len(ins)), [P] * (1 + len(ins))]
    rows += [[S(d if d < dim else d + 1)] + [S(d)] * len(ins) for d in range(rank)]
    return rows


def scan(node: fx.Node) -> list[Row]:
    """``cumsum`` / ``cumprod`` / ``logcumsumexp`` (input, dim): output and input split alike on any dim but the
    scanned one, or whole.

    DTensor's rule (``scan_strategy``, torch 2.13) compares shard dims with ``dim`` as written: a scan over
    ``dim=-1`` kept its input split along that very dim, and each rank scanned only its own part (Mamba-2's
    chunked scan, 1e-2 off in its gradients).
    """
    (source,) = tensor_inputs(node)
    rank = source.meta["val"].dim()
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    return [[R, R]] + _split_beside(dim, rank, tuple(node.meta["val"].shape))


def _split_beside(dim: int, rank: int, sizes: tuple[int, ...]) -> list[Row]:
    """An op of one input and one output over ``dim``: both split alike on any other dim."""
    dim = dim + rank if dim < 0 else dim
    return [[S(d), S(d)] for d in range(rank) if d != dim and sizes[d] > 1]


def _window_rows(dim: int, rank: int, sizes: tuple[int, ...]) -> list[Row]:
    """A window op's rows: its two tensors split alike on any dim but the windowed one, partial sums, or whole."""
    return [[R, R], [P, P]] + _split_beside(dim, rank, sizes)


def unfold(node: fx.Node) -> list[Row]:
    """``unfold(x, dim, size, step)``, the view of ``x``'s windows along ``dim`` (a new last dim holds each
    window): split on any other dim, each rank's windows are its own rows'; a partial sum's windows are
    partial sums. The windows cross a split of ``dim`` itself."""
    (source,) = tensor_inputs(node)
    return _window_rows(node.args[1], source.meta["val"].dim(), tuple(source.meta["val"].shape))


def unfold_backward(node: fx.Node) -> list[Row]:
    """``unfold_backward(grad, input_sizes, dim, size, step)``: the windows' gradients added back into
    ``input_sizes``; split as :func:`unfold`. ``input_sizes`` are the whole input's: a rank runs it with its
    shard's (:data:`LOCAL_ARGUMENTS`)."""
    sizes = tuple(node.args[1])
    return _window_rows(node.args[2], len(sizes), sizes)


def _unfold_backward_sizes(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A rank's ``input_sizes``: its gradient's (windows dropped, the windowed dim whole)."""
    grad, sizes, dim, *rest = args
    local = list(grad.shape[:-1])
    local[dim] = sizes[dim]
    return (grad, local, dim, *rest), kwargs


def weight_norm_backward(node: fx.Node) -> list[Row]:
    """``_weight_norm_interface_backward(grad_w, v, g, norms, dim) -> (grad_v, grad_g)``, the backward of
    ``weight_norm``'s ``w = g * v / ||v||`` (norms over every dim but ``dim``): split alike on ``dim``, each
    rank's norms its own rows'; or partial sums of ``grad_w`` giving partial sums of both gradients (they are
    linear in it); or whole. The forward's rows are DTensor's."""
    v = tensor_inputs(node)[1].meta["val"]
    dim = node.args[4] if len(node.args) > 4 else node.kwargs["dim"]
    dim = dim + v.dim() if dim < 0 else dim
    return [[R] * 6, [S(dim)] * 6, [P, P, P, R, R, R]]


# pooling backwards without a DTensor rule (DTensor has the forwards'), by the spatial dims they pool over
POOL_BACKWARDS = {
    aten.avg_pool2d_backward.default: 2,
    aten.avg_pool3d_backward.default: 3,
    aten.max_pool3d_with_indices_backward.default: 3,
    aten.adaptive_max_pool2d_backward.default: 2,
    aten.adaptive_max_pool3d_backward.default: 3,
    aten._adaptive_avg_pool3d_backward.default: 3,
}


def pool_backward(node: fx.Node) -> list[Row]:
    """A pooling op's backward ``(grad_output, self[, indices]) -> grad_input``: split alike on the batch or
    the channels (each plane pooled alone; a max pool's indices count inside a plane), or partial sums of
    ``grad_output`` giving partial sums (it is linear in them; ``self`` and the indices whole), or whole."""
    ins = tensor_inputs(node)
    rows: list[Row] = [[R] * (1 + len(ins)), [S(0)] * (1 + len(ins)), [P, P] + [R] * (len(ins) - 1)]
    if ins[1].meta["val"].dim() == POOL_BACKWARDS[node.target] + 2:  # batched: (N, C, *spatial)
        rows.append([S(1)] * (1 + len(ins)))
    return rows


# ops whose non-tensor arguments name whole sizes: a rank runs them with its shards' (args, kwargs) -> same
LOCAL_ARGUMENTS: dict[object, Callable[[tuple, dict], tuple[tuple, dict]]] = {
    aten.unfold_backward.default: _unfold_backward_sizes,
}


# element-wise ops with neither a DTensor rule nor a decomposition DTensor can trace
ELEMENTWISE = (
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.hardtanh_backward.default,
    aten.log_sigmoid_forward.default,
    aten.log_sigmoid_backward.default,
)


RULES: dict[object, Callable[[fx.Node], list[Row]]] = {
    torch.ops.autopar.experts.default: experts,
    torch.ops.autopar.experts_backward.default: experts_backward,
    aten.copy.default: copy,
    torch.ops.autopar.batch_norm_sums.default: batch_norm_sums,
    torch.ops.autopar.batch_norm_apply.default: batch_norm_apply,
    torch.ops.autopar.batch_norm_backward_reduce.default: batch_norm_backward_reduce,
    torch.ops.autopar.batch_norm_backward_elemt.default: batch_norm_backward_elemt,
    torch.ops.autopar.dropout_attention.default: dropout_attention,
    torch.ops.autopar.dropout_attention_backward.default: dropout_attention_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: sdpa_flash_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: sdpa_flash_cpu_backward,
    aten.fill.Tensor: fill_tensor,
    aten.stack.default: stack,
    aten.cumsum.default: scan,
    aten.cumprod.default: scan,
    aten.logcumsumexp.default: scan,
    aten.unfold.default: unfold,
    aten.unfold_backward.default: unfold_backward,
    aten._weight_norm_interface_backward.default: weight_norm_backward,
    aten._prelu_kernel_backward.default: prelu_backward,
}
RULES.update({op: elementwise for op in ELEMENTWISE})
RULES.update({op: pool_backward for op in POOL_BACKWARDS})
# random ops shard like element-wise ops: each rank draws the numbers of its own elements (random_ops)
RULES.update({op: random_ops.rule_rows for op in random_ops.RANDOM_OPS})
# ops of libraries that register them when imported, by name: (node target's str) -> rule
NAMED_RULES: dict[str, Callable[[fx.Node], list[Row]]] = {
    "transformers.grouped_mm_fallback.default": grouped_mm,
    "transformers.grouped_mm_fallback_backward.default": grouped_mm_backward,
}


def rule_for(op: object) -> Callable[[fx.Node], list[Row]] | None:
    """autopar's rule for ``op``, if it has one."""
    return RULES.get(op) or NAMED_RULES.get(str(op))
