"""Validation: Flax models built from cards, the training step, the exact tier, the runner
(subprocess per candidate, JSONL streaming, resume), the xla-gpu tier (skipped without the
CUDA plugin), the device tier on CPU, and calibration."""

from __future__ import annotations

import io
import json
import math
import warnings
from pathlib import Path

import jax
import pytest

from capopt.report import render
from capopt._cards import card_from_hf_config, list_cards, load_card
from capopt._model import ModelSpec
from capopt._specs import Config, LoRA
from capopt._inventory import inventory
from capopt.validation import (ValidationReport, abstract_model, count_params, predicted_terms,
                               validate, xla_gpu_available)
from capopt.validation.models import count_lora_params, Policy
from capopt.validation.predict import PARTS, TERMS
from capopt.validation.runner import Progress, input_bytes, load_results
from capopt.validation.step import Unsupported, build_step, output_leaves
from capopt.validation.tiers import NO_LATENCY_HIDING_OPTIONS, run_device, run_exact

from conftest import make_scenario

HF = Path(__file__).parent / "fixtures" / "hf"

# Parameters and optimizer state per device must match the cost model to 0.1%. The bytes the
# cost model leaves out are optax's int32 step counter (4 bytes per stateful transform), i.e.
# 0.003% of the smallest optimizer state tested here; 0.1% is the project's stated bar.
STATE_RTOL = 1e-3

TINY_BERT = ModelSpec(
    name="tiny-bert", family="encoder", hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=128, vocab_size=128, max_position_embeddings=64,
    type_vocab_size=2, embedding_norm=True, pooler=True, mlm_head=True, num_labels=2,
    attention_bias=True, attention_out_bias=True, mlp_bias=True, tie_word_embeddings=False,
    hidden_dropout=0.1, attention_dropout=0.1)
TINY_VIT = ModelSpec(
    name="tiny-vit", family="vit", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128, image_size=32, patch_size=8, num_labels=10, pooler=True,
    attention_bias=True, attention_out_bias=True, mlp_bias=True)
TINY_MLP = ModelSpec(name="tiny-mlp", family="mlp", hidden_size=64, num_hidden_layers=3)
TINY_MOE = ModelSpec(
    name="tiny-moe", family="decoder", hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, intermediate_size=96, vocab_size=128,
    position_embedding="rotary", norm_type="rmsnorm", mlp_type="gated", hidden_act="silu",
    num_local_experts=4, num_experts_per_tok=2, router_bias=True, lm_head_bias=True,
    norms_per_layer=4)
# DeepSeek's block kinds at toy size: latent attention with a q latent (q/k heads of 16 + 8,
# v heads of 16), a dense first block, shared experts beside the routed ones
TINY_MLA = ModelSpec(
    name="tiny-mla", family="decoder", hidden_size=64, num_hidden_layers=3,
    num_attention_heads=4, head_dim=24, v_head_dim=16, q_lora_rank=32, kv_lora_rank=16,
    qk_rope_head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
    router_bias=True, first_k_dense_replace=1, dense_intermediate_size=96,
    shared_expert_intermediate_size=48, vocab_size=128, position_embedding="rotary",
    norm_type="rmsnorm", mlp_type="gated", hidden_act="silu")


def tiny(card: str = "tiny-llama", *, count: int = 1, seq_len: int = 32, global_batch: int = 8,
         runtime: str = "xla-cpu", **kw):
    spec = load_card(card) if isinstance(card, str) else card
    return make_scenario(spec, runtime=runtime, count=count, seq_len=seq_len,
                         global_batch=global_batch, **kw)


def assert_state_matches(rec_or_pair):
    """params_bytes and optimizer_bytes: prediction = measurement to STATE_RTOL."""
    pred, meas = rec_or_pair
    for k in ("params_bytes", "optimizer_bytes"):
        # abs_tol 8 bytes: an optimizer without moments (sgd) predicts 0 and may hold up to
        # two int32 counters (clip + transform); rel_tol alone cannot compare with 0.
        assert math.isclose(pred[k], meas[k], rel_tol=STATE_RTOL, abs_tol=8), (k, pred[k],
                                                                                meas[k])


# ---- 1. models: parameter counts ------------------------------------------------------------
@pytest.mark.parametrize("name", list_cards())
def test_flax_model_has_the_cards_parameter_count(name):
    spec = load_card(name)
    assert count_params(abstract_model(spec)) == spec.num_params()   # exact, to the parameter


@pytest.mark.parametrize("path", sorted(HF.glob("*.json")), ids=lambda p: p.stem)
def test_flax_model_matches_hugging_face_imports(path):
    spec = card_from_hf_config(json.loads(path.read_text()))
    assert count_params(abstract_model(spec)) == spec.num_params()


@pytest.mark.parametrize("spec", [
    TINY_BERT, TINY_VIT, TINY_MLP, TINY_MOE, TINY_MLA, TINY_MLA.replace(q_lora_rank=0),
    # MoE with MLP biases and no shared experts: the experts' biases only
    TINY_MOE.replace(name="moe-bias", mlp_bias=True),
    TINY_VIT.replace(name="vit-moe-bias", num_local_experts=4, num_experts_per_tok=2,
                     mlp_bias=True)], ids=lambda s: s.name)
def test_every_family_and_option_counts_exactly(spec):
    assert count_params(abstract_model(spec)) == spec.num_params()


@pytest.mark.parametrize("targets", [("attn", "mlp"), ("q", "v"), ("v", "o", "down")],
                         ids="+".join)
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_lora_adapters_are_the_cost_models_count(bits, targets):
    spec = load_card("tiny-llama")
    lora = LoRA(rank=8, targets=targets, base_bits=bits)
    model = abstract_model(spec, Policy(lora=lora))
    # the Flax model's adapters are the inventory's, tensor by tensor in total
    assert count_lora_params(model) == sum(t.elements for t in inventory(spec, lora)
                                           if t.lora == "adapter")
    assert count_params(model) == spec.num_params()     # the base, quantised or not
    # an 8- or 4-bit base quantises every block matmul, wrapped or not (bitsandbytes at load)
    from flax import nnx

    from capopt.validation.models import QuantCodes
    codes = jax.tree.leaves(nnx.state(model, QuantCodes))
    stored = sum(t.count for t in inventory(spec, lora) if t.lora in ("base", "quant"))
    assert len(codes) == (stored if bits < 16 else 0)
    assert bits == 16 or stored == 7 * spec.num_hidden_layers


@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "plain"])
def test_an_nf4_base_takes_the_bytes_the_cost_model_counts(double_quant):
    """The Flax model's 4-bit codes and absmax (8-bit codes and their float32 scales, or a
    float32 absmax per block without double quantisation) are `nf4_bytes_per_weight` a
    stored weight."""
    from flax import nnx

    from capopt._runtime import nf4_bytes_per_weight
    from capopt.validation.models import QuantCodes, QuantScale
    spec = load_card("tiny-llama")
    lora = LoRA(rank=8, base_bits=4, double_quant=double_quant)
    model = abstract_model(spec, Policy(lora=lora))
    leaves = (jax.tree.leaves(nnx.state(model, QuantCodes))
              + jax.tree.leaves(nnx.state(model, QuantScale)))
    got = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    stored = [t for t in inventory(spec, lora) if t.lora in ("base", "quant")]
    want = sum(t.elements for t in stored) * nf4_bytes_per_weight(double_quant)
    # a matrix keeps whole groups of 256 block scales under double quantisation, which the
    # cost model counts as a fraction: under 4 bytes a matrix; without, every byte
    mats = sum(t.count for t in stored)
    assert 0 <= got - want < (4 * mats if double_quant else 1e-6)


def test_abstract_model_allocates_nothing():
    m = abstract_model(load_card("llama-3-70b"))
    leaves = jax.tree.leaves(m)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


# ---- 2-3. the step and the exact tier (in this process: one CPU device) ------------------------
def _exact(sc, cfg):
    out = run_exact(sc, cfg)
    pred = predicted_terms(cfg, sc, input_bytes=input_bytes(sc, cfg),
                           output_leaves=out["details"]["output_leaves"])
    return pred, out["measured"]


def test_cublas_gemms_put_one_workspace_in_xlas_temp():
    """Compiled with Triton GEMMs off (the xla-gpu tier's retry after a GEMM-tiling failure),
    every dot is a cuBLAS custom call whose output tuple carries the runtime's workspace: the
    predicted temporaries grow by one ``workspace_bytes`` (the calls share its slot); with
    Triton GEMMs, or options that leave them on, nothing changes."""
    from capopt.validation.tiers import GEMM_RETRY_OPTIONS
    sc = make_scenario(load_card("tiny-llama"), runtime="xla-gpu", count=1, global_batch=4)
    cfg = Config(micro_batch=4)
    triton = predicted_terms(cfg, sc)
    assert predicted_terms(cfg, sc, compiler_options=NO_LATENCY_HIDING_OPTIONS) == triton
    cublas = predicted_terms(cfg, sc, compiler_options={**NO_LATENCY_HIDING_OPTIONS,
                                                        **GEMM_RETRY_OPTIONS})
    ws = sc.runtime.coeff("workspace_bytes")
    assert ws > 0
    for key in ("temp_bytes", "peak_bytes"):
        assert cublas[key] - triton[key] == pytest.approx(ws, rel=1e-6)
    assert cublas["argument_bytes"] == triton["argument_bytes"]


@pytest.mark.parametrize("card,training,cfg", [
    ("tiny-llama", {}, Config(micro_batch=8)),
    ("tiny-gpt", {"precision": "fp32", "optimizer": "lion"},
     Config(micro_batch=4, grad_accum=2, remat="full")),
    ("tiny-llama", {"lora": LoRA(rank=4)}, Config(micro_batch=8, remat="selective")),
], ids=["adamw-bf16", "lion-fp32-accum-remat", "lora"])
def test_exact_tier_state_bytes_match_the_cost_model(card, training, cfg):
    pred, meas = _exact(tiny(card, **training), cfg)
    assert_state_matches((pred, meas))
    # The step's arguments are exactly parameters + optimizer state + batch (and key).
    assert meas["argument_bytes"] == (meas["params_bytes"] + meas["optimizer_bytes"]
                                      + meas["input_bytes"])
    # Donated trainable state and optimizer state come back in place: alias to 0.1% (the
    # cost model's trainable count leaves out the same int32 counters as above).
    assert math.isclose(pred["alias_bytes"], meas["alias_bytes"], rel_tol=STATE_RTOL)
    assert meas["input_bytes"] == pred["input_bytes"]                  # exact by construction
    assert meas["temp_bytes"] > 0


def test_step_is_built_abstractly_and_counts_its_outputs():
    sc = tiny("tiny-gpt")
    step = build_step(sc, Config(micro_batch=8), jax.devices()[:1])
    tr, fr, opt, batch, key = step.args
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(step.args))
    # adamw: count + mu + nu; plus the loss
    n = len(jax.tree.leaves(tr))
    assert output_leaves(step) == n + (2 * n + 1) + 1


def test_unsupported_configs_say_what_is_missing():
    sc = tiny("tiny-llama", count=2)
    with pytest.raises(Unsupported, match="pipeline"):
        build_step(sc, Config(micro_batch=8, pp=2), jax.devices())
    with pytest.raises(Unsupported, match="offload"):
        build_step(sc, Config(micro_batch=8, offload_optimizer=True), jax.devices())


# ---- 3b. layouts the cost model must describe (abstract steps on 8 virtual devices) ----------
# Each case pins one layout rule: the step is built abstractly (nothing compiled), its
# per-device parameter and optimizer bytes read from the shard shapes, and compared with the
# cost model at STATE_RTOL. One subprocess (8 virtual CPU devices) computes every case.
_LAYOUT_SCRIPT = r"""
import json, sys
import jax
from capopt._cards import load_card
from capopt._specs import Config, LoRA
from capopt.validation.predict import predicted_terms
from capopt.validation.step import build_step
sys.path.insert(0, sys.argv[1])
from conftest import make_scenario
import test_validation as tv
cases = {
    # kv heads (2) < tp (4): k/v projections stay whole on every device
    "kv-replicated": ("tiny-llama", 8, {}, Config(micro_batch=4, dp=2, tp=4)),
    # row-parallel output biases (attention out, MLP down) replicated, learned positions too
    "row-bias-gpt": ("tiny-gpt", 8, {}, Config(micro_batch=2, dp=4, tp=2)),
    "row-bias-vit": ("vit", 4, {}, Config(micro_batch=4, dp=2, tp=2)),
    # a vocabulary tp does not divide (131 rows): embedding and head replicated
    "vocab-replicated": ("odd-vocab", 8, {}, Config(micro_batch=2, dp=4, tp=2)),
    # MoE + expert parallelism + ZeRO: experts split over dp / ep, the rest over dp
    "moe-ep-zero1": ("moe", 4, {}, Config(micro_batch=2, dp=4, ep=2, zero_stage=1)),
    "moe-ep-zero3": ("moe", 4, {}, Config(micro_batch=2, dp=4, ep=2, zero_stage=3)),
    # latent attention: q_a and kv_a replicated over tp, kv_b column-parallel; a dense first
    # block and shared experts beside the routed ones (split over dp / ep under ZeRO)
    "mla-tp": ("mla", 4, {}, Config(micro_batch=2, dp=2, tp=2)),
    "mla-ep-zero3": ("mla", 4, {}, Config(micro_batch=2, dp=4, ep=2, zero_stage=3)),
    # LoRA on latent attention under tp: q_a's and kv_a's adapters (and their 8-bit bases'
    # per-column scales) whole on every rank, as the matrices they wrap
    "mla-lora-tp": ("mla", 4, {"lora": LoRA(rank=8, targets=("attn",), base_bits=8)},
                    Config(micro_batch=2, dp=2, tp=2)),
    # per-tensor optimizer layouts
    "adafactor": ("tiny-llama", 1, {"optimizer": "adafactor"}, Config(micro_batch=8)),
    "adafactor-big": ("wide", 1, {"optimizer": "adafactor"}, Config(micro_batch=1)),
    "adamw-8bit": ("tiny-llama", 1, {"optimizer": "adamw-8bit"}, Config(micro_batch=8)),
    "adamw-8bit-big": ("wide", 1, {"optimizer": "adamw-8bit"}, Config(micro_batch=1)),
    # 8-bit frozen base: int8 codes + a float32 scale per output column
    "lora-8bit": ("tiny-llama", 1, {"lora": LoRA(rank=8, base_bits=8)}, Config(micro_batch=8)),
    # NF4 base without double quantisation: a float32 absmax per 64 weights
    "qlora-plain": ("tiny-llama", 1, {"lora": LoRA(rank=8, base_bits=4, double_quant=False)},
                    Config(micro_batch=4)),
    # ... under tp: the block absmax split with a row-parallel matrix's codes, whole beside a
    # column-parallel one's; the absmax codes' scales whole
    "qlora-tp": ("tiny-llama", 2, {"lora": LoRA(rank=8, base_bits=4)},
                 Config(micro_batch=4, tp=2)),
    "qlora-plain-tp": ("tiny-llama", 2, {"lora": LoRA(rank=8, base_bits=4, double_quant=False)},
                       Config(micro_batch=4, tp=2)),
}
specs = {"vit": tv.TINY_VIT, "moe": tv.TINY_MOE.replace(num_key_value_heads=2),
         "mla": tv.TINY_MLA,
         "odd-vocab": load_card("tiny-gpt").replace(vocab_size=131),
         "wide": load_card("tiny-llama").replace(hidden_size=256, intermediate_size=512,
                                                 num_attention_heads=4, num_key_value_heads=2)}
out = {}
for name, (card, count, training, cfg) in cases.items():
    spec = specs.get(card) or load_card(card)
    seq = spec.native_seq_len or 32
    sc = make_scenario(spec, runtime="xla-cpu", count=count, seq_len=seq,
                       global_batch=cfg.micro_batch * cfg.dp, **training)
    step = build_step(sc, cfg, jax.devices()[:count])
    pred = predicted_terms(cfg, sc)
    out[name] = ({k: pred[k] for k in ("params_bytes", "optimizer_bytes")},
                 {"params_bytes": step.params_bytes, "optimizer_bytes": step.optimizer_bytes})
print(json.dumps(out))
"""


def _on_cpu_devices(script: str, devices: int):
    """The JSON the last line of ``script`` prints, run in a subprocess on ``devices``
    virtual CPU devices (the tests folder first on its path, its argument)."""
    import os
    import subprocess
    import sys
    tests = Path(__file__).parent
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script, str(tests)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def layout_cases():
    return _on_cpu_devices(_LAYOUT_SCRIPT, 8)


@pytest.mark.parametrize("case", [
    "kv-replicated", "row-bias-gpt", "row-bias-vit", "vocab-replicated", "moe-ep-zero1",
    "moe-ep-zero3", "mla-tp", "mla-ep-zero3", "mla-lora-tp", "adafactor", "adafactor-big",
    "adamw-8bit", "adamw-8bit-big", "lora-8bit", "qlora-plain", "qlora-tp",
    "qlora-plain-tp"])
def test_cost_model_describes_the_validation_layout(layout_cases, case):
    pred, meas = layout_cases[case]
    assert_state_matches((pred, meas))


def test_replicated_parts_cost_what_they_hold(layout_cases):
    """The cases above are not vacuous: each replicated or per-tensor part is a visible share
    of the state (far above STATE_RTOL), so a model without it would fail."""
    from capopt._runtime import ADAM8BIT_BLOCK, adam8bit_moment_bytes
    kv = layout_cases["kv-replicated"][1]["params_bytes"]
    spec = load_card("tiny-llama")
    # tp 4 with k/v split would hold a quarter of every matrix; replication adds 3/4 of k, v
    split = spec.num_params() * 4 / 4
    assert kv > 1.05 * split
    # 8-bit moments: 1 byte per weight plus a 4-byte absmax per block, padded to blocks
    assert adam8bit_moment_bytes(ADAM8BIT_BLOCK * 3) == 3 * (ADAM8BIT_BLOCK + 4)
    assert adam8bit_moment_bytes(ADAM8BIT_BLOCK * 3 + 1) == 4 * (ADAM8BIT_BLOCK + 4)
    assert adam8bit_moment_bytes(100) == 400                  # small tensors: float32


# ---- 4. the runner: sharded configs in subprocesses, crashes, resume ---------------------------
SHARDED = [Config(micro_batch=1, dp=8, zero_stage=3),
           Config(micro_batch=2, dp=4, tp=2, zero_stage=1, sequence_parallel=True)]


def test_sharded_exact_tier_matches_per_device_state(tmp_path):
    sc = tiny("tiny-llama", count=8)
    rep = validate(sc, configs=SHARDED, out=tmp_path / "r.jsonl", progress=False, jobs=2)
    assert [r["status"] for r in rep.results] == ["ok", "ok"], render(rep)
    for r in rep.results:
        assert_state_matches((r["predicted"], r["measured"]))
        assert r["details"]["compile_s"] > 0
    zero3, tp2 = rep.results
    # ZeRO-3 over 8 devices: every parameter split 8 ways (sizes all divide by 8).
    assert zero3["measured"]["params_bytes"] * 8 == load_card("tiny-llama").num_params() * 4
    assert tp2["measured"]["optimizer_bytes"] < tp2["measured"]["params_bytes"]   # ZeRO-1


def test_contract_shape_and_render(tmp_path):
    sc = tiny(TINY_MLP, seq_len=16)
    rep = validate(sc, configs=[Config(micro_batch=8)], progress=False)
    d = rep.to_dict()
    (r,) = d["results"]
    assert set(r) >= {"config", "tier", "status", "predicted", "measured", "error"}
    assert r["tier"] == "exact" and r["status"] == "ok"
    assert set(r["predicted"]) >= set(TERMS) | set(PARTS)
    assert set(r["measured"]) <= set(r["predicted"]) | {"static_peak_bytes", "in_use_bytes"}
    json.dumps(d)                                                    # JSON-serialisable
    text = render(rep)
    assert "argument_bytes" in text and "predicted" in text and "%" in text


def test_a_crash_is_recorded_and_resume_skips_finished(tmp_path, monkeypatch):
    sc = tiny(TINY_MLP, seq_len=16)
    cfgs = [Config(micro_batch=8), Config(micro_batch=4, grad_accum=2),
            Config(micro_batch=2, grad_accum=4)]
    out = tmp_path / "results.jsonl"
    monkeypatch.setenv("CAPOPT_VALIDATION_FAULT", "crash:1,oom:2")
    rep = validate(sc, configs=cfgs, out=out, progress=False)
    assert [r["status"] for r in rep.results] == ["ok", "error", "oom"]
    assert "SIGABRT" in rep.results[1]["error"]
    assert "RESOURCE_EXHAUSTED" in rep.results[2]["error"]
    assert len(load_results(out)) == 3                     # streamed as they finished
    first = rep.results[0]

    # A rerun skips what is in the file: if it ran config 0 again it would crash.
    monkeypatch.setenv("CAPOPT_VALIDATION_FAULT", "crash:0,crash:1,crash:2")
    again = validate(sc, configs=cfgs, out=out, progress=False)
    assert [r["status"] for r in again.results] == ["ok", "error", "oom"]
    assert again.results[0]["measured"] == first["measured"]
    assert len(load_results(out)) == 3 and any("resumed" in n for n in again.notes)

    # retry=True runs the failed ones again (now without faults) and keeps the finished one.
    monkeypatch.delenv("CAPOPT_VALIDATION_FAULT")
    fixed = validate(sc, configs=cfgs, out=out, progress=False, retry=True)
    assert [r["status"] for r in fixed.results] == ["ok", "ok", "ok"]


def test_a_torn_last_line_is_ignored(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"key": "a", "status": "ok"}\n{"key": "b", "sta')
    assert [r["key"] for r in load_results(p)] == ["a"]


@pytest.mark.slow
def test_a_hung_candidate_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPOPT_VALIDATION_FAULT", "hang:0")
    rep = validate(tiny(TINY_MLP, seq_len=16), configs=[Config(micro_batch=8)],
                   progress=False, timeout_s=6)
    assert rep.results[0]["status"] == "error" and "timeout" in rep.results[0]["error"]


def test_progress_bar_writes_one_line_per_candidate_off_a_terminal():
    buf = io.StringIO()
    p = Progress(2, stream=buf)
    p.update("a", "ok")
    p.update("b", "oom")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and "2/2" in lines[1] and "oom" in lines[1]


def test_progress_bar_names_the_candidate_being_measured_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    buf = Tty()
    p = Progress(2, stream=buf)
    p.start("mb=1 ga=2")
    assert "running" in buf.getvalue() and "mb=1 ga=2" in buf.getvalue() and "0/2" in buf.getvalue()
    p.update("mb=1 ga=2", "ok")
    assert buf.getvalue().count("\r") == 2 and "1/2" in buf.getvalue().split("\r")[-1]
    off = io.StringIO()
    Progress(2, stream=off).start("x")          # off a terminal: a line per result only
    assert off.getvalue() == ""


# ---- 5. xla-gpu and device tiers --------------------------------------------------------------
_XLA_GPU, _WHY = xla_gpu_available()


@pytest.mark.xla_gpu
@pytest.mark.skipif(not _XLA_GPU, reason=_WHY or "xla-gpu plugin absent")
def test_xla_gpu_tier_compiles_for_a_gpu_without_one(tmp_path):
    from capopt._hardware import get_hardware
    sc = tiny("tiny-llama", seq_len=128, global_batch=16, runtime="xla-gpu",
              hardware=get_hardware("h100-sxm-80gb"))
    cfgs = [Config(micro_batch=16), Config(micro_batch=16, remat="full")]
    with warnings.catch_warnings(record=True) as seen:
        rep = validate(sc, tier="xla-gpu", configs=cfgs, progress=False, jobs=2)
    assert [r["status"] for r in rep.results] == ["ok", "ok"], render(rep)
    # the workers start by fork and exec from a process running JAX: its warning that a fork
    # may deadlock (a child going on in JAX) is filtered, not shown to the user
    assert not [w for w in seen if "os.fork()" in str(w.message)], [str(w.message) for w in seen]
    none, full = rep.results
    assert_state_matches((none["predicted"], none["measured"]))
    # Full recomputation must shrink the GPU step's temporaries (the CPU backend would not).
    assert full["measured"]["temp_bytes"] < none["measured"]["temp_bytes"]
    # what XLA's schedulers logged is read: on one device no collective is there to overlap
    # and the latency-hiding scheduler does not run
    for r in rep.results:
        sched = r["details"]["xla_schedule"]
        assert sched["order"] in ("list", "dfs", "post_order") and sched["scheduled_bytes"] > 0
        assert sched["lhs_bytes"] is None and sched["lhs_limit_bytes"] is None


@pytest.mark.xla_gpu
@pytest.mark.skipif(not _XLA_GPU, reason=_WHY or "xla-gpu plugin absent")
def test_xla_latency_hiding_spends_the_cards_spare_memory_and_can_be_turned_off(tmp_path):
    """A step with collectives compiled for an H100 goes through XLA's latency-hiding
    scheduler, whose memory limit is (80% of the card - unaliased arguments and outputs) x 95%
    (``GetSchedulerMemoryLimit``), read back exactly from its log; with
    NO_LATENCY_HIDING_OPTIONS it does not run and the memory scheduler's order is compiled."""
    from capopt._hardware import get_hardware
    from capopt.report.text import validation_table
    sc = tiny("tiny-llama", seq_len=128, global_batch=16, runtime="xla-gpu",
              hardware=get_hardware("h100-sxm-80gb"))
    cfgs = [Config(micro_batch=8, dp=2)]
    out = tmp_path / "v.jsonl"
    on = validate(sc, tier="xla-gpu", configs=cfgs, progress=False, out=out)
    off = validate(sc, tier="xla-gpu", configs=cfgs, progress=False, out=out,
                   options={"latency_hiding": False})
    # (the second is another measurement: not resumed from the first's record)
    assert not any("resumed" in n for n in off.notes), off.notes
    lhs, calm = on.results[0], off.results[0]
    assert lhs["status"] == calm["status"] == "ok", (lhs.get("error"), calm.get("error"))
    m, sched = lhs["measured"], lhs["details"]["xla_schedule"]
    io = m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"]
    assert sched["lhs_limit_bytes"] == (sc.hardware.memory_bytes * 80 // 100 - io) * 95 // 100
    assert sched["lhs_bytes"] > 0
    assert "latency-hiding scheduler reordered this step" in validation_table(on)
    assert calm["details"]["xla_schedule"]["lhs_bytes"] is None
    assert calm["details"]["compiler_options"] == NO_LATENCY_HIDING_OPTIONS
    assert "latency-hiding" not in validation_table(off)
    # the same program either way: arguments and outputs do not move
    for k in ("argument_bytes", "output_bytes", "alias_bytes"):
        assert calm["measured"][k] == m[k]


@pytest.mark.xla_gpu
@pytest.mark.skipif(not _XLA_GPU, reason=_WHY or "xla-gpu plugin absent")
def test_xla_splits_a_gemms_k_where_the_xla_gpu_profile_says():
    """The profile's split-K rule (`capopt.cost.memory.head_grad_split`, read off
    `benchmarks/xla_splitk.py`) against the compiler it describes: XLA splits K of a GEMM
    whose output has a fifth fewer row x column tiles than the rule's limit and not of one
    with a quarter more (H100 target, K 5003, 128 columns). A jaxlib that moved its limit
    past either side fails here."""
    import subprocess
    import sys

    from capopt._hardware import get_hardware
    from capopt._runtime import get_profile
    from capopt.cost.memory import splitk_tile_limit
    from capopt.validation.tiers import environment
    xla = get_profile("xla-gpu")
    limit = splitk_tile_limit(get_hardware("h100-sxm-80gb").sm_count, 5003,
                              xla.coeff("head_splitk_rows_per_sm"),
                              xla.coeff("head_splitk_half_k"))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "xla_splitk.py"

    def split(m: int) -> int:
        out = subprocess.run([sys.executable, str(script), "--probe", "h100-sxm-80gb", str(m),
                              "128", "5003"], env=environment("xla-gpu", Config()),
                             capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert split(int(0.8 * limit)) > 1
    assert split(int(1.25 * limit)) == 1


@pytest.mark.xla_gpu
@pytest.mark.skipif(not _XLA_GPU, reason=_WHY or "xla-gpu plugin absent")
def test_the_weight_gradient_split_table_is_the_compilers():
    """`benchmarks/results/xla_splitk_wgrad.json` (the README's weight-gradient split-K
    figures) against the compiler: two of its points compiled again, one split and one not."""
    import json
    import subprocess
    import sys

    from capopt.validation.tiers import environment
    root = Path(__file__).resolve().parents[1]
    table = json.loads((root / "benchmarks" / "results" / "xla_splitk_wgrad.json").read_text())
    want = {(p["in"], p["tokens"]): p["split"] for p in table["points"]}
    jobs = [[384, 384, 2048], [2048, 2048, 2048]]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "xla_splitk.py"),
                          "--wgrad-worker", "h100-sxm-80gb", json.dumps(jobs)],
                         env=environment("xla-gpu", Config()), capture_output=True, text=True,
                         check=True)
    got = {(r["in"], r["tokens"]): r["split"]
           for r in map(json.loads, out.stdout.splitlines())}
    assert got == {k: want[k] for k in got}
    assert got[(384, 2048)] > 1 and got[(2048, 2048)] == 1


def test_xla_gpu_tier_refuses_cleanly_without_the_plugin(monkeypatch):
    import capopt.validation.runner as runner
    from capopt._errors import CapoptError
    monkeypatch.setattr(runner, "xla_gpu_available", lambda: (False, "no CUDA plugin here"))
    with pytest.raises(CapoptError, match="no CUDA plugin here"):
        validate(tiny(TINY_MLP, seq_len=16), tier="xla-gpu", configs=[Config(micro_batch=8)],
                 progress=False)


def test_device_tier_runs_real_steps_on_cpu():
    out = run_device(tiny(TINY_MLP, seq_len=16), Config(micro_batch=8), warmup=1, steps=2)
    assert out["measured"]["step_s"] > 0
    assert out["measured"]["peak_bytes"] is None            # CPU has no allocator stats
    assert math.isfinite(out["details"]["loss"])


def test_public_names():
    import capopt
    import capopt.validation as v
    assert v.__all__ == sorted(v.__all__)
    assert {"validate", "calibrate", "ValidationReport", "build_model", "build_step",
            "predicted_terms"} <= set(v.__all__)
    assert all(hasattr(v, n) for n in v.__all__)
    assert v.validate is validate and ValidationReport.__name__ in v.__all__
    assert capopt.validate.__doc__


# ---- 6. calibration --------------------------------------------------------------------------
def test_calibrate_recovers_known_coefficients():
    from capopt.validation.calibrate import Sample, _predict, calibrate
    from capopt.cost import knobs_from_config, numbers_pytree

    base = tiny("tiny-gpt", runtime="xla-gpu", seq_len=64, global_batch=64)
    truth = base.replace(runtime=base.runtime.with_coeffs(resid_saved=6.4,
                                                           logits_fp32_copies=3.0))
    cfgs = [Config(micro_batch=mb, grad_accum=64 // mb, remat=r, flash_attention=f)
            for mb in (1, 2, 4, 8, 16, 32) for r in ("none", "full") for f in (True, False)]
    predict = jax.jit(_predict, static_argnums=4)      # one program for the 24 configs
    samples = []
    for c in cfgs:
        true_temp = float(predict(knobs_from_config(c), numbers_pytree(truth), 0.0, 0.0,
                                  "temp_bytes"))
        samples.append(Sample(base, c, true_temp))
    res = calibrate(samples, coeffs=("resid_saved", "logits_fp32_copies"), steps=1500,
                    learning_rate=0.05)
    # Noise-free synthetic data from the same model: the fit should land within 2% (Adam's
    # last steps oscillate around the optimum by less than that at this learning rate).
    assert math.isclose(res.coeffs["resid_saved"], 6.4, rel_tol=0.02)
    assert math.isclose(res.coeffs["logits_fp32_copies"], 3.0, rel_tol=0.02)
    assert res.holdout_error["after"] < 0.01 < res.holdout_error["before"]
    text = res.to_toml()
    assert 'name = "xla-gpu-calibrated"' in text and "resid_saved" in text


def test_xla_gpu_compile_retries_gemm_tiling_failures_without_triton():
    """XLA's GPU compiler with autotuning off can fail to tile a small GEMM for Triton; the
    tier compiles again with Triton GEMMs off and says so (keeping the options it was asked
    for); other failures propagate."""
    from capopt.validation.tiers import (GEMM_RETRY_OPTIONS, NO_LATENCY_HIDING_OPTIONS,
                                         compile_retrying_gemm_tiling)

    class Lowered:
        def __init__(self, error):
            self.calls, self.error = [], error

        def compile(self, compiler_options=None):
            self.calls.append(compiler_options)
            if self.error and not set(GEMM_RETRY_OPTIONS) <= set(compiler_options or {}):
                raise RuntimeError(self.error)
            return "executable"

    asked = Lowered("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot")
    both = {**NO_LATENCY_HIDING_OPTIONS, **GEMM_RETRY_OPTIONS}
    assert compile_retrying_gemm_tiling(asked, NO_LATENCY_HIDING_OPTIONS) == ("executable", both)
    assert asked.calls == [NO_LATENCY_HIDING_OPTIONS, both]

    lowered = Lowered("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot")
    exe, opts = compile_retrying_gemm_tiling(lowered)
    assert exe == "executable" and opts == GEMM_RETRY_OPTIONS
    assert lowered.calls == [None, GEMM_RETRY_OPTIONS]
    fine = Lowered(None)
    assert compile_retrying_gemm_tiling(fine) == ("executable", {})
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        compile_retrying_gemm_tiling(Lowered("RESOURCE_EXHAUSTED: out of memory"))


def test_xla_gpu_target_needs_a_described_gpu():
    from capopt.validation.tiers import gpu_topology
    from conftest import TEST_GPU
    with pytest.raises(Unsupported, match="core_count"):
        gpu_topology(TEST_GPU, 1)        # no SM count, clock or compute capability




def test_grouped_moe_dispatch_routes_each_group_alone():
    """GShard's grouped dispatch: with room for every token, routing two groups apart gives
    what routing them together gives; with one slot per expert and group, each group routes
    its own first token (the shared expert's output alone would mean it was dropped)."""
    import jax.numpy as jnp
    from capopt.validation.models import KeyGen, MoE

    spec = TINY_MOE.replace(shared_expert_intermediate_size=32)
    x = jax.random.normal(jax.random.key(1), (2, 8, spec.hidden_size), jnp.float32)

    def moe(groups, cf):
        return MoE(spec, policy=Policy(moe_capacity_factor=cf, moe_groups=groups),
                   rngs=KeyGen(0))

    # float32 sums in another order: agreement to round-off
    assert jnp.allclose(moe(1, 8.0)(x), moe(2, 8.0)(x), atol=1e-5)
    tight = moe(2, 1e-3)
    routed = tight(x) - tight.shared(x)
    assert float(jnp.abs(routed[1, 0]).max()) > 1e-4


def test_dense_first_blocks_count_in_every_family():
    """An encoder or ViT MoE with a dense first block builds it dense and the rest with
    experts, as the inventory counts them (MLP biases off: see the note on expert biases in
    non-decoder families)."""
    moe = dict(num_local_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
               dense_intermediate_size=96, mlp_bias=False)
    for spec in (TINY_BERT.replace(**moe), TINY_VIT.replace(**moe)):
        assert count_params(abstract_model(spec)) == spec.num_params()


def test_latent_attention_needs_rotary_positions():
    from capopt._errors import CapoptError
    with pytest.raises(CapoptError) as err:
        TINY_MLA.replace(position_embedding="learned", max_position_embeddings=64)
    assert err.value.field == "model.position_embedding"


def test_torch_reserved_is_judged_against_the_runtimes_own_allocator():
    # torchtitan launches with expandable segments: its reserved figure is compared with the
    # allocator replayed that way; pytorch-eager's with the default allocator's replay
    from capopt._runtime import get_profile
    from capopt.validation.predict import judged_torch_measurement
    m = {"peak_bytes": 10, "reserved_bytes": 14, "reserved_expandable_bytes": 12}
    titan = judged_torch_measurement(m, get_profile("torchtitan"))
    assert titan["reserved_bytes"] == 12 and titan["reserved_default_bytes"] == 14
    assert judged_torch_measurement(m, get_profile("pytorch-eager")) == m
    assert m["reserved_bytes"] == 14                         # the record itself is not changed


_SP_LAYOUT_SCRIPT = r"""
import json, sys
import jax
sys.path.insert(0, sys.argv[1])
from conftest import make_scenario
from capopt._cards import load_card
from capopt._specs import Config
from capopt.validation.step import build_step
cfg = Config(micro_batch=2, dp=2, tp=2, sequence_parallel=True, flash_attention=False)
sc = make_scenario(load_card("tiny-gpt"), runtime="xla-cpu", count=4, seq_len=64,
                   global_batch=cfg.micro_batch * cfg.dp)
hlo = build_step(sc, cfg, jax.devices()[:4]).lower().compile().as_text()
print(json.dumps({op: hlo.count(op + "(") + hlo.count(op + "-start(")
                  for op in ("all-to-all", "all-gather")}))
"""


def test_sequence_parallel_step_is_laid_out_as_megatron():
    """Under sequence parallelism the validation step constrains each block's inside as
    Megatron-LM lays it out (`capopt.validation.models.Policy.layout`): the sublayers' inputs
    all-gathered over the sequence, the attention split over heads, the row-parallel outputs
    reduce-scattered back. With the residual stream alone constrained, XLA split the scores
    over the sequence and turned them over with all-to-alls (this step: two; rand0-121's:
    two float32 score-sized buffers at its peak); none is left."""
    counts = _on_cpu_devices(_SP_LAYOUT_SCRIPT, 4)
    assert counts["all-to-all"] == 0, counts
    assert counts["all-gather"] > 0, counts          # (XLA:CPU decomposes reduce-scatters)
