"""Read a plan the way a reviewer does: explain one op or layer, and diff two plans.

A plan states what was chosen; a person deciding whether to trust it asks
why this op is split that way, what it costs, and what changed between two
plans (another cluster, another batch, another autopar). ``explain`` answers
the first from the per-op records the search leaves in
``plan.solver.ops`` (see :mod:`autopar.search.sharding.explain_records`), falling
back to the placements and charged collectives where a plan has none;
``diff`` answers the second from the plain data of both plans.

Named ``inspection`` rather than ``inspect`` so that nothing run from inside
the package directory can shadow the standard library's ``inspect``.
"""

from __future__ import annotations

import difflib
import io
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from autopar.core.errors import AutoparError
from autopar.core.module_paths import layer_key
from autopar.core.placements import text, texts
from autopar.plans.data import PlanData
from autopar.plans.format import GB, precision, secs, size
from autopar.plans.op_records import ChargedCollective, OpRecord, OpRecords

MAX_LAYER_ROWS = 40  # ops listed when explaining a layer; the rest are counted
MAX_DIFF_ROWS = 40  # placement changes listed in a diff


class UnknownNameError(AutoparError, LookupError):
    """``Plan.explain`` was given a name that is no op, parameter or module of the plan."""


# ---- explain ----------------------------------------------------------------------------------


def explain_plan(plan: PlanData, name: str, width: int = 110) -> str:
    """Why the plan does what it does at ``name``: a node, a parameter or a module path (a layer).

    A module path may fold the layer number with ``*`` (``transformer.h.*.mlp``): the
    first layer stands for all. Raises :class:`UnknownNameError` (one line, with close
    matches) when the plan has nothing of that name.
    """
    kind, key = resolve(plan, name)
    buf = io.StringIO()
    console = _console(buf, width)
    if kind == "node":
        _explain_node(plan, key, console, asked=name)
    else:
        _explain_module(plan, key, console)
    return buf.getvalue()


def resolve(plan: PlanData, name: str) -> tuple[str, str]:
    """("node", node name) or ("module", module path or pattern) for ``name``; raises if neither."""
    name = name.strip()
    ops = _ops(plan)
    if name in plan.placements or ops.knows(name):
        return "node", name
    for node, entry in plan.placements.items():
        if entry.get("param") == name:
            return "node", node
    for node, rec in ops.records.items():
        if rec.param == name:
            return "node", node
    pattern = _module_pattern(name)
    if any(pattern.match(m) for m in _modules(plan)):
        return "module", name
    raise UnknownNameError(_unknown_message(plan, name))


def _unknown_message(plan: PlanData, name: str) -> str:
    if not plan.placements and not _ops(plan).records:
        return (
            f"the plan has no per-op placements, so nothing named {name!r}: the data-parallel model made "
            "it (every op replicated on its device)"
        )
    names = set(plan.placements)
    names |= {e["param"] for e in plan.placements.values() if "param" in e}
    for m in _modules(plan):
        parts = m.split(".")
        names |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
    close = difflib.get_close_matches(name, sorted(n for n in names if n), n=3, cutoff=0.6)
    hint = (
        f"; close matches: {', '.join(close)}"
        if close
        else "; names are node names, parameter names or module paths"
    )
    return f"the plan has no op, parameter or module named {name!r}{hint}"


def _ops(plan: PlanData) -> OpRecords:
    """The plan's per-op records; none (an empty set) for a plan the search left none in."""
    return plan.solver.ops if plan.solver.ops is not None else OpRecords()


def _modules(plan: PlanData) -> set[str]:
    mods = {e.get("module", "") for e in plan.placements.values()}
    mods |= {r.module for r in _ops(plan).records.values()}
    return {m for m in mods if m}


def _module_pattern(name: str) -> re.Pattern[str]:
    """Matches ``name`` and everything under it; ``*`` matches one path component (a layer number)."""
    body = r"[^.]+".join(re.escape(p) for p in name.rstrip(".").split("*"))
    return re.compile(rf"^{body}(\..*)?$")


def record_of(plan: PlanData, node: str) -> tuple[OpRecord | None, str]:
    """The search's record for ``node`` and the node it was recorded under (a repeated layer's first copy)."""
    return _ops(plan).record_of(node)


def _explain_node(plan: PlanData, node: str, console, asked: str) -> None:
    from rich.table import Table

    entry = plan.placements.get(node, {})
    rec, rep = record_of(plan, node)
    op = entry.get("op") or (rec.op if rec is not None else "?")
    module = entry.get("module", rec.module if rec is not None else "")
    param = entry.get("param") or (rec.param if rec is not None else None)
    title = f"{node}: {op}" + (f" in {module}" if module else " (top level)")
    if param:
        title = f"parameter {param} (node {node}) in {module or 'the top level'}"
    console.print(title, style="bold")
    axes = ", ".join(_ops(plan).axes or plan.mesh_axes())
    facts = []
    if rec is not None:
        if rec.phase and rec.phase != "input":
            facts.append(f"{rec.phase} pass")
        if rec.flops:
            facts.append(f"{_flops(rec.flops)} for the whole batch")
    if facts:
        console.print("; ".join(facts))
    if entry:
        outs = " | ".join(_pl(p) for p in entry.get("outputs", [])) or "-"
        console.print(f"chosen placement (per mesh axis {axes}): output {outs}")
        ins = [_pl(p) for p in entry.get("inputs", [])]
        if ins:
            console.print(f"  inputs brought to: {'; '.join(ins)}")
    if "zero" in entry:
        console.print(f"ZeRO stage {entry['zero']}: {_zero_words(entry['zero'])}")
    if "recompute" in entry:
        console.print(f"recompute: {entry['recompute']} (its output is computed again in the backward)")
    if rec is None:
        console.print(
            "The plan keeps no alternatives for this op (the search left no records: a plan from an older "
            "autopar, or one the data-parallel model chose)."
        )
    else:
        if rep != node:
            n = rec.copies if rec.copies > 1 else None
            console.print(
                f"repeated layer: recorded under its copy {rep}"
                + (f" ({n} copies take one decision)" if n else " (the copies' records were the same)")
            )
        console.print(f"why: {rec.why or '?'}")
        alts = rec.alternatives
        t = Table(
            title=f"strategies ({len(alts)} of {rec.strategies or len(alts)} shown"
            + (f", {rec.forbidden} ruled out" if rec.forbidden else "")
            + "; costs with every other op as chosen)"
        )
        for col in ("", "output", "inputs", "compute", "communication", "total", "memory"):
            t.add_column(col, justify="left" if col in ("", "output", "inputs") else "right")
        for k, a in enumerate(alts):
            t.add_row(
                "chosen" if k == 0 else "",
                a.outputs,
                "; ".join(a.inputs) or "-",
                secs(a.compute_s),
                secs(a.comm_s),
                secs(a.total_s),
                size(a.memory),
            )
        console.print(t)
        if param:
            console.print(
                "(a parameter's compute is its optimizer update; its communication includes its gradient "
                "synchronisation and bringing it to the ops that read it)"
            )
    colls = _collectives_of(plan, node, rec, rep)
    if colls:
        t = Table(title="collectives it takes part in (per step)")
        for col in ("collective", "axis", "bytes", "from", "to", "why"):
            t.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
        for c in colls:
            t.add_row(c.kind, c.axis, size(c.bytes), c.src, c.dst, _reason(c.reason))
        console.print(t)
    else:
        console.print("It causes no collective: its inputs arrive as it needs them.")
    if asked != node:
        console.print(f"({asked!r} is this node)")


def _collectives_of(plan: PlanData, node: str, rec: OpRecord | None, rep: str) -> list[ChargedCollective]:
    charged = [c for c in plan.solver.charged if c.touches(node)]
    if charged:
        return charged
    if rec is not None and rep == node:
        return rec.collectives
    return []


def _explain_module(plan: PlanData, name: str, console) -> None:
    from rich.table import Table

    pattern = _module_pattern(name)
    members = [(n, e) for n, e in plan.placements.items() if pattern.match(e.get("module", ""))]
    if "*" in name:  # the first layer speaks for the others
        first = layer_key(members[0][1]["module"]) if members else None
        if first is not None:
            members = [(n, e) for n, e in members if layer_key(e.get("module", "")) in (None, first)]
    console.print(f"module {name}: {len(members)} ops in the plan", style="bold")
    params = [(n, e) for n, e in members if "param" in e]
    if params:
        t = Table(title="parameters")
        for col in ("parameter", *plan.mesh_axes(), "ZeRO"):
            t.add_column(col, justify="left" if col == "parameter" else "right")
        for _, e in params:
            t.add_row(e["param"], *texts(e["outputs"][0] or ()), str(e.get("zero", plan.zero)))
        console.print(t)
    rows = []
    totals = {"flops": 0.0, "compute_s": 0.0, "comm_s": 0.0}
    for n, e in members:
        if "param" in e:
            continue
        rec, _ = record_of(plan, n)
        if rec is None:
            continue
        chosen = rec.chosen
        totals["flops"] += rec.flops
        if chosen:
            totals["compute_s"] += chosen.compute_s
            totals["comm_s"] += chosen.comm_s
        rows.append((n, e, rec, chosen))
    if rows:
        rows.sort(key=lambda r: -r[2].flops)
        t = Table(title=f"ops with work or communication ({min(len(rows), MAX_LAYER_ROWS)} of {len(rows)})")
        for col in ("node", "op", "phase", "FLOPs", "output", "compute", "communication", "recompute"):
            t.add_column(col, justify="right" if col in ("FLOPs", "compute", "communication") else "left")
        for n, e, rec, chosen in rows[:MAX_LAYER_ROWS]:
            t.add_row(
                n,
                _short_op(e.get("op", "")),
                rec.phase,
                _flops(rec.flops),
                " | ".join(_pl(p) for p in e.get("outputs", [])),
                secs(chosen.compute_s) if chosen else "-",
                secs(chosen.comm_s) if chosen else "-",
                e.get("recompute", ""),
            )
        console.print(t)
        console.print(
            f"total: {_flops(totals['flops'])}, compute {secs(totals['compute_s'])}, communication on its "
            f"ops' edges {secs(totals['comm_s'])} (an edge between two of them counts twice)"
        )
    elif plan.solver.ops is None:
        _module_placements(plan, members, console)
    charged = [c for c in plan.solver.charged if pattern.match(c.src_module) or pattern.match(c.dst_module)]
    if charged:
        agg: dict[tuple[str, str, str], list[float]] = {}
        for c in charged:
            a = agg.setdefault((c.kind, c.axis, _reason(c.reason)), [0, 0.0])
            a[0] += 1
            a[1] += c.bytes
        t = Table(title="collectives into, out of or inside it")
        for col in ("collective", "axis", "why", "count", "bytes in all"):
            t.add_column(col, justify="right" if col in ("count", "bytes in all") else "left")
        for (kind, axis, why), (count, nbytes) in sorted(agg.items()):
            t.add_row(kind, axis, why, str(int(count)), size(nbytes))
        console.print(t)


# ops worth listing when a plan has no records to say which ops did work: matmuls, attention, embeddings
_HEAVY = re.compile(r"mm|conv|attention|embedding|linear|loss", re.I)


def _module_placements(plan: PlanData, members: list[tuple[str, dict[str, Any]]], console) -> None:
    """A module's op placements from the plan alone (no search records): heavy ops and those that communicate."""
    from rich.table import Table

    talking = {c.src for c in plan.solver.charged} | {c.dst for c in plan.solver.charged}
    rows = [
        (n, e)
        for n, e in members
        if "param" not in e and (_HEAVY.search(e.get("op", "")) or n in talking or "recompute" in e)
    ]
    console.print("The plan keeps no per-op costs (no search records): placements only.")
    if not rows:
        return
    t = Table(
        title=f"matmul-like ops and ops that communicate ({min(len(rows), MAX_LAYER_ROWS)} of {len(rows)})"
    )
    for col in ("node", "op", "output", "inputs", "recompute"):
        t.add_column(col)
    for n, e in rows[:MAX_LAYER_ROWS]:
        t.add_row(
            n,
            _short_op(e.get("op", "")),
            " | ".join(_pl(p) for p in e.get("outputs", [])),
            "; ".join(_pl(p) for p in e.get("inputs", [])),
            e.get("recompute", ""),
        )
    console.print(t)


# ---- diff -------------------------------------------------------------------------------------


@dataclass
class PlanDiff:
    """What differs between two plans, by section; empty sections are left out.

    ``rows`` holds (section, what, plan a, plan b) for the configuration, estimate,
    collectives, solver and warnings; ``placements`` holds (what, how many ops, a, b)
    for per-op placements, layers folded. ``str()`` is a readable table; rich renders it.
    """

    a_name: str
    b_name: str
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    placements: list[tuple[str, int, str, str]] = field(default_factory=list)
    placement_note: str = ""

    @property
    def same(self) -> bool:
        return not self.rows and not self.placements and not self.placement_note

    def __rich_console__(self, console, options) -> Iterator[Any]:
        from rich.table import Table

        if self.same:
            yield f"{self.a_name} and {self.b_name}: no difference"
            return
        sections: dict[str, list[tuple[str, str, str]]] = {}
        for section, what, a, b in self.rows:
            sections.setdefault(section, []).append((what, a, b))
        for section, rows in sections.items():
            t = Table(title=section)
            for col in ("", self.a_name, self.b_name):
                t.add_column(col, justify="left" if not col else "right")
            for what, a, b in rows:
                t.add_row(what, a, b)
            yield t
        if self.placements:
            t = Table(title="per-op placements that differ (layers folded)")
            for col in ("op or parameter", "ops", self.a_name, self.b_name):
                t.add_column(col, justify="right" if col == "ops" else "left")
            for what, n, a, b in self.placements:
                t.add_row(what, str(n), a, b)
            yield t
        if self.placement_note:
            yield self.placement_note

    def __str__(self) -> str:
        buf = io.StringIO()
        _console(buf, 110).print(self)
        return buf.getvalue()


def diff(a: PlanData, b: PlanData, a_name: str = "a", b_name: str = "b") -> PlanDiff:
    """What differs between plans ``a`` and ``b``: configuration, estimate, collectives, per-op placements."""
    d = PlanDiff(a_name, b_name)

    def row(section: str, what: str, x: Any, y: Any, fmt=str) -> None:
        if x != y:
            d.rows.append((section, what, fmt(x) if x is not None else "-", fmt(y) if y is not None else "-"))

    cfg = "configuration"
    row(cfg, "model", a.model, b.model)
    if a.model == b.model:
        row(cfg, "model fingerprint", a.fingerprint, b.fingerprint)
    row(cfg, "parameters", a.num_params, b.num_params, lambda n: f"{n:,}")
    row(cfg, "cluster", a.cluster_description, b.cluster_description)
    row(cfg, "mesh", a.mesh_str(), b.mesh_str())
    row(cfg, "ZeRO stage", a.zero, b.zero)
    row(cfg, "recompute", a.recompute, b.recompute)
    row(cfg, "micro-batches", a.microbatches, b.microbatches)
    row(cfg, "micro-batch size", a.micro_batch_size, b.micro_batch_size)
    row(cfg, "global batch", a.global_batch_size, b.global_batch_size)
    row(cfg, "precision", precision(a.precision, a.reduce_dtype), precision(b.precision, b.reduce_dtype))
    row(cfg, "optimizer", a.optimizer, b.optimizer)
    row(cfg, "pipeline stages", len(a.stages), len(b.stages))

    ea, eb = a.estimate, b.estimate
    est = "estimate (per step, per device)"
    for what, x, y in (
        ("step time", ea.step_time_s, eb.step_time_s),
        ("compute", ea.compute_s, eb.compute_s),
        ("recompute", ea.recompute_s, eb.recompute_s),
        ("exposed communication", ea.exposed_comm_s, eb.exposed_comm_s),
        ("communication (all)", ea.comm_s, eb.comm_s),
        ("optimizer", ea.optimizer_s, eb.optimizer_s),
        ("pipeline bubble", ea.bubble_s, eb.bubble_s),
    ):
        if _differs(x, y):
            d.rows.append((est, what, secs(x), f"{secs(y)} ({_change(x, y)})"))
    if _differs(ea.samples_per_s, eb.samples_per_s):
        d.rows.append(
            (
                est,
                "samples/s",
                f"{ea.samples_per_s:,.1f}",
                f"{eb.samples_per_s:,.1f} ({_change(ea.samples_per_s, eb.samples_per_s)})",
            )
        )
    if _differs(ea.mfu, eb.mfu):
        d.rows.append((est, "MFU", f"{ea.mfu * 100:.1f}%", f"{eb.mfu * 100:.1f}%"))
    # HFU counts the recomputed forward ops too: a row of its own where either plan recomputes
    if (ea.hfu_differs or eb.hfu_differs) and _differs(ea.hfu, eb.hfu):
        d.rows.append((est, "HFU (recompute counted)", f"{ea.hfu * 100:.1f}%", f"{eb.hfu * 100:.1f}%"))
    mem = "memory per device (GB)"
    for cat in ("params", "grads", "optimizer", "activations", "buffers", "peak"):
        x, y = getattr(ea.memory, cat), getattr(eb.memory, cat)
        if _differs(x, y):
            d.rows.append((mem, cat, f"{x / GB:.3f}", f"{y / GB:.3f} ({_change(x, y)})"))
    if _differs(ea.memory_limit, eb.memory_limit):
        d.rows.append((mem, "limit", f"{ea.memory_limit / GB:.1f}", f"{eb.memory_limit / GB:.1f}"))
    row(mem, "fits", "yes" if ea.fits else "NO", "yes" if eb.fits else "NO")

    ca, cb = _collective_totals(ea.collectives), _collective_totals(eb.collectives)
    for key in sorted(set(ca) | set(cb)):
        x, y = ca.get(key), cb.get(key)
        fx = f"{x[0]} x {size(x[1])}, {secs(x[2])}" if x else "-"
        fy = f"{y[0]} x {size(y[1])}, {secs(y[2])}" if y else "-"
        if fx != fy:
            d.rows.append(("collectives per step", f"{key[0]} on {key[1]}", fx, fy))

    sa, sb = a.solver, b.solver
    row("solver", "status", sa.status or None, sb.status or None)
    row("solver", "gap", sa.gap, sb.gap, lambda g: f"{g * 100:.2g}%")
    row("solver", "configurations costed", sa.candidates, sb.candidates)
    for w in a.warnings:
        if w not in b.warnings:
            d.rows.append(("warnings", "only in " + a_name, w, "-"))
    for w in b.warnings:
        if w not in a.warnings:
            d.rows.append(("warnings", "only in " + b_name, "-", w))
    _diff_placements(a, b, d)
    return d


def _diff_placements(a: PlanData, b: PlanData, d: PlanDiff) -> None:
    if not a.placements and not b.placements:
        return
    if a.fingerprint != b.fingerprint:
        d.placement_note = "the plans are for different models: per-op placements are not compared"
        return
    changed: dict[tuple[str, str, str], int] = {}
    for node in a.placements.keys() | b.placements.keys():
        x, y = a.placements.get(node), b.placements.get(node)
        fx, fy = _entry_str(x), _entry_str(y)
        if fx == fy:
            continue
        e = x or y
        what = (
            _fold(e["param"])
            if "param" in e
            else f"{_short_op(e.get('op', ''))} in {_fold(e.get('module', '')) or 'top level'}"
        )
        key = (what, fx, fy)
        changed[key] = changed.get(key, 0) + 1
    rows = sorted(changed.items(), key=lambda kv: (-kv[1], kv[0]))
    d.placements = [(what, n, fx, fy) for (what, fx, fy), n in rows[:MAX_DIFF_ROWS]]
    if len(rows) > MAX_DIFF_ROWS:
        more = sum(n for _, n in rows[MAX_DIFF_ROWS:])
        d.placement_note = f"... and {len(rows) - MAX_DIFF_ROWS} more kinds of change ({more} ops)"


def _entry_str(e: dict[str, Any] | None) -> str:
    if e is None:
        return "(not in plan)"
    s = "out " + " | ".join(_pl(p) for p in e.get("outputs", []))
    if "zero" in e:
        s += f", ZeRO-{e['zero']}"
    if "recompute" in e:
        s += f", recompute {e['recompute']}"
    return s


def _collective_totals(colls: Iterable[dict[str, Any]]) -> dict[tuple[str, str], tuple[int, float, float]]:
    out: dict[tuple[str, str], tuple[int, float, float]] = {}
    for c in colls:
        key = (c["kind"], c["axis"])
        n, b, t = out.get(key, (0, 0.0, 0.0))
        out[key] = (n + int(c["count"]), b + c["bytes"] * c["count"], t + c["time_s"])
    return {k: (n, b / max(n, 1), t) for k, (n, b, t) in out.items()}


# ---- helpers ----------------------------------------------------------------------------------


def _console(buf: io.StringIO, width: int):
    from rich.console import Console

    return Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False)


def _differs(x: float, y: float, rtol: float = 1e-9) -> bool:
    return abs(x - y) > rtol * max(abs(x), abs(y), 1e-30)


def _change(x: float, y: float) -> str:
    if x == 0:
        return "new" if y else "same"
    if x > 0 and (y / x > 10 or y / x < 0.1):
        return f"x{y / x:.3g}"
    return f"{(y - x) / abs(x) * 100:+.1f}%"


def _fold(name: str) -> str:
    key = layer_key(name)
    return key[0] if key else name


def _pl(p: Any) -> str:
    return "-" if p is None else text(p)


def _short_op(op: str) -> str:
    """aten.addmm.default -> addmm."""
    parts = op.split(".")
    if len(parts) >= 2 and parts[0] in ("aten", "prims", "_c10d_functional"):
        return parts[1]
    return op


def _flops(f: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if f >= scale:
            return f"{f / scale:.3g} {unit}"
    return f"{f:.0f} FLOP"


def _reason(r: str) -> str:
    return {
        "data": "an input needs another placement",
        "grad-sync": "gradient synchronisation",
        "buffer-update": "a buffer's new value back to its placement",
    }.get(r, r)


def _zero_words(stage: int) -> str:
    return {
        0: "nothing sharded by ZeRO",
        1: "optimizer state sharded over dp",
        2: "optimizer state and gradient sharded over dp",
        3: "optimizer state, gradient and parameter sharded over dp",
    }.get(int(stage), "?")
