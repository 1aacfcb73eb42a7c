"""What the doctor's probes gather and its judges read: the raw outputs of one machine
(`DriverRaw`, `JaxRaw`, `StepRaw`, `VersionsRaw`), the driver's facts read from them, and the
same inputs parsed from a pasted ``jax.print_environment_info()`` report."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .smi import parse_query_apps_csv, parse_query_gpu_csv, parse_smi_table


MEMORY_ENV_VARS: tuple[str, ...] = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "TF_GPU_ALLOCATOR",
    "XLA_FLAGS",
)
"""Environment variables the ``memory-settings`` check explains."""
PLUGIN_DISTRIBUTIONS: tuple[str, ...] = (
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-rocm-plugin",
)


# ---------------------------------------------------------------------------------------------
# Raw inputs (what probes gather and judges read)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriverRaw:
    """What the NVIDIA driver said, as gathered.

    Attributes:
        nvml: facts read through NVML as plain data (``driver_version``,
            ``cuda_driver_version`` as NVML's integer, ``gpus``, ``processes``), or ``None``.
        nvml_error: why NVML gave nothing.
        smi_path: where ``nvidia-smi`` was found; ``None`` when it is not on PATH.
        smi_query_gpu: output of ``nvidia-smi --query-gpu=...`` (CSV, any header/units form).
        smi_query_apps: output of ``nvidia-smi --query-compute-apps=...`` (CSV).
        smi_table: output of plain ``nvidia-smi`` (the table; its header carries the CUDA
            version the driver supports).
        smi_error: what ``nvidia-smi`` printed when it failed.
        pci_nvidia_devices: NVIDIA display/3D controllers on the PCI bus (Linux), or ``None``.
        own_pid: the probing process, whose own device memory is not counted as taken.
    """

    nvml: dict[str, Any] | None = None
    nvml_error: str | None = None
    smi_path: str | None = None
    smi_query_gpu: str | None = None
    smi_query_apps: str | None = None
    smi_table: str | None = None
    smi_error: str | None = None
    pci_nvidia_devices: int | None = None
    own_pid: int | None = None


@dataclass(frozen=True)
class JaxRaw:
    """What JAX said about itself.

    Attributes:
        jax_version / jaxlib_version: version strings, ``None`` if unknown.
        backend: ``jax.default_backend()`` (``cpu``, ``gpu``, ``tpu``, ...).
        devices: ``repr`` of each device.
        device_kinds: ``device.device_kind`` of each device.
        backend_errors: platform -> error text for backends that failed to initialise.
        log_text: warnings JAX / XLA logged (or pasted from a report).
        cuda_versions: integers from jaxlib's CUDA version helpers: ``cuda_runtime_build``,
            ``cuda_runtime``, ``cudnn_build``, ``cudnn``, ``cuda_driver`` (absent if unknown).
        plugins: installed JAX accelerator plugin distributions -> version.
        env: ``JAX_PLATFORMS`` and ``CUDA_VISIBLE_DEVICES`` as seen by the process.
        error: why JAX could not be imported or initialised.
        compile_only_plugin: where `capopt setup xla-gpu` put the compile-only CUDA plugin
            (kept off ``sys.path``), ``None`` if it is not there.
    """

    jax_version: str | None = None
    jaxlib_version: str | None = None
    backend: str | None = None
    devices: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()
    backend_errors: Mapping[str, str] = field(default_factory=dict)
    log_text: str = ""
    cuda_versions: Mapping[str, int | None] = field(default_factory=dict)
    plugins: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None
    compile_only_plugin: str | None = None


@dataclass(frozen=True)
class StepRaw:
    """The tiny training step, as measured.

    Attributes:
        platform: the default device's platform.
        device: ``repr`` of the default device.
        output_platforms: platform of every device holding an output array.
        compile_s: lowering + compilation time.
        run_s: median wall time of the compiled step after one warm-up call.
        first_run_s: the warm-up call (includes transfers of the inputs).
        memory_stats: ``device.memory_stats()`` after the step, ``None`` when unsupported.
        error: the exception text when the step failed.
    """

    platform: str | None = None
    device: str | None = None
    output_platforms: tuple[str, ...] = ()
    compile_s: float | None = None
    run_s: float | None = None
    first_run_s: float | None = None
    memory_stats: Mapping[str, int] | None = None
    error: str | None = None


@dataclass(frozen=True)
class VersionsRaw:
    """Interpreter and package versions (``None`` = not installed)."""

    python: str
    packages: Mapping[str, str | None]


# ---------------------------------------------------------------------------------------------
# Driver facts (pure: DriverRaw -> DriverFacts)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriverFacts:
    """What the driver outputs add up to."""

    source: str
    gpu_visible: bool
    driver_version: str | None
    cuda_version: str | None
    gpus: tuple[dict[str, Any], ...]
    processes: tuple[dict[str, Any], ...]
    problem: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "gpu_visible": self.gpu_visible,
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "gpus": [dict(g) for g in self.gpus],
            "processes": [dict(p) for p in self.processes],
        }


def _cuda_int_to_str(v: int | None) -> str | None:
    """NVML / CUDA runtime version integers: 12020 -> "12.2"."""
    if v is None or v <= 0:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


def read_driver(raw: DriverRaw) -> DriverFacts:
    """Combine NVML and nvidia-smi outputs into one set of facts (NVML first)."""
    if raw.nvml:
        nvml_gpus = tuple(dict(g) for g in raw.nvml.get("gpus", []))
        return DriverFacts(
            source="nvml",
            gpu_visible=bool(nvml_gpus),
            driver_version=raw.nvml.get("driver_version"),
            cuda_version=_cuda_int_to_str(raw.nvml.get("cuda_driver_version")),
            gpus=nvml_gpus,
            processes=tuple(dict(p) for p in raw.nvml.get("processes", [])),
            problem=None if nvml_gpus else "NVML reports no GPUs",
        )
    table = parse_smi_table(raw.smi_table) if raw.smi_table else None
    gpus_q = parse_query_gpu_csv(raw.smi_query_gpu) if raw.smi_query_gpu else []
    gpus_t = table["gpus"] if table else []
    gpus = gpus_q or gpus_t
    procs: list[dict[str, Any]] = []
    if raw.smi_query_apps is not None:
        bus_to_index = {(g.get("bus_id") or "").lower(): g["index"] for g in gpus}
        for p in parse_query_apps_csv(raw.smi_query_apps):
            p = dict(p)
            p["gpu_index"] = bus_to_index.get((p.pop("bus_id") or "").lower())
            procs.append(p)
    elif table:
        procs = list(table["processes"])
    driver_version = (table or {}).get("driver_version") or next(
        (g["driver_version"] for g in gpus_q if g.get("driver_version")), None
    )
    cuda_version = (table or {}).get("cuda_version")
    text = "\n".join(t for t in (raw.smi_table, raw.smi_error, raw.smi_query_gpu) if t)
    no_devices = "No devices were found" in text
    # nvidia-smi prints its table header only when it reached the driver and found a GPU,
    # so a header with no parsed GPU rows (a truncated paste) still means "visible".
    visible = bool(gpus) or (bool(table and table["header_seen"]) and not no_devices)
    for g in gpus:
        g.pop("driver_version", None)
    problem = None
    if raw.smi_error and not visible:
        problem = raw.smi_error.strip().splitlines()[0] if raw.smi_error.strip() else "nvidia-smi failed"
    elif no_devices:
        problem = "nvidia-smi: No devices were found"
    source = "nvidia-smi" if (raw.smi_path or raw.smi_table or raw.smi_query_gpu) else "none"
    return DriverFacts(
        source=source,
        gpu_visible=visible,
        driver_version=driver_version,
        cuda_version=cuda_version,
        gpus=tuple(gpus),
        processes=tuple(procs),
        problem=problem,
    )


# ---------------------------------------------------------------------------------------------
# Parsing a pasted jax.print_environment_info() report
# ---------------------------------------------------------------------------------------------

_ENV_LINE_RES = {
    "jax": re.compile(r"^jax:\s+(\S+)"),
    "jaxlib": re.compile(r"^jaxlib:\s+(\S+)"),
    "devices": re.compile(r"^jax\.devices \((\d+) total, (\d+) local\): \[(.*)\]\s*$"),
    "device_info": re.compile(r"^device info: (.+)-(\d+), (\d+) local devices"),
}


def _backend_from_device_repr(text: str) -> str | None:
    t = text.lower()
    if "cpudevice" in t or "tfrt_cpu" in t or t.startswith("cpu"):
        return "cpu"
    gpu_marks = ("cudadevice", "gpudevice", "cuda(", "gpu(", "rocm(", "rocmdevice", "nvidia", "tesla")
    if any(k in t for k in gpu_marks):
        return "gpu"
    if "tpu" in t:
        return "tpu"
    return None


def parse_environment_info(text: str) -> tuple[JaxRaw, DriverRaw]:
    """Read a ``jax.print_environment_info()`` report (plus any log lines around it).

    Returns the JAX side as `JaxRaw` (versions, devices, backend inferred from the device
    reprs, the whole text as ``log_text``) and the ``$ nvidia-smi`` section, when present, as
    `DriverRaw`. Reports from jax 0.3 to 0.11 are understood.
    """
    jax_part, sep, smi_part = text.partition("$ nvidia-smi")
    found: dict[str, Any] = {}
    for line in jax_part.splitlines():
        for key, rx in _ENV_LINE_RES.items():
            m = rx.match(line.strip())
            if m and key not in found:
                found[key] = m
    devices: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    backend = None
    if "devices" in found:
        listed = re.split(r",\s*(?=[A-Za-z_]+\()", found["devices"].group(3))
        devices = tuple(d.strip() for d in listed if d.strip())
        backend = _backend_from_device_repr(devices[0]) if devices else None
    elif "device_info" in found:
        kind = found["device_info"].group(1)
        kinds = (kind,)
        backend = _backend_from_device_repr(kind)
    driver = DriverRaw(smi_path="nvidia-smi", smi_table=smi_part.strip("\n")) if sep else DriverRaw()
    raw = JaxRaw(
        jax_version=found["jax"].group(1) if "jax" in found else None,
        jaxlib_version=found["jaxlib"].group(1) if "jaxlib" in found else None,
        backend=backend,
        devices=devices,
        device_kinds=kinds,
        log_text=jax_part,
    )
    return raw, driver
