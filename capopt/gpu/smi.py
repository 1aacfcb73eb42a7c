"""nvidia-smi's output, parsed: its CSV queries (``--format=csv[,noheader][,nounits]``) and
its plain table (old and new layouts). The one parser the doctor and the monitor share; the
fixtures under ``tests/fixtures/gpu`` are real outputs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .._units import MiB

QUERY_GPU_FIELDS: tuple[str, ...] = (
    "index", "name", "driver_version", "memory.total", "memory.used", "pci.bus_id",
)
QUERY_APPS_FIELDS: tuple[str, ...] = ("gpu_bus_id", "pid", "process_name", "used_memory")

_UNIT_RE = re.compile(r"\s*\[[^\]]*\]$")
_NUM_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(?:%|MiB|W|MHz|C|us)?\s*$")
# names nvidia-smi prints in a header for fields queried under another name
SMI_FIELD_ALIASES = {"used_gpu_memory": "used_memory", "gpu_name": "name"}


def smi_csv_rows(text: str, fields: Sequence[str] | None = None) -> list[dict[str, str]]:
    """Rows of nvidia-smi CSV keyed by field name, units stripped from the header. The first
    line is read as the header when it names fields (always, when ``fields`` is None; a
    header's names for fields queried under another name are mapped back to ``fields``');
    otherwise (``noheader``) ``fields`` names the columns in order."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    first = [_UNIT_RE.sub("", c.strip()) for c in lines[0].split(",")]
    if fields is None:
        names, body = first, lines[1:]
    else:
        known = set(fields) | set(SMI_FIELD_ALIASES) | set(SMI_FIELD_ALIASES.values())
        header = any(c in known for c in first) and not any(smi_number(c) is not None
                                                            for c in first)
        names, body = (([SMI_FIELD_ALIASES.get(c, c) for c in first], lines[1:]) if header
                       else (list(fields), lines))
    return [dict(zip(names, (v.strip() for v in ln.split(",")), strict=False)) for ln in body]


def parse_csv_with_header(text: str) -> list[dict[str, str]]:
    """Rows of nvidia-smi ``--format=csv`` output keyed by field name (units stripped)."""
    return smi_csv_rows(text)


def smi_number(value: Any) -> float | None:
    """A number from an nvidia-smi cell (``"631.95 W"``, ``"100 %"``, ``"[N/A]"`` -> None)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    m = _NUM_RE.match(str(value))
    return float(m.group(1)) if m else None




def _mib_to_bytes(cell: str | None) -> int | None:
    v = smi_number(cell)
    return None if v is None else int(v * MiB)


def parse_query_gpu_csv(text: str, fields: Sequence[str] = QUERY_GPU_FIELDS) -> list[dict[str, Any]]:
    """GPUs from ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]``.

    Returns dicts with ``index``, ``name``, ``driver_version``, ``memory_total_bytes``,
    ``memory_used_bytes`` and ``bus_id`` (``None`` where the query lacks the field).
    Without a header, ``fields`` names the columns in order.
    """
    gpus = []
    for i, row in enumerate(smi_csv_rows(text, fields)):
        idx = smi_number(row.get("index"))
        gpus.append(
            {
                "index": int(idx) if idx is not None else i,
                "name": row.get("name"),
                "driver_version": row.get("driver_version"),
                "memory_total_bytes": _mib_to_bytes(row.get("memory.total")),
                "memory_used_bytes": _mib_to_bytes(row.get("memory.used")),
                "bus_id": row.get("pci.bus_id"),
            }
        )
    return gpus


def parse_query_apps_csv(text: str, fields: Sequence[str] = QUERY_APPS_FIELDS) -> list[dict[str, Any]]:
    """Processes from ``nvidia-smi --query-compute-apps=...``.

    Returns dicts with ``pid``, ``name``, ``used_bytes`` and ``bus_id``.
    """
    procs = []
    for row in smi_csv_rows(text, fields):
        pid = smi_number(row.get("pid"))
        if pid is None:
            continue
        procs.append(
            {
                "pid": int(pid),
                "name": row.get("process_name"),
                "used_bytes": _mib_to_bytes(row.get("used_memory")),
                "bus_id": row.get("gpu_bus_id"),
            }
        )
    return procs


_SMI_DRIVER_RE = re.compile(r"(?:Driver|KMD) Version:\s*([0-9][0-9.]*)")
_SMI_CUDA_RE = re.compile(r"CUDA(?: UMD)? Version:\s*([0-9][0-9.]*|N/A)")
_SMI_GPU_ROW_RE = re.compile(
    r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off|N/A)\s*\|\s*"
    r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])"
)
_SMI_MEM_RE = re.compile(r"(\d+)MiB\s*/\s*(\d+)MiB")
_SMI_PROC_RE = re.compile(
    r"^\|\s+(\d+)\s+(?:(?:N/A|\d+)\s+(?:N/A|\d+)\s+)?"  # GPU, then GI and CI on newer drivers
    r"(\d+)\s+(C\+G|C|G|M|M\+C)\s+(.+?)\s+(N/A|\d+MiB)\s*\|\s*$"
)


def parse_smi_table(text: str) -> dict[str, Any]:
    """Facts from plain ``nvidia-smi`` output (old and new table layouts).

    Returns ``driver_version``, ``cuda_version`` (the newest CUDA the driver supports),
    ``gpus`` (``index``, ``name``, ``bus_id``, ``memory_used_bytes``,
    ``memory_total_bytes``), ``processes`` and ``header_seen``. Names in old layouts may be
    truncated by nvidia-smi (``NVIDIA A100-SXM...``).
    """
    driver = _SMI_DRIVER_RE.search(text)
    cuda = _SMI_CUDA_RE.search(text)
    gpus: list[dict[str, Any]] = []
    procs: list[dict[str, Any]] = []
    expect_mem = False
    in_procs = False
    for line in text.splitlines():
        if "Processes:" in line:
            in_procs = True
            continue
        if in_procs:
            m = _SMI_PROC_RE.match(line)
            if m:
                mem = m.group(5)
                procs.append(
                    {
                        "gpu_index": int(m.group(1)),
                        "pid": int(m.group(2)),
                        "type": m.group(3),
                        "name": m.group(4),
                        "used_bytes": None if mem == "N/A" else int(mem[:-3]) * MiB,
                    }
                )
            continue
        m = _SMI_GPU_ROW_RE.match(line)
        if m:
            gpus.append(
                {
                    "index": int(m.group(1)),
                    "name": m.group(2).strip(),
                    "bus_id": m.group(3),
                    "memory_used_bytes": None,
                    "memory_total_bytes": None,
                }
            )
            expect_mem = True
            continue
        if expect_mem:
            mm = _SMI_MEM_RE.search(line)
            if mm:
                gpus[-1]["memory_used_bytes"] = int(mm.group(1)) * MiB
                gpus[-1]["memory_total_bytes"] = int(mm.group(2)) * MiB
            expect_mem = False
    cuda_version = cuda.group(1) if cuda else None
    return {
        "driver_version": driver.group(1) if driver else None,
        "cuda_version": None if cuda_version == "N/A" else cuda_version,
        "gpus": gpus,
        "processes": procs,
        "header_seen": driver is not None,
    }


__all__ = ["QUERY_APPS_FIELDS", "QUERY_GPU_FIELDS", "SMI_FIELD_ALIASES", "parse_csv_with_header",
           "parse_query_apps_csv", "parse_query_gpu_csv", "parse_smi_table", "smi_csv_rows",
           "smi_number"]
