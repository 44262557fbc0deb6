"""Example inputs and the loss: the forms capture accepts, and the one scalar it differentiates.

Capture, the runtime and the correctness oracle must agree on how a batch is
flattened into the joint graph's user inputs and how the loss is found in a
model's output; those rules live here, once.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.core.errors import CaptureError

WRAPPED = "model"  # attribute under which the wrapper holds the user's model
TARGETS = "_autopar_targets"  # keyword that carries the example targets through export, after user kwargs


class NoLoss(Exception):
    """Raised inside the traced forward when no scalar loss can be found."""


def _is_scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _describe(x: Any) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def pick_loss(out: Any, loss_fn: Callable[..., Any] | None, targets: tuple, cls: str) -> torch.Tensor:
    """The scalar loss from the model output, by the rules documented on ``capture``."""
    if loss_fn is not None:
        loss = loss_fn(out, *targets)
        if not _is_scalar(loss):
            raise NoLoss(
                f"loss_fn returned {_describe(loss)}, not a scalar tensor: make it reduce to a scalar"
            )
        return loss
    if _is_scalar(out):
        return out
    found = None if isinstance(out, torch.Tensor) else getattr(out, "loss", None)  # HF ModelOutput
    if found is None and isinstance(out, dict):
        found = out.get("loss")
    elif found is None and isinstance(out, (tuple, list)) and out:
        found = out[0]
    if _is_scalar(found):
        return found
    raise NoLoss(
        f"no loss found in the output of {cls} ({_describe(out)}): pass loss_fn= (and example_targets=) "
        "or make the model return a scalar loss (HuggingFace: pass labels)"
    )


class LossWrapper(nn.Module):
    """Calls the user's model and returns ``(loss,)`` so export sees one scalar output."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any] | None) -> None:
        super().__init__()
        setattr(self, WRAPPED, model)
        # Kept out of the module tree: a loss module's submodules would otherwise show up in module paths.
        self.__dict__["_loss_fn"] = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        model = getattr(self, WRAPPED)
        targets = kwargs.pop(TARGETS)
        out = model(*args, **kwargs)
        return (pick_loss(out, self._loss_fn, targets, type(model).__name__),)


def normalize(example_inputs: Any, example_targets: Any) -> tuple[tuple, dict, tuple]:
    """(positional args, keyword args, targets) from the forms ``capture`` accepts."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list, torch.Tensor)):
        args, kwargs = (
            (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs),
            {},
        )
    else:
        raise CaptureError(
            f"example_inputs must be a Tensor, a tuple of positional arguments or a dict of "
            f"keyword arguments, not {type(example_inputs).__name__}"
        )
    if example_targets is None or isinstance(example_targets, (tuple, list)):
        return args, kwargs, tuple(example_targets or ())
    return args, kwargs, (example_targets,)


def batch_of(tensors: list[Any]) -> int | None:
    """The batch ``tensors`` hold: dim 0 of the first tensor whose dim 0 is not 1 (1 if every one's is), None
    without a tensor of one dim or more. A dim 0 of 1 beside the batch is a tensor shared by every sample
    (``position_ids`` of shape (1, T), a causal mask of (1, 1, T, T)), as broadcasting reads it."""
    sizes = [int(t.shape[0]) for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0]
    return next((s for s in sizes if s != 1), 1) if sizes else None


def batched_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Per tensor, whether its dim 0 is the batch (:func:`batch_of`): the tensors data-parallel ranks and
    micro-batches split. The others (shared by every sample, or not of samples) are taken whole."""
    batch = batch_of(tensors)
    return [t.dim() > 0 and int(t.shape[0]) == batch for t in tensors]


def input_tensors(model: nn.Module, inputs: Any, targets: Any = None) -> list[torch.Tensor]:
    """The tensors of one batch in the order of ``CapturedGraph.inputs`` (the joint graph's user placeholders)."""
    args, kwargs, targets = normalize(inputs, targets)
    hf_no_cache(model, kwargs)
    leaves = pytree.tree_leaves((args, {**kwargs, TARGETS: targets}))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def model_loss(
    model: nn.Module, inputs: Any, loss_fn: Callable[..., Any] | None = None, targets: Any = None
) -> torch.Tensor:
    """The loss the captured graph computes, computed eagerly: the single-device reference."""
    args, kwargs, targets = normalize(inputs, targets)
    hf_no_cache(model, kwargs)
    try:
        return pick_loss(model(*args, **kwargs), loss_fn, targets, type(model).__name__)
    except NoLoss as exc:
        raise CaptureError(str(exc)) from None


def hf_no_cache(model: nn.Module, kwargs: dict) -> None:
    """Training never wants a KV cache, and HF LLaMA's cache breaks export: default use_cache=False."""
    with contextlib.suppress(TypeError, ValueError):  # forward without an inspectable signature
        if "use_cache" in inspect.signature(model.forward).parameters:
            kwargs.setdefault("use_cache", False)


def input_name(path: tuple) -> str:
    """Name of a user input from its pytree path in ``(args, {**kwargs, TARGETS: targets})``."""
    if path[0].idx == 0:
        base, rest = f"arg{path[1].idx}", path[2:]
    elif path[1].key == TARGETS:
        base, rest = f"target{path[2].idx}", path[3:]
    else:
        base, rest = str(path[1].key), path[2:]
    return base + pytree.keystr(rest)


def strip_wrapper(path: str) -> str:
    """Wrapper path -> path in the user's model ("model.h.0@1" -> "h.0")."""
    path = re.sub(r"@\d+$", "", path)
    return path[len(WRAPPED) + 1 :] if path.startswith(WRAPPED + ".") else ""
