"""The four measurement tiers. Each runs in a process whose JAX was set up for it
(`environment`): call one tier per process.

- ``exact``: lower and compile for ``dp * tp`` virtual CPU devices; XLA's memory analysis
  gives argument / output / alias bytes per device exactly (temp on CPU is not a proxy for a
  GPU's activations: the CPU backend ignores remat for memory and upcasts bf16).
- ``xla-gpu``: compile the same step for the scenario's GPU without one, through a deviceless
  topology (`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`) built from
  `capopt.validation.targets.xla_gpu_device_info`, autotuning off. Needs the CUDA PJRT plugin, which
  ``capopt setup xla-gpu`` installs (`capopt.validation.plugin`); the CUDA libraries themselves
  are not needed to compile. XLA's GPU buffer assignment gives temp and peak; its
  schedulers' log (`capopt.validation.xla_log`) the order its memory scheduler kept and what
  the latency-hiding scheduler, which spends the card's spare memory on overlapping
  collectives, used and was allowed (``latency_hiding=False`` compiles without it).
- ``torch``: the step in PyTorch on fake tensors (`capopt.validation.torch_step`): the live
  tensor bytes of every op, the peak and what was live at it by category. Needs torch
  (``pip install 'capopt[torch]'``); no GPU.
- ``device``: a real accelerator. Warm-up steps, then timed steps; the allocator's
  ``peak_bytes_in_use`` and ``bytes_in_use``; NVML samples through `capopt.gpu.monitor.Monitor`
  when NVML is there.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .compiler_options import (GEMM_RETRY_OPTIONS, GEMM_TILING_ERROR,  # noqa: F401 (re-exported)
                               NO_LATENCY_HIDING_OPTIONS)
from .plugin import PLUGIN_PATH_ENV, has_plugin, plugin_path
from .targets import gpu_target_text
from .xla_log import capture, log_environment, schedule_report

TIERS = ("exact", "xla-gpu", "torch", "deepspeed", "maxtext", "device")
# LLVM optimisation level 0 for the exact tier: it halves compile time on CPU and changes no
# buffer (HLO passes and buffer assignment run as usual; measured identical on tiny-gpt).
EXACT_XLA_FLAGS = ("--xla_backend_optimization_level=0",)
GPU_XLA_FLAGS = ("--xla_gpu_autotune_level=0",)


def devices_needed(config) -> int:
    return config.dp * config.tp


def xla_gpu_available() -> tuple[bool, str]:
    """Whether the deviceless GPU compile can be attempted here, and why not."""
    extra = plugin_path()
    if extra:
        ok = has_plugin(Path(extra))
        return ok, ("" if ok else f"{PLUGIN_PATH_ENV}={extra} has no jax_plugins folder")
    for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True, ""
        except (ImportError, ValueError):
            continue
    return False, ("the xla-gpu tier needs the CUDA PJRT plugin: run `capopt setup xla-gpu` "
                   f"(or set {PLUGIN_PATH_ENV} to a folder holding it)")


def _importable(modules: tuple[str, ...], why: str) -> tuple[bool, str]:
    """(True, "") where every module can be imported, else (False, ``why``)."""
    try:
        found = all(importlib.util.find_spec(m) is not None for m in modules)
    except (ImportError, ValueError):
        found = False
    return (True, "") if found else (False, why)


def torch_available() -> tuple[bool, str]:
    """Whether the torch tier can run here, and why not."""
    return _importable(("torch",), "the torch tier needs PyTorch: pip install 'capopt[torch]' "
                       "(a CPU build is enough; no GPU is used)")


def deepspeed_available() -> tuple[bool, str]:
    """Whether the deepspeed tier can run here, and why not."""
    return _importable(("torch", "deepspeed"), "the deepspeed tier needs PyTorch and "
                       "DeepSpeed: pip install 'capopt[torch,frameworks]' (CPU tensors; no GPU "
                       "is used)")


def environment(tier: str, config, base: dict | None = None) -> dict[str, str]:
    """Environment variables for a worker process measuring ``config`` on ``tier``."""
    env = dict(os.environ if base is None else base)
    flags = env.get("XLA_FLAGS", "").split()
    n = devices_needed(config)
    if tier == "exact":
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        flags += [f"--xla_force_host_platform_device_count={n}", *EXACT_XLA_FLAGS]
        env["CAPOPT_CPU_DEVICES"] = str(n)
    elif tier == "xla-gpu":
        env["JAX_PLATFORMS"] = "cpu"                     # compile for CUDA, run nothing
        env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"     # no CUDA libraries are needed
        env = log_environment(env)                       # the schedulers' lines (`xla_log`)
        flags += list(GPU_XLA_FLAGS)
        extra = plugin_path()
        if extra:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH")) if p)
    elif tier == "torch":
        env["JAX_PLATFORMS"] = "cpu"                     # the worker imports capopt, not JAX's GPU
        env.setdefault("OMP_NUM_THREADS", "1")           # fake tensors compute nothing
    elif tier == "deepspeed":
        env["JAX_PLATFORMS"] = "cpu"
        env["DS_ACCELERATOR"] = "cpu"                    # DeepSpeed's CPU accelerator
        # (a launcher's LOCAL_SIZE would switch DeepSpeed's CPU all-reduce to shared memory
        # across processes that do not exist: one process stands for the dp ranks here)
        for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE"):
            env.pop(var, None)
    elif tier == "maxtext":
        env["JAX_PLATFORMS"] = "cpu"                     # the worker imports capopt; MaxText
        # compiles in its own environment (`maxtext_tier`)
    elif tier != "device":
        raise ValueError(f"unknown tier {tier!r}")
    env["XLA_FLAGS"] = " ".join(dict.fromkeys(flags))
    return env


# --------------------------------------------------------------------------------------------
def gpu_topology(hardware, n: int):
    """A deviceless topology of ``n`` GPUs of ``hardware`` (one host)."""
    from jax.experimental import topologies

    from .step import Unsupported
    try:
        text = gpu_target_text(hardware)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    return topologies.get_topology_desc(platform="cuda", target_config=text,
                                        topology=f"1x1x{n}")


def _analyse(step, compiled, t_compile: float) -> dict[str, Any]:
    from .predict import measured_terms
    from .step import output_leaves
    measured = measured_terms(compiled.memory_analysis(), params_bytes=step.params_bytes,
                              optimizer_bytes=step.optimizer_bytes,
                              input_bytes=step.input_bytes)
    details = {"compile_s": t_compile, "output_leaves": output_leaves(step),
               "attention": step.policy.attention}
    if step.unsharded:
        details["unsharded"] = step.unsharded
    return {"measured": measured, "details": details}


def run_exact(scenario, config) -> dict[str, Any]:
    import jax
    from .step import build_step
    n = devices_needed(config)
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise RuntimeError(f"the exact tier needs {n} CPU devices, this process has "
                           f"{len(devices)} (set XLA_FLAGS=--xla_force_host_platform_device_count"
                           f"={n} before JAX starts, or use validate())")
    step = build_step(scenario, config, devices[:n], tier="exact")
    t0 = time.perf_counter()
    compiled = step.lower().compile()
    return _analyse(step, compiled, time.perf_counter() - t0)


def compile_retrying_gemm_tiling(lowered, options: dict[str, Any] | None = None
                                 ) -> tuple[Any, dict[str, Any]]:
    """``lowered.compile(options)``, or once more with `GEMM_RETRY_OPTIONS` added if GEMM
    tiling failed; returns the executable and the compiler options it took."""
    options = dict(options or {})
    try:
        return lowered.compile(compiler_options=options or None), options
    except Exception as e:          # XlaRuntimeError; its class moved between JAX versions
        if GEMM_TILING_ERROR not in str(e):
            raise
    retry = {**options, **GEMM_RETRY_OPTIONS}
    return lowered.compile(compiler_options=retry), retry


def run_xla_gpu(scenario, config, *, latency_hiding: bool = True) -> dict[str, Any]:
    """Compile ``config``'s step for the scenario's GPU; XLA's buffer assignment of it, and
    what its schedulers logged. ``latency_hiding=False`` compiles it with
    `NO_LATENCY_HIDING_OPTIONS`."""
    from .step import build_step
    n = devices_needed(config)
    topo = gpu_topology(scenario.hardware, n)
    step = build_step(scenario, config, topo.devices, tier="xla-gpu")
    t0 = time.perf_counter()
    with capture() as log:
        compiled, options = compile_retrying_gemm_tiling(
            step.lower(), None if latency_hiding else NO_LATENCY_HIDING_OPTIONS)
    out = _analyse(step, compiled, time.perf_counter() - t0)
    out["details"]["target"] = scenario.hardware.name
    schedule = schedule_report(log.text)
    if schedule:        # the memory-scheduled peak beside the compiled one (`xla_log`)
        out["details"]["xla_schedule"] = schedule
    if options:
        out["details"]["compiler_options"] = options
    return out


def run_device(scenario, config, *, warmup: int = 2, steps: int = 5,
               monitor: bool = True) -> dict[str, Any]:
    import jax
    from .step import Unsupported, build_step, init_arguments
    n = devices_needed(config)
    devices = jax.devices()
    if len(devices) < n:
        raise Unsupported(f"config needs {n} devices, this machine has {len(devices)}")
    platform = devices[0].platform
    tier = "device"
    if platform == "gpu" and config.flash_attention and scenario.workload.precision != "fp32":
        tier = "device-cudnn"
    step = build_step(scenario, config, devices[:n], tier=tier)
    t0 = time.perf_counter()
    try:
        compiled = step.lower().compile()
    except Exception:
        if tier != "device-cudnn":
            raise
        step = build_step(scenario, config, devices[:n], tier="device")   # no cuDNN kernel
        compiled = step.lower().compile()
    out = _analyse(step, compiled, time.perf_counter() - t0)
    tr, fr, opt, batch, key = init_arguments(step)
    for _ in range(warmup):
        tr, opt, loss = compiled(tr, fr, opt, batch, key)
    jax.block_until_ready(loss)
    mon = None
    if monitor and platform == "gpu":
        try:
            from ..gpu.monitor import Monitor
            mon = Monitor(interval_s=0.1).start()
        except Exception:  # monitoring is optional; never fail the measurement for it
            mon = None
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        tr, opt, loss = compiled(tr, fr, opt, batch, key)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
    if mon is not None:
        mon.stop()
        out["details"]["monitor"] = mon.summary()
    stats = [d.memory_stats() or {} for d in devices[:n]]
    peaks = [s.get("peak_bytes_in_use") for s in stats if s.get("peak_bytes_in_use")]
    in_use = [s.get("bytes_in_use") for s in stats if s.get("bytes_in_use")]
    m = out["measured"]
    m["static_peak_bytes"] = m["peak_bytes"]
    m["peak_bytes"] = max(peaks) if peaks else None       # None on CPU (no allocator stats)
    m["in_use_bytes"] = max(in_use) if in_use else None
    m["step_s"] = statistics.median(times)
    out["details"].update(platform=platform, device_kind=devices[0].device_kind,
                          step_times_s=times, loss=float(loss), warmup=warmup,
                          memory_stats=stats[0] if stats else None)
    return out


def run_tier(tier: str, scenario, config, **options) -> dict[str, Any]:
    if tier == "exact":
        return run_exact(scenario, config)
    if tier == "xla-gpu":
        return run_xla_gpu(scenario, config, **options)
    if tier == "torch":
        from .torch_step import run_torch
        return run_torch(scenario, config)
    if tier == "deepspeed":
        # (the worker is a fresh process already: the step runs in it)
        from .deepspeed_step import check_supported, measure_here
        check_supported(scenario, config)
        return measure_here(scenario, config, explain=bool(options.get("explain")))
    if tier == "maxtext":
        from .maxtext_tier import run_maxtext
        return run_maxtext(scenario, config)
    if tier == "device":
        return run_device(scenario, config, **options)
    raise ValueError(f"unknown tier {tier!r} (allowed: {', '.join(TIERS)})")


def configure_jax_for(tier: str) -> None:
    """In a fresh worker: apply what `environment` asked for before JAX picks its devices."""
    n = os.environ.get("CAPOPT_CPU_DEVICES")
    if tier == "exact" and n:
        import jax
        try:
            jax.config.update("jax_num_cpu_devices", int(n))
        except Exception:   # older or newer JAX without the option: XLA_FLAGS already says it
            pass
    if tier == "xla-gpu":
        extra = plugin_path()
        if extra and extra not in sys.path:
            sys.path.insert(0, extra)


__all__ = ["TIERS", "devices_needed", "environment", "gpu_topology", "run_device",
           "run_exact", "run_tier", "run_xla_gpu", "torch_available", "xla_gpu_available"]
