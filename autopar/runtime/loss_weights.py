"""How much each micro-batch counts in a step whose loss is a mean over the targets it keeps.

Capture writes a mean class loss (cross-entropy, NLL) as ``S / W``: the sum of
the per-target losses over the total weight of the targets not equal to
``ignore_index`` (:func:`autopar.capture.replay._mean_as_sum_over_weight`).  A step
of ``m`` micro-batches, each with its own ``L_k = S_k / W_k``, must give the
loss of the whole batch and its gradient:

    L = (sum_k S_k) / (sum_k W_k) = sum_k (W_k / W) L_k,     dL = sum_k (W_k / W) dL_k.

Averaging the micro-batch losses (weight ``1/m`` each, what gradient
accumulation usually does) is right only when every micro-batch keeps equally
many targets; padded sequences (labels of -100) do not.  ``W_k`` depends on the
labels alone, so before the step every rank runs the captured graph's label
chain (the ops from the user inputs to the loss's target) on each micro-batch
and counts the kept targets.  A loss of another form keeps the weights ``1/m``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.capture.graph import TensorInfo
from autopar.capture.joint import REDUCTION_SUM, CapturedGraph, ancestors

log = logging.getLogger(__name__)
aten = torch.ops.aten


class LabelChain:
    """The part of a captured joint graph that computes the loss's target from the user inputs."""

    def __init__(self, gm: fx.GraphModule, inputs: list[int], ignore_index: int) -> None:
        self.gm = gm
        self.inputs = inputs  # indices into CapturedGraph.inputs that the chain reads
        self.ignore_index = ignore_index

    def kept(self, inputs: Mapping[int, torch.Tensor]) -> float:
        """How many targets of one micro-batch (its whole, every data-parallel rank's share) count."""
        target = self.gm(*(inputs[i] for i in self.inputs))
        return float((target != self.ignore_index).sum())


def label_chain(captured: CapturedGraph) -> LabelChain | None:
    """The label chain of a loss ``S / W`` written by capture, or None for a loss of another form.

    None also when the target depends on parameters or state, or the loss has class weights.
    """
    g = captured.gm.graph
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    loss = out.args[0][0]
    if not isinstance(loss, fx.Node) or loss.target is not aten.div.Tensor:
        return None
    s, w = loss.args
    if not all(isinstance(a, fx.Node) and a.target is operator.getitem for a in (s, w)):
        return None
    nll = s.args[0]
    if w.args[0] is not nll or (s.args[1], w.args[1]) != (0, 1):
        return None
    if nll.target is not aten.nll_loss_forward.default or nll.args[3] != REDUCTION_SUM or nll.args[2] is not None:
        return None
    target = nll.args[1]
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    first_input = len(captured.params) + len(captured.buffers)
    index = {n: i - first_input for i, n in enumerate(placeholders)}
    needed = ancestors(target)
    if any(n.op == "placeholder" and index[n] < 0 for n in needed):
        return None
    chain = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for n in g.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            env[n] = chain.placeholder(n.name)
            inputs.append(index[n])
        else:
            env[n] = chain.node_copy(n, env.__getitem__)
    chain.output(env[target])
    return LabelChain(fx.GraphModule(captured.gm, chain), inputs, int(nll.args[4]))


def microbatch_weights(
    chain: LabelChain | None,
    tensors: list[torch.Tensor],
    microbatches: int,
    dp_group: dist.ProcessGroup | None = None,
    infos: list[TensorInfo] | None = None,
) -> list[float]:
    """``W_k / W`` per micro-batch of the batch ``tensors`` (the inputs in the order of ``CapturedGraph.inputs``).

    ``dp_group``: the data-parallel group when ``tensors`` are this rank's part of
    the batch (``local_batch``); the chain's inputs are gathered over it (a
    collective), so each micro-batch is counted whole. ``infos``: the inputs as
    captured; one that is not a batch (``TensorInfo.batched``) is read whole by
    every micro-batch.
    """
    m = microbatches
    if chain is None or m == 1:
        return [1.0 / m] * m
    read = {}
    for i in chain.inputs:
        t = tensors[i]
        if infos is not None and not infos[i].batched:
            read[i] = [t] * m
        elif dp_group is not None and t.dim():
            ranks = [torch.empty_like(t) for _ in range(dist.get_world_size(dp_group))]
            dist.all_gather(ranks, t.contiguous(), group=dp_group)
            # micro-batch k is the k-th chunk of every rank's part
            read[i] = [torch.cat([r.chunk(m, 0)[k] for r in ranks]) for k in range(m)]
        else:
            read[i] = t.chunk(m, 0) if t.dim() else [t] * m
    kept = [chain.kept({i: read[i][k] for i in chain.inputs}) for k in range(m)]
    total = sum(kept)
    if total == 0:  # every target ignored: the loss is 0/0 on one device too
        return [1.0 / m] * m
    return [k / total for k in kept]
