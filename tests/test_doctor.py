"""The doctor: its report on this machine, and each judge on recorded outputs.

Fixtures live in tests/fixtures/gpu (see its README for where each came from).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import types
from pathlib import Path

import pytest

from capopt.gpu.doctor import (
    Check,
    DoctorReport,
    DriverRaw,
    JaxRaw,
    StepRaw,
    VersionsRaw,
    diagnose,
    judge_cuda_versions,
    judge_driver,
    judge_jax,
    judge_memory_settings,
    judge_step,
    judge_versions,
    parse_environment_info,
    parse_query_apps_csv,
    parse_query_gpu_csv,
    parse_smi_table,
    probe_driver,
    read_driver,
    run_doctor,
)

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
MIB = 1024**2
H100_TOTAL = 81559 * MIB
CHECK_NAMES = ["accelerator", "jax-backend", "cuda-versions", "tiny-step", "memory-settings", "versions"]
NVIDIA_SMI_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
VERSIONS_OK = VersionsRaw(
    python="3.11.7", packages={"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8", "optax": "0.2.8"})


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def h100(state: str, *, table: bool = True, csv: bool = True) -> DriverRaw:
    return DriverRaw(
        smi_path="/usr/bin/nvidia-smi",
        smi_query_gpu=fixture(f"h100_{state}_query-gpu.csv") if csv else None,
        smi_query_apps=fixture(f"h100_{state}_query-compute-apps.csv") if csv else None,
        smi_table=fixture(f"h100_{state}_nvidia-smi.txt") if table else None,
    )


def cpu_jax(**kw) -> JaxRaw:
    base = dict(jax_version="0.10.2", jaxlib_version="0.10.2", backend="cpu", devices=("CpuDevice(id=0)",))
    return JaxRaw(**{**base, **kw})


# --- this machine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report_here() -> DoctorReport:
    return run_doctor(run_step=True)


def test_report_on_this_machine_is_clean_and_json(report_here):
    d = report_here.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert [c["name"] for c in d["checks"]] == CHECK_NAMES
    assert all(c["status"] in ("ok", "warn", "fail", "skip") for c in d["checks"])
    assert d["summary"]["exit_code"] == report_here.exit_code
    if report_here.check("accelerator").status == "skip":  # no accelerator here
        assert report_here.exit_code == 0
        assert report_here.check("jax-backend").status == "ok"
        assert report_here.check("cuda-versions").status == "skip"
        assert report_here.check("tiny-step").status == "ok"
        assert d["summary"]["accelerator"] is None


def test_tiny_step_ran_on_the_default_device(report_here):
    step = report_here.check("tiny-step")
    assert step.status == "ok", step.saw
    assert step.data["output_platforms"] == [step.data["platform"]]
    assert step.data["compile_s"] > 0 and step.data["run_s"] > 0
    if step.data["platform"] == "cpu":
        assert step.data["memory_stats"] is None


def test_render_lists_every_check(report_here):
    text = report_here.render()
    assert text.startswith("capopt doctor:")
    for name in CHECK_NAMES:
        assert name in text
    assert text.rstrip().endswith(f"exit code {report_here.exit_code}")


def test_environment_info_of_this_jax_parses():
    import jax

    raw, driver = parse_environment_info(jax.print_environment_info(return_string=True))
    assert raw.jax_version == jax.__version__
    assert raw.backend == jax.default_backend() or raw.backend in ("gpu", "cpu", "tpu")


# --- accelerator: nvidia-smi recordings ----------------------------------------------------------


def test_h100_idle_driver_visible_ok():
    c = judge_driver(h100("idle"))
    assert c.status == "ok", c.saw
    assert c.data["driver_version"] == "590.48.01" and c.data["cuda_version"] == "13.1"
    (gpu,) = c.data["gpus"]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["memory_total_bytes"] == H100_TOTAL and gpu["memory_used_bytes"] == 0
    assert c.data["processes"] == []
    assert "NVIDIA H100 80GB HBM3" in c.saw and "13.1" in c.saw


def test_h100_load_lists_processes_and_warns_memory_taken():
    c = judge_driver(h100("load"))
    assert c.status == "warn" and "taken" in c.fix
    procs = {p["pid"]: p for p in c.data["processes"]}
    assert set(procs) == {11327, 11328, 11345}
    assert procs[11345]["name"] == "./gpu_burn" and procs[11345]["used_bytes"] == 15690 * MIB
    assert all(p["gpu_index"] == 0 for p in procs.values())
    assert c.data["gpus"][0]["memory_used_bytes"] == 19818 * MIB


def test_own_process_memory_is_not_counted_as_taken():
    raw = h100("load")
    others = judge_driver(raw)
    assert others.data["taken_by_others_bytes"] == {0: 19818 * MIB}
    # Were this process gpu_burn (15690 MiB), 4128 MiB (5% of the card) would be taken by others.
    mine = judge_driver(DriverRaw(**{**raw.__dict__, "own_pid": 11345}))
    assert mine.status == "ok" and mine.data["taken_by_others_bytes"] == {0: (19818 - 15690) * MIB}


def test_table_alone_gives_the_same_facts_as_the_csv():
    from_table = read_driver(h100("load", csv=False))
    from_csv = read_driver(h100("load", table=False))
    assert [p["pid"] for p in from_table.processes] == [p["pid"] for p in from_csv.processes]
    assert from_table.gpus[0]["memory_total_bytes"] == from_csv.gpus[0]["memory_total_bytes"]
    assert from_table.cuda_version == "13.1" and from_csv.cuda_version is None  # only the table has it


def test_query_csv_without_header_or_units():
    # The probe's own form (--format=csv,noheader,nounits), values from the H100 capture.
    gpus = parse_query_gpu_csv("0, NVIDIA H100 80GB HBM3, 590.48.01, 81559, 19818, 00000000:00:09.0\n")
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3" and gpus[0]["memory_used_bytes"] == 19818 * MIB
    procs = parse_query_apps_csv("00000000:00:09.0, 11345, ./gpu_burn, 15690\n")
    assert procs == [
        {"pid": 11345, "name": "./gpu_burn", "used_bytes": 15690 * MIB, "bus_id": "00000000:00:09.0"}]
    assert parse_query_apps_csv(fixture("h100_idle_query-compute-apps.csv")) == []


def test_old_table_layout_colab_t4():
    t = parse_smi_table(fixture("jax_env_colab_t4.txt").split("$ nvidia-smi", 1)[1])
    assert (t["driver_version"], t["cuda_version"]) == ("460.32.03", "11.2")
    assert t["gpus"][0]["name"] == "Tesla T4" and t["gpus"][0]["memory_total_bytes"] is None


def test_no_accelerator_is_a_clean_skip():
    c = judge_driver(DriverRaw(nvml_error="NVML bindings not importable"))
    assert c.status == "skip" and "no NVIDIA accelerator found" in c.saw
    assert c.to_dict()["fix"] is None


def test_nvidia_smi_without_driver_fails():
    c = judge_driver(DriverRaw(smi_path="/usr/bin/nvidia-smi", smi_error=NVIDIA_SMI_NO_DRIVER))
    assert c.status == "fail" and "couldn't communicate" in c.saw and "driver" in c.fix


def test_nvidia_smi_no_devices_warns():
    c = judge_driver(DriverRaw(smi_path="/usr/bin/nvidia-smi", smi_error="No devices were found"))
    assert c.status == "warn"


def test_gpu_on_pci_bus_without_tools_fails():
    c = judge_driver(DriverRaw(pci_nvidia_devices=2))
    assert c.status == "fail" and "PCI" in c.saw


def _fake_pynvml() -> types.ModuleType:
    """A stand-in for nvidia-ml-py answering with the H100 capture's load-state values."""
    nv = types.ModuleType("pynvml")
    nv.nvmlInit = lambda: None
    nv.nvmlShutdown = lambda: None
    nv.nvmlSystemGetDriverVersion = lambda: "590.48.01"
    nv.nvmlSystemGetCudaDriverVersion_v2 = lambda: 13010
    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("h", i)
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=H100_TOTAL, used=19818 * MIB)
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=11345, usedGpuMemory=15690 * MIB),
        types.SimpleNamespace(pid=11327, usedGpuMemory=None),
    ]
    nv.nvmlSystemGetProcessName = lambda pid: {11345: b"./gpu_burn", 11327: b"/root/tools/memhog"}[pid]
    return nv


def test_probe_driver_through_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.setattr("capopt.gpu.probes.shutil.which", lambda name: None)
    raw = probe_driver()
    assert raw.nvml is not None and raw.nvml["cuda_driver_version"] == 13010
    c = judge_driver(raw)
    assert c.data["source"] == "nvml" and c.data["cuda_version"] == "13.1"
    assert c.status == "warn"  # 19.4 GiB already taken
    assert {p["pid"] for p in c.data["processes"]} == {11345, 11327}
    json.dumps(c.to_dict())


def test_probe_driver_through_nvidia_smi(monkeypatch, tmp_path):
    """A stand-in nvidia-smi on PATH that prints the recorded H100 outputs."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$1" in\n'
        f'  --query-gpu=*) cat "{FIXTURES}/h100_load_query-gpu.csv" ;;\n'
        f'  --query-compute-apps=*) cat "{FIXTURES}/h100_load_query-compute-apps.csv" ;;\n'
        f'  *) cat "{FIXTURES}/h100_load_nvidia-smi.txt" ;;\n'
        "esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    raw = probe_driver()
    assert raw.smi_path == str(script) and raw.smi_error is None
    facts = read_driver(raw)
    assert facts.source == "nvidia-smi" and facts.cuda_version == "13.1"
    assert facts.gpus[0]["name"] == "NVIDIA H100 80GB HBM3"
    assert len(facts.processes) == 3


# --- jax-backend -----------------------------------------------------------------------------------


def test_cpu_fallback_with_gpu_visible_fails():
    raw, driver = parse_environment_info(fixture("jax_env_cpu_fallback_conda.txt"))
    assert (raw.jax_version, raw.jaxlib_version, raw.backend) == ("0.4.32", "0.4.32", "cpu")
    assert read_driver(driver).cuda_version == "12.6"
    c = judge_jax(raw, driver)
    assert c.status == "fail"
    assert "silent CPU fallback" in c.saw and "CUDA-enabled jaxlib" in c.saw
    assert 'jax[cuda12]' in c.fix  # the driver supports CUDA 12.6
    report = diagnose(driver, raw, None, {}, VERSIONS_OK)
    assert report.exit_code == 1
    json.dumps(report.to_dict())


def test_cpu_fallback_on_a_h100_suggests_cuda13_wheels():
    c = judge_jax(cpu_jax(), h100("idle"))
    assert c.status == "fail" and "NVIDIA H100 80GB HBM3" in c.saw and "jax[cuda13]" in c.fix


def test_cuda_backend_init_error_is_quoted():
    raw = cpu_jax(log_text=fixture("jax_cudnn_outdated_conda.txt"))
    c = judge_jax(raw, h100("idle"))
    assert c.status == "fail" and "Outdated cuDNN installation found." in c.saw
    assert "LD_LIBRARY_PATH" in c.fix


def test_jax_on_gpu_is_ok():
    raw, driver = parse_environment_info(fixture("jax_env_colab_t4.txt"))
    assert raw.backend == "gpu" and raw.devices == ("GpuDevice(id=0, process_index=0)",)
    c = judge_jax(raw, driver)
    assert c.status == "ok" and "GpuDevice" in c.saw


def test_cpu_without_gpu_is_ok():
    c = judge_jax(cpu_jax(), DriverRaw())
    assert c.status == "ok" and "expected" in c.saw


def test_jax_platforms_cpu_with_gpu_warns_and_hidden_devices_fail():
    assert judge_jax(cpu_jax(env={"JAX_PLATFORMS": "cpu"}), h100("idle")).status == "warn"
    c = judge_jax(cpu_jax(env={"CUDA_VISIBLE_DEVICES": ""}), h100("idle"))
    assert c.status == "fail" and "CUDA_VISIBLE_DEVICES" in c.fix


def test_jax_import_error_fails():
    c = judge_jax(JaxRaw(error="ImportError: libcudart.so.12: cannot open shared object file"), DriverRaw())
    assert c.status == "fail"


# --- cuda-versions -----------------------------------------------------------------------------------


def test_ptxas_newer_than_driver_warns():
    raw, driver = parse_environment_info(fixture("jax_env_ptxas_newer_than_driver.txt"))
    assert raw.backend == "gpu" and judge_jax(raw, driver).status == "ok"
    c = judge_cuda_versions(raw, driver)
    assert c.status == "warn"
    assert "12.2" in c.saw and "12.3.107" in c.saw and "parallel compilation" in c.saw
    assert c.data["driver_cuda_version"] == "12.2"


@pytest.mark.parametrize(
    "name, have, built",
    [
        ("jax_cudnn_outdated_conda.txt", "8.9.7", "9.1.0"),
        ("jax_cudnn_older_than_build.txt", "8.6.0", "8.9.6"),
        ("xla_cudnn_runtime_older.txt", "8.5.0", "8.6.0"),
    ],
)
def test_cudnn_mismatch_messages_fail(name, have, built):
    c = judge_cuda_versions(cpu_jax(log_text=fixture(name)), h100("idle"))
    assert c.status == "fail"
    assert have in c.saw and built in c.saw
    assert "cuDNN" in c.fix


def test_jaxlib_built_for_newer_cuda_major_than_driver_fails():
    _, t4 = parse_environment_info(fixture("jax_env_colab_t4.txt"))  # driver supports CUDA 11.2
    raw = JaxRaw(backend="gpu", cuda_versions={"cuda_runtime_build": 12030})
    c = judge_cuda_versions(raw, t4)
    assert c.status == "fail" and "12.3" in c.saw and "11.2" in c.saw


def test_jaxlib_built_for_newer_cuda_minor_warns():
    _, driver = parse_environment_info(fixture("jax_env_ptxas_newer_than_driver.txt"))  # CUDA 12.2
    c = judge_cuda_versions(JaxRaw(backend="gpu", cuda_versions={"cuda_runtime_build": 12060}), driver)
    assert c.status == "warn" and "minor-version compatibility" in c.saw


def test_cuda12_plugin_on_a_cuda11_driver_fails():
    _, t4 = parse_environment_info(fixture("jax_env_colab_t4.txt"))
    c = judge_cuda_versions(cpu_jax(plugins={"jax-cuda12-plugin": "0.4.24"}), t4)
    assert c.status == "fail" and "jax-cuda12-plugin" in c.saw


def test_matching_versions_are_ok():
    raw = JaxRaw(backend="gpu", cuda_versions={"cuda_runtime_build": 12080, "cuda_runtime": 12080,
                                               "cudnn_build": 90800, "cudnn": 90801})
    c = judge_cuda_versions(raw, h100("idle"))
    assert c.status == "ok", c.saw
    assert c.data["jaxlib_cuda_build"] == "12.8" and c.data["cudnn_runtime"] == "9.8.1"


def test_runtime_cudnn_older_than_build_fails():
    raw = JaxRaw(backend="gpu", cuda_versions={"cudnn_build": 90800, "cudnn": 90100})
    assert judge_cuda_versions(raw, h100("idle")).status == "fail"


def test_no_cuda_anywhere_skips():
    assert judge_cuda_versions(cpu_jax(), DriverRaw()).status == "skip"


# --- tiny-step -----------------------------------------------------------------------------------------


def test_step_judge_cases():
    assert judge_step(None).status == "skip"
    recorded = {"bytes_in_use": 76288, "peak_bytes_in_use": 76800,  # memory_stats_gpu_session.txt
                "bytes_limit": 33014415360}
    ok = StepRaw(platform="gpu", device="CudaDevice(id=0)", output_platforms=("gpu",), compile_s=0.3,
                 run_s=0.0004, first_run_s=0.002, memory_stats=recorded)
    c = judge_step(ok, expect_accelerator=True)
    assert c.status == "ok" and "peak" in c.saw and c.data["memory"]["peak_bytes"] == 76800
    moved = StepRaw(platform="gpu", device="CudaDevice(id=0)", output_platforms=("cpu",))
    assert judge_step(moved).status == "fail"
    on_cpu = StepRaw(platform="cpu", device="CpuDevice(id=0)", output_platforms=("cpu",),
                     compile_s=0.1, run_s=0.001)
    assert judge_step(on_cpu).status == "ok"
    assert judge_step(on_cpu, expect_accelerator=True).status == "fail"
    oom = judge_step(StepRaw(
        error="XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
    assert oom.status == "fail" and "memory" in oom.fix


# --- memory-settings -------------------------------------------------------------------------------------


def test_memory_settings_defaults_explain_preallocation():
    c = judge_memory_settings({})
    assert c.status == "ok"
    assert "75%" in c.saw and "nvidia-smi" in c.saw
    assert set(c.data) == {"XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                           "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR", "TF_GPU_ALLOCATOR",
                           "XLA_FLAGS"}


def test_memory_settings_values():
    c = judge_memory_settings({"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                               "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert c.status == "ok" and "high-water mark" in c.saw
    assert c.data["XLA_FLAGS"]["flags"][0]["note"].startswith("splits the CPU")
    half = judge_memory_settings({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})
    assert half.saw.startswith("JAX preallocates 50%")
    for env in ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.99"}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"},
                {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, {"XLA_PYTHON_CLIENT_PREALLOCATE": "maybe"}):
        assert judge_memory_settings(env).status == "warn", env
    tf = judge_memory_settings({"TF_GPU_ALLOCATOR": "cuda_malloc_async"})
    assert "TensorFlow" in tf.data["TF_GPU_ALLOCATOR"]["meaning"]


# --- versions and the report type ------------------------------------------------------------------------


def test_versions_judge():
    assert judge_versions(VERSIONS_OK).status == "ok"
    bad = VersionsRaw(python="3.12.3", packages={**VERSIONS_OK.packages, "jax-cuda12-plugin": "0.10.1"})
    c = judge_versions(bad)
    assert c.status == "warn" and "does not match jaxlib" in c.saw
    no_flax = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": None, "optax": "0.2.8"}
    assert judge_versions(VersionsRaw(python="3.11", packages=no_flax)).status == "warn"
    # jax 0.3.17 with jaxlib 0.3.15 (the Colab report) is a supported pairing
    colab = {"jax": "0.3.17", "jaxlib": "0.3.15", "flax": "0.6", "optax": "0.1"}
    assert judge_versions(VersionsRaw(python="3.7", packages=colab)).status == "ok"


def test_check_rejects_unknown_status():
    with pytest.raises(ValueError, match="status"):
        Check("x", "bad", "saw")  # type: ignore[arg-type]


def test_report_from_recordings_renders_fixes():
    raw, driver = parse_environment_info(fixture("jax_env_cpu_fallback_conda.txt"))
    report = diagnose(driver, raw, None, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, VERSIONS_OK)
    text = report.render()
    assert "FAIL" in text and "WARN" in text and "fix:" in text
    s = report.to_dict()["summary"]
    assert (s["fail"], s["exit_code"], s["backend"]) == (1, 1, "cpu")


def test_the_compile_only_plugin_is_found_and_named_by_the_judge():
    """After `capopt setup xla-gpu` the doctor names the plugin it installed (kept off
    sys.path) instead of saying that there is none."""
    from capopt.gpu.probes import probe_jax
    from capopt.validation.plugin import plugin_path
    raw = probe_jax()
    assert raw.compile_only_plugin == plugin_path()
    if raw.compile_only_plugin is None:
        pytest.skip("the compile-only CUDA plugin is not installed (capopt setup xla-gpu)")
    check = judge_cuda_versions(raw, DriverRaw())
    if check.status == "skip":                   # no GPU and no CUDA stack: the usual CI case
        assert raw.compile_only_plugin in check.saw
