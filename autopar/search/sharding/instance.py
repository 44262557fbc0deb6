"""The sharding problem as the search holds it: the solver's numbers plus the map back onto the graph.

:mod:`autopar.search.sharding.problem` builds it, and the modules that read an
answer back (:mod:`autopar.search.sharding.step_memory`, the mesh search, the
pipeline search) take it; it lives in its own module so that they need not
import the builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from autopar.core.placements import Placements
from autopar.cost_models.reshard import grad_sync_steps
from autopar.search.sharding.graph_facts import GraphFacts
from autopar.search.sharding.strategies import Strategy
from autopar.solver import StrategyProblem

EdgeKind = Literal["data", "grad-sync", "buffer-update"]


@dataclass(frozen=True)
class EdgeInfo:
    """What one edge of the problem moves: a value of ``src`` to where ``dst`` needs it.

    ``input_pos`` is the entry of ``dst``'s strategy inputs the value is read as; -1 when
    the edge targets ``dst``'s own output placement, as a gradient targets its
    parameter's and a buffer's new value the buffer's.
    """

    src: str
    dst: str
    output: int  # which output of src
    nbytes: float  # global bytes of the value, at the training dtype
    kind: EdgeKind
    input_pos: int

    def have(self, a: Strategy) -> Placements | None:
        """The placement ``src`` makes the value in under its strategy ``a`` (None: not a tensor)."""
        return a.outputs[self.output] if self.output < len(a.outputs) else None

    def need(self, b: Strategy) -> Placements | None:
        """The placement ``dst`` needs the value in under its strategy ``b`` (None: not a tensor)."""
        if self.input_pos < 0:
            return b.outputs[0]
        return b.inputs[self.input_pos] if self.input_pos < len(b.inputs) else None


@dataclass
class ShardingProblem:
    """A StrategyProblem plus what is needed to read its answer back onto the graph."""

    problem: StrategyProblem
    nodes: list[str]  # problem node index -> graph node name
    strategies: list[list[Strategy]]  # per problem node
    edge_info: list[EdgeInfo]  # per problem edge
    grad_edges: list[int] = field(default_factory=list)  # indices of gradient-synchronisation edges
    backward_nodes: list[int] = field(default_factory=list)
    param_nodes: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)  # global FLOPs per problem node
    # per parameter node, per strategy: (parameter, gradient, optimizer state) bytes, and the seconds of
    # its cost that are a ZeRO-1/2 all-gather rather than the optimizer update
    state_parts: dict[int, list[tuple[float, float, float]]] = field(default_factory=dict)
    param_comm: dict[int, list[float]] = field(default_factory=dict)
    dp_dim: int | None = 0
    # the gradients' memory items (positions in problem.memory_items: sized by the parameters, not the
    # batch); the graph's facts and the micro-batch count, for autopar.search.sharding.step_memory
    grad_items: list[int] = field(default_factory=list)
    facts: GraphFacts | None = None
    microbatches: int = 1
    # nodes that replay a forward op in the backward (made by autopar.search.sharding.recompute): hardware FLOPs,
    # not model FLOPs
    replayed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EdgeCollective:
    """One collective a chosen answer implies: on the edge ``src`` -> ``dst`` over mesh dim ``mesh_dim``.

    ``reason`` is the edge's kind, or "zero" for a ZeRO-1/2 parameter gather after the step.
    """

    kind: str
    mesh_dim: int
    bytes: float
    src: str
    dst: str
    reason: str


def charged_collectives(sp: ShardingProblem, choice: list[int], mesh_shape: tuple[int, ...]) -> list[EdgeCollective]:
    """Every collective the chosen strategies imply, one record per edge that communicates."""
    out = []
    for e, (iu, iv) in enumerate(sp.problem.edges):
        info = sp.edge_info[e]
        b = sp.strategies[iv][choice[iv]]
        have, need = info.have(sp.strategies[iu][choice[iu]]), info.need(b)
        if have is None or need is None:
            continue
        zero = b.zero if info.input_pos < 0 else 0
        for coll, d, size in grad_sync_steps(have, need, zero, info.nbytes, mesh_shape, sp.dp_dim) or []:
            out.append(EdgeCollective(coll, d, size, info.src, info.dst, info.kind))
    for i in sp.param_nodes:
        s = sp.strategies[i][choice[i]]
        if s.zero:
            local = sp.state_parts[i][choice[i]][0]
            name = sp.nodes[i]
            assert sp.dp_dim is not None  # a ZeRO strategy exists only with a data-parallel dim
            out.append(EdgeCollective("all_gather", sp.dp_dim, local, name, name, "zero"))
    return out
