"""What the search did to reach a plan, as typed records the plan keeps (``plan.solver``).

The planner writes a :class:`SearchRecord`; the summary, the report, ``explain``
and ``diff`` read its fields. Its JSON form is its fields; plans of format 1 kept
the same facts as a loose dict (each mesh's phase timings flattened into its
entry), and plans of formats 1 and 2 kept the charged collectives and the per-op
records as loose dicts (:mod:`autopar.plans.op_records`), which
:meth:`SearchRecord.from_dict` still reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from autopar.core.mesh import MESH_AXES
from autopar.plans.op_records import ChargedCollective, OpRecords


def mesh_text(mesh: dict[str, int]) -> str:
    """``dp=4 x tp=2 x pp=1``."""
    return " x ".join(f"{k}={mesh.get(k, 1)}" for k in MESH_AXES)


def batch_line(plan) -> str:
    """How the plan's global batch is cut: ``global 256 = micro-batch 2 x 4 micro-batches x dp 32``, or, where
    a micro-batch has fewer sequences than dp has ranks (context parallelism over them), how its
    sequences are split instead."""
    dp, m, mbs = plan.mesh["dp"], plan.microbatches, plan.micro_batch_size
    if dp * m * mbs == plan.global_batch_size:
        return f"global {plan.global_batch_size} = micro-batch {mbs} x {m} micro-batches x dp {dp}"
    return (
        f"global {plan.global_batch_size} = micro-batch {mbs} x {m} micro-batches, every sequence split over "
        f"the dp axis's {dp} ranks (cp)"
    )


@dataclass
class MeshRecord:
    """One mesh (and micro-batch count) the search costed, and what it found there."""

    mesh: dict[str, int]
    microbatches: int = 1
    status: str = ""
    source: str = "milp"  # who found the answer: the MILP, or a hand-set seed layout
    step_time_s: float = 0.0
    peak_bytes: float = 0.0
    fits: bool = True
    schedule: str = ""  # the pipeline schedule on a pipeline mesh
    timings: dict[str, float] = field(default_factory=dict)  # seconds per search phase on this mesh

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeshRecord:
        known = {f.name for f in fields(cls)}
        body = {k: v for k, v in data.items() if k in known}
        timings = {k: v for k, v in data.items() if k not in known and isinstance(v, (int, float))}
        return cls(**{**body, "timings": {**timings, **(body.get("timings") or {})}})


@dataclass
class Alternative:
    """The best configuration of one ZeRO stage: what the chosen plan won against."""

    mesh: dict[str, int]
    zero: int
    microbatches: int
    step_time_s: float
    peak_bytes: float
    fits: bool


@dataclass
class PipelineRecord:
    """The chosen pipeline: its schedule, stages per device, whether its cuts were solved exactly."""

    schedule: str
    chunks: int
    exact: bool
    bubble_fraction: float


@dataclass
class ShardingFacts:
    """What the summary's sharding lines read: parameter elements by ZeRO stage and by the axes that split them.

    Kept because placements hold no shapes; made by :func:`autopar.plans.summary.sharding_facts`.
    ``split_elements`` is keyed by the mesh axes joined with "+" ("none": whole on every device).
    """

    param_elements: int = 0
    zero_elements: dict[int, int] = field(default_factory=dict)
    split_elements: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardingFacts:
        """From JSON, where the ZeRO stages are text keys."""
        return cls(
            param_elements=int(data.get("param_elements", 0)),
            zero_elements={int(z): n for z, n in (data.get("zero_elements") or {}).items()},
            split_elements=dict(data.get("split_elements") or {}),
        )


@dataclass
class SearchRecord:
    """How the plan was found: the solver's verdict on the chosen mesh and every mesh costed.

    ``gap`` is the solver's proven relative gap on the chosen mesh (None: no bound);
    ``charged`` the collectives the chosen placements cause; ``ops`` the per-op
    records ``explain`` reads (:mod:`autopar.search.sharding.explain_records`);
    ``sharding`` the facts the summary's sharding lines read.
    """

    status: str = ""
    gap: float | None = None
    objective: float | None = None
    backend: str = ""
    source: str = ""
    candidates: int | None = None  # configurations costed (the data-parallel path)
    meshes_left_out: int = 0  # meshes not searched: past the time limit, or tp across nodes ruled out
    meshes: list[MeshRecord] = field(default_factory=list)
    alternatives: list[Alternative] = field(default_factory=list)
    pipeline: PipelineRecord | None = None
    charged: list[ChargedCollective] = field(default_factory=list)
    graph_nodes: int | None = None
    nodes_after_reduction: int | None = None
    ops: OpRecords | None = None
    sharding: ShardingFacts | None = None
    capture_s: float | None = None
    time_s: float | None = None
    time_limit_s: float | None = None  # the plan's time limit (the whole call, capture included)
    stopped: str = ""  # why the search left meshes out ("every mesh costed" when it did not)
    # why the plan splits the sequence for attention where nothing fixed it: what did not fit without that
    context_parallel_why: str = ""

    def __bool__(self) -> bool:
        return bool(self.status)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(replace(self, charged=[], ops=None))
        body["charged"] = [c.to_dict() for c in self.charged]
        body["ops"] = self.ops.to_dict() if self.ops is not None else None
        return body

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, version: int) -> SearchRecord:
        """A record from the JSON of plan format ``version`` (format 1's loose dict too; unknown keys dropped)."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        body = {k: v for k, v in data.items() if k in known}
        body["meshes"] = [MeshRecord.from_dict(m) for m in body.get("meshes") or []]
        body["alternatives"] = [Alternative(**a) for a in body.get("alternatives") or []]
        if body.get("pipeline"):
            body["pipeline"] = PipelineRecord(**body["pipeline"])
        body["charged"] = [ChargedCollective.from_dict(c, version) for c in body.get("charged") or []]
        body["ops"] = OpRecords.from_dict(body["ops"], version) if body.get("ops") else None
        body["sharding"] = ShardingFacts.from_dict(body["sharding"]) if body.get("sharding") else None
        return cls(**body)

    def mesh_record(self, mesh: dict[str, int]) -> MeshRecord | None:
        """The record of ``mesh`` (the chosen one, for a plan's own mesh), if it was searched."""
        for r in self.meshes:
            if all(r.mesh.get(k, 1) == mesh.get(k, 1) for k in MESH_AXES):
                return r
        return None


def solver_line(record: SearchRecord, mesh: dict[str, int] | None = None) -> str:
    """Status, gap of the linear objective against the solver's bound, who found the answer, the time
    spent against the limit, and why the search left meshes out."""
    parts = [record.status or "?"]
    if record.gap is not None:
        parts.append(f"gap {record.gap * 100:.2g}%")
    chosen = record.mesh_record(mesh) if mesh is not None else None
    if chosen is not None and chosen.source != "milp":
        parts.append(f"found by the {chosen.source} seed")
    if record.candidates is not None:
        parts.append(f"{record.candidates} configurations costed")
    if record.time_s is not None:
        limit = f" of the {record.time_limit_s:g} s limit" if record.time_limit_s is not None else ""
        parts.append(f"{record.time_s:.2f} s{limit}")
    line = ", ".join(parts)
    return f"{line}; {record.stopped}" if record.stopped else line


@dataclass(frozen=True)
class Fixed:
    """The part of the answer a user forces with ``autopar.plan(..., fixed=...)``; None: searched.

    Made once, by :func:`autopar.api.fixed.check_fixed`, from the user's dict; every
    layer below reads its fields.
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    recompute: str | None = None  # "none", "selective" or "full"; None: op by op
    microbatches: int | None = None
    schedule: str | None = None
    ep: int | None = None  # experts split over this many ranks of the dp or the second (tp) axis
    cp: int | None = None  # attention's queries split on the sequence over this many ranks of dp or tp

    def given(self) -> dict[str, Any]:
        """The keys the user fixed, with their values (for messages)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __bool__(self) -> bool:
        return bool(self.given())
