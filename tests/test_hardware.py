"""The hardware catalog: every entry loads and cites a source, units convert, names resolve,
bad input names the file and the field, and a few datasheet figures are spot-checked."""

from __future__ import annotations

import math
import re
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from capopt import CapoptError
from capopt._hardware import (DTYPES, GB, GiB, Hardware, get_hardware, list_hardware,
                              load_catalog, load_hardware_file)
from capopt.validation.targets import xla_gpu_device_info

EXPECTED = {
    "v100-sxm-16gb", "v100-sxm-32gb", "t4-pcie-16gb", "a10g-24gb", "l4-pcie-24gb",
    "l40s-pcie-48gb", "a100-sxm-40gb", "a100-sxm-80gb", "a100-pcie-40gb", "a100-pcie-80gb",
    "h100-sxm-80gb", "h100-pcie-80gb", "h100-sxm-96gb", "h100-nvl-94gb", "h200-sxm-141gb", "b200-sxm-192gb",
    "rtx-3090-24gb", "rtx-4090-24gb", "rtx-5090-32gb", "rtx-a6000-48gb", "rtx-6000-ada-48gb",
    "mi300x-oam-192gb", "tpu-v4-32gb", "tpu-v5e-16gb", "tpu-v5p-95gb",
    "h800-sxm-80gb", "a800-sxm-80gb", "h20-96gb", "gb200-nvl72-186gb", "mi250x-oam-128gb",
    "mi325x-oam-256gb", "tpu-v6e-32gb",
}

# The catalog holds decimal figures (989.4 TFLOP/s) scaled by powers of ten; the only error in
# comparing them with the same figure written here is the decimal-to-binary rounding of each.
REL = 1e-12


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL)


@pytest.fixture(scope="module")
def catalog() -> dict[str, Hardware]:
    return load_catalog()


@pytest.fixture(scope="module")
def raw() -> dict:
    ref = resources.files("capopt") / "data" / "hardware.toml"
    return tomllib.loads(ref.read_text(encoding="utf-8"))


# --- every entry -----------------------------------------------------------------------------

def test_catalog_has_the_expected_entries(catalog):
    assert set(catalog) == EXPECTED
    assert list_hardware() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_entry_loads_with_sane_values(catalog, name):
    h = catalog[name]
    assert isinstance(h, Hardware) and h.name == name
    assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name)
    assert h.memory_bytes > 0 and h.mem_bw > 0
    assert h.intra_node_bw > 0 and h.inter_node_bw > 0 and h.host_bw > 0
    assert h.per_node >= 1 and h.peak_flops
    assert all(d in DTYPES for d, _ in h.peak_flops)
    # Bandwidths in bytes/s: between 1 GB/s (a shared NIC) and 10 TB/s.
    for bw in (h.intra_node_bw, h.inter_node_bw, h.host_bw):
        assert 0.5e9 <= bw <= 1e12
    assert 1e11 <= h.mem_bw <= 1e13
    # Dense peaks between 1 and 10,000 TFLOP/s.
    assert all(1e12 <= f <= 1e16 for _, f in h.peak_flops)
    assert h.kind in ("gpu", "tpu")
    if h.kind == "gpu":
        assert h.compute_capability
    assert get_hardware(name) is h


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_entry_has_a_source(catalog, raw, name):
    urls = raw[name]["source"]
    assert urls and all(u.startswith("https://") for u in urls)
    assert catalog[name].source == "; ".join(urls)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_memory_in_name_is_the_vendor_figure(catalog, raw, name):
    """The trailing <n>gb is the vendor's figure, entered in GiB or GB as the entry says."""
    n = int(re.search(r"(\d+)gb$", name).group(1))
    entry = raw[name]
    assert ("memory_gib" in entry) != ("memory_gb" in entry)
    if "memory_gib" in entry:
        assert entry["memory_gib"] == n and catalog[name].memory_bytes == n * GiB
    else:
        assert entry["memory_gb"] == n and catalog[name].memory_bytes == n * GB


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_peaks_are_ordered(catalog, name):
    """Lower precision is never slower: fp8 >= bf16 >= tf32 >= fp32, int8 >= bf16, where present."""
    p = catalog[name].peaks
    chain = [p[d] for d in ("fp32", "tf32", "bf16", "fp8") if d in p]
    assert chain == sorted(chain)
    if "fp16" in p and "fp32" in p:
        assert p["fp16"] >= p["fp32"]
    if "int8" in p and "bf16" in p:
        assert p["int8"] >= p["bf16"]


# --- names and aliases -----------------------------------------------------------------------

@pytest.mark.parametrize("alias, name", [
    ("h100", "h100-sxm-80gb"), ("a100", "a100-sxm-80gb"), ("4090", "rtx-4090-24gb"),
    ("H100", "h100-sxm-80gb"), ("  h200 ", "h200-sxm-141gb"), ("b200", "b200-sxm-192gb"),
    ("mi300x", "mi300x-oam-192gb"), ("v5e", "tpu-v5e-16gb"), ("A10G", "a10g-24gb"),
    ("H100-SXM-80GB", "h100-sxm-80gb"),
])
def test_aliases_resolve(alias, name):
    assert get_hardware(alias).name == name


def test_every_alias_resolves_to_its_entry_and_is_unique(catalog):
    seen = set(catalog)
    for h in catalog.values():
        for a in h.aliases:
            assert a not in seen, a
            seen.add(a)
            assert get_hardware(a) is h


def test_unknown_gpu_lists_the_allowed_names():
    with pytest.raises(CapoptError) as info:
        get_hardware("h1000")
    err = info.value
    assert err.field == "hardware.gpu"
    assert err.message == "unknown GPU 'h1000'"
    assert set(err.allowed.split(", ")) == EXPECTED
    assert "hardware.gpu" in str(err) and "h100-sxm-80gb" in str(err)


def test_load_catalog_returns_a_fresh_dict():
    a = load_catalog()
    a.pop("h100-sxm-80gb")
    assert "h100-sxm-80gb" in load_catalog()


def test_hardware_passes_through():
    h = get_hardware("h100")
    assert get_hardware(h) is h


# --- files -----------------------------------------------------------------------------------

GOOD = """
[my-gpu-24gb]
vendor = "nvidia"
memory_gb = 24
mem_bw_tb_s = 1.5
peak_tflops = { fp32 = 40, bf16 = 160 }
intra_node_gb_s = 32
inter_node_gb_s = 3.125
host_gb_s = 32
per_node = 4
l2_mib = 64
compute_capability = "8.9"
price_usd_per_hour = 0.5
price_source = "our invoice"
source = ["https://example.com/datasheet.pdf"]
"""


def write(tmp_path: Path, text: str, name: str = "gpu.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_a_file_loads_and_converts_units(tmp_path):
    p = write(tmp_path, GOOD)
    for arg in (p, str(p)):
        h = get_hardware(arg)
        assert h.name == "my-gpu-24gb"
        assert h.memory_bytes == 24 * 10**9
        assert close(h.mem_bw, 1.5e12) and close(h.peak("bf16"), 160e12)
        assert close(h.intra_node_bw, 32e9) and close(h.inter_node_bw, 3.125e9)
        assert h.per_node == 4 and h.l2_bytes == 64 * 2**20
        assert h.price_per_hour == 0.5 and h.kind == "gpu"


@pytest.mark.parametrize("text, field", [
    ("[x-1gb\nmemory_gib = 1", None),                                        # not TOML
    (GOOD.replace("host_gb_s = 32", "host_gbps = 32"), "my-gpu-24gb.host_gbps"),
    (GOOD.replace("host_gb_s = 32\n", ""), "my-gpu-24gb.host_gb_s"),
    (GOOD.replace("memory_gb = 24", "memory_gb = 24\nmemory_gib = 24"), "my-gpu-24gb.memory_gib"),
    (GOOD.replace("memory_gb = 24", "memory_gb = -24"), "my-gpu-24gb.memory_gb"),
    (GOOD.replace("bf16 = 160", "bf17 = 160"), "my-gpu-24gb.peak_tflops.bf17"),
    (GOOD.replace("bf16 = 160", 'bf16 = "fast"'), "my-gpu-24gb.peak_tflops.bf16"),
    (GOOD.replace("per_node = 4", "per_node = 2.5"), "my-gpu-24gb.per_node"),
    (GOOD.replace('vendor = "nvidia"', 'vendor = "acme"'), "my-gpu-24gb.vendor"),
    (GOOD.replace('"https://example.com/datasheet.pdf"', '"the internet"'), "my-gpu-24gb.source"),
    (GOOD.replace('price_source = "our invoice"\n', ""), "my-gpu-24gb.price_source"),
    (GOOD.replace('"8.9"', '"sm89"'), "my-gpu-24gb.compute_capability"),
    (GOOD + "sustained_tensor_share = 1.2\n", "my-gpu-24gb.sustained_tensor_share"),
    (GOOD + "sustained_tensor_share = 0\n", "my-gpu-24gb.sustained_tensor_share"),
    (GOOD + 'sustained_tensor_share = "most"\n', "my-gpu-24gb.sustained_tensor_share"),
    (GOOD.replace("[my-gpu-24gb]", "[\"My GPU\"]"), "My GPU"),
    (GOOD + "\n[other-gpu-8gb]\nmemory_gb = 8\n", None),                     # two entries
    ("memory_gb = 8\n", None),                                               # no table
])
def test_a_malformed_file_names_the_file_and_field(tmp_path, text, field):
    p = write(tmp_path, text)
    with pytest.raises(CapoptError) as info:
        get_hardware(str(p))
    err = info.value
    assert err.file == str(p) and str(p) in str(err)
    if field is not None:
        assert err.field == field and field in str(err)


def test_a_sustained_tensor_share_loads_and_defaults_to_the_datasheet(tmp_path):
    assert get_hardware(str(write(tmp_path, GOOD))).sustained_tensor_share == 1.0
    p = write(tmp_path, GOOD + "sustained_tensor_share = 0.5\n", "limited.toml")
    assert get_hardware(str(p)).sustained_tensor_share == 0.5
    # the parts with a published kernel benchmark under their power limit, and none other
    limited = {h.name for h in load_catalog().values() if h.sustained_tensor_share != 1.0}
    assert limited == {"h100-sxm-96gb"}


def test_a_missing_file_is_named(tmp_path):
    p = tmp_path / "nope.toml"
    with pytest.raises(CapoptError) as info:
        get_hardware(str(p))
    assert info.value.file == str(p)
    with pytest.raises(CapoptError):
        load_hardware_file(p)


# --- datasheet spot checks -------------------------------------------------------------------

def test_h100_sxm_datasheet(catalog):
    h = catalog["h100-sxm-80gb"]
    assert close(h.peak("bf16"), 989.4e12)             # 1978.9 with sparsity, halved
    assert close(h.peak("fp8"), 1978.9e12)
    assert close(h.mem_bw, 3.35e12)
    assert close(h.intra_node_bw, 450e9)               # NVLink 4: 900 GB/s both ways
    assert close(h.inter_node_bw, 50e9)                # 400 Gb/s NDR per GPU
    assert h.memory_bytes == 80 * GiB and h.per_node == 8 and h.power_w == 700


def test_a100_sxm_datasheet(catalog):
    for name in ("a100-sxm-40gb", "a100-sxm-80gb"):
        assert close(catalog[name].peak("bf16"), 312e12)
        assert close(catalog[name].peak("tf32"), 156e12)
    assert close(catalog["a100-sxm-80gb"].mem_bw, 2.039e12)
    assert close(catalog["a100-sxm-40gb"].mem_bw, 1.555e12)
    assert close(catalog["a100-sxm-80gb"].inter_node_bw, 25e9)   # 200 Gb/s HDR per GPU


def test_h200_datasheet(catalog):
    h = catalog["h200-sxm-141gb"]
    assert close(h.mem_bw, 4.8e12)
    assert h.memory_bytes == 141 * GiB                 # XLA reads 151397597184 B = 141.0 GiB
    assert h.peaks == catalog["h100-sxm-80gb"].peaks   # same GH100 compute


def test_other_spot_checks(catalog):
    assert close(catalog["mi300x-oam-192gb"].peak("bf16"), 1307.4e12)
    assert close(catalog["tpu-v5p-95gb"].peak("bf16"), 459e12)
    assert close(catalog["tpu-v4-32gb"].mem_bw, 1.2e12)
    assert close(catalog["l4-pcie-24gb"].peak("fp8"), 242.5e12)   # 485 with sparsity, halved
    assert catalog["b200-sxm-192gb"].memory_bytes == 192 * 10**9


# --- methods ---------------------------------------------------------------------------------

def test_peak_without_the_unit_raises():
    with pytest.raises(CapoptError) as info:
        get_hardware("v100").peak("bf16")
    assert info.value.field == "hardware.gpu" and "fp32" in info.value.allowed


@pytest.mark.parametrize("name, dtype, runs_as", [
    ("v100-sxm-16gb", "tf32", "fp32"),       # float32 matmuls on CUDA cores before Ampere
    ("t4-pcie-16gb", "bf16", "fp32"),        # no bf16 tensor cores
    ("a100-sxm-80gb", "fp8", "bf16"),        # fp8 upcast where there is no fp8 unit
    ("tpu-v5e-16gb", "fp32", "bf16"),        # JAX's default TPU matmul precision
    ("h100-sxm-80gb", "fp8", "fp8"),
])
def test_effective_peak_falls_back(name, dtype, runs_as):
    h = get_hardware(name)
    assert h.effective_peak(dtype) == h.peak(runs_as)


def test_effective_peak_without_a_fallback_raises():
    with pytest.raises(CapoptError):
        get_hardware("a100").effective_peak("fp4")
    with pytest.raises(CapoptError):
        get_hardware("v100").effective_peak("int8")


def test_describe_is_one_line(catalog):
    for h in catalog.values():
        d = h.describe()
        assert "\n" not in d and d.startswith(h.name + ": ") and "GiB" in d
    assert get_hardware("h100").describe() == (
        "h100-sxm-80gb: 80 GiB, 989 TFLOP/s bf16, 3.35 TB/s memory, 450/50 GB/s "
        "intra/inter-node, 8 per node")


def test_xla_device_info_matches_xlas_own_h100_spec():
    """Values from xla/backends/gpu/target_config/specs/h100_sxm.txtpb."""
    info = xla_gpu_device_info(get_hardware("h100"))
    assert info["core_count"] == 132
    assert info["clock_rate_ghz"] == pytest.approx(1.98)
    assert info["l2_cache_size"] == 52428800
    assert info["shared_memory_per_core"] == 233472
    assert info["shared_memory_per_block_optin"] == 232448
    assert info["threads_per_core_limit"] == 2048 and info["fpus_per_core"] == 128
    assert info["cuda_compute_capability"] == {"major": 9, "minor": 0}
    assert info["memory_bandwidth"] == 3_350_000_000_000
    assert info["device_memory_size"] == 80 * GiB


def test_xla_device_info_for_every_gpu(catalog):
    for h in catalog.values():
        if h.kind != "gpu":
            with pytest.raises(CapoptError):
                xla_gpu_device_info(h)
            continue
        info = xla_gpu_device_info(h)
        assert info["device_memory_size"] == h.memory_bytes
        cap = info.get("cuda_compute_capability") or info.get("rocm_compute_capability")
        assert cap, h.name
        assert "threads_per_warp" in info and "shared_memory_per_core" in info, h.name


def test_hardware_checks_its_fields():
    h = get_hardware("h100")
    kw = dict(name="x", memory_bytes=h.memory_bytes, peak_flops=h.peak_flops, mem_bw=h.mem_bw,
              intra_node_bw=h.intra_node_bw, inter_node_bw=h.inter_node_bw, host_bw=h.host_bw)
    assert Hardware(**kw).per_node == 8
    for bad in (dict(memory_bytes=0), dict(mem_bw=-1.0), dict(peak_flops=(("fp64", 1e12),)),
                dict(per_node=0), dict(kind="fpga")):
        with pytest.raises(CapoptError):
            Hardware(**{**kw, **bad})
