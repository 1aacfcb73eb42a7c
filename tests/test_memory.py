"""The memory model against published tables, and its properties over random configs."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from capopt._hardware import get_hardware
from capopt._runtime import get_profile
from capopt._model import ModelSpec
from capopt._specs import Config, LoRA
from capopt.cost import estimate, knobs_from_config, numbers_pytree, scenario_numbers
from capopt.cost.activations import saved_bytes
from capopt.cost.memory import PHASES, held_grad_bytes, memory, splitk_tile_limit
from conftest import (END_STAGE_CONFIGS, RELAXED_KNOBS, TEST_GPU, gpt_like, llama_like,
                      make_scenario)

# float32 arithmetic on byte counts up to ~1e12 carries ~1e-7 relative error.
F32_RTOL = 1e-6


# --------------------------------------------------------------------------------------------
# ZeRO (Rajbhandari et al. 2020), Table 1: model-state memory per device, 7.5B parameters,
# mixed-precision Adam (K = 12), GB = 1e9 bytes, as printed in the paper.
# --------------------------------------------------------------------------------------------
ZERO_TABLE_1 = {  # devices: (baseline, P_os, P_os+g, P_os+g+p)
    1: (120, 120, 120, 120),
    4: (120, 52.5, 41.3, 30),
    16: (120, 35.6, 21.6, 7.5),
    64: (120, 31.4, 16.6, 1.88),
    1024: (120, 30.1, 15.1, 0.12),
}


def _paper_digits(x: float) -> float:
    """Half a unit in the last digit the paper printed (its rounding, our tolerance)."""
    s = repr(x)
    decimals = len(s.split(".")[1]) if "." in s else 0
    return 0.5 * 10 ** (-decimals)


def _model_states_gb(devices: int, stage: int) -> float:
    sc = make_scenario(runtime="pytorch", count=devices, global_batch=devices)
    n = scenario_numbers(sc)
    # 7.5B parameters, all in blocks (the paper counts parameters, not their layout).
    for key in ("P_embed_tp", "P_embed_rep", "P_head_tp", "P_head_rep", "P_layer_rep",
                "P_expert"):
        n[key] = 0.0
    n["P_layer_tp"] = 7.5e9 / n["L"]
    cfg = Config(micro_batch=1, dp=devices, zero_stage=stage if devices > 1 else 0)
    m = memory(knobs_from_config(cfg), numbers_pytree(n))
    # model states: parameters, every gradient (live together at the update), optimizer state
    states = m["params_bytes"] + m["grads_all_bytes"] + m["optimizer_bytes"]
    return float(states) / 1e9


@pytest.mark.parametrize("devices", sorted(ZERO_TABLE_1))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_paper_table_1(devices, stage):
    paper = ZERO_TABLE_1[devices][stage]
    got = _model_states_gb(devices, stage)
    # The paper prints 3 significant digits; 41.3 for 41.25 rounds half up.
    assert abs(got - paper) <= _paper_digits(paper) + 1e-9, (devices, stage, got, paper)


# --------------------------------------------------------------------------------------------
# Korthikanti et al. 2022, activations per transformer layer (16-bit, with dropout):
# s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree.
# --------------------------------------------------------------------------------------------
S, B, H, A = 2048, 2, 1024, 16


def _korthikanti_layer(t: int, sp: bool, policy: str) -> float:
    sc = make_scenario(gpt_like(hidden=H, heads=A, seq=S), runtime="pytorch", seq_len=S,
                       count=t, global_batch=B)
    cfg = Config(micro_batch=B, tp=t, sequence_parallel=sp, flash_attention=False,
                 remat=policy)
    k = knobs_from_config(cfg)
    none, sel, full = saved_bytes(k, numbers_pytree(sc), B * S)
    return float({"none": none, "selective": sel, "full": full}[policy])


KORTHIKANTI = [  # (t, sp, policy, closed form in bytes)
    (1, False, "none", S * B * H * (34 + 5 * A * S / H)),
    (8, False, "none", S * B * H * (10 + 24 / 8 + 5 * A * S / (H * 8))),
    (8, True, "none", S * B * H * (34 / 8 + 5 * A * S / (H * 8))),
    (8, False, "selective", S * B * H * (10 + 24 / 8)),
    (8, True, "selective", S * B * H * 34 / 8),
    (1, False, "full", 2 * S * B * H),
    (4, False, "full", 2 * S * B * H),
]


@pytest.mark.parametrize("t,sp,policy,expected", KORTHIKANTI)
def test_korthikanti_activation_formulas(t, sp, policy, expected):
    got = _korthikanti_layer(t, sp, policy)
    assert got == pytest.approx(expected, rel=F32_RTOL)


# --------------------------------------------------------------------------------------------
# Properties over random configs
# --------------------------------------------------------------------------------------------
def _random_case(rng: random.Random):
    model = rng.choice([gpt_like(layers=rng.choice([4, 8, 12])),
                        llama_like(layers=rng.choice([4, 8]))])
    sc = make_scenario(model, runtime=rng.choice(["pytorch", "xla-gpu"]), count=64,
                       seq_len=rng.choice([256, 512]), global_batch=4096,
                       optimizer=rng.choice(["adamw", "sgd", "lion", "adafactor", "adamw-8bit"]),
                       precision=rng.choice(["fp32", "bf16-mixed", "bf16", "fp8-mixed"]),
                       grad_clip=rng.random() < 0.5)
    tp = rng.choice([1, 2, 4])
    cfg = Config(micro_batch=rng.choice([1, 2, 4]), grad_accum=rng.choice([1, 2, 4]),
                 dp=rng.choice([2, 4, 8]), zero_stage=rng.choice([0, 1, 2, 3]), tp=tp,
                 pp=rng.choice([1, 2]), sequence_parallel=tp > 1 and rng.random() < 0.5,
                 remat=rng.choice(["none", "selective", "full", 0.5]),
                 offload_optimizer=rng.random() < 0.3, flash_attention=rng.random() < 0.5)
    return sc, cfg


def _total(cfg, sc) -> float:
    return float(estimate(cfg, sc).memory["total_bytes"])


CASES = [_random_case(random.Random(seed)) for seed in range(60)]


@pytest.mark.parametrize("sc,cfg", CASES)
def test_memory_monotone_in_batch(sc, cfg):
    base = _total(cfg, sc)
    assert _total(cfg.replace(micro_batch=cfg.micro_batch * 2), sc) >= base
    assert _total(cfg.replace(grad_accum=cfg.grad_accum * 2), sc) >= base


@pytest.mark.parametrize("sc,cfg", CASES)
def test_memory_never_rises_with_shard_degree(sc, cfg):
    base = _total(cfg, sc)
    assert _total(cfg.replace(dp=cfg.dp * 2), sc) <= base
    if cfg.tp < 4:
        assert _total(cfg.replace(tp=cfg.tp * 2), sc) <= base


@pytest.mark.parametrize("sc,cfg", CASES)
def test_zero_stages_ordered(sc, cfg):
    from capopt._validity import config_problems
    stages = [z for z in range(4) if not config_problems(cfg.replace(zero_stage=z), sc)]
    totals = [_total(cfg.replace(zero_stage=z), sc) for z in stages]
    assert all(b <= a for a, b in zip(totals, totals[1:])), dict(zip(stages, totals))


@pytest.mark.parametrize("sc,cfg", CASES)
def test_remat_policies_ordered(sc, cfg):
    # Holds for stages of two or more blocks; a one-block stage pays the rebuild of the
    # recomputed block on top of its saved input (as a real run does).
    full, sel, none = (_total(cfg.replace(remat=r), sc) for r in ("full", "selective", "none"))
    assert full <= sel <= none


def test_terms_add_up_and_are_nonnegative():
    sc, cfg = CASES[0]
    m = estimate(cfg, sc).memory
    terms = ["params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
             "logits_bytes", "comm_bytes", "overhead_bytes"]
    assert all(float(m[t]) >= 0 for t in terms)
    assert float(sum(m[t] for t in terms)) == pytest.approx(float(m["total_bytes"]), rel=F32_RTOL)


# --------------------------------------------------------------------------------------------
# Named behaviours
# --------------------------------------------------------------------------------------------
def _with(sc, **wl):
    """``sc`` with workload fields replaced."""
    import dataclasses
    return sc.replace(workload=dataclasses.replace(sc.workload, **wl))


def _held_grads(n, elems):
    """Bytes of ``elems`` gradient elements as XLA holds them (`held_grad_bytes`: the
    weight-gradient dots' compute dtype), the embedding's float32 scatter-add table apart."""
    embed = float(n["embed_grad_tp"] + n["embed_grad_rep"])
    return (elems - embed) * float(held_grad_bytes(n)) + embed * float(n["grad_bytes"])


def test_fused_update_keeps_few_gradients_live_unless_clipped_or_accumulated():
    """XLA applies each update as its gradient is produced: at the bottom of the backward
    pass one block's gradients are live, not every block's, unless clipping's global norm
    needs them all; under accumulation the accumulator holds every gradient throughout."""
    sc = make_scenario(llama_like(layers=8), runtime="xla-gpu", count=1, global_batch=4,
                       grad_clip=False)
    clipped = _with(sc, grad_clip=True)
    k = knobs_from_config(Config(micro_batch=4))
    n_f, n_c = numbers_pytree(sc), numbers_pytree(clipped)
    from capopt.cost.memory import end_stage_memory
    fused = end_stage_memory(k, n_f)
    kept = end_stage_memory(k, n_c)
    grads_all = float(fused["trainable_params"][0]) * float(n_f["grad_bytes"])
    # (as held: the weight-gradient dots' compute dtype, `held_grad_bytes`)
    held_all = float(fused["trainable_params"][0]) * float(held_grad_bytes(n_f))
    bottom_f = float(fused["phase_bottom_bytes"][0] - kept["phase_bottom_bytes"][0])
    assert bottom_f < -0.5 * held_all           # clipping keeps the other blocks' gradients
    acc = estimate(Config(micro_batch=2, grad_accum=2), sc).memory
    assert float(acc["grads_bytes"]) >= grads_all * (1 - F32_RTOL)
    # PyTorch keeps .grad to the end whatever the clipping: no fused update
    pt = make_scenario(llama_like(layers=8), runtime="pytorch", count=1, global_batch=4,
                       grad_clip=False)
    m = estimate(Config(micro_batch=4), pt).memory
    assert float(m["phase_update_bytes"]) >= (float(m["params_bytes"]) + float(m["optimizer_bytes"])
                                              + float(m["trainable_params"]) * 4 * (1 - F32_RTOL))


@pytest.mark.parametrize("sc,cfg", CASES[:20])
def test_peak_is_the_largest_phase_and_the_terms_add_up(sc, cfg):
    m = estimate(cfg, sc).memory
    phases = [float(m[f"phase_{p}_bytes"]) for p in PHASES]
    assert float(m["total_bytes"]) == pytest.approx(max(phases), rel=F32_RTOL)
    assert PHASES[int(float(m["peak_phase"]))] in PHASES
    assert float(m[f"phase_{PHASES[int(float(m['peak_phase']))]}_bytes"]) == pytest.approx(
        max(phases), rel=F32_RTOL)


def _phase(sc, cfg, phase, **coeffs):
    """One phase's live bytes on the stage with the head and the embedding (pp = 1)."""
    rt = sc.runtime.with_coeffs(**coeffs) if coeffs else sc.runtime
    m = estimate(cfg, sc.replace(runtime=rt)).memory
    return float(m[f"phase_{phase}_bytes"])


def test_accumulator_holds_every_gradient_and_takes_the_embedding_buffer():
    """Under accumulation (a scan) the carried accumulator is every gradient, live from the
    loss on; the embedding's scatter-add buffer is its part of it, not a second copy;
    without accumulation, in a runtime that creates that buffer before the backward pass
    (``embed_grad_early``), it is live at the loss on its own."""
    sc = make_scenario(gpt_like(layers=4), runtime="xla-gpu", count=1, global_batch=8,
                       grad_clip=False)
    n = scenario_numbers(sc)
    acc = Config(micro_batch=4, grad_accum=2)
    grads_all = float(estimate(acc, sc).memory["trainable_params"]) * n["grad_bytes"]
    embed = (n["embed_grad_tp"] + n["embed_grad_rep"]) * n["grad_bytes"]
    # without the accumulator the embedding's own buffer comes back where it is early
    assert _phase(sc, acc, "loss") - _phase(sc, acc, "loss", accum_buffer=0.0) == \
        pytest.approx(grads_all, rel=1e-5)
    assert (_phase(sc, acc, "loss", embed_grad_early=1.0)
            - _phase(sc, acc, "loss", accum_buffer=0.0, embed_grad_early=1.0)) == \
        pytest.approx(grads_all - embed, rel=1e-5)
    assert _phase(sc, acc, "loss") == pytest.approx(
        _phase(sc, acc, "loss", embed_grad_early=1.0), rel=F32_RTOL)
    one = Config(micro_batch=8)
    assert _phase(sc, one, "loss", embed_grad_early=1.0) - _phase(sc, one, "loss") == \
        pytest.approx(embed, rel=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_xla_creates_the_embedding_gradient_at_its_backward_and_holds_it_to_the_update(tied):
    """XLA's scheduler creates the embedding's scatter-add table at the embedding's backward,
    at the backward pass's end (rand0-113: none at the loss), and its update cannot be fused
    into a scatter-add: without clipping or accumulation (every other update fused into its
    gradient's producer) the table is live at the update alone, as many bytes as it has. A
    tied head's weight gradient is the head dot's own [V, h] output from the loss's
    backward on, kept where clipping keeps every gradient (rand0-145: bf16[12289, 320] at
    the head's GEMM); an untied head's is counted as it was."""
    model = gpt_like(layers=2, vocab=4001, tie_word_embeddings=tied)
    free = make_scenario(model, runtime="xla-gpu", count=1, global_batch=4, grad_clip=False)
    n = scenario_numbers(free)
    one = Config(micro_batch=4)
    embed = (n["embed_grad_tp"] + n["embed_grad_rep"]) * n["grad_bytes"]
    assert _phase(free, one, "update") - _phase(free, one, "update", embed_grad_early=1.0) == \
        pytest.approx(embed, rel=1e-5)
    clipped = make_scenario(model, runtime="xla-gpu", count=1, global_batch=4, grad_clip=True)
    n = scenario_numbers(clipped)
    head = 4001 * 256 * float(n["grad_bytes"]) * (0.5 if n["rt_grads_compute_dtype"] else 1.0)
    own = _phase(clipped, one, "loss") - _phase(clipped, one, "loss", tied_head_grad_own=0.0)
    assert own == pytest.approx(head if tied else 0.0, rel=1e-5, abs=1.0)


def test_zero3_accumulation_holds_transposed_minor_shards():
    """XLA GPU gathers along the major dimension: under ZeRO-3 and accumulation every shard
    split on its minor dimension has a transposed copy held through the micro-batch loop, in
    the parameter's dtype, in every phase but the update. The bytes follow the placement
    rule of `capopt.validation.sharding` (at tp = 1 the kernels wider than their input, the
    gated MLP's gate and up here; at tp = 2 the row-parallel o and down, tensor parallelism
    splitting their input dimension), and nothing is added without accumulation, without
    ZeRO-3 or under LoRA."""
    m = llama_like(layers=4, hidden=256, heads=8, kv=2)      # f = 688 > h
    h, f, L = 256, 688, 4
    for tp, dp, elems in ((1, 8, 2 * h * f), (2, 4, (h * h + f * h) / 2)):
        sc = make_scenario(m, runtime="xla-gpu", count=tp * dp, global_batch=2 * dp,
                           seq_len=256, grad_clip=False, optimizer="sgd")
        n = scenario_numbers(sc)
        cfg = Config(micro_batch=1, grad_accum=2, dp=dp, tp=tp, zero_stage=3, remat="full")
        want = L * elems / dp * n["param_bytes"]
        for phase in ("loss", "top", "bottom", "forward"):
            got = _phase(sc, cfg, phase) - _phase(sc, cfg, phase, zero3_loop_layout_copies=0.0)
            assert got == pytest.approx(want, rel=1e-5), (tp, phase)
        assert _phase(sc, cfg, "update") == pytest.approx(
            _phase(sc, cfg, "update", zero3_loop_layout_copies=0.0), rel=F32_RTOL)
        # (the cost model prices a config whatever the global batch: micro-batches alone)
        for other in (cfg.replace(grad_accum=1), cfg.replace(zero_stage=2)):
            assert _phase(sc, other, "loss") == pytest.approx(
                _phase(sc, other, "loss", zero3_loop_layout_copies=0.0), rel=F32_RTOL)
    lo = make_scenario(m, runtime="xla-gpu", count=8, global_batch=16, seq_len=256,
                       lora=LoRA(rank=8))
    cfg = Config(micro_batch=1, grad_accum=2, dp=8, zero_stage=3)
    assert _phase(lo, cfg, "loss") == pytest.approx(
        _phase(lo, cfg, "loss", zero3_loop_layout_copies=0.0), rel=F32_RTOL)


def test_runtime_materialises_scores_where_its_kernel_does_not_tile():
    """The validation step's chunked attention runs blockwise only over whole chunks of more
    than one (attn_chunk_queries = 128): at s = 192 the scores are materialised, so the
    flash knob changes nothing; at s = 256 it drops them."""
    for seq, same in ((192, True), (128, True), (256, False)):
        sc = make_scenario(gpt_like(dropout=0.0, seq=seq), runtime="xla-gpu", count=1,
                           global_batch=2, seq_len=seq)
        on = float(estimate(Config(micro_batch=2), sc).memory["total_bytes"])
        off = float(estimate(Config(micro_batch=2, flash_attention=False), sc).memory[
            "total_bytes"])
        assert (on == pytest.approx(off, rel=F32_RTOL)) is same, seq
    # a fused kernel (pytorch: attn_chunk_queries = 0) tiles any sequence
    pt = make_scenario(gpt_like(dropout=0.0, seq=192), runtime="pytorch", count=1,
                       global_batch=2, seq_len=192)
    assert float(estimate(Config(micro_batch=2), pt).memory["total_bytes"]) < float(
        estimate(Config(micro_batch=2, flash_attention=False), pt).memory["total_bytes"])


def test_sequence_parallel_runs_the_head_on_the_sequence_slice():
    """With the residual stream split over the sequence, XLA runs the head on the device's
    slice: the logits split over tp even when tp does not divide the vocabulary."""
    sc = make_scenario(llama_like(vocab=1001), runtime="xla-gpu", count=2, global_batch=2)
    k0 = knobs_from_config(Config(micro_batch=2, tp=2))
    k1 = knobs_from_config(Config(micro_batch=2, tp=2, sequence_parallel=True))
    from capopt.cost.memory import end_stage_memory
    n = numbers_pytree(sc)
    l0 = float(end_stage_memory(k0, n)["phase_loss_bytes"][1])
    l1 = float(end_stage_memory(k1, n)["phase_loss_bytes"][1])
    nn = scenario_numbers(sc)
    logits = 2 * nn["logit_elems_per_seq"] * (4 + nn["act_bytes"] * (1 + nn["vocab_unaligned"]))
    assert l0 - l1 >= logits / 2 * (1 - 1e-5)


def test_xla_pads_the_logits_gradient_only_where_it_splits_the_heads_gemm():
    """XLA pads an unaligned vocabulary (K of the head's input-gradient GEMM) only where it
    splits that GEMM over K, which it does when the GEMM's output, [tokens, h], has few tiles
    for the device's SMs (`capopt.cost.memory.head_grad_split`): a short micro-batch of a
    narrow model holds one compute-dtype logits copy more at the loss, a long one none. A
    profile that states no rule pads every unaligned vocabulary."""
    h100 = get_hardware("h100-sxm-80gb")

    def loss(vocab, mb, hardware=h100, **coeffs):
        sc = make_scenario(gpt_like(vocab=vocab, seq=1024), runtime="xla-gpu", count=1,
                           seq_len=1024, global_batch=64, hardware=hardware)
        return _phase(sc, Config(micro_batch=mb, grad_accum=64 // mb), "loss", **coeffs)

    n = scenario_numbers(make_scenario(gpt_like(vocab=50257, seq=1024), runtime="xla-gpu",
                                       count=1, seq_len=1024, global_batch=64, hardware=h100))
    # (hidden 256: two column tiles; the limit at V 50257, 0.975 of the profile's per-SM rows)
    xla = get_profile("xla-gpu")
    limit = splitk_tile_limit(n["sm_count"], 50257, xla.coeff("head_splitk_rows_per_sm"),
                              xla.coeff("head_splitk_half_k"))
    assert 1024 * 2 < limit < 16 * 1024 * 2
    for mb, padded in ((1, True), (16, False)):
        copy = mb * 1024 * 50257 * n["act_bytes"]
        # (a vocabulary one entry larger, a multiple of 16: the same logits, never padded)
        extra = loss(50257, mb) - loss(50256, mb)
        assert extra == pytest.approx(copy if padded else 0.0, abs=0.002 * copy)
        # (no rule, or no SM count: padded whatever the split)
        assert loss(50257, mb, head_splitk_rows_per_sm=0.0) - loss(50256, mb) == \
            pytest.approx(copy, rel=0.002)
        assert loss(50257, mb, TEST_GPU) - loss(50256, mb, TEST_GPU) == \
            pytest.approx(copy, rel=0.002)


def test_xla_pads_the_head_beside_the_logits_gradient_where_it_splits_the_gemm():
    """A split head input-gradient GEMM pads both of its operands along the vocabulary: at
    the GEMM the padded logits gradient sits beside a padded copy of the head, [V, h] in the
    compute dtype (rand0-184, bf16: bf16[12416, 768] beside bf16[128, 12416]). With few
    tokens and a wide vocabulary that copy outweighs the logits-sized buffers; an aligned
    vocabulary is never padded, and neither is a float32 one at a micro-batch XLA does not
    split."""
    h100 = get_hardware("h100-sxm-80gb")

    def loss(vocab, seq, precision="bf16"):
        sc = make_scenario(gpt_like(vocab=vocab, seq=seq, hidden=768, heads=12),
                           runtime="xla-gpu", count=1, seq_len=seq, global_batch=1,
                           hardware=h100, precision=precision)
        return _phase(sc, Config(micro_batch=1), "loss")

    for precision, ab in (("bf16", 2), ("fp32", 4)):
        head = 32001 * 768 * ab
        # (64 tokens: split, the head's copy and the padded gradient beside it; the
        # logits-sized buffers are smaller than the head's copy alone)
        assert 64 * 32001 * 4 * 2 < head
        extra = loss(32001, 64, precision) - loss(32000, 64, precision)
        # (the aligned vocabulary's loss holds its own logits-sized buffers: at most 12 bytes
        # a logit less than the padded point's)
        assert head - 64 * 32001 * 12 < extra <= head + 64 * 32001 * ab + 1e-3 * head, \
            precision
    # (8192 tokens: not split, nothing padded in float32)
    assert loss(32001, 8192, "fp32") == pytest.approx(loss(32000, 8192, "fp32"), rel=1e-3)


def test_sequence_parallel_all_reduces_the_replicated_gradients_from_a_flat_copy():
    """Under sequence parallelism a parameter replicated over tp (norms, position embeddings,
    a vocabulary table tp does not divide) gets a partial gradient on each rank, all-reduced
    over the tensor axis from one flat copy (rand0-156: f32[1808000], the table, the
    positions and the norms concatenated): the update holds that copy beside the gradients,
    at most one combined group of it; without sequence parallelism there is nothing to
    reduce, and with a data-parallel all-reduce it is the same collective, its copy counted
    once."""
    from capopt.cost.memory import end_stage_memory
    model = gpt_like(vocab=1001, seq=128, layers=2)

    def update(cfg, count=2, **kw):
        sc = make_scenario(model, runtime="xla-gpu", count=count, seq_len=128,
                           global_batch=cfg.micro_batch * cfg.dp, precision="fp32", **kw)
        return float(end_stage_memory(knobs_from_config(cfg), numbers_pytree(sc))[
            "phase_update_bytes"][0]), scenario_numbers(sc)

    on, nn = update(Config(micro_batch=1, tp=2, sequence_parallel=True))
    off, _ = update(Config(micro_batch=1, tp=2))
    # (the replicated elements: the table (1001 is odd), the positions, the norms and the
    # replicated biases; float32 gradients)
    elems = (nn["P_embed_tp"] + nn["P_embed_rep"] + nn["P_head_rep"]
             + 2 * nn["P_layer_rep"])
    assert on - off == pytest.approx(4 * elems, rel=1e-3)
    # (a data-parallel all-reduce over both axes: no second copy)
    on_dp, _ = update(Config(micro_batch=1, dp=2, tp=2, sequence_parallel=True), count=4)
    off_dp, _ = update(Config(micro_batch=1, dp=2, tp=2), count=4)
    assert on_dp - off_dp < 0.01 * 4 * elems


def test_data_parallel_gradients_wait_for_their_combined_collective():
    """XLA combines the gradients' all-reduces up to 30 MiB: under data parallelism a
    gradient stays live until its group's collective, and the group is copied to one flat
    buffer, even without clipping. One device holds the embedding's table at the update
    alone (no update is fused into a scatter-add); under data parallelism it is one of the
    gradients the collective holds, not counted twice."""
    sc1 = make_scenario(gpt_like(layers=4), runtime="xla-gpu", count=1, global_batch=2,
                        grad_clip=False)
    sc2 = make_scenario(gpt_like(layers=4), runtime="xla-gpu", count=2, global_batch=4,
                        grad_clip=False)
    m1 = estimate(Config(micro_batch=2), sc1).memory
    m2 = estimate(Config(micro_batch=2, dp=2), sc2).memory
    n = scenario_numbers(sc2)
    grads = _held_grads(n, float(m2["trainable_params"]))
    pending = min(grads, n["rt_grad_combine_bytes"])
    table = (n["embed_grad_tp"] + n["embed_grad_rep"]) * n["grad_bytes"]
    assert float(m2["phase_update_bytes"]) - float(m1["phase_update_bytes"]) == pytest.approx(
        2 * pending - table, rel=1e-5)


def test_xla_weight_casts_cover_stored_blocks_and_the_head():
    """Weight casts live at the loss: every stored block's and the head's; a recomputed
    block casts again when rebuilt (one block's worth while it is differentiated); the
    embedding table (a gather) is never cast whole."""
    sc = make_scenario(llama_like(layers=4), count=1, global_batch=4)   # untied, bf16-mixed
    n = scenario_numbers(sc)
    per_cast = n["rt_weight_copy_fraction"] * n["weight_copy_bytes"]
    layer = n["P_layer_tp"] + n["P_layer_rep"]
    none, full = Config(micro_batch=1), Config(micro_batch=1, remat="full")
    casts = lambda cfg, ph: _phase(sc, cfg, ph) - _phase(sc, cfg, ph, weight_copy_fraction=0.0)  # noqa: E731
    assert casts(none, "loss") == pytest.approx(per_cast * (4 * layer + n["P_head_tp"]),
                                                rel=1e-4)
    assert casts(full, "loss") == pytest.approx(per_cast * n["P_head_tp"], rel=1e-4)
    assert casts(full, "top") == pytest.approx(per_cast * layer, rel=1e-4)


def test_offload_moves_optimizer_state_to_host():
    sc = make_scenario(llama_like(), count=1, global_batch=4)
    on = estimate(Config(micro_batch=4, offload_optimizer=True), sc).memory
    off = estimate(Config(micro_batch=4), sc).memory
    assert float(on["optimizer_bytes"]) == 0.0
    assert float(on["host_optimizer_bytes"]) == pytest.approx(float(off["optimizer_bytes"]),
                                                             rel=F32_RTOL)


def test_flash_attention_drops_the_score_matrix():
    """Per block, blockwise attention keeps the softmax statistics instead of the score
    matrix: the saved bytes differ by exactly the inventory's score entries."""
    for runtime in ("pytorch", "xla-gpu"):
        sc = make_scenario(gpt_like(dropout=0.0), runtime=runtime, count=1, global_batch=4,
                           seq_len=512)
        n = numbers_pytree(sc)
        nn = scenario_numbers(sc)
        on = saved_bytes(knobs_from_config(Config(micro_batch=4)), n, 4 * 512)[0]
        off = saved_bytes(knobs_from_config(Config(micro_batch=4, flash_attention=False)), n,
                          4 * 512)[0]
        scores = (nn["a"] * nn["s"] * (nn["rt_score_copies"] * nn["act_bytes"]
                                       + nn["rt_score_fp32_copies"] * 4.0)
                  + 4.0 * nn["a"] * nn["rt_softmax_stats"])
        lse = nn["a"] * nn["rt_attn_lse_bytes"]
        assert float(off - on) == pytest.approx(4 * 512 * (scores - lse), rel=F32_RTOL)


def test_gqa_shrinks_kv_params_and_activations():
    mha = make_scenario(llama_like(kv=8), count=1, global_batch=2)
    gqa = make_scenario(llama_like(kv=2), count=1, global_batch=2)
    a = estimate(Config(micro_batch=2), mha).memory
    b = estimate(Config(micro_batch=2), gqa).memory
    assert float(b["params_bytes"]) < float(a["params_bytes"])
    assert float(b["activations_bytes"]) < float(a["activations_bytes"])


def test_qlora_base_is_quantised_and_only_adapters_train():
    model = llama_like(layers=4, hidden=512, heads=8, kv=8)
    lora = make_scenario(model, count=1, global_batch=2, runtime="pytorch",
                         lora=LoRA(rank=8, targets=("attn", "mlp"), base_bits=4))
    full = make_scenario(model, count=1, global_batch=2, runtime="pytorch")
    ml = estimate(Config(micro_batch=2), lora).memory
    mf = estimate(Config(micro_batch=2), full).memory
    n = scenario_numbers(lora)
    assert float(ml["trainable_params"]) == pytest.approx(n["L"] * n["lora_layer"], rel=F32_RTOL)
    # Wrapped matrices at 4 bits (NF4 + constants), everything else frozen in bf16, adapters
    # in the working precision.
    wrapped = n["L"] * n["lora_base_layer"]
    expected = (wrapped * n["base_bytes"] + (n["P_total"] - wrapped) * n["frozen_bytes"]
                + n["L"] * n["lora_layer"] * n["param_bytes"])
    assert float(ml["params_bytes"]) == pytest.approx(expected, rel=F32_RTOL)
    assert n["base_bytes"] < 0.3 * n["frozen_bytes"]   # about a quarter of bf16
    assert float(ml["optimizer_bytes"]) < 0.05 * float(mf["optimizer_bytes"])


@pytest.mark.parametrize("runtime", ["pytorch", "xla-gpu"])
def test_nf4_without_double_quantisation_stores_a_float32_absmax_and_nothing_else(runtime):
    """``training.lora.double_quant = false``: each 64-weight block of the NF4 base keeps a
    float32 absmax (4 bytes) where double quantisation keeps an 8-bit code and 1/256 of a
    float32 scale (bitsandbytes quantize_4bit with and without compress_statistics): the
    base's bytes grow by (4 - 1 - 4/256) / 64 a stored weight, and no other term moves."""
    from capopt._runtime import NF4_BYTES_PER_WEIGHT, NF4_PLAIN_BYTES_PER_WEIGHT
    model = llama_like(layers=4, hidden=512, heads=8, kv=8)
    cfg = Config(micro_batch=2, remat="full")
    out = {}
    for dq in (True, False):
        sc = make_scenario(model, count=1, global_batch=2, runtime=runtime,
                           lora=LoRA(rank=8, targets=("q", "v"), base_bits=4, double_quant=dq))
        out[dq] = (estimate(cfg, sc).memory, scenario_numbers(sc))
    (m_dq, n_dq), (m_plain, n_plain) = out[True], out[False]
    assert n_dq["base_bytes"] == pytest.approx(NF4_BYTES_PER_WEIGHT)
    assert n_plain["base_bytes"] == pytest.approx(NF4_PLAIN_BYTES_PER_WEIGHT)
    # every block matmul is stored in 4 bits, wrapped (q, v) or not
    stored = n_dq["L"] * n_dq["lora_base_layer"]
    assert stored > 0.9 * n_dq["L"] * (4 * 512 * 512 + 3 * 512 * n_dq["f"])
    grown = stored * (NF4_PLAIN_BYTES_PER_WEIGHT - NF4_BYTES_PER_WEIGHT)
    assert float(m_plain["params_bytes"]) - float(m_dq["params_bytes"]) == pytest.approx(
        grown, rel=1e-4)    # a difference of float32 sums (~1e-7 each), 60x smaller here
    for key in ("trainable_bytes", "optimizer_bytes", "grads_bytes", "activations_bytes",
                "logits_bytes", "comm_bytes", "weight_copy_bytes"):
        assert float(m_plain[key]) == float(m_dq[key]), key


@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_scales_stay_whole_over_tp_where_the_runtime_lays_them_out_so(double_quant):
    """The xla-gpu step keeps a column-parallel (and split k/v) matrix's block absmax whole on
    every tensor-parallel rank beside its split codes, and every split matrix's absmax-code
    scales whole (``nf4_scales_whole_over_tp``): tp 2 adds half of those bytes a block to the
    split base; a profile without the rule splits them with the matrix. (The layout's bytes
    against the step's own: tests/test_validation.py, qlora-tp.)"""
    from capopt._runtime import nf4_scale_bytes
    model = llama_like(layers=4, hidden=512, heads=8, kv=8)
    lora = LoRA(rank=8, targets=("attn", "mlp"), base_bits=4, double_quant=double_quant)
    cfg = Config(micro_batch=2, tp=2)
    sc = make_scenario(model, count=2, global_batch=2, runtime="xla-gpu", lora=lora)
    split = sc.replace(runtime=sc.runtime.with_coeffs(nf4_scales_whole_over_tp=0.0))
    whole, apart = (float(estimate(cfg, s).memory["params_bytes"]) for s in (sc, split))
    absmax, scale2 = nf4_scale_bytes(double_quant)
    h, f = 512, scenario_numbers(sc)["f"]
    col, kv, row = h * h + 2 * h * f, 2 * h * h, h * h + f * h    # q gate up; k v; o down
    want = 4 * 0.5 * (absmax * (col + kv) + scale2 * (col + kv + row))
    assert whole - apart == pytest.approx(want, rel=1e-4)   # float32 sums' difference
    # nothing else in the state moves
    for key in ("optimizer_bytes", "grads_bytes", "trainable_bytes"):
        assert float(estimate(cfg, sc).memory[key]) == float(estimate(cfg, split).memory[key])


def test_moe_expert_parallelism_divides_expert_weights():
    moe = llama_like(num_local_experts=8, num_experts_per_tok=2)
    sc = make_scenario(moe, count=8, global_batch=8)
    p1 = float(estimate(Config(micro_batch=1, dp=8, ep=1), sc).memory["params_bytes"])
    p8 = float(estimate(Config(micro_batch=1, dp=8, ep=8), sc).memory["params_bytes"])
    n = scenario_numbers(sc)
    saved = n["L"] * n["P_expert"] * (8 - 1) * n["param_bytes"]
    assert p1 - p8 == pytest.approx(saved, rel=F32_RTOL)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_qlora_on_experts_splits_their_base_and_adapters_over_ep(ep):
    # every expert matrix is wrapped ("mlp"): a device holds E / ep experts' 4-bit bases and
    # adapters, and the optimizer state of those adapters only (ZeRO 0: no dp split)
    moe = llama_like(layers=2, hidden=256, heads=8, kv=8, intermediate_size=512, vocab=1000,
                     num_local_experts=8, num_experts_per_tok=2)
    sc = make_scenario(moe, count=8, global_batch=8, runtime="pytorch",
                       lora=LoRA(rank=8, targets=("attn", "mlp"), base_bits=4))
    n = scenario_numbers(sc)
    m1 = estimate(Config(micro_batch=1, dp=8, ep=1), sc).memory
    me = estimate(Config(micro_batch=1, dp=8, ep=ep), sc).memory
    off = n["L"] * (1 - 1 / ep)
    saved = off * (n["lora_base_expert"] * n["base_bytes"]
                   + n["lora_expert"] * n["param_bytes"])
    assert n["lora_base_expert"] > 0 and n["lora_expert"] > 0
    assert float(m1["params_bytes"]) - float(me["params_bytes"]) == pytest.approx(
        saved, rel=F32_RTOL)
    assert float(me["params_bytes"]) > 0
    state = off * n["lora_expert"] * (n["master_bytes"] + n["opt_bytes"])
    assert float(m1["optimizer_bytes"]) - float(me["optimizer_bytes"]) == pytest.approx(
        state, rel=F32_RTOL)


def test_pipeline_first_stage_holds_in_flight_microbatches():
    sc = make_scenario(gpt_like(layers=8), count=4, global_batch=16)
    m = estimate(Config(micro_batch=1, grad_accum=16, pp=4, dp=1, tp=1), sc).memory
    # 1F1B: stage 0 keeps p = 4 micro-batches of its 2 blocks; the last stage keeps one.
    assert float(m["first_stage_bytes"]) != float(m["last_stage_bytes"])
    sc1 = make_scenario(gpt_like(layers=8), count=4, global_batch=4)
    few = estimate(Config(micro_batch=1, grad_accum=1, pp=4, dp=1), sc1).memory
    assert float(few["activations_bytes"]) < float(m["activations_bytes"])


# --------------------------------------------------------------------------------------------
# Differentiability at relaxed points
# --------------------------------------------------------------------------------------------
def _relaxed_total(sc):
    n = numbers_pytree(sc)
    base = knobs_from_config(Config(micro_batch=2, grad_accum=2, dp=4, tp=2, pp=1))

    def total(x):
        k = base.replace(micro_batch=x[0], grad_accum=x[1], dp=x[2], tp=x[3], pp=x[4],
                         zero=jax.nn.softmax(x[5:9]), remat=jax.nn.softmax(x[9:12]),
                         sp=jax.nn.sigmoid(x[12]), offload=jax.nn.sigmoid(x[13]),
                         flash=jax.nn.sigmoid(x[14]))
        return memory(k, n)["total_bytes"] / 2**30
    return total


def test_gradient_of_total_is_finite_and_checked():
    sc = make_scenario(llama_like(), count=8, global_batch=64)
    f = _relaxed_total(sc)
    rng = np.random.default_rng(0)
    for _ in range(5):
        # A relaxed point away from the kinks of min/clip (integers): degrees in (1.2, 5.8).
        x = jnp.concatenate([jnp.asarray(rng.uniform(1.2, 5.8, 5), jnp.float32),
                             jnp.asarray(rng.normal(size=10), jnp.float32)])
        g = jax.grad(f)(x)
        assert bool(jnp.all(jnp.isfinite(g)))
        # float32: finite differences with eps 1e-2 agree to ~1e-2 relative.
        check_grads(f, (x,), order=1, modes=["rev"], eps=1e-2, atol=5e-2, rtol=5e-2)


# --------------------------------------------------------------------------------------------
# Tensor-parallel replication (KV heads, vocabulary): exact at integers, continuous between
# --------------------------------------------------------------------------------------------
def test_indivisible_is_exact_at_integers_and_continuous():
    from capopt.cost.memory import indivisible
    for count in (50257, 30522, 32000, 128):
        for d in range(1, 17):
            assert float(indivisible(float(count), float(d))) == float(count % d != 0)
    # linear between neighbours: halfway from 4 (divides 32000) to 5 (divides) to 6 (does not)
    assert float(indivisible(32000.0, 5.5)) == pytest.approx(0.5)
    g = jax.grad(lambda t: indivisible(32000.0, t))(5.5)
    assert float(g) == pytest.approx(1.0)


def test_kv_heads_and_vocabulary_replicate_when_tp_does_not_divide_them():
    model = llama_like(kv=2, vocab=1000)            # 1000 = 8 * 125: tp 8 divides it, 16 not
    sc = make_scenario(model, count=8, global_batch=8)
    n = scenario_numbers(sc)
    p = {t: float(estimate(Config(micro_batch=1, dp=8 // t, tp=t), sc).memory["params_bytes"])
         for t in (2, 4, 8)}
    per_elem = n["param_bytes"]
    # tp 2 splits everything tensor-parallel; at tp 4 > kv 2, k and v stay whole (3/4 extra)
    def split_only(t):
        return (n["L"] * (n["P_layer_tp"] / t + n["P_layer_rep"]) + n["P_embed_tp"] / t
                + n["P_embed_rep"] + n["P_head_rep"] + n["P_head_tp"] / t) * per_elem
    assert p[2] == pytest.approx(split_only(2), rel=F32_RTOL)
    extra_kv = n["L"] * n["P_layer_kv"] * (1 - 1 / 4) * per_elem
    assert p[4] == pytest.approx(split_only(4) + extra_kv, rel=F32_RTOL)
    odd = make_scenario(llama_like(kv=2, vocab=1001), count=8, global_batch=8)
    no = scenario_numbers(odd)
    q = float(estimate(Config(micro_batch=1, dp=4, tp=2), odd).memory["params_bytes"])
    # 1001 is odd: the (untied) embedding and head stay whole at tp 2
    whole = (no["L"] * (no["P_layer_tp"] / 2 + no["P_layer_rep"]) + no["P_embed_tp"]
             + no["P_embed_rep"] + no["P_head_rep"] + no["P_head_tp"]) * no["param_bytes"]
    assert q == pytest.approx(whole, rel=F32_RTOL)


def test_zero3_gathered_weights_bounded_by_max_live_params():
    """DeepSpeed ZeRO-3 keeps at most stage3_max_live_parameters gathered elements plus the
    module about to run; a small model's two whole layers stay under that bound, XLA gathers
    whole layers."""
    from capopt.cost.memory import largest_module
    big = gpt_like(layers=8, hidden=8192, heads=64, vocab=1024)   # ~0.8B parameters a layer
    cfg = Config(micro_batch=1, dp=8, zero_stage=3, remat="full")
    k = knobs_from_config(cfg)
    sc = make_scenario(big, runtime="pytorch", count=8, global_batch=8)
    n = scenario_numbers(sc)
    comm = float(estimate(cfg, sc).memory["comm_bytes"])
    largest = float(largest_module(k, numbers_pytree(n)))
    assert largest == pytest.approx(8192 * 4 * 8192)               # the MLP's up projection
    # (an all-gather's output is whole: world size x shard, beside the device's shard)
    bound = (n["rt_zero3_max_live_params"] + largest) * n["param_bytes"]
    two_layers = 2 * (n["P_layer_tp"] + n["P_layer_rep"]) * n["param_bytes"]
    assert bound < two_layers
    assert comm == pytest.approx(bound + n["rt_comm_bucket_bytes"], rel=F32_RTOL)
    # without the bound (XLA, or a raised stage3_max_live_parameters): two whole layers
    loose = sc.replace(runtime=sc.runtime.with_coeffs(zero3_max_live_params=1e15))
    assert float(estimate(cfg, loose).memory["comm_bytes"]) == pytest.approx(
        two_layers + n["rt_comm_bucket_bytes"], rel=F32_RTOL)
    # XLA: no element bound; weights gathered in the compute dtype; rebuilt blocks gather
    # again (the prefetch window), stored blocks keep theirs for the backward (all of them)
    xla = make_scenario(big, runtime="xla-gpu", count=8, global_batch=8)
    nx = scenario_numbers(xla)
    layer_x = (nx["P_layer_tp"] + nx["P_layer_rep"]) * nx["weight_copy_bytes"]
    assert nx["weight_copy_bytes"] < nx["param_bytes"]
    assert float(estimate(cfg, xla).memory["comm_bytes"]) == pytest.approx(
        2 * layer_x + nx["rt_comm_bucket_bytes"], rel=F32_RTOL)
    stored = cfg.replace(remat="none")
    assert float(estimate(stored, xla).memory["comm_bytes"]) == pytest.approx(
        nx["L"] * layer_x + nx["rt_comm_bucket_bytes"], rel=F32_RTOL)
    # a small model's two layers are under the bound: unchanged
    small = make_scenario(gpt_like(), runtime="pytorch", count=8, global_batch=8)
    ns = scenario_numbers(small)
    assert float(estimate(cfg, small).memory["comm_bytes"]) == pytest.approx(
        2 * (ns["P_layer_tp"] + ns["P_layer_rep"]) * ns["param_bytes"]
        + ns["rt_comm_bucket_bytes"], rel=F32_RTOL)


def test_every_profile_has_the_same_coefficients():
    """One numbers pytree for every built-in profile (the jitted solver does not retrace)."""
    from capopt._runtime import get_profile
    names = ("pytorch", "xla-cpu", "xla-gpu")
    keys = {name: set(get_profile(name).coeff_dict()) for name in names}
    for name in names:
        assert keys[name] == keys["pytorch"], name


# --------------------------------------------------------------------------------------------
# The end stages in one evaluation: the same numbers as one stage_memory call per stage
# --------------------------------------------------------------------------------------------
from capopt.cost.memory import stage_memory, end_stage_args, end_stage_memory  # noqa: E402

END_STAGE_SCENARIOS = {
    "gpt": make_scenario(gpt_like(layers=4), count=64, global_batch=64),
    "moe": make_scenario(llama_like(layers=4, num_local_experts=4, num_experts_per_tok=2),
                         count=64, global_batch=64, runtime="pytorch"),
    "lora": make_scenario(llama_like(layers=4), count=64, global_batch=64,
                          lora=LoRA(rank=8, base_bits=4)),
    "xla": make_scenario(llama_like(layers=8), runtime="xla-gpu", count=64, global_batch=64),
}
END_STAGE_NUMBERS = {key: numbers_pytree(sc) for key, sc in END_STAGE_SCENARIOS.items()}


@jax.jit
def _end_stages_both_ways(k, n):
    """(stacked end stages, first stage alone, last stage alone, memory)."""
    first, last = end_stage_args(k, n)
    layers = n["L"] / k.pp
    return (end_stage_memory(k, n), stage_memory(k, n, layers=layers, **first),
            stage_memory(k, n, layers=layers, **last), memory(k, n))


def test_end_stage_memory_in_one_evaluation_equals_one_call_per_stage():
    # memory() evaluates the first and the last pipeline stage as one stage_memory call over
    # a leading axis of two (vmap): every term of both equals its own stage_memory call (with
    # first_stage a Python bool), to float32 rounding, at integer and at relaxed points; the
    # breakdown memory() reports is the larger stage's
    for which in sorted(END_STAGE_SCENARIOS):
        for k in [knobs_from_config(c) for c in END_STAGE_CONFIGS] + [RELAXED_KNOBS]:
            both, first, last, out = _end_stages_both_ways(k, END_STAGE_NUMBERS[which])
            assert set(both) == set(first) == set(last)
            for key in first:
                for i, ref in ((0, first), (1, last)):
                    np.testing.assert_allclose(np.asarray(both[key])[i], np.asarray(ref[key]),
                                               rtol=F32_RTOL, atol=1e-9,
                                               err_msg=f"{which} {key} stage {i}")
            f_tot, l_tot = float(first["total_bytes"]), float(last["total_bytes"])
            pick = first if f_tot >= l_tot else last
            close = np.isclose(f_tot, l_tot, rtol=F32_RTOL)
            for key in first:
                ok = [np.isclose(float(out[key]), float(st[key]), rtol=F32_RTOL, atol=1e-9)
                      for st in ((first, last) if close else (pick,))]
                assert any(ok), (which, key)
            np.testing.assert_allclose(float(out["first_stage_bytes"]), f_tot, rtol=F32_RTOL)
            np.testing.assert_allclose(float(out["last_stage_bytes"]), l_tot, rtol=F32_RTOL)


def test_torchtitans_op_policy_saves_every_other_plain_matmul():
    """torchtitan's per-op checkpointing on Llama 3.1 8B's block (q, k, v, o; w1, w3, w2 as
    aten.mm): mm 1, 3, 5, 7 are saved (q 4096, v 1024 and w1 14336 wide, split by tp; w2's
    partial sums 4096 wide on every rank); k, o and w3 are recomputed. A block whose
    projections all have biases runs addmm, neither counted nor saved. The torchtitan
    profile's selective policy keeps those widths plus the block input and the flash
    kernel's output and float32 log-sum-exp, exactly."""
    from capopt._cards import load_card
    from capopt._inventory import inventory
    from capopt.cost._inputs import op_checkpoint_widths
    m = load_card("llama-3.1-8b")
    w = op_checkpoint_widths(inventory(m), m.num_hidden_layers)
    assert w == {"ops_tp": 4096 + 1024 + 14336, "ops_whole": 4096, "ops_rows": 2,
                 "ops_recompute_w": 4096 * 1024 + 4096 * 4096 + 4096 * 14336}
    gpt = gpt_like()
    w = op_checkpoint_widths(inventory(gpt), gpt.num_hidden_layers)
    assert w["ops_tp"] == w["ops_whole"] == 0.0

    from capopt.cost._inputs import runtime_numbers
    sc = make_scenario(m, runtime="torchtitan", precision="bf16-mixed", seq_len=8192)

    def saved(cfg):
        k = knobs_from_config(cfg)
        return float(saved_bytes(k, runtime_numbers(k, numbers_pytree(sc)), 2 * 8192)[1])
    # under FSDP (ZeRO-3): FSDP2's bf16 parameters, a bf16 stream
    sel = saved(Config(micro_batch=2, dp=8, zero_stage=3, remat="selective"))
    per_token = 2 * (4096 + 4096 + 1024 + 14336 + 4096 + 4096) + 4 * 32
    assert sel == pytest.approx(2 * 8192 * per_token, rel=1e-6)
    # one device: torch.autocast (torchtitan's maybe_enable_amp), the block input in float32
    one = saved(Config(micro_batch=2, remat="selective"))
    assert one == pytest.approx(2 * 8192 * (per_token + 2 * 4096), rel=1e-6)
    # tp 8 with sequence parallelism (and FSDP): the input and both reduce-scatters' outputs
    # split, the column outputs split, w2's partial sums whole
    sel8 = saved(Config(micro_batch=2, dp=2, zero_stage=3, tp=8, sequence_parallel=True,
                        remat="selective"))
    per_token8 = 2 * (4096 / 8 + 2 * 4096 / 8 + (4096 + 1024 + 14336 + 4096) / 8 + 4096) + 4 * 4
    assert sel8 == pytest.approx(2 * 8192 * per_token8, rel=1e-6)


def _wide_vocab():
    """One small block under a 65536-entry vocabulary: the loss makes the peak."""
    from capopt._model import ModelSpec
    return ModelSpec(name="v", family="decoder", hidden_size=64, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=128, vocab_size=65536,
                     position_embedding="rotary", norm_type="rmsnorm", mlp_type="gated",
                     hidden_act="silu")


def test_a_chunked_loss_holds_every_slices_float32_log_probabilities():
    """``loss = "chunked"`` (torchtune's, eager): where the loss makes the peak, its logits
    term is every slice's float32 log-probabilities plus one slice's nll_loss gradient and
    log_softmax backward result, micro_batch x s x V x 4 x (1 + 2 / 8) bytes, exactly (the
    head's weight gradients, 65536 x 64, are too small here to move the peak to the second
    slice); its head GEMMs run on an eighth of the rows; nothing else changes."""
    import dataclasses
    sc = make_scenario(_wide_vocab(), runtime="pytorch-eager", count=1, global_batch=4, seq_len=512)
    ch = sc.replace(workload=dataclasses.replace(sc.workload, loss="chunked"))
    cfg = Config(micro_batch=4)
    mem_c, mem_u = estimate(cfg, ch).memory, estimate(cfg, sc).memory
    assert float(mem_c["logits_bytes"]) == 4 * 512 * 65536 * 4 * (1 + 2 / 8)
    assert float(mem_u["logits_bytes"]) == 4 * 512 * 65536 * 4 * 3
    for key in ("params_bytes", "optimizer_bytes", "grads_bytes", "activations_bytes"):
        assert float(mem_c[key]) == float(mem_u[key]), key


def test_a_fused_loss_holds_two_compute_dtype_logits_copies():
    """``loss = "fused"``: where the loss makes the peak (a large vocabulary, a small model),
    its logits term is the compute-dtype logits and their gradient, micro_batch x s x V x 2
    x 2 bytes in bf16, exactly; the float32 loss (pytorch: two float32 copies and one bf16)
    holds more; a calibrated profile's loss coefficients do not undo the choice."""
    import dataclasses
    from capopt._model import ModelSpec
    from capopt.cost import estimate_numbers
    m = ModelSpec(name="v", family="decoder", hidden_size=64, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=128, vocab_size=65536,
                  position_embedding="rotary", norm_type="rmsnorm", mlp_type="gated",
                  hidden_act="silu")
    sc = make_scenario(m, runtime="pytorch", count=1, global_batch=4, seq_len=512)
    fused = sc.replace(workload=dataclasses.replace(sc.workload, loss="fused"))
    cfg = Config(micro_batch=4)
    mem_f, mem_u = estimate(cfg, fused).memory, estimate(cfg, sc).memory
    assert float(mem_f["logits_bytes"]) == 4 * 512 * 65536 * 2 * 2
    assert float(mem_u["logits_bytes"]) == 4 * 512 * 65536 * (2 * 4 + 2)
    # ... and nothing else: the model's states and the blocks' activations are the same
    for key in ("params_bytes", "optimizer_bytes", "grads_bytes", "activations_bytes"):
        assert float(mem_f[key]) == float(mem_u[key]), key
    n = numbers_pytree(fused)
    n = {**n, "rt_logits_fp32_copies": n["rt_logits_fp32_copies"] + 1.0}   # (a calibration)
    out = estimate_numbers(knobs_from_config(cfg), n).memory
    assert float(out["logits_bytes"]) == 4 * 512 * 65536 * 2 * 2


def test_llm_foundry_is_torchtitans_fsdp_precision_on_fsdp1s_buffers():
    """Composer's FSDP1 against torchtitan's FSDP2, both gathering bf16 parameters with no
    autocast casts, under ZeRO-3 and full recomputation (where torchtitan's per-op policy
    plays no part): the same parameters, optimizer state, activations and gathered blocks
    (two whole blocks each: FSDP1's flat parameter in use and the one prefetched, FSDP2's
    copied-out group and the next group's flat all-gather output); FSDP2 holds a group's
    reduce-scatter input until the next group's reduction (``zero_holds_reduce_input``),
    FSDP1 drops it in the hook; and FSDP1 keeps the root gathered after the forward pass
    (``zero3_root_regather`` 0): the root is live at the loss, and never gathered again.
    Under ZeRO-2 the two keep the same buffers but for the optimizer's temporaries, that
    reduce-scatter input and FSDP2's last all-gather output at the forward pass's end."""
    m = gpt_like(layers=4, hidden=512, heads=8, vocab=1024, seq=1024)
    cfg = Config(micro_batch=2, dp=8, zero_stage=3, remat="full")
    mem = {}
    for rt in ("torchtitan", "llm-foundry"):
        sc = make_scenario(m, runtime=rt, seq_len=1024, count=8, global_batch=16)
        mem[rt] = {k: float(v) for k, v in estimate(cfg, sc).memory.items()}
        mem[rt, 2] = {k: float(v) for k, v in
                      estimate(cfg.replace(zero_stage=2), sc).memory.items()}
    n = scenario_numbers(make_scenario(m, runtime="llm-foundry", seq_len=1024, count=8))
    tt, lf = mem["torchtitan"], mem["llm-foundry"]
    for key in ("params_bytes", "optimizer_bytes", "activations_bytes", "logits_bytes",
                "comm_bytes"):
        assert lf[key] == tt[key], key
    # at the rebuild (the peak of both), FSDP2's middle block holds the reduce-scatter input
    # of the block above (in the reduce dtype, float32) where the top block holds that
    # block's checkpoint (2 x 1024 tokens x 512, bf16), freed by then: the difference
    block = (n["P_layer_tp"] + n["P_layer_rep"]) * 4
    checkpoint = 2 * 1024 * 512 * 2
    assert tt["grads_bytes"] - lf["grads_bytes"] == pytest.approx(block - checkpoint,
                                                                  rel=10 * F32_RTOL)
    root = (m.num_params() - 4 * (n["P_layer_tp"] + n["P_layer_rep"])) * 2   # bf16, whole
    # (the allocator's slack on dynamic buffers counted on it too; the phases are float32
    # sums of the whole step's buffers, some hundred times the root's bytes: 100 roundings)
    assert lf["phase_loss_bytes"] - tt["phase_loss_bytes"] == pytest.approx(
        root * (1 + n["rt_fragmentation"]), rel=100 * F32_RTOL)
    assert lf["phase_regather_bytes"] < lf["phase_loss_bytes"]
    # ZeRO-2: the same buffers but at the update, where torch's foreach Adam holds a
    # state-sized square root (torchtitan) and Composer's DecoupledAdamW one tensor's, and
    # where FSDP2 holds a block's reduce-scatter input (a float32 block, as above): at the
    # bottom block's backward the block above's; at the block below the top, the top
    # block's in place of its bf16 copy, resharded, and of one checkpoint (the top and
    # rebuild phases); the allocator's fragmentation is counted on all of them
    lf2, tt2 = mem["llm-foundry", 2], mem["torchtitan", 2]
    frag = 1 + n["rt_fragmentation"]
    for key in ("params_bytes", "optimizer_bytes", "phase_loss_bytes", "phase_regather_bytes"):
        assert lf2[key] == tt2[key], key
    # (at the forward pass's end FSDP2 still holds the last group's all-gather output, a bf16
    # block, ``zero_holds_gather_output``; FSDP1's flat parameter is that output itself)
    assert tt2["phase_forward_bytes"] - lf2["phase_forward_bytes"] == pytest.approx(
        block / 2 * frag, rel=100 * F32_RTOL)
    assert lf2["phase_update_bytes"] < tt2["phase_update_bytes"]
    assert tt2["phase_bottom_bytes"] - lf2["phase_bottom_bytes"] == pytest.approx(
        block * frag, rel=100 * F32_RTOL)
    for key in ("phase_top_bytes", "phase_rebuild_bytes"):
        assert tt2[key] - lf2[key] == pytest.approx((block - block / 2 - checkpoint) * frag,
                                                    rel=100 * F32_RTOL), key


@pytest.mark.parametrize("dp", [1, 8])
def test_megatron_model_states_are_its_theoretical_18_bytes(dp):
    """Megatron-LM's own accounting (megatron/training/theoretical_memory_usage.py): under
    --bf16, 18 bytes per parameter (bf16 weights, float32 main_grad, float32 master weights
    and Adam moments); with the distributed optimizer (ZeRO-1) 6 + 12 / dp."""
    m = gpt_like(layers=2, hidden=256, heads=4, vocab=1024, seq=256)
    sc = make_scenario(m, runtime="megatron", seq_len=256, count=dp, global_batch=dp)
    mem = estimate(Config(micro_batch=1, dp=dp, zero_stage=1 if dp > 1 else 0), sc).memory
    states = float(mem["params_bytes"] + mem["grads_all_bytes"] + mem["optimizer_bytes"])
    per_param = 6 + 12 / dp if dp > 1 else 18
    # (three float32 totals summed: a few roundings each)
    assert states == pytest.approx(per_param * m.num_params(), rel=10 * F32_RTOL)


def test_cached_slack_is_in_the_reserved_figure_and_not_in_the_budgeted_total():
    """The caching allocator keeps freed blocks cached while memory is not short (reserved
    over allocated: fragmentation + cached_slack per dynamic byte), and frees every non-split
    cached block before failing: the total the budget counts carries the fragmentation and
    not the cached slack."""
    m = llama_like(layers=2, hidden=256, heads=4, kv=4)
    sc = make_scenario(m, runtime="pytorch-eager", seq_len=512)
    cfg = Config(micro_batch=2)
    frag = sc.runtime.coeff("fragmentation")

    def mem(cached):
        rt = sc.runtime.with_coeffs(cached_slack=cached)
        return {k: float(v) for k, v in estimate(cfg, sc.replace(runtime=rt)).memory.items()}

    none, some = mem(0.0), mem(0.3)
    assert some["total_bytes"] == none["total_bytes"]
    assert some["allocated_bytes"] == none["allocated_bytes"]
    dynamic = (none["reserved_bytes"] - none["allocated_bytes"]) / frag
    assert some["reserved_bytes"] - none["reserved_bytes"] == pytest.approx(
        0.3 * dynamic, rel=100 * F32_RTOL)       # (a difference of float32 totals)
    assert get_profile("pytorch-eager").coeff("cached_slack") > 0


def test_fsdp_under_a_pipeline_schedule_keeps_its_stage_gathered_and_its_grads_unsharded():
    """PyTorch's pipeline schedules run FSDP without per-micro-batch sync (``zero_pp_nosync``,
    torch.distributed.pipelining stage.py): ZeRO-3 keeps the stage's gathered parameters as
    ZeRO-2 does, ZeRO-2/3 keep their gradients whole (as ZeRO-1 does), the optimizer state
    stays split; the stage gathers and reduce-scatters once a step, not once a micro-batch."""
    from capopt.cost import estimate_numbers
    m = llama_like(layers=8, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="pytorch-eager", count=8, global_batch=32)
    n = numbers_pytree(sc)
    assert float(n["rt_zero_pp_nosync"]) == 1.0
    off = {**n, "rt_zero_pp_nosync": jnp.zeros_like(n["rt_zero_pp_nosync"])}

    def run(cfg, numbers):
        out = estimate_numbers(knobs_from_config(cfg), numbers)
        return ({k: float(v) for k, v in out.memory.items()},
                {k: float(v) for k, v in out.time.items()})

    pp = Config(micro_batch=1, grad_accum=8, dp=4, pp=2)
    z1, _ = run(pp.replace(zero_stage=1), n)
    z2, _ = run(pp.replace(zero_stage=2), n)
    z3, t3 = run(pp.replace(zero_stage=3), n)
    z3_off, t3_off = run(pp.replace(zero_stage=3), off)
    assert z3["params_bytes"] == z2["params_bytes"] > z3_off["params_bytes"]
    for z in (z2, z3):
        assert z["grads_all_bytes"] == z1["grads_all_bytes"]
        assert z["optimizer_bytes"] == z1["optimizer_bytes"]
    # (each of the 4 data-parallel ranks keeps a quarter of the gradients when they sync)
    assert z3_off["grads_all_bytes"] == pytest.approx(z3["grads_all_bytes"] / 4, rel=0.05)
    # without pipeline parallelism nothing changes: the flag reads pp >= 2
    flat = Config(micro_batch=1, grad_accum=4, dp=8, zero_stage=3)
    assert run(flat, n)[0] == run(flat, off)[0]
    # communication: once a step with the flag, once a micro-batch without it
    def zero_comm(ga, numbers):             # ZeRO traffic, exposed and hidden
        t = run(pp.replace(zero_stage=3, grad_accum=ga), numbers)[1]
        return t["comm_zero_s"] + t["comm_hidden_s"]
    # (twice the micro-batches: the per-micro-batch gathers and scatters double; the
    # once-a-step ones do not, but for the pipeline's sends, hidden too, a few percent here)
    assert zero_comm(16, n) == pytest.approx(zero_comm(8, n), rel=0.05)
    assert zero_comm(16, off) > 1.8 * zero_comm(8, off)
    assert t3["step_s"] < t3_off["step_s"]


def test_context_parallelism_at_the_same_tokens_per_rank_adds_only_the_rings_buffers_and_traffic():
    """Context parallelism (torch's ring attention, torchtitan's context_parallel_degree)
    splits each sequence over cp ranks of the data-parallel group: cp = 2 with micro-batch 2
    holds, on each rank, the tokens of cp = 1 with micro-batch 1 (2 x s/2), whose queries
    attend to as many keys in all (2 x s/2 x s = s x s), at the same global batch (dp / cp
    replicas). The state is sharded over the same dp ranks. So the two price the same
    parameters, gradients, optimizer state, logits, FLOPs and ZeRO traffic; cp adds the
    ring's backward buffers (the gathered keys and values of the whole sequence, float32
    accumulators of dq, dk, dv and their per-step partials, dk, dv in flight) and the
    exchange of keys and values (``comm_cp_s``), and nothing else."""
    from capopt._validity import config_problems
    from capopt.cost import estimate_numbers
    from capopt.cost.activations import context_parallel_transient
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=8, seq_len=4096, global_batch=8)
    n = numbers_pytree(sc)

    def run(cfg):
        out = estimate_numbers(knobs_from_config(cfg), n)
        return ({k: float(v) for k, v in out.memory.items()},
                {k: float(v) for k, v in out.time.items()},
                {k: float(v) for k, v in out.throughput.items()})

    base = Config(micro_batch=1, grad_accum=1, dp=8, zero_stage=3, remat="none")
    ring = base.replace(micro_batch=2, cp=2)
    assert not config_problems(ring, sc) and not config_problems(base, sc)
    (m1, t1, r1), (m2, t2, r2) = run(base), run(ring)
    for term in ("params_bytes", "grads_all_bytes", "optimizer_bytes"):
        assert m2[term] == pytest.approx(m1[term], rel=1e-6), term
    # the ring's buffers, by hand: 4096 tokens a rank; keys and values 4 heads x 64 wide
    # each, queries 8 x 64; bf16 compute (2 bytes), float32 accumulators
    kv, q = 2 * 4 * 64, 8 * 64
    by_hand = 4096 * (2 * kv * 2 + 2 * 4 * (q + kv) + 2 * 4 * kv)
    k2 = knobs_from_config(ring)
    assert float(context_parallel_transient(k2, n, 4096.0)) == pytest.approx(by_hand)
    # (the ring's buffers are live in the attention's backward, where the block's MLP
    # tensors are freed already: the phases of a block's backward grow by more than nothing
    # and at most by them, the others not at all; the peak, whichever phase it is, by at most
    # them; the terms are each phase's, so the totals are compared)
    for p in PHASES:
        grew = m2[f"phase_{p}_bytes"] - m1[f"phase_{p}_bytes"]
        if p in ("top", "bottom"):
            assert 0.0 < grew <= by_hand * (1 + 1e-6), p
        else:
            assert grew == pytest.approx(0.0, abs=1e-6 * m1[f"phase_{p}_bytes"] + 1.0), p
    grew = m2["total_bytes"] - m1["total_bytes"]
    assert 0.0 <= grew <= by_hand * (1 + 1e-6)
    # time: the same compute, the same ZeRO traffic, and the exchange on top
    assert t2["compute_s"] == pytest.approx(t1["compute_s"], rel=1e-5)
    assert t1["comm_cp_s"] == 0.0 and t2["comm_cp_s"] + t2["comm_hidden_s"] > t1["comm_hidden_s"]
    assert t2["comm_zero_s"] == pytest.approx(t1["comm_zero_s"], rel=1e-5)
    assert t2["step_s"] >= t1["step_s"]
    assert r2["tokens_per_s"] * t2["step_s"] == pytest.approx(r1["tokens_per_s"] * t1["step_s"])


def test_context_parallelism_splits_a_long_sequence_that_does_not_fit_whole():
    """At a sequence one rank cannot hold, cp divides the activations (their
    token-proportional part) by about cp; the parameters and optimizer state do not move."""
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=8, seq_len=65536, global_batch=4)
    one = estimate(Config(micro_batch=1, grad_accum=1, dp=8, cp=2, zero_stage=3), sc).memory
    four = estimate(Config(micro_batch=1, grad_accum=1, dp=8, cp=8, zero_stage=3),
                    make_scenario(m, runtime="torchtitan", count=8, seq_len=65536,
                                  global_batch=1)).memory
    assert four["params_bytes"] == pytest.approx(one["params_bytes"])
    assert four["optimizer_bytes"] == pytest.approx(one["optimizer_bytes"])
    # a quarter of the tokens a rank (the ring's gathered keys and values stay whole)
    assert 0.2 < four["activations_bytes"] / one["activations_bytes"] < 0.4


def test_interleaving_holds_the_warmup_chunks_and_changes_nothing_else():
    """Interleaved 1F1B with v chunks a rank: rank 0 warms up with (v - 1) p + 2 (p - 1)
    chunk forwards (Megatron-Core's and torch's schedules) and holds one more, (v p + p - 1) / v
    micro-batches of its blocks where 1F1B holds p: at p = 4, 5.5 (v = 2) and 4.75 (v = 4)
    against 4; its input edge (the embedding's output) for the micro-batches its first chunk
    has in flight, min(2 p, m) = 8 against 4. One more 1F1B micro-batch (m = 4 against 3) adds
    one block-set B and one edge E; the two interleavings then add 1.5 B + 4 E and 0.75 B + 4 E:
    B from their difference, E from the 1F1B step, and the v = 2 growth must equal 1.5 B + 4 E.
    Weights, gradients and optimizer state do not move; the point-to-point traffic doubles
    and the bubble is (p - 1) / v of the interleaved micro-batch time."""
    m = llama_like(layers=16, kv=2)

    def est_at(ga, vpp=1):
        sc = make_scenario(m, runtime="megatron", count=8, global_batch=2 * ga)
        return estimate(Config(micro_batch=1, grad_accum=ga, dp=2, pp=4, vpp=vpp), sc).to_dict()

    first = lambda e: e["memory"]["first_stage_bytes"]        # noqa: E731
    plain, inter, inter4 = est_at(16), est_at(16, vpp=2), est_at(16, vpp=4)
    one_more = first(est_at(4)) - first(est_at(3))            # B + E
    g2, g4 = first(inter) - first(plain), first(inter4) - first(plain)
    b = (g2 - g4) / 0.75
    e = one_more - b
    assert b > 0 and e > 0
    assert g2 == pytest.approx(1.5 * b + 4.0 * e, rel=1e-4)   # float32 sums of GiB-sized terms
    assert inter["memory"]["last_stage_bytes"] > plain["memory"]["last_stage_bytes"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "weight_copy_bytes"):
        assert inter["memory"][key] == plain["memory"][key], key
    assert inter["time"]["comm_pp_s"] == pytest.approx(2 * plain["time"]["comm_pp_s"], rel=1e-6)
    assert inter["time"]["compute_s"] == plain["time"]["compute_s"]
    t_mb = inter["time"]["step_s"] - inter["time"]["bubble_s"] - (
        inter["time"]["comm_dp_s"] + inter["time"]["optimizer_s"] + inter["time"]["offload_s"])
    t_mb = t_mb / 16.0                                        # the interleaved micro-batch time
    assert inter["time"]["bubble_s"] < plain["time"]["bubble_s"]
    assert inter["time"]["bubble_s"] == pytest.approx(3.0 / 2.0 * t_mb, rel=1e-5)


def test_interleaving_at_few_micro_batches_holds_them_all():
    """With m = p micro-batches the warmup reaches every chunk forward (m v of them) before the
    first backward: the same m micro-batches in flight as 1F1B on rank 0."""
    m = llama_like(layers=8, kv=2)
    sc = make_scenario(m, runtime="megatron", count=8, global_batch=8)
    plain = estimate(Config(micro_batch=1, grad_accum=4, dp=2, pp=4), sc).to_dict()["memory"]
    inter = estimate(Config(micro_batch=1, grad_accum=4, dp=2, pp=4, vpp=2), sc).to_dict()
    assert inter["memory"]["first_stage_bytes"] == pytest.approx(plain["first_stage_bytes"],
                                                                 rel=1e-6)


# --------------------------------------------------------------------------------------------
# LoRA on chosen matrices (PEFT's target_modules)
# --------------------------------------------------------------------------------------------
def _lora_numbers(targets, *, bits=16, runtime="pytorch-eager", flash=True, model=None,
                  coeffs=None):
    sc = make_scenario(model or llama_like(), count=1, global_batch=2, runtime=runtime,
                       lora=LoRA(rank=8, targets=targets, base_bits=bits))
    if coeffs:
        sc = sc.replace(runtime=sc.runtime.with_coeffs(**coeffs))
    cfg = Config(micro_batch=2, flash_attention=flash)
    return sc, cfg, knobs_from_config(cfg), numbers_pytree(scenario_numbers(sc))


def test_lora_targets_add_exactly_their_adapters():
    """q and v alone (PEFT's default for Llama-family models) train the q and v adapters of
    the inventory, and only them: per block r (h + q_w) + r (h + v_w) weights."""
    from capopt._inventory import inventory, trainable
    m = llama_like()
    _, _, _, n = _lora_numbers(("q", "v"), model=m)
    r, h, hd = 8, m.hidden_size, m.head_size
    per_block = r * (h + m.num_attention_heads * hd) + r * (h + m.kv_heads * hd)
    assert n["lora_layer"] == per_block
    adapters = trainable(inventory(m, LoRA(rank=8, targets=("q", "v"))))
    assert {t.name for t in adapters} == {"blocks.attn.q.lora_a", "blocks.attn.q.lora_b",
                                          "blocks.attn.v.lora_a", "blocks.attn.v.lora_b"}
    # a group and its members are one target set
    assert _lora_numbers(("attn",))[3] == _lora_numbers(("q", "k", "v", "o"))[3]


def test_a_quantised_base_quantises_every_block_matmul_whatever_the_targets():
    """bitsandbytes quantises every nn.Linear at load (transformers' replace_with_bnb_linear),
    PEFT then wraps its targets: QLoRA on q and v stores the MLP in NF4 too. The stored base
    is the same for every target set; only the adapters differ. A 16-bit base stores the
    unwrapped matrices in the compute dtype, as before."""
    m = llama_like()
    _, _, _, qv = _lora_numbers(("q", "v"), bits=4, model=m)
    _, _, _, every = _lora_numbers(("attn", "mlp"), bits=4, model=m)
    for key in ("lora_base_layer", "lora_base_kv", "lora_base_mats", "base_bytes"):
        assert qv[key] == every[key], key
    assert qv["lora_base_mats"] == 7                      # q k v o gate up down
    assert _lora_numbers(("q", "v"), bits=16, model=m)[3]["lora_base_mats"] == 2


def test_frozen_matrices_keep_no_inputs_where_the_runtime_drops_them():
    """Per block, the inputs a runtime keeps only for an adapter's gradient: with q and v
    wrapped, o's input (materialised attention's output; with a flash kernel, the
    sequence-first copy of its output where rotary embeddings made it heads-first, and
    nothing where it is a view of the output the kernel keeps anyway), gate/up's input (the
    second norm's output) and down's input go. In a runtime that keeps frozen inputs
    (xla-gpu's profile) nothing moves. Exact per-token counts."""
    m = llama_like()
    tokens = 2.0 * 512
    ab = 2.0                                                # bf16-mixed under LoRA
    ow, h, f = m.num_attention_heads * m.head_size, m.hidden_size, m.intermediate_size

    def saved(targets, **kw):
        _, _, k, n = _lora_numbers(targets, **kw)
        return float(saved_bytes(k, n, tokens)[0])

    assert saved(("q", "v", "o"), flash=False) - saved(("q", "v"), flash=False) == \
        pytest.approx(tokens * ab * ow, rel=F32_RTOL)
    assert saved(("q", "v", "o"), flash=True) - saved(("q", "v"), flash=True) == \
        pytest.approx(tokens * ab * ow, rel=F32_RTOL)
    gpt = gpt_like(layers=4, hidden=256, heads=8, seq=512, dropout=0.0)
    assert saved(("q", "v", "o"), flash=True, model=gpt) == pytest.approx(
        saved(("q", "v"), flash=True, model=gpt), rel=F32_RTOL)
    assert saved(("q", "v", "up")) - saved(("q", "v")) == pytest.approx(tokens * ab * h,
                                                                        rel=F32_RTOL)
    assert saved(("q", "v", "down")) - saved(("q", "v")) == pytest.approx(tokens * ab * f,
                                                                          rel=F32_RTOL)
    for targets in (("q", "v"), ("mlp",)):
        assert saved(targets, runtime="xla-gpu") == pytest.approx(
            saved(("attn", "mlp"), runtime="xla-gpu"), rel=F32_RTOL)


def test_the_first_block_keeps_nothing_before_its_first_adapter():
    """With the embedding frozen, the first block's input needs no gradient: autograd keeps
    nothing computed before the block's first adapter. Adapters on the attention: only the
    first norm's input and statistics go; on the MLP alone, the attention's saved tensors
    too (the score matrix included); nothing under full fine-tuning or full recomputation,
    or in a runtime that keeps frozen inputs."""
    from capopt.cost.activations import first_block_unsaved
    tokens = 2.0 * 512
    h = llama_like().hidden_size

    def unsaved(targets, **kw):
        _, _, k, n = _lora_numbers(targets, **kw)
        return [float(x) for x in first_block_unsaved(k, n, tokens)]

    none, sel, full = unsaved(("attn", "mlp"))
    assert none == pytest.approx(tokens * (2.0 * h + 4.0), rel=F32_RTOL)
    # (the profile's selective policy caches every matmul's output: the rule leaves it be)
    assert sel == 0.0 and full == 0.0
    korthikanti = {"selective_saves_dots": 0.0}
    assert unsaved(("attn", "mlp"), coeffs=korthikanti)[1] == pytest.approx(none, rel=F32_RTOL)
    mlp_none, mlp_sel, _ = unsaved(("mlp",), flash=False, coeffs=korthikanti)
    _, _, k, n = _lora_numbers(("mlp",), flash=False)
    scores = tokens * float(n["a"]) * float(n["s"]) * 2.0      # at least the bf16 probabilities
    assert mlp_none - mlp_sel > scores                         # selective drops the scores anyway
    assert mlp_sel > none
    assert unsaved(("mlp",), runtime="xla-gpu") == [0.0, 0.0, 0.0]
    sc = make_scenario(llama_like(), count=1, global_batch=2, runtime="pytorch-eager")
    cfg = Config(micro_batch=2)
    n = numbers_pytree(scenario_numbers(sc))
    assert [float(x) for x in first_block_unsaved(knobs_from_config(cfg), n, tokens)] == [0, 0, 0]


@pytest.mark.parametrize("kv", [1, 2, 8])
def test_grouped_kv_heads_are_kept_expanded_by_materialised_attention_only(kv):
    """``gqa_expanded_saved`` (pytorch-eager: Hugging Face's repeat_kv): materialised
    attention keeps k and v at the query heads' width, (a - kv) d more each per token than
    the grouped heads; a flash kernel reads them in place; MHA (kv = a) is unchanged."""
    from capopt.cost import knobs_from_config
    m = llama_like(heads=8, kv=kv)
    sc = make_scenario(m, count=1, global_batch=2, runtime="pytorch-eager")
    n = numbers_pytree(scenario_numbers(sc))
    tokens = 2.0 * 512
    ab, d = 2.0, m.head_size
    off = sc.replace(runtime=sc.runtime.with_coeffs(gqa_expanded_saved=0.0))
    n_off = numbers_pytree(scenario_numbers(off))
    for flash in (False, True):
        k = knobs_from_config(Config(micro_batch=2, flash_attention=flash))
        extra = float(saved_bytes(k, n, tokens)[0]) - float(saved_bytes(k, n_off, tokens)[0])
        want = 0.0 if flash else tokens * ab * 2.0 * (8 - kv) * d
        assert extra == pytest.approx(want, rel=F32_RTOL, abs=1.0)


def test_the_first_block_discount_counts_each_micro_batch_of_the_first_chunk_once():
    """Under interleaved stages rank 0 holds its first chunk for more micro-batches than its
    blocks' average (`first_chunk_in_flight` against `pipeline_in_flight`): the first block's
    LoRA discount (here the first norm's input: every matrix wrapped) comes off each phase
    that holds the stored blocks once per micro-batch of that chunk, the bottom phase too."""
    from capopt.cost._inputs import rank_sequences
    from capopt.cost.activations import first_block_unsaved
    from capopt.cost.memory import end_stage_args, end_stage_memory
    sc = make_scenario(llama_like(layers=8), count=4, global_batch=16, runtime="pytorch-eager",
                       lora=LoRA(rank=8, targets=("attn", "mlp")))
    cfg = Config(micro_batch=1, grad_accum=8, pp=2, vpp=2, dp=2)
    k = knobs_from_config(cfg)
    n = numbers_pytree(scenario_numbers(sc))
    off = numbers_pytree(scenario_numbers(sc.replace(
        runtime=sc.runtime.with_coeffs(frozen_inputs_dropped=0.0))))
    first, _ = end_stage_args(k, n)
    assert float(first["edge_in_flight"]) != float(first["in_flight"])
    tokens = float(rank_sequences(k)) * 512
    u = float(first_block_unsaved(k, n, tokens)[0]) * float(first["edge_in_flight"])
    assert u > 0
    u = u * (1.0 + float(n["rt_fragmentation"]))     # (a phase's total adds fragmentation)
    on_m, off_m = end_stage_memory(k, n), end_stage_memory(k, off)
    for phase in ("loss", "top", "bottom"):
        key = f"phase_{phase}_bytes"
        assert float(off_m[key][0] - on_m[key][0]) == pytest.approx(u, rel=1e-4), phase



# --------------------------------------------------------------------------------------------
# The hf runtime: PEFT's input cast and TRL's bfloat16 adapters on a quantised base
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("targets, copies", [
    # q, k, v read the first norm's output, gate and up the second's: a copy a matrix in
    # place of one kept for all of them (o and down have one reader: no change)
    (("attn", "mlp"), (3 - 1) + (2 - 1)), (("q", "v"), 1), (("o", "down"), 0),
    (("k",), 0)])
def test_peft_casts_each_wrapped_input_for_its_adapter(targets, copies):
    """hf's ``lora_input_cast`` (PEFT 0.21.2 lora.Linear: x cast to the float32 adapters,
    autocast's cast of it back kept by lora_A): a 16-bit base keeps one compute-dtype copy
    of its input a wrapped matrix; the stored activations grow by exactly the extra copies,
    h wide, and nothing else changes."""
    m = llama_like()
    got = {}
    for runtime in ("pytorch-eager", "hf"):
        sc, cfg, k, n = _lora_numbers(targets, runtime=runtime, model=m)
        got[runtime] = (saved_bytes(k, n, 1.0)[0], estimate(cfg, sc).to_dict()["memory"])
    (eager, m0), (hf, m1) = got["pytorch-eager"], got["hf"]
    # (a block's bytes per token, no recomputation)
    assert float(hf - eager) == pytest.approx(copies * 2.0 * m.hidden_size, abs=1e-3)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert m1[key] == m0[key], key


@pytest.mark.parametrize("precision, cast", [("bf16-mixed", 1), ("fp32", 0)])
def test_peft_casts_nothing_on_a_quantised_base_or_without_autocast(precision, cast):
    """bitsandbytes' LoRA layers cast only without autocast (requires_conversion), and in
    float32 the adapters' dtype is the input's: no copies there."""
    m = llama_like()
    for bits in (4, 16):
        sc0, _, k0, n0 = _lora_numbers(("attn", "mlp"), bits=bits, model=m)
        sc0 = sc0.replace(workload=sc0.workload.__class__(
            **{**sc0.workload.__dict__, "precision": precision}))
        sc1 = sc0.replace(runtime=get_profile("hf"))
        a0 = saved_bytes(k0, numbers_pytree(scenario_numbers(sc0)), 1.0)[0]
        a1 = saved_bytes(k0, numbers_pytree(scenario_numbers(sc1)), 1.0)[0]
        assert (float(a1) > float(a0)) == (bits == 16 and cast == 1), (bits, precision)


def test_trl_keeps_a_quantised_models_adapters_in_bfloat16():
    """hf's ``lora_quant_adapters_lowp`` (TRL 1.16 _prepare_peft_model: a quantised model's
    trainable parameters cast to bfloat16; AdamW's moments follow): under QLoRA the adapters,
    their gradients and AdamW's two moments take 2 bytes each, where pytorch-eager keeps
    float32 (4); a 16-bit base's adapters stay float32 (PEFT's autocast_adapter_dtype)."""
    m = llama_like()
    for bits, ratio in ((4, 0.5), (16, 1.0)):
        mem = {}
        for runtime in ("pytorch-eager", "hf"):
            sc, cfg, _, _ = _lora_numbers(("attn", "mlp"), bits=bits, runtime=runtime, model=m)
            mem[runtime] = estimate(cfg, sc).to_dict()["memory"]
        for key in ("grads_bytes", "optimizer_bytes", "trainable_bytes"):
            assert mem["hf"][key] == pytest.approx(ratio * mem["pytorch-eager"][key],
                                                   rel=1e-6), (bits, key)


@pytest.mark.parametrize("runtime", ["pytorch-eager", "hf"])
def test_adapter_dropout_keeps_a_dropped_copy_and_a_mask_a_wrapped_matrix(runtime):
    """PEFT's lora_dropout (lora_B(lora_A(dropout(x))), one nn.Dropout a wrapped matrix):
    each adapter keeps its own dropped copy of its input and dropout its 1-byte mask. On q,
    k, v (one norm output), gate and up (another), o and down: three copies where one was
    kept, two where one, o's and down's copies in place of their inputs, and a mask each.
    Under hf's cast the copies were there already: only the masks are new."""
    import dataclasses
    m = llama_like()
    h, f = m.hidden_size, m.intermediate_size
    per_token = {}
    for p in (0.0, 0.1):
        sc, cfg, k, _ = _lora_numbers(("attn", "mlp"), runtime=runtime, model=m)
        sc = sc.replace(workload=dataclasses.replace(
            sc.workload, lora=dataclasses.replace(sc.workload.lora, dropout=p)))
        per_token[p] = float(saved_bytes(k, numbers_pytree(scenario_numbers(sc)), 1.0)[0])
    masks = 3 * h + 2 * h + h + f
    copies = 0 if runtime == "hf" else 2.0 * ((3 - 1) * h + (2 - 1) * h)
    assert per_token[0.1] - per_token[0.0] == pytest.approx(masks + copies, abs=1e-3)


def test_the_trainers_fsdp_mixes_precision_by_the_parameter_dtype():
    """Accelerate (1.16 state.py) gives the Trainer's FSDP MixedPrecision(param_dtype =
    reduce_dtype = the compute dtype) under bf16: under ZeRO-2/3 the gathered weights are bf16
    and autocast caches no cast of them, where on one device (no FSDP) it caches every
    block's. Parameters, gradients and optimizer state are unchanged; the gradients cross the
    reduce-scatter in bf16, so the ZeRO traffic is less than with float32 reductions and the
    memory the same."""
    m = llama_like(hidden=1024, heads=8, kv=2)
    sc = make_scenario(m, runtime="hf", count=8, global_batch=16, seq_len=1024)
    one = make_scenario(m, runtime="hf", count=1, global_batch=2, seq_len=1024)
    z3 = Config(micro_batch=2, dp=8, zero_stage=3, remat="none")
    assert float(estimate(z3, sc).memory["weight_copy_bytes"]) == 0.0
    solo = estimate(Config(micro_batch=2, dp=1, remat="none"), one).memory
    assert float(solo["weight_copy_bytes"]) > 0.0
    f32 = sc.replace(runtime=sc.runtime.with_coeffs(fsdp_reduce_compute_dtype=0.0))
    a, b = estimate(z3, sc), estimate(z3, f32)
    assert float(a.memory["total_bytes"]) == pytest.approx(float(b.memory["total_bytes"]),
                                                           rel=1e-6)
    moved = lambda e: float(e.time["comm_zero_s"]) + float(e.time["comm_hidden_s"])  # noqa: E731
    assert moved(a) < moved(b)


def test_adapter_dropout_is_refused_where_the_step_runs_none():
    from capopt._errors import CapoptError
    with pytest.raises(CapoptError) as err:
        make_scenario(llama_like(), runtime="xla-gpu", lora=LoRA(rank=8, dropout=0.05))
    assert err.value.field == "training.lora.dropout"
    with pytest.raises(CapoptError, match="training.lora.dropout"):
        LoRA(rank=8, dropout=1.0)


# --------------------------------------------------------------------------------------------
# A block's backward pass, node by node (``block_grads_in_order``)
# --------------------------------------------------------------------------------------------
def test_backward_grad_shares_follow_the_inventory():
    """Down's gradient alone at the MLP's point, the MLP's and the output projection's at the
    attention core's, each as a share of the block's trainable elements; the adapters' under
    LoRA; share 1 where a block has neither (the plain MLP stack)."""
    from capopt._inventory import inventory
    from capopt.cost._inputs import backward_grad_shares
    m = llama_like(hidden=256, heads=8, kv=2)          # q, o 256x256; k, v 256x64; f 688
    h, f, kv = 256, 688, 64
    block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h    # + two RMSNorm scales
    s = backward_grad_shares(inventory(m))
    assert s["grad_share_mlp"] == pytest.approx(f * h / block, rel=1e-12)
    assert s["grad_share_attn"] == pytest.approx((3 * h * f + h * h) / block, rel=1e-12)
    # LoRA r=8 on q and v only: no adapter in the MLP or on o, so none by either point
    lora = backward_grad_shares(inventory(m, LoRA(rank=8, targets=("q", "v"))))
    assert lora == {"grad_share_mlp": 0.0, "grad_share_attn": 0.0}
    # on down alone: all of them by the MLP's point
    down = backward_grad_shares(inventory(m, LoRA(rank=8, targets=("down",))))
    assert down == {"grad_share_mlp": 1.0, "grad_share_attn": 1.0}
    stack = ModelSpec(name="mlp", family="mlp", hidden_size=64, num_hidden_layers=3)
    assert backward_grad_shares(inventory(stack)) == {"grad_share_mlp": 1.0,
                                                      "grad_share_attn": 1.0}


@pytest.mark.parametrize("zero", [0, 3])
@pytest.mark.parametrize("remat", ["none", "selective", "full"])
def test_gradients_in_order_never_raise_a_phase(zero, remat):
    """Counting a block's gradients as they are produced takes the largest of its points
    (each transient beside what exists by then, every gradient once the transients are
    freed), so no phase exceeds the rule that puts every transient beside every gradient
    of the block, and at least one backward phase is lower for a card whose gradients are
    not negligible."""
    sc = make_scenario(llama_like(layers=3), runtime="pytorch-eager", count=2, seq_len=256,
                       global_batch=8, precision="fp32")
    cfg = Config(micro_batch=4, dp=2, zero_stage=zero, remat=remat)
    n = scenario_numbers(sc)
    k = knobs_from_config(cfg)
    on = memory(k, numbers_pytree(n))
    off = memory(k, numbers_pytree({**n, "rt_block_grads_in_order": 0.0}))
    phases = [float(on[f"phase_{p}_bytes"]) for p in PHASES]
    before = [float(off[f"phase_{p}_bytes"]) for p in PHASES]
    assert all(a <= b * (1 + F32_RTOL) for a, b in zip(phases, before))
    lower = [p for p, a, b in zip(PHASES, phases, before) if a < b * (1 - 1e-3)]
    assert set(lower) & {"top", "bottom", "rebuild"}, (phases, before)


def test_a_fused_linear_loss_holds_one_chunk_of_logits():
    """``loss = "fused-linear"`` (Liger's fused linear cross-entropy): the chunk is Liger's
    (its own example: BT 4096 x 4, V 32000, H 4096 -> 2048 rows; Llama-3-8B's head at 16384
    tokens -> 512); against the fused loss on the same step, the loss phase holds that chunk
    of compute-dtype logits, the head's input gradient in the stream dtype, a float32 loss
    per token, the head's weight gradient and a second cast of the head, and the norm's
    output in the stream dtype in place of its cast, in place of the whole logits and their
    gradient; the forward pass's end holds no logits; the blocks' backward and the update
    are unchanged."""
    import dataclasses
    from capopt.cost import estimate_numbers
    from capopt.cost.flops import fused_linear_chunk
    chunk = lambda v, h, bt: float(fused_linear_chunk({"V": v, "h": h}, jnp.asarray(bt)))
    assert chunk(32000, 4096, 4096.0 * 4) == 2048
    assert chunk(128256, 4096, 16384.0) == 512
    assert chunk(1000, 4096, 300.0) == 300          # one chunk: never more than the tokens
    m = ModelSpec(name="v", family="decoder", hidden_size=256, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=512, vocab_size=32768,
                  position_embedding="rotary", norm_type="rmsnorm", mlp_type="gated",
                  hidden_act="silu")
    sc = make_scenario(m, runtime="pytorch-eager", count=1, global_batch=4, seq_len=1024,
                       loss="fused")
    fl = sc.replace(workload=dataclasses.replace(sc.workload, loss="fused-linear"))
    cfg = Config(micro_batch=4)
    tokens, h, v = 4 * 1024, 256, 32768
    rows = chunk(v, h, float(tokens))
    assert rows == 32
    head = v * h
    out = {}
    for name, s in (("fused", sc), ("fl", fl)):
        n = numbers_pytree(s)
        n = {**n, "rt_fragmentation": 0.0 * n["rt_fragmentation"]}
        out[name] = estimate_numbers(knobs_from_config(cfg), n).memory
    d = {p: float(out["fl"][f"phase_{p}_bytes"] - out["fused"][f"phase_{p}_bytes"])
         for p in PHASES}
    loss = (rows * v * 2 + tokens * (h * 4 + 4) - tokens * v * 2 * 2     # logits
            + tokens * h * (4 - 2)                                      # the norm's output
            + head * 4 + head * 2)                                      # gradient, cast
    assert d["loss"] == pytest.approx(loss, rel=1e-6)
    assert d["forward"] == pytest.approx(-tokens * v * 2 + tokens * h * (4 - 2), rel=1e-6)
    for p in ("bottom", "update"):
        assert d[p] == 0.0, p


def test_activation_offloading_keeps_one_window_of_one_block_on_the_device():
    """``activation_offload`` (TRL's / torchtune's OffloadActivations): in bf16 on one device
    (no casts to offload), the blocks' saved tensors leave the device, and so do the first
    block's input and the final norm's: the loss and the forward pass's end drop by every
    block's saved bytes (under full recomputation, every block's input, which the checkpoint
    saves through the same hooks) and those two h-wide tensors; the top block's backward
    brings its window back (`offload_window`: the larger of its MLP's and its attention's
    saved sets), less than its whole set; the update is unchanged."""
    import dataclasses
    from capopt.cost import estimate_numbers
    from capopt.cost.activations import stream_bytes
    from capopt.cost.memory import offload_window
    m = llama_like()
    sc = make_scenario(m, runtime="pytorch-eager", count=1, global_batch=2, seq_len=512,
                       precision="bf16")
    ao = sc.replace(workload=dataclasses.replace(sc.workload, activation_offload=True))
    for remat, policy in (("none", 0), ("full", 2)):
        cfg = Config(micro_batch=2, remat=remat)
        k = knobs_from_config(cfg)
        out = {}
        for name, s in (("plain", sc), ("ao", ao)):
            n = numbers_pytree(s)
            n = {**n, "rt_fragmentation": 0.0 * n["rt_fragmentation"]}
            out[name] = (estimate_numbers(k, n).memory, n)
        d = {p: float(out["ao"][0][f"phase_{p}_bytes"] - out["plain"][0][f"phase_{p}_bytes"])
             for p in PHASES}
        n = out["ao"][1]
        tokens = 2 * 512.0
        saved = float(saved_bytes(k, n, tokens)[policy])
        blocks = m.num_hidden_layers * saved
        h_wide = tokens * m.hidden_size * float(stream_bytes(n))   # (no dropout: one each)
        assert d["loss"] == pytest.approx(-(blocks + 2 * h_wide), rel=1e-5), remat
        assert d["forward"] == pytest.approx(-(blocks + 2 * h_wide), rel=1e-5), remat
        assert d["update"] == 0.0
        if remat == "none":
            window = float(offload_window(k, n, jnp.asarray(tokens))[0])
            assert 0 < window < saved
            assert d["loss"] < d["top"] < 0.0


@pytest.mark.parametrize("zero", [0, 1])
def test_clipped_update_holds_every_gradient_once_without_sharded_gradients(zero):
    """XLA, clipping, no accumulation, gradients not sharded (ZeRO-0/1): at the update every
    gradient is live once, the embedding's (its scatter-add's output, reduced in place) like
    the others; under data parallelism XLA's combined all-reduce copies them into one flat
    buffer (``grad_combine_copy``), where the update is the step's peak. Counted twice, the
    embedding's would add its table (1 MiB beside 7.3 MiB of gradients here)."""
    m = llama_like(vocab=1024, layers=2, hidden=256)
    sc = make_scenario(m, count=2, seq_len=8, global_batch=2, grad_clip=True)
    mem = estimate(Config(micro_batch=1, dp=2, zero_stage=zero), sc).memory
    assert int(mem["peak_phase"]) == PHASES.index("update")
    copies = 1.0 + get_profile("xla-gpu").coeff("grad_combine_copy")
    # (every gradient as held)
    n = scenario_numbers(sc)
    held = _held_grads(n, float(mem["grads_all_bytes"]) / n["grad_bytes"])
    assert float(mem["grads_bytes"]) == pytest.approx(copies * held, rel=F32_RTOL)


@pytest.mark.parametrize("dp, hidden, ffn", [(2, 640, 1792), (4, 1024, 2816)])
def test_a_combined_reduce_scatter_runs_on_the_gradients_with_its_shards_beside_them(
        dp, hidden, ffn):
    """XLA, gradients sharded (ZeRO-2): the reduce-scatter combiner counts each collective's
    output, the shard, against its 30 MiB threshold, so every gradient of a small model goes
    into one reduce-scatter, which reads them as they are (no flat copy, which only the
    all-reduce's AllReduceContiguous pass makes) and writes their shards beside them: at its
    end every gradient is live once and 1/dp of them again. The copy an all-reduce makes
    would add a whole second set; a 30 MiB cap on the unsharded gradients would leave the
    rest out (39 MiB of gradients at dp 2 here, 94 MiB at dp 4)."""
    m = llama_like(vocab=1024, layers=2, hidden=hidden, intermediate_size=ffn)
    sc = make_scenario(m, count=dp, seq_len=8, global_batch=dp, grad_clip=False,
                       optimizer="sgd", precision="fp32")
    mem = estimate(Config(micro_batch=1, dp=dp, zero_stage=2), sc).memory
    assert int(mem["peak_phase"]) == PHASES.index("update")
    n = scenario_numbers(sc)
    held = _held_grads(n, float(mem["trainable_params"]))
    assert held > n["rt_grad_combine_bytes"]               # more than one all-reduce group
    assert held < dp * n["rt_grad_combine_bytes"]          # one reduce-scatter group
    assert float(mem["grads_bytes"]) == pytest.approx(held * (1.0 + 1.0 / dp), rel=F32_RTOL)


@pytest.mark.parametrize("tp, ga, tensors", [
    (1, 1, 4 + 1),                  # each layer's matmul output; the top's input gradient
    (2, 1, 4 * (1 + 0.5) + 2),      # + each layer's gathered activation; two gradients
    (2, 2, 4 * (1 + 0.5) + 2 + 3),  # + the hoisted transposed inputs (2) and one slice
])
def test_a_plain_mlp_stack_keeps_one_output_a_layer_under_xla(tp, ga, tensors):
    """XLA (rand0-143, rand0-124 and rand0-178 of the fitting split): a ReLU MLP stack keeps
    each layer's matmul output alone, split over tp, the activation and its mask recomputed
    in the fusions that read it; the top layer's backward adds its input's gradient, the
    loss's being recomputed inside its GEMMs. With tp > 1 every layer also keeps its
    all-gathered activation, the backward holds the incoming gradient whole, and with
    accumulation XLA keeps a transposed copy of every micro-batch's inputs and one slice.
    The batch itself, the first layer's input, is an argument: no activation."""
    m = ModelSpec(name="mlp", family="mlp", hidden_size=512, num_hidden_layers=4,
                  hidden_act="relu")
    sc = make_scenario(m, count=tp, seq_len=128, global_batch=8 * ga, precision="bf16",
                       grad_clip=False, optimizer="sgd")
    mem = estimate(Config(micro_batch=8, grad_accum=ga, tp=tp), sc).memory
    assert int(mem["peak_phase"]) == PHASES.index("top")
    one = 8 * 128 * 512 * 2                          # tokens x h x bf16
    assert float(mem["activations_bytes"]) == pytest.approx(tensors * one, rel=F32_RTOL)


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("runtime", ["xla-gpu", "pytorch"])
def test_a_quantised_base_is_kept_dequantised_for_the_backward_under_xla(bits, runtime):
    """XLA (Llama-2-7B shape, 4 blocks, 4- and 8-bit bases, remat none): the forward pass's
    dequantisation of a quantised base and the backward's are one value, so each stored block
    keeps its base matrices in the compute dtype to its backward pass, at the loss all of
    them; a rebuilt block dequantises again, one block's worth. bitsandbytes dequantises again
    in the backward (`lora_dequant_in_backward`): nothing kept. A 16-bit base is the compute
    dtype already."""
    m = llama_like(layers=4)
    lora = LoRA(rank=8, targets=("attn", "mlp"), base_bits=bits)
    sc = make_scenario(m, runtime=runtime, count=1, seq_len=512, global_batch=4,
                       precision="bf16", grad_clip=False, lora=lora)
    from capopt._inventory import inventory
    base = sum(t.elements for t in inventory(m, lora) if t.lora in ("base", "quant"))
    kept = base * 2.0 if (runtime == "xla-gpu" and bits < 16) else 0.0    # bf16 copies
    none = estimate(Config(micro_batch=4), sc).memory
    assert int(none["peak_phase"]) == PHASES.index("loss")
    assert float(none["weight_copy_bytes"]) == pytest.approx(kept, rel=F32_RTOL, abs=0.0)
    full = estimate(Config(micro_batch=4, remat="full"), sc).memory
    if int(full["peak_phase"]) == PHASES.index("top"):
        assert float(full["weight_copy_bytes"]) == pytest.approx(kept / 4, rel=F32_RTOL)


def test_selective_recomputation_keeps_every_lora_product_under_xla():
    """jax.checkpoint_policies.dots_with_no_batch_dims_saveable saves every dot without batch
    dimensions: of a wrapped matmul y = x W + (x A) B, (x A) B and x A beside x W (the
    validation step's Linear; Llama-2-7B shape, 4 blocks, selective: gate and up keep two
    bf16[8192, 11008] dot outputs each). Against the same profile without that rule, each
    block keeps every wrapped matrix's output width (q, k, v, o, gate, up, down) and the
    adapter's rank once more per token, in the compute dtype: at the loss, all four blocks."""
    m = llama_like(layers=4)
    sc = make_scenario(m, count=1, seq_len=512, global_batch=4, precision="bf16",
                       grad_clip=False, lora=LoRA(rank=8, targets=("attn", "mlp")))
    without = sc.replace(runtime=sc.runtime.with_coeffs(selective_saves_adapters=0.0))
    cfg = Config(micro_batch=4, remat="selective")
    added = float(estimate(cfg, sc).memory["phase_loss_bytes"]
                  - estimate(cfg, without).memory["phase_loss_bytes"])
    heads, kv = m.num_attention_heads, m.num_key_value_heads
    d = m.hidden_size // heads
    widths = (heads + 2 * kv) * d + m.hidden_size + 2 * m.intermediate_size + m.hidden_size
    per_token = widths + 7 * 8                       # (x A)B of each and x A, rank 8
    assert added == pytest.approx(m.num_hidden_layers * 4 * 512 * per_token * 2.0, rel=1e-5)


def test_selective_recomputation_under_xla_rebuilds_the_batched_expert_dots():
    """The validation step runs an MoE's routed experts as one einsum batched over the
    experts ("ech,ehf->ecf"): a dot with a batch dimension, which
    dots_with_no_batch_dims_saveable does not save (rand0-082, MoE E8, selective: each
    stored block keeps q, k, v, o's output and the residual, no expert output; the xla-gpu
    profile does not take the rule: its note says why). Against a policy that names them
    (MaxText's "minimal": checkpoint_name "mlpwi_0" / "mlpwi_1"), a runtime with the rule
    (``expert_dots_batched``) keeps less a block by the gate and up outputs of its top-k x
    capacity slots, in the compute dtype; the dense model, whose MLP is a plain dot, keeps
    the same either way."""
    def kept(model, batched):
        sc = make_scenario(model, count=1, seq_len=256, global_batch=2, precision="bf16")
        sc = sc.replace(runtime=sc.runtime.with_coeffs(expert_dots_batched=batched))
        k, n = knobs_from_config(Config(micro_batch=2, remat="selective")), numbers_pytree(sc)
        return float(saved_bytes(k, n, 2 * 256)[1])

    moe = llama_like(num_local_experts=8, num_experts_per_tok=2)
    sc = make_scenario(moe, count=1, seq_len=256, global_batch=2, precision="bf16")
    slots = 2 * float(scenario_numbers(sc)["rt_moe_capacity_factor"])
    routed = 2 * 256 * 2.0 * 2 * slots * moe.intermediate_size        # gate and up, bf16
    assert kept(moe, 0.0) - kept(moe, 1.0) == pytest.approx(routed, rel=1e-5)
    dense = llama_like()
    assert kept(dense, 0.0) == kept(dense, 1.0)


def test_xla_keeps_the_float32_logits_gradient_for_the_heads_weight_gradient():
    """In float32 nothing is cast between the logits gradient and the split GEMM's pad: the
    head's weight-gradient GEMM reads the unpadded gradient after the pad, so at the input
    gradient's GEMM it is live beside the padded gradient and the padded head (rand0-173:
    f32[4, 512, 32001] beside f32[2048, 32016] and f32[320, 32016]). The padded point then
    holds the aligned loss's two logits-sized float32 buffers and the head's copy on top of
    them; a frozen head (LoRA) has no weight-gradient GEMM, and its point holds one."""
    h100 = get_hardware("h100-sxm-80gb")

    def loss(vocab, lora=None):
        sc = make_scenario(gpt_like(vocab=vocab, seq=64, hidden=768, heads=12),
                           runtime="xla-gpu", count=1, seq_len=64, global_batch=1,
                           hardware=h100, precision="fp32", lora=lora)
        return _phase(sc, Config(micro_batch=1), "loss")

    head, logits = 32001 * 768 * 4, 64 * 32001 * 4
    # (the padded vocabulary's 16 more columns and the head's one more row of parameters,
    # gradients and Adam's moments: well under 0.1% of the head's copy)
    assert loss(32001) - loss(32000) == pytest.approx(head, rel=1e-3)
    lora = LoRA(rank=8, targets=("attn", "mlp"))
    assert loss(32001, lora) - loss(32000, lora) == pytest.approx(head - logits, rel=1e-3)


def test_xla_copies_the_old_8bit_moment_codes_of_the_tensor_it_updates():
    """8-bit Adam's update reads a tensor's old int8 and uint8 moment codes in two fusions
    (the new block absmax, then the new codes) while the new codes take the donated
    buffers: XLA's copy insertion copies the old ones, a byte each per element, live while
    that tensor updates (rand0-102: s8[4001, 2048] and u8[4001, 2048] beside the
    f32[32001, 256] table at the update's peak). The update holds the largest tensor's,
    the vocabulary table here; another optimizer copies nothing."""
    def update(optimizer, **coeffs):
        sc = make_scenario(gpt_like(layers=2, vocab=4001), runtime="xla-gpu", count=1,
                           global_batch=4, grad_clip=False, optimizer=optimizer)
        return _phase(sc, Config(micro_batch=4), "update", **coeffs)

    table = 4001 * 256
    assert update("adamw-8bit") - update("adamw-8bit", quant_moment_copies=0.0) == \
        pytest.approx(2.0 * table, rel=1e-5)
    assert update("adamw") == update("adamw", quant_moment_copies=0.0)


@pytest.mark.parametrize("dp, zero", [(1, 0), (2, 0), (2, 3)])
def test_xla_holds_weight_gradients_in_the_compute_dtype(dp, zero):
    """XLA keeps a weight's gradient as its weight-gradient dot wrote it, in the compute
    dtype, and reduces it over the data-parallel group in that dtype; the cast to the float32
    parameter's dtype is fused into what reads it (optimized HLO: Llama-3.2-1B shape one
    device, bf16 dW outputs at the backward's end; all-reduces and reduce-scatters of bf16
    matrices in fitting configs). At a clipped update every gradient is live: against the
    same profile without the rule, 2 of the 4 bytes of every gradient but the embedding's
    (its scatter-add table, float32 either way) are gone."""
    m = llama_like(vocab=1024, layers=2, hidden=256)
    sc = make_scenario(m, count=dp, seq_len=8, global_batch=dp, grad_clip=True)
    without = sc.replace(runtime=sc.runtime.with_coeffs(grads_compute_dtype=0.0))
    cfg = Config(micro_batch=1, dp=dp, zero_stage=zero)
    a, b = estimate(cfg, sc).memory, estimate(cfg, without).memory
    n = scenario_numbers(sc)
    # (every trainable element, as a replicated layout holds them; float32 parameters)
    whole = estimate(Config(micro_batch=1, dp=dp), sc).memory["trainable_bytes"]
    elems = float(whole) / float(n["param_bytes"])
    # (one device: the kept gradients; under dp every gradient waits, unsharded, for its
    # combined collective: an all-reduce's beside the flat copy it is reduced in, twice; a
    # reduce-scatter's beside the shards it writes, 1 + 1 / dp)
    copies = 1.0 if dp == 1 else (2.0 if zero < 2 else 1.0 + 1.0 / dp)
    saved = float(b["phase_update_bytes"] - a["phase_update_bytes"])
    assert saved == pytest.approx(copies * (elems * n["grad_bytes"] - _held_grads(n, elems)),
                                  rel=1e-5)


def test_replicated_kv_heads_are_saved_as_the_runtime_keeps_them():
    """k and v replicated over tp (tp exceeds the KV heads): XLA's step computes every KV head
    on every rank and keeps them (``kv_replicated_one_head`` 0), the torch tier's slices out
    the one its query heads share (1). Two cards that differ only in their KV heads (2 and
    4) save the same bytes but k's and v's: at tp 4 the 2-head card keeps ``kept`` heads of
    each per rank where the 4-head card keeps one (an even split would be half a head); at
    tp 2, where both divide, one against two."""
    from capopt.cost._inputs import runtime_numbers
    hd, s, mb = 64, 512, 2
    tokens = mb * s
    for runtime, kept in (("xla-gpu", 2), ("pytorch-eager", 1)):
        def saved(kv, tp):
            sc = make_scenario(llama_like(hidden=8 * hd, heads=8, kv=kv), runtime=runtime,
                               precision="bf16", seq_len=s)
            k = knobs_from_config(Config(micro_batch=mb, tp=tp, remat="none"))
            return float(saved_bytes(k, runtime_numbers(k, numbers_pytree(sc)), tokens)[0])
        head = tokens * 2.0 * 2 * hd                   # one KV head of k and of v, bf16
        assert saved(2, 4) - saved(4, 4) == pytest.approx(head * (kept - 1), abs=1.0), runtime
        assert saved(2, 2) - saved(4, 2) == pytest.approx(-head, rel=1e-6), runtime
