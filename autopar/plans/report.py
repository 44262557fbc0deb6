"""One self-contained HTML page per plan: the summary tables, the charts, the solver's verdict.

A plan is reviewed by people who may not run autopar: attached to a ticket,
mailed, opened from a CI artifact. So the page needs nothing but a browser:
CSS is inline, the charts are PNGs embedded as base64 ``data:`` URIs, there
is no script and no link to any server. Every string from the plan is
escaped, since model and module names come from user code.
"""

from __future__ import annotations

import base64
import html
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from autopar.plans.data import PlanData
from autopar.plans.format import count, precision, secs, size
from autopar.plans.op_records import OpAlternative
from autopar.plans.pictures import all_pngs
from autopar.plans.records import batch_line, mesh_text, solver_line

log = logging.getLogger(__name__)

MAX_OP_ROWS = 60  # ops listed in the "ops with the most work" table

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 1100px; color: #222; line-height: 1.4; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 2px; } h2 { font-size: 17px; margin-top: 28px;
     border-bottom: 1px solid #ddd; padding-bottom: 4px; } h3 { font-size: 14px; margin: 14px 0 4px 0; }
.scroll { overflow-x: auto; } td.why { font-size: 12px; color: #555; border-top: none; }
table.ops { width: 100%; } table.ops td { overflow-wrap: anywhere; }
.sub { color: #666; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
.card .v { font-size: 20px; font-weight: 600; } .card .k { color: #666; font-size: 12px; }
.bad { color: #B00020; } .good { color: #1B7F3B; }
table { border-collapse: collapse; margin: 8px 0 12px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; border: 1px solid #eee; }
.warn { background: #FFF4E5; border-left: 4px solid #F0A030; padding: 6px 10px; margin: 6px 0; }
details summary { cursor: pointer; color: #345; }
code { font-size: 12px; }
"""


def write_report(plan: PlanData, path: str | Path) -> Path:
    """Write ``plan`` as one self-contained HTML file at ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_html(plan), encoding="utf-8")
    log.info("wrote report %s", path)
    return path


def report_html(plan: PlanData) -> str:
    """The HTML page of ``plan`` as a string (see :func:`write_report`)."""
    pngs = all_pngs(plan)
    parts = [
        *_head(plan),
        "<h2>Configuration</h2>",
        _configuration(plan),
        "<h2>Memory per device</h2>",
        _img(pngs["memory"], "memory per device by category, with the peak and the limit"),
        _memory_table(plan),
        "<h2>Time per step</h2>",
        _img(pngs["time"], "step time by part: compute, exposed communication, optimizer, bubble"),
        *_time_tables(plan),
        "<h2>Pipeline</h2>",
        _stages(plan),
    ]
    if plan.mesh.get("pp", 1) > 1:
        parts.append(_img(pngs["pipeline"], "pipeline timeline"))
    parts += [
        "<h2>Sharding per layer</h2>",
        _param_table(plan),
        _ops_table(plan),
        "<h2>Search</h2>",
        _search(plan),
        '<p class="sub">Written by autopar. Explain one op or layer with '
        "<code>autopar show plan.json --explain NAME</code>.</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _head(plan: PlanData) -> list[str]:
    """The document head, the title, the headline cards and the plan's warnings."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>autopar plan: {e(plan.model)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>autopar plan: {e(plan.model)}</h1>",
        f'<p class="sub">{count(plan.num_params)} parameters on {e(plan.cluster_description)}</p>',
        _cards(plan),
    ]
    if plan.warnings:
        parts.append("".join(f'<div class="warn">warning: {e(w)}</div>' for w in plan.warnings))
    return parts


def _configuration(plan: PlanData) -> str:
    cfg = [
        ("mesh", plan.mesh_str()),
        ("ZeRO stage", str(plan.zero)),
        ("recompute", plan.recompute),
        ("batch", batch_line(plan)),
        ("precision / optimizer", f"{precision(plan.precision, plan.reduce_dtype)} / {plan.optimizer}"),
        ("cluster", plan.cluster_description),
    ]
    if plan.solver:
        cfg.append(("search", solver_line(plan.solver, plan.mesh)))
    return _kv_table(cfg)


def _memory_table(plan: PlanData) -> str:
    est, mem = plan.estimate, plan.estimate.memory
    categories = (mem.params, mem.grads, mem.optimizer, mem.activations, mem.buffers, mem.peak)
    return _table(
        ["params", "grads", "optimizer", "activations", "buffers", "peak", "limit", "fits"],
        [[*(size(v) for v in categories), size(est.memory_limit), "yes" if est.fits else "NO"]],
        numeric=range(7),
    )


def _time_tables(plan: PlanData) -> list[str]:
    """The step time by part, then the collectives of one step."""
    est = plan.estimate
    parts = []
    hfu = ["HFU"] if est.hfu_differs else []  # hardware FLOPs, recompute counted: shown where it differs
    parts.append(
        _table(
            ["step", "compute", "recompute", "exposed comm", "all comm", "optimizer", "bubble", "samples/s", "MFU"]
            + hfu,
            [
                [
                    secs(est.step_time_s),
                    secs(est.compute_s),
                    secs(est.recompute_s),
                    secs(est.exposed_comm_s),
                    secs(est.comm_s),
                    secs(est.optimizer_s),
                    secs(est.bubble_s),
                    f"{est.samples_per_s:,.1f}",
                    f"{est.mfu * 100:.1f}%",
                ]
                + [f"{est.hfu * 100:.1f}%" for _ in hfu]
            ],
            numeric=range(9 + len(hfu)),
        )
    )
    if est.collectives:
        parts.append("<h3>Collectives per step</h3>")
        parts.append(
            _table(
                ["collective", "axis", "count", "bytes each", "time"],
                [
                    [c["kind"], c["axis"], str(c["count"]), size(c["bytes"]), secs(c["time_s"])]
                    for c in est.collectives
                ],
                numeric=(2, 3, 4),
            )
        )
    return parts


def _cards(plan: PlanData) -> str:
    est = plan.estimate
    fit_cls = "good" if est.fits else "bad"
    cards = [
        ("step time", secs(est.step_time_s), ""),
        ("samples / s", f"{est.samples_per_s:,.1f}", ""),
        ("MFU", f"{est.mfu * 100:.1f}%", ""),
        *([("HFU (recompute counted)", f"{est.hfu * 100:.1f}%", "")] if est.hfu_differs else []),
        ("peak memory / device", size(est.memory.peak), fit_cls),
        ("memory limit", size(est.memory_limit), ""),
        ("mesh", plan.mesh_str(), ""),
        ("solver", plan.solver.status or "-", ""),
    ]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="v {c}">{html.escape(v)}</div><div class="k">{html.escape(k)}</div></div>'
            for k, v, c in cards
        )
        + "</div>"
    )


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _kv_table(rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Iterable[int] = ()) -> str:
    cls = {i: "n" for i in numeric}
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{f' class={cls[i]}' if i in cls else ''}>{html.escape(str(v))}</td>"
            for i, v in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _stages(plan: PlanData) -> str:
    if not plan.stages:
        return f"<p>No pipeline: pp = {plan.mesh.get('pp', 1)}; every device holds every layer.</p>"
    rows = plan.stage_rows()
    return _table(list(rows[0]), [list(r.values()) for r in rows], numeric=(3, 4, 5, 6))


def _param_table(plan: PlanData) -> str:
    import re

    axes = plan.mesh_axes()
    folded: dict[tuple, int] = {}
    for entry in plan.placements.values():
        if "param" not in entry:
            continue
        name = re.sub(r"\.\d+\.", ".*.", entry["param"], count=1)
        key = (
            name,
            tuple(placement_or_dash(p) for p in entry["outputs"][0] or []),
            entry.get("zero", plan.zero),
        )
        folded[key] = folded.get(key, 0) + 1
    if not folded:
        return (
            f"<p>No per-op placements: the data-parallel model chose this plan (every parameter replicated over "
            f"dp, ZeRO stage {plan.zero}).</p>"
        )
    rows = [[name, str(n), *pl, str(z)] for (name, pl, z), n in folded.items()]
    return "<h3>Parameters (layers folded)</h3>" + _table(
        ["parameter", "copies", *axes, "ZeRO"], rows, numeric=(1,)
    )


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def placement_or_dash(p: Any) -> str:
    return "-" if p is None else str(p)


def _ops_table(plan: PlanData) -> str:
    records = plan.solver.ops.records if plan.solver.ops is not None else {}
    if not records:
        recompute = [(n, e) for n, e in plan.placements.items() if "recompute" in e]
        if recompute:
            return "<h3>Recomputed ops</h3>" + _table(
                ["node", "op", "module", "recompute"],
                [
                    [n, e.get("op", ""), e.get("module", ""), e["recompute"]]
                    for n, e in recompute[:MAX_OP_ROWS]
                ],
            )
        return ""
    header = ["node", "op", "module", "phase", "GFLOP", "output", "compute", "comm", "copies", "recompute"]
    numeric = {4, 6, 7, 8}
    ranked = sorted(records.items(), key=lambda kv: -kv[1].flops)[:MAX_OP_ROWS]
    body = []
    for name, rec in ranked:
        chosen = rec.chosen or OpAlternative(outputs="-")
        entry = plan.placements.get(name, {})
        cells = [
            name,
            rec.op.replace("aten.", "").replace(".default", ""),
            rec.module,
            rec.phase,
            f"{rec.flops / 1e9:.3g}",
            chosen.outputs,
            secs(chosen.compute_s),
            secs(chosen.comm_s),
            str(rec.copies),
            entry.get("recompute", ""),
        ]
        body.append(
            "<tr>"
            + "".join(
                f"<td{' class=n' if i in numeric else ''}>{html.escape(str(v))}</td>"
                for i, v in enumerate(cells)
            )
            + "</tr>"
        )
        # why it won, on its own row under the op: long sentences would stretch a column
        body.append(
            f'<tr><td></td><td class="why" colspan="{len(header) - 1}">why: {html.escape(rec.why)}</td></tr>'
        )
    more = len(records) - len(ranked)
    note = f" ({more} more recorded)" if more > 0 else ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    table = f'<table class="ops"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    return (
        f"<details open><summary>Ops with the most work, as chosen{html.escape(note)}; repeated layers "
        f'once</summary><div class="scroll">{table}</div></details>'
    )


def _search(plan: PlanData) -> str:
    s = plan.solver
    if not s:
        return "<p>No search record.</p>"
    kv = [
        (k, str(getattr(s, k)))
        for k in ("status", "backend", "candidates", "graph_nodes", "nodes_after_reduction")
        if getattr(s, k) not in (None, "")
    ]
    if s.gap is not None:
        kv.insert(1, ("gap", f"{s.gap * 100:.3g}%"))
    if s.objective is not None:
        kv.append(("objective (s)", f"{s.objective:.6g}"))
    for name, value in (("capture", s.capture_s), ("planning time", s.time_s)):
        if value is not None:
            kv.append((name, f"{value:.2f} s"))
    out = [_kv_table(kv)]
    meshes = s.meshes
    if meshes:
        out.append("<h3>Meshes searched</h3>")
        out.append(
            _table(
                ["mesh", "micro-batches", "status", "found by", "step", "peak memory", "fits"],
                [
                    [
                        mesh_text(r.mesh),
                        str(r.microbatches),
                        r.status,
                        r.source,
                        secs(r.step_time_s),
                        size(r.peak_bytes),
                        "yes" if r.fits else "no",
                    ]
                    for r in meshes
                ],
                numeric=(1, 4, 5),
            )
        )
    alts = s.alternatives
    if alts:
        out.append("<h3>Best configuration per ZeRO stage</h3>")
        out.append(
            _table(
                ["mesh", "ZeRO", "micro-batches", "step", "peak memory", "fits"],
                [
                    [
                        mesh_text(a.mesh),
                        str(a.zero),
                        str(a.microbatches),
                        secs(a.step_time_s),
                        size(a.peak_bytes),
                        "yes" if a.fits else "no",
                    ]
                    for a in alts
                ],
                numeric=(1, 2, 3, 4),
            )
        )
    return "".join(out)
