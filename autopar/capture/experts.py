"""Capture writes HuggingFace's routed experts as ``autopar::experts`` (:mod:`autopar.ops.experts`).

HuggingFace dispatches an experts module's forward by its config's
``_experts_implementation`` through ``ExpertsInterface``, the registry it keeps
for kernels of its own; autopar registers the op there as "autopar" and, for
the export only, points each experts module it computes exactly at it.  Modules
it does not compute (biases, transposed or interleaved weights, a post-expert
norm, another gate) keep HuggingFace's implementation, with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from autopar.ops import experts

log = logging.getLogger(__name__)

NAME = "autopar"


def _interface():  # noqa: ANN202
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return ALL_EXPERTS_FUNCTIONS


@contextmanager
def experts_as_op(model: nn.Module) -> Iterator[int]:
    """Within the block, the model's HuggingFace experts modules run as the op; yields how many do."""
    registry = _interface()
    if registry is None:
        yield 0
        return
    found = [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "config")]
    if not found:
        yield 0
        return
    if NAME not in registry:
        registry.register(NAME, experts.hf_forward)
    chosen = [m for m in found if experts.supports(m)]
    for m in found:
        if m not in chosen:
            log.info("%s: HuggingFace's experts implementation kept (a layout the op does not compute)",
                     type(m).__name__)
    saved = [(m.config, m.config._experts_implementation) for m in chosen]
    try:
        for m in chosen:
            m.config._experts_implementation_internal = NAME
        yield len(chosen)
    finally:
        for config, impl in saved:
            config._experts_implementation_internal = impl
