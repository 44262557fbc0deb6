"""The last captured graph, kept so that re-planning the same model does not capture it again.

Users re-plan one model with other options (a ZeRO stage, a memory limit, a
cluster); a 7B capture takes seconds and its result does not change. The key
covers the model object, its parameter names, shapes and dtypes, the
loss function, and the shapes, dtypes and devices of the inputs the graph is
captured from (the example inputs resized to the batch asked for, so that
asking for the batch they already have reuses their capture).

The planner only reads the graph, so a repeated layer stack is traced four
layers deep and written out to its full depth (:mod:`autopar.capture.fold`);
the runtime traces the whole model and carries the plan onto it by op sequence
(:mod:`autopar.codegen.transfer`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from autopar.capture.fold import capture_folded, capture_template
from autopar.capture.inputs import batch_of
from autopar.capture.joint import CapturedGraph, frozen_parameter_count
from autopar.cost_models.graph_stats import graph_stats
from autopar.cost_models.step import GraphStats

log = logging.getLogger(__name__)

_last: tuple[tuple, CapturedGraph, GraphStats] | None = None


def captured_with_stats(
    model, example_inputs, loss_fn=None, example_targets=None, batch: int | None = None
) -> tuple[CapturedGraph, GraphStats]:
    """Capture ``model`` (at ``batch`` samples if given) and read its statistics, reusing the last capture."""
    global _last
    if batch is not None:
        whole = example_batch(example_inputs)
        example_inputs = resize_batch(example_inputs, batch, whole)
        example_targets = resize_batch(example_targets, batch, whole)
    # keyed by the inputs as captured: a batch the examples already have is the capture without one
    key = (_model_key(model), _shapes(example_inputs), _shapes(example_targets), id(loss_fn))
    if _last is not None and _last[0] == key:
        log.info("reusing the capture of %s", type(model).__name__)
        return _last[1], _last[2]
    captured = capture_folded(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets)
    offer_recapture(captured, model, example_inputs, loss_fn, example_targets)
    stats = graph_stats(captured, frozen_parameter_count(model))
    _last = (key, captured, stats)
    return captured, stats


def offer_recapture(captured: CapturedGraph, model, example_inputs, loss_fn, example_targets) -> None:
    """Give ``captured`` (and its fold's template) the capture of the same model at another batch, made on
    first use and kept: which dims scale with the batch is read off the two. A folded graph's are read off
    its template's (:mod:`autopar.search.sharding.batch_dims`), so only the four traced layers are
    captured again."""
    made: dict[tuple[bool, int], CapturedGraph | None] = {}

    def at(batch: int, template: bool = False) -> CapturedGraph:
        key = (template, batch)
        if key not in made:
            whole = example_batch(example_inputs)
            inputs, targets = resize_batch(example_inputs, batch, whole), resize_batch(example_targets, batch, whole)
            made[key] = (capture_template if template else capture_folded)(model, inputs, loss_fn, targets)
        got = made[key]
        if got is None:
            raise ValueError("the model does not trace cut short at that batch")
        return got

    captured.recapture = at
    if captured.fold is not None:
        captured.fold.template.recapture = functools.partial(at, template=True)


def example_batch(example_inputs) -> int | None:
    """The batch the user gave (:func:`autopar.capture.inputs.batch_of` of the example inputs)."""
    return batch_of(list(_flat(example_inputs)))


def resize_batch(x, batch: int, whole: int | None = None):
    """The same inputs with the batch set to ``batch``, on the meta device (capture needs only shapes).

    The batch is dim 0 of the tensors whose dim 0 is the examples' batch (``whole``, by default
    :func:`example_batch`'s): a tensor of another length there (a graph's edge list beside its node
    features, a ``(1, T)`` tensor every sample shares) is not a batch of samples and keeps its shape.
    """
    whole = example_batch(x) if whole is None else whole
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] == batch or x.shape[0] != whole:
            return x
        return torch.empty((batch, *x.shape[1:]), dtype=x.dtype, device="meta")
    if isinstance(x, dict):
        return {k: resize_batch(v, batch, whole) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(resize_batch(v, batch, whole) for v in x)
    return x


def _flat(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _flat(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _flat(v)
    else:
        yield x


def _model_key(model) -> tuple:
    return (
        id(model),
        type(model),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()),
    )


def _shapes(x) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, str(x.device))
    if isinstance(x, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_shapes(v) for v in x)
    return repr(x)
