"""Random ops: their sharding rule, and how a rank computes its part of one from keyed random numbers.

Every random ATen op autopar knows is, element by element, a function of
uniform (or standard normal) numbers: dropout keeps an element where
``u < 1 - p``, ``bernoulli`` is ``u < p``, ``exponential`` is
``-log(1 - u) / λ``, ``randperm(n)`` sorts ``n`` uniforms.  So a rank computes
its shard of the op's output from its shard of those numbers, drawn by
:func:`autopar.ops.rng.random_tensor` under a key that makes the draw right for the
placement (see :mod:`autopar.ops.rng`): the op shards like any element-wise op,
along any dim of its output, with no communication, and none is replicated at
the global batch.

``RANDOM_OPS`` maps each op to a :class:`RandomOp`; the strategy pass takes
its rows (:func:`rule_rows`) and the sharding interpreter runs it
(:func:`run_local`).  Seeded ops missing here (``multinomial``, ``poisson``,
``_standard_gamma``, RNN and attention kernels with dropout) keep their
ordinary treatment: DTensor's rule or replication, drawing from the process's
generator.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.capture.joint import bind_args
from autopar.core.placements import REPLICATE, Row, shard
from autopar.ops import dropout_attention  # noqa: F401  (registers torch.ops.autopar.dropout_attention*)
from autopar.search.sharding.node_keys import tensor_inputs

aten = torch.ops.aten

# draw(normal, dtype): this rank's part of the op's random numbers, shaped like its (first) output
Draw = Callable[[bool, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class RandomOp:
    """How to compute one random op from its random numbers.

    ``compute(args, draw, out)`` gets the op's arguments bound by name
    (tensors local), ``draw`` and the (fake) value of its first output, and
    returns the op's outputs.  ``shardable``: False for ops whose output must
    stay whole (a permutation).
    """

    compute: Callable[[dict[str, Any], Draw, torch.Tensor], Any]
    shardable: bool = True


def _work(dtype: torch.dtype) -> torch.dtype:
    """The dtype random numbers are drawn in for an output of ``dtype``."""
    return torch.float64 if dtype in (torch.float64, torch.int64) else torch.float32


def _dropout(a: dict, draw: Draw, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, p, train = a["input"], float(a["p"]), a.get("train")
    if train is False or p == 0.0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    mask = draw(False, _work(x.dtype)) < 1.0 - p
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return x * mask * scale, mask


def _uniform_to(lo: float, hi: float) -> Callable:
    return lambda u: lo + (hi - lo) * u


def _like(transform: Callable[[torch.Tensor, dict], torch.Tensor], normal: bool = False) -> Callable:
    """An op whose output has its first output's dtype and is ``transform(numbers, args)``."""

    def compute(a: dict, draw: Draw, out: torch.Tensor) -> torch.Tensor:
        return transform(draw(normal, _work(out.dtype)), a).to(out.dtype)

    return compute


def _ints(lo_key: str | None, hi_key: str) -> Callable:
    """Integers in [low, high): ``low + floor(u * (high - low))``, u in float64 so wide ranges stay uniform."""

    def compute(a: dict, draw: Draw, out: torch.Tensor) -> torch.Tensor:
        lo = a.get(lo_key, 0) if lo_key else 0
        hi = a[hi_key]
        u = draw(False, torch.float64)
        return (lo + torch.floor(u * (hi - lo))).to(out.dtype)

    return compute


def _random_from(a: dict, draw: Draw, out: torch.Tensor) -> torch.Tensor:
    lo, hi = a.get("from", 0), a.get("to")
    if hi is None:  # [from, the dtype's largest integer]: only defined for integer and float types
        hi = 2**53 if out.is_floating_point() else torch.iinfo(out.dtype).max
    u = draw(False, torch.float64)
    return (lo + torch.floor(u * (hi - lo))).to(out.dtype)


def _randperm(a: dict, draw: Draw, out: torch.Tensor) -> torch.Tensor:
    return torch.argsort(draw(False, torch.float64)).to(out.dtype)


RANDOM_OPS: dict[Any, RandomOp] = {
    aten.native_dropout.default: RandomOp(_dropout),
    aten.bernoulli.default: RandomOp(_like(lambda u, a: u < a["self"])),
    aten.bernoulli.p: RandomOp(_like(lambda u, a: u < a["p"])),
    aten.bernoulli.Tensor: RandomOp(_like(lambda u, a: u < a["p"])),
    aten.uniform.default: RandomOp(_like(lambda u, a: _uniform_to(a.get("from", 0.0), a.get("to", 1.0))(u))),
    aten.rand.default: RandomOp(_like(lambda u, a: u)),
    aten.rand_like.default: RandomOp(_like(lambda u, a: u)),
    aten.randn.default: RandomOp(_like(lambda z, a: z, normal=True)),
    aten.randn_like.default: RandomOp(_like(lambda z, a: z, normal=True)),
    aten.normal_functional.default: RandomOp(
        _like(lambda z, a: a.get("mean", 0.0) + a.get("std", 1.0) * z, normal=True)
    ),
    aten.normal.Tensor_float: RandomOp(_like(lambda z, a: a["mean"] + a.get("std", 1.0) * z, normal=True)),
    aten.normal.float_Tensor: RandomOp(_like(lambda z, a: a.get("mean", 0.0) + a["std"] * z, normal=True)),
    aten.normal.Tensor_Tensor: RandomOp(_like(lambda z, a: a["mean"] + a["std"] * z, normal=True)),
    aten.normal.float_float: RandomOp(_like(lambda z, a: a["mean"] + a["std"] * z, normal=True)),
    aten.exponential.default: RandomOp(_like(lambda u, a: -torch.log1p(-u) / a.get("lambd", 1.0))),
    aten.geometric.default: RandomOp(
        _like(lambda u, a: torch.ceil(torch.log1p(-u) / math.log1p(-a["p"])).clamp_min(1.0))
    ),
    aten.log_normal.default: RandomOp(
        _like(lambda z, a: torch.exp(a.get("mean", 1.0) + a.get("std", 2.0) * z), normal=True)
    ),
    aten.cauchy.default: RandomOp(
        _like(lambda u, a: a.get("median", 0.0) + a.get("sigma", 1.0) * torch.tan(math.pi * (u - 0.5)))
    ),
    aten.randint.default: RandomOp(_ints(None, "high")),
    aten.randint.low: RandomOp(_ints("low", "high")),
    aten.randint_like.default: RandomOp(_ints(None, "high")),
    aten.randint_like.low_dtype: RandomOp(_ints("low", "high")),
    aten.random.to: RandomOp(_ints(None, "to")),
    getattr(aten.random, "from"): RandomOp(_random_from),  # "from" is a Python keyword
    aten.randperm.default: RandomOp(_randperm, shardable=False),
}


# Kernels that draw with a key of their own, passed as their last four arguments (dropout_attention.KEY_ARGS):
# where their query is among their arguments, and which of them is the forward.
KEYED_KERNELS: dict[Any, int] = {
    torch.ops.autopar.dropout_attention.default: 0,
    torch.ops.autopar.dropout_attention_backward.default: 1,
}
_FORWARD_KERNEL = torch.ops.autopar.dropout_attention.default


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` is a random op autopar draws itself (element-wise, or a keyed kernel)."""
    return node.op == "call_function" and (node.target in RANDOM_OPS or node.target in KEYED_KERNELS)


def _forward_of(node: fx.Node) -> fx.Node | None:
    """The forward kernel whose outputs a keyed backward reads (its output, its log-sum-exp).

    Autograd hands the backward its saved tensors through ``detach`` nodes.
    """
    for a in node.all_input_nodes:
        while a.target is aten.detach.default and isinstance(a.args[0], fx.Node):
            a = a.args[0]
        src = a.args[0] if a.target is operator.getitem else a
        if isinstance(src, fx.Node) and src.target is _FORWARD_KERNEL:
            return src
    return None


def _out_val(node: fx.Node) -> torch.Tensor:
    val = node.meta["val"]
    return val[0] if isinstance(val, (tuple, list)) else val


def rule_rows(node: fx.Node) -> list[Row]:
    """Single-mesh-dim rows (outputs, then tensor inputs in the op's order) for a random op.

    Whole everywhere, or every output and every tensor argument of the
    output's shape sharded on the same dim: each rank draws the numbers of
    its own elements.  An argument of another shape (a broadcast probability)
    keeps the op whole, and a permutation is never split.
    """
    out = _out_val(node)
    vals = node.meta["val"]
    width = (len(vals) if isinstance(vals, (tuple, list)) else 1) + len(tensor_inputs(node))
    rows: list[Row] = [[REPLICATE] * width]
    if not RANDOM_OPS[node.target].shardable or any(
        tuple(a.meta["val"].shape) != tuple(out.shape) for a in tensor_inputs(node)
    ):
        return rows
    return rows + [[shard(d)] * width for d in range(out.dim())]


def op_numbers(graph: fx.Graph) -> dict[str, int]:
    """A number per random op of the captured graph, the same on every rank and for every batch size.

    Random ops are numbered in graph order.  A node replayed in the backward
    (:mod:`autopar.search.sharding.recompute`) takes its original's number, and so does
    a keyed backward kernel its forward's, so both draw what the forward drew.
    """
    numbers: dict[str, int] = {}
    draws = [n for n in graph.nodes if is_random(n)]
    for n in draws:  # the forward draws, in graph order
        if "autopar_recompute_of" not in n.meta and (n.target in RANDOM_OPS or n.target is _FORWARD_KERNEL):
            numbers[n.name] = len(numbers)
    for n in draws:
        if "autopar_recompute_of" in n.meta:
            numbers[n.name] = numbers[n.meta["autopar_recompute_of"]]
    for n in draws:  # a keyed backward draws its forward's numbers again
        if n.name not in numbers:
            fwd = _forward_of(n)
            if fwd is None or fwd.name not in numbers:
                raise ValueError(f"{n.name} reads no output of a forward kernel: its draws have no key")
            numbers[n.name] = numbers[fwd.name]
    return numbers


def run_local(target: Any, args: tuple, kwargs: dict, draw: Draw, out: torch.Tensor) -> Any:
    """The op's (local) outputs from local arguments and this rank's random numbers."""
    return RANDOM_OPS[target].compute(bind_args(target, args, kwargs), draw, out)

