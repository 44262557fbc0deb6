"""How plans print numbers: one formatter per kind of quantity, shared by every view.

The tables use fixed decimals so columns line up; the sentences (why an op was
sharded as it was) use the ``_brief`` forms, three significant figures.
"""

from __future__ import annotations

GB = 1e9


def count(n: float) -> str:
    """An element count as people say it: 124M, 6.7B, 53.2K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def precision(name: str, reduce_dtype: str) -> str:
    """A plan's precision as the summary says it: "bf16-mixed (gradients reduced in fp32)", "fp32"."""
    return name if name == "fp32" else f"{name} (gradients reduced in {reduce_dtype})"


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


def secs_brief(s: float) -> str:
    """Seconds to three significant figures, for a number inside a sentence: 1.23 s, 45.6 ms, 7.89 us."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def size_brief(b: float) -> str:
    """Bytes to three significant figures, sign kept, for a number inside a sentence: 1.23 GB, -45.6 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"
