"""The Plan: what autopar decided, as plain data.

A Plan is the hand-off between planning (which needs no process group and
no accelerator) and running (``autopar.parallelize`` inside each rank). It
holds only JSON-able values so that it can be saved, diffed, reviewed and
loaded by another process or another version of autopar. Nothing in it
refers to torch objects.

Placements are :class:`~autopar.core.placements.Placement` values in memory and
their plain form (``"S(0)"``) in JSON: :meth:`PlanData.from_dict` reads them
and :meth:`PlanData.to_dict` writes them, so no other module reads that form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from autopar.core.errors import PlanFormatError
from autopar.core.mesh import MESH_AXES, SHARDING_AXES, SHARED_AXES
from autopar.core.placements import Placements, parse_all, texts
from autopar.cost_models.estimate import Estimate, MemoryEstimate
from autopar.plans.format import GB, count, secs
from autopar.plans.records import SearchRecord

FORMAT_VERSION = 3
"""3: the search record's collectives, per-op records and sharding facts are typed records
(:mod:`autopar.plans.op_records`), written under their fields' names; 2: ``solver`` is a
:class:`~autopar.plans.records.SearchRecord` holding those as loose dicts; 1: a loose dict.
Every earlier format is still read."""


@dataclass
class PlanData:
    """A parallel training configuration for one model on one cluster: the fields, JSON in and out.

    :class:`autopar.Plan` adds the views (summary, explain, report).
    """

    model: str
    fingerprint: str  # hash of parameter names and shapes: refuses a plan made for another model
    num_params: int  # elements of the parameters that train
    cluster: dict[str, Any]  # Cluster.to_dict()
    cluster_description: str
    mesh: dict[str, int]  # {"dp": .., "tp": .., "pp": ..}
    zero: int = 0
    recompute: str = "none"
    microbatches: int = 1
    global_batch_size: int = 1
    micro_batch_size: int = 1
    precision: str = "bf16-mixed"
    reduce_dtype: str = "fp32"  # dtype of the gradient reductions under mixed precision
    optimizer: str = "adamw"
    # node -> {"op", "module", "outputs", "inputs", ...}: "outputs" and "inputs" list Placements (or None) per tensor
    placements: dict[str, Any] = field(default_factory=dict)
    stages: list[Any] = field(default_factory=list)  # pipeline stages: {"first": forward node, ...} each
    schedule: str = ""  # pipeline schedule ("1F1B", "GPipe", "interleaved"); "" without a pipeline
    estimate: Estimate = field(default_factory=Estimate)
    solver: SearchRecord = field(default_factory=SearchRecord)  # how the search found it
    warnings: list[str] = field(default_factory=list)
    # elements of the parameters that do not train (a fine-tune's frozen base weights): held as fixed state, their
    # memory in the estimate's params, never stepped
    frozen_params: int = 0
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-able values, placements in their plain form."""
        body = asdict(replace(self, placements={}, solver=SearchRecord()))
        body["placements"] = {node: _entry_json(e, texts) for node, e in self.placements.items()}
        body["solver"] = self.solver.to_dict()
        return body

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> PlanData:
        if not isinstance(data, dict):
            raise PlanFormatError(
                f"{source} is not a plan: expected a JSON object, got {type(data).__name__}"
            )
        version = data.get("format_version")
        if not isinstance(version, int):
            raise PlanFormatError(f"{source} is not an autopar plan: it has no integer 'format_version'")
        if version > FORMAT_VERSION:
            raise PlanFormatError(
                f"{source} has plan format {version}, newer than this autopar reads ({FORMAT_VERSION}); "
                "upgrade autopar to load it"
            )
        try:
            body = dict(data)
            est = dict(body.pop("estimate", {}) or {})
            mem = MemoryEstimate(**(est.pop("memory", {}) or {}))
            # plans written before HFU was a figure of its own: read as counting no recompute
            est.setdefault("hfu", est.get("mfu", 0.0))
            est.setdefault("hardware_flops", est.get("model_flops", 0.0))
            body["estimate"] = Estimate(memory=mem, **est)
            body["solver"] = SearchRecord.from_dict(body.get("solver"), version)
            body["format_version"] = FORMAT_VERSION  # read into this version's form
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(body) - known)
            if unknown:
                raise TypeError(f"unexpected field(s) {', '.join(unknown)}")
            plan = cls(**body)
        except TypeError as err:
            raise PlanFormatError(f"{source} is malformed: {_short_type_error(err)}") from None
        try:
            plan.placements = {node: _entry_json(e, parse_all) for node, e in plan.placements.items()}
        except (ValueError, TypeError, AttributeError) as err:
            raise PlanFormatError(f"{source} is malformed: {err}") from None
        for key in MESH_AXES:
            if not isinstance(plan.mesh.get(key), int) or plan.mesh[key] < 1:
                raise PlanFormatError(f"{source} is malformed: mesh needs a positive integer '{key}'")
        return plan

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PlanData:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as err:
            raise PlanFormatError(f"cannot read plan file {path}: {err.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanFormatError(f"{path} is not valid JSON (line {err.lineno}: {err.msg})") from None
        return cls.from_dict(data, source=str(path))

    # ---- reading ------------------------------------------------------------------------------

    def mesh_str(self) -> str:
        shared = [f"{k}={self.mesh[k]}" for k in SHARED_AXES if self.mesh.get(k, 1) > 1]
        return " x ".join(f"{k}={self.mesh[k]}" for k in MESH_AXES) + "".join(f" ({s})" for s in shared)

    def stage_rows(self) -> list[dict[str, str]]:
        """Each pipeline stage as text: stage, device, what it holds, params, forward, backward, peak memory."""
        pp = max(self.mesh.get("pp", 1), 1)
        rows = []
        for i, st in enumerate(self.stages):
            names = [n for n in st.get("segments", []) if n]
            holds = (
                names[0]
                if len(names) == 1
                else (f"{names[0]} .. {names[-1]}" if names else st.get("first", ""))
            )
            rows.append(
                {
                    "stage": str(i),
                    "device": str(st.get("device", i % pp)),
                    "holds": holds,
                    "params": count(st["params"]) if st.get("params") else "-",
                    "forward": secs(st["forward_s"]) if "forward_s" in st else "-",
                    "backward": secs(st["backward_s"]) if "backward_s" in st else "-",
                    "peak memory (GB)": f"{st['memory_bytes'] / GB:.2f}" if "memory_bytes" in st else "-",
                }
            )
        return rows

    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh dims placements are written over (pipeline stages are not a placement dim)."""
        return SHARDING_AXES

    def param_placements(self) -> dict[tuple[str, Placements], int]:
        """(parameter name with layer numbers folded to '*', placement per mesh dim) -> how many parameters."""
        out: dict[tuple[str, Placements], int] = {}
        for entry in self.placements.values():
            if "param" not in entry:
                continue
            name = re.sub(r"\.\d+\.", ".*.", entry["param"], count=1)
            key = (name, tuple(entry["outputs"][0]))
            out[key] = out.get(key, 0) + 1
        return out


def param_zero_stage(entry: dict[str, Any]) -> int:
    """A parameter's ZeRO stage from its entry: 3 when its placement shards it over dp, else its own ``"zero"``.

    ZeRO-3 is a placement (the parameter sharded over the dp mesh dim, the first),
    so the entry of a sharded parameter writes no stage; a replicated one writes 0, 1 or 2.
    """
    outs = entry.get("outputs") or [None]
    if outs[0] is not None and not outs[0][0].is_replicate():
        return 3
    return int(entry.get("zero", 0) or 0)


def _entry_json(entry: dict[str, Any], convert: Callable[[Any], Any]) -> dict[str, Any]:
    """``entry`` with ``convert`` applied to each placement list of its outputs and inputs (None stays None)."""
    out = dict(entry)
    for key in ("outputs", "inputs"):
        if key in out:
            out[key] = [None if p is None else convert(p) for p in out[key]]
    return out


def _short_type_error(err: TypeError) -> str:
    msg = str(err)
    # "__init__() got an unexpected keyword argument 'x'" -> "unexpected keyword argument 'x'"
    return msg.split(") ", 1)[-1] if "__init__()" in msg else msg
