"""The doctor's probes: the only code that touches the machine (NVML, nvidia-smi, JAX, a tiny
training step, the installed versions), returning raw outputs for the judges."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .monitor import load_nvml
from .raw import PLUGIN_DISTRIBUTIONS, DriverRaw, JaxRaw, StepRaw, VersionsRaw
from .smi import QUERY_APPS_FIELDS, QUERY_GPU_FIELDS


SMI_TIMEOUT_S = 15.0


# ---------------------------------------------------------------------------------------------
# Probes (touch the machine)
# ---------------------------------------------------------------------------------------------


def _run(cmd: Sequence[str]) -> tuple[str | None, str | None]:
    """Run a command; return ``(stdout, None)`` or ``(None, error text)``."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"{type(err).__name__}: {err}"
    if proc.returncode != 0:
        msg = (proc.stdout + "\n" + proc.stderr).strip()
        return None, msg or f"exit status {proc.returncode}"
    return proc.stdout, None


def _pci_nvidia_devices(root: str = "/sys/bus/pci/devices") -> int | None:
    """NVIDIA (vendor 0x10de) display / 3D controllers (class 0x03xxxx) on the PCI bus."""
    base = Path(root)
    if not base.is_dir():
        return None
    n = 0
    for dev in base.iterdir():
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            klass = (dev / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith("0x03"):
            n += 1
    return n


def _nvml_facts(nv: Any) -> dict[str, Any]:
    def s(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    facts: dict[str, Any] = {"gpus": [], "processes": []}
    facts["driver_version"] = s(nv.nvmlSystemGetDriverVersion())
    get_cuda = (getattr(nv, "nvmlSystemGetCudaDriverVersion_v2", None)
                or getattr(nv, "nvmlSystemGetCudaDriverVersion", None))
    try:
        facts["cuda_driver_version"] = int(get_cuda()) if get_cuda else None
    except Exception:
        facts["cuda_driver_version"] = None
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        gpu: dict[str, Any] = {
            "index": i,
            "name": s(nv.nvmlDeviceGetName(h)),
            "memory_total_bytes": int(mem.total),
            "memory_used_bytes": int(mem.used),
        }
        facts["gpus"].append(gpu)
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
        except Exception:
            procs = []
        for p in procs:
            try:
                name = s(nv.nvmlSystemGetProcessName(p.pid))
            except Exception:
                name = None
            used = getattr(p, "usedGpuMemory", None)
            facts["processes"].append({"gpu_index": i, "pid": int(p.pid), "name": name,
                                       "used_bytes": int(used) if used is not None else None})
    return facts


def probe_driver() -> DriverRaw:
    """Ask NVML (if importable) and ``nvidia-smi`` (if on PATH) what they see."""
    nvml: dict[str, Any] | None = None
    nv, nvml_error = load_nvml()
    if nv is not None:
        try:
            nvml = _nvml_facts(nv)
        except Exception as err:
            nvml_error = f"NVML query failed: {err}"
        finally:
            try:
                nv.nvmlShutdown()
            except Exception:
                pass
    smi = shutil.which("nvidia-smi")
    q_gpu = q_apps = table = smi_error = None
    if smi and nvml is None:
        fmt = "--format=csv,noheader,nounits"
        q_gpu, smi_error = _run([smi, f"--query-gpu={','.join(QUERY_GPU_FIELDS)}", fmt])
        if q_gpu is not None:
            q_apps, _ = _run([smi, f"--query-compute-apps={','.join(QUERY_APPS_FIELDS)}", fmt])
            table, _ = _run([smi])
    elif smi:
        table, _ = _run([smi])  # for the record; NVML already gave the facts
    return DriverRaw(
        nvml=nvml, nvml_error=nvml_error, smi_path=smi, smi_query_gpu=q_gpu, smi_query_apps=q_apps,
        smi_table=table, smi_error=smi_error, pci_nvidia_devices=_pci_nvidia_devices(),
        own_pid=os.getpid(),
    )


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(record.getMessage())
        except Exception:
            pass


def _cuda_versions_module() -> Any:
    try:
        from jax._src.lib import cuda_versions  # type: ignore[attr-defined]

        if cuda_versions is not None:
            return cuda_versions
    except Exception:
        pass
    for name in ("jax_cuda13_plugin._versions", "jax_cuda12_plugin._versions", "jaxlib.cuda._versions"):
        try:
            return importlib.import_module(name)
        except Exception:
            continue
    return None


def _read_cuda_versions() -> dict[str, int | None]:
    mod = _cuda_versions_module()
    if mod is None:
        return {}
    out: dict[str, int | None] = {}
    for key, fn in (
        ("cuda_runtime_build", "cuda_runtime_build_version"),
        ("cuda_runtime", "cuda_runtime_get_version"),
        ("cudnn_build", "cudnn_build_version"),
        ("cudnn", "cudnn_get_version"),
        ("cuda_driver", "cuda_driver_get_version"),
    ):
        f = getattr(mod, fn, None)
        if f is None:
            continue
        try:
            out[key] = int(f())
        except Exception:
            out[key] = None
    return out


def _compile_only_plugin() -> str | None:
    """Where `capopt setup xla-gpu` put the CUDA plugin (kept off sys.path: the xla-gpu
    tier's workers load it), or None."""
    try:
        from ..validation.plugin import plugin_path
        return plugin_path()
    except Exception:       # the validation extra may not import; the doctor still runs
        return None


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe_jax() -> JaxRaw:
    """Import JAX, initialise its backends and record what it reports (and logs)."""
    env = {k: os.environ[k] for k in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES") if k in os.environ}
    handler = _ListHandler()
    # jax._src.xla_bridge logs to a child of "jax"; records propagate to these two.
    loggers = [logging.getLogger(n) for n in ("jax", "jax_plugins")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        import jax

        backend = jax.default_backend()
        devices = jax.devices()
        try:
            from jax._src import xla_bridge as xb

            errors = dict(getattr(xb, "_backend_errors", {}) or {})
        except Exception:
            errors = {}
        try:
            import jaxlib

            jaxlib_version = getattr(jaxlib, "__version__", None) or _installed("jaxlib")
        except Exception:
            jaxlib_version = _installed("jaxlib")
        return JaxRaw(
            jax_version=jax.__version__,
            jaxlib_version=jaxlib_version,
            backend=backend,
            devices=tuple(repr(d) for d in devices),
            device_kinds=tuple(str(getattr(d, "device_kind", "")) for d in devices),
            backend_errors={k: str(v) for k, v in errors.items() if k != "tpu" or backend == "tpu"},
            log_text="\n".join(handler.records),
            cuda_versions=_read_cuda_versions(),
            plugins={d: v for d in PLUGIN_DISTRIBUTIONS if (v := _installed(d))},
            env=env,
            compile_only_plugin=_compile_only_plugin(),
        )
    except Exception as err:
        return JaxRaw(error=f"{type(err).__name__}: {err}", log_text="\n".join(handler.records), env=env,
                      compile_only_plugin=_compile_only_plugin())
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def probe_step(repeats: int = 5) -> StepRaw:
    """Compile and run a small MLP training step (forward + backward) on the default device."""
    try:
        import jax
        import jax.numpy as jnp

        device = jax.devices()[0]

        def loss_fn(params: dict[str, Any], x: Any, y: Any) -> Any:
            h = jax.nn.relu(x @ params["w1"] + params["b1"])
            return jnp.mean((h @ params["w2"] - y) ** 2)

        def step(params: dict[str, Any], x: Any, y: Any) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            new = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads)
            return loss, new

        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
        params = {
            "w1": jax.random.normal(k1, (128, 256), jnp.float32) * 0.05,
            "b1": jnp.zeros((256,), jnp.float32),
            "w2": jax.random.normal(k2, (256, 16), jnp.float32) * 0.05,
        }
        x = jax.random.normal(k3, (64, 128), jnp.float32)
        y = jnp.zeros((64, 16), jnp.float32)
        jax.block_until_ready((params, x, y))
        t0 = time.perf_counter()
        compiled = jax.jit(step).lower(params, x, y).compile()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(params, x, y))
        first_s = time.perf_counter() - t0
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            out = jax.block_until_ready(compiled(params, x, y))
            times.append(time.perf_counter() - t0)
        platforms: set[str] = set()
        for leaf in jax.tree_util.tree_leaves(out):
            for d in leaf.devices():
                platforms.add(d.platform)
        try:
            stats = device.memory_stats()
        except Exception:
            stats = None
        return StepRaw(
            platform=device.platform,
            device=repr(device),
            output_platforms=tuple(sorted(platforms)),
            compile_s=compile_s,
            run_s=statistics.median(times),
            first_run_s=first_s,
            memory_stats={k: int(v) for k, v in stats.items()} if stats else None,
        )
    except Exception as err:
        return StepRaw(error=f"{type(err).__name__}: {err}")


def probe_versions() -> VersionsRaw:
    """Python and package versions from the installed distributions (imports nothing)."""
    names = ("jax", "jaxlib", *PLUGIN_DISTRIBUTIONS, "flax", "optax", "numpy", "nvidia-ml-py")
    packages = {n: _installed(n) for n in names}
    # Optional accelerator packages are listed only when installed.
    optional = set(PLUGIN_DISTRIBUTIONS) | {"nvidia-ml-py"}
    packages = {k: v for k, v in packages.items() if v is not None or k not in optional}
    return VersionsRaw(python=f"{platform.python_version()} ({sys.executable})", packages=packages)
