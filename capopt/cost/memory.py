"""Per-device memory, in pure `jax.numpy`.

Every function takes `Knobs` and the scenario `Numbers` (dicts of scalars) and returns bytes.
Integer knobs give the exact accounting; relaxed knobs give a smooth interpolation (ZeRO
stage and remat policy are weight vectors, so their terms are linear mixtures; ``min`` and
indicator terms are piecewise linear and exact at integers).

Sources: model states follow ZeRO (Rajbhandari et al. 2020, Table 1); saved activations follow
Korthikanti et al. 2022 (section 4), generalised op by op to GQA, gated MLPs, MoE and flash
attention; which of them are live together is the runtime profile's business.
"""

from __future__ import annotations

import jax.numpy as jnp

from ._inputs import Knobs


def step_at_least(x, threshold):
    """0 at ``x <= threshold - 1``, 1 at ``x >= threshold``, linear between (exact at integers)."""
    return jnp.clip(x - (threshold - 1.0), 0.0, 1.0)


def shard(fraction, degree):
    """Share of a buffer one device holds when ``fraction`` of it is split ``degree`` ways."""
    return 1.0 - fraction + fraction / degree


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------
def layer_activation_terms(k: Knobs, n) -> dict:
    """Bytes saved per token by one block, split by how they scale.

    ``replicated``: the residual stream side (norm inputs and outputs, dropout masks); split by
    tp only under sequence parallelism. ``sharded``: q, k, v, attention output, MLP internals;
    always split by tp. ``scores``: the attention matrix (materialised) or the softmax
    statistics (flash); split by tp. ``layer_input``: what full recomputation keeps.
    """
    ab = n["act_bytes"]
    h, a, kv, hd, f, s = n["h"], n["a"], n["kv"], n["hd"], n["f"], n["s"]
    mask_h = n["hidden_dropout"]            # 1-byte masks after attention and MLP
    mask_a = n["attn_dropout"]
    is_mlp_model = n["mlp"]
    moe_mult = jnp.where(n["E"] > 1, n["topk"] * n["rt_moe_capacity_factor"], 1.0)

    replicated = ab * (n["rt_norm_inputs_saved"] * h + 2.0 * h) + 2.0 * mask_h * h
    replicated = replicated + jnp.where(n["E"] > 1, 4.0 * n["E"], 0.0)   # fp32 router probs
    mlp_saved = n["gated"] * n["rt_mlp_gated_saved"] + (1 - n["gated"]) * n["rt_mlp_gelu_saved"]
    sharded = ab * (2.0 * a * hd + 2.0 * kv * hd) + ab * mlp_saved * f * moe_mult
    materialised = a * s * (ab + mask_a * (1.0 + ab))
    # Causal or not, XLA and PyTorch materialise the full s x s matrix.
    flash = a * n["rt_attn_lse_bytes"]
    scores = k.flash * flash + (1.0 - k.flash) * materialised
    # A plain MLP stack (family "mlp") keeps one input and one activation per layer.
    mlp_only = ab * 2.0 * h
    scale = n["rt_act_scale"]
    return {
        "replicated": scale * jnp.where(is_mlp_model > 0, mlp_only, replicated),
        "sharded": scale * jnp.where(is_mlp_model > 0, 0.0, sharded),
        "scores": scale * jnp.where(is_mlp_model > 0, 0.0, scores),
        "layer_input": ab * h,
    }


def layer_activation_bytes(k: Knobs, n, tokens):
    """Bytes one block saves for ``tokens`` tokens under each policy: (none, selective, full)."""
    t = layer_activation_terms(k, n)
    rep_div = shard(k.sp, k.tp)
    none = tokens * (t["replicated"] * rep_div + (t["sharded"] + t["scores"]) / k.tp)
    selective = none - tokens * t["scores"] / k.tp
    full = tokens * t["layer_input"] * rep_div
    return none, selective, full


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
def stage_params(k: Knobs, n):
    """Parameters held by one device of the first and of the last pipeline stage.

    Returns (layer_params, first_extra, last_extra): parameters of one block on this device,
    and the embedding / head parameters on the first / last stage (both on one stage at pp=1;
    a tied embedding is held twice when pp > 1, as Megatron-LM does).
    """
    per_layer = (n["P_layer_tp"] / k.tp + n["P_layer_rep"]
                 + n["E"] / k.ep * n["P_expert"] / k.tp)
    first = n["P_embed_tp"] / k.tp + n["P_embed_rep"]
    last = n["P_head_tp"] / k.tp + n["P_head_rep"]
    multi = step_at_least(k.pp, 2.0)           # 1 when pp >= 2
    last = last + multi * n["tied"] * n["P_embed_tp"] / k.tp
    return per_layer, first, last, multi


# --------------------------------------------------------------------------------------------
# The breakdown
# --------------------------------------------------------------------------------------------
def _stage_memory(k: Knobs, n, *, layers, extra_params, in_flight, logits_mb, first_stage):
    """Memory of one device holding ``layers`` blocks plus ``extra_params``."""
    per_layer, _, _, _ = stage_params(k, n)
    z = k.zero
    f_opt, f_grad, f_param = z[1] + z[2] + z[3], z[2] + z[3], z[3]
    dp = k.dp

    # --- parameters (LoRA: frozen base, quantised where wrapped) ---
    dense_params = layers * per_layer + extra_params
    lora = n["lora"]
    lora_tp = n["lora_layer"] / k.tp
    base_wrapped = n["lora_base_layer"] / k.tp * layers
    full_params_bytes = dense_params * n["param_bytes"]
    lora_params_bytes = (base_wrapped * n["base_bytes"]
                         + (dense_params - base_wrapped) * n["frozen_bytes"]
                         + layers * lora_tp * n["param_bytes"])
    params_bytes = (lora * lora_params_bytes + (1 - lora) * full_params_bytes) * shard(f_param, dp)

    trainable = lora * layers * lora_tp + (1 - lora) * dense_params

    # --- gradients: all live unless the update is fused into the backward pass ---
    need_all = jnp.maximum(n["grad_clip"], step_at_least(k.grad_accum, 2.0))
    fused_share = jnp.minimum(1.0, n["rt_grads_live_layers_fused"] / jnp.maximum(layers, 1e-6))
    fused = n["rt_grads_fused"]
    live = (1 - fused) + fused * (need_all + (1 - need_all) * fused_share)
    grads_bytes = trainable * n["grad_bytes"] * shard(f_grad, dp) * live

    # --- optimizer state (+ fp32 master weights), maybe offloaded to the host ---
    opt_per_param = n["master_bytes"] + n["opt_bytes"]
    optimizer_bytes = trainable * opt_per_param * shard(f_opt, dp) * (1.0 - k.offload)

    # --- activations ---
    tokens = k.micro_batch * n["s"]
    a_none, a_sel, a_full = layer_activation_bytes(k, n, tokens)
    w_none, w_sel, w_full = k.remat[0], k.remat[1], k.remat[2]
    stored = layers * (w_none * a_none + w_sel * a_sel + w_full * a_full) * in_flight
    # A recomputed block is rebuilt whole during its backward pass.
    rebuild = (jnp.minimum(1.0, w_full * layers) * a_none
               + jnp.minimum(1.0, w_sel * layers) * (a_none - a_sel))
    rep_div = shard(k.sp, k.tp)
    terms = layer_activation_terms(k, n)
    edge = tokens * (terms["layer_input"] + n["hidden_dropout"] * n["h"]) * rep_div
    activations_bytes = stored + rebuild + edge * (in_flight if first_stage else 1.0)

    # --- logits and loss buffers (last stage) ---
    per_elem = (n["rt_logits_act_copies"] * n["act_bytes"] + n["rt_logits_fp32_copies"] * 4.0)
    logit_div = n["logit_tp"] * k.tp + (1 - n["logit_tp"])
    logits_bytes = logits_mb * k.micro_batch * n["logit_elems_per_seq"] * per_elem / logit_div

    # --- communication buffers ---
    # ZeRO-3/FSDP: whole blocks gathered for compute (the layer in use plus prefetch); the
    # device's own 1/dp slice is already counted in params_bytes.
    in_use = jnp.minimum(n["rt_zero3_prefetch_layers"], layers)
    gathered = f_param * in_use * per_layer * (1.0 - 1.0 / dp) * n["param_bytes"]
    buckets = step_at_least(dp, 2.0) * n["rt_comm_bucket_bytes"]
    p2p = step_at_least(k.pp, 2.0) * 2.0 * tokens * n["h"] * n["act_bytes"] * rep_div
    comm_bytes = gathered + buckets + p2p

    # --- runtime overhead ---
    weight_copy = (n["rt_weight_copy_fraction"] * dense_params * n["weight_copy_bytes"]
                   * shard(f_param, dp) * (1 - lora))
    dynamic = activations_bytes + logits_bytes + grads_bytes + comm_bytes
    overhead_bytes = (n["rt_context_bytes"] + n["rt_workspace_bytes"]
                      + n["rt_fragmentation"] * dynamic + weight_copy)

    total = (params_bytes + grads_bytes + optimizer_bytes + activations_bytes + logits_bytes
             + comm_bytes + overhead_bytes)
    return {
        "params_bytes": params_bytes, "grads_bytes": grads_bytes,
        "optimizer_bytes": optimizer_bytes, "activations_bytes": activations_bytes,
        "logits_bytes": logits_bytes, "comm_bytes": comm_bytes,
        "overhead_bytes": overhead_bytes, "total_bytes": total,
        "host_optimizer_bytes": trainable * opt_per_param * shard(f_opt, dp) * k.offload,
        "trainable_params": trainable, "device_params": dense_params,
    }


def memory(k: Knobs, n) -> dict:
    """Per-device memory of the device that needs the most (first or last pipeline stage)."""
    per_layer, first_extra, last_extra, multi = stage_params(k, n)
    layers = n["L"] / k.pp
    single = 1.0 - multi
    in_flight = jnp.minimum(k.pp, k.grad_accum)   # 1F1B: stage 0 holds min(p, m) micro-batches
    first = _stage_memory(k, n, layers=layers, extra_params=first_extra + single * last_extra,
                          in_flight=in_flight, logits_mb=single, first_stage=True)
    last = _stage_memory(k, n, layers=layers, extra_params=last_extra + single * first_extra,
                         in_flight=1.0, logits_mb=1.0, first_stage=False)
    # Which stage binds: a smooth-free pick (exact), the breakdown of the larger one.
    take_first = first["total_bytes"] >= last["total_bytes"]
    out = {key: jnp.where(take_first, first[key], last[key]) for key in first}
    out["first_stage_bytes"] = first["total_bytes"]
    out["last_stage_bytes"] = last["total_bytes"]
    out["budget_bytes"] = n["usable_bytes"]
    out["vram_bytes"] = n["vram_bytes"]
    out["free_bytes"] = n["usable_bytes"] - out["total_bytes"]
    return out
