"""XLA's GPU target description of a catalog GPU: what the xla-gpu tier compiles for.

`xla_gpu_device_info` gives the fields of XLA's ``GpuDeviceInfoProto`` for a `Hardware` entry:
the catalog's numbers (SMs, clock, L2, memory and its bandwidth) and the per-architecture
limits below, which only this tier needs.
"""

from __future__ import annotations

from typing import Any

from .._errors import CapoptError
from .._hardware import Hardware

# Per-compute-capability limits in XLA's GpuDeviceInfoProto field names, from the CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability", and checked against
# XLA's own device specs (xla/backends/gpu/target_config/specs/*.txtpb for V100, A100, A6000,
# H100 and B200).
_CUDA_COMMON: dict[str, int] = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 49152,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
    "block_dim_limit_x": 2**31 - 1,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "thread_dim_limit_x": 1024,
    "thread_dim_limit_y": 1024,
    "thread_dim_limit_z": 64,
}
# (shared memory per SM, max opt-in shared memory per block, threads per SM, FP32 units per SM)
_CUDA_SM: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (7, 0): (98304, 98304, 2048, 64),
    (7, 5): (65536, 65536, 1024, 64),
    (8, 0): (167936, 166912, 2048, 64),
    (8, 6): (102400, 101376, 1536, 128),
    (8, 9): (102400, 101376, 1536, 128),
    (9, 0): (233472, 232448, 2048, 128),
    (10, 0): (233472, 232448, 2048, 128),
    (12, 0): (102400, 101376, 1536, 128),
}
# ROCm targets, from XLA's MI300 and MI200 specs (xla/backends/gpu/target_config/specs/
# mi300.txtpb, mi200.txtpb; the MI200 one gives no register limits).
_ROCM: dict[str, dict[str, int]] = {
    "gfx90a": {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 64,
        "shared_memory_per_block": 65536,
        "shared_memory_per_block_optin": 65536,
        "shared_memory_per_core": 65536,
        "threads_per_core_limit": 2048,
        "fpus_per_core": 128,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 2**31 - 1,
        "block_dim_limit_z": 2**31 - 1,
    },
    "gfx942": {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 64,
        "shared_memory_per_block": 65536,
        "shared_memory_per_block_optin": 65536,
        "shared_memory_per_core": 65536,
        "threads_per_core_limit": 2048,
        "fpus_per_core": 128,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65536,
        "block_dim_limit_z": 65536,
        "registers_per_core_limit": 131072,
        "registers_per_block_limit": 131072,
    },
}


def xla_gpu_device_info(hardware: Hardware) -> dict[str, Any]:
    """What XLA's GPU target description (``GpuDeviceInfoProto``) needs, where known.

    Keys are the proto's field names: ``core_count``, ``clock_rate_ghz``,
    ``l2_cache_size``, ``device_memory_size``, ``memory_bandwidth`` and
    ``cuda_compute_capability`` (``{"major", "minor"}``) or ``rocm_compute_capability``
    (``{"gcn_arch_name"}``), plus the per-architecture thread, register and shared-memory
    limits. Fields the catalog does not know are left out. TPUs raise `CapoptError`.
    """
    if hardware.kind != "gpu":
        raise CapoptError(f"{hardware.name} is a {hardware.kind.upper()}, not a GPU; XLA's GPU "
                          "target description does not apply", field="hardware.gpu")
    info: dict[str, Any] = {}
    cc = hardware.compute_capability
    if hardware.vendor == "nvidia" and cc:
        major, minor = (int(x) for x in cc.split("."))
        info.update(_CUDA_COMMON)
        if (major, minor) in _CUDA_SM:
            smem, optin, threads, fpus = _CUDA_SM[(major, minor)]
            info.update(shared_memory_per_core=smem, shared_memory_per_block_optin=optin,
                        threads_per_core_limit=threads, fpus_per_core=fpus)
        info["cuda_compute_capability"] = {"major": major, "minor": minor}
    elif hardware.vendor == "amd" and cc:
        info.update(_ROCM.get(cc, {}))
        info["rocm_compute_capability"] = {"gcn_arch_name": cc}
    if hardware.sm_count is not None:
        info["core_count"] = hardware.sm_count
    if hardware.clock_mhz is not None:
        info["clock_rate_ghz"] = hardware.clock_mhz / 1000
    if hardware.l2_bytes is not None:
        info["l2_cache_size"] = hardware.l2_bytes
    info["device_memory_size"] = hardware.memory_bytes
    info["memory_bandwidth"] = round(hardware.mem_bw)
    return info


def device_info_text(info: dict[str, Any]) -> str:
    """`xla_gpu_device_info` as ``GpuTargetConfigProto`` text."""
    lines = []
    for k, v in info.items():
        if isinstance(v, dict):
            inner = " ".join(f'{kk}: {_proto_value(vv)}' for kk, vv in v.items())
            lines.append(f"  {k} {{ {inner} }}")
        else:
            lines.append(f"  {k}: {_proto_value(v)}")
    return "gpu_device_info {\n" + "\n".join(lines) + '\n}\nplatform_name: "cuda"\n'


def _proto_value(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


# Without these XLA's GPU cost model divides by zero (SIGFPE) instead of raising.
REQUIRED_DEVICE_INFO = ("core_count", "clock_rate_ghz", "threads_per_warp", "fpus_per_core",
                        "memory_bandwidth", "device_memory_size")


def gpu_target_text(hardware: Hardware) -> str:
    """XLA's ``GpuTargetConfigProto`` text for ``hardware`` (what a deviceless CUDA compile
    targets); ValueError naming what it lacks where XLA's GPU target needs more."""
    info = xla_gpu_device_info(hardware)
    missing = [k for k in REQUIRED_DEVICE_INFO if not info.get(k)]
    if "cuda_compute_capability" not in info:
        missing.append("compute_capability (an NVIDIA one: the plugin targets CUDA)")
    if missing:
        raise ValueError(f"hardware {hardware.name!r} lacks what XLA's GPU target needs: "
                         + ", ".join(missing))
    return device_info_text(info)


__all__ = ["REQUIRED_DEVICE_INFO", "device_info_text", "gpu_target_text",
           "xla_gpu_device_info"]
