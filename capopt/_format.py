"""Plain-text tables and units for the terminal (no numerics beyond unit conversion)."""

from __future__ import annotations

from typing import Iterable, Sequence

from ._units import GiB, KiB, MiB


def gib(x: float) -> str:
    """Bytes as a number of GiB, for a table whose column says the unit: ``12.34``."""
    return f"{x / GiB:,.2f}"


def format_bytes(n: float | None, missing: str = "-") -> str:
    """Bytes for people, with their unit: GiB down to MiB and KiB for small amounts
    (``12.34 GiB``, ``74.5 KiB``, ``512 B``); ``missing`` where there is no number."""
    if n is None:
        return missing
    if abs(n) >= GiB:
        return f"{n / GiB:,.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:,.1f} MiB"
    if abs(n) >= KiB:
        return f"{n / KiB:,.1f} KiB"
    return f"{int(n)} B"


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


# the knobs of a config in the order a one-line summary lists them, and their short names
_CONFIG_KEYS = ("micro_batch", "grad_accum", "dp", "dp_replicate", "zero_stage", "tp", "pp",
                "vpp", "ep", "cp", "sequence_parallel", "remat", "offload_optimizer",
                "offload_params", "flash_attention")
CONFIG_SHORT = {"micro_batch": "mb", "grad_accum": "ga", "zero_stage": "zero",
                "sequence_parallel": "sp", "offload_optimizer": "offload",
                "offload_params": "param-offload", "flash_attention": "flash",
                "dp_replicate": "hsdp"}


def config_line(cfg: dict) -> str:
    """One line for a config's dict (``Config.to_dict()``): ``mb=4 ga=2 dp=8 zero=1 ...``;
    the context-parallel degree, the virtual pipeline stages, the hybrid-sharding replicas
    and parameter offload only where they are used (cp > 1, vpp > 1, dp_replicate > 1:
    ``hsdp=4``; ``param-offload=on``)."""
    parts = []
    for k in _CONFIG_KEYS:
        if k in ("cp", "vpp", "dp_replicate") and cfg.get(k, 1) == 1:
            continue
        if k == "offload_params" and not cfg.get(k, False):
            continue
        v = cfg[k]
        if isinstance(v, bool):
            v = "on" if v else "off"
        parts.append(f"{CONFIG_SHORT.get(k, k)}={v}")
    return " ".join(parts)
