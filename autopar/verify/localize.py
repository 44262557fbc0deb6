"""Where a plan's numbers leave one device's: the nodes of the joint graph whose values differ.

The oracle (:mod:`autopar.verify.oracle`) says whether a plan trains like one
device; when it does not, this says where.  Both runs go through the sharding
interpreter (:func:`autopar.codegen.shard.run_sharded`), op by op and eagerly,
at the plan's global batch in one micro-batch, under ``rng="exact"``:

* the reference: the captured graph run as it is on rank 0, or, when the model
  draws random numbers, the same interpreter on one process with every node
  whole (each placement a replica), which draws what one device draws;
* the plan on its ranks, each node as the plan places it; every node's value
  is gathered whole (``full_tensor``) and rank 0 compares it with the
  reference's.

A node differs when ``max |plan - one| > tolerance x max(max |one|, 1e-3)``:
relative to the tensor's own scale, so that round-off in a large tensor and a
wrong sign in a small one are told apart.  Every node after a faulty one
inherits its error, so the first in graph order is the one to read: its op,
and the placements the plan runs it in.  Values of a whole step are held at
once, so it is for the models a test or a bug report trains, not large ones.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autopar.capture.joint import capture, whole_arguments
from autopar.codegen.shard import run_sharded
from autopar.codegen.transfer import transfer_placements
from autopar.core.errors import PlanError
from autopar.core.mesh import SHARDING_AXES, world_size
from autopar.core.placements import REPLICATE
from autopar.hardware.cluster import Cluster
from autopar.ops import rng
from autopar.plans.plan import Plan
from autopar.runtime.launch import launch
from autopar.verify.oracle import draws_random

aten = torch.ops.aten
# ops whose values are whatever memory held: no two runs need agree on them
UNDEFINED = frozenset(
    {aten.empty_like.default, aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
     aten.new_empty_strided.default}
)


@dataclass(frozen=True)
class Difference:
    """A node whose value under the plan differs from one device's."""

    node: str
    op: str
    error: float  # the largest absolute difference
    scale: float  # the largest absolute value on one device
    inputs: tuple[str, ...]  # the nodes it reads
    strategy: str  # the placements the plan runs it in: inputs -> outputs

    def __str__(self) -> str:
        return (
            f"{self.node} ({self.op}) off by {self.error:.1e} (its values up to {self.scale:.1e}); "
            f"reads {', '.join(self.inputs) or 'nothing'}; placed {self.strategy}"
        )


def differences(
    factory: Callable[[], tuple[Any, Any]],
    cluster: Cluster,
    plan: Plan,
    *,
    loss_fn: Callable | None = None,
    seed: int = 0,
    tolerance: float = 1e-4,
    limit: int = 10,
) -> list[Difference]:
    """The first ``limit`` nodes, in graph order, whose values under ``plan`` differ from one device's.

    ``factory()`` builds the model and its inputs after ``torch.manual_seed(seed)``, as the oracle's
    checks build them; ``plan`` is a plan for ``cluster`` without a pipeline.  Empty: the plan computes
    every value one device does, to ``tolerance``.
    """
    if plan.mesh.get("pp", 1) > 1:
        raise PlanError("differences compares plans without a pipeline; check each stage's layout on its own")
    if not plan.placements:
        raise PlanError("the plan has no per-node placements (an analytic data-parallel plan): nothing to compare")
    if world_size(plan.mesh) != cluster.world_size:
        raise PlanError(
            f"the plan is for {world_size(plan.mesh)} devices but the cluster has {cluster.world_size}; "
            "pass the cluster the plan was made for"
        )
    wire = plan.to_dict()
    reference = None
    if draws_random(factory, seed, loss_fn):  # one device's draws under "exact": autopar's own, on one process
        (values,) = launch(_rank_values, Cluster.local(1), factory, wire, loss_fn, seed, None, 0.0, 0)
        reference = pickle.dumps(values)  # bytes: a tensor among a launch's arguments takes a descriptor each
    return launch(_rank_values, cluster, factory, wire, loss_fn, seed, reference, tolerance, limit)[0]


def _rank_values(
    factory: Callable, wire: dict, loss_fn: Callable | None, seed: int, pickled: bytes | None, tolerance: float,
    limit: int,
) -> Any:
    """One rank's run of :func:`differences`; rank 0 answers.

    On one process without a reference (``pickled``): every node's value, every node whole. On the plan's
    ranks: the nodes whose values differ from the reference, or, where there is none (a graph that draws no
    random numbers), from the captured graph run as it is on rank 0.
    """
    plan = Plan.from_dict(wire)
    torch.manual_seed(seed)
    model, inputs = factory()
    captured = capture(model, inputs, loss_fn=loss_fn)
    alone = dist.get_world_size() == 1
    shape = (1, 1) if alone else (plan.mesh["dp"], plan.mesh.get("tp", 1))
    placements, _ = transfer_placements(plan.placements, captured, shape)
    if alone:
        placements = {name: _whole(entry) for name, entry in placements.items()}
    whole = whole_arguments(captured, model, inputs)
    values: dict[str, DTensor] = {}

    def record(node: fx.Node, value: Any) -> None:
        if isinstance(value, DTensor):
            values[node.name] = value

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=SHARDING_AXES)
    with rng.using(rng.RngState(mode="exact", seed=seed, batch=captured.batch_size)), torch.no_grad():
        run_sharded(captured, placements, mesh, whole, record)
        if alone:
            return {k: v.full_tensor() for k, v in values.items() if v.is_floating_point()}
        if pickled is not None:
            reference = pickle.loads(pickled)
        else:
            reference = graph_values(captured.gm, whole) if dist.get_rank() == 0 else {}
    found: list[Difference] = []
    for node in captured.gm.graph.nodes:
        if node.name not in values or node.target in UNDEFINED:
            continue
        full = values[node.name].full_tensor()  # every rank gathers, in the same order
        want = reference.get(node.name)
        if dist.get_rank() != 0 or not isinstance(want, torch.Tensor) or len(found) >= limit:
            continue
        diff = _difference(node, full, want, placements.get(node.name) or {}, tolerance)
        if diff is not None:
            found.append(diff)
    return found


def as_traced(out: Any, val: Any) -> Any:
    """``out`` laid out in memory as the trace's fake value ``val`` was.

    A real kernel may lay its output out otherwise than its fake one does (``softplus_backward``'s takes its
    first operand's strides, its fake its second's: a view the trace recorded after it then fails on Doge's
    real values); the graph's later ops were traced for the fake layout."""
    if isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor) and out.shape == val.shape:
        if out.stride() != val.stride() and out.numel() > 1:
            return torch.empty_strided(val.shape, val.stride(), dtype=out.dtype, device=out.device).copy_(out)
    return out


def graph_values(gm: fx.GraphModule, args: list[torch.Tensor]) -> dict[str, Any]:
    """Every node's value when the joint graph runs as captured on ``args`` (one device's values), each laid
    out as the trace laid it out."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = as_traced(super().run_node(n), n.meta.get("val"))
            return values[n.name]

    Recorder(gm).run(*args)
    return values


def _whole(entry: dict) -> dict:
    """A plan's entry for a node with every placement a replica."""
    def whole(ps: Any) -> Any:
        return None if not ps else tuple(REPLICATE for _ in ps)

    return {**entry, "inputs": [whole(p) for p in entry["inputs"]], "outputs": [whole(p) for p in entry["outputs"]]}


def gap(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference between ``got`` and ``want``, and the largest finite ``|want|``.

    Equal infinities (a mask's -inf) and NaNs in the same places agree; other shapes are infinitely apart.
    """
    want, got = want.double(), got.double()
    finite = want.isfinite()
    scale = want[finite].abs().max().item() if finite.any() else 0.0
    if got.shape != want.shape:
        return float("inf"), scale
    same = (got == want) | (got.isnan() & want.isnan())
    far = (got - want).abs().masked_fill(same, 0.0)
    error = far.max().item() if far.numel() else 0.0
    return (float("inf") if error != error else error), scale


def differs(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> str | None:
    """How far ``got`` is from ``want`` when further than ``tolerance`` of its scale; None when not."""
    error, scale = gap(got, want)
    if error <= tolerance * max(scale, 1e-3):
        return None
    return f"off by {error:.1e} (its values up to {scale:.1e})"


def placed(inputs: Any, outputs: Any) -> str:
    """A strategy's placements as plans print them: ``inputs -> outputs``."""

    def text(ps: Any) -> str:
        return ", ".join("-" if p is None else "(" + ", ".join(map(str, p)) + ")" for p in ps)

    return f"{text(inputs)} -> {text(outputs)}"


def _difference(
    node: fx.Node, got: torch.Tensor, want: torch.Tensor, entry: dict, tolerance: float
) -> Difference | None:
    error, scale = gap(got, want)
    if error <= tolerance * max(scale, 1e-3):
        return None
    strategy = placed(entry.get("inputs", []), entry.get("outputs", []))
    return Difference(node.name, str(node.target), error, scale, tuple(a.name for a in node.all_input_nodes), strategy)
