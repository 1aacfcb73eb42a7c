"""Live accelerator monitoring while a training step runs, and what the numbers mean.

`Monitor` samples one NVIDIA GPU through NVML (the optional ``nvidia-ml-py`` package,
imported as ``pynvml``) in a background thread: utilisation (SM and memory), memory used,
power, temperature, SM clock and the clock-event ("throttle") reasons, plus host CPU
utilisation. `summary` reduces the samples to mean / max / p5 per series, `flags` turns a
summary into findings (input-bound, thermal or power throttling), and `explain_memory`
reads a JAX ``device.memory_stats()`` dict and says what the allocator holds versus what the
step needs.

Sampling goes through a `Sampler`, so recorded series replay exactly like live ones::

    >>> sampler = ReplaySampler.from_dmon(open("h100_load_dmon.txt").read())  # doctest: +SKIP
    >>> with Monitor(interval_s=0.0, sampler=sampler) as mon:  # doctest: +SKIP
    ...     mon.wait()
    >>> [f.kind for f in flags(mon.summary())]  # doctest: +SKIP
    []

Live, around a training loop::

    with Monitor(interval_s=0.2) as mon:
        train(steps=100)
    print(mon.summary(), flags(mon.summary()))

Without NVML the monitor records nothing and says why in `Monitor.reason`; it never raises.
"""

from __future__ import annotations

import ast
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from types import ModuleType
from typing import Any, Protocol

from .._format import format_bytes
from .._units import GiB, MiB
from .smi import parse_csv_with_header, smi_number

__all__ = [
    "CLOCK_REASON_BITS",
    "cpu_percent_between",
    "decode_clock_reasons",
    "explain_memory",
    "Finding",
    "flags",
    "HostCpu",
    "load_nvml",
    "MemoryExplanation",
    "Monitor",
    "NvmlSampler",
    "parse_csv_with_header",
    "parse_memory_stats_text",
    "parse_proc_stat",
    "ReplaySampler",
    "Sample",
    "Sampler",
    "SERIES",
    "summarize",
]


# NVML clock event ("throttle") reason bits, from nvml.h (nvmlClocksEventReason*) and
# `nvidia-smi --help-query-gpu`; the H100 capture in tests/fixtures/gpu reports the
# supported mask 0x1FF, i.e. exactly these nine bits.
CLOCK_REASON_BITS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
THERMAL_MASK = 0x020 | 0x040
POWER_MASK = 0x004 | 0x080
HW_SLOWDOWN_MASK = 0x008

# Thresholds behind `flags`. Each is a judgement, written down so it can be argued with.
LOW_GPU_UTIL_PCT = 50.0
"""Mean ``utilization.gpu`` below this: kernels ran less than half of the time."""
BUSY_HOST_CPU_PCT = 80.0
"""Host-wide CPU utilisation at or above this counts as busy."""
BUSY_CORE_PCT = 90.0
"""A single core at or above this counts as busy: a Python input loop holds one core (GIL)."""
THROTTLE_MIN_FRACTION = 0.2
"""A throttle reason must be active in at least this fraction of samples to be reported."""
CLOCK_DROP_FRACTION = 0.05
"""SM clocks count as falling when p5 or the last quarter sits this far below the peak."""
NEAR_LIMIT_FRACTION = 0.9
"""Peak allocator use above this fraction of ``bytes_limit`` leaves little headroom."""
DOMINANT_BUFFER_MIN_PEAK_BYTES = 256 * 1024**2
"""Below this peak, one buffer dominating memory is not worth a warning."""
DEFAULT_PREALLOCATE_FRACTION = 0.75
"""JAX preallocates 75% of device memory by default (docs.jax.dev, GPU memory allocation)."""


# ---------------------------------------------------------------------------------------------
# Samples and samplers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One reading. ``None`` marks a value the source could not provide.

    Attributes:
        t_s: seconds since the sampler started.
        gpu_util_pct: percent of the sample period with a kernel running (``utilization.gpu``).
        mem_util_pct: percent of the period device memory was read or written.
        mem_used_bytes: device memory allocated by all contexts (what nvidia-smi shows).
        power_w: board power draw in watts.
        temp_c: GPU temperature in degrees Celsius.
        sm_clock_mhz: current SM clock in MHz.
        throttle_reasons: NVML clock-event-reason bitmask (see `CLOCK_REASON_BITS`).
        cpu_util_pct: host CPU utilisation over all cores since the previous sample.
        cpu_max_core_pct: utilisation of the busiest single core since the previous sample.
    """

    t_s: float
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_bytes: int | None = None
    power_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    throttle_reasons: int | None = None
    cpu_util_pct: float | None = None
    cpu_max_core_pct: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Sample:
        """Build a sample from a mapping; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


SERIES: tuple[str, ...] = (
    "gpu_util_pct",
    "mem_util_pct",
    "mem_used_bytes",
    "power_w",
    "temp_c",
    "sm_clock_mhz",
    "cpu_util_pct",
    "cpu_max_core_pct",
)


class Sampler(Protocol):
    """Where samples come from: NVML on a live machine, a recording in tests."""

    available: bool
    reason: str | None

    def sample(self) -> Sample | None:
        """Take one reading; ``None`` means the source is exhausted (a replay ran out)."""

    def close(self) -> None:
        """Release the source."""


def load_nvml() -> tuple[ModuleType | None, str | None]:
    """Import and initialise ``pynvml``; return ``(module, None)`` or ``(None, why)``."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except Exception as err:  # ImportError, or a broken install
        return None, f"NVML bindings not importable: {err} (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as err:
        return None, f"NVML failed to initialise: {_nvml_error_text(err)}"
    return pynvml, None


def _nvml_error_text(err: BaseException) -> str:
    text = str(err)
    return text or type(err).__name__


class HostCpu:
    """Host CPU utilisation between successive calls.

    Uses ``psutil`` when it is installed, otherwise ``/proc/stat`` (Linux). On neither, every
    reading is ``None``. Each call to `read` returns ``(all_cores_pct, busiest_core_pct)``
    over the time since the previous call; the first call primes the counters and returns
    ``(None, None)``.
    """

    def __init__(self, proc_stat: str = "/proc/stat", use_psutil: bool | None = None):
        self._proc_stat = proc_stat
        self._psutil: ModuleType | None = None
        if use_psutil is not False:
            try:
                import psutil  # type: ignore[import-untyped]

                self._psutil = psutil
            except ImportError:
                self._psutil = None
        self._prev: dict[str, tuple[int, int]] | None = None
        self._psutil_primed = False

    def read(self) -> tuple[float | None, float | None]:
        if self._psutil is not None:
            per_core = self._psutil.cpu_percent(interval=None, percpu=True)
            if not self._psutil_primed:  # psutil's first call only starts the interval
                self._psutil_primed = True
                return None, None
            if not per_core:
                return None, None
            return sum(per_core) / len(per_core), max(per_core)
        try:
            with open(self._proc_stat) as fh:
                now = parse_proc_stat(fh.read())
        except OSError:
            return None, None
        prev, self._prev = self._prev, now
        if prev is None:
            return None, None
        return cpu_percent_between(prev, now)


def parse_proc_stat(text: str) -> dict[str, tuple[int, int]]:
    """Parse the ``cpu`` lines of ``/proc/stat`` into ``{name: (busy_jiffies, total_jiffies)}``.

    Idle time is ``idle + iowait`` (fields 4 and 5); everything else counts as busy. Guest
    time is already included in user time, so it is not added again.
    """
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu"):
            continue
        values = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
        values += [0] * (8 - len(values))
        idle = values[3] + values[4]
        total = sum(values)
        out[parts[0]] = (total - idle, total)
    return out


def cpu_percent_between(
    before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]
) -> tuple[float | None, float | None]:
    """``(all_cores_pct, busiest_core_pct)`` between two `parse_proc_stat` snapshots."""

    def pct(name: str) -> float | None:
        if name not in before or name not in after:
            return None
        busy = after[name][0] - before[name][0]
        total = after[name][1] - before[name][1]
        return 100.0 * busy / total if total > 0 else None

    cores = [p for name in after if name != "cpu" and (p := pct(name)) is not None]
    return pct("cpu"), (max(cores) if cores else None)


class NvmlSampler:
    """Reads one GPU through NVML. Unavailable (never raising) when NVML is missing."""

    def __init__(self, device_index: int = 0, host_cpu: HostCpu | None = None):
        self.device_index = device_index
        self._host = host_cpu if host_cpu is not None else HostCpu()
        self._t0 = time.monotonic()
        self._nvml, self.reason = load_nvml()
        self._handle: Any = None
        if self._nvml is not None:
            try:
                count = self._nvml.nvmlDeviceGetCount()
                if device_index >= count:
                    self.reason = f"device index {device_index} out of range ({count} GPUs)"
                else:
                    self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device_index)
            except Exception as err:
                self.reason = f"NVML could not open GPU {device_index} ({_nvml_error_text(err)})"
        self.available = self._handle is not None
        if self.available:
            self._host.read()  # prime the CPU counters

    def _try(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:
            return None

    def sample(self) -> Sample | None:
        if not self.available:
            return None
        nv, h = self._nvml, self._handle
        assert nv is not None
        util = self._try(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = self._try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power_mw = self._try(lambda: nv.nvmlDeviceGetPowerUsage(h))
        temp = self._try(lambda: nv.nvmlDeviceGetTemperature(h, getattr(nv, "NVML_TEMPERATURE_GPU", 0)))
        clock = self._try(lambda: nv.nvmlDeviceGetClockInfo(h, getattr(nv, "NVML_CLOCK_SM", 1)))
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        reasons = self._try(lambda: reasons_fn(h)) if reasons_fn is not None else None
        cpu, core = self._host.read()
        return Sample(
            t_s=time.monotonic() - self._t0,
            gpu_util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            mem_used_bytes=None if mem is None else int(mem.used),
            power_w=None if power_mw is None else power_mw / 1000.0,
            temp_c=None if temp is None else float(temp),
            sm_clock_mhz=None if clock is None else float(clock),
            throttle_reasons=None if reasons is None else int(reasons),
            cpu_util_pct=cpu,
            cpu_max_core_pct=core,
        )

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
        self.available = False


class ReplaySampler:
    """Replays a recorded series, one sample per call, then reports exhaustion."""

    def __init__(self, samples: Iterable[Sample], reason: str | None = None):
        self._samples = list(samples)
        self._i = 0
        self.available = True
        self.reason = reason

    def sample(self) -> Sample | None:
        if self._i >= len(self._samples):
            return None
        s = self._samples[self._i]
        self._i += 1
        return s

    def close(self) -> None:
        self._i = len(self._samples)

    @classmethod
    def from_dicts(cls, rows: Iterable[Mapping[str, Any]]) -> ReplaySampler:
        return cls(Sample.from_dict(r) for r in rows)

    @classmethod
    def from_json(cls, text: str, key: str | None = None) -> ReplaySampler:
        """Replay ``[{...sample...}, ...]``, or the list under ``key`` in a JSON object."""
        data = json.loads(text)
        return cls.from_dicts(data[key] if key is not None else data)

    @classmethod
    def from_dmon(cls, text: str, interval_s: float = 1.0, gpu: int = 0) -> ReplaySampler:
        """Replay ``nvidia-smi dmon`` output (one row per GPU per interval).

        ``sm`` is SM activity (kept as ``gpu_util_pct``), ``pclk`` the processor clock (kept as
        the SM clock), ``pwr`` watts, ``gtemp`` degrees C. dmon reports neither memory used
        nor clock-event reasons, and nothing about the host CPU.
        """
        header: list[str] = []
        rows: list[Sample] = []
        for line in text.splitlines():
            if line.startswith("#"):
                if not header:
                    header = line.lstrip("#").split()
                continue
            parts = line.split()
            if not parts or not header:
                continue
            rec = dict(zip(header, parts, strict=False))
            if smi_number(rec.get("gpu")) != gpu:
                continue
            rows.append(
                Sample(
                    t_s=len(rows) * interval_s,
                    gpu_util_pct=smi_number(rec.get("sm")),
                    mem_util_pct=smi_number(rec.get("mem")),
                    power_w=smi_number(rec.get("pwr")),
                    temp_c=smi_number(rec.get("gtemp")),
                    sm_clock_mhz=smi_number(rec.get("pclk")),
                )
            )
        return cls(rows)

    @classmethod
    def from_query_csv(cls, text: str, interval_s: float = 1.0) -> ReplaySampler:
        """Replay rows of ``nvidia-smi --query-gpu=... --format=csv`` (with its header)."""
        rows: list[Sample] = []
        for i, rec in enumerate(parse_csv_with_header(text)):
            used_mib = smi_number(rec.get("memory.used"))
            reasons = rec.get("clocks_event_reasons.active") or rec.get("clocks_throttle_reasons.active")
            rows.append(
                Sample(
                    t_s=i * interval_s,
                    gpu_util_pct=smi_number(rec.get("utilization.gpu")),
                    mem_util_pct=smi_number(rec.get("utilization.memory")),
                    mem_used_bytes=None if used_mib is None else int(used_mib * MiB),
                    power_w=smi_number(rec.get("power.draw")),
                    temp_c=smi_number(rec.get("temperature.gpu")),
                    sm_clock_mhz=smi_number(rec.get("clocks.current.sm") or rec.get("clocks.sm")),
                    throttle_reasons=_hex(reasons),
                )
            )
        return cls(rows)


def _hex(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(str(value).strip(), 0)
    except ValueError:
        return None


def decode_clock_reasons(mask: int | None) -> list[str]:
    """Names of the NVML clock-event reasons set in ``mask``."""
    if not mask:
        return []
    return [name for bit, name in CLOCK_REASON_BITS.items() if mask & bit]


# ---------------------------------------------------------------------------------------------
# The monitor
# ---------------------------------------------------------------------------------------------


class Monitor:
    """Sample one GPU in a background thread while the caller trains.

    Args:
        interval_s: seconds between samples (NVML utilisation itself averages over
            1/6 s to 1 s depending on the product, so much finer sampling adds nothing).
        device_index: NVML index of the GPU to watch.
        sampler: where samples come from; defaults to `NvmlSampler` for ``device_index``.

    Use as a context manager (``with Monitor() as mon: ...``) or call `start` / `stop`.
    When the sampler is unavailable (no NVML, no GPU) nothing is recorded and `reason`
    says why.
    """

    def __init__(self, interval_s: float = 0.2, device_index: int = 0, sampler: Sampler | None = None):
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = float(interval_s)
        self.device_index = device_index
        self._sampler_arg = sampler
        self._sampler: Sampler | None = None
        self._samples: list[Sample] = []
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._available = False
        self.reason: str | None = None
        self.error: str | None = None

    @property
    def available(self) -> bool:
        """Whether the sampler could read the device when the monitor started."""
        return self._available

    @property
    def samples(self) -> list[Sample]:
        """A copy of the samples recorded so far."""
        return list(self._samples)

    def start(self) -> Monitor:
        if self._thread is not None:
            return self
        self._sampler = (self._sampler_arg if self._sampler_arg is not None
                         else NvmlSampler(self.device_index))
        self.reason = self._sampler.reason
        self._available = bool(self._sampler.available)
        if not self._available:
            self._done.set()
            return self
        self._thread = threading.Thread(target=self._run, name="capopt-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self._sampler is not None
        try:
            while not self._stop.is_set():
                s = self._sampler.sample()
                if s is None:
                    break
                self._samples.append(s)
                if self.interval_s > 0 and self._stop.wait(self.interval_s):
                    break
        except Exception as err:  # a sampling failure ends monitoring, never the training
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the sampler runs out (replays) or `stop` is called."""
        return self._done.wait(timeout_s)

    def stop(self) -> Monitor:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
        if self._sampler is not None and self._sampler_arg is None:
            self._sampler.close()
        return self

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def summary(self) -> dict[str, Any]:
        """`summarize` of the samples so far, with `reason` when nothing was recorded."""
        out = summarize(self._samples)
        if not self._samples:
            out["reason"] = self.reason or self.error or "no samples recorded"
        return out


# ---------------------------------------------------------------------------------------------
# Summary and findings
# ---------------------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method), ``q`` in [0, 100]."""
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def summarize(samples: Sequence[Sample]) -> dict[str, Any]:
    """Mean / max / min / p5 for each series, the SM clock trend and throttle fractions.

    Returns ``{"n_samples", "duration_s", "series": {name: {"mean", "max", "min", "p5",
    "n"}}, "sm_clock_trend": {...} | None, "throttle": {...} | None}``. A series with no
    readings is left out of ``"series"``.
    """
    out: dict[str, Any] = {"n_samples": len(samples), "series": {}}
    out["duration_s"] = (samples[-1].t_s - samples[0].t_s) if len(samples) > 1 else 0.0
    for name in SERIES:
        vals = [float(v) for s in samples if (v := getattr(s, name)) is not None]
        if vals:
            out["series"][name] = {
                "mean": sum(vals) / len(vals),
                "max": max(vals),
                "min": min(vals),
                "p5": _percentile(vals, 5),
                "n": len(vals),
            }
    clocks = [float(s.sm_clock_mhz) for s in samples if s.sm_clock_mhz is not None]
    out["sm_clock_trend"] = None
    if len(clocks) >= 4:
        q = max(1, len(clocks) // 4)
        first, last = clocks[:q], clocks[-q:]
        peak = max(clocks)
        low = min(_percentile(clocks, 5), sum(last) / len(last))
        out["sm_clock_trend"] = {
            "first_quarter_mean": sum(first) / len(first),
            "last_quarter_mean": sum(last) / len(last),
            "peak": peak,
            "drop_fraction": (peak - low) / peak if peak else 0.0,
        }
    masks = [s.throttle_reasons for s in samples if s.throttle_reasons is not None]
    out["throttle"] = None
    if masks:
        seen: list[str] = []
        for m in masks:
            for name in decode_clock_reasons(m):
                if name not in seen:
                    seen.append(name)
        n = len(masks)
        out["throttle"] = {
            "thermal_fraction": sum(1 for m in masks if m & THERMAL_MASK) / n,
            "power_fraction": sum(1 for m in masks if m & POWER_MASK) / n,
            "hw_slowdown_fraction": sum(1 for m in masks if m & HW_SLOWDOWN_MASK) / n,
            "idle_fraction": sum(1 for m in masks if m & 0x001) / n,
            "reasons_seen": seen,
        }
    return out


@dataclass(frozen=True)
class Finding:
    """One thing the monitor noticed, with the numbers behind it."""

    kind: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "evidence": dict(self.evidence)}


def flags(summary: Mapping[str, Any]) -> list[Finding]:
    """Findings from a `summarize` result: input-bound, throttling, an idle GPU.

    - ``input-bound``: mean GPU utilisation below `LOW_GPU_UTIL_PCT` while the host CPU is
      busy (all cores at `BUSY_HOST_CPU_PCT`, or one core at `BUSY_CORE_PCT`).
    - ``gpu-underused``: low GPU utilisation with an idle host (waiting on I/O, host syncs,
      or kernels too small to fill the GPU).
    - ``thermal-throttling`` / ``power-throttling``: the matching clock-event reasons in at
      least `THROTTLE_MIN_FRACTION` of samples *and* SM clocks falling by
      `CLOCK_DROP_FRACTION` or more.
    """
    found: list[Finding] = []
    series = summary.get("series", {})
    gpu = series.get("gpu_util_pct")
    cpu = series.get("cpu_util_pct")
    core = series.get("cpu_max_core_pct")
    if gpu is not None and gpu["mean"] < LOW_GPU_UTIL_PCT:
        busy_host = cpu is not None and cpu["mean"] >= BUSY_HOST_CPU_PCT
        busy_core = core is not None and core["mean"] >= BUSY_CORE_PCT
        evidence = {
            "gpu_util_mean_pct": round(gpu["mean"], 1),
            "cpu_util_mean_pct": None if cpu is None else round(cpu["mean"], 1),
            "cpu_busiest_core_mean_pct": None if core is None else round(core["mean"], 1),
        }
        if busy_host or busy_core:
            which = "all cores" if busy_host else "one core (a single Python thread)"
            found.append(
                Finding(
                    "input-bound",
                    f"GPU busy only {gpu['mean']:.0f}% of the time while the host CPU is saturated "
                    f"on {which}: the input pipeline or host-side Python cannot keep up. Prefetch "
                    "batches on background threads, move preprocessing onto the device, or "
                    "raise the batch size so each step does more device work.",
                    evidence,
                )
            )
        else:
            host = ("the host CPU is not busy" if (cpu is not None or core is not None)
                    else "the host CPU was not measured")
            found.append(
                Finding(
                    "gpu-underused",
                    f"GPU busy only {gpu['mean']:.0f}% of the time and {host}: look for waits on "
                    "storage or network, host syncs in the loop (float(loss), .item(), "
                    "block_until_ready each step), or kernels too small to fill the GPU.",
                    evidence,
                )
            )
    trend = summary.get("sm_clock_trend")
    throttle = summary.get("throttle")
    if trend and throttle and trend["drop_fraction"] >= CLOCK_DROP_FRACTION:
        clock_ev = {
            "sm_clock_peak_mhz": trend["peak"],
            "sm_clock_last_quarter_mhz": round(trend["last_quarter_mean"], 1),
            "sm_clock_drop_fraction": round(trend["drop_fraction"], 3),
        }
        temp = series.get("temp_c")
        power = series.get("power_w")
        if throttle["thermal_fraction"] >= THROTTLE_MIN_FRACTION:
            found.append(
                Finding(
                    "thermal-throttling",
                    f"SM clocks fell {100 * trend['drop_fraction']:.0f}% below their peak while "
                    "thermal slowdown was active: the GPU is too hot. Check airflow, fan curves "
                    "and inlet temperature; throughput measured now understates the card.",
                    {**clock_ev, "thermal_fraction": round(throttle["thermal_fraction"], 3),
                     "temp_max_c": None if temp is None else temp["max"]},
                )
            )
        if throttle["power_fraction"] >= THROTTLE_MIN_FRACTION:
            found.append(
                Finding(
                    "power-throttling",
                    f"SM clocks fell {100 * trend['drop_fraction']:.0f}% below their peak while "
                    "the power cap was active: the card is at its power limit. Check "
                    "`nvidia-smi -q -d POWER` for a lowered limit; step times will vary with load.",
                    {**clock_ev, "power_fraction": round(throttle["power_fraction"], 3),
                     "power_max_w": None if power is None else power["max"]},
                )
            )
        if (throttle["hw_slowdown_fraction"] >= THROTTLE_MIN_FRACTION
                and throttle["thermal_fraction"] < THROTTLE_MIN_FRACTION
                and throttle["power_fraction"] < THROTTLE_MIN_FRACTION):
            found.append(
                Finding(
                    "hw-slowdown",
                    "Hardware slowdown (clocks halved or worse) was active: temperature or the "
                    "power supply's brake signal. Check `nvidia-smi -q -d PERFORMANCE`.",
                    {**clock_ev, "hw_slowdown_fraction": round(throttle["hw_slowdown_fraction"], 3)},
                )
            )
    return found


# ---------------------------------------------------------------------------------------------
# Device memory: what the allocator holds versus what the step needs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryExplanation:
    """A reading of ``device.memory_stats()`` in words. Byte counts are ``None`` when absent."""

    in_use_bytes: int | None
    peak_bytes: int | None
    held_bytes: int | None
    limit_bytes: int | None
    largest_alloc_bytes: int | None
    largest_free_block_bytes: int | None
    num_allocs: int | None
    device_total_bytes: int | None
    lines: tuple[str, ...]
    warnings: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lines"] = list(self.lines)
        d["warnings"] = list(self.warnings)
        return d

    def render(self) -> str:
        return "\n".join([*self.lines, *(f"warning: {w}" for w in self.warnings)])


def explain_memory(
    stats: Mapping[str, Any] | None, *, device_total_bytes: int | None = None
) -> MemoryExplanation:
    """Explain a JAX ``device.memory_stats()`` dict.

    The XLA allocator reports (all per device, bytes):

    - ``bytes_in_use``: live buffers right now;
    - ``peak_bytes_in_use``: the high-water mark of live buffers, which is what a training
      step actually needed (budget against this);
    - ``pool_bytes`` (when reported): what the allocator has taken from the device and keeps;
      with preallocation this is the whole pool from the first operation on, without it the
      pool grows to the peak and never shrinks. nvidia-smi counts this, plus the CUDA
      context, not the live bytes;
    - ``bytes_limit``: the most the allocator may take (75% of the device by default);
    - ``bytes_reserved`` / ``peak_bytes_reserved``: memory set aside outside ``bytes_in_use``;
    - ``largest_alloc_size``: the largest single buffer; ``largest_free_block_bytes``: the
      largest contiguous free block, small next to the free total means fragmentation.

    Args:
        stats: the dict, or ``None`` (what CPU devices return).
        device_total_bytes: the device's memory (e.g. from NVML) to relate the limit to it.
    """
    if not stats:
        return MemoryExplanation(
            None, None, None, None, None, None, None, device_total_bytes,
            ("no allocator statistics: this device reports none (CPU devices return None)",), (),
        )

    def get(key: str) -> int | None:
        v = stats.get(key)
        if v is None:
            return None
        try:
            v = int(v)
        except (TypeError, ValueError):
            return None
        return None if v < 0 else v  # -1 is PJRT's "not reported"

    in_use = get("bytes_in_use")
    peak = get("peak_bytes_in_use")
    limit = get("bytes_limit")
    pool = get("pool_bytes")
    reserved = get("bytes_reserved")
    largest = get("largest_alloc_size")
    free_block = get("largest_free_block_bytes")
    n_allocs = get("num_allocs")
    lines: list[str] = []
    warnings: list[str] = []
    if in_use is not None:
        tail = f" in {n_allocs} allocation{'s' if n_allocs != 1 else ''}" if n_allocs is not None else ""
        lines.append(f"live now: {format_bytes(in_use)} (bytes_in_use){tail}")
    if peak is not None:
        lines.append(
            f"peak need: {format_bytes(peak)} (peak_bytes_in_use), the most that was live at once; "
            "this is what the step needs, budget against it"
        )
    held = pool
    if pool is not None:
        line = f"held by the allocator: {format_bytes(pool)} (pool_bytes)"
        if peak is not None and pool > peak:
            line += (
                f", {format_bytes(pool - peak)} more than the peak need: the pool keeps memory it once "
                "took (preallocation, or growth it never returns); nvidia-smi shows this, "
                "not what the step uses"
            )
        lines.append(line)
    if reserved:
        lines.append(f"reserved outside live buffers: {format_bytes(reserved)} (bytes_reserved)")
    if limit is not None:
        line = f"allocator limit: {format_bytes(limit)} (bytes_limit)"
        if device_total_bytes:
            frac = limit / device_total_bytes
            line += f" = {100 * frac:.1f}% of the device's {format_bytes(device_total_bytes)}"
            if abs(frac - DEFAULT_PREALLOCATE_FRACTION) < 0.01:
                line += " (JAX's default 75% preallocation; XLA_PYTHON_CLIENT_MEM_FRACTION changes it)"
        lines.append(line)
        if peak is not None:
            head = limit - peak
            if limit:
                share = 100 * head / limit
                lines.append(f"headroom at peak: {format_bytes(head)} ({share:.1f}% of the limit)")
            if limit and peak > NEAR_LIMIT_FRACTION * limit:
                warnings.append(
                    f"peak use is {100 * peak / limit:.0f}% of the allocator limit: one larger batch "
                    "or a fragmentation spike will run out of memory"
                )
    if largest is not None and peak:
        lines.append(
            f"largest single buffer: {format_bytes(largest)} (largest_alloc_size), "
            f"{100 * largest / peak:.0f}% of the peak"
        )
        if largest > 0.5 * peak and peak >= DOMINANT_BUFFER_MIN_PEAK_BYTES:
            warnings.append(
                "one buffer is over half of the peak: a single tensor (often logits or an "
                "attention score matrix) dominates memory; chunking it cuts the peak most"
            )
    if free_block is not None and limit is not None and held is None and in_use is not None:
        free_total = limit - in_use
        if free_total > 0 and free_block < 0.5 * free_total and free_total > GiB:
            warnings.append(
                f"largest free block {format_bytes(free_block)} is under half of the "
                f"{format_bytes(free_total)} "
                "free: the pool is fragmented, a large allocation can fail before memory is full"
            )
    return MemoryExplanation(
        in_use, peak, held, limit, largest, free_block, n_allocs, device_total_bytes,
        tuple(lines), tuple(warnings),
    )


def parse_memory_stats_text(text: str) -> list[dict[str, int]]:
    """Every ``{...}`` dict literal in ``text`` (printed ``memory_stats()`` output), in order."""
    out: list[dict[str, int]] = []
    depth = 0
    start = -1
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                try:
                    value = ast.literal_eval(text[start : i + 1])
                except (ValueError, SyntaxError):
                    continue
                if isinstance(value, dict):
                    out.append(value)
    return out

