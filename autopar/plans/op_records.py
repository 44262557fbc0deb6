"""Per-op facts of a search, typed: the collectives it charged and the alternatives each op had.

The search writes these (:mod:`autopar.search.sharding.answer` the collectives,
:mod:`autopar.search.sharding.explain_records` the per-op records) and the plan's
views read them (``explain``, the report); they are plain data so that a plan file
carries them. Their JSON form leaves out fields at their defaults, which keeps a
plan of two thousand records small, and reads back to the same values.

Plans before format 3 wrote the same facts as loose dicts with other keys
("from", "to", "alts", "out", ...); ``from_dict(data, version)`` reads those too.
"""

from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

# plans of these formats wrote the per-op facts as loose dicts with the keys read by _legacy_* below
LEGACY_FORMATS = (1, 2)


def _compact(obj: Any) -> dict[str, Any]:
    """``obj``'s fields that differ from their defaults (the JSON form: small, and the same on reading)."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else MISSING)
        )
        if value != default:
            out[f.name] = copy.deepcopy(value)  # the JSON form shares nothing with the record
    return out


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of ``cls`` (a newer plan's extra keys are dropped)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class ChargedCollective:
    """One collective the chosen placements cause: on an edge ``src`` -> ``dst``, or a ZeRO parameter gather.

    ``reason`` says what needs it: "data" (an input needs another placement),
    "grad-sync", "buffer-update" or "zero". The module, phase and parameter fields
    are filled in for the plan's whole list (``SearchRecord.charged``); a per-op
    record's copy leaves them out.
    """

    kind: str
    axis: str = ""
    bytes: float = 0.0
    src: str = ""
    dst: str = ""
    reason: str = ""
    src_module: str = ""
    dst_module: str = ""
    phase: str = ""
    src_param: bool = False

    def touches(self, node: str) -> bool:
        """Whether it comes from or goes to ``node``."""
        return node in (self.src, self.dst)

    def to_dict(self) -> dict[str, Any]:
        return _compact(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], version: int) -> ChargedCollective:
        if version in LEGACY_FORMATS:
            data = _legacy_collective(data)
        return cls(**_known(cls, data))


def _legacy_collective(data: dict[str, Any]) -> dict[str, Any]:
    renamed = {
        "from": "src",
        "to": "dst",
        "from_module": "src_module",
        "to_module": "dst_module",
        "from_param": "src_param",
    }
    return {renamed.get(k, k): v for k, v in data.items()}


@dataclass
class OpAlternative:
    """One strategy an op had, costed with every other op as chosen: placements as text, seconds, bytes."""

    outputs: str  # the output placements, one "S(0),R" per output tensor joined by " | "
    inputs: list[str] = field(default_factory=list)  # what each input is brought to ("-": not a tensor)
    compute_s: float = 0.0
    comm_s: float = 0.0  # communication on the edges that touch the op
    memory: float = 0.0  # bytes the op holds: its output, or a parameter's value, state and gradient

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def to_dict(self) -> dict[str, Any]:
        return _compact(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], version: int) -> OpAlternative:
        if version in LEGACY_FORMATS:
            data = {
                "outputs": data.get("out", "-"),
                "inputs": data.get("in", []),
                "compute_s": data.get("compute_s", 0.0),
                "comm_s": data.get("comm_s", 0.0),
                "memory": data.get("mem", 0.0),
            }
        return cls(**_known(cls, data))


@dataclass
class OpRecord:
    """What the search knew about one op: its strategies, the chosen one first, and why it won.

    ``strategies`` is how many it had, ``forbidden`` how many of those were ruled out;
    ``copies`` the repeated layers that share the decision; ``param`` the parameter's
    name when the op is one.
    """

    op: str
    module: str = ""
    phase: str = ""
    flops: float = 0.0  # for the whole batch
    strategies: int = 0
    forbidden: int = 0
    alternatives: list[OpAlternative] = field(default_factory=list)
    why: str = ""
    param: str | None = None
    copies: int = 1
    collectives: list[ChargedCollective] = field(default_factory=list)

    @property
    def chosen(self) -> OpAlternative | None:
        """The strategy the plan took (listed first), if any was recorded."""
        return self.alternatives[0] if self.alternatives else None

    def to_dict(self) -> dict[str, Any]:
        body = _compact(self)
        if self.alternatives:
            body["alternatives"] = [a.to_dict() for a in self.alternatives]
        if self.collectives:
            body["collectives"] = [c.to_dict() for c in self.collectives]
        return body

    @classmethod
    def from_dict(cls, data: dict[str, Any], version: int) -> OpRecord:
        data = dict(data)
        if version in LEGACY_FORMATS:
            data["strategies"] = data.pop("n", 0)
            data["alternatives"] = data.pop("alts", [])
        body = _known(cls, data)
        body["alternatives"] = [OpAlternative.from_dict(a, version) for a in body.get("alternatives") or []]
        body["collectives"] = [ChargedCollective.from_dict(c, version) for c in body.get("collectives") or []]
        return cls(**body)


@dataclass
class OpRecords:
    """The per-op records of the chosen mesh's search (``plan.solver.ops``), bounded in size.

    A repeated layer's op is recorded once: ``same_as`` maps the other copies to the
    recorded one; ``dropped`` counts the ops left out past the limit.
    """

    axes: list[str] = field(default_factory=list)  # the mesh axes placements are written over
    mesh: dict[str, int] = field(default_factory=dict)
    source: str = ""  # who found the answer: the MILP, or a seed layout
    status: str = ""
    memory_limit: float = 0.0
    peak: float = 0.0
    records: dict[str, OpRecord] = field(default_factory=dict)
    same_as: dict[str, str] = field(default_factory=dict)
    dropped: int = 0

    def record_of(self, node: str) -> tuple[OpRecord | None, str]:
        """``node``'s record and the node it was recorded under (a repeated layer's first copy)."""
        rep = self.same_as.get(node, node)
        return self.records.get(rep), rep

    def knows(self, node: str) -> bool:
        """Whether ``node`` has a record, itself or through a copy."""
        return node in self.records or node in self.same_as

    def to_dict(self) -> dict[str, Any]:
        body = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "records"}
        body["records"] = {name: r.to_dict() for name, r in self.records.items()}
        return body

    @classmethod
    def from_dict(cls, data: dict[str, Any], version: int) -> OpRecords:
        body = _known(cls, data)
        body["records"] = {
            name: OpRecord.from_dict(r, version) for name, r in (body.get("records") or {}).items()
        }
        return cls(**body)
