"""The sharding problem as the search holds it: the solver's numbers plus the map back onto the graph.

:mod:`autopar.search.sharding.problem` builds it, and the modules that read an
answer back (:mod:`autopar.search.sharding.step_memory`, the mesh search, the
pipeline search) take it; it lives in its own module so that they need not
import the builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from autopar.capture.joint import extend_gradient_chain
from autopar.core.mesh import SHARDING_AXES
from autopar.core.placements import Placements
from autopar.cost_models.comm import collective_time
from autopar.cost_models.reshard import grad_sync_steps
from autopar.search.sharding.graph_facts import GraphFacts
from autopar.search.sharding.node_strategies import Strategy
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
    # a gradient's reduction runs in the plan's reduce dtype: bytes per byte of the training dtype
    # (:func:`autopar.capture.joint.gradient_chain`; fp32 reductions of bf16 gradients: 2)
    reduce_scale: float = 1.0

    def moved_bytes(self, have: Placements | None, need: Placements | None) -> float:
        """Global bytes the move from ``have`` to ``need`` works on: a gradient's reduction in the reduce dtype.

        The runtime casts a gradient on the chain up before a reduction and keeps it
        there, and returns every gradient in the reduce dtype
        (:class:`autopar.codegen.shard_interpreter.GradientCasts`): its own synchronisation
        edge moves it in that dtype whatever the move.
        """
        if self.reduce_scale == 1.0 or have is None or need is None:
            return self.nbytes
        reduces = any(h.is_partial() and not n.is_partial() for h, n in zip(have, need, strict=True))
        return self.nbytes * self.reduce_scale if reduces or self.kind == "grad-sync" else self.nbytes

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
    # per problem node, the number of its strategy list: nodes with equal numbers hold the same strategies
    # in the same order (the copies of a repeated layer)
    list_ids: list[int] = field(default_factory=list)
    # per problem edge, how many edges of the graph it stands for (a folded problem's,
    # autopar.search.sharding.fold: its costs are already multiplied; the bytes it moves are not); None: one each
    edge_weight: list[float] | None = None
    # per problem node, how many nodes of the graph it stands for (a folded problem's: its costs and
    # state_parts are already multiplied); None: one each
    node_weight: list[float] | None = None
    # a folded problem's template problem as built, every layer counted once (its nodes and indices are this
    # problem's): what one layer's figures are read from
    template: ShardingProblem | None = None
    # a folded problem's phantom layers (autopar.search.sharding.fold): how many, and where their values live
    phantoms: PhantomLayers | None = None
    # (node, strategy) -> (its cost, the micro-batch counts it holds at): a strategy that holds at some counts
    # alone (``Strategy.only_at``), forbidden in ``problem`` at every other count
    held: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = field(default_factory=dict)
    # the ``held`` strategies ``problem`` allows, those of its micro-batch count
    reopened: tuple[tuple[int, int], ...] = ()
    # the fixed state's nodes (buffers, frozen parameters): like the parameters', their memory is held over the
    # whole step, the same at any micro-batch count, and counted with the parameters'
    state_nodes: list[int] = field(default_factory=list)

    @property
    def held_nodes(self) -> list[int]:
        """The parameters' and the fixed state's nodes: the memory the model holds for the whole step."""
        return [*self.param_nodes, *self.state_nodes]


@dataclass(frozen=True)
class PhantomLayers:
    """The middle layers a folded problem adds as phantoms, ``count`` of them, and the template's marks that
    place their values (:mod:`autopar.search.sharding.fold`): T1's forward start, T2's forward end, T2's
    backward start, T1's backward end, and the step's end."""

    count: int
    f1: int
    f2_end: int
    b2: int
    b1_end: int
    end: int

    def span(self, start: int, stop: int) -> tuple[int, int] | None:
        """Where a phantom layer's copy of a value T1 holds over [start, stop) is live, or None when it is
        not live at a time the template shows (the fold's module docstring)."""
        s2 = start if start < self.f1 else (self.f1 if start < self.b2 else (self.b1_end if start < self.b1_end else start))
        e2 = self.f1 if stop <= self.f2_end else (self.b1_end if stop <= self.b1_end or stop < self.end else stop)
        return (s2, e2) if s2 < e2 else None


def parameter_sourced(sp: ShardingProblem) -> set[str]:
    """Names of the problem's parameters and of the views of them (a transpose): what moving moves a parameter.

    A parameter moved to an op (ZeRO-3's all-gather) is moved again for every
    micro-batch, since each runs the graph once, and is overlapped with the pass
    that reads it, as FSDP prefetches; an activation's move is neither.
    """
    out = {sp.nodes[i] for i in sp.held_nodes}  # a frozen parameter's moves are a parameter's too
    if sp.facts is None:
        return out
    for name in sp.nodes:  # graph order: a view comes after what it views
        node = sp.facts.by_name[name]
        src = node.args[0] if node.args else None
        if sp.facts.view.get(name) and getattr(src, "name", None) in out:
            out.add(name)
    return out


def gradient_chain(sp: ShardingProblem) -> set[str]:
    """Names of the nodes that only make parameter gradients: the gradients, and backward nodes whose every
    reader is one of them and as large (a bias's ``sum`` then its ``view``, a norm's ``getitem``; not the
    activation a weight gradient's matmul reads, whose moves are on the backward's critical path).

    Moving such a value is gradient synchronisation wherever on the chain the
    solver puts it: it overlaps with the rest of the backward and is sent in
    buckets, like the reduction on the gradient's own edge.
    """
    out = {sp.edge_info[e].src for e in sp.grad_edges}
    if sp.facts is None:
        return out
    return extend_gradient_chain(list(sp.facts.by_name.values()), out)


def per_microbatch_grad_sync(sp: ShardingProblem, strategy: Strategy) -> bool:
    """Whether a parameter under ``strategy`` has its gradient reduced once per micro-batch, not once per step.

    ZeRO-2 reduce-scatters each micro-batch's gradient so as to keep only its
    shard, and so does a parameter sharded over the data-parallel axis (ZeRO-3);
    plain data parallelism and ZeRO-1 accumulate the whole gradient and reduce
    it once.
    """
    out = strategy.outputs[0]
    dp_sharded = sp.dp_dim is not None and out is not None and not out[sp.dp_dim].is_replicate()
    return strategy.zero == 2 or dp_sharded


TP_DIM = SHARDING_AXES.index("tp")
"""The mesh dim of the tensor-parallel axis in a per-op placement list."""


def tp_seconds(
    info: EdgeInfo, a: Strategy, b: Strategy, mesh_shape: tuple[int, ...], links: list, dp_dim: int | None
) -> float:
    """Seconds of a data edge's move (source under ``a``, reader under ``b``) that run on the tensor-parallel axis.

    The collectives of one edge can span both mesh dims (a batch split over dp
    gathered while a hidden dim is reduced over tp); only the tp axis's are
    tensor-parallel collectives a runtime may overlap with GEMMs
    (:mod:`autopar.cost_models.overlap`).
    """
    have, need = info.have(a), info.need(b)
    if have is None or need is None or len(mesh_shape) <= TP_DIM or mesh_shape[TP_DIM] == 1:
        return 0.0
    steps = grad_sync_steps(have, need, 0, info.moved_bytes(have, need), mesh_shape, dp_dim) or []
    return sum(collective_time(k, size, mesh_shape[d], links[d]) for k, d, size in steps if d == TP_DIM)


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
        nbytes = info.moved_bytes(have, need)
        for coll, d, size in grad_sync_steps(have, need, zero, nbytes, mesh_shape, sp.dp_dim) or []:
            out.append(EdgeCollective(coll, d, size, info.src, info.dst, info.kind))
    for i in sp.param_nodes:
        s = sp.strategies[i][choice[i]]
        if s.zero:
            local = sp.state_parts[i][choice[i]][0]
            name = sp.nodes[i]
            assert sp.dp_dim is not None  # a ZeRO strategy exists only with a data-parallel dim
            out.append(EdgeCollective("all_gather", sp.dp_dim, local, name, name, "zero"))
    return out
