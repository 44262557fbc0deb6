"""Calling a rank's local graph: in the grad mode it was traced in, with nothing recorded for autograd.

The joint graph is traced with grad mode on, as eager training runs, and some
kernels read the mode at run time rather than their arguments: the CPU LSTM
(``aten.mkldnn_rnn_layer``) returns the workspace its backward reads only when
grad mode is on, and nothing under ``no_grad``, so its backward then fails. The
graphs compute their own gradients, so their inputs are detached: with none
requiring grad, grad mode records nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def call_graph(gm: fx.GraphModule, *args: Any) -> Any:
    """``gm(*args)`` with grad mode on and every tensor argument detached."""
    detached = [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
    with torch.enable_grad():
        return gm(*detached)
