"""Every strategy the search may choose for every op of a model, run on the ranks and held to one device.

The oracle (:mod:`autopar.verify.oracle`) trains whole plans, and a random
layout draws one strategy per node: a wrong rule is found only when a draw
lands on it (DTensor's scan rule, split along the dim it scans, was drawn by
two of three random layouts of Mamba-2 and by none of its flowing ones).
Here each (node, strategy) pair runs alone, on the ranks of a real job: the
node's inputs are cut from one device's values as the strategy reads them,
the sharding interpreter (:class:`autopar.codegen.shard_interpreter.ShardInterpreter`)
runs the op exactly as a rank's graph would, and every output is gathered
whole and compared with one device's, relative to the tensor's scale
(:func:`autopar.verify.localize.differs`).  Nodes of one op with the same
arguments and shapes (a model's repeated layers) are checked once per
strategy; so is a strategy that differs from another only by ZeRO or
recompute, which place nothing differently.

Random ops are left to the oracle's runs under ``rng="exact"`` (their
numbers are keyed to the whole program, not to one op run alone).
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autopar.capture.joint import capture, whole_arguments
from autopar.codegen.redistribute import from_whole_planned
from autopar.codegen.shard_interpreter import ShardInterpreter
from autopar.core.mesh import SHARDING_AXES
from autopar.hardware.cluster import Cluster
from autopar.runtime.launch import launch
from autopar.search.sharding.node_keys import node_keys, tensor_inputs
from autopar.search.sharding.node_strategies import Strategy
from autopar.search.sharding.random_ops import KEYED_KERNELS, is_random
from autopar.search.sharding.strategies import enumerate_strategies
from autopar.verify.localize import UNDEFINED, as_traced, differs, placed

# a follower takes its source's placement; the others' values are whatever memory held
_UNCHECKED = {operator.getitem, *UNDEFINED}


@dataclass(frozen=True)
class WrongStrategy:
    """A strategy whose op, run on the ranks as it places the inputs, does not compute the node's value."""

    node: str
    op: str
    strategy: str  # inputs -> outputs
    error: str  # how far off, or what the run raised

    def __str__(self) -> str:
        return f"{self.node} ({self.op}) placed {self.strategy}: {self.error}"


@dataclass(frozen=True)
class RuleCheck:
    """What :func:`check_rules` ran and found."""

    mesh: tuple[int, ...]
    nodes: int  # call nodes whose strategies were run
    checked: int  # (node, strategy) pairs run
    wrong: list[WrongStrategy]
    ops: dict[str, int]  # strategies run, per op


def check_rules(
    factories: Sequence[Callable[[], tuple[Any, Any]]],
    mesh: tuple[int, ...],
    *,
    loss_fn: Callable | None = None,
    seed: int = 0,
    tolerance: float = 1e-4,
) -> list[RuleCheck]:
    """Run every strategy of every op of each ``factory()``'s joint graph on a ``mesh`` (dp x tp) of local
    processes, one launch for them all; each model is built after ``torch.manual_seed(seed)``."""
    if len(mesh) != len(SHARDING_AXES) or min(mesh) < 1:
        raise ValueError(f"mesh {tuple(mesh)} is not a dp x tp shape: give two sizes, e.g. (1, 2) or (2, 2)")
    cluster = Cluster.local(math.prod(mesh))
    return launch(_rank_checks, cluster, list(factories), tuple(mesh), loss_fn, seed, tolerance)[0]


def _rank_checks(
    factories: list[Callable], mesh_shape: tuple[int, ...], loss_fn: Callable | None, seed: int, tolerance: float
) -> list[RuleCheck]:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=SHARDING_AXES)
    return [_rank_check(factory, mesh, loss_fn, seed, tolerance) for factory in factories]


def _rank_check(factory: Callable, mesh: Any, loss_fn: Callable | None, seed: int, tolerance: float) -> RuleCheck:
    torch.manual_seed(seed)
    model, inputs = factory()
    captured = capture(model, inputs, loss_fn=loss_fn)
    gm = captured.gm
    whole = whole_arguments(captured, model, inputs)
    checker = _Checker(gm, enumerate_strategies(gm, tuple(mesh.shape)), ShardInterpreter(gm, {}, mesh), tolerance)
    with torch.no_grad():
        checker.run(*whole)
    wrong = checker.wrong if dist.get_rank() == 0 else []
    return RuleCheck(tuple(mesh.shape), checker.nodes, sum(checker.ops.values()), wrong, dict(checker.ops))


class _Checker(fx.Interpreter):
    """The captured graph run as it is (one device's values, every rank alike), each node's strategies run on
    the ranks as soon as its value is known: a value is held only while the run needs it, not for the whole
    step."""

    def __init__(
        self, gm: fx.GraphModule, strategies: dict, sharded: ShardInterpreter, tolerance: float
    ) -> None:
        super().__init__(gm)
        self.strategies, self.sharded, self.tolerance = strategies, sharded, tolerance
        self.keys = node_keys(gm)
        self.seen: set = set()
        self.wrong: list[WrongStrategy] = []
        self.ops: Counter = Counter()
        self.nodes = 0

    def run_node(self, n: fx.Node) -> Any:
        out = as_traced(super().run_node(n), n.meta.get("val"))
        if n.op != "call_function" or n.target in _UNCHECKED or is_random(n) or n.target in KEYED_KERNELS:
            return out
        self.nodes += 1
        values = {a.name: self.env[a] for a in n.all_input_nodes}
        values[n.name] = out
        template = self.keys[n].template
        for s in self.strategies[n.name].strategies:
            sig = (template if template is not None else n.name, s.inputs, s.outputs)
            if sig in self.seen:
                continue
            self.seen.add(sig)
            self.ops[str(n.target)] += 1
            error = _run_one(self.sharded, n, s, values, self.tolerance)
            if error is not None:
                self.wrong.append(WrongStrategy(n.name, str(n.target), placed(s.inputs, s.outputs), error))
        return out


def _run_one(interp: ShardInterpreter, n: fx.Node, s: Strategy, values: dict[str, Any], tolerance: float) -> str | None:
    """``n`` run as ``s`` places it, its inputs cut from ``values``; None when every output is the node's value,
    else how it is not."""
    plan: dict[str, dict] = {}
    env: dict[fx.Node, Any] = {a: values.get(a.name) for a in n.all_input_nodes}
    for a, p in zip(tensor_inputs(n), s.inputs, strict=True):
        if p is not None and isinstance(values.get(a.name), torch.Tensor):
            plan[a.name] = {"op": "", "inputs": [], "outputs": [tuple(p)]}
            env[a] = from_whole_planned(values[a.name], interp.mesh, tuple(p))
    plan[n.name] = {"op": str(n.target), "inputs": list(s.inputs), "outputs": list(s.outputs)}
    interp.plan, interp.env = plan, env
    try:
        out = interp.run_node(n)
    except Exception as e:  # noqa: BLE001 - a strategy that cannot run is reported as such
        text = str(e).strip()
        return f"raised {type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"
    outs = out if isinstance(out, (tuple, list)) else (out,)
    want = values[n.name]
    wants = want if isinstance(want, (tuple, list)) else (want,)
    worst = None
    for got, w in zip(outs, wants, strict=False):
        if not isinstance(got, DTensor) or not isinstance(w, torch.Tensor):
            continue
        full = got.full_tensor()  # every rank gathers, in the same order
        off = differs(full, w, tolerance)
        if off is not None and worst is None:
            worst = off
    return worst
