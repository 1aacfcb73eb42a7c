"""The doctor's judges: pure functions from raw outputs (`capopt.gpu.raw`) to a `Check`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .._format import format_bytes
from .monitor import explain_memory
from .raw import (PLUGIN_DISTRIBUTIONS, DriverFacts, DriverRaw, JaxRaw, StepRaw, VersionsRaw,
                  _cuda_int_to_str, read_driver)
from .report import Check, Status, _worst


OTHER_PROCESS_MEMORY_WARN_FRACTION = 0.10
"""Memory already in use above this fraction of a GPU, before capopt ran, is worth a warning."""


# ---------------------------------------------------------------------------------------------
# Judges
# ---------------------------------------------------------------------------------------------


def judge_driver(raw: DriverRaw) -> Check:
    """``accelerator``: does the driver see a GPU, and how much of it is already taken?"""
    facts = read_driver(raw)
    data = facts.to_dict()
    data["pci_nvidia_devices"] = raw.pci_nvidia_devices
    if facts.gpu_visible:
        if facts.gpus:
            names: dict[str, int] = {}
            for g in facts.gpus:
                names[g.get("name") or "?"] = names.get(g.get("name") or "?", 0) + 1
            desc = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in names.items())
            g0 = facts.gpus[0]
            mem = (f"; GPU {g0['index']}: {format_bytes(g0.get('memory_used_bytes'), '?')} of "
                   f"{format_bytes(g0.get('memory_total_bytes'), '?')} in use") if g0.get("memory_total_bytes") else ""
        else:
            desc, mem = "an NVIDIA GPU (nvidia-smi printed its header; this output has no GPU rows)", ""
        cuda = f", supports CUDA up to {facts.cuda_version}" if facts.cuda_version else ""
        saw = f"{desc}; driver {facts.driver_version or '?'}{cuda}{mem}"
        procs = list(facts.processes)
        if procs:
            top = sorted(procs, key=lambda p: -(p.get("used_bytes") or 0))[:3]
            held = ", ".join(f"{p.get('name')} (pid {p['pid']}) {format_bytes(p.get('used_bytes'), '?')}" for p in top)
            saw += f"; {len(procs)} process{'es' if len(procs) > 1 else ''} hold memory: {held}"
        def taken(g: dict[str, Any]) -> int:
            own = sum(p.get("used_bytes") or 0 for p in procs
                      if p.get("pid") == raw.own_pid and p.get("gpu_index") in (None, g["index"]))
            return max(0, (g.get("memory_used_bytes") or 0) - own)

        busy = [
            g for g in facts.gpus
            if g.get("memory_total_bytes")
            and taken(g) > OTHER_PROCESS_MEMORY_WARN_FRACTION * g["memory_total_bytes"]
        ]
        data["taken_by_others_bytes"] = {g["index"]: taken(g) for g in facts.gpus}
        if busy:
            g = busy[0]
            return Check(
                "accelerator", "warn", saw,
                fix=(f"{format_bytes(taken(g), '?')} of GPU {g['index']} is taken by other processes: "
                     "plans assume the whole card. Stop the other processes, pick "
                     "another GPU with CUDA_VISIBLE_DEVICES, or lower the budget (vram_gib)."),
                data=data,
            )
        return Check("accelerator", "ok", saw, data=data)
    if raw.smi_error and "No devices were found" in raw.smi_error:
        return Check(
            "accelerator", "warn",
            "nvidia-smi runs but finds no GPU (No devices were found)",
            fix=("the driver is loaded but no GPU is attached to it: in a container, start it with "
                 "`--gpus all`; on a VM, check the GPU is passed through; `dmesg | grep -i nvrm` "
                 "shows a GPU that fell off the bus."),
            data=data,
        )
    if raw.smi_error and not raw.nvml:
        return Check(
            "accelerator", "fail",
            f"nvidia-smi is installed but fails: {facts.problem}",
            fix=("the NVIDIA kernel driver is not reachable: check `lsmod | grep nvidia` and "
                 "`dmesg | grep -i nvrm`, reinstall or reload the driver (a reboot after a driver "
                 "update often suffices); in a container, start it with `--gpus all` "
                 "(NVIDIA Container Toolkit)."),
            data=data,
        )
    if raw.pci_nvidia_devices:
        return Check(
            "accelerator", "fail",
            f"{raw.pci_nvidia_devices} NVIDIA device(s) on the PCI bus, but neither NVML nor "
            "nvidia-smi is available to talk to them",
            fix=("install the NVIDIA driver (it ships nvidia-smi and NVML); in a container, run "
                 "with the NVIDIA Container Toolkit (`--gpus all`)."),
            data=data,
        )
    why = []
    if raw.nvml_error:
        why.append(raw.nvml_error)
    if raw.nvml is not None and facts.problem:
        why.append(facts.problem)
    if not raw.smi_path and not raw.smi_table:
        why.append("nvidia-smi not on PATH")
    elif facts.problem:
        why.append(facts.problem)
    return Check(
        "accelerator", "skip",
        "no NVIDIA accelerator found" + (f": {'; '.join(why)}" if why else ""),
        data=data,
    )


_GPU_BACKENDS = ("gpu", "cuda", "rocm")


def _jax_expected_gpu(raw: JaxRaw, facts: DriverFacts) -> tuple[bool, str | None]:
    """Whether a GPU should have been used, and the evidence."""
    log = raw.log_text or ""
    if facts.gpu_visible:
        name = facts.gpus[0].get("name") if facts.gpus else "a GPU"
        return True, f"the driver sees {name}"
    if "An NVIDIA GPU may be present" in log:
        return True, "JAX itself warned that an NVIDIA GPU may be present"
    if "cuda" in raw.backend_errors or "CUDA backend failed" in log:
        return True, "JAX's CUDA backend was found but failed to initialise"
    return False, None


def _cuda_extra(facts: DriverFacts) -> str:
    major = None
    if facts.cuda_version:
        try:
            major = int(facts.cuda_version.split(".")[0])
        except ValueError:
            major = None
    if major is not None and major >= 13:
        return 'pip install -U "jax[cuda13]"'
    return 'pip install -U "jax[cuda12]"'


def judge_jax(raw: JaxRaw, driver: DriverRaw) -> Check:
    """``jax-backend``: which backend JAX uses, failing on a silent CPU fallback."""
    facts = read_driver(driver)
    data: dict[str, Any] = {
        "backend": raw.backend,
        "devices": list(raw.devices),
        "device_kinds": list(raw.device_kinds),
        "jax_version": raw.jax_version,
        "jaxlib_version": raw.jaxlib_version,
        "plugins": dict(raw.plugins),
        "backend_errors": dict(raw.backend_errors),
        "env": dict(raw.env),
    }
    if raw.error:
        return Check(
            "jax-backend", "fail", f"JAX could not start: {raw.error}",
            fix='reinstall JAX: pip install -U jax  (with a GPU: pip install -U "jax[cuda12]")',
            data=data,
        )
    n = len(raw.devices)
    dev_desc = ", ".join(raw.devices[:4]) + (" ..." if n > 4 else "")
    if raw.backend in _GPU_BACKENDS or raw.backend == "tpu":
        kind = f" ({raw.device_kinds[0]})" if raw.device_kinds else ""
        return Check(
            "jax-backend", "ok",
            f"backend {raw.backend}, {n} device{'s' if n != 1 else ''}: {dev_desc}{kind}",
            data=data,
        )
    expected, evidence = _jax_expected_gpu(raw, facts)
    if not expected:
        return Check(
            "jax-backend", "ok",
            f"backend {raw.backend or '?'} ({dev_desc or 'no devices listed'}); no accelerator is "
            "visible, so running on the CPU is expected",
            data=data,
        )
    platforms = (raw.env.get("JAX_PLATFORMS") or "").strip().lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
        return Check(
            "jax-backend", "warn",
            f"{evidence}, but JAX_PLATFORMS={platforms} keeps JAX on {raw.backend}",
            fix="unset JAX_PLATFORMS (or set JAX_PLATFORMS=cuda) to train on the GPU",
            data=data,
        )
    if raw.env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return Check(
            "jax-backend", "fail",
            f"{evidence}, but CUDA_VISIBLE_DEVICES={raw.env['CUDA_VISIBLE_DEVICES']!r} hides it; "
            f"JAX runs on {raw.backend}",
            fix="unset CUDA_VISIBLE_DEVICES or list the GPU indices to use (e.g. CUDA_VISIBLE_DEVICES=0)",
            data=data,
        )
    cuda_err = raw.backend_errors.get("cuda") or _first_line_with(
        raw.log_text, "CUDA backend failed to initialize")
    if cuda_err:
        err_lines = [ln.strip() for ln in cuda_err.strip().splitlines() if ln.strip()]
        why = " ".join(err_lines[:2]) if err_lines[0].endswith(":") else err_lines[0]
        fix = ("JAX's CUDA plugin is installed but could not start (see cuda-versions). Let pip "
               f"supply matched CUDA and cuDNN: {_cuda_extra(facts)}; and remove older CUDA/cuDNN "
               "directories from LD_LIBRARY_PATH, which take precedence over the pip wheels.")
    else:
        if raw.plugins:
            why = "the CUDA plugin is installed but registered no devices"
        elif "CUDA-enabled jaxlib is not installed" in (raw.log_text or ""):
            why = "no CUDA-enabled jaxlib is installed"
        else:
            why = "JAX registered no CUDA backend (no CUDA-enabled jaxlib or CUDA plugin found)"
        fix = (f"install JAX's CUDA build: {_cuda_extra(facts)}  (conda: conda install -c conda-forge "
               "jax \"jaxlib=*=*cuda*\"); then check `python -c \"import jax; print(jax.devices())\"` "
               "lists CudaDevice and that LD_LIBRARY_PATH holds no older CUDA libraries.")
    return Check(
        "jax-backend", "fail",
        f"{evidence}, but JAX runs on {raw.backend or 'cpu'} (silent CPU fallback): {why}",
        fix=fix, data=data,
    )


def _first_line_with(text: str, needle: str) -> str | None:
    """The line holding ``needle`` from there on, plus the next line when it ends in ':'."""
    lines = (text or "").splitlines()
    for i, line in enumerate(lines):
        if needle in line:
            out = line[line.index(needle):]
            if out.rstrip().endswith(":") and i + 1 < len(lines):
                out += "\n" + lines[i + 1]
            return out
    return None


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _cudnn_int(v: int) -> tuple[int, int, int]:
    """cuDNN version integers: 8906 -> (8, 9, 6); 90100 -> (9, 1, 0); 9100 -> (9, 1, 0)."""
    if v >= 10000:
        return v // 10000, (v % 10000) // 100, v % 100
    return v // 1000, (v % 1000) // 100, v % 100


def _dotted(t: Sequence[int]) -> str:
    return ".".join(str(x) for x in t)


_VERSION_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("found-older", re.compile(
        r"Found (cuDNN|CUDA|cuBLAS|cuFFT|cuSPARSE|cuSOLVER|cuPTI) version (\d+), "
        r"but JAX was built against version (\d+)")),
    ("outdated", re.compile(
        r"Outdated (\S+) installation found\.\s*Version JAX was built against: (\d+)\s*"
        r"Minimum supported: (\d+)\s*Installed version: (\d+)")),
    ("loaded-runtime", re.compile(
        r"Loaded runtime CuDNN library: (\d+(?:\.\d+)*) but source was compiled with: (\d+(?:\.\d+)*)")),
    ("ptxas", re.compile(
        r"The NVIDIA driver's CUDA version is (\d+(?:\.\d+)*) which is older than the "
        r"(?:ptxas CUDA version|PTX compiler version) \(?(\d+(?:\.\d+)*)\)?")),
    ("unable-to-load", re.compile(r"Unable to load (\w+)\. Is it installed\?")),
)


def judge_cuda_versions(raw: JaxRaw, driver: DriverRaw) -> Check:
    """``cuda-versions``: jaxlib's CUDA / cuDNN against what the driver and libraries provide."""
    facts = read_driver(driver)
    cv = dict(raw.cuda_versions)
    text = "\n".join([raw.log_text or "", *raw.backend_errors.values()])
    issues: list[tuple[Status, str, str]] = []  # (status, saw, fix)
    matched: list[dict[str, Any]] = []

    for kind, pattern in _VERSION_PATTERNS:
        for m in pattern.finditer(text):
            matched.append({"kind": kind, "text": m.group(0)})
            if kind == "found-older":
                lib, have, built = m.group(1), int(m.group(2)), int(m.group(3))
                dec = _cudnn_int if lib == "cuDNN" else (lambda v: (v // 1000, (v % 1000) // 10, 0))
                issues.append((
                    "fail",
                    f"installed {lib} {_dotted(dec(have))} is older than the {_dotted(dec(built))} "
                    "jaxlib was built against, so the CUDA backend did not start",
                    f"upgrade {lib} to {_dotted(dec(built)[:2])} or newer; with pip wheels: "
                    f"{_cuda_extra(facts)}, and drop older {lib} directories from LD_LIBRARY_PATH",
                ))
            elif kind == "outdated":
                lib, built, minimum, have = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
                dec = _cudnn_int if lib == "cuDNN" else (lambda v: (v // 1000, (v % 1000) // 10, 0))
                issues.append((
                    "fail",
                    f"installed {lib} {_dotted(dec(have))} is below the minimum {_dotted(dec(minimum))} "
                    f"this jaxlib supports (built against {_dotted(dec(built))})",
                    f"install {lib} {_dotted(dec(minimum)[:2])} or newer (conda: update the {lib.lower()} "
                    f"package; pip: {_cuda_extra(facts)}), or pin jaxlib to a release built for "
                    f"{lib} {_dotted(dec(have)[:2])}",
                ))
            elif kind == "loaded-runtime":
                loaded, compiled = m.group(1), m.group(2)
                issues.append((
                    "fail",
                    f"the cuDNN loaded at run time ({loaded}) is older than the {compiled} XLA was "
                    "compiled with; convolutions and attention fail",
                    f"make cuDNN >= {compiled} the one that loads: remove the older copy from "
                    f"LD_LIBRARY_PATH or install matched wheels with {_cuda_extra(facts)}",
                ))
            elif kind == "ptxas":
                drv, ptx = m.group(1), m.group(2)
                issues.append((
                    "warn",
                    f"the driver supports CUDA {drv} but the PTX compiler is CUDA {ptx}: XLA disables "
                    "parallel compilation, so every compile is slower",
                    f"update the NVIDIA driver to one supporting CUDA {_dotted(_version_tuple(ptx)[:2])} "
                    "or newer, or install NVIDIA's CUDA forward-compatibility package",
                ))
            elif kind == "unable-to-load":
                lib = m.group(1)
                issues.append((
                    "fail",
                    f"JAX could not load {lib}, so the CUDA backend did not start",
                    f"install the CUDA libraries with JAX: {_cuda_extra(facts)}; or, for a local "
                    f"CUDA toolkit, put its {lib} on LD_LIBRARY_PATH",
                ))

    built_cuda = cv.get("cuda_runtime_build")
    if built_cuda and facts.cuda_version:
        b = (built_cuda // 1000, (built_cuda % 1000) // 10)
        d = _version_tuple(facts.cuda_version)[:2]
        if b[0] > d[0]:
            issues.append((
                "fail",
                f"jaxlib was built for CUDA {_dotted(b)} but the driver supports only CUDA "
                f"{facts.cuda_version}",
                f"update the NVIDIA driver to one supporting CUDA {_dotted(b)}, or install a JAX "
                f"build for CUDA {d[0]}",
            ))
        elif b > tuple(d):
            issues.append((
                "warn",
                f"jaxlib was built for CUDA {_dotted(b)}, newer than the driver's CUDA "
                f"{facts.cuda_version}: it runs under CUDA minor-version compatibility, but PTX "
                "from the newer toolkit cannot be JIT-compiled by this driver",
                f"update the NVIDIA driver to one supporting CUDA {_dotted(b)}",
            ))
    elif facts.cuda_version and raw.plugins:
        d_major = _version_tuple(facts.cuda_version)[:1]
        for dist in raw.plugins:
            pm = re.match(r"jax-cuda(\d+)-", dist)
            if pm and d_major and int(pm.group(1)) > d_major[0]:
                issues.append((
                    "fail",
                    f"{dist} needs a driver supporting CUDA {pm.group(1)}, but this driver supports "
                    f"CUDA {facts.cuda_version}",
                    f"update the NVIDIA driver, or install jax[cuda{d_major[0]}] if such a build exists",
                ))
                break
    have_dnn, built_dnn = cv.get("cudnn"), cv.get("cudnn_build")
    if have_dnn and built_dnn:
        hd, bd = _cudnn_int(have_dnn), _cudnn_int(built_dnn)
        if hd[0] != bd[0] or hd[:2] < bd[:2]:
            issues.append((
                "fail",
                f"cuDNN {_dotted(hd)} is loaded but jaxlib was built against {_dotted(bd)} "
                "(cuDNN needs the same major version and an equal or newer minor)",
                f"install cuDNN {bd[0]}.{bd[1]} or newer of major version {bd[0]}: {_cuda_extra(facts)}",
            ))

    data: dict[str, Any] = {
        "driver_cuda_version": facts.cuda_version,
        "jaxlib_cuda_build": _cuda_int_to_str(built_cuda),
        "cuda_runtime": _cuda_int_to_str(cv.get("cuda_runtime")),
        "cudnn_build": _dotted(_cudnn_int(built_dnn)) if built_dnn else None,
        "cudnn_runtime": _dotted(_cudnn_int(have_dnn)) if have_dnn else None,
        "plugins": dict(raw.plugins),
        "messages": matched,
    }
    if issues:
        status = _worst([i[0] for i in issues])
        saw = "; ".join(i[1] for i in issues)
        fix = "; ".join(dict.fromkeys(i[2] for i in issues if i[0] == status))
        return Check("cuda-versions", status, saw, fix=fix, data=data)
    if not facts.gpu_visible and not cv and not raw.plugins:
        side = raw.compile_only_plugin
        extra = (f"; the xla-gpu tier's compile-only CUDA plugin is in {side}" if side else
                 "; no CUDA plugin (`capopt setup xla-gpu` installs the compile-only one)")
        return Check("cuda-versions", "skip", "no CUDA stack to check (no GPU visible" + extra
                     + ")", data={**data, "xla_gpu_plugin": side})
    parts = []
    if facts.cuda_version:
        parts.append(f"driver supports CUDA {facts.cuda_version}")
    if data["jaxlib_cuda_build"]:
        parts.append(f"jaxlib built for CUDA {data['jaxlib_cuda_build']}")
    if data["cudnn_build"]:
        rt = f" (loaded {data['cudnn_runtime']})" if data["cudnn_runtime"] else ""
        parts.append(f"cuDNN {data['cudnn_build']}{rt}")
    if raw.plugins:
        parts.append(", ".join(f"{k} {v}" for k, v in raw.plugins.items()))
    saw = "; ".join(parts) + "; no incompatibility seen" if parts else "no incompatibility seen"
    return Check("cuda-versions", "ok", saw, data=data)


def judge_step(raw: StepRaw | None, *, expect_accelerator: bool | None = None) -> Check:
    """``tiny-step``: did a jitted forward + backward run, where, and how fast?

    Args:
        raw: the measurement, or ``None`` when the step was not run.
        expect_accelerator: when true, a step that ran on the CPU fails.
    """
    if raw is None:
        return Check("tiny-step", "skip", "not run (run_step=False)")
    data: dict[str, Any] = {
        "platform": raw.platform,
        "device": raw.device,
        "output_platforms": list(raw.output_platforms),
        "compile_s": raw.compile_s,
        "first_run_s": raw.first_run_s,
        "run_s": raw.run_s,
        "memory_stats": dict(raw.memory_stats) if raw.memory_stats else None,
    }
    if raw.error:
        oom = "RESOURCE_EXHAUSTED" in raw.error or "out of memory" in raw.error.lower()
        fix = ("device memory is exhausted before any model ran: another process (or "
               "preallocation by an earlier JAX/TensorFlow process) holds it; see the accelerator "
               "and memory-settings checks") if oom else (
               "run `python -c \"import jax; jax.print_environment_info()\"` and fix the first "
               "error it shows; the cuda-versions check lists known version problems")
        first = raw.error.strip().splitlines()[0]
        return Check("tiny-step", "fail", f"the tiny step failed: {first}", fix=fix, data=data)
    where = set(raw.output_platforms)
    if raw.platform and where and where != {raw.platform}:
        return Check(
            "tiny-step", "fail",
            f"the step ran but its outputs live on {sorted(where)}, not on the default device "
            f"{raw.device}",
            fix="something moves results off the device (a host callback, or a default_device "
                "override); check jax.config.jax_default_device and JAX_PLATFORMS",
            data=data,
        )
    ms = lambda s: "?" if s is None else f"{1e3 * s:.1f} ms"  # noqa: E731
    saw = (f"jit forward+backward on {raw.device}: compile {ms(raw.compile_s)}, step "
           f"{ms(raw.run_s)} (first call {ms(raw.first_run_s)}); "
           f"outputs on {', '.join(sorted(where)) or '?'}")
    if raw.memory_stats:
        ex = explain_memory(raw.memory_stats)
        used = format_bytes(ex.in_use_bytes, "?")
        peak = format_bytes(ex.peak_bytes, "?")
        saw += f"; device memory in use {used}, peak {peak}"
        data["memory"] = ex.to_dict()
    else:
        saw += ("; memory_stats: none (the CPU backend reports none)" if raw.platform == "cpu"
                else "; memory_stats: not reported")
    if expect_accelerator and raw.platform == "cpu":
        return Check("tiny-step", "fail", saw + "; a GPU is visible but the step ran on the CPU",
                     fix="see the jax-backend check", data=data)
    return Check("tiny-step", "ok", saw, data=data)


def _explain_preallocate(value: str | None) -> tuple[Status, str]:
    if value is None:
        return "ok", ("unset (default true): JAX reserves a fixed share of GPU memory at its first "
                      "operation, so nvidia-smi shows ~75% of the card in use whatever the model; "
                      "read device.memory_stats()['peak_bytes_in_use'] for what a step needs")
    v = value.strip().lower()
    if v in ("true", "1"):
        return "ok", ("true: JAX reserves its pool up front, so nvidia-smi shows the pool, not the "
                      "model; read device.memory_stats()['peak_bytes_in_use'] for the real need")
    if v in ("false", "0"):
        return "ok", ("false: JAX grows its pool as needed and does not give memory back, so "
                      "nvidia-smi shows the high-water mark; near the limit fragmentation can cause "
                      "OOMs that preallocation would avoid")
    return "warn", f"{value!r} is not true/false; JAX's parsing of it is undefined"


def _explain_fraction(name: str, value: str | None) -> tuple[Status, str]:
    if value is None:
        return "ok", "unset: the default 0.75 of the device's memory"
    try:
        f = float(value)
    except ValueError:
        return "warn", f"{value!r} is not a number between 0 and 1"
    if not 0 < f <= 1:
        return "warn", f"{f} is outside (0, 1]"
    text = (f"{f:g}: JAX's pool is {100 * f:.0f}% of the device's memory (preallocated when "
            "preallocation is on); plans should use this, not the full card, as the budget")
    if f > 0.95:
        return "warn", text + ("; this leaves too little for the CUDA context, cuBLAS/cuDNN "
                               "workspaces and NCCL, which allocate outside JAX's pool")
    return "ok", text


def _explain_allocator(value: str | None) -> tuple[Status, str]:
    if value is None:
        return "ok", ("unset: the BFC allocator, which reuses freed memory and never returns it "
                      "to the device")
    v = value.strip().lower()
    if v in ("default", "bfc"):
        return "ok", f"{v}: the BFC allocator, which reuses freed memory and never returns it"
    if v == "platform":
        return "warn", ("platform: allocates and frees exactly on demand, so nvidia-smi tracks live "
                        "memory, but every allocation is a cudaMalloc: far too slow for training, "
                        "meant for debugging OOMs")
    if v == "cuda_async":
        return "ok", "cuda_async: CUDA's stream-ordered allocator (cudaMallocAsync) manages the pool"
    return "warn", f"{value!r} is not one of default, bfc, platform, cuda_async"


def _explain_tf_allocator(value: str | None) -> tuple[Status, str]:
    if value is None:
        return "ok", ("unset (read by TensorFlow's GPU allocator; JAX picks its own with "
                      "XLA_PYTHON_CLIENT_ALLOCATOR)")
    return "ok", (f"{value}: affects TensorFlow if it runs in this process (cuda_malloc_async = "
                  "CUDA's async allocator); JAX chooses its allocator with XLA_PYTHON_CLIENT_ALLOCATOR. "
                  "A TensorFlow in the same process also preallocates GPU memory unless limited")


_XLA_FLAG_NOTES = {
    "--xla_force_host_platform_device_count":
        "splits the CPU into N virtual devices (sharding tests; no real parallelism)",
    "--xla_gpu_memory_fraction_policy": "overrides JAX's memory-fraction policy",
    "--xla_gpu_autotune_level": "autotuning level (0 = off: faster compiles, possibly slower kernels)",
    "--xla_dump_to": "dumps compiled HLO to disk (slower compiles, disk use)",
    "--xla_gpu_enable_command_buffer": "CUDA graphs; captured graphs hold extra device memory",
    "--xla_gpu_memory_limit_slop_factor": "how far XLA may exceed its memory estimate when scheduling",
    "--xla_gpu_enable_latency_hiding_scheduler": "overlaps communication with compute; raises peak memory",
    "--xla_gpu_cuda_data_dir": "where XLA looks for CUDA (libdevice, ptxas)",
}


def _explain_xla_flags(value: str | None) -> tuple[Status, str, list[dict[str, str | None]]]:
    if not value or not value.strip():
        return "ok", "unset", []
    flags_ = []
    for tok in value.split():
        name = tok.split("=", 1)[0]
        flags_.append({"flag": tok, "note": _XLA_FLAG_NOTES.get(name)})
    noted = [f"{f['flag']} ({f['note']})" for f in flags_ if f["note"]]
    other = [str(f["flag"]) for f in flags_ if not f["note"]]
    text = "; ".join(noted + ([f"also: {' '.join(other)}"] if other else []))
    return "ok", text, flags_


def judge_memory_settings(env: Mapping[str, str]) -> Check:
    """``memory-settings``: what the allocator environment variables mean for the numbers seen."""
    data: dict[str, Any] = {}
    statuses: list[Status] = []
    warn_lines: list[str] = []

    def put(name: str, status: Status, meaning: str, **extra: Any) -> None:
        data[name] = {"value": env.get(name), "meaning": meaning, "status": status, **extra}
        statuses.append(status)
        if status != "ok":
            warn_lines.append(f"{name}: {meaning}")

    put("XLA_PYTHON_CLIENT_PREALLOCATE", *_explain_preallocate(env.get("XLA_PYTHON_CLIENT_PREALLOCATE")))
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        put(name, *_explain_fraction(name, env.get(name)))
    if env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") and env.get("XLA_CLIENT_MEM_FRACTION") and (
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] != env["XLA_CLIENT_MEM_FRACTION"]
    ):
        statuses.append("warn")
        warn_lines.append("both XLA_PYTHON_CLIENT_MEM_FRACTION and XLA_CLIENT_MEM_FRACTION are set, "
                          "to different values (the first is the older name of the second)")
    put("XLA_PYTHON_CLIENT_ALLOCATOR", *_explain_allocator(env.get("XLA_PYTHON_CLIENT_ALLOCATOR")))
    put("TF_GPU_ALLOCATOR", *_explain_tf_allocator(env.get("TF_GPU_ALLOCATOR")))
    st, meaning, parsed = _explain_xla_flags(env.get("XLA_FLAGS"))
    put("XLA_FLAGS", st, meaning, flags=parsed)

    prealloc = (env.get("XLA_PYTHON_CLIENT_PREALLOCATE") or "true").strip().lower() not in ("false", "0")
    frac = env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    allocator = (env.get("XLA_PYTHON_CLIENT_ALLOCATOR") or "default").strip().lower()
    if allocator == "platform":
        headline = "platform allocator: nvidia-smi tracks live memory, at a large speed cost"
    elif prealloc:
        share = f"{100 * float(frac):.0f}%" if frac and _is_float(frac) else "75%"
        headline = (f"JAX preallocates {share} of GPU memory at first use: nvidia-smi will show "
                    f"about {share} in use regardless of the model; use memory_stats() peak for "
                    "the real need")
    else:
        headline = ("preallocation off: the pool grows to the peak and stays there; nvidia-smi "
                    "shows the high-water mark")
    status = _worst(statuses)
    saw = headline if status == "ok" else headline + "; " + "; ".join(warn_lines)
    fix = None
    if status == "warn":
        fix = ("unset the variables flagged above, or set them as described at "
               "https://docs.jax.dev/en/latest/gpu_memory_allocation.html")
    return Check("memory-settings", status, saw, fix=fix, data=data)


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def judge_versions(raw: VersionsRaw) -> Check:
    """``versions``: Python and the packages capopt runs on, with mismatches that break JAX."""
    pk = dict(raw.packages)
    data = {"python": raw.python, "packages": pk}
    problems: list[str] = []
    fixes: list[str] = []
    jax_v, jaxlib_v = pk.get("jax"), pk.get("jaxlib")
    if jax_v is None:
        problems.append("jax is not installed")
        fixes.append("pip install -U jax")
    if jax_v and jaxlib_v and _version_tuple(jax_v)[:2] != _version_tuple(jaxlib_v)[:2]:
        problems.append(f"jax {jax_v} and jaxlib {jaxlib_v} are from different releases")
        fixes.append("pip install -U jax jaxlib  (keep them on the same release)")
    for dist in PLUGIN_DISTRIBUTIONS:
        v = pk.get(dist)
        if v and jaxlib_v and _version_tuple(v) != _version_tuple(jaxlib_v):
            problems.append(f"{dist} {v} does not match jaxlib {jaxlib_v}")
            fixes.append('pip install -U "jax[cuda12]"  (installs a plugin matching jaxlib)')
    for dist in ("flax", "optax"):
        if pk.get(dist) is None:
            problems.append(f"{dist} is not installed (needed to validate plans with real steps)")
            fixes.append(f"pip install {dist}")
    shown = ", ".join(f"{k} {v}" for k, v in pk.items() if v is not None)
    saw = f"python {raw.python.split()[0]}; {shown}"
    if problems:
        return Check("versions", "warn", saw + "; " + "; ".join(problems),
                     fix="; ".join(dict.fromkeys(fixes)), data=data)
    return Check("versions", "ok", saw, data=data)
