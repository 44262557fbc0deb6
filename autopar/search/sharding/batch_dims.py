"""Which dims of each value of a captured graph scale with the batch.

A sharding problem is built on the graph at the whole batch; the runtime runs it at
``1/m`` of the batch, where a dim that scales with it is ``m`` times smaller and a
shard of it must still divide (:mod:`autopar.search.sharding.microbatches`). Which dims
scale is read off a second capture of the same model at twice the batch
(``CapturedGraph.recapture``; a folded graph's, its template's): a dim scales where its size
differs between the two. The
shape alone cannot say: LLaMA-3-8B's 32 heads at a batch of 8 look like a batch dim,
and a micro-batch of one sequence would seem to leave 4 heads for tensor parallelism's 8
ranks. Without a second capture (a graph made some other way) every dim whose size is
a multiple of the batch is taken to scale: at worst a count that would have worked is
refused; the guess is kept too where the batch divides none of the model's own sizes
(:func:`_ambiguous`), where a size it divides is the batch's but by a coincidence of products.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.fx as fx

from autopar.capture.joint import CapturedGraph

log = logging.getLogger(__name__)

Scaled = tuple[bool, ...]
"""Per dim of a value: whether its size scales with the batch."""

_READ: weakref.WeakKeyDictionary[fx.GraphModule, dict[str, tuple[Scaled | None, ...]] | None] = (
    weakref.WeakKeyDictionary()
)


def scaled_dims(captured: CapturedGraph) -> dict[str, tuple[Scaled | None, ...]] | None:
    """Per node, per output (None: not a tensor), which dims scale with the batch; None where the graph has no
    second capture to read it from. Read once per graph."""
    gm = captured.gm
    if gm in _READ:
        return _READ[gm]
    found = None
    fold = captured.fold
    if fold is not None:  # written from its template: each node's dims are those of the node it stands on
        template = scaled_dims(fold.template)
        if template is not None:
            found = {name: template[origin] for name, origin in fold.origin.items() if origin in template}
    elif captured.recapture is not None and _ambiguous(captured):
        try:
            found = _compare(gm, captured.recapture(2 * captured.batch_size).gm)
        except Exception as why:  # noqa: BLE001 - a model that does not trace at twice the batch: shapes alone
            log.info("batch dims of %s: no capture at twice the batch (%s)", captured.model_name, why)
    _READ[gm] = found
    return found


def _ambiguous(captured: CapturedGraph) -> bool:
    """Whether the batch divides one of the model's own sizes (a dim of a parameter or buffer, or of an input
    past its batch dim): then a size of a value that the batch divides may be the model's (a head count,
    a hidden size), not the batch's. Where it divides none, the guess stands and no second capture is
    made (DeepSeek-V3 at 15,360 sequences: 2.3 s saved of a 60-s search)."""
    batch = captured.batch_size
    if batch <= 1:
        return False
    own = {int(d) for t in (*captured.params, *captured.buffers) for d in t.shape}
    own |= {int(d) for t in captured.inputs for d in t.shape[1:]}
    return any(d % batch == 0 for d in own if d)


def guessed(shape: tuple[int, ...], batch: int) -> Scaled:
    """The dims taken to scale where no second capture says: every one whose size is a multiple of the batch."""
    return tuple(int(size) % batch == 0 for size in shape)


def _compare(a: fx.GraphModule, b: fx.GraphModule) -> dict[str, tuple[Scaled | None, ...]]:
    """The dims whose sizes differ between ``a`` and ``b``'s node of the same name, op and ranks (a forward
    op that ``a`` replays in the backward, as its original)."""
    others = {n.name: n for n in b.graph.nodes}
    out: dict[str, tuple[Scaled | None, ...]] = {}
    for node in a.graph.nodes:
        other = others.get(node.meta.get("autopar_recompute_of", node.name))
        if other is None or other.target != node.target:
            continue
        mine, theirs = _values(node), _values(other)
        if len(mine) != len(theirs):
            continue
        out[node.name] = tuple(
            tuple(int(p) != int(q) for p, q in zip(x.shape, y.shape, strict=True))
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == y.dim()
            else None
            for x, y in zip(mine, theirs, strict=True)
        )
    return out


def _values(node: fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]
