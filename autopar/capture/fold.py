"""Capture a model whose layers repeat by tracing four of them (:mod:`autopar.capture.unroll`).

The planner reads the joint graph, never runs it, and tracing is most of what a
plan of a deep model costs; so it captures through :func:`capture_folded`. A
stack is folded only when an ``nn.ModuleList`` ends with a run of at least
``MIN_LAYERS`` modules of one class whose parameters, buffers and plain
attributes agree (an attribute equal to the layer's own index, such as
``layer_idx``, may differ); layers before the run (DeepSeek-V3's three dense
layers before its mixtures of experts) are traced whole. Otherwise, or when
the traced layers do not repeat cleanly, the whole model is traced. Either way
the names are canonical, so the graph equals the whole model's trace node for
node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from autopar.capture.graph import CapturedGraph
from autopar.capture.joint import capture, state_infos
from autopar.capture.unroll import TEMPLATE_LAYERS, NotUnrollable, unroll

log = logging.getLogger(__name__)

MIN_LAYERS = 6
"""Fewer layers than this are traced whole: the four traced would be most of them."""

_SKIPPED = {"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def capture_folded(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., Any] | None = None,
    example_targets: Any = None,
) -> CapturedGraph:
    """:func:`~autopar.capture.joint.capture`, tracing four layers of a repeated stack."""
    found = repeated_stack(model)
    if found is not None:
        parent, attr, path, first = found
        stack: nn.ModuleList = getattr(parent, attr)
        if first:
            log.info("capture: %s's first %d layers under %s differ from the rest: traced whole", type(model).__name__, first, path)
        short = _cut_short(model, found, example_inputs, loss_fn, example_targets)
        params, fixed = state_infos(model)
        try:
            if short is not None:
                return unroll(short, path, len(stack) - first, params, fixed, first)
        except NotUnrollable as why:
            log.info(
                "capture: %s's layers under %s do not repeat cleanly (%s); tracing all of them",
                type(model).__name__,
                path,
                why,
            )
    return capture(model, example_inputs, loss_fn, example_targets)


def capture_template(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., Any] | None = None,
    example_targets: Any = None,
) -> CapturedGraph | None:
    """The trace :func:`capture_folded` writes a folded graph from (``Fold.template``), alone; None for a
    model with no repeated stack or one that does not trace cut short."""
    found = repeated_stack(model)
    return None if found is None else _cut_short(model, found, example_inputs, loss_fn, example_targets)


def _cut_short(model: nn.Module, found, example_inputs, loss_fn, example_targets) -> CapturedGraph | None:
    """``model`` captured with its stack (``found``, from :func:`repeated_stack`) cut to its first layers and
    four of the run; None where that does not trace."""
    parent, attr, path, first = found
    stack: nn.ModuleList = getattr(parent, attr)
    try:
        setattr(parent, attr, nn.ModuleList(list(stack)[: first + TEMPLATE_LAYERS]))
        return capture(model, example_inputs, loss_fn, example_targets)
    except Exception as why:  # noqa: BLE001 - a forward that needs every layer is traced whole
        log.info("capture: %s with %s cut short does not trace (%s)", type(model).__name__, path, why)
        return None
    finally:
        setattr(parent, attr, stack)


def repeated_stack(model: nn.Module) -> tuple[nn.Module, str, str, int] | None:
    """The outermost ``nn.ModuleList`` ending with a run of like layers (the longest run):
    (parent, attribute, path, the index of the run's first layer).

    Outermost, so that a mixture of experts' list of experts inside each layer is
    never taken for the layer stack. None if there is none.
    """
    found: list[tuple[int, str, nn.Module, str, int]] = []
    for path, parent in model.named_modules():
        for attr, child in parent.named_children():
            first = _run_start(list(child)) if isinstance(child, nn.ModuleList) else None
            if first is not None:
                found.append((len(child) - first, f"{path}.{attr}" if path else attr, parent, attr, first))
    outer = [f for f in found if not any(f[1].startswith(g[1] + ".") for g in found)]
    if not outer:
        return None
    _, full, parent, attr, first = max(outer, key=lambda f: f[0])
    return parent, attr, full, first


def _run_start(layers: list[nn.Module]) -> int | None:
    """Where the run of like layers that ends ``layers`` starts, if it holds ``MIN_LAYERS`` or more; else None.

    Like: the same class tree, tensor shapes and dtypes, and plain attributes up to the layer's own index.
    """
    if len(layers) < MIN_LAYERS:
        return None
    tensors = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    if sum(1 for layer in layers for _ in [*layer.parameters(), *layer.buffers()]) != len(tensors):
        return None  # layers sharing weights
    r = len(layers) - 2  # a middle layer of the run
    ref = _description(layers[r])

    def agrees(j: int, mine: tuple, theirs: tuple) -> bool:
        # an attribute holding the layer's own index (layer_idx) differs by design
        return mine == theirs or (mine[:-1] == theirs[:-1] and (mine[-1], theirs[-1]) == (repr(j), repr(r)))

    first = len(layers)
    for j in reversed(range(len(layers))):
        mine = _description(layers[j])
        if len(mine) != len(ref) or not all(agrees(j, a, b) for a, b in zip(mine, ref, strict=True)):
            break
        first = j
    return first if len(layers) - first >= MIN_LAYERS else None


def _description(layer: nn.Module) -> list[tuple]:
    out: list[tuple] = []
    for name, m in layer.named_modules():
        out.append((name, type(m)))
        for attr, value in sorted(vars(m).items()):
            if attr in _SKIPPED or attr.startswith("_") and "hook" in attr:
                continue
            if isinstance(value, (bool, int, float, str, type(None), tuple, list)):
                out.append((name, attr, repr(value)))
        for tname, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            out.append((name, tname, tuple(t.shape), t.dtype, t.requires_grad))
    return out
