"""The single-device reference the oracle compares a plan with, in the plan's precision.

In fp32 the reference is the model trained eagerly, as it is.  Under mixed
precision it is one device running the same policy as the runtime
(:mod:`autopar.runtime.precision`), so that a parallel run is compared with
what its precision computes rather than with fp32: fp32 master weights that
the optimizer steps, a copy of the model with its floating-point parameters in
the compute dtype (buffers shared with the masters' model, as the runtime keeps
them in their own dtype) that runs the forward and backward on the inputs cast
to that dtype, gradients cast to fp32 into the masters' ``.grad``, and under
fp16 the same dynamic loss scaling (:class:`~autopar.runtime.precision.LossScaler`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture.inputs import batch_of
from autopar.capture.joint import model_loss
from autopar.runtime.precision import LossScaler, PrecisionPolicy, scale_steps


def train(model, inputs, step: Callable[[], torch.Tensor], opt, steps: int, grads: Callable) -> tuple:
    """``steps`` optimizer steps: the loss of each, the gradients of the first."""
    losses, first = [], None
    for s in range(steps):
        losses.append(float(step()))
        if s == 0:
            first = grads()
        opt.step()
        opt.zero_grad()
    return losses, first


def slice_batch(inputs: Any, k: int, parts: int) -> Any:
    """Slice ``k`` of ``parts`` of every batched tensor of ``inputs`` (dim 0 the batch,
    :func:`autopar.capture.inputs.batch_of`): a micro-batch, or a data-parallel rank's part of the batch.
    Tensors that are not batches (a (1, T) tensor every sample shares) stay whole."""
    if parts == 1:
        return inputs
    batch = batch_of(pytree.tree_leaves(inputs))

    def part(t: Any) -> Any:
        return t.chunk(parts, 0)[k] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t

    return pytree.tree_map(part, inputs)


class _Working:
    """The compute-dtype copy of a model the reference runs forward and backward (see the module docstring)."""

    def __init__(self, masters: nn.Module, dtype: torch.dtype) -> None:
        self.masters, self.dtype = masters, dtype
        self.model = copy.deepcopy(masters)
        with torch.no_grad():
            for p in self.model.parameters():
                p.data = p.data.to(dtype) if p.is_floating_point() else p.data
        for mine, theirs in zip(self.model.modules(), masters.modules(), strict=True):
            mine._buffers = theirs._buffers  # one set of buffers, in their own dtype, updated by the forward

    def refresh(self) -> None:
        """The copy takes the masters' current values (rounded to the compute dtype)."""
        with torch.no_grad():
            for mine, theirs in zip(self.model.parameters(), self.masters.parameters(), strict=True):
                mine.copy_(theirs)
                mine.grad = None

    def inputs(self, batch: Any) -> Any:
        return pytree.tree_map(
            lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch
        )

    def grads_to_masters(self) -> None:
        """The copy's gradients, cast to fp32, into the masters' ``.grad`` (summed with what is there)."""
        for mine, theirs in zip(self.model.parameters(), self.masters.parameters(), strict=True):
            if mine.grad is None:
                continue
            g = mine.grad.to(theirs.dtype)
            theirs.grad = g if theirs.grad is None else theirs.grad.add_(g)


def single_device_run(
    factory: Callable,
    steps: int,
    lr: float,
    seed: int,
    loss_fn=None,
    microbatches: int = 1,
    precision: str = "fp32",
    reduce_dtype: str | None = None,
) -> tuple:
    """``steps`` AdamW steps of ``factory()``'s model on one device: losses, first gradients, final state.

    ``microbatches`` > 1: each step accumulates the gradients of that many equal
    slices of the batch, each loss weighted 1/m (gradient accumulation).  A model
    whose forward couples the samples of a batch (BatchNorm in training) computes
    another function per micro-batch, so a plan with micro-batches is compared
    with this; for any other model, and losses that are means over equal
    micro-batches, it is the global batch's step.

    ``precision``: the plan's; under mixed precision the policy of the module
    docstring (``reduce_dtype`` changes nothing on one device: there is no reduction).
    """
    policy = PrecisionPolicy.of(precision, reduce_dtype)
    torch.manual_seed(seed)
    model, inputs = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    work = _Working(model, policy.param_dtype) if policy.mixed else None
    scaler = LossScaler() if policy.loss_scaling else None
    if scaler is not None:
        scale_steps(opt, scaler)

    def step() -> torch.Tensor:
        if work is not None:
            work.refresh()
        total = torch.zeros(())
        for k in range(microbatches):
            part = slice_batch(inputs, k, microbatches)
            if work is None:
                loss = model_loss(model, part, loss_fn) / microbatches
            else:
                loss = model_loss(work.model, work.inputs(part), loss_fn).float() / microbatches
            (loss * scaler.scale if scaler is not None else loss).backward()
            total += loss.detach()
        if work is not None:
            work.grads_to_masters()
        return total

    def grads() -> dict:
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    losses, first = train(model, inputs, step, opt, steps, grads)
    return losses, first, {n: t.detach().clone() for n, t in model.state_dict().items()}
