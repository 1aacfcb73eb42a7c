"""Plain-text tables and units for the terminal (no numerics beyond unit conversion)."""

from __future__ import annotations

from typing import Iterable, Sequence

GiB = 2**30


def gib(x: float) -> str:
    return f"{x / GiB:,.2f}"


def si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:,.2f} {prefix}{unit}"
    return f"{x:,.2f} {unit}".rstrip()


def seconds(x: float) -> str:
    if x >= 86400:
        return f"{x / 86400:,.1f} d"
    if x >= 3600:
        return f"{x / 3600:,.1f} h"
    if x >= 1:
        return f"{x:,.3f} s"
    return f"{x * 1e3:,.2f} ms"


def table(rows: Iterable[Sequence], headers: Sequence[str], align: str | None = None) -> str:
    """A boxed-free aligned table; ``align`` has one of 'l'/'r' per column."""
    rows = [[str(c) for c in r] for r in rows]
    headers = [str(h) for h in headers]
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(cells, widths, align)).rstrip()

    line = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(headers), line] + [fmt(r) for r in rows])


def bar(fraction: float, width: int = 20) -> str:
    fraction = max(0.0, min(1.0, fraction))
    full = int(round(fraction * width))
    return "#" * full + "." * (width - full)
