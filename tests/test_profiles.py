"""Runtime profiles: the schema, its defaults, and clear errors for bad coefficients."""

from __future__ import annotations

import math

import pytest

from capopt._errors import CapoptError
from capopt._runtime import (NF4_BYTES_PER_WEIGHT, SCHEMA, get_profile, list_profiles,
                             nf4_bytes_per_weight)


def test_every_builtin_profile_sets_only_schema_keys_and_gets_every_key():
    assert set(list_profiles()) == {"deepspeed", "hf", "llm-foundry", "maxtext", "megatron",
                                    "pytorch", "pytorch-eager", "torchtitan", "torchtune",
                                    "xla-cpu", "xla-gpu"}
    for name in list_profiles():
        d = get_profile(name).coeff_dict()
        assert set(d) == set(SCHEMA), name
        assert all(math.isfinite(v) and v >= 0 for v in d.values()), name


def test_a_profile_takes_its_base_profiles_coefficients_and_overrides_its_own():
    eager, base = get_profile("pytorch-eager"), get_profile("pytorch")
    assert eager.coeff("gemm_eff_max") == base.coeff("gemm_eff_max")
    assert eager.coeff("autocast_casts") == 1.0 != base.coeff("autocast_casts")


@pytest.mark.parametrize("value", ['["adamw", "rmsprop"]', "[]", '"adamw"'])
def test_a_profile_optimizer_list_names_known_optimizers(tmp_path, value):
    """``optimizers``: the training.optimizer values the runtime runs, a non-empty list of
    capopt's; anything else is an error naming the file and the key."""
    p = tmp_path / "prof.toml"
    p.write_text(f'name = "p"\nbase = "xla-gpu"\noptimizers = {value}\n\n[coeffs]\n')
    with pytest.raises(CapoptError) as e:
        get_profile(str(p))
    assert e.value.field == "optimizers" and str(p) in str(e.value)


def test_an_unknown_base_profile_is_named(tmp_path):
    p = tmp_path / "prof.toml"
    p.write_text('name = "p"\nbase = "nope"\n\n[coeffs]\n\n[precision."fp32"]\n'
                 'param_bytes = 4.0\ngrad_bytes = 4.0\nmaster_bytes = 0.0\nact_bytes = 4.0\n'
                 'weight_copy_bytes = 0.0\nstate_bytes = 4.0\nmatmul_dtype = "tf32"\n')
    with pytest.raises(CapoptError) as e:
        get_profile(str(p))
    assert "nope" in str(e.value) and "base" in str(e.value)


def test_a_profile_without_precision_tables_takes_its_bases(tmp_path):
    """``hf`` has no precision tables of its own: the base's (pytorch-eager) byte widths. A
    profile with neither tables nor a base is refused, naming the missing table."""
    assert get_profile("hf").precisions == get_profile("pytorch-eager").precisions
    p = tmp_path / "prof.toml"
    p.write_text('name = "p"\nbase = "torchtitan"\n\n[coeffs]\nresid_saved = 3.0\n')
    prof = get_profile(str(p))
    assert prof.precisions == get_profile("torchtitan").precisions
    assert prof.coeff("resid_saved") == 3.0
    p.write_text('name = "p"\n\n[coeffs]\n')
    with pytest.raises(CapoptError, match="precision"):
        get_profile(str(p))


def _write(tmp_path, coeffs: str):
    p = tmp_path / "prof.toml"
    p.write_text(f'name = "p"\nsource = "test"\n\n[coeffs]\n{coeffs}\n\n'
                 '[precision."fp32"]\nparam_bytes = 4.0\ngrad_bytes = 4.0\nmaster_bytes = 0.0\n'
                 'act_bytes = 4.0\nweight_copy_bytes = 0.0\nstate_bytes = 4.0\n'
                 'matmul_dtype = "tf32"\n')
    return str(p)


@pytest.mark.parametrize("line, words", [
    ("bogus_coeff = 1.0", ["bogus_coeff", "unknown"]),
    ("resid_saved = -1.0", ["coeffs.resid_saved", ">= 0"]),
    ("resid_saved = nan", ["coeffs.resid_saved", "finite"]),
    ("resid_saved = inf", ["coeffs.resid_saved", "finite"]),
    ('resid_saved = "x"', ["coeffs.resid_saved", "number"]),
])
def test_bad_coefficient_names_the_file_and_the_key(tmp_path, line, words):
    path = _write(tmp_path, line)
    with pytest.raises(CapoptError) as e:
        get_profile(path)
    msg = str(e.value)
    assert "prof.toml" in msg and all(w in msg for w in words), msg


def test_selective_policy_shares_above_one_are_an_error(tmp_path):
    """dots and torchtitan's per-op policy are shares of one selective policy (Korthikanti's
    the rest): a profile giving both whole names the key, from a file or `with_coeffs`."""
    path = _write(tmp_path, "selective_saves_dots = 1.0\nselective_saves_ops = 0.5")
    with pytest.raises(CapoptError) as e:
        get_profile(path)
    assert "prof.toml" in str(e.value) and "coeffs.selective_saves_ops" in str(e.value)
    with pytest.raises(CapoptError):
        get_profile("xla-gpu").with_coeffs(selective_saves_ops=1.0)   # (xla-gpu: dots = 1)
    assert get_profile("torchtitan").coeff("selective_saves_ops") == 1.0


def test_missing_coefficients_take_the_schema_default(tmp_path):
    prof = get_profile(_write(tmp_path, "resid_saved = 5.0"))
    assert prof.coeff("resid_saved") == 5.0
    assert prof.coeff("logits_fp32_copies") == SCHEMA["logits_fp32_copies"].default


def test_nf4_bytes_are_computed_from_the_layout():
    # 4-bit codes, an 8-bit absmax per 64 weights, a float32 scale per 256 absmax codes
    assert NF4_BYTES_PER_WEIGHT == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))
    assert round(NF4_BYTES_PER_WEIGHT, 4) == 0.5159
    # without double quantisation: a float32 absmax per 64 weights
    assert nf4_bytes_per_weight(False) == 0.5 + 4 / 64 == 0.5625
    assert nf4_bytes_per_weight(True) == NF4_BYTES_PER_WEIGHT


def test_with_coeffs_checks_like_a_file():
    prof = get_profile("xla-gpu")
    with pytest.raises(CapoptError):
        prof.with_coeffs(resid_saved=-2.0)
    with pytest.raises(CapoptError):
        prof.with_coeffs(not_a_coeff=1.0)
    assert prof.with_coeffs(resid_saved=6.0).coeff("resid_saved") == 6.0


def test_a_share_coefficient_above_one_names_the_key(tmp_path):
    """Shares (a mixture's weight, a 0/1 rule) are at most 1: 3 would make a term negative."""
    with pytest.raises(CapoptError) as e:
        get_profile(_write(tmp_path, "fsdp_gathers_compute_dtype = 3.0"))
    assert "coeffs.fsdp_gathers_compute_dtype" in str(e.value) and "between 0 and 1" in str(
        e.value)
    with pytest.raises(CapoptError):
        get_profile("pytorch").with_coeffs(autocast_casts=1.5)


def test_llm_foundry_refuses_pure_bf16_naming_its_precisions():
    # Composer trains fp32, amp_fp16, amp_bf16 or amp_fp8, every one with float32 master
    # parameters: the profile has no pure-bf16 table, and asking for one names what it has
    with pytest.raises(CapoptError) as e:
        get_profile("llm-foundry").precision("bf16")
    msg = str(e.value)
    assert "training.precision" in msg and "bf16-mixed" in msg and "fp8-mixed" in msg
