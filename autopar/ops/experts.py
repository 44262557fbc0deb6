"""A mixture of experts' routed experts as one op: dispatch, expert MLPs and combine, dropless.

HuggingFace runs its mixtures' experts (``@use_experts_implementation`` classes:
Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...) as a sort of the (token, choice)
pairs by expert, grouped matmuls and an unsort.  Traced, that is a dozen index
ops whose rows are counted over the whole batch (``offs`` of the grouped matmul
is a cumulative count): no split of the tokens is exact for them, so every plan
ran every expert on every token of the batch on every rank.

Capture therefore writes the experts as ``autopar::experts`` (the router's
top-k indices and weights in, the weighted sum over each token's experts out)
with its backward ``autopar::experts_backward``.  Every token reaches each of its
top-k experts (no capacity drop), so the op is exact on any split of the tokens.
Its sharding rules (:mod:`autopar.search.sharding.strategy_rules`) add, beside
the data-parallel split, *expert parallelism*: the experts' weights split on
their expert dim over a mesh axis that also splits the tokens; each rank then
sends each pair to the rank holding its expert and gets the results back, two
``_c10d_functional.all_to_all_single`` with split sizes exchanged first
(``autopar::experts_ep`` and its backward, which the sharding pass writes into
a rank's graph in place of the op).  The backward recomputes the forward (the
dispatched rows are not kept), so it moves four all-to-alls' worth of rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import flop_counter

# HuggingFace's activation names that the op computes, as torch functions
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its gradient is the all-to-all back with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: str) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, group)
    return torch.ops._c10d_functional.wait_tensor(out)


def _experts_mlp(x: torch.Tensor, expert_of_row: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str):
    """Each row of ``x`` through its expert's gated MLP (rows grouped by expert, ``expert_of_row`` sorted)."""
    counts = torch.bincount(expert_of_row, minlength=gate_up.shape[0]).tolist()
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        # no rows at all: expert 0 runs on none. An output made of nothing (new_zeros) would cut the autograd
        # graph from ``x``, and a rank of an expert-parallel group given no rows would skip the backward's
        # all-to-alls that the other ranks wait in
        if counts[e] == 0 and (x.shape[0] or e):
            continue
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(ACTIVATIONS[act](gate) * up, down[e]))
    return torch.cat(outs)


def routed(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    group: str | None = None,
    ep_size: int = 1,
) -> torch.Tensor:
    """The experts' output for ``hidden`` (T, H): ``sum_j w[t, j] * expert_{idx[t, j]}(hidden[t])``.

    ``group`` None: every expert's weights are here.  Otherwise this rank holds
    experts ``[r * E, (r + 1) * E)`` of the ``ep_size`` ranks of ``group`` (r its
    rank in it, E = ``gate_up.shape[0]``), and the other ranks' tokens come and go
    by all-to-all.  Differentiable (the backward op runs it under autograd).
    """
    tokens, k = top_k_index.shape
    local = gate_up.shape[0]
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    rows = hidden[order // k]
    if group is None:
        out_sorted = _experts_mlp(rows, ids[order], gate_up, down, act)
    else:
        counts = torch.bincount(ids, minlength=local * ep_size)
        got = _all_to_all(counts, [local] * ep_size, [local] * ep_size, group).view(ep_size, local)
        send = counts.view(ep_size, local).sum(1).tolist()
        recv = got.sum(1).tolist()
        arrived = _AllToAll.apply(rows, recv, send, group)  # by (source rank, local expert)
        expert_of = torch.repeat_interleave(
            torch.arange(local, device=ids.device).repeat(ep_size), got.reshape(-1)
        )
        regroup = torch.argsort(expert_of, stable=True)
        done = torch.empty_like(arrived[:, : down.shape[1]]).index_put(
            (regroup,), _experts_mlp(arrived[regroup], expert_of[regroup], gate_up, down, act)
        )
        out_sorted = _AllToAll.apply(done, send, recv, group)
    pairs = torch.empty_like(out_sorted).index_put((order,), out_sorted)
    weighted = pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)
    return weighted.sum(1).to(hidden.dtype)


def _autograd_on():  # noqa: ANN202
    """Autograd inside a custom op's kernel, where the dispatcher turns it off: the backward op differentiates
    the forward it recomputes."""
    keys = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA,
                torch._C.DispatchKey.ADInplaceOrView, torch._C.DispatchKey.AutogradOther):
        keys = keys - torch._C.DispatchKeySet(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys)


def _grads(grad, hidden, top_k_index, top_k_weights, gate_up, down, act, group=None, ep_size=1):  # noqa: ANN001, ANN202
    with torch.enable_grad(), _autograd_on():
        leaves = [t.detach().requires_grad_(True) for t in (hidden, top_k_weights, gate_up, down)]
        out = routed(leaves[0], top_k_index, leaves[1], leaves[2], leaves[3], act, group, ep_size)
        got = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves, strict=True))


@torch.library.custom_op("autopar::experts", mutates_args=())
def experts(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, act: str,
) -> torch.Tensor:
    return routed(hidden, top_k_index, top_k_weights, gate_up, down, act)


@experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, down, act):  # noqa: ANN001, ANN202
    return torch.empty_like(hidden)


@torch.library.custom_op("autopar::experts_backward", mutates_args=())
def experts_backward(
    grad: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    gate_up: torch.Tensor, down: torch.Tensor, act: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _grads(grad, hidden, top_k_index, top_k_weights, gate_up, down, act)


@experts_backward.register_fake
def _(grad, hidden, top_k_index, top_k_weights, gate_up, down, act):  # noqa: ANN001, ANN202
    return tuple(torch.empty_like(t) for t in (hidden, top_k_weights, gate_up, down))


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    hidden, top_k_index, top_k_weights, gate_up, down, act = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, gate_up, down)
    ctx.act = act


def _backward(ctx, grad):  # noqa: ANN001, ANN202
    hidden, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
    g = experts_backward(grad, hidden, top_k_index, top_k_weights, gate_up, down, ctx.act)
    return g[0], None, g[1], g[2], g[3], None


experts.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("autopar::experts_ep", mutates_args=())
def experts_ep(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, act: str, group: str, ep_size: int,
) -> torch.Tensor:
    return routed(hidden, top_k_index, top_k_weights, gate_up, down, act, group, ep_size)


@experts_ep.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, down, act, group, ep_size):  # noqa: ANN001, ANN202
    return torch.empty_like(hidden)


@torch.library.custom_op("autopar::experts_ep_backward", mutates_args=())
def experts_ep_backward(
    grad: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    gate_up: torch.Tensor, down: torch.Tensor, act: str, group: str, ep_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _grads(grad, hidden, top_k_index, top_k_weights, gate_up, down, act, group, ep_size)


@experts_ep_backward.register_fake
def _(grad, hidden, top_k_index, top_k_weights, gate_up, down, act, group, ep_size):  # noqa: ANN001, ANN202
    return tuple(torch.empty_like(t) for t in (hidden, top_k_weights, gate_up, down))


def _flops(hidden_shape, index_shape, gate_up_shape) -> int:  # noqa: ANN001
    """Two matmuls per (token, choice) pair: (H -> 2I) and (I -> H)."""
    pairs = index_shape[0] * index_shape[1]
    return 2 * pairs * hidden_shape[-1] * gate_up_shape[1] * 3 // 2


flop_counter.register_flop_formula(torch.ops.autopar.experts)(
    lambda h, i, w, gu, d, *args, out_shape=None, **kwargs: _flops(h, i, gu)
)
# the backward recomputes the forward, then takes the two matmuls' two gradients
flop_counter.register_flop_formula(torch.ops.autopar.experts_backward)(
    lambda g, h, i, w, gu, d, *args, out_shape=None, **kwargs: 3 * _flops(h, i, gu)
)

EXPERT_OPS = {torch.ops.autopar.experts.default, torch.ops.autopar.experts_backward.default}
BACKWARD_NAME = "autopar.experts_backward.default"
EXPERT_OP_NAMES = {"autopar.experts.default", BACKWARD_NAME}
EP_VARIANT = {
    torch.ops.autopar.experts.default: torch.ops.autopar.experts_ep.default,
    torch.ops.autopar.experts_backward.default: torch.ops.autopar.experts_ep_backward.default,
}


def ep_axes(inputs: Any, backward: bool) -> list[int] | None:
    """The mesh axes over which ``op``'s inputs (one placement tuple per tensor input) split the experts;
    None when that is more than one axis (one all-to-all group per op), or when an axis splits the experts
    without splitting the tokens the same way."""
    first = 1 if backward else 0
    hidden, weights = inputs[first], inputs[first + 3]
    if weights is None:
        return []
    axes = [a for a, p in enumerate(weights) if p.is_shard(0)]
    if len(axes) > 1 or any(hidden is None or not hidden[a].is_shard(0) for a in axes):
        return None
    return axes


def balancing_loss(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm``'s loss has a mixture's load-balancing term: a top-k over the routers' logits outside
    every layer (HuggingFace's ``load_balancing_loss_func`` takes the top-k of all layers' logits again).

    That term is the product of two means over the batch (each expert's share of the tokens and of the
    router's probability): a micro-batch's term is not its share of the batch's, so, as with BatchNorm,
    the search keeps one micro-batch unless a user fixes more.
    """
    if not any(str(n.target) in EXPERT_OP_NAMES for n in gm.graph.nodes):
        return False
    topk = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.topk.default)
    return any(not n.meta.get("autopar_module") for n in topk)


def supports(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a HuggingFace experts class) is one the op computes: concatenated [gate; up]
    weights, no biases, no post-expert norm, the default gate and an activation of :data:`ACTIVATIONS`."""
    from transformers.integrations.moe import _default_apply_gate

    return (
        getattr(module, "has_gate", False)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "is_transposed", True)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "has_post_expert_norm", True)
        and getattr(type(module), "_apply_gate", None) is _default_apply_gate
        and getattr(module.config, "hidden_act", None) in ACTIVATIONS
        and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    )


def hf_forward(module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """HuggingFace's experts interface entry (``ExpertsInterface``): the op, registered as "autopar"."""
    return experts(hidden, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, module.config.hidden_act)
