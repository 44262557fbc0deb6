"""A plan carried onto a graph traced in another process, whose nodes of the same names are other nodes.

A model that iterates a set of strings traces its ops in the order of the process's hash seed: HuggingFace's
ExaoneMoe builds its full and sliding-window masks so, and a plan made in one process (the planner's) named
other nodes than the ranks' capture gave those names (a random layout of it failed to trace: a shard of a
0-dim tensor). ``TwoGates`` makes two gates in the order it is given; the two graphs have the same node
names and ops, read by other nodes. (:mod:`autopar.codegen.transfer`; a plan carried onto a one-row
micro-batch's graph is tested in ``tests/test_rng.py``.) Ranks that each capture their own graph (on GPUs)
check that they traced the same one (:func:`autopar.runtime.shared_capture.same_graph_on_every_rank`).
"""

from __future__ import annotations

import functools

import onnx
import torch
import torch.distributed as dist

import autopar
from autopar.capture.joint import capture
from autopar.codegen.transfer import _offered, same_graph, transfer_placements
from autopar.core.errors import RuntimeMismatchError
from autopar.onnx import export_onnx, read_onnx_plan
from autopar.runtime.launch import launch
from autopar.runtime.shared_capture import same_graph_on_every_rank
from autopar.search.sharding.strategies import enumerate_strategies
from autopar.verify.oracle import check_plans, layout_plan, random_placements

MESH = (1, 2)


class TwoGates(torch.nn.Module):
    """A gate over rows ([b, s]) and one over cells ([b, s, h]), made in ``order`` by the same op."""

    def __init__(self, order: tuple[str, str]) -> None:
        super().__init__()
        self.order = order
        self.proj = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        made = {}
        for kind in self.order:
            made[kind] = torch.sigmoid(h.sum(-1) if kind == "rows" else h)
        z = h * made["rows"].unsqueeze(-1) * made["cells"]
        return torch.nn.functional.mse_loss(self.out(z), y)


def two_gates(order: tuple[str, str] = ("cells", "rows")):
    torch.manual_seed(0)
    return TwoGates(order), (torch.randn(8, 4, 16), torch.randn(8, 4, 16))


def _by_name_offered(placements: dict, captured) -> bool:
    strategies = enumerate_strategies(captured.gm, MESH)
    return all(_offered(placements[n], strategies[n]) for n in strategies)


def test_a_plan_is_carried_by_what_its_nodes_read_not_by_their_names():
    planned = capture(*two_gates(("rows", "cells")))
    ran = capture(*two_gates())
    ops = {n.name: str(n.target) for n in planned.gm.graph.nodes}
    assert ops == {n.name: str(n.target) for n in ran.gm.graph.nodes}  # by name and op, the same graph
    strategies = enumerate_strategies(ran.gm, MESH)
    misread = 0
    for seed in range(6):
        placements = random_placements(planned, MESH, seed)
        assert same_graph(placements, planned) and not same_graph(placements, ran)
        misread += not _by_name_offered(placements, ran)
        moved, _ = transfer_placements(placements, ran, MESH)
        assert list(moved) == list(strategies)
        assert all(_offered(moved[n], strategies[n]) for n in strategies)
    assert misread  # read by name, some layout puts a node in placements its op does not compute in


@functools.cache
def _misread_plan() -> autopar.Plan:
    """The first random layout of the rows-first graph that, read by name, misplaces a node of the other."""
    model, inputs = two_gates(("rows", "cells"))
    ran = capture(*two_gates())
    for seed in range(20):
        plan = layout_plan(model, inputs, autopar.Cluster.local(2), *MESH, "random", seed=seed)
        if not _by_name_offered(plan.placements, ran):
            return plan
    raise AssertionError("no random layout of 20 misplaces a node read by name")


def test_a_plan_made_on_the_other_order_trains_like_one_device():
    (check,) = check_plans([(two_gates, _misread_plan())], autopar.Cluster.local(2))
    assert check.ok(1e-5), str(check)


def test_onnx_annotations_of_a_plan_made_on_the_other_order_name_the_nodes_they_place(tmp_path):
    """The annotated ONNX export captures the model again: each annotation names the plan node that placed it,
    and that node computes a tensor of the annotated value's shape (by name, the rows gate would annotate the
    cells gate)."""
    plan = _misread_plan()
    planned = capture(*two_gates(("rows", "cells")))
    shapes = {n.name: tuple(n.meta["val"].shape) for n in planned.gm.graph.nodes if "val" in n.meta}
    model, inputs = two_gates()
    export_onnx(model, plan, str(tmp_path / "two_gates.onnx"), inputs)
    back = read_onnx_plan(str(tmp_path / "two_gates.onnx"))
    proto = onnx.load(str(tmp_path / "two_gates.onnx"))
    onnx_shapes = {
        v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
        for v in [*proto.graph.value_info, *proto.graph.input, *proto.graph.output]
    }
    onnx_shapes.update({t.name: tuple(t.dims) for t in proto.graph.initializer})
    compared = [t for t in back.plan_nodes if t in onnx_shapes]
    assert len(compared) > 8
    for tensor in compared:
        assert shapes[back.plan_nodes[tensor]] == onnx_shapes[tensor], tensor


def _agreement() -> tuple[str, str]:
    """On each rank: the check on the same graph, then on a rank 1 that traced the other order."""
    outcomes = []
    for differ in (False, True):
        order = ("rows", "cells") if differ and dist.get_rank() == 1 else ("cells", "rows")
        try:
            same_graph_on_every_rank(capture(*two_gates(order)))
            outcomes.append("same")
        except RuntimeMismatchError as e:
            outcomes.append(str(e))
    return tuple(outcomes)


def test_ranks_that_traced_other_orders_fail_in_one_line_instead_of_waiting_on_each_other():
    """On GPUs every rank captures its own graph, in a process of its own hash seed (torchrun sets none)."""
    for same, other in launch(_agreement, 2, collective_timeout_s=30):
        assert same == "same"
        assert "rank 1 traced another graph of TwoGates" in other and "PYTHONHASHSEED" in other
