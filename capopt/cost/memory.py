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

import jax
import jax.numpy as jnp

from ._inputs import Knobs


def step_at_least(x, threshold):
    """0 at ``x <= threshold - 1``, 1 at ``x >= threshold``, linear between (exact at integers)."""
    return jnp.clip(x - (threshold - 1.0), 0.0, 1.0)


def shard(fraction, degree):
    """Share of a buffer one device holds when ``fraction`` of it is split ``degree`` ways."""
    return 1.0 - fraction + fraction / degree


def indivisible(count, degree):
    """1 where the integer ``degree`` does not divide ``count``, else 0; linear between
    neighbouring integers (exact at integer degrees, continuous in a relaxed one)."""
    lo = jnp.maximum(jnp.floor(degree), 1.0)
    t = jnp.clip(degree - lo, 0.0, 1.0)
    one = lambda d: (jnp.mod(count, d) != 0).astype(jnp.result_type(float))  # noqa: E731
    return (1.0 - t) * one(lo) + t * one(lo + 1.0)


def tp_replication(k: Knobs, n):
    """(KV projections, vocabulary tables) replicated over tensor parallelism: 1 or 0.

    ``k``/``v`` stay whole on every device when ``tp`` exceeds the KV heads (a valid config has
    tp | kv or kv | tp); vocabulary-parallel tables when ``tp`` does not divide the vocabulary.
    """
    kv_rep = step_at_least(k.tp, n["kv"] + 1.0)
    vocab_rep = indivisible(n["V"], k.tp)
    return kv_rep, vocab_rep


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
    # (a GELU computed in float32 from 16-bit inputs also keeps ``mlp_gelu_lowp_saved``
    # f-wide 16-bit residuals of its derivative; in float32 XLA recomputes them)
    lowp = (ab < 4.0).astype(jnp.result_type(float))
    gelu_saved = n["rt_mlp_gelu_saved"] + lowp * n["rt_mlp_gelu_lowp_saved"]
    mlp_saved = n["gated"] * n["rt_mlp_gated_saved"] + (1 - n["gated"]) * gelu_saved
    sharded = ab * (2.0 * a * hd + 2.0 * kv * hd) + ab * mlp_saved * f * moe_mult
    # softmax output (``score_copies`` of them in the activation dtype, plus
    # ``score_fp32_copies`` in float32: XLA keeps the float32 softmax output for its backward
    # and the probabilities cast back to the compute dtype for the second matmul), dropout
    # mask, and the dropped probabilities where the runtime keeps them
    # (``attn_dropout_out_saved``; XLA recomputes them from the mask)
    materialised = a * s * (n["rt_score_copies"] * ab + n["rt_score_fp32_copies"] * 4.0
                            + mask_a * (1.0 + n["rt_attn_dropout_out_saved"] * ab))
    # Causal or not, XLA and PyTorch materialise the full s x s matrix.
    # blockwise attention: the softmax statistics (q and the output, regrouped by block, are
    # the q and attention output counted in ``sharded``)
    flash = a * n["rt_attn_lse_bytes"]
    scores = k.flash * flash + (1.0 - k.flash) * materialised
    # A plain MLP stack (family "mlp") keeps one input and one activation per layer.
    mlp_only = ab * 2.0 * h
    scale = n["rt_act_scale"]
    # attention dropout's mask and dropped probabilities (regenerated, not stored, when a
    # recomputed block is rebuilt: the mask comes from the step's key)
    dropout_scores = (1.0 - k.flash) * a * s * mask_a * (1.0 + n["rt_attn_dropout_out_saved"] * ab)
    # a rebuilt block holds its float32 score copy in the compute dtype (the scores and the
    # masked scores, before the float32 softmax, which is fused into its consumer)
    rebuilt_cast = (1.0 - k.flash) * a * s * n["rt_score_fp32_copies"] * (4.0 - ab)
    # blockwise attention in a rebuilt block: its backward loop's zero-initialised gradient
    # accumulators (query-sized, ``flash_qo_copies`` of them), which XLA creates for every
    # rebuilt block at once, ahead of the backward pass (a hoisted broadcast)
    flash_accum = k.flash * n["rt_flash_qo_copies"] * ab * a * hd
    return {
        "flash_accum": scale * jnp.where(is_mlp_model > 0, 0.0, flash_accum),
        "replicated": scale * jnp.where(is_mlp_model > 0, mlp_only, replicated),
        "sharded": scale * jnp.where(is_mlp_model > 0, 0.0, sharded),
        "scores": scale * jnp.where(is_mlp_model > 0, 0.0, scores),
        "dropout_scores": scale * jnp.where(is_mlp_model > 0, 0.0, dropout_scores),
        "rebuilt_cast": scale * jnp.where(is_mlp_model > 0, 0.0, rebuilt_cast),
        "layer_input": ab * h,
    }


def layer_activation_bytes(k: Knobs, n, tokens):
    """Bytes one block saves for ``tokens`` tokens under each policy: (none, selective, full).

    Selective recomputation is a mixture by the profile's ``selective_saves_dots``: 0 is
    Korthikanti et al.'s (keep everything but the attention core); 1 is JAX's
    ``dots_with_no_batch_dims_saveable`` (keep only the projections' outputs, q k v o
    gate/up down, and the block input; norms, activations and the attention core are rebuilt).
    """
    t = layer_activation_terms(k, n)
    rep_div = shard(k.sp, k.tp)
    none = tokens * (t["replicated"] * rep_div + (t["sharded"] + t["scores"]) / k.tp)
    korthikanti = none - tokens * t["scores"] / k.tp
    ab = n["act_bytes"]
    moe_mult = jnp.where(n["E"] > 1, n["topk"] * n["rt_moe_capacity_factor"], 1.0)
    up_mats = 1.0 + n["gated"]
    dots = ab * ((n["a"] * n["hd"] + 2.0 * n["kv"] * n["hd"] + up_mats * n["f"] * moe_mult)
                 / k.tp + 3.0 * n["h"] * rep_div)           # + o and down outputs, block input
    dots = jnp.where(n["mlp"] > 0, ab * 2.0 * n["h"], dots)
    c = n["rt_selective_saves_dots"]
    selective = (1.0 - c) * korthikanti + c * tokens * dots * n["rt_act_scale"]
    full = tokens * t["layer_input"] * rep_div
    accum = tokens * t["flash_accum"] / k.tp
    return none, selective + accum, full + accum


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
def expert_layer_params(k: Knobs, n):
    """Expert parameters of one block on one device (split over ep, and over tp except
    the down-projection bias)."""
    return n["E"] / k.ep * (n["P_expert"] / k.tp + n["P_expert_rep"] * (1.0 - 1.0 / k.tp))


def stage_params(k: Knobs, n):
    """Parameters held by one device of the first and of the last pipeline stage.

    Returns (layer_params, first_extra, last_extra, multi): parameters of one block on this
    device, and the embedding / head parameters on the first / last stage (both on one stage
    at pp=1; a tied embedding is held twice when pp > 1, as Megatron-LM does); ``multi`` is 1
    when pp >= 2. Tensor-parallel groups as `capopt.cost._inputs.scenario_numbers` describes.
    """
    kv_rep, vocab_rep = tp_replication(k, n)
    per_layer = (n["P_layer_tp"] / k.tp + n["P_layer_rep"]
                 + kv_rep * n["P_layer_kv"] * (1.0 - 1.0 / k.tp)
                 + expert_layer_params(k, n))
    vocab_share = vocab_rep + (1.0 - vocab_rep) / k.tp
    first = n["P_embed_tp"] * vocab_share + n["P_embed_rep"]
    last = n["P_head_tp"] * vocab_share + n["P_head_rep"]
    multi = step_at_least(k.pp, 2.0)           # 1 when pp >= 2
    last = last + multi * n["tied"] * n["P_embed_tp"] * vocab_share
    return per_layer, first, last, multi


def largest_module(k: Knobs, n):
    """Parameters of a block's largest weight matrix on one device: the fused q/k/v
    projection, the attention output, the (fused gate and) up projection or the down
    projection, split over tp (a plain MLP stack: one h x h matrix)."""
    h, a, kv, hd, f = n["h"], n["a"], n["kv"], n["hd"], n["f"]
    qkv = h * (a * hd + 2.0 * kv * hd)
    up = h * f * (1.0 + n["gated"])
    big = jnp.maximum(jnp.maximum(qkv, a * hd * h), jnp.maximum(up, f * h)) / k.tp
    return jnp.where(n["mlp"] > 0, h * h, big)


# --------------------------------------------------------------------------------------------
# The breakdown
# --------------------------------------------------------------------------------------------
def stage_memory(k: Knobs, n, *, layers, extra_params, in_flight, logits_mb, first_stage):
    """Memory of one device holding ``layers`` blocks plus ``extra_params``.

    ``first_stage`` (the stage whose input edge is held for every micro-batch in flight) is
    a bool, or an array of them when the stage arguments are batched under `jax.vmap`.
    """
    per_layer, _, _, _ = stage_params(k, n)
    kv_rep, vocab_rep = tp_replication(k, n)
    z = k.zero
    f_opt, f_grad, f_param = z[1] + z[2] + z[3], z[2] + z[3], z[3]
    dp = k.dp
    # ZeRO splits state over the data-parallel group; expert tensors, already split over ep,
    # only over the expert-data-parallel group (dp / ep), as DeepSpeed-MoE does.
    edp = jnp.maximum(dp / k.ep, 1.0)

    # --- parameters (LoRA: frozen base, quantised where wrapped) ---
    dense_params = layers * per_layer + extra_params
    expert_params = layers * expert_layer_params(k, n)

    def zshard(frac, total, expert):
        """One device's share of ``total`` parameters (``expert`` of them in experts) when
        ``frac`` of the state is ZeRO-sharded."""
        return (total - expert) * shard(frac, dp) + expert * shard(frac, edp)

    lora = n["lora"]
    lora_tp = n["lora_layer"] / k.tp
    kv_base = n["lora_base_kv"] * kv_rep * (1.0 - 1.0 / k.tp)
    base_wrapped = (n["lora_base_layer"] / k.tp + kv_base) * layers
    base_scales = (n["base_scale_tp_bytes"] / k.tp + n["base_scale_rep_bytes"]) * layers
    full_params_bytes = zshard(f_param, dense_params, expert_params) * n["param_bytes"]
    lora_params_bytes = (base_wrapped * n["base_bytes"] + base_scales
                         + (dense_params - base_wrapped) * n["frozen_bytes"]
                         + layers * lora_tp * n["param_bytes"]) * shard(f_param, dp)
    params_bytes = lora * lora_params_bytes + (1 - lora) * full_params_bytes

    trainable = lora * layers * lora_tp + (1 - lora) * dense_params
    trainable_expert = (1 - lora) * expert_params

    # --- gradients: all live unless the update is fused into the backward pass ---
    # (under accumulation a runtime that reuses buffers, ``buffer_reuse`` = 1, adds each
    # micro-batch gradient into the accumulator as it is produced: the accumulator, counted
    # below, is what stays live, and clipping reads it after the last micro-batch)
    accumulating = step_at_least(k.grad_accum, 2.0)
    need_all = (jnp.maximum(n["grad_clip"], accumulating)
                * (1.0 - n["rt_buffer_reuse"] * accumulating))
    fused_share = jnp.minimum(1.0, n["rt_grads_live_layers_fused"] / jnp.maximum(layers, 1e-6))
    fused = n["rt_grads_fused"]
    live = (1 - fused) + fused * (need_all + (1 - need_all) * fused_share)
    grads_bytes = zshard(f_grad, trainable, trainable_expert) * n["grad_bytes"] * live

    # --- optimizer state (+ fp32 master weights), maybe offloaded to the host ---
    opt_per_param = n["master_bytes"] + n["opt_bytes"]
    opt_device = zshard(f_opt, trainable, trainable_expert) * opt_per_param
    optimizer_bytes = opt_device * (1.0 - k.offload)

    # --- activations ---
    tokens = k.micro_batch * n["s"]
    a_none, a_sel, a_full = layer_activation_bytes(k, n, tokens)
    w_none, w_sel, w_full = k.remat[0], k.remat[1], k.remat[2]
    stored = layers * (w_none * a_none + w_sel * a_sel + w_full * a_full) * in_flight
    # A recomputed block is rebuilt during its backward pass; ``rebuild_fraction`` of what it
    # would have saved is live at once (1: the whole block, as a caching allocator holds it),
    # less the attention-dropout buffers ``rt_rebuild_dropout`` = 0 says are fused away.
    terms = layer_activation_terms(k, n)
    drop = ((1.0 - n["rt_rebuild_dropout"]) * terms["dropout_scores"]
            + terms["rebuilt_cast"]) * tokens / k.tp
    rebuild = n["rt_rebuild_fraction"] * (
        jnp.minimum(1.0, w_full * layers) * (a_none - drop)
        + jnp.minimum(1.0, w_sel * layers) * jnp.maximum(a_none - a_sel - drop, 0.0))
    # The backward pass of a block holds float32 score gradients for a moment
    # (``score_grad_copies`` of them, per head): of the whole s x s matrix when attention is
    # materialised, of one block of ``attn_chunk_queries`` queries (against every key) when
    # it runs blockwise (the validation step's chunked stand-in; 0 for a fused kernel).
    # The blockwise loop's buffers are assigned apart from the rest of the step (XLA gives a
    # loop body's buffers their own space), so they do not share memory with the logits.
    per_head = n["rt_score_grad_copies"] * k.micro_batch * n["a"] * 4.0 / k.tp * jnp.where(
        n["mlp"] > 0, 0.0, 1.0)
    transient = per_head * (1.0 - k.flash) * n["s"] * n["s"]
    loop_transient = per_head * k.flash * jnp.minimum(n["rt_attn_chunk_queries"], n["s"]) * n["s"]
    # The score gradients are live while the block's attention runs backward, by which time
    # its rebuilt MLP activations are gone: the larger of the rebuilt block and its scores plus
    # their gradients (exact at integer points).
    scores_rebuilt = n["rt_rebuild_fraction"] * (
        jnp.minimum(1.0, w_full * layers) + jnp.minimum(1.0, w_sel * layers)) * tokens * (
        terms["scores"] - terms["rebuilt_cast"]
        - (1.0 - n["rt_rebuild_dropout"]) * terms["dropout_scores"]) / k.tp * (1.0 - k.flash)
    rebuild = jnp.maximum(rebuild, scores_rebuilt + transient)
    rep_div = shard(k.sp, k.tp)
    edge = tokens * (terms["layer_input"] + n["hidden_dropout"] * n["h"]) * rep_div
    if first_stage is True or first_stage is False:
        edge_in_flight = in_flight if first_stage else 1.0
    else:                                   # an array (e.g. under `jax.vmap`): 1 or 0
        edge_in_flight = jnp.where(first_stage, in_flight, 1.0)
    activations_bytes = stored + rebuild + loop_transient + edge * edge_in_flight

    # --- gradients at the peak ---
    # XLA's static buffer assignment reuses memory across the step: gradients produced late in
    # the backward pass take the place of activations already consumed. With
    # ``buffer_reuse`` = o, the gradients that must all be live at the end of the
    # backward pass (clipping, or a micro-batch's gradients before they are accumulated)
    # overlap the activations and logits by o * min(both): o = 0 adds them (the plain sum),
    # o = 1 takes the larger. Under gradient accumulation the accumulator itself (all
    # gradients) is live across the whole step, on top of the micro-batch's (counted at o).
    accum = step_at_least(k.grad_accum, 2.0)
    grads_all = zshard(f_grad, trainable, trainable_expert) * n["grad_bytes"]
    accum_bytes = n["rt_buffer_reuse"] * accum * grads_all
    late_grads = grads_bytes

    # --- logits and loss buffers (last stage) ---
    # (a tied head, x @ embedding.T, keeps one more compute-dtype copy for the embedding's
    # gradient: ``logits_tied_copies``)
    per_elem = ((n["rt_logits_act_copies"] + n["tied"] * n["rt_logits_tied_copies"])
                * n["act_bytes"] + n["rt_logits_fp32_copies"] * 4.0)
    logit_tp = n["logit_tp"] * (1.0 - vocab_rep)          # a replicated head: whole logits
    logit_div = logit_tp * k.tp + (1 - logit_tp)
    logits_bytes = logits_mb * k.micro_batch * n["logit_elems_per_seq"] * per_elem / logit_div
    # The loss buffers are freed before the first recomputed block is rebuilt: with
    # ``buffer_reuse`` = 1 they share memory (the larger counts; the rebuild is in
    # activations_bytes, the logits' excess over it here).
    logits_bytes = logits_bytes - n["rt_buffer_reuse"] * jnp.minimum(logits_bytes, rebuild)

    # A rebuilt block is rebuilt while the gradients already produced are live (the last one
    # rebuilt, with all but one block's gradients): gradients share memory only with the
    # stored activations and the loss buffers, which are consumed before they are produced.
    overlap = n["rt_buffer_reuse"] * jnp.minimum(activations_bytes - rebuild + logits_bytes,
                                                 late_grads)
    grads_bytes = accum_bytes + late_grads - overlap

    # --- communication buffers ---
    # ZeRO-3/FSDP: whole blocks gathered for compute (the layer in use plus prefetch); the
    # device's own 1/dp slice is already counted in params_bytes. A runtime that gathers
    # module by module bounds the gathered parameters instead: DeepSpeed stops prefetching
    # once ``zero3_max_live_params`` elements are resident (stage3_max_live_parameters) but
    # always fetches the module about to run, so at most that bound plus the largest module
    # (one weight matrix) is live. The smaller of the two counts (min: exact at integers).
    in_use = jnp.minimum(n["rt_zero3_prefetch_layers"], layers)
    # XLA (``zero3_keeps_stored_gathered`` = 1) gathers the weights cast to the compute dtype,
    # and a block that is not recomputed keeps its gathered weights for its backward pass
    # (the backward's gathers are the forward's): every stored block's, plus the prefetch
    # window for the rebuilt ones, which gather again.
    keep = n["rt_zero3_keeps_stored_gathered"]
    in_use = (1.0 - keep) * in_use + keep * (layers * w_none + (1.0 - w_none) * in_use)
    gather_bytes = (1.0 - keep) * n["param_bytes"] + keep * jnp.where(
        n["weight_copy_bytes"] > 0, n["weight_copy_bytes"], n["param_bytes"])
    expert_layer = expert_layer_params(k, n)
    gathered_layer = ((per_layer - expert_layer) * (1.0 - 1.0 / dp)
                      + expert_layer * (1.0 - 1.0 / edp))
    bounded = (n["rt_zero3_max_live_params"] + largest_module(k, n)) * (1.0 - 1.0 / dp)
    gathered = f_param * jnp.minimum(in_use * gathered_layer, bounded) * gather_bytes
    buckets = step_at_least(dp, 2.0) * n["rt_comm_bucket_bytes"]
    p2p = step_at_least(k.pp, 2.0) * 2.0 * tokens * n["h"] * n["act_bytes"] * rep_div
    comm_bytes = gathered + buckets + p2p

    # --- runtime overhead ---
    # Casts of the weights to the compute dtype (a matmul's operand): a stored block keeps its
    # casts for the backward pass, a recomputed block casts again when it is rebuilt (one
    # block's worth at a time); the head's cast is live at the loss; the embedding table is
    # read by a gather, never cast whole (XLA buffer assignment: heldout deep-llama s2048
    # bf16-mixed holds every block's casts and the head's; calib-gpt s1024 full, with every block
    # recomputed, a few matrices').
    vocab_share = vocab_rep + (1.0 - vocab_rep) / k.tp
    head = logits_mb * (n["P_head_tp"] + n["tied"] * n["P_embed_tp"]) * vocab_share
    cast_layers = layers * w_none + jnp.minimum(1.0, layers * (w_sel + w_full))
    weight_copy = (n["rt_weight_copy_fraction"] * n["weight_copy_bytes"] * (1 - lora)
                   * shard(f_param, dp) * (cast_layers * per_layer + head))
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
        "host_optimizer_bytes": opt_device * k.offload,
        "trainable_params": trainable, "device_params": dense_params,
        # the trainable state's bytes on this device (ZeRO-3 splits it, experts over dp / ep)
        "trainable_bytes": zshard(f_param, trainable, trainable_expert) * n["param_bytes"],
    }


def end_stage_args(k: Knobs, n) -> tuple[dict, dict]:
    """The `stage_memory` arguments of the first pipeline stage (embedding; 1F1B: it holds
    min(p, m) micro-batches) and of the last (head and loss); at pp = 1 one stage holds both."""
    _, first_extra, last_extra, multi = stage_params(k, n)
    single = 1.0 - multi
    in_flight = jnp.minimum(k.pp, k.grad_accum)   # 1F1B: stage 0 holds min(p, m) micro-batches
    first = {"extra_params": first_extra + single * last_extra, "in_flight": in_flight,
             "logits_mb": single, "first_stage": True}
    last = {"extra_params": last_extra + single * first_extra, "in_flight": 1.0,
            "logits_mb": 1.0, "first_stage": False}
    return first, last


def end_stage_memory(k: Knobs, n) -> dict:
    """`stage_memory` of the first and the last pipeline stage, stacked on a leading axis of
    two (first, last): one stage evaluation under `jax.vmap` over the stage arguments, so what
    the two stages share is computed once."""
    first, last = end_stage_args(k, n)
    args = {key: jnp.stack(jnp.broadcast_arrays(first[key], last[key])) for key in first}
    layers = n["L"] / k.pp
    return jax.vmap(lambda a: stage_memory(k, n, layers=layers, **a))(args)


def memory(k: Knobs, n) -> dict:
    """Per-device memory of the device that needs the most (first or last pipeline stage)."""
    both = end_stage_memory(k, n)
    # Which stage binds: a smooth-free pick (exact), the breakdown of the larger one.
    take_first = both["total_bytes"][0] >= both["total_bytes"][1]
    out = {key: jnp.where(take_first, v[0], v[1]) for key, v in both.items()}
    out["first_stage_bytes"] = both["total_bytes"][0]
    out["last_stage_bytes"] = both["total_bytes"][1]
    out["budget_bytes"] = n["usable_bytes"]
    out["vram_bytes"] = n["vram_bytes"]
    out["free_bytes"] = n["usable_bytes"] - out["total_bytes"]
    return out
