"""FLOPs of one training step, matmul by matmul, and the time the matmuls take on one device.

Counting convention (the one Narayanan et al. 2021 and Korthikanti et al. 2022 use): a multiply
and an add are two FLOPs; only matmuls count (norms, softmax, activations and the optimizer are
memory-bound and timed by bytes elsewhere); attention scores are counted over the full s x s
matrix, causal or not. Per token and block, in the forward pass:

    weights   2 h (q + 2 kv) + 2 q h                       q, k, v and output projections
              + 2 mats h f topk                            MLP (mats = 3 gated, 2 GELU), top-k experts
              + 2 h E                                      MoE router
    attention 2 s (q + o)                                  Q K^T and P V (q = o = heads x head_dim)
    LoRA      2 r (d_in + d_out) per wrapped matrix        (= 2 x LoRA parameters per block)

with q = heads x head_dim and kv = kv_heads x head_dim (latent attention: its five projections
instead of q, k and v, and o = heads x v_head_dim; shared experts and an MoE's dense first
blocks at their width, averaged over the blocks); the head adds 2 h V per token (LM head,
MLM decoder), the MLM transform 2 h^2, and per sequence 2 h^2 (pooler) and 2 h labels
(classifier); a ViT adds 2 (channels patch^2) h per patch. A plain MLP stack (family "mlp")
has 2 h^2 per layer and nothing else.

The backward pass computes every matmul's input gradient (same FLOPs as its forward) and the
weight gradient of every trainable matmul (same again); attention has two input gradients.
LoRA freezes the base: its matmuls get input gradients only, the adapters both. So a full
training step is 3x the forward, and the papers' closed forms hold exactly:

    model FLOPs (no recompute)      72 B s l h^2 (1 + s/(6h) + V/(12 l h))    Korthikanti eq. 7
    + full recompute                96 B s l h^2 (1 + s/(6h) + V/(16 l h))    Narayanan eq. 3
    + selective recompute           72 B s l h^2 (1 + 2s/(9h) + V/(12 l h))

(Korthikanti et al.'s eq. 8 writes s/(3h) for the last, counting the attention core's forward
and backward a second time; selective recomputation repeats only its forward, 4 s h per token.)

*Model* FLOPs (for MFU) exclude recomputation; *hardware* FLOPs (for HFU) add the extra forward
of full recomputation, the attention core of selective recomputation (and under per-op
selective checkpointing, ``selective_saves_ops``, the matmuls it did not save), the Q K^T that
flash attention recomputes in its backward pass, and the padded slots of capacity-factor MoE
routing.

The FLOP counts are plain arithmetic (``+ - * /``) on the numbers and knobs, so they run on
Python floats (exact integers in float64) as well as on traced `jnp` scalars. The time functions
add the shape-dependent efficiency, which needs `jnp.minimum`.
"""

from __future__ import annotations

import jax.numpy as jnp

from ._inputs import Knobs, rank_sequences
from .activations import split_over

# ---------------------------------------------------------------------------------------------
# FLOPs per token (forward, one block, whole model: no sharding)
# ---------------------------------------------------------------------------------------------


def block_flops(n: dict) -> dict:
    """Forward FLOPs per token of one block, by matmul group (unsharded, top-k experts): two
    per weight element of the inventory's GEMM weights (`capopt._inventory`, the ``W_*``
    numbers, routed experts top-k times), ``2 s (q + o)`` for the attention core, two per LoRA
    adapter parameter. ``experts``: the routed experts' part of ``mlp_in + mlp_out``."""
    tf = 1.0 - n["mlp"]                     # transformer families
    return {
        "qkv": 2.0 * n["W_qkv"],
        "out": 2.0 * n["W_out"],
        "mlp_in": 2.0 * n["W_in"],
        "mlp_out": 2.0 * n["W_down"],
        "experts": 2.0 * (n["W_ex_in"] + n["W_ex_down"]),
        "router": 2.0 * n["W_router"],
        "dense": 2.0 * n["W_dense"],         # family "mlp": one h x h layer
        "attn": tf * 2.0 * n["s"] * (n["q_w"] + n["o_w"]),
        "lora": 2.0 * n["lora_layer"],
    }


def _weight_flops(b: dict):
    return b["qkv"] + b["out"] + b["mlp_in"] + b["mlp_out"] + b["router"] + b["dense"]


def _capacity(n: dict):
    """Expert slots computed per routed token: the capacity factor for MoE, else 1."""
    return n["moe"] * n["rt_moe_capacity_factor"] + (1.0 - n["moe"])


def step_tokens(k: Knobs, n: dict):
    """Sequences and tokens one optimizer step processes: micro_batch x grad_accum x dp / cp
    (`rank_sequences`)."""
    seqs = rank_sequences(k) * k.grad_accum * k.dp
    return seqs, seqs * n["s"]


def model_flops(k: Knobs, n: dict):
    """FLOPs of one step of the whole job, recomputation excluded (the MFU numerator)."""
    seqs, tokens = step_tokens(k, n)
    b = block_flops(n)
    frozen = n["lora"]
    w, a, lo = _weight_flops(b), b["attn"], b["lora"]
    # forward + input gradients + weight gradients of what trains
    block = w * (2.0 + (1.0 - frozen)) + 3.0 * a + 3.0 * lo
    head_tok = 2.0 * (n["head_tok_tp"] + n["head_tok_rep"]) * (2.0 + (1.0 - frozen))
    per_seq = (2.0 * n["head_seq"] * (2.0 + (1.0 - frozen))
               + 2.0 * n["embed_seq"] * (1.0 + (1.0 - frozen)))   # pixels need no gradient
    return tokens * (n["L"] * block + head_tok) + seqs * per_seq


def recompute_flops(k: Knobs, n: dict):
    """FLOPs executed on top of the model FLOPs: recomputation, flash backward, MoE padding."""
    _, tokens = step_tokens(k, n)
    b = block_flops(n)
    frozen = n["lora"]
    w_sel, w_full = k.remat[1], k.remat[2]
    fwd = _weight_flops(b) + b["attn"] + b["lora"]
    ops = n["rt_selective_saves_ops"]
    extra = (w_full * fwd
             + w_sel * (1.0 - k.flash) * b["attn"]         # selective: the attention core again
             + w_sel * ops * 2.0 * n["ops_recompute_w"]    # per-op: the matmuls not saved
             + k.flash * 0.5 * b["attn"])                  # flash backward recomputes Q K^T
    experts = b["experts"]
    # (per-op selective checkpointing recomputes the expert GEMMs: batched, never saved)
    padding = (_capacity(n) - 1.0) * experts * (2.0 + (1.0 - frozen) + w_full + w_sel * ops)
    return tokens * n["L"] * (extra + padding)


def hardware_flops(k: Knobs, n: dict):
    """FLOPs one step of the whole job executes (the HFU numerator)."""
    return model_flops(k, n) + recompute_flops(k, n)


# ---------------------------------------------------------------------------------------------
# Matmul efficiency and per-device time
# ---------------------------------------------------------------------------------------------


def matmul_efficiency(m, n: dict):
    """Achievable fraction of the dtype's peak for a GEMM of effective dimension ``m``.

    ``eff_max * m / (m + m_half)``, i.e. seconds = FLOPs / (eff_max peak) + bytes moved /
    (eff_max HBM bandwidth): the roofline's harmonic form (Williams et al. 2009). A GEMM
    (M, K, N) does 2 M K N FLOPs and, tiled ideally, moves each operand once:
    ``e (M K + K N + M N)`` bytes (``e``: its operands' bytes, ``matmul_bytes``: 1 for an
    8-bit GEMM), so its intensity is ``2 m / e`` FLOP/byte with
    ``1 / m = 1 / M + 1 / K + 1 / N`` (`gemm_dim`), and ``m_half`` is the ridge point
    ``peak * element_bytes / (2 * mem_bw)`` scaled by the profile. A part that sustains less
    than its datasheet's tensor rate under its power limit runs at ``tensor_share`` of it
    (`capopt.Hardware.sustained_tensor_share`).
    """
    m_half = (n["rt_gemm_half_scale"] * n["matmul_peak"] * n["matmul_bytes"]
              / (2.0 * n["mem_bw"]))
    m = jnp.maximum(m, 1.0)
    return n["tensor_share"] * n["rt_gemm_eff_max"] * m / (m + m_half)


def gemm_dim(*dims):
    """Effective dimension of a GEMM with dimensions ``dims`` (M, K, N):
    ``1 / (1 / M + 1 / K + 1 / N)``.

    Every operand counts: the weights (K x N) are read again for every micro-batch (and in
    the backward pass, for the input gradient; the weight gradient writes them), so a GEMM
    over many tokens still pays for its weight bytes, and one over few tokens for its
    activations. Below the smallest dimension and at least a third of it.
    """
    inv = 0.0
    for d in dims:
        inv = inv + 1.0 / jnp.maximum(d, 1.0)
    return 1.0 / inv


def fused_linear_chunk(n, tokens):
    """Rows of logits a fused linear cross-entropy holds at once (``loss = "fused-linear"``):
    Liger's chunk (liger_kernel/ops/fused_linear_cross_entropy.py at ead96b6,
    ``fused_linear_cross_entropy_forward``): the ``tokens`` split into ``ceil(V / h)`` parts,
    each rounded up to a power of two, so that a chunk's logits are about the size of the
    head's input; never more than the tokens."""
    parts = jnp.maximum(jnp.ceil(n["V"] / n["h"]), 1.0)     # (no vocabulary: one part)
    rows = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(jnp.ceil(tokens / parts), 1.0))))
    return jnp.minimum(rows, tokens)


def _smallest(*dims):
    out = dims[0]
    for d in dims[1:]:
        out = jnp.minimum(out, d)
    return out


def _gemm_s(flops, n: dict, *dims):
    """Seconds for ``flops`` of GEMMs with dimensions ``dims`` (M, K, N) on one device."""
    return flops / (matmul_efficiency(gemm_dim(*dims), n) * n["matmul_peak"])


def compute_times(k: Knobs, n: dict) -> dict:
    """Matmul seconds on one device for one micro-batch.

    Returns ``layer`` (one block: forward, recomputation, backward), split into ``layer_fwd``
    (the forward pass) and ``layer_bwd`` (the backward phase, recomputation included);
    ``layer_dw`` (the weight-gradient GEMMs, which tensor-parallel communication can hide
    behind); ``first`` (input matmuls on the first stage) and ``last`` (head matmuls on the last
    stage), and their forward passes ``first_fwd`` and ``last_fwd``; ``attn_s`` and
    ``attn_bwd_s`` (the attention core's forward and backward, which context parallelism's
    exchange hides behind); ``tp_windows``, the forward seconds of the four GEMMs beside a
    block's tensor-parallel collectives (the attention's input projections after its
    all-gather, its output projection before its reduce-scatter, the MLP's input and output
    matrices likewise), which asynchronous tensor parallelism pipelines them with.
    """
    b = block_flops(n)
    tp, s, h, f, hd = k.tp, n["s"], n["h"], n["f"], n["hd"]
    tokens = rank_sequences(k) * s
    frozen = n["lora"]
    w_sel, w_full = k.remat[1], k.remat[2]
    cap = _capacity(n)
    # tokens per expert GEMM: the ep group's tokens x top-k x capacity, spread over E experts
    expert_rows = tokens * (n["moe"] * k.ep * n["topk"] * cap / n["E"] + (1.0 - n["moe"]))

    fwd_pass = 1.0 + w_full                       # forward + full recomputation
    dx, dw = 1.0, 1.0 - frozen                    # input and weight gradients
    weight_mult = fwd_pass + dx + dw

    seqs = rank_sequences(k)
    fl = n["loss_fused_linear"]
    ch = n["loss_chunked"]                        # (the chunked loss's head: slice by slice)
    head_rows = ((1.0 - fl - ch) * tokens + fl * fused_linear_chunk(n, tokens)
                 + ch * tokens / n["loss_chunks"])
    # the attention's projections: split over tp, and (latent attention's q_a, kv_a)
    # replicated; K = h (latent attention's q and kv_b read the narrower latents)
    qkv_rep = 2.0 * n["W_qkv_rep"]
    qkv_tp = b["qkv"] - qkv_rep
    routed_in = 2.0 * n["W_ex_in"]
    routed_out = b["experts"] - routed_in
    un_in, un_out = b["mlp_in"] - routed_in, b["mlp_out"] - routed_out
    # Every GEMM of the step as one row (FLOPs, M, K, N), timed in one vectorised evaluation
    # of `_gemm_s` (elementwise: the same numbers as one call per GEMM).
    gemms = [  # forward seconds per token of each weight GEMM on this device, ...
        (qkv_tp / tp, tokens, h, n["dots_tp"] / tp),
        (qkv_rep, tokens, h, jnp.maximum(n["dots_rep"], 1.0)),
        (b["out"] / tp, tokens, n["o_w"] / tp, h),
        (routed_in * cap / tp, expert_rows, h, f / tp),
        (routed_out * cap / tp, expert_rows, f / tp, h),
        (un_in / tp, tokens, h, n["f_unrouted"] / tp),
        (un_out / tp, tokens, n["f_unrouted"] / tp, h),
        (b["router"], tokens, h, jnp.maximum(n["E"], 1.0)),
        (b["dense"] / tp, tokens, h, h / tp),
        # LoRA adapters (those of replicated matrices whole on every rank)
        (split_over(b["lora"], 2.0 * n["lora_rep"], tp), tokens, h,
         jnp.maximum(n["lora_rank"], 1.0)),
        (tokens * b["attn"] / tp, s, hd, s),   # Q K^T (s, hd, s), P V (s, s, hd): per micro-batch
        # the head, per token (the fused linear cross-entropy's: one chunk of rows at a time)
        (2.0 * n["head_tok_tp"] / tp, head_rows, h, n["V"] / tp),
        (2.0 * n["head_tok_rep"], tokens, h, h),
        (2.0 * n["head_seq"], seqs, h, h),                                   # per sequence
        (2.0 * n["embed_seq"], tokens, jnp.maximum(n["patch_dim"], 1.0), h),
    ]
    cols = [jnp.stack(jnp.broadcast_arrays(*col)) for col in zip(*gemms)]
    secs = _gemm_s(cols[0], n, *cols[1:])
    (qkv_s, qkv_rep_s, out_s, mlp_in_s, mlp_out_s, un_in_s, un_out_s, router_s, dense_s, lora_g,
     attn_matmul_s, head_tp_s, head_rep_s, head_seq_s, embed_s) = (
        secs[i] for i in range(len(gemms)))
    weights_s = tokens * sum([qkv_s, qkv_rep_s, out_s, mlp_in_s, mlp_out_s, un_in_s, un_out_s,
                              router_s, dense_s])
    lora_s = tokens * lora_g
    attn_flops = tokens * b["attn"] / tp
    # the attention core runs at its own dtype's peak (fp8 recipes leave it in 16 bits)
    attn_matmul_s = attn_matmul_s * n["matmul_peak"] / n["attn_peak"]
    attn_flash_s = attn_flops / (n["rt_flash_eff"] * n["attn_peak"])
    # the attention core's forward pass, and its backward: materialised, two passes' worth of
    # matmuls (and the scores again under selective recomputation); flash, 2.5 forward passes
    attn_fwd_s = (1.0 - k.flash) * attn_matmul_s + k.flash * attn_flash_s
    attn_bwd_s = ((1.0 - k.flash) * attn_matmul_s * (2.0 + w_sel)
                  + k.flash * attn_flash_s * (2.0 + 0.5))
    attn_s = fwd_pass * attn_fwd_s + attn_bwd_s
    # per-op selective checkpointing runs the matmuls it did not save again (their share of
    # the block's weight GEMM FLOPs, at the block's average GEMM rate)
    weight_w = _weight_flops(b) / 2.0 + b["lora"] / 2.0
    ops_share = n["ops_recompute_w"] / jnp.maximum(weight_w, 1.0)
    recompute_ops = w_sel * n["rt_selective_saves_ops"] * ops_share * (weights_s + lora_s)
    layer = weights_s * weight_mult + lora_s * (fwd_pass + 2.0) + attn_s + recompute_ops
    layer_fwd = weights_s + lora_s + attn_fwd_s
    # the backward phase: gradients plus whatever is recomputed for them
    layer_bwd = layer - layer_fwd

    head_mult = 1.0 + dx + dw                      # the head is not recomputed
    last = head_mult * (tokens * head_tp_s + tokens * head_rep_s + seqs * head_seq_s)
    first = (1.0 + dw) * seqs * embed_s
    # the rates these assume, for the report: the block's weight GEMMs and its attention
    # core (forward), FLOPs and seconds on this device
    weight_rows = cols[0][:9]
    return {"layer": layer, "layer_fwd": layer_fwd, "layer_bwd": layer_bwd,
            "layer_dw": weights_s * dw, "first": first, "last": last,
            "first_fwd": seqs * embed_s, "last_fwd": last / head_mult,
            "gemm_flops": tokens * jnp.sum(weight_rows), "gemm_s": weights_s,
            "attn_flops": attn_flops, "attn_s": attn_fwd_s,
            "attn_bwd_s": attn_bwd_s,
            "tp_windows": tokens * jnp.stack([qkv_s, out_s, mlp_in_s + un_in_s,
                                              mlp_out_s + un_out_s])}


__all__ = ["block_flops", "compute_times", "fused_linear_chunk", "gemm_dim", "hardware_flops",
           "matmul_efficiency", "model_flops", "recompute_flops", "step_tokens"]
