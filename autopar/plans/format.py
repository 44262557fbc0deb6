"""How plans print numbers: one formatter per kind of quantity, shared by every view."""

from __future__ import annotations

from typing import Any

GB = 1e9


def count(n: float) -> str:
    """An element count as people say it: 124M, 6.7B, 53.2K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def secs(s: float) -> str:
    """Seconds as people read them: 1.234 s, 12.34 ms, 56.7 us."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def size(b: float) -> str:
    """Bytes in the largest unit that keeps a leading digit: 1.23 GB, 45.60 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def solver_line(solver: dict[str, Any], mesh: dict[str, int] | None = None) -> str:
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
