"""Why a plan fits: what it shards, what it recomputes, and what is live at its peak, in words.

Planning records, per plan, the facts a reader needs to see why its memory
comes out as it does (:func:`sharding_facts`, kept in ``plan.solver.sharding``
as plain data: parameter elements by placement and ZeRO stage, the recompute
marks by layer and op); :func:`summary_rows` and :func:`peak_line` turn them
and the estimate into the lines ``Plan.summary`` prints.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.core.mesh import SHARDING_AXES
from autopar.core.placements import replicated, texts
from autopar.plans.data import PlanData, param_zero_stage
from autopar.plans.format import GB, precision, secs, size
from autopar.plans.records import ShardingFacts, batch_line, mesh_text, solver_line

_STATES = {
    0: "replicated",
    1: "optimizer state split",
    2: "gradients and optimizer state split",
    3: "parameters, gradients and optimizer state split",
}


def _layer(module: str) -> str | None:
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _op_name(op: str) -> str:
    """``aten.mul.Tensor`` -> ``mul``; ``<built-in function getitem>`` -> ``getitem``."""
    if op.startswith("<"):
        return op.strip("<>").split()[-1]
    parts = op.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def sharding_facts(
    captured, placements: dict[str, dict[str, Any]], axes: tuple[str, ...] = SHARDING_AXES
) -> ShardingFacts:
    """Parameter elements by ZeRO stage and by the mesh axes that split them (placements hold no shapes)."""
    zero: Counter = Counter()
    split: Counter = Counter()
    total = 0
    for p in captured.params:
        entry = placements.get(p.placeholder)
        if entry is None:
            continue
        n = math.prod(p.shape)
        total += n
        out = entry["outputs"][0] or replicated(len(axes))
        zero[param_zero_stage(entry)] += n
        split["+".join(a for a, pl in zip(axes, out, strict=False) if not pl.is_replicate()) or "none"] += n
    return ShardingFacts(param_elements=total, zero_elements=dict(zero), split_elements=dict(split))


def context_parallel_axes(
    placements: dict[str, dict[str, Any]], axes: tuple[str, ...] = SHARDING_AXES, balanced: bool = False
) -> list[str]:
    """The mesh axes over which the plan's attention kernels split their queries' sequence (dim 2 of the
    query, their first input forward); with ``balanced``, those that split it in head-tail order."""
    found: set[str] = set()
    for entry in placements.values():
        op = entry.get("op", "")
        if ("scaled_dot_product" in op or "dropout_attention" in op) and "backward" not in op and entry["inputs"]:
            q = entry["inputs"][0] or ()
            found |= {a for a, p in zip(axes, q, strict=False) if p.is_shard(2) and (p.is_balanced() or not balanced)}
    return [a for a in axes if a in found]


def recompute_facts(placements: dict[str, dict[str, Any]]) -> dict:
    """The recompute marks: how many ops, of which kinds, in how many of the layers."""
    marks = [e for e in placements.values() if e.get("recompute")]
    return {
        "ops": len(marks),
        "full": sum(1 for e in marks if e["recompute"] == "full"),
        "layers": len({_layer(e.get("module", "")) for e in marks} - {None}),
        "of_layers": len({_layer(e.get("module", "")) for e in placements.values()} - {None}),
        "kinds": dict(Counter(_op_name(e.get("op", "")) for e in marks).most_common(6)),
    }


# Plan.recompute in words
_RECOMPUTE = {
    "selective": "selective (Megatron's: the attention core of every layer)",
    "full": "full (Megatron's: every layer from its input)",
    "op-level": "op by op (the MILP's choice)",
}


def _share(part: float, total: float) -> str:
    if not total:
        return "-"
    return "<1%" if 0 < part / total < 0.005 else f"{100 * part / total:.0f}%"


def summary_rows(plan) -> list[tuple[str, str]]:
    """(key, value) rows for the summary's configuration table: how it shards, ZeRO, recompute."""
    facts = plan.solver.sharding
    mesh = plan.mesh
    if facts is None:
        return [("ZeRO stage", str(plan.zero)), ("recompute", plan.recompute)]
    total = facts.param_elements
    dp = mesh.get("dp", 1)
    split = facts.split_elements
    parts = []
    for axes, n in sorted(split.items(), key=lambda kv: -kv[1]):
        if axes == "none":
            parts.append(f"{_share(n, total)} whole on every device")
        else:
            ways = math.prod(mesh.get(a, 1) for a in axes.split("+"))
            parts.append(f"{_share(n, total)} split {ways} ways over {axes}")
    parts = [f"parameter elements: {', '.join(parts)}"]
    cp_axes = context_parallel_axes(plan.placements)
    if mesh.get("cp", 1) > 1 and cp_axes:
        parts.insert(0, (
            f"attention's queries split {mesh['cp']} ways on the sequence over {'+'.join(cp_axes)} (context "
            "parallel: keys and values gathered, their gradients reduce-scattered"
            + ("; in head-tail order, causal work balanced)" if context_parallel_axes(plan.placements, balanced=True) else ")")
            + (f", because {plan.solver.context_parallel_why}" if plan.solver.context_parallel_why else "")
        ))
    if dp > 1 and "dp" not in cp_axes:
        parts.insert(0, f"batch split {dp} ways over dp")
    if mesh.get("pp", 1) > 1:
        parts.insert(0, f"layers cut into {len(plan.stages) or mesh['pp']} pipeline stages over pp={mesh['pp']}")
    stages = sorted(facts.zero_elements.items(), key=lambda kv: -kv[1])
    zero_text = "; ".join(
        f"{z} for {_share(n, total)} ({_STATES[z]}{f' {dp} ways over dp' if z else ''})" for z, n in stages
    )
    rec = recompute_facts(plan.placements)
    if rec["ops"]:
        kinds = ", ".join(f"{k} {v}" for k, v in rec["kinds"].items())
        how = _RECOMPUTE.get(plan.recompute, "full layers" if rec["full"] else plan.recompute)
        rec_text = (
            f"{how}: {rec['ops']} forward ops in {rec['layers']} of {rec['of_layers']} layers marked, replayed in "
            f"the backward (+{secs(plan.estimate.recompute_s)} per step); most: {kinds}"
        )
    else:
        rec_text = "none: every activation the backward reads is kept from the forward"
    return [("sharded", "; ".join(parts)), ("ZeRO stage", zero_text), ("recompute", rec_text)]


def peak_line(plan) -> str:
    """The peak against the limit, where in the step it falls, and what is live there."""
    est, mem = plan.estimate, plan.estimate.memory
    if not mem.peak:
        return ""
    free = est.memory_limit - mem.peak
    head = f"peak {size(mem.peak)} of the {size(est.memory_limit)} limit " + (
        f"({size(free)} free)" if free >= 0 else f"({size(-free)} over)"
    )
    where = f", in the {mem.peak_at}" if mem.peak_at and not mem.peak_at.startswith("end") else (
        f", at the {mem.peak_at}" if mem.peak_at else ""
    )
    at = mem.at_peak
    if not at:
        return head + where
    names = {"grads": "gradients made so far"}
    parts = " + ".join(f"{names.get(k, k)} {size(v)}" for k, v in at.items() if v)
    return f"{head}{where}: {parts}"


def summary_text(plan: PlanData, width: int = 100) -> str:
    """A table a person reads: the configuration, time and memory per device."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    console.print(_config_table(plan))
    console.print(_time_table(plan))
    console.print(_memory_table(plan))
    if peak_line(plan):
        console.print(peak_line(plan))
    tables = (
        _pipeline_table(plan) if plan.stages else None,
        _collectives_table(plan),
        _param_table(plan),
        _meshes_table(plan),
        _alternatives_table(plan),
    )
    for table in tables:
        if table is not None:
            console.print(table)
    for w in plan.warnings:
        console.print(f"warning: {w}")
    return buf.getvalue()


def params_line(plan: PlanData) -> str:
    """``1.23B params``, or with frozen parameters (a LoRA fine-tune) ``8.39M trainable of 6.75B params``."""
    if not plan.frozen_params:
        return f"{plan.num_params / 1e9:.3g}B params"
    total = plan.num_params + plan.frozen_params
    return f"{_count(plan.num_params)} trainable of {_count(total)} params"


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"


def _config_table(plan: PlanData) -> Table:
    """The cluster, the mesh, what is sharded, ZeRO, recompute, the batch and the search."""
    cfg = Table(
        title=f"autopar plan: {plan.model} ({params_line(plan)})", show_header=False
    )
    cfg.add_column("key", style="bold")
    cfg.add_column("value")
    cfg.add_row("cluster", plan.cluster_description)
    cfg.add_row("mesh", plan.mesh_str())
    for key, value in summary_rows(plan):  # what is sharded, ZeRO, what is recomputed
        cfg.add_row(key, value)
    cfg.add_row("batch", batch_line(plan))
    cfg.add_row("precision / optimizer", f"{precision(plan.precision, plan.reduce_dtype)} / {plan.optimizer}")
    if plan.solver:
        cfg.add_row("search", solver_line(plan.solver, plan.mesh))
    return cfg


def _time_table(plan: PlanData) -> Table:
    est = plan.estimate
    time_t = Table(title="time per step")
    hfu = ("HFU",) if est.hfu_differs else ()  # hardware FLOPs: recompute counted
    for col in ("step", "compute (recompute)", "comm (exposed / total)", "optimizer", "samples/s", "MFU", *hfu):
        time_t.add_column(col, justify="right")
    time_t.add_row(
        secs(est.step_time_s),
        f"{secs(est.compute_s)} ({secs(est.recompute_s)})",
        f"{secs(est.exposed_comm_s)} / {secs(est.comm_s)}",
        secs(est.optimizer_s),
        f"{est.samples_per_s:,.1f}",
        f"{est.mfu * 100:.1f}%",
        *(f"{est.hfu * 100:.1f}%" for _ in hfu),
    )
    return time_t


def _memory_table(plan: PlanData) -> Table:
    est, mem = plan.estimate, plan.estimate.memory
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
    return mem_t


def _collectives_table(plan: PlanData) -> Table | None:
    if not plan.estimate.collectives:
        return None
    coll = Table(title="collectives per step")
    for col in ("collective", "axis", "count", "bytes each", "time"):
        coll.add_column(col, justify="right")
    for c in plan.estimate.collectives:
        coll.add_row(c["kind"], c["axis"], str(c["count"]), size(c["bytes"]), secs(c["time_s"]))
    return coll


def _param_table(plan: PlanData) -> Table | None:
    params = plan.param_placements()
    if not params:
        return None
    pt = Table(title="parameter placements (layers folded)")
    for col in ("parameter", "copies", *plan.mesh_axes()):
        pt.add_column(col, justify="left" if col == "parameter" else "right")
    for (name, placement), count in params.items():
        pt.add_row(name, str(count), *texts(placement))
    return pt


def _meshes_table(plan: PlanData) -> Table | None:
    """The meshes the search compared, when there was more than one."""
    meshes = plan.solver.meshes
    if len(meshes) <= 1:
        return None
    left = plan.solver.meshes_left_out
    mt = Table(
        title="meshes searched",
        caption=(
            f"{left} more dp x tp mesh(es) not searched: past the time limit, or a wider tp across nodes "
            "after a narrower one lost"
        )
        if left
        else None,
    )
    for col in ("mesh", "micro-batches", "status", "found by", "step", "peak memory (GB)", "fits"):
        mt.add_column(col, justify="right")
    for r in meshes:
        mt.add_row(
            mesh_text(r.mesh),
            str(r.microbatches),
            r.status,
            r.source,
            secs(r.step_time_s),
            f"{r.peak_bytes / GB:.2f}",
            "yes" if r.fits else "no",
        )
    return mt


def _alternatives_table(plan: PlanData) -> Table | None:
    """The best configuration found for each ZeRO stage, when more than one was costed."""
    alts = plan.solver.alternatives
    if len(alts) <= 1:
        return None
    alt_t = Table(title="best configuration per ZeRO stage")
    for col in ("mesh", "ZeRO", "micro-batches", "step", "peak memory (GB)", "fits"):
        alt_t.add_column(col, justify="right")
    for a in alts:
        alt_t.add_row(
            mesh_text(a.mesh),
            str(a.zero),
            str(a.microbatches),
            secs(a.step_time_s),
            f"{a.peak_bytes / GB:.2f}",
            "yes" if a.fits else "no",
        )
    return alt_t


def _pipeline_table(plan: PlanData) -> Table:
    """One row per pipeline stage: what it holds, its time per micro-batch and its peak memory."""
    pp, m = plan.mesh.get("pp", 1), max(plan.microbatches, 1)
    chunks = max(len(plan.stages) // max(pp, 1), 1)
    bubble = (pp - 1) / (m * chunks)
    table = Table(
        title=f"pipeline: {plan.schedule or '1F1B'}, {len(plan.stages)} stages on {pp} devices, "
        f"{m} micro-batches, bubble (p-1)/(v*m) = {bubble * 100:.1f}%"
    )
    rows = plan.stage_rows()
    for col in rows[0] if rows else ():
        table.add_column(col, justify="left" if col == "holds" else "right")
    for row in rows:
        table.add_row(*row.values())
    return table
