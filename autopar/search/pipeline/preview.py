"""A quick preview of each pipeline mesh's step time: the order in which the search costs them.

Costing one pp × dp × tp mesh means building and solving its sharding problem
(seconds at scale), and a large cluster has dozens of such meshes, more than a
time limit allows.  The preview ranks them without solving: the segment figures
of a sharding already solved for the same tp (a dp × tp mesh without a pipeline,
or a pipeline mesh costed earlier) are scaled to the mesh's micro-batch size,
and a pipeline of near-even layer cuts is priced under 1F1B
(:mod:`autopar.cost_models.pipeline`) at each micro-batch count the search would
try.  Only the order depends on it: every mesh the search keeps is costed by
its own solve.  Figures of different tp compare poorly until a pipeline of
each was costed, so a mesh of each promising tp goes first (see ``order``).

The figures carry over imperfectly (a mesh without a pipeline holds every
layer's states, so it may have chosen ZeRO-3 or recompute where a stage needs
neither), which is why a costed pipeline mesh replaces them for its tp.
"""

from __future__ import annotations

import logging
import math

from autopar.capture.joint import CapturedGraph
from autopar.cost_models.comm import collective_time
from autopar.cost_models.memory import Precision
from autopar.cost_models.pipeline import Segment, pipeline_memory, pipeline_time
from autopar.hardware.cluster import Cluster, MeshShape
from autopar.search.pipeline.segments import layer_figures, microbatch_counts, rescale
from autopar.search.pipeline.stages import GraphSegment, forward_segments
from autopar.search.sharding.mesh import HOPELESS
from autopar.search.sharding.request import activation_scale, mesh_links

log = logging.getLogger(__name__)

# Added to a previewed step that does not fit in memory: such meshes are costed after those that fit.
UNFIT = 1e9

# HOPELESS (autopar.search.sharding.mesh): a mesh previewed this much slower than the best plan costed is
# not costed. Previews priced under 1F1B and carried over from another mesh's sharding are within about 5%
# of the costed step at LLaMA-7B scale (interleaving, costed, gains about 4% more).

CARRIED_SLOW = 0.15
"""How much slower than costed a pipeline previews from the figures of a mesh without one
(which holds every layer's states, so may have chosen ZeRO-3 or recompute where a stage needs
neither): GPT 39B on 512 A100s, tp = 8 previewed past the fastest costed tp = 4 pipeline's
8.97 s and costed 8.65 s. The first pipeline of a tp is hopeless only past this margin too."""


def near_even_cuts(graph_segments: list[GraphSegment], pieces: int) -> list[int] | None:
    """Cuts giving ``pieces`` stages as equal a number of layers as they divide into (None: too few layers)."""
    layers = [i for i, s in enumerate(graph_segments) if s.name.rsplit(".", 1)[-1].isdigit()]
    if len(layers) < pieces:
        return None
    return [layers[(k * len(layers)) // pieces] for k in range(1, pieces)]


class Preview:
    """Segment figures per tensor-parallel size, and the previewed step of a mesh from them."""

    def __init__(self, captured: CapturedGraph, cluster: Cluster, precision: Precision, memory_limit: float):
        self.captured, self.cluster, self.memory_limit = captured, cluster, memory_limit
        self.graph_segments = forward_segments(captured)
        self.activation_scale = activation_scale(captured, precision)
        self.figures: dict[int, tuple[list[Segment], float]] = {}  # tp -> segments, their micro-batch size
        self.tried: set[int] = set()  # tensor-parallel sizes a pipeline mesh was costed for
        self.costed_shapes: set[tuple[int, int]] = set()  # (pp, tp) of every pipeline mesh costed
        self.best_recomputed = False  # whether the fastest costed pipeline recomputes activations
        self.best: tuple[float, int] = (math.inf, 0)  # the fastest pipeline costed: step, tp
        self.best_mesh: MeshShape | None = None
        self.flat_best = math.inf  # the fastest mesh without a pipeline that fits

    def learn_flat(self, results) -> None:
        """Take the figures of solved dp × tp meshes (``ShardingResult``), one per tp not yet known."""
        for r in results:
            if r.solution.choice and r.estimate.fits:
                self.flat_best = min(self.flat_best, r.estimate.step_time_s)
            if not r.solution.choice or r.mesh.tp in self.figures:
                continue
            segs = layer_figures(
                self.captured,
                r.sp,
                r.solution.choice,
                self.graph_segments,
                (r.mesh.dp, r.mesh.tp),
                r.microbatches,
                self.activation_scale,
                mesh_links(self.cluster, r.mesh),
            )
            self.learn(r.mesh, segs, r.microbatches)

    def learn(self, mesh: MeshShape, segments: list[Segment], microbatches: int) -> None:
        """Figures of ``mesh``'s solved sharding at ``microbatches``: they now stand for its tp."""
        self.figures[mesh.tp] = (segments, self.captured.batch_size / (mesh.dp * microbatches))

    def costed(self, mesh: MeshShape, step_s: float | None, recomputed: bool = False) -> None:
        """``mesh`` was costed as a pipeline: its step (None when nothing on it fits), and whether
        its answer recomputes activations (which fewer states per device might spare it)."""
        self.tried.add(mesh.tp)
        self.costed_shapes.add((mesh.pp, mesh.tp))
        if step_s is not None and step_s < self.best[0]:
            self.best = (step_s, mesh.tp)
            self.best_mesh = mesh
            self.best_recomputed = recomputed

    def step(self, mesh: MeshShape) -> float | None:
        """The previewed step time of a pipeline on ``mesh`` (plus UNFIT if it does not fit), or None."""
        if mesh.tp not in self.figures:
            return None
        cuts = near_even_cuts(self.graph_segments, mesh.pp)
        if cuts is None:
            return None
        segs, size = self.figures[mesh.tp]
        link = self.cluster.axis_link(mesh, "pp")

        def p2p(nbytes: float) -> float:
            return collective_time("send_recv", nbytes, 2, link) if nbytes > 0 else 0.0

        best = math.inf
        for m in microbatch_counts(self.captured.batch_size // mesh.dp, mesh.pp, None):
            # rescale's figures scale with new / old micro-batch size (given as the sizes, not the counts)
            scaled = rescale(segs, self.captured.batch_size / (mesh.dp * m), size)
            t = pipeline_time(scaled, cuts, m, "1F1B", p2p, 1).step_s
            if max(pipeline_memory(scaled, cuts, m, "1F1B", 1)) > self.memory_limit:
                t += UNFIT
            best = min(best, t)
        return best if math.isfinite(best) else None

    def hopeless(self, mesh: MeshShape) -> bool:
        """Whether ``mesh`` previews more than ``HOPELESS`` slower than the best plan costed so far.

        Meshes go in previewed order, so the meshes after it preview slower still: the
        search stops there. A mesh without a preview is never hopeless, nor is the first
        pipeline of a tp that ``order`` puts first (any tp before a pipeline was costed, then
        half or twice the fastest one's): its figures come from a mesh without a pipeline,
        which holds every layer's states and may have chosen ZeRO-3 or recompute where a
        stage needs neither, and so preview it up to ``CARRIED_SLOW`` slow: such a mesh is hopeless
        only past that margin too (LLaMA-7B on 64 H100s, batch 256: the first pipelines of tp = 4,
        8 and 2 previewed 42-51% slower than the 0.849 s plan without a pipeline, and costed
        27-54% slower, 7.6 s of a 26-s search).
        """
        if self._deeper(mesh):
            return False
        margin = 1 + HOPELESS
        if mesh.tp not in self.tried and mesh.tp in self._wanted():
            margin *= 1 + CARRIED_SLOW
        step = self.step(mesh)
        best = min(self.best[0], self.flat_best)
        return step is not None and math.isfinite(best) and step > best * margin

    def _deeper(self, mesh: MeshShape) -> bool:
        """Whether ``mesh`` has the fastest costed pipeline's tp and twice its stages, and was not costed.

        The figures of a costed pipeline carry the recompute its stages' memory forced; twice
        the stages hold half the states per device and may need less, so when that pipeline
        recomputes, such a
        mesh previews slow (LLaMA-3-405B on 16,384 H100s: pp = 16 previewed more than 10% slower
        than pp = 8's 13.0 s, and costs 10.1 s). It is costed however it previews, as the first
        pipeline of a neighbouring tp is.
        """
        best = self.best_mesh
        return (
            best is not None
            and self.best_recomputed
            and mesh.tp == best.tp
            and mesh.pp == 2 * best.pp
            and (mesh.pp, mesh.tp) not in self.costed_shapes
        )

    def _wanted(self) -> set[int]:
        """The tensor-parallel sizes whose first pipeline goes ahead of the previewed order (see ``order``)."""
        if math.isfinite(self.best[0]):
            return {self.best[1] * 2, self.best[1] // 2} - self.tried
        return set(self.figures) - self.tried

    def order(self, meshes: list[MeshShape]) -> list[MeshShape]:
        """``meshes`` by previewed step, fastest first; those with no preview after them, in their order.

        Figures of one tp compare poorly with another's until a pipeline of each was
        costed, so some meshes go first, the best-previewed (or else the first) of their
        tp: before any mesh was costed, one of each tp with figures; after, the mesh of
        the fastest pipeline's tp previewed faster than that pipeline's own mesh, if
        any, then the mesh of that tp with twice its stages (:meth:`_deeper`), then one of each tp
        not yet tried next to (half or twice) that tp.
        """
        steps = {m: self.step(m) for m in meshes}
        ahead = sorted((m for m in meshes if steps[m] is not None), key=lambda m: steps[m])
        rest = [m for m in meshes if steps[m] is None]
        log.debug("pipelines previewed: %s", ", ".join(f"{m.pp}x{m.dp}x{m.tp} {steps[m]:.4g}" for m in ahead))
        wanted = self._wanted()
        lead: dict[int, MeshShape] = {}
        for m in ahead + rest:
            if m.tp in wanted:
                lead.setdefault(m.tp, m)
        first = list(lead.values())
        if self.best_mesh is not None:
            own = self.step(self.best_mesh)
            better = [m for m in ahead if m.tp == self.best[1] and own is not None and steps[m] < own]
            deeper = [m for m in meshes if self._deeper(m)]
            first = better[:1] + deeper[:1] + first
        return first + [m for m in ahead + rest if m not in first]
