"""The monitor: replaying recorded series, flags, host CPU, and explain_memory.

Fixtures live in tests/fixtures/gpu (see its README for where each came from).
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest

from capopt.gpu.monitor import (
    CLOCK_REASON_BITS,
    HostCpu,
    Monitor,
    NvmlSampler,
    ReplaySampler,
    Sample,
    cpu_percent_between,
    decode_clock_reasons,
    explain_memory,
    flags,
    parse_memory_stats_text,
    parse_proc_stat,
    summarize,
)

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
MIB = 1024**2


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def synthetic(key: str) -> list[Sample]:
    return [Sample.from_dict(d) for d in json.loads(fixture("monitor_series_synthetic.json"))[key]]


def replay(sampler: ReplaySampler) -> Monitor:
    with Monitor(interval_s=0.0, sampler=sampler) as mon:
        assert mon.wait(timeout_s=5.0)
    return mon


# --- replaying recorded H100 series ----------------------------------------------------------


def test_dmon_under_load_replays_and_raises_no_flags():
    mon = replay(ReplaySampler.from_dmon(fixture("h100_load_dmon.txt")))
    assert len(mon.samples) == 5
    s = mon.summary()
    assert s["series"]["gpu_util_pct"]["mean"] == 100.0
    assert s["series"]["power_w"]["mean"] == pytest.approx((631 + 634 + 633 + 634 + 636) / 5)
    assert s["series"]["power_w"]["max"] == 636.0
    assert s["series"]["temp_c"]["p5"] == pytest.approx(63.0)
    assert s["series"]["sm_clock_mhz"]["min"] == 1980.0
    assert s["sm_clock_trend"]["drop_fraction"] == 0.0
    assert flags(s) == []  # a saturated, unthrottled GPU: nothing to report


def test_dmon_idle_is_flagged_underused():
    s = replay(ReplaySampler.from_dmon(fixture("h100_idle_dmon.txt"))).summary()
    assert s["series"]["sm_clock_mhz"]["mean"] == 345.0
    assert [f.kind for f in flags(s)] == ["gpu-underused"]


def test_query_csv_rows_carry_clock_event_reasons():
    idle = ReplaySampler.from_query_csv(fixture("h100_idle_query-gpu.csv")).sample()
    load = ReplaySampler.from_query_csv(fixture("h100_load_query-gpu.csv")).sample()
    assert idle is not None and load is not None
    assert idle.throttle_reasons == 0x1 and decode_clock_reasons(idle.throttle_reasons) == ["gpu_idle"]
    assert load.throttle_reasons == 0
    assert load.gpu_util_pct == 100.0 and load.mem_used_bytes == 19818 * MIB
    assert load.power_w == pytest.approx(631.95) and load.sm_clock_mhz == 1980.0 and load.temp_c == 59.0


def test_replay_sampler_is_exhausted_then_returns_none():
    sampler = ReplaySampler([Sample(t_s=0.0), Sample(t_s=1.0)])
    assert sampler.sample() is not None and sampler.sample() is not None
    assert sampler.sample() is None


def test_clock_reason_bits_match_the_supported_mask_of_the_h100_capture():
    # clocks_event_reasons.supported on the H100 capture is 0x1FF: exactly these nine bits.
    assert sum(CLOCK_REASON_BITS) == 0x1FF
    assert decode_clock_reasons(0x60) == ["sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert decode_clock_reasons(None) == [] and decode_clock_reasons(0) == []


# --- flags on the synthetic series (see the fixture README) ----------------------------------


@pytest.mark.parametrize(
    "key, kind",
    [("input_bound", "input-bound"), ("thermal", "thermal-throttling"), ("power", "power-throttling")],
)
def test_flags_on_synthetic_series(key, kind):
    found = flags(summarize(synthetic(key)))
    assert [f.kind for f in found] == [kind]
    json.dumps([f.to_dict() for f in found])


def test_input_bound_is_recognised_from_one_saturated_core():
    f = flags(summarize(synthetic("input_bound")))[0]
    assert f.evidence["cpu_util_mean_pct"] < 80  # host-wide CPU alone would miss it
    assert f.evidence["cpu_busiest_core_mean_pct"] >= 90
    assert "one core" in f.message


def test_throttle_reasons_without_falling_clocks_are_not_flagged():
    steady = [Sample(**{**s.to_dict(), "sm_clock_mhz": 1980.0}) for s in synthetic("thermal")]
    assert flags(summarize(steady)) == []


def test_thermal_evidence_names_the_drop():
    f = flags(summarize(synthetic("thermal")))[0]
    assert f.evidence["sm_clock_peak_mhz"] == 1980.0
    assert f.evidence["sm_clock_last_quarter_mhz"] == pytest.approx((1515 + 1500 + 1500 + 1485) / 4)
    assert f.evidence["temp_max_c"] == 90


def test_summary_percentile_is_linear_interpolation():
    s = summarize([Sample(t_s=float(i), gpu_util_pct=float(v)) for i, v in enumerate([10, 20, 30, 40, 50])])
    # numpy.percentile([10, 20, 30, 40, 50], 5) == 12.0
    assert s["series"]["gpu_util_pct"]["p5"] == pytest.approx(12.0)
    assert s["duration_s"] == 4.0


# --- the monitor without NVML, and with a stand-in NVML --------------------------------------


def test_monitor_without_nvml_records_nothing_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with Monitor(interval_s=0.01) as mon:
        pass
    assert not mon.available
    assert mon.samples == []
    assert "NVML" in (mon.reason or "")
    s = mon.summary()
    assert s["n_samples"] == 0 and "NVML" in s["reason"]
    assert flags(s) == []


def _fake_pynvml() -> types.ModuleType:
    """A stand-in for nvidia-ml-py returning readings taken from the H100 capture under load."""
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU = 0
    nv.NVML_CLOCK_SM = 1
    nv.calls = {"init": 0, "shutdown": 0}

    def init():
        nv.calls["init"] += 1

    def shutdown():
        nv.calls["shutdown"] += 1

    nv.nvmlInit = init
    nv.nvmlShutdown = shutdown
    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=100, memory=11)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=81559 * MIB, used=19818 * MIB, free=61263 * MIB)
    nv.nvmlDeviceGetPowerUsage = lambda h: 631950  # milliwatts
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 59
    nv.nvmlDeviceGetClockInfo = lambda h, clock: 1980
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0
    nv.nvmlSystemGetDriverVersion = lambda: "590.48.01"
    nv.nvmlSystemGetCudaDriverVersion_v2 = lambda: 13010
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=11345, usedGpuMemory=15690 * MIB)]
    nv.nvmlSystemGetProcessName = lambda pid: b"./gpu_burn"
    return nv


def test_nvml_sampler_reads_a_sample(monkeypatch):
    nv = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    sampler = NvmlSampler(device_index=0, host_cpu=HostCpu(use_psutil=False))
    assert sampler.available and sampler.reason is None
    s = sampler.sample()
    assert s is not None
    readings = (s.gpu_util_pct, s.mem_util_pct, s.power_w, s.temp_c, s.sm_clock_mhz)
    assert readings == (100.0, 11.0, 631.95, 59.0, 1980.0)
    assert s.mem_used_bytes == 19818 * MIB and s.throttle_reasons == 0
    sampler.close()
    assert nv.calls == {"init": 1, "shutdown": 1}


def test_monitor_samples_in_the_background_until_stopped(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    mon = Monitor(interval_s=0.01).start()
    try:
        for _ in range(200):
            if len(mon.samples) >= 3:
                break
            time.sleep(0.01)
    finally:
        mon.stop()
    n = len(mon.samples)
    assert n >= 3 and mon.available
    assert mon.summary()["series"]["gpu_util_pct"]["mean"] == 100.0
    assert len(mon.samples) == n  # nothing more after stop


def test_nvml_sampler_out_of_range_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    sampler = NvmlSampler(device_index=3)
    assert not sampler.available and "out of range" in (sampler.reason or "")


def test_monitor_rejects_negative_interval():
    with pytest.raises(ValueError, match="interval_s"):
        Monitor(interval_s=-1)


# --- host CPU ---------------------------------------------------------------------------------


def test_proc_stat_recording_one_busy_core_of_two():
    text = fixture("proc_stat_busy_loop.txt")
    first, second = text.split("# snapshot 2")
    host, busiest = cpu_percent_between(parse_proc_stat(first), parse_proc_stat(second))
    assert host == pytest.approx(50.0)
    assert busiest == pytest.approx(100.0)


def test_host_cpu_reads_this_machine():
    cpu = HostCpu(use_psutil=False)
    assert cpu.read() == (None, None)  # priming call
    host, busiest = cpu.read()
    if Path("/proc/stat").exists():
        assert host is None or 0.0 <= host <= 100.0
        assert busiest is None or 0.0 <= busiest <= 100.0


# --- explain_memory ----------------------------------------------------------------------------


def test_explain_memory_pool_held_beyond_peak():
    stats = parse_memory_stats_text(fixture("memory_stats_pool_growth.txt"))
    assert len(stats) == 7
    ex = explain_memory(stats[1])  # the "20:" row: peak 4.25 GB, pool grown to the limit
    assert ex.in_use_bytes == 22846976 and ex.peak_bytes == 4251233024
    assert ex.held_bytes == ex.limit_bytes == 12701761536
    text = ex.render()
    assert "pool_bytes" in text and "more than the peak need" in text and "nvidia-smi" in text
    assert any("over half of the peak" in w for w in ex.warnings)  # one 4.2 GB buffer
    json.dumps(ex.to_dict())


def test_explain_memory_relates_the_limit_to_the_device():
    stats = parse_memory_stats_text(fixture("memory_stats_pool_growth.txt"))[0]
    # The source does not name its card; 16935682048 bytes is the device size at which the
    # recorded bytes_limit is exactly JAX's default 75%, so the annotation must appear.
    ex = explain_memory(stats, device_total_bytes=16935682048)
    assert "75.0% of the device" in ex.render() and "default 75%" in ex.render()


def test_explain_memory_small_session_has_no_warnings():
    before, after = parse_memory_stats_text(fixture("memory_stats_gpu_session.txt"))
    ex = explain_memory(after)
    assert (ex.in_use_bytes, ex.peak_bytes, ex.num_allocs) == (76288, 76800, 3)
    assert ex.held_bytes is None  # this allocator reports no pool_bytes
    assert ex.warnings == ()
    assert "74.5 KiB" in ex.render() and "3 allocations" in ex.render()
    assert explain_memory(before).lines[0].endswith("in 1 allocation")


def test_explain_memory_near_the_limit_warns():
    stats = parse_memory_stats_text(fixture("memory_stats_gpu_session.txt"))[1]
    near = {**stats, "peak_bytes_in_use": int(0.95 * stats["bytes_limit"])}
    assert any("of the allocator limit" in w for w in explain_memory(near).warnings)


def test_explain_memory_on_cpu():
    ex = explain_memory(None)
    assert ex.peak_bytes is None and "CPU" in ex.render()
