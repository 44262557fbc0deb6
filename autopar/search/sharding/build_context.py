"""What every step of :func:`autopar.search.sharding.problem.build_problem` reads, and what it fills in.

The build of one mesh's sharding problem runs in named steps
(:mod:`autopar.search.sharding.problem` holds the node terms and memory items,
:mod:`autopar.search.sharding.resharding_edges` the edges).  They all read one
:class:`BuildContext` (the graph, the mesh, the device, the set-up, derived
once per build by :func:`make_context`) and fill one :class:`Terms`; this
module holds those two records and what they share (:class:`Memo`,
:class:`NodeRow`), so that the steps' modules import it and not each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopar.capture.joint import CapturedGraph, gradient_chain
from autopar.core.placements import Placements
from autopar.cost_models import compute as compute_model
from autopar.cost_models.compute import ComputeEfficiency
from autopar.cost_models.experts import CAPACITY_FACTOR
from autopar.cost_models.memory import Precision, optimizer_bytes_per_param, partition_copy_bytes
from autopar.cost_models.reshard import shard_factor
from autopar.hardware.cluster import Link
from autopar.search.sharding.graph_facts import GraphFacts, graph_facts
from autopar.search.sharding.instance import EdgeInfo
from autopar.search.sharding.node_strategies import NodeStrategies, Strategy
from autopar.search.sharding.request import MeshRequest
from autopar.search.sharding.step_memory import Item


@dataclass
class Memo:
    """Answers the steps of one build share.

    The nodes of repeated layers share their strategy objects and sizes: each question
    (a placement's shard factor, a row of terms, a resharding matrix) is answered once
    and the answer object shared, so repeated layers cost one layer's work.
    """

    shard_factors: dict[Placements, int] = field(default_factory=dict)
    splits: dict[tuple, int] = field(default_factory=dict)
    variants: dict[tuple[int, int], Strategy] = field(default_factory=dict)  # (id(s), zero or -1: recompute)
    rows: dict[tuple, NodeRow] = field(default_factory=dict)
    list_numbers: dict[tuple[int, ...], int] = field(default_factory=dict)  # distinct strategy lists
    matrices: dict[tuple, list[float]] = field(default_factory=dict)
    # (have, need, bytes, zero, bucketed) -> seconds, the placements by their numbers in ``placement_ids``
    moves: dict[tuple, float] = field(default_factory=dict)
    placement_ids: dict[Placements | None, int] = field(default_factory=dict)  # hashing placements is slow
    # the placements an edge's ends have and need, per strategy, numbered once per strategy list
    haves: dict[tuple[int, int], tuple[int, tuple]] = field(default_factory=dict)
    needs: dict[tuple[int, int], tuple[int, tuple]] = field(default_factory=dict)


@dataclass
class BuildContext:
    """What every step of the build reads: the graph, the mesh, the device and the set-up."""

    captured: CapturedGraph
    facts: GraphFacts
    strategies: dict[str, NodeStrategies]
    mesh_shape: tuple[int, ...]
    links: list[Link]
    device: Any
    precision: Precision
    efficiency: ComputeEfficiency | None
    dp_dim: int | None
    microbatches: int
    recompute: bool  # recompute variants are offered (asked for, and under a memory limit)
    params: set[str]  # placeholders of parameters
    state: set[str]  # placeholders of the fixed state: buffers and frozen parameters, held for the whole step
    inputs: set[str]  # placeholders of user inputs
    scale: float  # activation bytes per traced byte (the training dtype against the traced one)
    dp_n: int
    mem_bw: float  # bytes per second the optimizer update streams at
    b_opt: float  # optimizer-state bytes per parameter element
    b_copy: float  # the ZeRO-stepped chunk's own fp32 copy, per element
    opt_traffic: float  # bytes per parameter element one optimizer update reads and writes
    # the gradient chain (:func:`autopar.capture.joint.gradient_chain`), where the reduce dtype differs
    # from the activations'; empty otherwise
    gradient_chain: set[str] = field(default_factory=set)
    # the busiest expert-parallel rank's pairs over the mean; None: expected under uniform routing
    capacity_factor: float | None = CAPACITY_FACTOR
    memo: Memo = field(default_factory=Memo)

    def pieces(self, p: Placements) -> int:
        """How many pieces placement ``p`` cuts a tensor into on this mesh."""
        f = self.memo.shard_factors.get(p)
        if f is None:
            f = self.memo.shard_factors[p] = shard_factor(p, self.mesh_shape)
        return f

    def split(self, s: Strategy) -> int:
        """W(s): the number of pieces the work is cut into, the mesh dims where any placement is not replicated."""
        key = (s.outputs, s.inputs)
        n = self.memo.splits.get(key)
        if n is None:
            n = self.memo.splits[key] = math.prod(
                n
                for d, n in enumerate(self.mesh_shape)
                if any(p is not None and not p[d].is_replicate() for p in (*s.outputs, *s.inputs))
            )
        return n

    def local(self, nbytes: list, placements: tuple) -> list[float]:
        """Local bytes of each value under its placement (0 where either is missing)."""
        return [
            b / self.pieces(p) if b is not None and p is not None else 0.0
            for b, p in zip(nbytes, placements, strict=False)
        ]


@dataclass
class NodeRow:
    """A node's terms, one entry per strategy: shared by the nodes of repeated layers."""

    costs: list[float]  # c_v
    memory: list[float]  # m_v
    # per strategy: bytes of each output (ops), or (parameter, gradient, optimizer state) bytes (parameters)
    parts: list = field(default_factory=list)
    gather: list[float] = field(default_factory=list)  # parameters: seconds of c_p that are a ZeRO all-gather
    in_parts: list[list[float]] = field(default_factory=list)  # ops: local bytes of each input


@dataclass
class Terms:
    """The problem as the steps of the build fill it in, per problem node and per edge."""

    names: list[str] = field(default_factory=list)
    strats: list[list[Strategy]] = field(default_factory=list)
    rows: list[NodeRow] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "param" | "state" | "placeholder" | "op"
    gaps: list[tuple[int, int] | None] = field(default_factory=list)  # recompute gap, where offered
    list_ids: list[int] = field(default_factory=list)  # number of the node's strategy list
    intervals: list[tuple[int, int]] = field(default_factory=list)
    backward: list[int] = field(default_factory=list)
    params: list[int] = field(default_factory=list)
    state: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    items: list[Item] = field(default_factory=list)
    grad_items: list[int] = field(default_factory=list)
    edges: list[tuple[int, int]] = field(default_factory=list)
    edge_costs: list[list[float]] = field(default_factory=list)
    edge_info: list[EdgeInfo] = field(default_factory=list)
    grad_edges: list[int] = field(default_factory=list)


def make_context(
    request: MeshRequest, strategies: dict[str, NodeStrategies], dp_dim: int | None, microbatches: int
) -> BuildContext:
    """The constants every step reads, derived once per build.

    Recompute variants are offered when the request asks for them and has a memory
    limit: without one, a variant only costs time.
    """
    captured, precision, device = request.captured, request.precision, request.cluster.device_spec
    mesh_shape = request.shape
    b_opt = optimizer_bytes_per_param(precision, request.optimizer)
    return BuildContext(
        captured=captured,
        facts=graph_facts(captured.gm),
        strategies=strategies,
        mesh_shape=mesh_shape,
        links=request.links,
        device=device,
        precision=precision,
        efficiency=request.efficiency,
        dp_dim=dp_dim,
        microbatches=microbatches,
        recompute=request.recompute and request.memory_limit is not None,
        params={p.placeholder for p in captured.params},
        state={b.placeholder for b in captured.buffers},
        inputs={t.placeholder for t in captured.inputs},
        scale=request.activation_scale,
        dp_n=mesh_shape[dp_dim] if dp_dim is not None else 1,
        mem_bw=device.hbm_bandwidth * (request.efficiency or compute_model.DEFAULT_EFFICIENCY).memory,
        b_opt=b_opt,
        b_copy=partition_copy_bytes(precision),
        opt_traffic=precision.grad_bytes + 2 * b_opt + precision.param_bytes,
        gradient_chain=(
            gradient_chain(captured.gm, len(captured.params))
            if precision.reduce_bytes != precision.activation_bytes
            else set()
        ),
        capacity_factor=captured.capacity_factor,
    )
