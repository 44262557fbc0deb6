"""The Plan: what autopar decided, as plain data.

A Plan is the hand-off between planning (which needs no process group and
no accelerator) and running (``autopar.parallelize`` inside each rank). It
holds only JSON-able values so that it can be saved, diffed, reviewed and
loaded by another process or another version of autopar. Nothing in it
refers to torch objects.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from autopar.errors import PlanFormatError
from autopar.memory_summary import peak_line, summary_rows

FORMAT_VERSION = 1

GB = 1e9


@dataclass
class MemoryEstimate:
    """Bytes per device, by category. ``peak`` is what must fit in the device."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0  # communication buckets, gathered ZeRO-3 parameters, backward workspace
    peak: float = 0.0
    # what is live at the peak (params, optimizer, grads made so far, activations, buffers), and where it is
    at_peak: dict[str, float] = field(default_factory=dict)
    peak_at: str = ""

    @property
    def model_states(self) -> float:
        """Parameters + gradients + optimizer state: what the ZeRO paper counts."""
        return self.params + self.grads + self.optimizer


@dataclass
class Estimate:
    """The cost model's verdict on one configuration (per step, per device)."""

    step_time_s: float = 0.0
    samples_per_s: float = 0.0
    mfu: float = 0.0  # model FLOPs utilization: model_flops / (step time x devices x peak FLOP/s)
    hfu: float = 0.0  # hardware FLOPs utilization: the same with hardware_flops (recompute included)
    memory: MemoryEstimate = field(default_factory=MemoryEstimate)
    memory_limit: float = 0.0
    fits: bool = True
    compute_s: float = 0.0  # forward + backward compute, all micro-batches
    comm_s: float = 0.0  # total communication time (overlapped or not)
    exposed_comm_s: float = 0.0  # the part of comm_s that compute does not hide
    optimizer_s: float = 0.0
    recompute_s: float = 0.0  # the forward ops run again in the backward (part of compute_s)
    bubble_s: float = 0.0
    model_flops: float = 0.0  # per step, whole cluster, without recompute
    hardware_flops: float = 0.0  # per step, whole cluster, the forward ops recomputed included
    collectives: list[dict[str, Any]] = field(
        default_factory=list
    )  # {"kind", "axis", "bytes", "count", "time_s"}

    @property
    def hfu_differs(self) -> bool:
        """Whether HFU says more than MFU: the plan runs forward ops again, which MFU does not count."""
        return self.hfu > self.mfu * (1 + 1e-6)


@dataclass
class Plan:
    """A parallel training configuration for one model on one cluster."""

    model: str
    fingerprint: str  # hash of parameter names and shapes: refuses a plan made for another model
    num_params: int
    cluster: dict[str, Any]  # Cluster.to_dict()
    cluster_description: str
    mesh: dict[str, int]  # {"dp": .., "tp": .., "pp": ..}
    zero: int = 0
    recompute: str = "none"
    microbatches: int = 1
    global_batch_size: int = 1
    micro_batch_size: int = 1
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    placements: dict[str, Any] = field(default_factory=dict)  # op -> placement per mesh axis
    stages: list[Any] = field(default_factory=list)  # pipeline stages: {"first": forward node, ...} each
    schedule: str = ""  # pipeline schedule ("1F1B", "GPipe", "interleaved"); "" without a pipeline
    estimate: Estimate = field(default_factory=Estimate)
    solver: dict[str, Any] = field(default_factory=dict)  # status, objective, gap, candidates, time_s
    warnings: list[str] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    # ---- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> Plan:
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
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(body) - known)
            if unknown:
                raise TypeError(f"unexpected field(s) {', '.join(unknown)}")
            plan = cls(**body)
        except TypeError as err:
            raise PlanFormatError(f"{source} is malformed: {_short_type_error(err)}") from None
        for key in ("dp", "tp", "pp"):
            if not isinstance(plan.mesh.get(key), int) or plan.mesh[key] < 1:
                raise PlanFormatError(f"{source} is malformed: mesh needs a positive integer '{key}'")
        return plan

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
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
        return " x ".join(f"{k}={self.mesh[k]}" for k in ("dp", "tp", "pp"))

    def summary(self, width: int = 100) -> str:
        """A table a person reads: the configuration, time and memory per device."""
        from rich.console import Console
        from rich.table import Table

        est, mem = self.estimate, self.estimate.memory
        buf = io.StringIO()
        console = Console(file=buf, width=width, color_system=None, force_terminal=False)

        cfg = Table(
            title=f"autopar plan: {self.model} ({self.num_params / 1e9:.3g}B params)", show_header=False
        )
        cfg.add_column("key", style="bold")
        cfg.add_column("value")
        cfg.add_row("cluster", self.cluster_description)
        cfg.add_row("mesh", self.mesh_str())
        for key, value in summary_rows(self):  # what is sharded, ZeRO, what is recomputed
            cfg.add_row(key, value)
        cfg.add_row(
            "batch",
            f"global {self.global_batch_size} = micro-batch {self.micro_batch_size} x "
            f"{self.microbatches} micro-batches x dp {self.mesh['dp']}",
        )
        cfg.add_row("precision / optimizer", f"{self.precision} / {self.optimizer}")
        if self.solver:
            cfg.add_row("search", _solver_line(self.solver, self.mesh))
        console.print(cfg)

        time_t = Table(title="time per step")
        hfu = ("HFU",) if est.hfu_differs else ()  # hardware FLOPs: recompute counted
        for col in ("step", "compute (recompute)", "comm (exposed / total)", "optimizer", "samples/s", "MFU", *hfu):
            time_t.add_column(col, justify="right")
        time_t.add_row(
            _secs(est.step_time_s),
            f"{_secs(est.compute_s)} ({_secs(est.recompute_s)})",
            f"{_secs(est.exposed_comm_s)} / {_secs(est.comm_s)}",
            _secs(est.optimizer_s),
            f"{est.samples_per_s:,.1f}",
            f"{est.mfu * 100:.1f}%",
            *(f"{est.hfu * 100:.1f}%" for _ in hfu),
        )
        console.print(time_t)

        mem_t = Table(title="memory per device (GB)")
        for col in ("params", "grads", "optimizer", "activations", "buffers", "peak", "limit", "fits"):
            mem_t.add_column(col, justify="right")
        mem_t.add_row(
            *(
                f"{v / GB:.2f}"
                for v in (mem.params, mem.grads, mem.optimizer, mem.activations, mem.buffers, mem.peak)
            ),
            f"{est.memory_limit / GB:.1f}",
            "yes" if est.fits else "NO",
        )
        console.print(mem_t)
        if peak_line(self):
            console.print(peak_line(self))

        if self.stages:
            console.print(self._pipeline_table())

        if est.collectives:
            coll = Table(title="collectives per step")
            for col in ("collective", "axis", "count", "bytes each", "time"):
                coll.add_column(col, justify="right")
            for c in est.collectives:
                coll.add_row(c["kind"], c["axis"], str(c["count"]), _bytes(c["bytes"]), _secs(c["time_s"]))
            console.print(coll)
        params = self.param_placements()
        if params:
            pt = Table(title="parameter placements (layers folded)")
            for col in ("parameter", "copies", *self.mesh_axes()):
                pt.add_column(col, justify="left" if col == "parameter" else "right")
            for (name, placement), count in params.items():
                pt.add_row(name, str(count), *placement)
            console.print(pt)
        meshes = self.solver.get("meshes") or []
        if len(meshes) > 1:
            left = self.solver.get("meshes_left_out") or 0
            mt = Table(
                title="meshes searched",
                caption=f"{left} more dp x tp mesh(es) left out at the time limit" if left else None,
            )
            for col in ("mesh", "micro-batches", "status", "found by", "step", "peak memory (GB)", "fits"):
                mt.add_column(col, justify="right")
            for r in meshes:
                mt.add_row(
                    " x ".join(f"{k}={r['mesh'][k]}" for k in ("dp", "tp", "pp")),
                    str(r.get("microbatches", 1)),
                    r["status"],
                    r.get("source", "milp"),
                    _secs(r["step_time_s"]),
                    f"{r['peak_bytes'] / GB:.2f}",
                    "yes" if r["fits"] else "no",
                )
            console.print(mt)
        alts = self.solver.get("alternatives") or []
        if len(alts) > 1:
            alt_t = Table(title="best configuration per ZeRO stage")
            for col in ("mesh", "ZeRO", "micro-batches", "step", "peak memory (GB)", "fits"):
                alt_t.add_column(col, justify="right")
            for a in alts:
                mesh = " x ".join(f"{k}={a['mesh'][k]}" for k in ("dp", "tp", "pp"))
                alt_t.add_row(
                    mesh,
                    str(a["zero"]),
                    str(a["microbatches"]),
                    _secs(a["step_time_s"]),
                    f"{a['peak_bytes'] / GB:.2f}",
                    "yes" if a["fits"] else "no",
                )
            console.print(alt_t)
        for w in self.warnings:
            console.print(f"warning: {w}")
        return buf.getvalue()

    def _pipeline_table(self):
        """One row per pipeline stage: what it holds, its time per micro-batch and its peak memory."""
        from rich.table import Table

        pp, m = self.mesh.get("pp", 1), max(self.microbatches, 1)
        chunks = max(len(self.stages) // max(pp, 1), 1)
        bubble = (pp - 1) / (m * chunks)
        table = Table(
            title=f"pipeline: {self.schedule or '1F1B'}, {len(self.stages)} stages on {pp} devices, "
            f"{m} micro-batches, bubble (p-1)/(v*m) = {bubble * 100:.1f}%"
        )
        rows = self.stage_rows()
        for col in rows[0] if rows else ():
            table.add_column(col, justify="left" if col == "holds" else "right")
        for row in rows:
            table.add_row(*row.values())
        return table

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
                    "params": _count(st["params"]) if st.get("params") else "-",
                    "forward": _secs(st["forward_s"]) if "forward_s" in st else "-",
                    "backward": _secs(st["backward_s"]) if "backward_s" in st else "-",
                    "peak memory (GB)": f"{st['memory_bytes'] / GB:.2f}" if "memory_bytes" in st else "-",
                }
            )
        return rows

    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh dims placements are written over (pipeline stages are not a placement dim)."""
        return ("dp", "tp")

    def param_placements(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """(parameter name with layer numbers folded to '*', placement per mesh dim) -> how many parameters."""
        out: dict[tuple[str, tuple[str, ...]], int] = {}
        for entry in self.placements.values():
            if "param" not in entry:
                continue
            name = re.sub(r"\.\d+\.", ".*.", entry["param"], count=1)
            key = (name, tuple(entry["outputs"][0]))
            out[key] = out.get(key, 0) + 1
        return out

    def explain(self, name: str) -> str:
        """Why the plan does what it does at ``name``: a node, a parameter, or a module path (a layer).

        For an op: the strategies it had and what each would cost with every other op
        as chosen, why the chosen one won, the collectives it causes. For a module: its
        parameters, its ops' placements and costs, the collectives into and out of it.
        Raises ``autopar.inspection.UnknownNameError`` (one line naming close matches).
        """
        from autopar.inspection import explain_plan

        return explain_plan(self, name)

    def report(self, path: str | Path) -> Path:
        """Write a self-contained HTML report of the plan (tables and charts, no server needed)."""
        from autopar.report import write_report

        return write_report(self, path)

    def __str__(self) -> str:
        return self.summary()


def _solver_line(solver: dict[str, Any], mesh: dict[str, int] | None = None) -> str:
    """Status, gap of the linear objective against the solver's bound, who found the answer, time."""
    parts = [str(solver.get("status", "?"))]
    if solver.get("gap") is not None:
        parts.append(f"gap {solver['gap'] * 100:.2g}%")
    chosen = [
        r
        for r in solver.get("meshes") or []
        if mesh is not None and all(r["mesh"].get(k) == mesh.get(k) for k in ("dp", "tp", "pp"))
    ]
    if chosen and chosen[0].get("source", "milp") != "milp":
        parts.append(f"found by the {chosen[0]['source']} seed")
    if "candidates" in solver:
        parts.append(f"{solver['candidates']} configurations costed")
    if "time_s" in solver:
        parts.append(f"{solver['time_s']:.2f} s")
    return ", ".join(parts)


def _count(n: float) -> str:
    """An element count as people say it: 124M, 6.7B, 53.2K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _secs(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _short_type_error(err: TypeError) -> str:
    msg = str(err)
    # "__init__() got an unexpected keyword argument 'x'" -> "unexpected keyword argument 'x'"
    return msg.split(") ", 1)[-1] if "__init__()" in msg else msg
