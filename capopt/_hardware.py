"""`Hardware`: one accelerator and its node, and the catalog in ``data/hardware.toml``.

The catalog is data: one TOML table per accelerator, each with the documents its numbers come
from. Entries are written in the units datasheets use (GiB or GB, TFLOP/s, TB/s, GB/s); the
loader converts them to SI units for `Hardware` (bytes, FLOP/s, bytes/s), so the cost model
never sees a unit prefix.

    >>> from capopt._hardware import get_hardware
    >>> from capopt._units import GiB
    >>> h = get_hardware("h100")                    # a profile name, an alias, or a .toml path
    >>> h.name, h.peak("bf16"), h.memory_bytes / GiB
    ('h100-sxm-80gb', 989400000000000.0, 80.0)
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ._errors import CapoptError
from ._io import check_depth, parse_toml, read_text
from ._units import GB, TB, TERA, GiB, MiB


#: dtypes a peak can be given for, in the order they are listed.
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
KINDS = ("gpu", "tpu")
VENDORS = ("nvidia", "amd", "google")

#: Where a dtype the device lacks runs instead, for `Hardware.effective_peak`.
#: tf32 -> fp32: before Ampere, XLA runs float32 matmuls on the CUDA cores.
#: bf16 -> fp32: without bf16 tensor cores (Volta, Turing) XLA computes bf16 dots in float32.
#: fp8 -> bf16 / fp16: without fp8 units XLA upcasts fp8 dots.
#: fp32/tf32 on a TPU -> bf16: JAX's default matmul precision runs float32 matmuls as one
#: bfloat16 pass on the MXU (``jax.default_matmul_precision``).
_FALLBACK = {
    "gpu": {"tf32": ("fp32",), "bf16": ("fp32",), "fp16": ("fp32",), "fp8": ("bf16", "fp16"),
            "int8": ()},
    "tpu": {"fp32": ("bf16",), "tf32": ("bf16",), "fp16": ("bf16",), "fp8": ("bf16",),
            "int8": ()},
}

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")

@dataclass(frozen=True)
class Hardware:
    """One accelerator. Rates are per device: FLOP/s, bytes/s (one direction).

    ``memory_bytes`` is physical capacity; what the driver and the framework reserve is the
    runtime profile's business. ``intra_node_bw`` is the device's fabric inside a node (NVLink,
    Infinity Fabric, TPU ICI; PCIe where there is none), ``inter_node_bw`` its share of the
    scale-out network in a typical deployment, ``host_bw`` its link to the CPU.
    """

    name: str
    memory_bytes: int
    peak_flops: tuple[tuple[str, float], ...]      # (dtype, dense FLOP/s), dtypes in DTYPES
    mem_bw: float                                 # HBM/GDDR bytes/s
    intra_node_bw: float                          # per device, one direction, bytes/s
    inter_node_bw: float                          # per device, one direction, bytes/s
    host_bw: float                                # host link per device, one direction, bytes/s
    per_node: int = 8
    power_w: float | None = None                  # maximum board power; None: not published
    vendor: str = "nvidia"
    sm_count: int | None = None                   # SMs (NVIDIA) or compute units (AMD)
    l2_bytes: int | None = None
    clock_mhz: float | None = None                # boost clock
    price_per_hour: float | None = None           # USD per device-hour
    aliases: tuple[str, ...] = ()
    source: str = ""                              # URLs, "; "-separated
    kind: str = "gpu"                             # gpu | tpu
    compute_capability: str | None = None         # "9.0" (CUDA) or "gfx942" (ROCm)
    notes: str = ""
    # the share of the rates capopt's GEMM model gives the datasheet's tensor peaks that this
    # part's GEMMs sustain under its power limit (1: the datasheet part's)
    sustained_tensor_share: float = 1.0

    def __post_init__(self):
        where = self.name or "hardware"
        if not isinstance(self.name, str) or not self.name:
            raise CapoptError("a hardware profile needs a name", field="hardware.gpu")
        if not _is_int(self.memory_bytes) or self.memory_bytes <= 0:
            raise CapoptError(f"must be a positive integer, got {self.memory_bytes!r}",
                              field=f"{where}.memory_bytes")
        if not self.peak_flops:
            raise CapoptError("needs at least one peak", field=f"{where}.peak_flops",
                              allowed=", ".join(DTYPES))
        seen = set()
        for dtype, flops in self.peak_flops:
            if dtype not in DTYPES or dtype in seen:
                raise CapoptError(f"unknown or repeated dtype {dtype!r}",
                                  field=f"{where}.peak_flops", allowed=", ".join(DTYPES))
            seen.add(dtype)
            _check_positive(flops, f"{where}.peak_flops.{dtype}")
        for attr in ("mem_bw", "intra_node_bw", "inter_node_bw", "host_bw"):
            _check_positive(getattr(self, attr), f"{where}.{attr}")
        if not _is_int(self.per_node) or self.per_node < 1:
            raise CapoptError(f"must be a positive integer, got {self.per_node!r}",
                              field=f"{where}.per_node")
        if self.kind not in KINDS:
            raise CapoptError(f"got {self.kind!r}", field=f"{where}.kind", allowed=", ".join(KINDS))
        for attr in ("power_w", "clock_mhz", "price_per_hour"):
            if getattr(self, attr) is not None:
                _check_positive(getattr(self, attr), f"{where}.{attr}", allow_zero=True)
        share = self.sustained_tensor_share
        if not _is_num(share) or not 0.0 < share <= 1.0:
            raise CapoptError(f"must be a number in (0, 1], got {share!r}",
                              field=f"{where}.sustained_tensor_share")
        for attr in ("sm_count", "l2_bytes"):
            v = getattr(self, attr)
            if v is not None and (not _is_int(v) or v <= 0):
                raise CapoptError(f"must be a positive integer, got {v!r}", field=f"{where}.{attr}")

    # --- compute -------------------------------------------------------------------------------

    @property
    def peaks(self) -> dict[str, float]:
        """Dense peak FLOP/s (int8: OP/s) by dtype, for the dtypes the device has."""
        return dict(self.peak_flops)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a `CapoptError` if the device has no such unit."""
        table = dict(self.peak_flops)
        if dtype in table:
            return table[dtype]
        raise CapoptError(f"{self.name} has no peak for {dtype!r}", field="hardware.gpu",
                          allowed=", ".join(table))

    def effective_peak(self, dtype: str) -> float:
        """The rate a matmul in ``dtype`` runs at here, falling back where the unit is missing.

        A device without ``dtype`` runs it in the dtype XLA converts it to (see ``_FALLBACK``):
        tf32 on a V100 runs at the fp32 rate, fp8 on an A100 at the bf16 rate, float32 on a TPU
        at the bf16 rate (JAX's default matmul precision). A `CapoptError` if none applies.

            >>> get_hardware("v100").effective_peak("tf32") == get_hardware("v100").peak("fp32")
            True
        """
        table = dict(self.peak_flops)
        if dtype in table:
            return table[dtype]
        if dtype not in DTYPES:
            raise CapoptError(f"unknown dtype {dtype!r}", field="hardware.gpu",
                              allowed=", ".join(DTYPES))
        for alt in _FALLBACK[self.kind].get(dtype, ()):
            if alt in table:
                return table[alt]
        raise CapoptError(f"{self.name} cannot run {dtype!r} matmuls", field="hardware.gpu",
                          allowed=", ".join(table))

    # --- description ---------------------------------------------------------------------------

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    def describe(self) -> str:
        """One line for people: memory, the 16-bit dense peak, memory and link bandwidths.

            >>> get_hardware("h100").describe()[:48]
            'h100-sxm-80gb: 80 GiB, 989 TFLOP/s bf16, 3.35 TB'
        """
        gib = self.memory_gib
        mem = f"{gib:.0f}" if abs(gib - round(gib)) < 0.05 else f"{gib:.1f}"
        table = dict(self.peak_flops)
        dtype = next((d for d in ("bf16", "fp16") if d in table), max(table, key=table.get))
        return (f"{self.name}: {mem} GiB, {table[dtype] / TERA:.0f} TFLOP/s {dtype}, "
                f"{self.mem_bw / TB:.4g} TB/s memory, "
                f"{_g(self.intra_node_bw / GB)}/{_g(self.inter_node_bw / GB)} GB/s "
                f"intra/inter-node, {self.per_node} per node")


# --- loading ------------------------------------------------------------------------------------

#: Keys of a catalog entry, with what each holds (shown when a key is wrong).
ENTRY_KEYS: dict[str, str] = {
    "vendor": "nvidia | amd | google",
    "kind": "gpu | tpu",
    "memory_gib": "capacity in GiB (2^30 B)",
    "memory_gb": "capacity in GB (10^9 B)",
    "mem_bw_tb_s": "memory bandwidth, TB/s",
    "peak_tflops": "dense peak per dtype, TFLOP/s",
    "intra_node_gb_s": "in-node device link, one direction, GB/s",
    "inter_node_gb_s": "scale-out network per device, one direction, GB/s",
    "host_gb_s": "host link per device, one direction, GB/s",
    "per_node": "devices per node",
    "tdp_w": "maximum board power, W",
    "sm_count": "SMs or compute units",
    "l2_mib": "L2 cache, MiB",
    "boost_clock_mhz": "boost clock, MHz",
    "sustained_tensor_share": "share of the modelled tensor-core rate sustained under the "
                              "part's power limit, (0, 1] (default 1)",
    "compute_capability": "e.g. \"9.0\" or \"gfx942\"",
    "price_usd_per_hour": "USD per device-hour",
    "price_source": "where the price comes from",
    "aliases": "other names",
    "source": "datasheet URLs",
    "notes": "assumptions and caveats",
}
_REQUIRED = ("mem_bw_tb_s", "peak_tflops", "intra_node_gb_s", "inter_node_gb_s", "host_gb_s",
             "source")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_positive(v: object, field: str, *, allow_zero: bool = False) -> None:
    if not _is_num(v) or v < 0 or (v == 0 and not allow_zero):
        raise CapoptError(f"must be a {'non-negative' if allow_zero else 'positive'} number, "
                          f"got {v!r}", field=field)


def _g(x: float) -> str:
    return f"{x:.3g}"


def _num(t: Mapping, key: str, name: str, file: str, *, integer: bool = False) -> float | None:
    if key not in t:
        return None
    v = t[key]
    ok = _is_int(v) if integer else _is_num(v)
    if not ok or v <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise CapoptError(f"must be {kind}, got {v!r}", file=file, field=f"{name}.{key}")
    # in these units (GiB, TFLOP/s, TB/s, GB/s, W, MHz) no accelerator comes near 10^6
    if v > 1e6:
        raise CapoptError(f"got {v!r}", file=file, field=f"{name}.{key}",
                          allowed="a positive number up to 1e6 in the field's unit")
    return v


def _str(t: Mapping, key: str, name: str, file: str) -> str | None:
    if key not in t:
        return None
    v = t[key]
    if not isinstance(v, str) or not v.strip():
        raise CapoptError(f"must be a non-empty string, got {v!r}", file=file,
                          field=f"{name}.{key}")
    return v.strip()


def _str_list(t: Mapping, key: str, name: str, file: str) -> tuple[str, ...]:
    v = t.get(key, [])
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s.strip() for s in v):
        raise CapoptError(f"must be a list of non-empty strings, got {v!r}", file=file,
                          field=f"{name}.{key}")
    return tuple(s.strip() for s in v)


def parse_entry(name: str, table: object, file: str) -> Hardware:
    """Build a `Hardware` from one catalog table, converting its units to SI.

    ``file`` names the source in errors. Unknown keys, missing keys and bad values raise
    `CapoptError` naming the file and the field (``<name>.<key>``).
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise CapoptError(f"bad profile name {name!r}: use lower case <chip>[-<form factor>]-"
                          "<memory>, e.g. h100-sxm-80gb", file=file, field=str(name))
    if not isinstance(table, Mapping):
        raise CapoptError(f"must be a table ([{name}]), got {type(table).__name__}", file=file,
                          field=name)
    unknown = sorted(set(table) - set(ENTRY_KEYS))
    if unknown:
        raise CapoptError(f"unknown key {unknown[0]!r}", file=file, field=f"{name}.{unknown[0]}",
                          allowed=", ".join(ENTRY_KEYS))
    missing = [k for k in _REQUIRED if k not in table]
    if missing:
        raise CapoptError("missing", file=file, field=f"{name}.{missing[0]}")

    has_gib, has_gb = "memory_gib" in table, "memory_gb" in table
    if has_gib == has_gb:
        raise CapoptError("give exactly one of memory_gib (GiB) and memory_gb (GB)", file=file,
                          field=f"{name}.memory_gib")
    mem_key = "memory_gib" if has_gib else "memory_gb"
    memory = _num(table, mem_key, name, file)
    memory_bytes = round(memory * (GiB if has_gib else GB))

    peaks = table["peak_tflops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise CapoptError("must be a table of dtype = TFLOP/s, e.g. { bf16 = 989.4 }", file=file,
                          field=f"{name}.peak_tflops", allowed=", ".join(DTYPES))
    bad = [d for d in peaks if d not in DTYPES]
    if bad:
        raise CapoptError(f"unknown dtype {bad[0]!r}", file=file,
                          field=f"{name}.peak_tflops.{bad[0]}", allowed=", ".join(DTYPES))
    peak_flops = []
    for dtype in DTYPES:
        if dtype in peaks:
            v = _num(peaks, dtype, f"{name}.peak_tflops", file)
            peak_flops.append((dtype, float(v) * TERA))

    vendor = _str(table, "vendor", name, file) or "nvidia"
    if vendor not in VENDORS:
        raise CapoptError(f"got {vendor!r}", file=file, field=f"{name}.vendor",
                          allowed=", ".join(VENDORS))
    kind = _str(table, "kind", name, file) or ("tpu" if vendor == "google" else "gpu")
    if kind not in KINDS:
        raise CapoptError(f"got {kind!r}", file=file, field=f"{name}.kind",
                          allowed=", ".join(KINDS))
    cc = _str(table, "compute_capability", name, file)
    if cc is not None:
        pattern = r"^\d+\.\d+$" if vendor == "nvidia" else r"^gfx[0-9a-f]+$"
        if kind != "gpu" or not re.match(pattern, cc):
            raise CapoptError(f"got {cc!r}", file=file, field=f"{name}.compute_capability",
                              allowed='"<major>.<minor>" for NVIDIA GPUs, "gfx<arch>" for AMD')

    sources = _str_list(table, "source", name, file)
    if not any(s.startswith(("https://", "http://")) for s in sources):
        raise CapoptError("needs at least one URL of the document the numbers come from",
                          file=file, field=f"{name}.source")
    aliases = tuple(a.lower() for a in _str_list(table, "aliases", name, file))
    for a in aliases:
        if not _NAME_RE.match(a):
            raise CapoptError(f"bad alias {a!r}", file=file, field=f"{name}.aliases")

    price = table.get("price_usd_per_hour")
    if price is not None and (not _is_num(price) or price < 0):
        raise CapoptError(f"must be a non-negative number, got {price!r}", file=file,
                          field=f"{name}.price_usd_per_hour")
    if price is not None and "price_source" not in table:
        raise CapoptError("a price needs a price_source", file=file, field=f"{name}.price_source")
    _str(table, "price_source", name, file)

    l2 = _num(table, "l2_mib", name, file)
    tdp = _num(table, "tdp_w", name, file)
    clock = _num(table, "boost_clock_mhz", name, file)
    per_node = _num(table, "per_node", name, file, integer=True)
    sm = _num(table, "sm_count", name, file, integer=True)
    share = _num(table, "sustained_tensor_share", name, file)
    try:
        return Hardware(
            name=name,
            memory_bytes=memory_bytes,
            peak_flops=tuple(peak_flops),
            mem_bw=float(_num(table, "mem_bw_tb_s", name, file)) * TB,
            intra_node_bw=float(_num(table, "intra_node_gb_s", name, file)) * GB,
            inter_node_bw=float(_num(table, "inter_node_gb_s", name, file)) * GB,
            host_bw=float(_num(table, "host_gb_s", name, file)) * GB,
            per_node=8 if per_node is None else per_node,
            power_w=None if tdp is None else float(tdp),
            vendor=vendor,
            sm_count=sm,
            l2_bytes=None if l2 is None else round(l2 * MiB),
            clock_mhz=None if clock is None else float(clock),
            price_per_hour=None if price is None else float(price),
            aliases=aliases,
            source="; ".join(sources),
            kind=kind,
            compute_capability=cc,
            notes=_str(table, "notes", name, file) or "",
            sustained_tensor_share=1.0 if share is None else float(share),
        )
    except CapoptError as e:
        raise e.in_file(file) from None


def _parse_toml(text: str, file: str) -> dict[str, Any]:
    data = parse_toml(text, file)
    check_depth(data, file, limit=3)
    return data


def _catalog_file():
    return resources.files(__package__) / "data" / "hardware.toml"


@functools.cache
def _catalog() -> tuple[dict[str, Hardware], dict[str, str]]:
    """(profiles by name, name by alias), read once. Callers must not mutate these."""
    ref = _catalog_file()
    file = str(ref)
    data = _parse_toml(ref.read_text(encoding="utf-8"), file)
    entries: dict[str, Hardware] = {}
    for name, table in data.items():
        entries[name] = parse_entry(name, table, file)
    alias_to_name: dict[str, str] = {}
    for h in entries.values():
        for a in h.aliases:
            if a in entries or a in alias_to_name:
                other = a if a in entries else alias_to_name[a]
                raise CapoptError(f"alias {a!r} is already taken by {other!r}", file=file,
                                  field=f"{h.name}.aliases")
            alias_to_name[a] = h.name
    return entries, alias_to_name


def load_catalog() -> dict[str, Hardware]:
    """Every profile in the packaged catalog, by name (a fresh dict; the file is read once)."""
    return dict(_catalog()[0])


def list_hardware() -> list[str]:
    """Profile names in the packaged catalog, sorted."""
    return sorted(_catalog()[0])


def load_hardware_file(path: str | os.PathLike[str]) -> Hardware:
    """Read a TOML file that holds one accelerator table in the catalog's format."""
    p = Path(path)
    file = str(path)
    data = _parse_toml(read_text(p, field="hardware.gpu"), file)
    tables = [k for k, v in data.items() if isinstance(v, Mapping)]
    if len(data) != 1 or len(tables) != 1:
        found = ", ".join(data) or "nothing"
        raise CapoptError(f"must hold exactly one accelerator table like [my-gpu-80gb], found "
                          f"{found}", file=file)
    name = tables[0]
    return parse_entry(name, data[name], file)


def _looks_like_path(s: str) -> bool:
    return s.endswith(".toml") or "/" in s or os.sep in s


def get_hardware(name_or_path: str | os.PathLike[str] | Hardware) -> Hardware:
    """A profile by name (``h100-sxm-80gb``), alias (``h100``), or path to a ``.toml`` file.

    Names and aliases are matched case-insensitively. A file holds one table in the catalog's
    format. An unknown name raises `CapoptError` with ``field="hardware.gpu"`` and the profile
    names as ``allowed``.
    """
    if isinstance(name_or_path, Hardware):
        return name_or_path
    if isinstance(name_or_path, os.PathLike):
        return load_hardware_file(name_or_path)
    if not isinstance(name_or_path, str):
        raise CapoptError(f"must be a profile name or a path, got {name_or_path!r}",
                          field="hardware.gpu")
    if _looks_like_path(name_or_path):
        return load_hardware_file(name_or_path)
    entries, aliases = _catalog()
    key = name_or_path.strip().lower()
    if key in entries:
        return entries[key]
    if key in aliases:
        return entries[aliases[key]]
    raise CapoptError(f"unknown GPU {name_or_path!r}", field="hardware.gpu",
                      allowed=", ".join(sorted(entries)))
