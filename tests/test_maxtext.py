"""The ``maxtext`` runtime: MaxText's pre-training step (AI-Hypercomputer/maxtext e591f30c) as
capopt prices it and ``--emit maxtext`` launches it. The xla-gpu profile's rules (MaxText's
step is a JAX program compiled by the same XLA) with what MaxText runs differently: remat
selective is its ``minimal`` policy (the MLP's down projection saved too), every block under
one policy (no remat none, no fraction), hybrid sharding over its data and fsdp axes; and
what it does not run refused: ZeRO-1/2, Megatron sequence parallelism, fp16-mixed, LoRA, and
optimizers other than adamw, adam and sgd."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import capopt
from capopt._errors import CapoptError
from capopt._runtime import _parse, get_profile
from capopt._specs import Config
from capopt._validity import config_problems
from capopt.cli import main
from capopt.cost import estimate
from capopt.report.launch import emit
from conftest import llama_like, make_scenario, runtime_scenario_file

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("loss", "top", "rebuild", "bottom", "update", "forward", "regather")


def _sc(runtime="maxtext", **kw):
    kw = {"precision": "bf16-mixed", "count": 8, "global_batch": 16, "seq_len": 1024, **kw}
    return make_scenario(kw.pop("model", llama_like(hidden=1024, heads=8, kv=2)),
                         runtime=runtime, **kw)


def _scenario_file(tmp_path, training: str, config: str = "") -> str:
    return runtime_scenario_file(tmp_path, "maxtext", training, config)


def test_the_profile_is_an_xla_step_built_on_xla_gpu():
    prof = get_profile("maxtext")
    assert prof.lineage == ("xla-gpu",) and prof.xla_step
    assert not get_profile("torchtune").xla_step and get_profile("xla-gpu").xla_step
    assert prof.precision_names == ("fp32", "bf16-mixed", "bf16", "fp8-mixed")
    assert prof.optimizers == ("adamw", "adam", "sgd")
    # what differs from the base: the coefficients the profile names, nothing else
    base, own = get_profile("xla-gpu").coeff_dict(), prof.coeff_dict()
    changed = {k for k in own if own[k] != base[k]}
    assert changed == {"selective_saves_down", "embed_grad_early",
                       "tied_head_grad_own", "remat_policy_every_block", "hybrid_shard",
                       "fsdp_or_replicated_only", "megatron_sequence_parallel",
                       "lora_training", "logits_fp32_copies", "scan_grad_stacks",
                       "scan_grad_zero3_copies", "grads_compute_dtype"}
    # written back and read again, a profile keeps its base and its optimizers
    again = _parse(tomllib.loads(prof.to_toml()), "x.toml")
    assert again.lineage == ("xla-gpu",) and again.optimizers == prof.optimizers


@pytest.mark.parametrize("training, field, allowed", [
    ('precision = "fp16-mixed"', "training.precision", "fp32, bf16-mixed, bf16, fp8-mixed"),
    ('optimizer = "lion"', "training.optimizer", "adamw, adam, sgd"),
    ('optimizer = "adamw-8bit"', "training.optimizer", "adamw, adam, sgd"),
    ("lora = { rank = 16 }", "training.lora", "none"),
    ('loss = "fused"', "training.loss", "float32"),
])
def test_what_its_step_does_not_run_exits_2_naming_the_field(tmp_path, capsys, training, field,
                                                             allowed):
    """No loss scaling (fp16-mixed), opt_type adamw / adam_pax / sgd / muon only, no LoRA in
    the pre-training step, its cross-entropy over whole logits: one line each,
    naming the field and what is allowed."""
    assert main(["plan", _scenario_file(tmp_path, training), "--set", "micro_batch=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and allowed in err[0], err


@pytest.mark.parametrize("knob, value, words", [
    ("zero_stage", "1", "fully shards (ZeRO-3)"), ("zero_stage", "2", "fully shards (ZeRO-3)"),
    ("remat", '"none"', "one policy"), ("remat", "0.5", "one policy"),
    ("sequence_parallel", "true", "Megatron sequence parallelism")])
def test_layouts_it_does_not_run_are_refused_when_named(tmp_path, capsys, knob, value, words):
    """ZeRO-1 (shard_optimizer_over_data's bfloat16 copies are not priced) and ZeRO-2 (no
    gradient-only sharding), remat none (its none recomputes the whole block) or a fraction
    (one policy for every block), Megatron's sequence parallelism: exit 2 naming the knob."""
    assert main(["plan", _scenario_file(tmp_path, "", f"{knob} = {value}"),
                 "--set", "micro_batch=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config.{knob}" in err[0] and "maxtext" in err[0], err
    assert words in err[0], err


def test_searched_knobs_are_narrowed_to_what_maxtext_runs():
    sc = _sc()
    assert sc.knob("zero_stage").values == (0, 3)
    assert sc.knob("remat").values == ("selective", "full")
    assert sc.knob("sequence_parallel").values == (False,)
    res = capopt.optimize(sc, method="exhaustive", top_k=5, remedies=False)
    assert res.status == "ok"
    for c in res.candidates:
        assert c.config.zero_stage in (0, 3) and c.config.remat in ("selective", "full")
        assert not c.config.sequence_parallel


def test_selective_keeps_the_down_projection_and_nothing_else_changes():
    """Against the same profile with the plain step's selective policy (xla-gpu's
    dots_with_no_batch_dims_saveable): remat selective (MaxText's minimal) keeps one more
    h-wide tensor a token a block, the MLP's down projection output, in the compute dtype;
    remat full, and every byte that is not an activation, are unchanged."""
    mt = _sc()
    xla = mt.replace(runtime=mt.runtime.with_coeffs(selective_saves_down=0.0))
    cfg = Config(micro_batch=2, grad_accum=1, dp=8, zero_stage=3, remat="selective")
    a, b = estimate(cfg, mt).memory, estimate(cfg, xla).memory
    m = mt.model
    tokens = cfg.micro_batch * mt.workload.seq_len
    down = tokens * m.hidden_size * 2.0 * m.num_hidden_layers          # bf16, every block
    got = float(a["activations_bytes"]) - float(b["activations_bytes"])
    # (at the peak, a block's backward, that block's saved set has given way to its rebuild,
    # which may hold it again: between L - 1 and L + 1 blocks' worth)
    L = m.num_hidden_layers
    assert down * (L - 1) / L * (1 - 1e-6) <= got <= down * (L + 1) / L * (1 + 1e-6)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert float(a[key]) == float(b[key])
    full = cfg.replace(remat="full")
    assert float(estimate(full, mt).memory["total_bytes"]) == pytest.approx(
        float(estimate(full, xla).memory["total_bytes"]), rel=1e-6)


@pytest.mark.parametrize("precision, width", [("bf16-mixed", 2), ("fp32", 4)])
def test_its_loss_holds_one_logits_buffer_in_the_compute_dtype(precision, width):
    """MaxText's cross-entropy (a custom_vjp on the float32 cast) compiles to reductions and a
    gradient fused over the logits: at the loss one logits-sized buffer in the compute dtype
    (the logits, then their gradient in place), where the plain step holds a float32 one
    beside it (xla-gpu's logits_fp32_copies)."""
    m = llama_like(hidden=256, heads=4, kv=4, vocab=32768)
    mt = _sc(model=m, count=1, global_batch=4, precision=precision)
    xla = _sc("xla-gpu", model=m, count=1, global_batch=4, precision=precision)
    cfg = Config(micro_batch=4, grad_accum=1, dp=1, remat="full")
    logits = 4 * mt.workload.seq_len * m.vocab_size
    a, b = estimate(cfg, mt).memory, estimate(cfg, xla).memory
    assert float(a["logits_bytes"]) == pytest.approx(logits * width, rel=1e-6)
    assert float(b["logits_bytes"]) == pytest.approx(logits * (width + 4), rel=1e-6)


@pytest.mark.parametrize("count, zero, stacks", [(1, 0, 1), (2, 3, 2)])
def test_its_layer_scan_holds_every_block_gradient_through_the_backward(count, zero, stacks):
    """MaxText scans its blocks: the backward scan carries every block's gradient (a stack,
    two under ZeRO-3: the shard's transposed copy), clipped or not; the plain step, unclipped,
    applies SGD's update as each gradient is produced. At a backward phase the gradients held
    are at least the stacks: layers x a block's parameters x 4 bytes (split dp ways under
    ZeRO-3)."""
    m = llama_like(layers=4, hidden=1024, heads=8, kv=8, vocab=1024)
    mt = _sc(model=m, count=count, global_batch=2 * count, optimizer="sgd", grad_clip=False)
    cfg = Config(micro_batch=2, grad_accum=1, dp=count, zero_stage=zero, remat="selective")
    mem = estimate(cfg, mt).memory
    block = sum(t.elements for t in __import__("capopt._inventory", fromlist=["x"]).inventory(m)
                if t.where == "block")
    assert PHASES[int(mem["peak_phase"])] in ("top", "rebuild", "bottom")
    assert float(mem["grads_bytes"]) >= stacks * block * 4 / count * (1 - 1e-6)
    xla = estimate(cfg, _sc("xla-gpu", model=m, count=count, global_batch=2 * count,
                            optimizer="sgd", grad_clip=False)).memory
    assert float(xla["grads_bytes"]) < block * 4 / count


def test_hybrid_sharding_runs_where_xla_gpu_refuses_it():
    """dcn_data x ici_fsdp: the state over the FSDP group only, its gradient all-reduced
    across the replicas. xla-gpu (a plain step over one mesh axis) refuses dp_replicate."""
    mt, xla = _sc(count=16), _sc("xla-gpu", count=16)
    hsdp = Config(micro_batch=1, grad_accum=1, dp=16, zero_stage=3, dp_replicate=2,
                  remat="full")
    assert config_problems(hsdp, mt) == []
    assert any(f == "config.dp_replicate" for f, _ in config_problems(hsdp, xla))
    flat = estimate(hsdp.replace(dp_replicate=1), mt)
    two = estimate(hsdp, mt)
    # the state split over 8 ranks, not 16: twice the optimizer bytes a device
    assert float(two.memory["optimizer_bytes"]) == pytest.approx(
        2 * float(flat.memory["optimizer_bytes"]), rel=1e-6)


def test_emit_writes_hybrid_sharding_as_its_data_and_fsdp_axes():
    sc = _sc(count=16)
    cfg = Config(micro_batch=1, grad_accum=1, dp=16, zero_stage=3, dp_replicate=2,
                 remat="selective")
    lines = [ln for ln in emit("maxtext", cfg, sc).splitlines() if not ln.startswith("#")]
    d = dict(ln.split("=", 1) for ln in lines)
    # two nodes of eight: the replicas across them, the FSDP group inside one
    assert (d["ici_fsdp_parallelism"], d["dcn_fsdp_parallelism"]) == ("8", "1")
    assert (d["ici_data_parallelism"], d["dcn_data_parallelism"]) == ("1", "2")
    assert d["remat_policy"] == "minimal" and d["shard_optimizer_over_data"] == "false"
    # priced with its own profile: the header names no other; priced with xla-gpu, it says
    # which profile prices MaxText's rules
    assert "priced with the" not in emit("maxtext", cfg, sc)
    plain = cfg.replace(dp_replicate=1)
    assert "--runtime maxtext" in emit("maxtext", plain, _sc("xla-gpu", count=16))


def test_published_rows_are_its_a3_table_in_its_own_flop_count():
    """MaxText's A3 table (5 rows of TFLOP/s per chip) becomes tokens/s by MaxText's count of
    the same commit: 6 x 6,738,415,616 + 6 x 32 x 32 x 128 x 4096 = 43.65 GFLOP a token, so
    492 TFLOP/s a chip is 11,271 tokens/s; each row is predicted (none refused) with the
    maxtext runtime, hybrid sharding across the VMs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_runs import maxtext_runs, maxtext_tflops_per_token, predict
    doc = json.loads((ROOT / "benchmarks" / "published" / "maxtext.json").read_text())
    assert maxtext_tflops_per_token(doc) == pytest.approx(43.65e9, rel=1e-3)
    runs = maxtext_runs(doc)
    assert [r.config.dp_replicate for r in runs] == [1, 2, 4, 8, 16]
    assert runs[0].tokens_per_gpu == pytest.approx(11271, abs=1)
    for r in runs:
        p = predict(r)
        assert p["status"] == "ok" and p["fits"], (r.label, p)
        assert r.scenario.runtime.name == "maxtext"
        assert np.isfinite(p["throughput_error"])


# --------------------------------------------------------------------------------------------
# The maxtext tier: MaxText's own step, compiled in its own environment
# --------------------------------------------------------------------------------------------
def _tier_sc(count=16, **kw):
    from capopt._hardware import get_hardware
    kw = {"precision": "bf16-mixed", "global_batch": 32, "seq_len": 512, **kw}
    return _sc(count=count, hardware=get_hardware("h100-sxm-80gb"), **kw)


def test_the_tier_compiles_what_the_emitter_writes_on_one_slice():
    """The candidate's MaxText arguments are `--emit maxtext`'s with each axis spread across
    nodes folded into the one inside the slice (the same mesh shape), the card's sizes, and
    the compile's own device count."""
    from capopt.validation.maxtext_tier import overrides
    sc = _tier_sc()
    cfg = Config(micro_batch=2, grad_accum=1, dp=16, zero_stage=3, dp_replicate=2,
                 remat="full", flash_attention=False)
    d = dict(a.split("=", 1) for a in overrides(sc, cfg))
    assert (d["ici_fsdp_parallelism"], d["ici_data_parallelism"]) == ("8", "2")
    assert all(d[f"dcn_{k}_parallelism"] == "1" for k in ("data", "fsdp", "tensor"))
    assert d["internal_compile_num_devices"] == "16" and d["attention"] == "dot_product"
    m = sc.model
    assert (d["base_emb_dim"], d["base_num_query_heads"], d["base_num_kv_heads"],
            d["base_mlp_dim"], d["base_num_decoder_layers"], d["vocab_size"]) == tuple(
        str(v) for v in (m.hidden_size, m.num_attention_heads, m.num_key_value_heads,
                         m.intermediate_size, m.num_hidden_layers, m.vocab_size))
    assert d["remat_policy"] == "full" and d["logits_via_embedding"] == "false"


@pytest.mark.parametrize("change, words", [
    ({"flash_attention": True}, "dot_product"),
    ({"model": "gelu"}, "llama2 block"),
    ({"precision": "fp8-mixed"}, "fp8"),
])
def test_the_tier_refuses_what_it_does_not_compile(change, words):
    from capopt.validation.maxtext_tier import check
    from capopt.validation.step import Unsupported
    cfg = Config(micro_batch=2, grad_accum=1, dp=16, zero_stage=3, remat="full",
                 flash_attention=change.get("flash_attention", False))
    kw = {}
    if change.get("model") == "gelu":
        kw["model"] = llama_like(hidden=1024, heads=8, kv=2, mlp_type="gelu", hidden_act="gelu")
    if "precision" in change:
        kw["precision"] = change["precision"]
    with pytest.raises(Unsupported, match=words):
        check(_tier_sc(**kw), cfg)


def test_a_candidate_searched_under_another_runtime_is_judged_only_where_maxtext_runs_it():
    """Swapped to the maxtext profile by the tier, a candidate the maxtext runtime does not
    price (ZeRO-1: MaxText's optimizer-over-data layout; remat none) is not compiled."""
    from capopt.validation.maxtext_tier import check
    from capopt.validation.step import Unsupported
    sc = _tier_sc(runtime="xla-gpu")
    for cfg, words in ((Config(micro_batch=2, dp=16, zero_stage=1, remat="full",
                               flash_attention=False), "config.zero_stage"),
                       (Config(micro_batch=2, dp=16, zero_stage=3, remat="none",
                               flash_attention=False), "config.remat")):
        with pytest.raises(Unsupported, match=words):
            check(sc, cfg)


def test_per_stage_recompute_counts_are_refused():
    with pytest.raises(CapoptError) as err:
        _sc().replace(stage_recompute="auto")
    assert err.value.field == "config.stage_recompute"


def test_an_interpreter_without_maxtext_is_not_the_tier(monkeypatch):
    from capopt.validation import maxtext_tier
    monkeypatch.setenv(maxtext_tier.PYTHON_ENV, sys.executable)     # capopt's: no maxtext
    ok, why = maxtext_tier.maxtext_available()
    assert not ok and "has no maxtext" in why and "capopt setup maxtext" in why


def test_without_its_environment_the_tier_says_how_to_build_it(monkeypatch, tmp_path):
    from capopt.validation import maxtext_tier
    monkeypatch.delenv(maxtext_tier.PYTHON_ENV, raising=False)
    monkeypatch.setattr(maxtext_tier, "venv_dir", lambda: tmp_path / "none")
    ok, why = maxtext_tier.maxtext_available()
    assert not ok and "capopt setup maxtext" in why and maxtext_tier.PYTHON_ENV in why


def _fake_python(path, status=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexit {status}\n")
    path.chmod(0o755)
    return path


def test_setup_finds_a_python_312_where_pyenv_keeps_it(monkeypatch, tmp_path):
    from capopt.validation import maxtext_tier
    for v in ("3.11.7", "3.12.1"):
        _fake_python(tmp_path / "versions" / v / "bin" / "python")
    monkeypatch.setattr(maxtext_tier.shutil, "which", lambda name: None)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    assert maxtext_tier.find_python() == str(tmp_path / "versions" / "3.12.1" / "bin" / "python")
    (tmp_path / "versions" / "3.12.1" / "bin" / "python").unlink()
    assert maxtext_tier.find_python() is None


def test_setup_skips_a_python_on_the_path_that_does_not_start(monkeypatch, tmp_path):
    """A pyenv shim of a version installed but not selected is on the path and exits with
    an error ("pyenv: python3.13: command not found"): the installed version is taken."""
    from capopt.validation import maxtext_tier
    shim = _fake_python(tmp_path / "shims" / "python3.13", status=127)
    real = _fake_python(tmp_path / "versions" / "3.13.0" / "bin" / "python")
    monkeypatch.setattr(maxtext_tier.shutil, "which",
                        lambda name: str(shim) if name == "python3.13" else None)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    assert maxtext_tier.find_python() == str(real)


def test_setup_maxtext_takes_no_target(capsys):
    assert main(["setup", "maxtext", "--target", "/tmp/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target" in err[0]


@pytest.mark.maxtext
def test_one_maxtext_step_compiles_and_its_state_is_the_profiles():
    """Where the tier is set up: MaxText's step of a small llama compiles for 8 H100s, and
    the donated state (float32 parameters, AdamW's two moments, the step counts) is the
    profile's parameters and optimizer state per device, but for MaxText's norm scales: its
    'norm' axis is not sharded (configs/base.yml logical_axis_rules), so under fsdp each
    device holds them whole, (2 L + 1) h elements x 12 bytes x (1 - 1/8) more; its counters
    are under 1 KB."""
    from capopt.validation.maxtext_tier import maxtext_available, run_maxtext
    from capopt.validation.predict import predicted_terms
    ok, why = maxtext_available()
    if not ok:
        pytest.skip(why)
    sc = _tier_sc(count=8, global_batch=16)
    cfg = Config(micro_batch=2, grad_accum=1, dp=8, zero_stage=3, remat="full",
                 flash_attention=False)
    r = run_maxtext(sc, cfg)
    m = r["measured"]
    p = predicted_terms(cfg, sc, input_bytes=m["input_bytes"])
    model = sc.model
    norms = (2 * model.num_hidden_layers + 1) * model.hidden_size * 12 * (1 - 1 / 8)
    assert 0 <= m["alias_bytes"] - p["alias_bytes"] - norms < 1024
    assert m["temp_bytes"] > 0 and m["peak_bytes"] > m["alias_bytes"]


def test_validate_on_the_maxtext_tier_judges_the_maxtext_profile(monkeypatch, tmp_path, capsys):
    """``capopt validate --tier maxtext`` prices each candidate with the maxtext profile (the
    scenario's own maxtext* one where it names one); without the tier's environment it exits
    2 in one line naming --tier and how to build it."""
    from capopt.validation import maxtext_tier
    from capopt.validation.runner import tier_scenario
    assert tier_scenario(_tier_sc(runtime="xla-gpu"), "maxtext").runtime.name == "maxtext"
    own = _tier_sc()
    assert tier_scenario(own, "maxtext") is own
    monkeypatch.delenv(maxtext_tier.PYTHON_ENV, raising=False)
    monkeypatch.setattr(maxtext_tier, "venv_dir", lambda: tmp_path / "none")
    assert main(["validate", _scenario_file(tmp_path, ""), "--tier", "maxtext",
                 "--pinned", "--set", "micro_batch=2", "--set", "flash_attention=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tier" in err[0] and "capopt setup maxtext" in err[0], err
