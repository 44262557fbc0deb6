"""BatchNorm in training as SyncBatchNorm computes it: statistics summed over every shard of the batch.

A BatchNorm normalizes each channel by the mean and variance of the whole
batch.  ATen's kernel (``native_batch_norm``) computes them inside one op, so
the only way to run it on a batch split over data-parallel ranks is to gather
the batch or move the split to the channels (an all-to-all of every
activation), which is what DTensor's rule offers.  SyncBatchNorm instead
splits the op where the sums are: each rank sums its part of the batch, the
per-channel sums are all-reduced (2·C numbers), and every rank normalizes its
own part.  Capture writes a training BatchNorm that way, as three ops:

* ``autopar::batch_norm_sums(x) -> (Σx, Σx²)`` per channel: a reduction over
  every dim but the channel dim, so a batch (or spatial) split makes partial
  sums, a channel split keeps the channels split;
* the statistics from the sums, in plain ATen ops on C-element vectors
  (mean, biased variance for normalizing, unbiased for the running variance,
  the running statistics' update, which capture writes back into the
  buffers as the eager op does);
* ``autopar::batch_norm_apply(x, mean, invstd, weight, bias)``: element-wise.

The backward is SyncBatchNorm's too: ``autopar::batch_norm_backward_reduce``
sums ``grad`` and ``grad · (x − mean)`` per channel (partial again under a batch
split: 2·C more numbers all-reduced), and ``autopar::batch_norm_backward_elemt``
gives the input's gradient from those sums, element-wise; the weight's and
bias's gradients are the sums themselves.  The statistics are computed without
autograd, their derivative being in that backward, as in the fused kernel.
One device computes the same function, so a plan that splits the batch trains
like one device with the statistics of the whole batch, as SyncBatchNorm keeps
them, and each op keeps for the backward what the fused kernel keeps (the
input, the mean and inverse deviation).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _channel_view(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against ``x`` (channels on dim 1)."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


@torch.library.custom_op("autopar::batch_norm_sums", mutates_args=())
def batch_norm_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel sum and sum of squares of ``x`` (channels on dim 1), in fp32."""
    xf = x.float()
    dims = _reduce_dims(x)
    return xf.sum(dims), (xf * xf).sum(dims)


@batch_norm_sums.register_fake
def _(x):  # noqa: ANN001, ANN202
    c = x.shape[1]
    return x.new_empty((c,), dtype=torch.float32), x.new_empty((c,), dtype=torch.float32)


@torch.library.custom_op("autopar::batch_norm_apply", mutates_args=())
def batch_norm_apply(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    count: int,
) -> torch.Tensor:
    """``(x − mean) · invstd · weight + bias``, per channel; ``count`` values per channel in the whole batch."""
    scale = invstd if weight is None else invstd * weight.float()
    y = (x.float() - _channel_view(mean, x)) * _channel_view(scale, x)
    if bias is not None:
        y = y + _channel_view(bias.float(), x)
    return y.to(x.dtype)


@batch_norm_apply.register_fake
def _(x, mean, invstd, weight, bias, count):  # noqa: ANN001, ANN202
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("autopar::batch_norm_backward_reduce", mutates_args=())
def batch_norm_backward_reduce(
    grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``Σ grad`` and ``Σ grad · (x − mean)``, in fp32."""
    g = grad.float()
    dims = _reduce_dims(x)
    return g.sum(dims), (g * (x.float() - _channel_view(mean, x))).sum(dims)


@batch_norm_backward_reduce.register_fake
def _(grad, x, mean):  # noqa: ANN001, ANN202
    c = x.shape[1]
    return x.new_empty((c,), dtype=torch.float32), x.new_empty((c,), dtype=torch.float32)


@torch.library.custom_op("autopar::batch_norm_backward_elemt", mutates_args=())
def batch_norm_backward_elemt(
    grad: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sum_grad: torch.Tensor,
    sum_grad_centered: torch.Tensor,
    count: int,
) -> torch.Tensor:
    """The input's gradient from the whole batch's sums: ``(g − Σg/n − (x − mean)·invstd²·Σg(x − mean)/n)·invstd·w``."""
    scale = invstd if weight is None else invstd * weight.float()
    centered = x.float() - _channel_view(mean, x)
    dx = grad.float() - _channel_view(sum_grad / count, x)
    dx = dx - centered * _channel_view(invstd * invstd * sum_grad_centered / count, x)
    return (dx * _channel_view(scale, x)).to(x.dtype)


@batch_norm_backward_elemt.register_fake
def _(grad, x, mean, invstd, weight, sum_grad, sum_grad_centered, count):  # noqa: ANN001, ANN202
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, mean, invstd, weight, bias, count = inputs
    ctx.save_for_backward(x, mean, invstd, weight)
    ctx.count = count
    ctx.has_bias = bias is not None


def _backward(ctx, grad):  # noqa: ANN001, ANN202
    x, mean, invstd, weight = ctx.saved_tensors
    sum_grad, sum_grad_centered = torch.ops.autopar.batch_norm_backward_reduce(grad, x, mean)
    dx = torch.ops.autopar.batch_norm_backward_elemt(
        grad, x, mean, invstd, weight, sum_grad, sum_grad_centered, ctx.count
    )
    d_weight = None if weight is None else (sum_grad_centered * invstd).to(weight.dtype)
    d_bias = sum_grad.to(weight.dtype if weight is not None else x.dtype) if ctx.has_bias else None
    return dx, None, None, d_weight, d_bias, None


batch_norm_apply.register_autograd(_backward, setup_context=_setup)


def batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    """``F.batch_norm(..., training=True)`` written as the ops above; the running statistics updated in place.

    The statistics are computed without autograd: the gradient through them is
    part of :func:`batch_norm_apply`'s backward, as in the fused kernel.
    """
    count = x.numel() // x.shape[1]
    with torch.no_grad():
        total, squares = torch.ops.autopar.batch_norm_sums(x)
        mean = total / count
        var = (squares / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            unbiased = var * (count / max(count - 1, 1))
            running_mean.copy_((1 - momentum) * running_mean + momentum * mean.to(running_mean.dtype))
            running_var.copy_((1 - momentum) * running_var + momentum * unbiased.to(running_var.dtype))
    return torch.ops.autopar.batch_norm_apply(x, mean, invstd, weight, bias, count)


def coupling_modules(gm: torch.fx.GraphModule) -> list[str]:
    """Modules of ``gm`` whose forward couples the samples of a batch: training BatchNorms.

    Such a model computes another function when the batch is cut into
    micro-batches (each normalized by its own statistics), so the search keeps
    one micro-batch for it unless a user fixes more.
    """
    sums = gm.graph.find_nodes(op="call_function", target=torch.ops.autopar.batch_norm_sums.default)
    return sorted({n.meta.get("autopar_module", "") for n in sums})
