"""Why a plan fits: what it shards, what it recomputes, and what is live at its peak, in words.

Planning records, per plan, the facts a reader needs to see why its memory
comes out as it does (:func:`sharding_facts`, kept in ``plan.solver["sharding"]``
as plain data: parameter elements by placement and ZeRO stage, the recompute
marks by layer and op); :func:`summary_rows` and :func:`peak_line` turn them
and the estimate into the lines ``Plan.summary`` prints.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

GB = 1e9

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


def sharding_facts(captured, placements: dict[str, dict[str, Any]], axes: tuple[str, ...] = ("dp", "tp")) -> dict:
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
        out = entry["outputs"][0] or ["R"] * len(axes)
        stage = 3 if out[0] != "R" else int(entry.get("zero", 0) or 0)
        zero[str(stage)] += n
        split["+".join(a for a, pl in zip(axes, out, strict=False) if pl != "R") or "none"] += n
    return {"param_elements": total, "zero_elements": dict(zero), "split_elements": dict(split)}


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
    facts = plan.solver.get("sharding")
    mesh = plan.mesh
    if not facts:
        return [("ZeRO stage", str(plan.zero)), ("recompute", plan.recompute)]
    total = facts["param_elements"]
    dp = mesh.get("dp", 1)
    split = facts["split_elements"]
    parts = []
    for axes, n in sorted(split.items(), key=lambda kv: -kv[1]):
        if axes == "none":
            parts.append(f"{_share(n, total)} whole on every device")
        else:
            ways = math.prod(mesh.get(a, 1) for a in axes.split("+"))
            parts.append(f"{_share(n, total)} split {ways} ways over {axes}")
    parts = [f"parameter elements: {', '.join(parts)}"]
    if dp > 1:
        parts.insert(0, f"batch split {dp} ways over dp")
    if mesh.get("pp", 1) > 1:
        parts.insert(0, f"layers cut into {len(plan.stages) or mesh['pp']} pipeline stages over pp={mesh['pp']}")
    zero = facts["zero_elements"]
    stages = sorted(zero.items(), key=lambda kv: -kv[1])
    zero_text = "; ".join(
        f"{z} for {_share(n, total)} ({_STATES[int(z)]}{f' {dp} ways over dp' if int(z) else ''})"
        for z, n in stages
    )
    rec = recompute_facts(plan.placements)
    if rec["ops"]:
        kinds = ", ".join(f"{k} {v}" for k, v in rec["kinds"].items())
        how = _RECOMPUTE.get(plan.recompute, "full layers" if rec["full"] else plan.recompute)
        rec_text = (
            f"{how}: {rec['ops']} forward ops in {rec['layers']} of {rec['of_layers']} layers marked, replayed in "
            f"the backward (+{_secs(plan.estimate.recompute_s)} per step); most: {kinds}"
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
    head = f"peak {_size(mem.peak)} of the {_size(est.memory_limit)} limit " + (
        f"({_size(free)} free)" if free >= 0 else f"({_size(-free)} over)"
    )
    where = f", in the {mem.peak_at}" if mem.peak_at and not mem.peak_at.startswith("end") else (
        f", at the {mem.peak_at}" if mem.peak_at else ""
    )
    at = mem.at_peak
    if not at:
        return head + where
    names = {"grads": "gradients made so far"}
    parts = " + ".join(f"{names.get(k, k)} {_size(v)}" for k, v in at.items() if v)
    return f"{head}{where}: {parts}"


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.2f} MB"


def _secs(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.0f} ms"
