"""Step time and throughput: exact FLOP counts, communication, pipeline, properties, JAX."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capopt._hardware import get_hardware
from capopt._model import ModelSpec
from capopt._specs import Config, LoRA
from capopt._runtime import get_profile
from capopt.cost import (Knobs, estimate, estimate_numbers, knobs_from_config, numbers_pytree,
                         scenario_numbers, stack_knobs)
from capopt.cost import comm
from capopt.cost.memory import gathered_param_bytes, held_grad_bytes
from capopt.cost.flops import (block_flops, hardware_flops, matmul_efficiency, model_flops,
                               recompute_flops)
from conftest import (END_STAGE_CONFIGS, RELAXED_KNOBS, TEST_GPU, gpt_like, llama_like,
                      make_scenario)

# The cost model runs in float32: relative agreement to 1e-5 is float32 round-off over a few
# dozen operations, not modelling slack. FLOP counts on Python floats are exact integers.
F32 = 1e-5


def py_knobs(*, mb=2, ga=3, dp=4, tp=1, pp=1, ep=1, zero=0, remat=(1.0, 0.0, 0.0), sp=0.0,
             offload=0.0, flash=0.0, cp=1) -> Knobs:
    """Knobs as Python floats, so the FLOP counts are exact integer arithmetic (float64)."""
    z = [0.0] * 4
    z[zero] = 1.0
    f = float
    return Knobs(micro_batch=f(mb), grad_accum=f(ga), dp=f(dp), tp=f(tp), pp=f(pp), ep=f(ep),
                 zero=tuple(z), remat=tuple(map(f, remat)), sp=f(sp), offload=f(offload),
                 flash=f(flash), cp=f(cp), vpp=f(1))


def est(cfg: Config, sc) -> dict:
    return estimate(cfg, sc).to_dict()


# ---------------------------------------------------------------------------------------------
# FLOP counts: closed forms, exactly
# ---------------------------------------------------------------------------------------------
GPT = dict(layers=3, hidden=64, heads=4, vocab=512, seq=128)


def _gpt_numbers(**kw):
    sc = make_scenario(gpt_like(**GPT), seq_len=GPT["seq"], **kw)
    return scenario_numbers(sc)


def test_gpt_model_flops_match_korthikanti_eq7():
    # 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) = B s (72 l h^2 + 12 l s h + 6 h V)
    n = _gpt_numbers()
    k = py_knobs()
    B, s, l, h, V = 2 * 3 * 4, GPT["seq"], GPT["layers"], GPT["hidden"], GPT["vocab"]
    assert model_flops(k, n) == B * s * (72 * l * h * h + 12 * l * s * h + 6 * h * V)


def test_gpt_full_recompute_matches_narayanan_eq3():
    # 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) = B s (96 l h^2 + 16 l s h + 6 h V)
    n = _gpt_numbers()
    k = py_knobs(remat=(0.0, 0.0, 1.0))
    B, s, l, h, V = 24, GPT["seq"], GPT["layers"], GPT["hidden"], GPT["vocab"]
    assert hardware_flops(k, n) == B * s * (96 * l * h * h + 16 * l * s * h + 6 * h * V)


def test_gpt_selective_recompute_repeats_the_attention_core_forward():
    # 72 B s l h^2 (1 + 2s/(9h) + V/(12 l h)): one more Q K^T and P V forward, 4 s h per token.
    # (Korthikanti et al. eq. 8 has s/(3h): the core's forward and backward counted again.)
    n = _gpt_numbers()
    k = py_knobs(remat=(0.0, 1.0, 0.0))
    B, s, l, h, V = 24, GPT["seq"], GPT["layers"], GPT["hidden"], GPT["vocab"]
    assert hardware_flops(k, n) == B * s * (72 * l * h * h + 16 * l * s * h + 6 * h * V)
    # flash attention stores no scores: nothing to recompute selectively, but its backward
    # pass recomputes Q K^T (half the attention-core forward)
    kf = py_knobs(remat=(0.0, 1.0, 0.0), flash=1.0)
    assert hardware_flops(kf, n) - model_flops(kf, n) == B * s * l * 2 * s * h


def test_paper_card_matches_narayanan_eq3_exactly():
    from capopt import load_card
    m = load_card("gpt3-175b")
    sc = make_scenario(m, seq_len=2048, global_batch=1536, count=384)
    n = scenario_numbers(sc)
    k = py_knobs(mb=1, ga=384, dp=4, tp=8, pp=12, remat=(0.0, 0.0, 1.0))
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    assert hardware_flops(k, n) == B * s * (96 * l * h * h + 16 * l * s * h + 6 * h * V)
    assert 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)) == pytest.approx(
        hardware_flops(k, n), rel=1e-12)


def test_llama_gqa_gated_flops():
    m = llama_like(layers=2, hidden=128, heads=8, kv=2, vocab=300, intermediate_size=352)
    sc = make_scenario(m, seq_len=64)
    n = scenario_numbers(sc)
    k = py_knobs(mb=1, ga=1, dp=2)
    h, hd, f, s, L, V = 128, 16, 352, 64, 2, 300
    q, kv = 8 * hd, 2 * hd
    per_tok_fwd = 2 * (h * q + 2 * h * kv + q * h) + 2 * 3 * h * f + 4 * s * q
    assert model_flops(k, n) == 2 * s * (3 * L * per_tok_fwd + 3 * 2 * h * V)


def test_moe_counts_top_k_experts_and_router():
    m = llama_like(layers=2, hidden=64, heads=4, kv=4, vocab=100, intermediate_size=96,
                   num_local_experts=4, num_experts_per_tok=2)
    sc = make_scenario(m, seq_len=32, runtime="xla-gpu")          # capacity factor 1.25
    n = scenario_numbers(sc)
    k = py_knobs(mb=1, ga=1, dp=1)
    h, f, s, L, V, E, topk = 64, 96, 32, 2, 100, 4, 2
    experts = 2 * 3 * h * f * topk
    attn_w = 2 * 4 * h * h
    per_tok = attn_w + experts + 2 * h * E + 4 * s * h
    assert model_flops(k, n) == s * (3 * L * per_tok + 6 * h * V)
    cf = n["rt_moe_capacity_factor"]
    assert recompute_flops(k, n) == pytest.approx(s * L * (cf - 1) * experts * 3, rel=1e-15)


def test_latent_attention_dense_first_blocks_and_shared_experts_flops():
    """DeepSeek's block kinds, against their arithmetic per token: latent attention's five
    projections and a core of q/k heads 16 + 8 wide and v heads 16 wide; one dense block and
    two expert blocks with a shared expert beside the top-2 routed ones."""
    m = ModelSpec(name="mla", family="decoder", hidden_size=64, num_hidden_layers=3,
                  num_attention_heads=4, head_dim=24, v_head_dim=16, q_lora_rank=32,
                  kv_lora_rank=16, qk_rope_head_dim=8, intermediate_size=32,
                  num_local_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                  dense_intermediate_size=96, shared_expert_intermediate_size=48,
                  vocab_size=100, position_embedding="rotary", norm_type="rmsnorm",
                  mlp_type="gated", hidden_act="silu")
    n = scenario_numbers(make_scenario(m, seq_len=32))
    k = py_knobs(mb=1, ga=1, dp=1)
    h, a, s, V = 64, 4, 32, 100
    attn = 2 * (h * 32 + 32 * a * 24 + h * (16 + 8) + 16 * a * (16 + 16) + a * 16 * h)
    core = 2 * s * (a * 24 + a * 16)
    dense = 2 * 3 * h * 96
    moe = 2 * 3 * h * 32 * 2 + 2 * 3 * h * 48 + 2 * h * 4
    per_tok = 3 * (attn + core) + dense + 2 * moe
    assert model_flops(k, n) == pytest.approx(s * (3 * per_tok + 6 * h * V), rel=1e-12)


def test_lora_base_gets_input_gradients_only():
    m = gpt_like(layers=2, hidden=64, heads=4, vocab=200, seq=32)
    lora = LoRA(rank=4, targets=("attn", "mlp"))
    sc = make_scenario(m, seq_len=32, lora=lora)
    n = scenario_numbers(sc)
    k = py_knobs(mb=1, ga=1, dp=1)
    h, f, s, L, V, r = 64, 256, 32, 2, 200, 4
    w = 24 * h * h                          # q, k, v, o + 4h MLP, forward per token
    a = 4 * s * h
    lo = 2 * r * ((h + h) * 4 + (h + f) + (f + h))   # adapters on q, k, v, o, up, down
    assert 2 * n["lora_layer"] == lo
    # forward + input gradients for the frozen base; adapters also get weight gradients
    per_tok = L * (2 * w + 3 * a + 3 * lo) + 2 * (2 * h * V)
    assert model_flops(k, n) == s * per_tok


# ---------------------------------------------------------------------------------------------
# QLoRA: the 4-bit base is dequantised before its matmuls
# ---------------------------------------------------------------------------------------------
def _qlora_pair(runtime, cfg, *, base_bits=4, tp_kv=False):
    """(4-bit, 16-bit base) estimates of one config, and the 4-bit scenario's numbers."""
    m = llama_like(layers=4, hidden=256, heads=8, kv=2 if tp_kv else 8,
                   intermediate_size=704, vocab=1000)
    out = []
    for bits in (base_bits, 16):
        lora = LoRA(rank=8, targets=("attn", "mlp"), base_bits=bits)
        sc = make_scenario(m, runtime=runtime, count=cfg.dp * cfg.tp, seq_len=512,
                           global_batch=cfg.micro_batch * cfg.grad_accum * cfg.dp, lora=lora)
        out.append((est(cfg, sc), scenario_numbers(sc)))
    return out


@pytest.mark.parametrize("runtime, remat, passes, kernels", [
    # bitsandbytes: dequantize_4bit before the forward's and again before the backward's
    # matmul, and in a recomputed forward; double quantisation takes three kernels
    ("pytorch", "none", 2, 3), ("pytorch", "full", 3, 3), ("pytorch", "selective", 2, 3),
    # a selective policy that saves matmul outputs (pytorch-eager's) or torchtitan's per-op
    # one replays the block's forward, the dequantisation with it
    ("pytorch-eager", "selective", 3, 3), ("torchtitan", "selective", 3, 3),
    # XLA: one dequantising fusion in the forward pass, its output kept for the backward's
    # GEMMs; recomputed with the block (full) or with its non-matmul values (dots saveable)
    ("xla-gpu", "none", 1, 1), ("xla-gpu", "full", 2, 1), ("xla-gpu", "selective", 2, 1)])
def test_a_4bit_base_adds_its_dequantisation_traffic_and_nothing_else(runtime, remat, passes,
                                                                       kernels):
    cfg = Config(micro_batch=2, grad_accum=3, remat=remat)
    (q, n), (b16, _) = _qlora_pair(runtime, cfg)
    h, f, kv, L = 256, 704, 256, 4
    wrapped = h * (h + 2 * kv) + h * h + 3 * h * f          # q k v, o, gate up down
    prof = get_profile(runtime)
    rate = TEST_GPU.mem_bw * prof.coeff("mem_eff")
    # a pass reads the codes and their scales and writes the weight in the compute dtype
    per_pass = wrapped * (n["base_bytes"] + 2.0)
    want = cfg.grad_accum * L * passes * per_pass / rate
    tq, t16 = q["time"], b16["time"]
    assert tq["dequant_s"] == pytest.approx(want, rel=F32)
    assert t16["dequant_s"] == 0.0
    # memory-bound time grows by the traffic and the kernels' exposed launches, nothing else
    # (a difference of two float32 sums: their rounding, ~1e-7 of each, is up to ~30x the
    # difference's size here, hence 1e-4 of it rather than F32)
    launches = tq["launch_s"] - t16["launch_s"]
    assert tq["memory_bound_s"] - t16["memory_bound_s"] == pytest.approx(
        want + launches, rel=1e-4)
    assert 0.0 <= launches <= cfg.grad_accum * L * passes * 7 * kernels * max(
        prof.coeff("kernel_gap_s"), prof.coeff("kernel_launch_s")) * (1 + 1e-4)
    for key in ("compute_s", "optimizer_s", "bubble_s", "comm_exposed_s", "grad_accum_s"):
        assert tq[key] == pytest.approx(t16[key], rel=F32), key
    assert tq["step_s"] > t16["step_s"]


@pytest.mark.parametrize("runtime, kernels_saved", [
    # bitsandbytes without compress_statistics: dequantize_4bit alone, not the absmax
    # codes' dequantize_blockwise and += offset first; XLA fuses the scales into its
    # dequantising fusions either way
    ("pytorch", 2), ("xla-gpu", 0)])
def test_double_quantisation_changes_the_dequantisation_traffic_and_kernels_only(
        runtime, kernels_saved):
    m = llama_like(layers=4, hidden=256, heads=8, kv=8, intermediate_size=704, vocab=1000)
    cfg = Config(micro_batch=2, grad_accum=3, remat="none")
    out = {}
    for dq in (True, False):
        lora = LoRA(rank=8, targets=("attn", "mlp"), base_bits=4, double_quant=dq)
        sc = make_scenario(m, runtime=runtime, count=1, seq_len=512, global_batch=6, lora=lora)
        out[dq] = (est(cfg, sc)["time"], scenario_numbers(sc))
    (t_dq, n_dq), (t_plain, n_plain) = out[True], out[False]
    # the dequantisation reads the codes and their scales: a float32 absmax a block of 64
    # weights is 0.047 bytes a weight more than double quantisation's (nothing else changes)
    ratio = (n_plain["base_bytes"] + 2.0) / (n_dq["base_bytes"] + 2.0)
    assert t_plain["dequant_s"] == pytest.approx(t_dq["dequant_s"] * ratio, rel=F32)
    # kernels a micro-batch launches: each of a block's 7 wrapped matrices is dequantised
    # before its forward and again before its backward matmul (bitsandbytes; XLA's backward
    # reads the forward's copy), each time with ``kernels_saved`` kernels fewer
    from capopt.cost.time import dequant_passes, stage_kernels
    k = py_knobs(mb=2, ga=3, dp=1)
    passes = float(dequant_passes(k, n_dq))
    assert passes == (2.0 if runtime == "pytorch" else 1.0)
    assert n_dq["lora_base_mats"] == 7.0
    saved = float(stage_kernels(k, n_dq, 4.0)) - float(stage_kernels(k, n_plain, 4.0))
    assert saved == pytest.approx(4 * passes * 7 * kernels_saved, abs=1e-9)
    for key in ("compute_s", "optimizer_s", "bubble_s", "comm_exposed_s", "grad_accum_s"):
        assert t_plain[key] == pytest.approx(t_dq[key], rel=F32), key


# ---------------------------------------------------------------------------------------------
# Eager element-wise ops, and torch.compile fusing them
# ---------------------------------------------------------------------------------------------
def _compile_pair(model, runtime, cfg):
    out = []
    for compiled in (False, True):
        sc = make_scenario(model, runtime=runtime, count=1, seq_len=512,
                           global_batch=cfg.micro_batch * cfg.grad_accum, compile=compiled)
        out.append(est(cfg, sc))
    return out


@pytest.mark.parametrize("runtime, remat, passes", [
    # a forward pass and ew_bwd_factor (2) passes of backward traffic; full recomputation
    # repeats the forward; the torch tier's selective policy (matmul outputs saved) and
    # torchtitan's per-op one replay every non-matmul op of the block
    ("pytorch-eager", "none", 3), ("pytorch-eager", "full", 4),
    ("pytorch-eager", "selective", 4), ("torchtitan", "selective", 4)])
def test_compiling_removes_the_eager_ops_traffic_and_nothing_else(runtime, remat, passes):
    """An eager step moves an RMSNorm's, rotary embedding's and SwiGLU's operands op by op
    (the profile's ew_*_extra, from the ops of torchtitan's and transformers' Llama); under
    compile each chain is one kernel. The difference is that traffic at HBM rate, and only
    memory-bound time changes."""
    model = llama_like(layers=4, hidden=256, heads=8, kv=2)        # head 32, f 688
    cfg = Config(micro_batch=2, grad_accum=3, remat=remat)
    eager, compiled = _compile_pair(model, runtime, cfg)
    prof = get_profile(runtime)
    h, q, kv, f, L = 256, 8 * 32, 2 * 32, 688, 4
    per_token = (2 * prof.coeff("ew_rmsnorm_extra") * h + prof.coeff("ew_rope_extra") * (q + kv)
                 + prof.coeff("ew_glu_extra") * f)
    tokens = cfg.micro_batch * 512
    want = (cfg.grad_accum * L * passes * tokens * 2.0 * per_token
            / (TEST_GPU.mem_bw * prof.coeff("mem_eff")))
    te, tc = eager["time"], compiled["time"]
    # memory_bound_s holds the work and the launches its kernels leave exposed (fewer when the
    # work is longer): the work itself differs by the traffic. 1e-4: a difference of float32
    # sums ~40x its size (see the QLoRA test above)
    work = (te["memory_bound_s"] - te["launch_s"]) - (tc["memory_bound_s"] - tc["launch_s"])
    assert want > 0.0 and work == pytest.approx(want, rel=1e-4)
    for key in ("compute_s", "optimizer_s", "bubble_s", "comm_exposed_s", "grad_accum_s",
                "dequant_s"):
        assert te[key] == pytest.approx(tc[key], rel=F32), key
    assert tc["step_s"] < te["step_s"]
    assert eager["memory"] == compiled["memory"]


def test_compile_leaves_a_card_without_eager_chains_alone():
    """GPT-2's shape (LayerNorm: one native_layer_norm kernel; GELU; learned positions) has
    nothing an eager step runs op by op beyond the fused count: compiling changes nothing."""
    cfg = Config(micro_batch=2, grad_accum=1, remat="none")
    eager, compiled = _compile_pair(gpt_like(seq=512), "torchtitan", cfg)
    assert compiled["time"]["memory_bound_s"] == eager["time"]["memory_bound_s"]
    assert compiled["memory"] == eager["memory"]


@pytest.mark.parametrize("runtime", ["pytorch", "megatron", "xla-gpu", "xla-cpu"])
def test_compile_is_refused_where_the_ops_are_fused_already(runtime):
    from capopt._errors import CapoptError
    with pytest.raises(CapoptError) as err:
        make_scenario(llama_like(), runtime=runtime, compile=True)
    assert err.value.field == "training.compile" and "pytorch-eager" in err.value.allowed
    with pytest.raises(CapoptError, match="training.compile"):
        make_scenario(llama_like(), runtime="torchtitan", compile="yes")


def test_an_8bit_base_and_a_runtime_without_the_rule_add_no_dequantisation():
    cfg = Config(micro_batch=2, grad_accum=1, remat="full")
    (q8, _), _ = _qlora_pair("pytorch", cfg, base_bits=8)
    assert q8["time"]["dequant_s"] == 0.0        # LLM.int8's matmuls: not modelled here
    (qc, _), (b16c, _) = _qlora_pair("xla-cpu", cfg)
    assert qc["time"]["dequant_s"] == 0.0
    assert qc["time"]["memory_bound_s"] == pytest.approx(b16c["time"]["memory_bound_s"], rel=F32)


def test_dequantisation_splits_over_tensor_parallelism_but_not_replicated_kv():
    # tp 4 over 2 KV heads: k and v stay whole on every rank, the rest splits by 4
    cfg = Config(micro_batch=2, grad_accum=1, dp=1, tp=4)
    (q, n), _ = _qlora_pair("pytorch", cfg, tp_kv=True)
    h, f, kv, L = 256, 704, 64, 4
    per_rank = h * h / 4 + 2 * h * kv + h * h / 4 + 3 * h * f / 4
    rate = TEST_GPU.mem_bw * get_profile("pytorch").coeff("mem_eff")
    want = L * 2 * per_rank * (n["base_bytes"] + 2.0) / rate
    assert q["time"]["dequant_s"] == pytest.approx(want, rel=F32)


def test_dequantisation_of_experts_splits_over_ep():
    moe = llama_like(layers=2, hidden=256, heads=8, kv=8, intermediate_size=512, vocab=1000,
                     num_local_experts=8, num_experts_per_tok=2)
    sc = make_scenario(moe, runtime="pytorch", count=8, seq_len=256, global_batch=8,
                       lora=LoRA(rank=8, targets=("attn", "mlp"), base_bits=4))
    n = scenario_numbers(sc)
    rate = TEST_GPU.mem_bw * get_profile("pytorch").coeff("mem_eff")
    for ep in (1, 2, 8):
        t = est(Config(micro_batch=1, dp=8, ep=ep), sc)["time"]
        elems = n["lora_base_layer"] - (1 - 1 / ep) * n["lora_base_expert"]
        want = n["L"] * 2 * elems * (n["base_bytes"] + n["frozen_bytes"]) / rate
        assert t["dequant_s"] == pytest.approx(want, rel=F32)


def test_vit_patch_embedding_and_classifier():
    m = ModelSpec(name="tiny-vit", family="vit", hidden_size=48, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=192, image_size=32, patch_size=8,
                  num_labels=10)
    sc = make_scenario(m, seq_len=17)
    n = scenario_numbers(sc)
    k = py_knobs(mb=1, ga=1, dp=1)
    h, s, L, patches, pd = 48, 17, 2, 16, 3 * 64
    per_tok = L * 3 * (24 * h * h + 4 * s * h)
    per_seq = 3 * 2 * h * 10 + 2 * 2 * patches * pd * h     # classifier x3; patches fwd + dW
    assert model_flops(k, n) == s * per_tok + per_seq


def test_encoder_mlm_and_pooler():
    m = ModelSpec(name="tiny-bert", family="encoder", hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=128, vocab_size=100,
                  max_position_embeddings=64, type_vocab_size=2, mlm_head=True, pooler=True,
                  tie_word_embeddings=True)
    sc = make_scenario(m, seq_len=16)
    n = scenario_numbers(sc)
    k = py_knobs(mb=1, ga=1, dp=1)
    h, s, L, V = 32, 16, 2, 100
    per_tok = L * 3 * (24 * h * h + 4 * s * h) + 3 * 2 * (h * h + h * V)
    assert model_flops(k, n) == s * per_tok + 3 * 2 * h * h


def test_mlp_stack():
    m = ModelSpec(name="tiny-mlp", family="mlp", hidden_size=32, num_hidden_layers=3)
    sc = make_scenario(m, seq_len=1)
    n = scenario_numbers(sc)
    assert model_flops(py_knobs(mb=4, ga=1, dp=1), n) == 4 * 3 * 3 * 2 * 32 * 32


# ---------------------------------------------------------------------------------------------
# Matmul efficiency and communication
# ---------------------------------------------------------------------------------------------


def test_small_matmuls_reach_less_of_peak():
    n = numbers_pytree(make_scenario())
    effs = [float(matmul_efficiency(jnp.float32(m), n)) for m in (8, 64, 512, 4096, 65536)]
    assert effs == sorted(effs)
    assert effs[-1] < float(n["rt_gemm_eff_max"]) and effs[0] < 0.1 * effs[-1]
    # at m = the roofline ridge point the efficiency is half the maximum
    ridge = n["matmul_peak"] * n["act_bytes"] / (2 * n["mem_bw"])
    assert float(matmul_efficiency(ridge, n)) == pytest.approx(
        0.5 * float(n["rt_gemm_eff_max"]), rel=F32)


def test_group_layout_follows_megatron_placement():
    # tensor-parallel ranks innermost: tp = 8 fills a node; data-parallel behind it, one per node
    assert [float(x) for x in comm.group_layout(8.0, 1.0, 8.0)] == [8.0, 1.0]
    assert [float(x) for x in comm.group_layout(16.0, 1.0, 8.0)] == [8.0, 2.0]
    assert [float(x) for x in comm.group_layout(4.0, 8.0, 8.0)] == [1.0, 4.0]
    assert [float(x) for x in comm.group_layout(4.0, 2.0, 8.0)] == [4.0, 1.0]
    assert [float(x) for x in comm.group_layout(8.0, 2.0, 8.0)] == [4.0, 2.0]


def test_ring_all_reduce_inside_a_node_is_the_alpha_beta_formula():
    n = numbers_pytree(make_scenario())
    size, S = 8.0, 64e6
    got = float(comm.all_reduce_s(S, size, size, 1.0, n))
    bw = float(n["intra_bw"] * n["rt_nvlink_eff"])
    lat = float(n["rt_alpha_base_s"] + 2 * (size - 1) * n["rt_alpha_intra_s"])
    assert got == pytest.approx(2 * (size - 1) / size * S / bw + lat, rel=F32)
    # a group of one moves nothing and waits for nothing
    assert float(comm.all_reduce_s(S, 1.0, 1.0, 1.0, n)) == 0.0
    assert float(comm.all_to_all_s(S, 1.0, 1.0, 1.0, n)) == 0.0


def test_across_nodes_the_network_is_the_bottleneck():
    n = numbers_pytree(make_scenario())
    S = 1e9
    one_node = float(comm.all_gather_s(S, 8.0, 8.0, 1.0, n))
    one_per_node = float(comm.all_gather_s(S, 8.0, 1.0, 8.0, n))
    two_nodes = float(comm.all_gather_s(S, 16.0, 8.0, 2.0, n))
    assert one_node < two_nodes < one_per_node
    bw_inter = float(n["inter_bw"] * n["rt_net_eff"])
    latency = float(n["rt_alpha_base_s"] + 7 * n["rt_alpha_inter_s"])
    assert one_per_node == pytest.approx(7 / 8 * S / bw_inter + latency, rel=F32)


@pytest.mark.parametrize("comm_s, window_s, fraction, hidden", [
    (1.0, 10.0, 0.5, 0.5),      # short collective: the part issued ahead hides entirely
    (10.0, 1.0, 0.5, 1.0),      # long collective: it covers the whole window
    (10.0, 4.0, 0.5, 4.0),
    (4.0, 10.0, 1.0, 4.0),
    (4.0, 10.0, 0.0, 0.0),      # nothing issued ahead hides nothing
    (4.0, -1.0, 1.0, 0.0)])     # no window
def test_overlap_hides_its_fraction_of_the_collective_up_to_the_window(comm_s, window_s,
                                                                        fraction, hidden):
    exposed, got = (float(x) for x in comm.overlap(comm_s, window_s, fraction))
    assert got == pytest.approx(hidden, rel=F32)
    assert exposed == pytest.approx(comm_s - hidden, rel=F32)


@given(st.floats(0.0, 1e3), st.floats(-1.0, 1e3), st.floats(0.0, 1.0))
@settings(max_examples=200, deadline=None)
def test_overlap_never_hides_more_than_the_window_or_its_fraction(comm_s, window_s, fraction):
    exposed, hidden = (float(x) for x in comm.overlap(comm_s, window_s, fraction))
    # float32 arithmetic on values up to 1e3: a few ulps of 1e3
    tol = 1e-4
    assert -tol <= hidden <= max(window_s, 0.0) + tol
    assert hidden <= fraction * comm_s + tol
    assert exposed >= -tol
    # the step is never shorter than its longer part: compute + exposed >= max(compute, comm)
    if window_s >= 0.0:
        assert window_s + exposed >= max(window_s, comm_s) - tol


@given(st.lists(st.tuples(st.floats(0.0, 1e3), st.floats(0.0, 1.0)), min_size=1, max_size=3),
       st.floats(0.0, 1e3))
@settings(max_examples=200, deadline=None)
def test_kinds_sharing_a_window_hide_no_more_than_it_together(kinds, window_s):
    comms = [jnp.float32(c) for c, _ in kinds]
    out = comm.overlap_shared(comms, jnp.float32(window_s), [f for _, f in kinds])
    hidden = [float(h) for _, h in out]
    tol = 1e-3       # float32 sums of values up to 1e3
    assert sum(hidden) <= window_s + tol
    for (c, f), (e, h) in zip(kinds, out):
        assert -tol <= float(h) <= f * c + tol and float(e) >= -tol
    # one kind alone is `overlap`
    if len(kinds) == 1:
        assert hidden[0] == pytest.approx(float(comm.overlap(comms[0], window_s, kinds[0][1])[1]),
                                          rel=1e-5, abs=tol)


def test_shared_overlap_has_finite_gradients_where_nothing_communicates():
    g = jax.grad(lambda a, b: sum(e for e, _ in comm.overlap_shared([a, b], 2.0, [0.5, 0.5])),
                 argnums=(0, 1))(0.0, 0.0)
    assert all(np.isfinite(float(x)) for x in g)


# ---------------------------------------------------------------------------------------------
# Time terms
# ---------------------------------------------------------------------------------------------
TIME_KEYS = {"compute_s", "memory_bound_s", "comm_dp_s", "comm_zero_s", "comm_tp_s",
             "comm_pp_s", "comm_moe_s", "comm_cp_s", "comm_exposed_s", "comm_hidden_s", "bubble_s",
             "optimizer_s", "offload_s", "input_s", "step_s", "grad_accum_s", "launch_s",
             "dequant_s", "paging_s"}
THROUGHPUT_KEYS = {"tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "mfu", "hfu",
                   "model_flops", "hardware_flops", "tflops_per_device", "time_to_train_s",
                   "cost_per_million_tokens", "gemm_tflops", "gemm_peak_share",
                   "attention_tflops", "attention_peak_share", "hbm_tb_s", "nccl_intra_gb_s",
                   "nccl_inter_gb_s"}


def test_terms_are_named_and_add_up():
    sc = make_scenario(count=16, global_batch=64)
    cfg = Config(micro_batch=2, grad_accum=16, dp=2, tp=4, pp=2, remat="full")
    e = est(cfg, sc)
    t, thr = e["time"], e["throughput"]
    assert set(t) == TIME_KEYS and set(thr) == THROUGHPUT_KEYS
    kinds = sum(t[f"comm_{k}_s"] for k in ("dp", "zero", "tp", "pp", "moe", "cp"))
    assert t["comm_exposed_s"] == pytest.approx(kinds, rel=F32)
    parts = (t["compute_s"] + t["memory_bound_s"] + t["comm_exposed_s"] + t["bubble_s"]
             + t["optimizer_s"] + t["offload_s"])
    assert t["step_s"] == pytest.approx(parts, rel=F32)
    assert thr["tokens_per_s"] == pytest.approx(64 * 512 / t["step_s"], rel=F32)
    assert thr["tokens_per_s_per_device"] == pytest.approx(thr["tokens_per_s"] / 16, rel=F32)
    assert 0 < thr["mfu"] <= thr["hfu"] < 1


@pytest.mark.parametrize("precision, flash", [("bf16-mixed", True), ("fp8-mixed", True),
                                               ("bf16-mixed", False)])
def test_mfu_never_exceeds_the_rates_the_kernels_are_given(precision, flash):
    """The step's model FLOPs run no faster than the GEMM and attention rates the plan shows
    (`assumed_rates`): MFU is at most the larger of their shares of the matmul peak, on a
    small and an 8B-class card, one device and 8."""
    from capopt._cards import load_card
    for model, count in ((gpt_like(), 1), (load_card("llama-3.1-8b"), 8)):
        sc = make_scenario(model, runtime="pytorch", count=count, global_batch=8 * count,
                           seq_len=2048, precision=precision)
        cfg = Config(micro_batch=1, grad_accum=8, dp=count, zero_stage=3 if count > 1 else 0,
                     flash_attention=flash)
        thr = est(cfg, sc)["throughput"]
        attn_vs_matmul = thr["attention_tflops"] / (thr["gemm_tflops"] / thr["gemm_peak_share"])
        assert 0 < thr["mfu"] <= max(thr["gemm_peak_share"], attn_vs_matmul) * (1 + F32)


def test_bubble_is_the_1f1b_fraction_and_vanishes_at_one_stage():
    sc = make_scenario(count=8, global_batch=16)
    for pp, ga in ((4, 8), (2, 3), (8, 16)):
        cfg = Config(micro_batch=1, grad_accum=ga, dp=1, tp=1, pp=pp)
        t = est(cfg, sc.replace(count=pp))["time"]
        per_step = t["comm_dp_s"] + t["optimizer_s"] + t["offload_s"]
        pipeline = t["step_s"] - per_step
        assert t["bubble_s"] / pipeline == pytest.approx((pp - 1) / (ga + pp - 1), rel=F32)
    flat = est(Config(micro_batch=1, grad_accum=8, dp=8), sc)["time"]
    assert flat["bubble_s"] == 0.0 and flat["comm_pp_s"] == 0.0


def test_interleaving_divides_the_bubble():
    sc = make_scenario(gpt_like(layers=8), count=4, global_batch=8)
    cfg = Config(micro_batch=1, grad_accum=8, dp=1, pp=4)
    plain = est(cfg, sc)["time"]
    inter = est(cfg.replace(vpp=2), sc)["time"]
    # same per-micro-batch work plus twice the point-to-point traffic
    t_mb_plain = plain["bubble_s"] / 3.0
    t_mb_inter = inter["bubble_s"] / 1.5
    assert t_mb_inter > t_mb_plain
    assert inter["comm_pp_s"] == pytest.approx(2 * plain["comm_pp_s"], rel=F32)
    assert inter["bubble_s"] < plain["bubble_s"]


def test_single_device_has_no_communication():
    sc = make_scenario(count=1, global_batch=8)
    t = est(Config(micro_batch=2, grad_accum=4), sc)["time"]
    for kind in ("dp", "zero", "tp", "pp", "moe"):
        assert t[f"comm_{kind}_s"] == 0.0
    assert t["comm_hidden_s"] == 0.0


def test_recomputation_costs_time_and_sequence_parallelism_saves_some():
    sc = make_scenario(gpt_like(layers=4, hidden=1024, heads=16, seq=1024), count=8,
                       seq_len=1024, global_batch=8)
    base = dict(micro_batch=1, grad_accum=1, dp=1, tp=8, flash_attention=False)
    none = est(Config(**base), sc)["time"]["step_s"]
    sel = est(Config(**base, remat="selective"), sc)["time"]["step_s"]
    full = est(Config(**base, remat="full"), sc)["time"]["step_s"]
    sp = est(Config(**base, sequence_parallel=True), sc)["time"]["step_s"]
    assert none < sel < full and sp < none


def test_fp8_recipes_leave_the_attention_core_in_16_bits():
    """torchao's float8 and Transformer Engine quantise the linear layers: with every weight
    GEMM removed, a block takes as long under fp8-mixed as under bf16-mixed; with them, less."""
    from capopt.cost.flops import compute_times
    k = knobs_from_config(Config(micro_batch=2, flash_attention=True))
    times = {}
    for prec in ("bf16-mixed", "fp8-mixed"):
        n = numbers_pytree(make_scenario(runtime="pytorch", precision=prec, seq_len=2048,
                                         hardware=get_hardware("h100-sxm-80gb")))
        core = {**n, **{w: jnp.zeros_like(n[w]) for w in n if w.startswith("W_")}}
        times[prec] = (float(compute_times(k, n)["layer"]), float(compute_times(k, core)["layer"]))
    assert times["fp8-mixed"][1] == pytest.approx(times["bf16-mixed"][1], rel=F32)
    assert times["fp8-mixed"][0] < times["bf16-mixed"][0]


def test_tensor_parallelism_shrinks_matmuls_and_their_efficiency():
    sc = make_scenario(count=8, global_batch=8)
    c1 = est(Config(micro_batch=1, grad_accum=1, dp=8, tp=1), sc)
    c8 = est(Config(micro_batch=8, grad_accum=1, dp=1, tp=8), sc)
    # the same work per device, run as one eighth of every matmul: slower per FLOP
    assert c8["time"]["compute_s"] > c1["time"]["compute_s"]
    assert c8["time"]["comm_tp_s"] > 0.0


def test_offload_moves_optimizer_state_over_the_host_link():
    sc = make_scenario(count=1, global_batch=4, runtime="pytorch")
    cfg = Config(micro_batch=1, grad_accum=4, offload_optimizer=True)
    e = estimate(cfg, sc)
    n = numbers_pytree(sc)
    want = 2 * e.memory["host_optimizer_bytes"] / (n["host_bw"] * n["rt_host_eff"])
    assert float(e.time["offload_s"]) == pytest.approx(float(want), rel=F32)
    assert float(e.time["offload_s"]) > 0
    assert est(cfg.replace(offload_optimizer=False), sc)["time"]["offload_s"] == 0.0


def test_a_slow_input_pipeline_makes_the_run_data_bound():
    sc = make_scenario(count=8, global_batch=64, input_samples_per_s=1.0)
    t = est(Config(micro_batch=2, grad_accum=4, dp=8), sc)["time"]
    assert t["input_s"] == pytest.approx(64.0) and t["step_s"] == t["input_s"]
    fast = make_scenario(count=8, global_batch=64, input_samples_per_s=1e9)
    t2 = est(Config(micro_batch=2, grad_accum=4, dp=8), fast)["time"]
    assert t2["step_s"] > t2["input_s"] > 0


def test_time_to_train_and_cost():
    cfg = Config(micro_batch=2, grad_accum=4, dp=8)
    plain = est(cfg, make_scenario(count=8, global_batch=64))["throughput"]
    assert plain["time_to_train_s"] == 0.0 and plain["cost_per_million_tokens"] == 0.0
    sc = make_scenario(count=8, global_batch=64, train_tokens=1e9).replace(
        price_per_gpu_hour=2.0)
    thr = est(cfg, sc)["throughput"]
    assert thr["time_to_train_s"] == pytest.approx(1e9 / thr["tokens_per_s"], rel=F32)
    usd_per_s = 2.0 * 8 / 3600
    assert thr["cost_per_million_tokens"] == pytest.approx(
        usd_per_s / thr["tokens_per_s"] * 1e6, rel=F32)


def test_zero3_gathers_weights_every_micro_batch():
    sc = make_scenario(count=8, global_batch=64)
    z0 = est(Config(micro_batch=1, grad_accum=8, dp=8, zero_stage=0), sc)["time"]
    z3a = est(Config(micro_batch=1, grad_accum=8, dp=8, zero_stage=3), sc)["time"]
    z3b = est(Config(micro_batch=2, grad_accum=4, dp=8, zero_stage=3), sc)["time"]
    assert z0["comm_zero_s"] == 0.0 and z3a["comm_dp_s"] == 0.0
    assert z3a["comm_zero_s"] + z3a["comm_hidden_s"] > z3b["comm_zero_s"] + z3b["comm_hidden_s"]


def _zero3_scenario(ga, *, runtime="pytorch", **coeffs):
    """One node of 8, ZeRO-3 over all of them, the latency terms switched off."""
    sc = make_scenario(count=8, global_batch=8 * ga, runtime=runtime)
    zero_lat = dict(alpha_base_s=0.0, alpha_intra_s=0.0, alpha_inter_s=0.0)
    return sc.replace(runtime=sc.runtime.with_coeffs(**zero_lat, **coeffs))


def _zero3_total(t):
    # only ZeRO-3 communicates at tp = pp = 1: exposed + hidden is all of it
    return t["comm_zero_s"] + t["comm_hidden_s"]


def test_zero3_traffic_is_per_micro_batch_so_it_grows_with_grad_accum():
    # fixed micro-batch: every extra micro-batch gathers the weights and reduce-scatters the
    # gradients again, so the ZeRO-3 traffic of a step is exactly m times that of one
    times = {ga: est(Config(micro_batch=1, grad_accum=ga, dp=8, zero_stage=3),
                     _zero3_scenario(ga))["time"] for ga in (1, 2, 4)}
    for ga in (2, 4):
        assert _zero3_total(times[ga]) == pytest.approx(ga * _zero3_total(times[1]), rel=F32)
    assert times[1]["comm_zero_s"] < times[2]["comm_zero_s"] < times[4]["comm_zero_s"]
    assert all(t["comm_dp_s"] == 0.0 for t in times.values())


@pytest.mark.parametrize("remat, gathers", [("none", 2), ("full", 3)])
def test_zero3_bytes_match_the_closed_form(remat, gathers):
    # 8 ranks in one node, no latency, nothing hidden: per micro-batch every parameter is
    # gathered `gathers` times (forward, backward, recomputed forward) and its gradient
    # reduce-scattered once, each moving S (N-1)/N bytes over NVLink (bf16: 2 bytes each)
    sc = _zero3_scenario(1, overlap_zero=0.0)
    t = est(Config(micro_batch=1, grad_accum=1, dp=8, zero_stage=3, remat=remat), sc)["time"]
    n = numbers_pytree(sc)
    P = sc.model.num_params()
    bw = float(n["intra_bw"] * n["rt_nvlink_eff"])
    expected = (gathers + 1) * 2.0 * P * 7 / 8 / bw
    assert t["comm_hidden_s"] == 0.0
    assert t["comm_zero_s"] == pytest.approx(expected, rel=1e-4)


def test_a_slow_zero3_fetch_path_adds_to_every_gather():
    cfg = Config(micro_batch=1, grad_accum=2, dp=8, zero_stage=3, remat="none")
    base = est(cfg, _zero3_scenario(2, overlap_zero=0.0))["time"]
    slow_sc = _zero3_scenario(2, overlap_zero=0.0, zero3_fetch_s_per_gb=1.0)
    slow = est(cfg, slow_sc)["time"]
    P = slow_sc.model.num_params()
    # 1 s per GB a rank receives, in series with the collectives: two gathers per micro-batch
    # (no recomputation), two micro-batches, 7/8 of the weights from the other ranks
    fetch = 2 * 2 * 2.0 * P / 1e9 * 7 / 8
    assert slow["comm_zero_s"] == pytest.approx(base["comm_zero_s"] + fetch, rel=1e-4)
    # other ZeRO stages and a group of one never touch the fetch path
    for cfg in (Config(micro_batch=1, grad_accum=2, dp=8, zero_stage=1),
                Config(micro_batch=2, grad_accum=8, dp=1, tp=8, zero_stage=3)):
        a = est(cfg, _zero3_scenario(2))["time"]["step_s"]
        b = est(cfg, _zero3_scenario(2, zero3_fetch_s_per_gb=1.0))["time"]["step_s"]
        assert a == b


def test_moe_all_to_all_only_with_expert_parallelism():
    m = llama_like(layers=2, hidden=256, heads=8, kv=2, num_local_experts=8,
                   num_experts_per_tok=2)
    sc = make_scenario(m, count=8, global_batch=32)
    no_ep = est(Config(micro_batch=1, grad_accum=4, dp=8, ep=1), sc)["time"]
    ep = est(Config(micro_batch=1, grad_accum=4, dp=8, ep=8), sc)["time"]
    assert no_ep["comm_moe_s"] == 0.0 and ep["comm_moe_s"] > 0.0


# ---------------------------------------------------------------------------------------------
# Properties over random configs (relaxed knobs included)
# ---------------------------------------------------------------------------------------------
POW2 = st.sampled_from([1, 2, 4, 8])


@st.composite
def knobs(draw, relaxed=False):
    def num(base):      # relaxed degrees stay >= 1, the smallest meaningful value
        return max(1.0, float(base) * (draw(st.floats(0.7, 1.4)) if relaxed else 1.0))

    def weights(size):
        if relaxed:
            w = np.asarray(draw(st.lists(st.floats(0.01, 1.0), min_size=size, max_size=size)))
            return tuple((w / w.sum()).tolist())
        one = [0.0] * size
        one[draw(st.integers(0, size - 1))] = 1.0
        return tuple(one)

    def frac():
        return draw(st.floats(0.0, 1.0)) if relaxed else float(draw(st.booleans()))

    dp = draw(POW2)
    return Knobs(micro_batch=jnp.float32(num(draw(POW2))), grad_accum=jnp.float32(num(draw(POW2))),
                 dp=jnp.float32(num(dp)), tp=jnp.float32(num(draw(POW2))),
                 pp=jnp.float32(num(draw(st.sampled_from([1, 2, 4])))),
                 ep=jnp.float32(num(draw(st.sampled_from([e for e in (1, 2, 4) if e <= dp])))),
                 zero=jnp.asarray(weights(4), jnp.float32),
                 remat=jnp.asarray(weights(3), jnp.float32),
                 sp=jnp.float32(frac()), offload=jnp.float32(frac()),
                 flash=jnp.float32(frac()),
                 cp=jnp.float32(num(draw(st.sampled_from([1, 2, 4])))), vpp=jnp.float32(1.0))


SCENARIOS = {
    "gpt": make_scenario(gpt_like(layers=4), count=64, global_batch=64),
    "moe": make_scenario(llama_like(layers=4, num_local_experts=4, num_experts_per_tok=2),
                         count=64, global_batch=64, runtime="pytorch"),
    "lora": make_scenario(llama_like(layers=4), count=64, global_batch=64,
                          lora=LoRA(rank=8, base_bits=4), input_samples_per_s=50.0),
}
NUMBERS = {k: numbers_pytree(sc) for k, sc in SCENARIOS.items()}
_jit_estimate = jax.jit(estimate_numbers)


@settings(max_examples=60, deadline=None)
@given(k=knobs(relaxed=True), which=st.sampled_from(sorted(SCENARIOS)))
def test_every_time_term_is_finite_and_no_exposure_is_negative(k, which):
    e = _jit_estimate(k, NUMBERS[which])
    for key, v in e.time.items():
        assert np.isfinite(float(v)), key
        assert float(v) >= 0.0, key
    for kind in ("dp", "zero", "tp", "pp", "moe", "cp"):
        assert float(e.time[f"comm_{kind}_s"]) >= 0.0
    for key, v in e.throughput.items():
        assert np.isfinite(float(v)), key


@settings(max_examples=40, deadline=None)
@given(k=knobs(), which=st.sampled_from(sorted(SCENARIOS)))
def test_more_replicas_at_fixed_per_device_work_never_lower_aggregate_flops(k, which):
    n = {key: float(v) for key, v in scenario_numbers(SCENARIOS[which]).items()}
    small = Knobs(**{f: (float(v) if np.ndim(v) == 0 else tuple(np.asarray(v).tolist()))
                     for f, v in vars(k).items()})
    big = small.replace(dp=2 * small.dp)
    assert model_flops(big, n) >= model_flops(small, n)
    assert hardware_flops(big, n) >= hardware_flops(small, n) >= model_flops(small, n)


@settings(max_examples=40, deadline=None)
@given(k=knobs(), which=st.sampled_from(sorted(SCENARIOS)))
def test_the_bubble_vanishes_at_one_stage(k, which):
    e = _jit_estimate(k.replace(pp=jnp.float32(1.0)), NUMBERS[which])
    assert float(e.time["bubble_s"]) == 0.0 and float(e.time["comm_pp_s"]) == 0.0


# ---------------------------------------------------------------------------------------------
# JAX: gradients, vmap, jit
# ---------------------------------------------------------------------------------------------


def test_grad_of_step_time_is_finite_at_relaxed_points():
    n = NUMBERS["moe"]
    k = RELAXED_KNOBS
    g = jax.grad(lambda kk: estimate_numbers(kk, n).time["step_s"])(k)
    leaves = jax.tree.leaves(g)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in leaves)
    assert any(np.any(np.asarray(x) != 0.0) for x in leaves)
    # throughput is differentiable too
    g2 = jax.grad(lambda kk: estimate_numbers(kk, n).throughput["tokens_per_s"])(k)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(g2))


def test_zero3_fetch_cost_is_smooth_in_the_relaxed_knobs():
    # a nonzero fetch cost keeps the step time differentiable at relaxed points and pulls the
    # gradient towards fewer ZeRO-3 shards' worth of traffic per step (more micro-batches cost)
    n = numbers_pytree(_zero3_scenario(4, zero3_fetch_s_per_gb=0.05))
    k = Knobs(micro_batch=jnp.float32(1.5), grad_accum=jnp.float32(2.5), dp=jnp.float32(5.5),
              tp=jnp.float32(1.4), pp=jnp.float32(1.0), ep=jnp.float32(1.0),
              zero=jnp.asarray([0.1, 0.1, 0.1, 0.7], jnp.float32),
              remat=jnp.asarray([0.2, 0.3, 0.5], jnp.float32), sp=jnp.float32(0.0),
              offload=jnp.float32(0.0), flash=jnp.float32(0.0), cp=jnp.float32(1.0),
              vpp=jnp.float32(1.0))
    g = jax.grad(lambda kk: estimate_numbers(kk, n).time["comm_zero_s"])(k)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(g))
    assert float(g.grad_accum) > 0.0 and float(g.zero[3]) > 0.0


def test_vmap_equals_per_config_estimates():
    sc = SCENARIOS["gpt"]
    configs = [Config(micro_batch=1, grad_accum=8, dp=8, tp=4, pp=2, remat="full"),
               Config(micro_batch=2, grad_accum=1, dp=32, tp=2, zero_stage=3),
               Config(micro_batch=1, grad_accum=4, dp=16, tp=2, pp=2, sequence_parallel=True,
                      remat="selective", flash_attention=False),
               Config(micro_batch=4, grad_accum=2, dp=8, tp=8, offload_optimizer=True)]
    n = numbers_pytree(sc)
    batched = jax.jit(jax.vmap(estimate_numbers, in_axes=(0, None)))(stack_knobs(configs), n)
    for i, cfg in enumerate(configs):
        one = estimate(cfg, sc)
        for part in ("time", "throughput"):
            a, b = getattr(one, part), getattr(batched, part)
            for key in a:
                np.testing.assert_allclose(np.asarray(b[key])[i], np.asarray(a[key]),
                                           rtol=F32, err_msg=f"{part}.{key}")


def test_jit_and_eager_agree():
    sc = SCENARIOS["lora"]
    cfg = Config(micro_batch=2, grad_accum=2, dp=16, tp=2, pp=2)
    eager = estimate(cfg, sc, jit=False).to_dict()
    jitted = estimate(cfg, sc).to_dict()
    for part in ("time", "throughput"):
        for key, v in eager[part].items():
            assert jitted[part][key] == pytest.approx(v, rel=F32, abs=1e-12), key


def test_integer_points_are_exact_mixtures():
    # a relaxed remat weight halfway between two policies interpolates their FLOPs linearly
    n = _gpt_numbers()
    none = hardware_flops(py_knobs(remat=(1.0, 0.0, 0.0)), n)
    full = hardware_flops(py_knobs(remat=(0.0, 0.0, 1.0)), n)
    half = hardware_flops(py_knobs(remat=(0.5, 0.0, 0.5)), n)
    assert half == (none + full) / 2
    b = block_flops(n)
    assert b["attn"] == 4 * GPT["seq"] * GPT["hidden"]
    assert math.isclose(sum(b[k] for k in ("qkv", "out", "mlp_in", "mlp_out")),
                        24 * GPT["hidden"] ** 2)


def test_knobs_from_config_round_trip():
    k = knobs_from_config(Config(micro_batch=2, grad_accum=3, dp=4, remat="selective"))
    assert float(k.micro_batch * k.grad_accum * k.dp) == 24.0


# ---------------------------------------------------------------------------------------------
# Costs that grow with the number of micro-batches: accumulation, kernel overhead, weight reads
# ---------------------------------------------------------------------------------------------
from capopt import load_scenario  # noqa: E402
from capopt.cost import time as time_mod  # noqa: E402
from capopt.cost.flops import gemm_dim  # noqa: E402


def test_fewer_larger_micro_batches_are_faster_at_a_fixed_global_batch():
    # GPT-2 124M on a 24 GB card, 512 sequences per step: every split fits, and each halving
    # of the micro-batch count saves accumulation adds, kernels and weight re-reads
    sc = load_scenario("gpt2-124m-rtx4090")
    steps = []
    for mb in (2, 4, 8, 16):
        e = est(Config(micro_batch=mb, grad_accum=512 // mb, remat="none"), sc)
        assert e["memory"]["total_bytes"] <= e["memory"]["budget_bytes"]
        steps.append(e["time"]["step_s"])
        assert 0.0 < e["time"]["grad_accum_s"] < e["time"]["memory_bound_s"]
        assert 0.0 < e["time"]["launch_s"]
    assert all(a > b for a, b in zip(steps, steps[1:])), steps


@pytest.mark.parametrize("runtime, adds, per_param", [
    ("xla-gpu", lambda m: m if m > 1 else 0, 3 * 4.0),  # scan from zeros; fp32 accumulator
    ("pytorch", lambda m: m - 1, 2.0 + 2 * 4.0),  # first backward writes .grad; fp32 main_grad
])
@pytest.mark.parametrize("zero, dp", [(0, 1), (2, 8), (3, 8)])
def test_accumulation_bytes_match_the_closed_form(runtime, adds, per_param, zero, dp):
    # a tiny card, one stage: adds x trainable parameters / dp (ZeRO-2/3 shards) x bytes, at
    # HBM bandwidth; nothing at grad_accum = 1
    model = gpt_like(layers=2, hidden=64, heads=4, vocab=256, seq=128)
    sc = make_scenario(model, runtime=runtime, count=dp, seq_len=128, global_batch=8 * dp)
    n = numbers_pytree(sc)
    P = sc.model.num_params()
    rate = float(n["mem_bw"] * n["rt_mem_eff"])
    for m in (1, 2, 8):
        cfg = Config(micro_batch=8 // m, grad_accum=m, dp=dp, zero_stage=zero)
        t = est(cfg, sc)["time"]
        shard = 1.0 / dp if zero >= 2 else 1.0
        expected = adds(m) * P * shard * per_param / rate
        assert t["grad_accum_s"] == pytest.approx(expected, rel=1e-4)
        if m == 1:
            assert t["grad_accum_s"] == 0.0


def test_accumulation_and_launch_are_smooth_at_relaxed_points():
    n = numbers_pytree(load_scenario("gpt2-124m-rtx4090"))
    k = Knobs(micro_batch=jnp.float32(5.5), grad_accum=jnp.float32(1.6), dp=jnp.float32(1.0),
              tp=jnp.float32(1.0), pp=jnp.float32(1.0), ep=jnp.float32(1.0),
              zero=jnp.asarray([1.0, 0.0, 0.0, 0.0], jnp.float32),
              remat=jnp.asarray([0.6, 0.2, 0.2], jnp.float32), sp=jnp.float32(0.0),
              offload=jnp.float32(0.0), flash=jnp.float32(0.7), cp=jnp.float32(1.0),
              vpp=jnp.float32(1.0))
    for key in ("grad_accum_s", "launch_s", "step_s"):
        g = jax.grad(lambda kk: estimate_numbers(kk, n).time[key])(k)
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(g)), key
    g = jax.grad(lambda kk: estimate_numbers(kk, n).time["grad_accum_s"])(k)
    assert float(g.grad_accum) > 0.0
    # between 1 and 2 micro-batches the accumulation term rises continuously from 0
    vals = [float(estimate_numbers(k.replace(grad_accum=jnp.float32(m)), n).time["grad_accum_s"])
            for m in (1.0, 1.25, 1.5, 2.0)]
    assert vals[0] == 0.0 and vals == sorted(vals) and vals[-1] > 0.0


def test_launches_hide_behind_long_kernels_and_pace_short_ones():
    # the stream takes max(work + K gap, K launch): with gap 0, a large micro-batch hides its
    # launches entirely; a tiny one is paced by them
    sc = load_scenario("gpt2-124m-rtx4090")
    sc = sc.replace(runtime=sc.runtime.with_coeffs(kernel_gap_s=0.0))
    big = est(Config(micro_batch=16, grad_accum=32, remat="none"), sc)["time"]
    assert big["launch_s"] == pytest.approx(0.0, abs=1e-6 * big["step_s"])
    tiny_sc = make_scenario(gpt_like(layers=2, hidden=64, heads=4, vocab=256, seq=128),
                            count=1, seq_len=128, global_batch=1)
    tiny_sc = tiny_sc.replace(runtime=tiny_sc.runtime.with_coeffs(kernel_gap_s=0.0))
    n = numbers_pytree(tiny_sc)
    # (as the runtime applies the knobs: at s = 128 its chunked attention is not blockwise)
    from capopt.cost._inputs import runtime_knobs
    k = runtime_knobs(knobs_from_config(Config(micro_batch=1, grad_accum=1)), n)
    t = est(Config(micro_batch=1, grad_accum=1), tiny_sc)["time"]
    kernels = float(time_mod.stage_kernels(k, n, n["L"]))
    per_step = float(n["L"] * n["rt_optimizer_kernels_per_layer"])
    launch = float(n["rt_kernel_launch_s"])
    paced = t["compute_s"] + t["memory_bound_s"]
    assert paced == pytest.approx(kernels * launch, rel=1e-3)
    assert t["optimizer_s"] == pytest.approx(per_step * launch, rel=1e-3)


def test_smooth_max_is_exact_away_from_the_crossover():
    for a, b in ((1.0, 0.25), (0.3, 3.0), (5e-3, 1e-3)):
        assert float(time_mod.smooth_max(jnp.float32(a), jnp.float32(b))) == pytest.approx(
            max(a, b), rel=F32)
    assert float(time_mod.smooth_max(jnp.float32(0.0), jnp.float32(0.0))) == 0.0
    at = float(time_mod.smooth_max(jnp.float32(1.0), jnp.float32(1.0)))
    assert 1.0 < at < 1.0 + 0.1 * math.log(2.0) + 1e-6


def test_zero2_reduce_scatters_every_micro_batch():
    # ZeRO-2 keeps a sharded accumulator: its gradient traffic grows with the micro-batches,
    # ZeRO-1's (one reduce-scatter of the accumulated gradients) does not
    def total(zero, ga):
        sc = _zero3_scenario(ga)
        t = est(Config(micro_batch=1, grad_accum=ga, dp=8, zero_stage=zero), sc)["time"]
        return t["comm_zero_s"] + t["comm_hidden_s"]
    z1 = [total(1, ga) for ga in (1, 4)]
    z2 = [total(2, ga) for ga in (1, 4)]
    assert z1[0] == pytest.approx(z2[0], rel=F32)
    assert z1[1] == pytest.approx(z1[0], rel=F32)
    assert z2[1] > 3.0 * z2[0] - z1[0]


@pytest.mark.parametrize("remat", ["none", "full"])
def test_fsdp_zero2_gathers_once_and_reduce_scatters_once_per_group(remat):
    # FSDP's ZeRO-2 (reshard_after_forward=False / SHARD_GRAD_OP, zero2_per_group = 1): per
    # micro-batch each parameter is gathered once (in the profile's gathered dtype, the copy
    # kept to the backward pass, recomputation included) and its gradient reduce-scattered
    # once, S (N-1)/N bytes each over NVLink; nothing after the step. ZeRO-3 gathers twice,
    # recomputation or not (the checkpointed block recomputes inside its backward, on the
    # backward's gather): the difference is exactly the gather ZeRO-2 keeps.
    sc = _zero3_scenario(1, runtime="pytorch-eager", overlap_zero=0.0)
    n = numbers_pytree(sc)
    assert sc.runtime.coeff("zero2_per_group") == 1.0
    cfg = Config(micro_batch=1, grad_accum=1, dp=8, zero_stage=2, remat=remat)
    t2 = est(cfg, sc)["time"]
    t3 = est(cfg.replace(zero_stage=3), sc)["time"]
    P = sc.model.num_params()
    bw = float(n["intra_bw"] * n["rt_nvlink_eff"])
    # (pytorch-eager gathers FSDP2's float32 parameters, casting under autocast after)
    gather = float(gathered_param_bytes(n)) * P * 7 / 8 / bw
    scatter = float(n["grad_bytes"]) * P * 7 / 8 / bw
    assert float(gathered_param_bytes(n)) == float(n["grad_bytes"]) == 4.0
    assert t2["comm_hidden_s"] == 0.0 and t2["comm_dp_s"] == 0.0
    # (the ring's bytes and bandwidths in float32, per collective and summed: a few F32;
    # the ZeRO-3 difference cancels the common part, ten)
    assert t2["comm_zero_s"] == pytest.approx(gather + scatter, rel=4 * F32)
    assert t3["comm_zero_s"] - t2["comm_zero_s"] == pytest.approx(gather, rel=10 * F32)


def test_deepspeed_zero3_gathers_again_for_recomputation_and_fsdp_does_not():
    # DeepSpeed's module hooks gather a fully recomputed block's parameters a third time for
    # the recomputation (the pytorch profile); FSDP recomputes inside the block's backward on
    # the backward's gather (pytorch-eager): full recomputation adds one gather of all the
    # parameters per micro-batch to the first and none to the second
    cfg = Config(micro_batch=1, grad_accum=1, dp=8, zero_stage=3)
    extra = {}
    for runtime in ("pytorch", "pytorch-eager"):
        sc = _zero3_scenario(1, runtime=runtime, overlap_zero=0.0, zero3_fetch_s_per_gb=0.0)
        none = est(cfg, sc)["time"]["comm_zero_s"]
        full = est(cfg.replace(remat="full"), sc)["time"]["comm_zero_s"]
        n = numbers_pytree(sc)
        one = (float(gathered_param_bytes(n)) * sc.model.num_params() * 7 / 8
               / float(n["intra_bw"] * n["rt_nvlink_eff"]))
        extra[runtime] = (full - none) / one
    # (a difference of float32 totals about three gathers large: a few roundings)
    assert extra["pytorch"] == pytest.approx(1.0, rel=10 * F32)
    assert extra["pytorch-eager"] == pytest.approx(0.0, abs=10 * F32)


def test_fsdp_zero2_has_no_gradient_buckets_and_deepspeeds_has():
    # DeepSpeed's stage 2 (the pytorch profile) reduce-scatters in dp_bucket_bytes buckets, a
    # latency each; FSDP's (pytorch-eager) one collective per group, whatever the bucket size
    cfg = Config(micro_batch=1, grad_accum=2, dp=8, zero_stage=2)

    def comm(runtime, bucket):
        sc = make_scenario(count=8, global_batch=16, runtime=runtime)
        sc = sc.replace(runtime=sc.runtime.with_coeffs(dp_bucket_bytes=bucket))
        t = est(cfg, sc)["time"]
        return t["comm_zero_s"] + t["comm_hidden_s"]
    assert comm("pytorch-eager", 1e6) == pytest.approx(comm("pytorch-eager", 1e9), rel=F32)
    assert comm("pytorch", 1e6) > comm("pytorch", 1e9)


def test_flash_attention_runs_at_its_hopper_share_on_hopper_only():
    # pytorch-eager's SDPA flash kernel (FlashAttention-2) reaches 0.34 of H100's peak on long
    # sequences at head dim 128 and the base's flash_eff on Ampere; the pytorch profile names
    # no Hopper value: flash_eff on both
    model = llama_like(layers=2, hidden=512, heads=4, kv=4)
    eff = {}
    for runtime in ("pytorch-eager", "pytorch"):
        for gpu in ("h100-sxm-80gb", "a100-sxm-80gb", "h200-sxm-141gb"):
            sc = make_scenario(model, runtime=runtime, seq_len=4096, hardware=get_hardware(gpu))
            eff[runtime, gpu] = float(scenario_numbers(sc)["rt_flash_eff"])
    base = get_profile("pytorch").coeff("flash_eff")
    # (at 4096 tokens, FlashAttention-2's curve over sequence length: 0.34 x 4096 / 4306)
    at_4k = 0.34 * 4096 / (4096 + 210)
    assert eff["pytorch-eager", "h100-sxm-80gb"] == pytest.approx(at_4k, rel=F32)
    assert eff["pytorch-eager", "h200-sxm-141gb"] == pytest.approx(at_4k, rel=F32)
    assert eff["pytorch-eager", "a100-sxm-80gb"] == base
    assert {eff["pytorch", g] for g in ("h100-sxm-80gb", "a100-sxm-80gb")} == {base}
    # and the attention's seconds follow: compute on H100 differs by the attention alone
    cfg = Config(micro_batch=1, grad_accum=1, dp=8, flash_attention=True)
    h100 = make_scenario(model, runtime="pytorch-eager", seq_len=4096,
                         hardware=get_hardware("h100-sxm-80gb"))
    slow = est(cfg, h100)["time"]["compute_s"]
    fast = est(cfg, h100.replace(runtime=h100.runtime.with_coeffs(flash_eff_sm90=base,
                                                                  flash_half_seq_sm90=0.0)))
    # by the attention core's FLOPs at the two shares: 2 blocks x 4096 tokens x 4 s h per
    # token and block forward, 3.5 passes (forward, backward's two, FlashAttention-2's
    # recomputed half)
    n = scenario_numbers(h100)
    attn_flops = 2 * 4096 * 4 * 4096.0 * 512 * 3.5
    expected = attn_flops * (1 / at_4k - 1 / base) / float(n["attn_peak"])
    # (a difference of two float32 totals about three times its size: a few roundings)
    assert slow - fast["time"]["compute_s"] == pytest.approx(expected, rel=10 * F32)


def test_hopper_flash_share_follows_the_head_dim_through_its_exponentials():
    # FlashAttention-2 pays two exponentials a score element (forward softmax, backward's
    # recomputed P) between 14 d matmul FLOPs, each exponential 254 tensor-core FLOPs' time on
    # an H100 (989 against 3.9 TFLOPS): with 0.34 at head dim 128 the kernel runs its matmuls
    # at 14 x 128 / (14 x 128 / 0.34 - 2 x 254) of the peak, and head dim 64 reaches
    # 14 x 64 / (14 x 64 / that + 2 x 254) (0.310; Shah et al.'s head-dim-64 bars: 0.303 at
    # 16k tokens, held out in benchmarks/attention_table.py). Long sequences
    # (flash_half_seq_sm90 off), only on Hopper, only where the profile names the rule.
    inside = 14 * 128 / (14 * 128 / 0.34 - 2 * 254)
    expected = {128: 0.34, 64: 14 * 64 / (14 * 64 / inside + 2 * 254)}

    def share(runtime, heads, gpu="h100-sxm-80gb", **coeffs):
        sc = make_scenario(llama_like(layers=2, hidden=512, heads=heads, kv=heads),
                           runtime=runtime, seq_len=4096, hardware=get_hardware(gpu))
        sc = sc.replace(runtime=sc.runtime.with_coeffs(flash_half_seq_sm90=0.0, **coeffs))
        return float(scenario_numbers(sc)["rt_flash_eff"])
    for heads, d in ((4, 128), (8, 64)):
        assert share("pytorch-eager", heads) == pytest.approx(expected[d], rel=F32)
        assert share("pytorch-eager", heads, "h200-sxm-141gb") == pytest.approx(expected[d],
                                                                                rel=F32)
    assert expected[64] == pytest.approx(0.310, abs=5e-4)
    # without the rule, or off Hopper, the head dim changes nothing
    assert share("pytorch-eager", 8, flash_exp_flops_sm90=0.0) == pytest.approx(0.34, rel=F32)
    base = get_profile("pytorch").coeff("flash_eff")
    assert share("pytorch-eager", 8, "a100-sxm-80gb") == base
    assert share("pytorch", 8) == share("pytorch", 4) == base


def test_a_hopper_share_the_exponentials_alone_exceed_is_refused():
    # 14 d / share must leave time for the matmuls beside 2 exponentials: at head dim 128 and
    # 254 FLOPs an exponential, a share at or above 7 x 128 / 254 = 3.53 cannot be reached
    # (a share is at most 1, so the check bites where an exponential costs more: 1000 FLOPs
    # bounds the share at 0.896)
    from capopt._errors import CapoptError
    prof = get_profile("pytorch-eager")
    prof.with_coeffs(flash_exp_flops_sm90=1000.0, flash_eff_sm90=0.89)
    with pytest.raises(CapoptError, match="flash_exp_flops_sm90"):
        prof.with_coeffs(flash_exp_flops_sm90=1000.0, flash_eff_sm90=0.9)


def _megatron(**coeffs):
    """Megatron-Core's profile on one node of 8, the latency terms switched off, a model of
    about 100M parameters (float32 gradients: 2.6 buckets of 4e7 elements)."""
    sc = make_scenario(gpt_like(layers=8, hidden=1024, heads=8, vocab=1024, seq=512),
                       runtime="megatron", count=8, global_batch=64)
    zero_lat = dict(alpha_base_s=0.0, alpha_intra_s=0.0, alpha_inter_s=0.0)
    return sc.replace(runtime=sc.runtime.with_coeffs(**zero_lat, **coeffs))


def test_megatron_reduces_every_gradient_bucket_but_the_last_during_the_backward_pass():
    # --overlap-grad-reduce: with a backward pass longer than the reduction, exactly the last
    # bucket's share is exposed; Megatron-Core's bucket is max(4e7, 1e6 x dp) elements
    sc = _megatron()
    n = numbers_pytree(sc)
    assert float(n["grad_bytes"]) == 4.0                   # float32 main_grad under --bf16
    buckets = sc.model.num_params() / 4e7
    assert 2.0 < buckets < 3.0
    t = est(Config(micro_batch=8, grad_accum=1, dp=8, zero_stage=0), sc)["time"]
    total = t["comm_dp_s"] + t["comm_hidden_s"]           # only the all-reduce communicates
    # (the exposed and hidden shares are two float32 products of the same sum: F32 each)
    assert t["comm_dp_s"] == pytest.approx(total / buckets, rel=2 * F32)
    # a prior share instead (the pytorch profile's rule): 1 - overlap_dp of it exposed
    t0 = est(Config(micro_batch=8, grad_accum=1, dp=8, zero_stage=0),
             _megatron(overlap_dp_buckets=0.0, overlap_dp=0.5))["time"]
    assert t0["comm_dp_s"] == pytest.approx(0.5 * total, rel=2 * F32)


def test_megatron_grows_its_buckets_with_the_data_parallel_size():
    # 1e6 elements per rank: at dp = 64 a bucket is 6.4e7 elements, not 4e7, so fewer buckets
    # and a larger last one exposed; without the per-rank rule the bucket stays at 4e7
    model = gpt_like(layers=8, hidden=1024, heads=8, vocab=1024, seq=512)
    zero_lat = dict(alpha_base_s=0.0, alpha_intra_s=0.0, alpha_inter_s=0.0)
    big = make_scenario(model, runtime="megatron", count=64, global_batch=512)
    cfg = Config(micro_batch=8, grad_accum=1, dp=64, zero_stage=0)

    def exposed_share(**coeffs):
        t = est(cfg, big.replace(runtime=big.runtime.with_coeffs(**zero_lat, **coeffs)))["time"]
        return t["comm_dp_s"] / (t["comm_dp_s"] + t["comm_hidden_s"])

    P = model.num_params()
    assert exposed_share() == pytest.approx(6.4e7 / P, rel=2 * F32)
    assert exposed_share(dp_bucket_elems_per_rank=0.0) == pytest.approx(4e7 / P, rel=2 * F32)


def test_megatron_gathers_updated_parameters_behind_the_next_forward_pass():
    # --overlap-param-gather with the distributed optimizer (ZeRO-1): the all-gather of the
    # updated bf16 parameters, 2 P (N-1)/N bytes over NVLink, hides behind the forward pass
    # but for its first bucket (the gradients' buckets: the same elements, P / 4e7 of them);
    # without the flag all of it follows the step
    cfg = Config(micro_batch=8, grad_accum=1, dp=8, zero_stage=1)
    sc = _megatron()
    n = numbers_pytree(sc)
    on = est(cfg, sc)["time"]
    off = est(cfg, _megatron(overlap_param_gather=0.0))["time"]
    P = sc.model.num_params()
    gather = 2.0 * P * 7 / 8 / float(n["intra_bw"] * n["rt_nvlink_eff"])
    gather_buckets = P / 4e7
    assert gather_buckets > 2.0
    # (the gather is recomputed from the profile's bandwidths here: a few float32 roundings)
    assert off["comm_zero_s"] - on["comm_zero_s"] == pytest.approx(
        gather * (1.0 - 1.0 / gather_buckets), rel=4 * F32)
    assert on["comm_hidden_s"] - off["comm_hidden_s"] == pytest.approx(
        off["comm_zero_s"] - on["comm_zero_s"], rel=4 * F32)


def test_the_parameter_gather_hides_behind_the_forward_gemms_only():
    # a gather longer than its window: what hides is the stage's forward matmul seconds, the
    # blocks' and the embedding's and head's forward GEMMs (their backward GEMMs are no window)
    from capopt.cost.flops import compute_times
    cfg = Config(micro_batch=8, grad_accum=1, dp=8, zero_stage=1)
    slow = dict(nvlink_eff=0.002)                           # a gather of ~10 s
    on = est(cfg, _megatron(**slow))["time"]
    off = est(cfg, _megatron(overlap_param_gather=0.0, **slow))["time"]
    sc = _megatron(**slow)
    n = numbers_pytree(sc)
    c = compute_times(knobs_from_config(cfg), n)
    window = float(8 * c["layer_fwd"] + c["first_fwd"] + c["last_fwd"])
    assert window < float(c["layer"] * 8 + c["first"] + c["last"]) / 2
    # (a difference of two float32 sums of hidden seconds: a few roundings)
    assert on["comm_hidden_s"] - off["comm_hidden_s"] == pytest.approx(window, rel=10 * F32)


def test_no_bucketing_is_one_collective_not_a_nan():
    # dp_bucket_bytes = 0 (allowed by the schema): one all-reduce of all the gradients
    sc = make_scenario(gpt_like(layers=2, hidden=256, heads=4, vocab=1024, seq=256),
                       count=8, global_batch=8)
    cfg = Config(micro_batch=1, dp=8)
    zero = est(cfg, sc.replace(runtime=sc.runtime.with_coeffs(dp_bucket_bytes=0.0)))["time"]
    huge = est(cfg, sc.replace(runtime=sc.runtime.with_coeffs(dp_bucket_bytes=1e15)))["time"]
    assert math.isfinite(zero["step_s"])
    assert zero["comm_dp_s"] == pytest.approx(huge["comm_dp_s"], rel=F32)


def test_megatron_pipelines_tensor_parallel_communication_only_under_sequence_parallelism():
    # --tp-comm-overlap hides the forward pass's tensor-parallel communication behind the
    # GEMMs, and Megatron allows it only with --sequence-parallel: without it the forward
    # all-reduces are exposed as in the pytorch profile (the backward's overlap is both's)
    cfg = Config(micro_batch=4, grad_accum=1, dp=2, tp=4, zero_stage=1)
    sp, no_sp = cfg.replace(sequence_parallel=True), cfg
    mega, base = _megatron(), _megatron(overlap_tp_fwd=0.0)
    assert est(sp, mega)["time"]["comm_tp_s"] < est(sp, base)["time"]["comm_tp_s"]
    assert est(no_sp, mega)["time"]["comm_tp_s"] == pytest.approx(
        est(no_sp, base)["time"]["comm_tp_s"], rel=F32)
    assert est(no_sp, mega)["time"]["comm_tp_s"] > 0.0


def test_gemms_pay_for_their_weights_every_micro_batch():
    # the effective GEMM dimension counts every operand: with more tokens than the hidden size
    # the weights still cross HBM once per micro-batch, so the efficiency keeps rising
    n = numbers_pytree(load_scenario("gpt2-124m-rtx4090"))
    h, f = 768.0, 3072.0
    effs = [float(matmul_efficiency(gemm_dim(jnp.float32(t), h, f), n))
            for t in (1024.0, 2048.0, 8192.0, 16384.0)]
    assert effs == sorted(effs) and effs[0] < effs[-1]
    assert float(gemm_dim(2048.0, h, f)) == pytest.approx(1 / (1 / 2048 + 1 / h + 1 / f), rel=F32)


def test_a_profile_without_the_per_micro_batch_coefficients_still_estimates():
    # a runtime profile written before these coefficients: accumulation from a zeroed buffer in
    # the gradient dtype, no kernel overhead
    sc = load_scenario("gpt2-124m-rtx4090")
    n = numbers_pytree(sc)
    new = ("accum_from_zero", "accum_bytes", "kernels_per_layer", "kernels_per_attn_chunk",
           "accum_kernels_per_layer", "kernels_per_micro_batch", "kernel_gap_s",
           "kernel_launch_s", "optimizer_kernels_per_layer")
    old = {key: v for key, v in n.items() if key[3:] not in new}
    k = knobs_from_config(Config(micro_batch=4, grad_accum=128, remat="none"))
    t_old = estimate_numbers(k, old).time
    t_new = estimate_numbers(k, n).time
    assert float(t_old["launch_s"]) == 0.0
    assert float(t_old["grad_accum_s"]) == pytest.approx(float(t_new["grad_accum_s"]), rel=F32)
    assert float(t_old["step_s"]) < float(t_new["step_s"])


# ---------------------------------------------------------------------------------------------
# The end stages in one evaluation: the same numbers as one stage_time call per stage
# ---------------------------------------------------------------------------------------------
from capopt.cost.flops import compute_times  # noqa: E402
from capopt.cost.time import (end_stage_extras, end_stages, memory_bound_times,  # noqa: E402
                              stage_time, time_terms)



def _end_stage_cases():
    for which in sorted(SCENARIOS):
        for cfg in END_STAGE_CONFIGS:
            yield which, knobs_from_config(cfg)
        yield which, RELAXED_KNOBS


def _stages_both_ways(k, n):
    """(stacked end stages, first stage alone, last stage alone, time terms)."""
    c, mb = compute_times(k, n), memory_bound_times(k, n)
    first, last = end_stage_extras(k, n, c, mb)
    layers = n["L"] / k.pp
    one = lambda e: stage_time(k, n, layers=layers, c=c, mb=mb, **e)  # noqa: E731
    time, _ = time_terms(k, n, estimate_numbers(k, n).memory)
    return end_stages(k, n, c, mb), one(first), one(last), time


_stages_jit = jax.jit(_stages_both_ways)


def test_end_stages_in_one_evaluation_equal_one_call_per_stage():
    # time_terms evaluates the first and the last pipeline stage as one stage_time call over
    # a leading axis of two (vmap): every term of both equals its own stage_time call, to
    # float32 rounding, at integer and at relaxed points
    for which, k in _end_stage_cases():
        both, first, last, _ = _stages_jit(k, NUMBERS[which])
        assert set(both) == set(first)
        for key in first:
            for i, ref in ((0, first), (1, last)):
                np.testing.assert_allclose(np.asarray(both[key])[i], np.asarray(ref[key]),
                                           rtol=F32, atol=1e-12,
                                           err_msg=f"{which} {key} stage {i}")


def test_time_terms_take_the_slower_end_stage_per_micro_batch():
    # the per-micro-batch terms of the step are grad_accum times the slower stage's (the first
    # on a tie); where the two totals agree to float32 rounding either breakdown is right
    for which, k in _end_stage_cases():
        _, first, last, t = _stages_jit(k, NUMBERS[which])
        m, v = float(k.grad_accum), float(k.vpp)
        f_tot, l_tot = float(first["total"]), float(last["total"])
        picks = [first if f_tot >= l_tot else last]
        if math.isclose(f_tot, l_tot, rel_tol=F32):
            picks = [first, last]
        expected = lambda st: {  # noqa: E731
            "compute_s": m * st["compute"], "memory_bound_s": m * st["memory"],
            "grad_accum_s": m * st["accum"], "comm_tp_s": m * st["tp"],
            "comm_pp_s": m * st["pp"], "comm_moe_s": m * st["moe"], "comm_cp_s": m * st["cp"],
            "bubble_s": max(float(k.pp) - 1.0, 0.0) / v * st["total"]}
        ok = [all(math.isclose(float(t[key]), float(val), rel_tol=F32, abs_tol=1e-12)
                  for key, val in expected(st).items()) for st in picks]
        assert any(ok), (which, {key: float(t[key]) for key in expected(picks[0])})


def test_the_relaxed_solve_reports_the_values_at_its_final_point():
    # the solver takes the final loss, memory excess and objective from one more evaluating
    # pass of its loop (one traced copy of the cost model): they are those of the returned x
    from capopt.search.relax import _loss_terms, initial_points, make_solver, scenario_bounds
    sc, n = SCENARIOS["moe"], NUMBERS["moe"]
    b = scenario_bounds(sc)
    sol = make_solver(steps=12, mu1=1e3)(initial_points(3, 1), n, b)
    loss, (over, obj) = jax.vmap(_loss_terms, in_axes=(0, None, None, None))(
        sol.x, n, b, jnp.float32(1e3))
    for got, want in ((sol.loss, loss), (sol.over, over), (sol.objective, obj)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("runtime, costs_time", [("xla-gpu", True), ("pytorch", False)])
def test_selective_recompute_time_follows_what_the_policy_saves(runtime, costs_time):
    # With flash attention there are no scores to recompute, so Korthikanti's selective policy
    # (pytorch: selective_saves_dots = 0) is free; XLA's dots-saveable policy (xla-gpu: 1)
    # repeats every non-matmul op of the forward, which the memory model already assumes.
    sc = make_scenario(llama_like(), runtime=runtime)
    k_none = knobs_from_config(Config(micro_batch=4, flash_attention=True))
    k_sel = knobs_from_config(Config(micro_batch=4, flash_attention=True, remat="selective"))
    n = numbers_pytree(sc)
    none, sel = (float(memory_bound_times(k, n)["layer"]) for k in (k_none, k_sel))
    if costs_time:
        # one more forward over fwd + bwd: 1 / (1 + ew_bwd_factor) more; 10% is well below that
        assert sel > none * 1.1
    else:
        assert sel == pytest.approx(none, rel=1e-6)


def test_the_step_terms_add_up_to_the_step():
    # STEP_TERMS is what `why_lost` compares and what the plan table sums: their sum is the
    # step unless the input pipeline is slower. float32 sums of up to ten terms in another
    # order than the model's: relative error up to ~10 ulp, so rtol 1e-5.
    from capopt._plan import plan
    from capopt.cost.time import STEP_TERMS
    sc = "scenarios/llama3-8b-8xh100.toml"
    for knobs in (dict(micro_batch=2, dp=4, tp=2, zero_stage=2, remat="selective"),
                  dict(micro_batch=1, dp=8, tp=1, zero_stage=3, remat="none"),
                  dict(micro_batch=1, dp=2, tp=2, pp=2, zero_stage=1, remat="full")):
        t = plan(sc, **knobs).time
        busy = sum(t[k] for k in STEP_TERMS)
        assert max(busy, t["input_s"]) == pytest.approx(t["step_s"], rel=1e-5)


def test_why_the_runner_up_lost_names_only_terms_of_the_step():
    # The default scenario's first two: the runner-up hides more communication than the best,
    # which is not why it is slower; only terms that add up to the step may be named.
    from capopt._plan import plan
    from capopt.cost.time import STEP_TERMS
    from capopt.report import why_lost
    sc = "scenarios/llama3-8b-8xh100.toml"
    best = plan(sc, micro_batch=2, dp=4, tp=2, zero_stage=2, sequence_parallel=True,
                remat="selective")
    other = plan(sc, micro_batch=1, dp=8, tp=1, zero_stage=3, sequence_parallel=False,
                 remat="none")
    assert other.time["comm_hidden_s"] > best.time["comm_hidden_s"]
    text = why_lost(best, other)
    named = [part.split(" +")[0] for part in text.split("(", 1)[1].rstrip(")").split("; ")]
    allowed = {k[:-2].replace("_", " ") for k in STEP_TERMS}
    assert named and set(named) <= allowed, text


def test_flash_attention_on_hopper_is_slower_on_shorter_sequences():
    # FlashAttention-2's forward + backward share of H100's peak rises with the sequence
    # (Shah et al. 2024, Figs. 5-6, head dim 128): 0.34 x s / (s + 210), from 0.24 at 512 to
    # 0.336 at 16k
    model = llama_like(layers=2, hidden=512, heads=4, kv=4)
    effs = {}
    for seq in (512, 2048, 16384):
        sc = make_scenario(model, runtime="pytorch-eager", seq_len=seq,
                           hardware=get_hardware("h100-sxm-80gb"))
        effs[seq] = float(scenario_numbers(sc)["rt_flash_eff"])
    assert effs[512] < effs[2048] < effs[16384] < 0.34
    # the composite of the paper's bars at 512 and 16k tokens (0.237, 0.338), within the
    # least-squares fit's largest residual (0.0048, at 4096 tokens)
    assert effs[512] == pytest.approx(0.237, abs=0.005)
    assert effs[16384] == pytest.approx(0.338, abs=0.005)


def test_a_power_limited_part_runs_its_gemms_at_its_share_and_nothing_else_changes():
    """``sustained_tensor_share`` scales the weight GEMMs' rate (their assumed share of the
    peak falls by exactly that factor); the attention kernel, the memory-bound work, the
    memory and the datasheet peak MFU is counted against stay as they were."""
    from dataclasses import replace
    sheet = get_hardware("h100-sxm-80gb")
    limited = replace(sheet, sustained_tensor_share=0.5)
    cfg = Config(micro_batch=2, grad_accum=4, dp=8, remat="selective", flash_attention=True)
    a = estimate(cfg, make_scenario(llama_like(), hardware=sheet, runtime="torchtitan"))
    b = estimate(cfg, make_scenario(llama_like(), hardware=limited, runtime="torchtitan"))
    ta, tb = a.throughput, b.throughput
    assert float(tb["gemm_peak_share"]) == pytest.approx(0.5 * float(ta["gemm_peak_share"]),
                                                         rel=F32)
    assert float(tb["attention_peak_share"]) == pytest.approx(
        float(ta["attention_peak_share"]), rel=F32)
    # (the memory-bound seconds less the launches: a launch is exposed where its kernel is
    # shorter than it, which longer GEMMs change)
    bound = lambda e: float(e.time["memory_bound_s"] - e.time["launch_s"])  # noqa: E731
    assert bound(b) == pytest.approx(bound(a), rel=F32)
    assert float(b.time["compute_s"]) > float(a.time["compute_s"])
    assert a.memory["total_bytes"] == b.memory["total_bytes"]
    # MFU against the same peak: it falls as the step lengthens
    assert float(tb["mfu"] / ta["mfu"]) == pytest.approx(
        float(a.time["step_s"] / b.time["step_s"]), rel=F32)


def test_an_8bit_recipe_prices_its_casts_and_reads_one_byte_operands():
    """``fp8_cast_bytes`` per element of each linear layer's input (forward) and output
    gradient (backward): a llama block at tp 1 casts h (q/k/v), q (output projection), h (the
    MLP's input pair) and f (its output matrix) forward, and q + 2 kv, h, 2 f and h backward.
    The memory-bound seconds grow by exactly those bytes at the profile's HBM rate; on a part
    without 8-bit units (A100: the recipe's GEMMs run in 16 bits) nothing is cast. An 8-bit
    GEMM's roofline counts 1-byte operands: its ridge point is half the 16-bit one's."""
    m = llama_like(layers=4, hidden=1024, heads=8, kv=2, vocab=32000, intermediate_size=2816)
    cfg = Config(micro_batch=2, grad_accum=1, dp=1)

    def bound(hw, cast):
        sc = make_scenario(m, hardware=get_hardware(hw), runtime="torchtitan",
                           precision="fp8-mixed", count=1, seq_len=512, global_batch=2)
        sc = sc.replace(runtime=sc.runtime.with_coeffs(fp8_cast_bytes=cast))
        e = estimate(cfg, sc)
        return float(e.time["memory_bound_s"] - e.time["launch_s"]), scenario_numbers(sc)

    base, n = bound("h100-sxm-80gb", 0.0)
    cast, _ = bound("h100-sxm-80gb", 6.0)
    h, q, kv, f = 1024, 1024, 256, 2816
    elems = (2 * h + q + f) + (q + 2 * kv + h + 2 * f + h)
    tokens, layers = 2 * 512, 4
    rate = n["mem_bw"] * n["rt_mem_eff"]
    assert cast - base == pytest.approx(layers * tokens * elems * 6.0 / rate, rel=1e-4)
    a100_base, a100 = bound("a100-sxm-80gb", 0.0)[0], bound("a100-sxm-80gb", 6.0)[0]
    assert a100 == a100_base
    assert n["matmul_bytes"] == 1.0 and n["fp8_linear"] == 1.0
    assert scenario_numbers(make_scenario(m, runtime="torchtitan"))["matmul_bytes"] == 2.0


@pytest.mark.parametrize("vocab, precision", [(32768, "bf16-mixed"), (32768, "bf16"),
                                              (192, "bf16-mixed")])
def test_a_fused_linear_loss_runs_the_heads_gemms_a_chunk_at_a_time(vocab, precision):
    """``loss = "fused-linear"`` runs the head's three GEMMs over chunks of
    `fused_linear_chunk` rows: the head's matmul seconds are the fused loss's times the
    efficiency ratio of the two shapes (`matmul_efficiency`), the blocks' are the same; a
    vocabulary no wider than the model is one chunk, the same GEMMs. Its memory-bound pass
    over the logits is one compute-dtype copy against the fused loss's two (half the bytes),
    plus, under autocast, the head cast again for every chunk (the parameter dtype read, the
    compute dtype written)."""
    import dataclasses

    from capopt.cost.flops import compute_times, fused_linear_chunk, gemm_dim, matmul_efficiency
    from capopt.cost.time import memory_bound_times
    m = ModelSpec(name="v", family="decoder", hidden_size=256, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=512, vocab_size=vocab,
                  position_embedding="rotary", norm_type="rmsnorm", mlp_type="gated",
                  hidden_act="silu")
    sc = _fl_scenario(m, precision)
    fl = sc.replace(workload=dataclasses.replace(sc.workload, loss="fused-linear"))
    k = knobs_from_config(Config(micro_batch=4))
    n_f, n_l = numbers_pytree(sc), numbers_pytree(fl)
    c_f, c_l = compute_times(k, n_f), compute_times(k, n_l)
    tokens = 4.0 * 1024
    rows = float(fused_linear_chunk(n_l, jnp.asarray(tokens)))
    ratio = (float(matmul_efficiency(gemm_dim(tokens, 256.0, float(vocab)), n_f))
             / float(matmul_efficiency(gemm_dim(rows, 256.0, float(vocab)), n_f)))
    assert float(c_l["last"]) == pytest.approx(float(c_f["last"]) * ratio, rel=1e-5)
    assert float(c_l["layer"]) == pytest.approx(float(c_f["layer"]), rel=1e-6)
    if vocab <= 256:
        assert rows == tokens and ratio == pytest.approx(1.0)
    else:
        assert rows < tokens and ratio > 1.0
    mb_f, mb_l = memory_bound_times(k, n_f), memory_bound_times(k, n_l)
    rate = float(n_f["mem_bw"] * n_f["rt_mem_eff"])
    ab, pb = float(n_f["act_bytes"]), float(n_f["param_bytes"])
    logits_pass = 2.0 * tokens * vocab * ab               # one copy, two passes
    casts = (math.ceil(tokens / rows) * vocab * 256 * (pb + ab)) if pb > ab else 0.0
    assert float(mb_l["last"] - mb_f["last"]) == pytest.approx(
        (casts - logits_pass) / rate, rel=1e-4)


def _fl_scenario(model, precision):
    from capopt._hardware import get_hardware
    from capopt._specs import Budget, Scenario, Workload
    hw = get_hardware("h100-sxm-80gb")
    return Scenario(name="fl", model=model, hardware=hw, count=1, per_node=1,
                    workload=Workload(seq_len=1024, global_batch=4, precision=precision,
                                      loss="fused"),
                    budget=Budget(vram_bytes=hw.memory_bytes),
                    runtime=get_profile("pytorch-eager"))


def test_activation_offloading_is_exposed_where_its_copies_outlast_the_matmuls():
    """``activation_offload``: each micro-batch's offloaded bytes (`memory`'s
    ``offloaded_activation_bytes``: the stored blocks' saved tensors) cross the host link to
    the host in the forward pass and back in the backward pass, behind the matmuls: on a
    fast link nothing is exposed; on slow ones the exposed seconds grow by exactly
    2 x micro-batches x bytes / link (the copies in both directions, each past its window)."""
    import dataclasses
    sc = make_scenario(llama_like(), runtime="pytorch-eager", count=1, global_batch=8,
                       seq_len=512, precision="bf16-mixed")
    sc = sc.replace(workload=dataclasses.replace(sc.workload, activation_offload=True))
    k = knobs_from_config(Config(micro_batch=2, grad_accum=4))
    n = numbers_pytree(sc)

    def offload(link_gb_s):
        out = estimate_numbers(k, {**n, "host_bw": jnp.asarray(link_gb_s * 1e9),
                                   "rt_host_eff": jnp.asarray(1.0)})
        return float(out.time["offload_s"]), float(out.memory["offloaded_activation_bytes"])

    fast, nbytes = offload(1e6)
    assert fast == 0.0 and nbytes > 0
    (s1, _), (s2, _) = offload(0.5), offload(0.25)
    assert s2 - s1 == pytest.approx(2 * 4 * nbytes * (1 / 0.25e9 - 1 / 0.5e9), rel=1e-4)


def test_xla_reduces_gradients_in_the_compute_dtype():
    """Data parallelism under XLA's mixed precision all-reduces the gradients in the dtype
    their weight-gradient dots wrote (the optimized HLO: bf16 matrices in the combined
    all-reduces, `held_grad_bytes`): less exposed synchronisation than the
    same step reducing float32 gradients, and equal where the profile says the gradients
    stay float32 (MaxText's float32 scan stacks)."""
    sc = make_scenario(llama_like(layers=8, hidden=1024, vocab=1024), count=8, global_batch=8)
    cfg = Config(micro_batch=1, dp=8)
    without = sc.replace(runtime=sc.runtime.with_coeffs(grads_compute_dtype=0.0))
    assert est(cfg, sc)["time"]["comm_dp_s"] < est(cfg, without)["time"]["comm_dp_s"]
    mt = sc.replace(runtime=get_profile("maxtext"))
    mt_without = mt.replace(runtime=mt.runtime.with_coeffs(grads_compute_dtype=0.0))
    assert est(cfg, mt)["time"]["comm_dp_s"] == est(cfg, mt_without)["time"]["comm_dp_s"]


def test_xla_reduces_the_embedding_gradient_in_its_float32_table():
    """The data-parallel collectives carry every gradient as memory holds it: the block and
    head gradients in the compute dtype, the embedding's scatter-add table in float32 (the
    optimized HLO of fitting rand0-038 all-reduces f32[V, h] beside the bf16 matrices). One
    number serves both: what the step reduces is the memory model's unsharded gradients."""
    vocab, hidden = 1024, 1024
    sc = make_scenario(llama_like(layers=4, hidden=hidden, vocab=vocab), count=8,
                       global_batch=8)
    out = estimate(Config(micro_batch=1, dp=8), sc)
    n = numbers_pytree(sc)
    held, gb = float(held_grad_bytes(n)), float(n["grad_bytes"])
    assert gb > held                       # a bf16 gradient beside a float32 table
    reduced = float(out.memory["grads_reduced_bytes"])
    trainable = float(out.memory["trainable_params"])
    assert reduced == pytest.approx(trainable * held + vocab * hidden * (gb - held), rel=1e-6)
    # (gradients held in float32, MaxText's rule: every one reduced in float32, the table too)
    narrow = sc.replace(runtime=sc.runtime.with_coeffs(grads_compute_dtype=0.0))
    assert float(estimate(Config(micro_batch=1, dp=8), narrow).memory["grads_reduced_bytes"]) \
        == pytest.approx(trainable * gb, rel=1e-6)
