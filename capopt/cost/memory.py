"""Per-device memory: the largest live set of a simulated training step, in pure `jax.numpy`.

Model states (parameters, gradients, optimizer state) come from the parameter groups of the
card's tensor inventory, split as ZeRO (Rajbhandari et al. 2020, Table 1), tensor and expert
parallelism place them. Activations come from `capopt.cost.activations` (one block's
inventory). What is live at once is a walk over the phases of one step on one device:

``loss``      the loss and its gradient: every block's saved activations (x micro-batches in
              flight on a pipeline stage), the logits' buffers, the head's weight cast, the
              embedding-gradient buffer, the accumulator;
``top``       the backward pass of the last block: every block's saved activations, its
              backward transients (or, recomputed, its rebuilt activations and transients),
              the gradients produced so far that must stay live;
``rebuild``   the backward pass of the last recomputed block (with a fraction of the layers
              recomputed, after the stored ones are consumed): the recomputed blocks' inputs,
              one block rebuilt, and every stored block's gradients when they must stay live;
``bottom``    the backward pass of the first block: its own activations and transients and
              every other block's gradients when they must stay live;
``update``    after the backward pass: every gradient (when clipping needs them all) and the
              optimizer's temporaries;
``forward``   the forward pass's end, before the loss: every block's saved activations, the
              head's output, and every weight cast a runtime caches for the whole forward
              pass (autocast: recomputed blocks' too). After the phases above, so that a tie
              goes to them.
``regather``  a runtime that reshards its root group after the forward pass
              (``zero3_root_regather``) gathers it again when the gradient reaches the head's
              output: every block's saved activations, that gradient, and the root twice (the
              collective's flat output and the parameters copied out of it). Without that rule
              it is never above ``loss``.

Between ``top`` and ``bottom`` the live set is linear in the block index, so its largest
value is at one of the ends. Which gradients stay live is the runtime's rule:
``grads_fused`` = 1 (XLA) applies each update as its gradient is produced, unless clipping
(the global norm) or accumulation needs them all; a runtime that keeps ``.grad`` (PyTorch)
keeps every gradient to the end. The peak is the largest phase; every reported term is its
value in that phase, so the terms add up to ``total_bytes``. Integer knobs give the exact
accounting; relaxed knobs interpolate (the max over phases is piecewise linear).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._inputs import Knobs, rank_sequences, shard_group, step_at_least
from .flops import fused_linear_chunk
from .activations import (backward_transient_points, block_inventory, first_block_unsaved,
                          kv_replicated, mlp_width, saved_bytes, shard, split_over,
                          stream_bytes)

PHASES = ("loss", "top", "rebuild", "bottom", "update", "forward", "regather")


def indivisible(count, degree):
    """1 where the integer ``degree`` does not divide ``count``, else 0; linear between
    neighbouring integers (exact at integer degrees, continuous in a relaxed one)."""
    lo = jnp.maximum(jnp.floor(degree), 1.0)
    t = jnp.clip(degree - lo, 0.0, 1.0)
    one = lambda d: (jnp.mod(count, d) != 0).astype(jnp.result_type(float))  # noqa: E731
    return (1.0 - t) * one(lo) + t * one(lo + 1.0)


def stage_blocks(k: Knobs, n):
    """Blocks on the fullest pipeline rank: L / pp, or, where the runtime splits blocks
    unevenly (``uneven_stages``) and pp does not divide them, the most a rank of that split
    holds: ceil(L / pp) with one stage a rank (exactly: `capopt.cost.stages.runtime_split`),
    at most v * ceil(L / (pp v)) with v stages a rank (a bound). One number for every stage,
    so the end stages' embedding and head are priced beside the fullest rank's blocks: a
    bound on the split's memory and step time, never below them; `capopt.cost.estimate`
    prices a real config's split stage by stage. Linear between integer pp (continuous in a
    relaxed one)."""
    L = n["L"]
    v = jnp.maximum(k.vpp, 1.0)

    def extra(d):            # blocks above L / d on the fullest rank, at an integer d
        fullest = jnp.minimum(v * jnp.ceil(L / (d * v)), L)
        return jnp.where(jnp.mod(L, d) != 0, fullest - L / d, 0.0)
    lo = jnp.maximum(jnp.floor(k.pp), 1.0)
    t = jnp.clip(k.pp - lo, 0.0, 1.0)
    return L / k.pp + n["rt_uneven_stages"] * ((1.0 - t) * extra(lo) + t * extra(lo + 1.0))


def compute_weight_bytes(n):
    """Bytes per parameter of a weight in the compute dtype (its cast; the parameter itself
    where no cast is made)."""
    return jnp.where(n["weight_copy_bytes"] > 0, n["weight_copy_bytes"], n["param_bytes"])


def held_grad_bytes(n):
    """Bytes per element of a weight's gradient as it is held and reduced over the
    data-parallel group: the gradient dtype, or the compute dtype where the runtime keeps
    the weight-gradient matmul's output and casts it only where it is read
    (``grads_compute_dtype``). An accumulator, and the embedding's scatter-add target, are
    in the gradient dtype either way."""
    gb = n["grad_bytes"]
    return gb - n["rt_grads_compute_dtype"] * jnp.maximum(gb - n["act_bytes"], 0.0)


def gathered_param_bytes(n):
    """Bytes per trainable parameter as ZeRO-2/3 gathers it: the parameter's dtype, or the
    compute dtype where the runtime casts each shard before its all-gather
    (``fsdp_gathers_compute_dtype``: FSDP2's MixedPrecisionPolicy param_dtype)."""
    g = n["rt_fsdp_gathers_compute_dtype"]
    return (1.0 - g) * n["param_bytes"] + g * compute_weight_bytes(n)


def head_grad_split(n, rows, vocab):
    """1 where the runtime splits the contracting dimension of the head's input-gradient GEMM
    (logits gradient [rows, vocab] x head [vocab, h] on the device), 0 where not.

    XLA's GPU compiler splits K where the output has few tiles for the device's SMs, the
    more readily the longer K is (``head_splitk_rows_per_sm``, ``head_splitk_half_k``:
    `benchmarks/xla_splitk.py`); a split pads K to a multiple of the split, the padded copy
    of the logits gradient the profile's ``logits_pad_copies``. (A runtime that states no
    rule, or a device whose SM count is not known: 1.)"""
    per_sm = n["rt_head_splitk_rows_per_sm"]
    tiles = rows * jnp.ceil(n["h"] / 128.0)
    limit = splitk_tile_limit(n["sm_count"], vocab, per_sm, n["rt_head_splitk_half_k"])
    # (no rule, or a device whose SMs the catalog does not give: padded whenever unaligned)
    stated = (per_sm > 0.0) & (n["sm_count"] > 0.0)
    return jnp.where(stated, (tiles < limit).astype(jnp.result_type(float)), 1.0)


def splitk_tile_limit(sm_count, k, rows_per_sm, half_k):
    """Output rows x 128-wide column tiles below which a K-deep GEMM is split over K:
    ``rows_per_sm`` per SM for a long K, half that at ``k = half_k``."""
    return sm_count * rows_per_sm * k / (k + half_k)


def loss_copies(n):
    """Logits-sized buffers at the loss: (float32, compute dtype, padded compute-dtype
    copies of an unaligned vocabulary, float32 extras of a vocabulary-parallel loss). The
    runtime profile's rules, or a fused cross-entropy's (``loss = "fused"``: the logits it
    reads, kept for its backward, and their gradient, written in the compute dtype; no
    float32 copy, no padded or vocabulary-parallel extras); or a fused linear
    cross-entropy's (``loss = "fused-linear"``): one, each chunk's logits overwritten by
    their gradient (`fused_linear_chunk`); or the chunked loss's (``loss = "chunked"``,
    torchtune's, eager): every slice's float32 log-probabilities, saved by log_softmax, and
    at the first slice's backward, where its log_softmax backward runs, nll_loss's float32
    gradient and the result beside them, one slice each (a slice's logits and their upcast
    copy are freed within its forward pass: _to_copy's and linear's backward keep neither;
    the last slice's forward holds its bf16 logits, their upcast and its log-probabilities
    beside seven saved: 4.75 bytes a logit against the backward's 5)."""
    ch = n["loss_chunked"]
    keep = 1.0 - n["loss_fused"] - n["loss_fused_linear"] - ch
    return (keep * n["rt_logits_fp32_copies"] + ch * (1.0 + 2.0 / n["loss_chunks"]),
            keep * n["rt_logits_act_copies"] + 2.0 * n["loss_fused"] + n["loss_fused_linear"],
            keep * n["rt_logits_pad_copies"], keep * n["rt_logits_parallel_extra_copies"])


def offload_window(k: Knobs, n, tokens, inv: dict | None = None):
    """Bytes of a block's saved tensors on the device while activation offloading brings
    them back for its backward pass: the larger of its MLP's saved set (the f-wide tensors
    and the MLP input's cast) and its attention's (q, k, v, the output, the scores or the
    flash kernel's statistics), the nodes around each point being the ones whose tensors
    are back (torchtune's OffloadActivations: each node's freed once the next has run).
    Returns (the window, the MLP's set, the attention's set). ``inv``: the block's
    `block_inventory`, where the caller has it already."""
    ab = n["act_bytes"]
    inv = block_inventory(k, n) if inv is None else inv
    rep_div = shard(k.sp, k.tp)
    tf = 1.0 - n["mlp"]
    mlp = tokens * (ab * mlp_width(n) * (n["gated"] * n["rt_mlp_gated_saved"]
                                         + (1.0 - n["gated"]) * n["rt_mlp_gelu_saved"]) / k.tp
                    + ab * n["h"] * rep_div)
    attn = tokens * (ab * (n["q_w"] + n["k_w"] + n["v_w"] + n["o_w"]) / k.tp
                     + inv["scores"] / k.tp + ab * n["h"] * rep_div)
    plain = (1.0 - tf) * tokens * inv["rep"]
    return tf * jnp.maximum(mlp, attn) + plain, tf * mlp + plain, tf * attn + plain


def lora_per_device(n, tp, ep):
    """(adapters, wrapped base) elements of one block on one device: those of experts split
    over ep (a device holds E / ep experts, their adapters with them), then all split over tp,
    except those of replicated matrices (latent attention's q_a and kv_a), whole on every rank
    as their bases are; k/v replication is the caller's (`tp_replication`)."""
    off = 1.0 - 1.0 / ep
    return (split_over(n["lora_layer"] - off * n["lora_expert"], n["lora_rep"], tp),
            split_over(n["lora_base_layer"] - off * n["lora_base_expert"], n["lora_base_rep"],
                       tp))


def wrapped_base_per_device(k: Knobs, n):
    """Elements of one block's LoRA-wrapped (frozen, maybe quantised) base matrices on one
    device: `lora_per_device`'s, plus the k/v part kept whole on every rank where tp exceeds
    the KV heads (`tp_replication`)."""
    kv_rep, _ = tp_replication(k, n)
    return lora_per_device(n, k.tp, k.ep)[1] + n["lora_base_kv"] * kv_rep * (1.0 - 1.0 / k.tp)


def tp_replication(k: Knobs, n):
    """(KV projections, vocabulary tables) replicated over tensor parallelism: 1 or 0.

    ``k``/``v`` stay whole on every device when ``tp`` exceeds the KV heads (a valid config has
    tp | kv or kv | tp); vocabulary-parallel tables when ``tp`` does not divide the vocabulary.
    """
    kv_rep = kv_replicated(k, n)
    vocab_rep = indivisible(n["V"], k.tp)
    return kv_rep, vocab_rep


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
def expert_layer_params(k: Knobs, n):
    """Expert parameters of one block on one device (split over ep, and over tp except
    the down-projection bias)."""
    return n["E"] / k.ep * (n["P_expert"] / k.tp + n["P_expert_rep"] * (1.0 - 1.0 / k.tp))


def zero_shard(frac, total, expert, k: Knobs):
    """One device's share of ``total`` elements, ``expert`` of them in experts, when ``frac``
    of the state is ZeRO-sharded: dense tensors over the data-parallel group, expert tensors
    (already split over ep) over the expert-data-parallel group dp / ep, as DeepSpeed-MoE
    does; under hybrid sharding, dense tensors over the shard group (`shard_group`)."""
    edp = jnp.maximum(k.dp / k.ep, 1.0)
    return (total - expert) * shard(frac, shard_group(k)) + expert * shard(frac, edp)


def zero_shares(k: Knobs, n):
    """(f_opt, f_grad, f_param, z2_kept): the shares of the config whose optimizer state,
    gradients and parameters are split over the data-parallel group, and the share whose
    parameters are kept as ZeRO-2 keeps them (whole, beside their shards, ``zero2_keeps_shards``).

    Under a pipeline schedule that skips every micro-batch's reduce-scatter and reshard
    (``zero_pp_nosync``, pp >= 2: PyTorch's FSDP in torch.distributed.pipelining) ZeRO-3's
    parameters stay gathered as ZeRO-2's do and ZeRO-2/3's gradients stay unsharded through
    the step; only the optimizer state (and the parameters' own shards) stay split."""
    z = k.zero
    ns = pp_nosync(k, n)
    return (z[..., 1] + z[..., 2] + z[..., 3], (1.0 - ns) * (z[..., 2] + z[..., 3]),
            (1.0 - ns) * z[..., 3], z[..., 2] + ns * z[..., 3])


def pp_nosync(k: Knobs, n):
    """1 where ZeRO-2/3 runs under a pipeline schedule without per-micro-batch sync (see
    `zero_shares`), 0 elsewhere."""
    return n["rt_zero_pp_nosync"] * step_at_least(k.pp, 2.0)


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
    projection (latent attention: its projections together), the attention output, the
    (fused gate and) up projection or the down projection of the widest MLP, split over tp
    (a plain MLP stack: one h x h matrix)."""
    h, f = n["h"], n["f_max"]
    qkv = (n["W_qkv"] - n["W_qkv_rep"]) / k.tp + n["W_qkv_rep"]
    up = h * f * (1.0 + n["gated"])
    big = jnp.maximum(jnp.maximum(qkv, n["o_w"] * h / k.tp),
                      jnp.maximum(up, f * h) / k.tp)
    return jnp.where(n["mlp"] > 0, h * h, big)


# --------------------------------------------------------------------------------------------
# One stage
# --------------------------------------------------------------------------------------------
def _by_phase(values: dict):
    """One term's value in each phase, stacked in `PHASES` order (a vector of their count)."""
    return jnp.stack(jnp.broadcast_arrays(*(values[p] for p in PHASES)))


def stage_memory(k: Knobs, n, *, layers, extra_params, in_flight, edge_in_flight, logits_mb,
                 first_stage):
    """Memory of one device holding ``layers`` blocks plus ``extra_params``.

    ``in_flight`` micro-batches of the blocks' activations are held; the first stage's input
    edge for ``edge_in_flight`` of them (its first chunk's count, `first_chunk_in_flight`).

    ``first_stage`` (the stage whose input edge is held for every micro-batch in flight and
    whose embedding gradient is accumulated) is a bool, or an array of them when the stage
    arguments are batched under `jax.vmap`; ``logits_mb`` is 1 on the stage with the head.
    """
    per_layer, _, _, _ = stage_params(k, n)
    kv_rep, vocab_rep = tp_replication(k, n)
    vocab_share = vocab_rep + (1.0 - vocab_rep) / k.tp
    f_opt, f_grad, f_param, z2_kept = zero_shares(k, n)
    # ZeRO splits state over the data-parallel group (under hybrid sharding, over its shard
    # group, `shard_group`); expert tensors, already split over ep, only over the
    # expert-data-parallel group (dp / ep), as DeepSpeed-MoE does.
    dp = shard_group(k)
    edp = jnp.maximum(k.dp / k.ep, 1.0)
    if first_stage is True or first_stage is False:
        first = 1.0 if first_stage else 0.0
    else:                                   # an array (e.g. under `jax.vmap`): 1 or 0
        first = jnp.where(first_stage, 1.0, 0.0)

    # --- parameters (LoRA: frozen base, quantised where wrapped) ---
    dense_params = layers * per_layer + extra_params
    expert_params = layers * expert_layer_params(k, n)

    lora = n["lora"]
    lora_tp, _ = lora_per_device(n, k.tp, k.ep)
    base_wrapped = wrapped_base_per_device(k, n) * layers
    # (an NF4 base's scales kept whole beside its split codes, ``nf4_scales_whole_over_tp``;
    # the k/v part only where k/v are split, whole matrices being counted whole already)
    whole = n["rt_nf4_scales_whole_over_tp"] * (1.0 - 1.0 / k.tp) * (
        n["base_whole_bytes"] + (1.0 - kv_rep) * n["base_whole_kv_bytes"])
    base_scales = (n["base_scale_tp_bytes"] / k.tp + n["base_scale_rep_bytes"] + whole) * layers
    # (ZeRO-2 as FSDP2 runs it keeps each group's unsharded copy, ``zero2_keeps_shards``: in
    # the dtype its all-gather carries, `gathered_param_bytes`)
    z2_copy = n["rt_zero2_keeps_shards"] * z2_kept
    full_params_bytes = zero_shard(f_param, dense_params, expert_params, k) * (
        (1.0 - z2_copy) * n["param_bytes"] + z2_copy * gathered_param_bytes(n))
    lora_params_bytes = (base_wrapped * n["base_bytes"] + base_scales
                         + (dense_params - base_wrapped) * n["frozen_bytes"]
                         + layers * lora_tp * n["param_bytes"]) * shard(f_param, dp)
    params_bytes = lora * lora_params_bytes + (1 - lora) * full_params_bytes
    # Parameter offload (``offload_params``, FSDP2's CPUOffloadPolicy, torch v2.13): the
    # sharded parameters live in pinned host memory, each group's shard copied to the device
    # just before its all-gather (and cast there to the gathered dtype: a transient of 1/dp of
    # a group, not counted); the gathered windows below are on the device as without it. The
    # gradient shards follow them (copied to the host after each reduce-scatter, the device's
    # copy freed), the optimizer state and its step too (`host_state`).
    op = k.offload_params
    on_device = 1.0 - op
    offloaded_params = op * params_bytes
    params_bytes = on_device * params_bytes

    # (a vocabulary-parallel table whose gradient is the whole table, ``embed_grad_whole_tp``:
    # the rest of it, beside the device's share; a runtime that shards gradients over the
    # data-parallel group, ZeRO-2/3, reduce-scatters it into the shard at the backward's end.
    # A table tied to the head on this stage sums the head's row-sharded contribution into
    # it, and DTensor's sum of a Shard(0) and a Partial gradient is Shard(0): its .grad is
    # the device's rows, the whole table only a temporary of the embedding's backward; torch
    # v2.13, the torch tier's tied tensor-parallel steps)
    whole_tp = (first * (1 - lora) * n["rt_embed_grad_whole_tp"] * (1.0 - vocab_rep)
                * n["embed_grad_tp"])
    tied_here = n["tied"] * logits_mb
    embed_whole = whole_tp * (1.0 - tied_here) * (1.0 - 1.0 / k.tp) * (1.0 - f_grad)
    trainable = lora * layers * lora_tp + (1 - lora) * dense_params
    trainable_expert = (1 - lora) * expert_params
    trainable_layer = lora * lora_tp + (1 - lora) * per_layer
    trainable_layer_expert = (1 - lora) * expert_layer_params(k, n)

    # --- optimizer state (+ fp32 master weights), maybe offloaded to the host ---
    # (a runtime whose ZeRO optimizer keeps a float32 partition of the parameters even when
    # they are float32 themselves, ``zero_fp32_partition``: DeepSpeed's)
    zero_any = 1.0 - k.zero[..., 0]
    master = jnp.maximum(n["master_bytes"], n["rt_zero_fp32_partition"] * zero_any * 4.0)
    opt_per_param = master + n["opt_bytes"]
    # (the device's share of the trainable elements, as its optimizer state splits them)
    state_elems = zero_shard(f_opt, trainable, trainable_expert, k)
    opt_device = state_elems * opt_per_param
    # (on the host: offloaded alone, ``offload_optimizer``, or with the parameters)
    host_state = k.offload + op - k.offload * op
    optimizer_bytes = opt_device * (1.0 - host_state)
    # A paged optimizer (bitsandbytes, ``opt_paged``: the share of the state in CUDA managed
    # memory) holds that state outside the caching allocator: the driver moves its pages to
    # host memory when an allocation needs the room and back for each parameter's update, so
    # it is in no phase's live set (what could run out) and priced in time where it does not
    # fit beside them (`capopt.cost.time`)
    paged_bytes = state_elems * n["opt_bytes"] * (1.0 - host_state) * n["opt_paged"]
    optimizer_bytes = optimizer_bytes - paged_bytes

    # --- gradients ---
    # One block's gradients on this device, all of them, and the embedding table's
    # (a dense scatter-add target in the gradient dtype, created before the backward pass;
    # the head's gradient lands in it when tied). ZeRO-2/3 keep a 1/dp slice.
    gb = n["grad_bytes"]
    # (a gradient before its ZeRO-2/3 reduce-scatter is in its unsharded parameter's dtype:
    # the compute dtype under FSDP's mixed precision, ``fsdp_mixed_precision``)
    ugb = gb + n["rt_fsdp_mixed_precision"] * f_grad * (compute_weight_bytes(n) - gb)
    # (the block and head gradients as held, waiting for a collective and by the update,
    # `held_grad_bytes`; the accumulator and the embedding's table in ``gb``)
    ghb = held_grad_bytes(n)
    # (the shards a step keeps: on the host under parameter offload)
    grad_layer = zero_shard(f_grad, trainable_layer, trainable_layer_expert, k) * ghb * on_device
    grads_all = (zero_shard(f_grad, trainable, trainable_expert, k) + embed_whole) * gb
    offloaded_grads = op * grads_all
    grads_all = on_device * grads_all
    accumulating = step_at_least(k.grad_accum, 2.0)
    # (under accumulation the embedding's accumulator is that buffer, counted in ``accum``)
    # (the dense gradient itself is the whole table: ZeRO splits it only once reduced)
    embed_elems = first * (1 - lora) * (n["embed_grad_tp"] * vocab_share + n["embed_grad_rep"])
    embed_full = embed_elems * ugb
    # (the word embeddings' share: a tied head's contribution is added to it alone)
    word_full = first * (1 - lora) * n["embed_grad_tp"] * vocab_share * ugb
    # (the same whole table under ZeRO-2/3, ``embed_grad_whole_tp``: reduced by the root
    # group's post-backward, so live through the embedding's backward beside the rank's rows;
    # a tied table's whole one too, a temporary until its sum with the head's rows)
    word_partial = (whole_tp * step_at_least(k.tp, 2.0) * (f_grad + (1.0 - f_grad) * tied_here)
                    * ugb)
    # (the buffer kept to the update is the reduce-scattered slice, in the gradient dtype)
    embed_table = embed_elems * shard(f_grad, dp) * gb * on_device
    embed_live = embed_table * (1.0 - accumulating * n["rt_accum_buffer"])
    embed_grad = embed_live * n["rt_embed_grad_early"]
    # (a tied head's weight gradient as a buffer of its own, ``tied_head_grad_own``: the
    # head dot's output, summed into the table's only at the embedding's backward)
    own_tied = n["rt_tied_head_grad_own"] * n["tied"] * n["P_embed_tp"]
    head_grad = logits_mb * (1 - lora) * ((n["P_head_tp"] + own_tied) * vocab_share
                                          + n["P_head_rep"]) * shard(f_grad, dp) * ghb * on_device
    # every gradient must stay live to the end of the backward pass: clipping's global norm,
    # a runtime that keeps .grad; accumulation keeps the accumulator instead (counted apart)
    fused = n["rt_grads_fused"]
    keep_all = 1.0 - fused * (1.0 - n["grad_clip"])
    keep_all = keep_all * (1.0 - fused * accumulating)     # XLA adds into the accumulator
    # (an optimizer stepped in the backward pass, ``opt_in_bwd``, frees each gradient once its
    # parameter is stepped: none is kept)
    oib = n["opt_in_bwd"]
    keep_all = keep_all * (1.0 - oib)
    accum = accumulating * n["rt_accum_buffer"] * grads_all
    # a runtime whose .grad is the accumulator (no buffer of its own, gradients kept): from
    # the second micro-batch on, every gradient is live in every phase
    in_grad = accumulating * (1.0 - n["rt_accum_buffer"]) * (1.0 - fused) * grads_all
    # Data parallelism: a runtime that combines the gradients' collectives (XLA's all-reduce
    # and reduce-scatter combiners, ``grad_combine_bytes`` per collective) keeps each gradient
    # (before its reduce-scatter: unsharded) until its group's collective runs. An all-reduce
    # group (the share not ZeRO-sharded) is at most that many bytes and runs on one flat
    # buffer it is copied into (``grad_combine_copy``); a reduce-scatter group (the ZeRO-2/3
    # share, ``f_grad``) counts its output, the shard, against the threshold, so it takes up
    # to dp times as many unsharded bytes, and runs on the gradients themselves: at its end
    # its output shards are live beside them (jaxlib 0.10.2, the optimized HLO of every
    # multi-device step of the random draw: 272 reduce-scatters over the gradients as they
    # are, none on a concatenation; the all-reduces on concatenations).
    # (the embedding's gradient, its scatter-add's float32 table, reduced in that dtype)
    embed_wider = (gb - ghb) * embed_elems
    unsharded_all = zero_shard(0.0, trainable, trainable_expert, k) * ghb + embed_wider
    multi_dp = step_at_least(dp, 2.0)
    combine = n["rt_grad_combine_bytes"]
    # The reduce-scatter group waiting at the backward pass's end holds every gradient, the
    # head's too, combined with the blocks' (rand0-111: its f32[56, 997] shard in the one
    # reduce-scatter). Blocks run in a scan (``scan_grad_stacks``) reduce-scatter theirs
    # inside the loop, a block at a time, into stacks of shards (``scan_grad_zero3_copies``),
    # where the head's, produced before the loop, cannot join them: none is left to wait.
    # (one block's trainable elements, unsharded)
    layer_unsharded = zero_shard(0.0, trainable_layer, trainable_layer_expert, k)
    waiting = (1.0 - jnp.clip(n["rt_scan_grad_stacks"], 0.0, 1.0)) * unsharded_all
    ar_group = jnp.minimum(unsharded_all, combine)
    rs_group = jnp.minimum(waiting, combine * dp)
    pending = multi_dp * ((1.0 - f_grad) * ar_group + f_grad * rs_group)
    # (while the bottom block is differentiated, what the head and the blocks above it have
    # produced: not its own gradients nor the embedding's table, both counted apart there)
    above = unsharded_all - layer_unsharded * ghb - embed_elems * gb
    pending_bottom = jnp.minimum(pending, multi_dp * jnp.maximum(above, 0.0))
    flat = multi_dp * ((1.0 - f_grad) * n["rt_grad_combine_copy"] * ar_group
                       + f_grad * rs_group / dp)
    # Sequence parallelism: a parameter replicated over tp and applied on the rank's slice of
    # the sequence (the norms, the row-parallel outputs' biases, the position embeddings, a
    # vocabulary table tp does not divide: `tp_replication`) has a partial gradient on each
    # rank, all-reduced over the tensor axis. The same combiners and contiguous pass run it:
    # one flat copy of a group, the reduced gradients sliced out of it for the update
    # (rand0-156, tp 4 sp, float32: f32[1808000] = the 10007 x 128 table, the 4096 x 128
    # positions and 2816 norm and bias elements, beside the table and the positions sliced
    # out). Without ZeRO the data-parallel all-reduce is the same collective over both axes,
    # its flat copy counted above.
    rep_grad = (1 - lora) * ((layers * n["P_layer_rep"] + first * n["P_embed_rep"]
                              + logits_mb * (n["P_head_rep"] + vocab_rep * n["P_head_tp"]))
                             * ghb
                             + vocab_rep * first * n["P_embed_tp"] * gb)
    flat_tp = (k.sp * step_at_least(k.tp, 2.0) * n["rt_grad_combine_copy"]
               * (1.0 - multi_dp * (1.0 - f_grad)) * jnp.minimum(rep_grad, combine))

    # --- activations of one micro-batch ---
    tokens = rank_sequences(k) * n["s"]
    inv = block_inventory(k, n)
    a_none, a_sel, a_full = saved_bytes(k, n, tokens, inv)
    w_none, w_sel, w_full = k.remat[0], k.remat[1], k.remat[2]
    # Activation offloading (``act_offload``): what a block saves goes to host memory in
    # the forward pass and comes back node by node in the backward pass, each node's tensors
    # freed once the next node has run: of the block under backward the larger of its MLP's
    # and its attention's saved sets is on the device (`offload_window`). A recomputed
    # block's checkpoint saves its input through the same hooks (torch v2.13 non-reentrant
    # checkpoint: _NoopSaveInputs, before its own hooks are pushed), offloaded too and
    # brought back for the rebuild; what a selective policy keeps stays in the checkpoint's
    # own store, on the device.
    ao = n["act_offload"]
    window, window_mlp, window_attn = offload_window(k, n, tokens, inv)
    kept_sel = a_sel - ao * a_full
    per_block = (1.0 - ao) * (w_none * a_none + w_full * a_full) + w_sel * kept_sel
    # (a block's backward transients at each point where its backward can peak; the largest
    # beside what it saved is the rule without the gradients' order)
    points = backward_transient_points(k, n, tokens)
    transient = points["largest"] + points["stream"]
    rebuilt_sel = jnp.maximum(a_none - a_sel, 0.0) * n["rt_rebuild_fraction"]
    rebuilt_full = jnp.maximum(a_none - a_full, 0.0) * n["rt_rebuild_fraction"]
    rep_div = shard(k.sp, k.tp)
    # the stage's input edge, kept for every micro-batch in flight on the first stage
    edge = tokens * (stream_bytes(n) + n["hidden_dropout"]) * n["h"] * rep_div
    # (an MLP stack's first layer reads the batch itself, an argument in the compute dtype:
    # no stage input of its own; with tp > 1 and accumulation XLA hoists a transposed copy
    # of every micro-batch's inputs out of the loop and slices one a micro-batch: rand0-124,
    # tp 4, accumulation 2: bf16[512, 2, 2, 512] and a [1, 2, 512, 512] slice)
    batch_copies = (step_at_least(k.tp, 2.0) * step_at_least(k.grad_accum, 2.0)
                    * (k.grad_accum + 1.0))
    edge = jnp.where(n["mlp"] > 0, batch_copies * tokens * n["act_bytes"] * n["h"], edge)
    edge_bytes = edge * (first * edge_in_flight + (1.0 - first))
    # (offloaded, it is on the host but while the first block is differentiated)
    edge_kept = (1.0 - ao) * edge_bytes
    # Recomputing a fraction of the blocks recomputes the first ones (Megatron's "block"
    # method, the validation step's `remat_plan`): the top block is a stored one whenever a
    # block is stored, the bottom block a recomputed one whenever a block is recomputed.
    # (Exact at whole blocks, smooth between for the relaxation.)
    w_rec = jnp.maximum(w_sel + w_full, 1e-6)
    remat_share = jnp.minimum(1.0, (w_sel + w_full) * layers)       # 1 if any block rebuilds
    # LoRA: the first stage's first block keeps nothing from before its first adapter (each
    # micro-batch in flight there); stored or rebuilt, as the block's policy says (the
    # first blocks are the recomputed ones)
    u_none, u_sel, _ = first_block_unsaved(k, n, tokens, inv)
    unsaved_rebuilt = first * remat_share * (w_sel / w_rec) * u_sel
    unsaved = first * (1.0 - remat_share) * (1.0 - ao) * u_none + unsaved_rebuilt
    stored = layers * per_block * in_flight - unsaved * edge_in_flight
    # the block under backward is its own micro-batch's: what it adds on top of the stored
    top_stored = jnp.minimum(1.0, w_none * layers)                  # 1 if any block is stored
    own_rec = (w_sel * (rebuilt_sel + transient) + w_full * (rebuilt_full + transient)) / w_rec
    top_own = (top_stored * (transient + ao * window)
               + (1.0 - top_stored) * (own_rec + ao * a_full))
    rebuild_own = own_rec * remat_share
    stored_remat = (layers * (w_sel * kept_sel + (1.0 - ao) * w_full * a_full) * in_flight
                    - unsaved_rebuilt * edge_in_flight
                    + ao * remat_share * a_full)          # (the input brought back)
    bottom_own = ((1.0 - remat_share) * ((1.0 - ao) * a_none + ao * window + transient)
                  + remat_share * ((w_sel * a_sel + w_full * a_full) / w_rec + own_rec))

    # --- logits and the loss (the stage with the head) ---
    # The loss's gradient in float32 (``logits_fp32_copies``) beside a compute-dtype
    # logits-sized buffer (``logits_act_copies``: the logits it is computed from, then its
    # cast for the head's backward matmul), split over tp by a vocabulary-parallel head, or by
    # sequence parallelism (the head then runs on the device's slice of the sequence).
    # In 16-bit, a vocabulary that is not a multiple of 16 is padded to one for the head's
    # backward GEMM: ``logits_pad_copies`` more compute-dtype copies while the cast is padded
    # (in float32 the padded copy takes the place of the second float32 buffer).
    # A head split over the vocabulary (tp > 1) computes the loss vocabulary-parallel, with
    # ``logits_parallel_extra_copies`` more float32 buffers (its own fused backward).
    lowp = (n["act_bytes"] < 4.0).astype(jnp.result_type(float))
    fp32_copies, act_copies, pad_copies, parallel_extra = loss_copies(n)
    vocab_split = n["logit_tp"] * (1.0 - vocab_rep)
    parallel_loss = vocab_split * step_at_least(k.tp, 2.0)
    split = jnp.maximum(vocab_split, n["logit_tp"] * k.sp * n["rt_logits_follow_sp"])
    logit_div = split * k.tp + (1.0 - split)
    # (the device's logits: its share of the vocabulary, over its rows of the sequence)
    vocab_div = vocab_split * k.tp + (1.0 - vocab_split)
    head_rows = rank_sequences(k) * n["s"] * vocab_div / logit_div
    head_vocab = n["logit_elems_per_seq"] / n["s"] / vocab_div
    # (``padded``: 1 where the runtime pads the split GEMM's K, an unaligned vocabulary)
    padded = (n["vocab_unaligned"] * jnp.minimum(pad_copies, 1.0)
              * head_grad_split(n, head_rows, head_vocab))
    pad = lowp * padded * pad_copies
    per_elem = ((fp32_copies + parallel_loss * parallel_extra) * 4.0
                + (act_copies + pad) * n["act_bytes"])
    logit_elems = logits_mb * rank_sequences(k) * n["logit_elems_per_seq"] / logit_div
    logits_bytes = logit_elems * per_elem
    # The split GEMM itself pads both of its operands along K: beside the padded logits
    # gradient (compute dtype; the softmax's float32 buffers freed by then) it reads a padded
    # copy of the device's head, [vocabulary, h] in the compute dtype (cast in the pad), made
    # just before it (rand0-184 bf16: bf16[12416, 768] beside bf16[128, 12416]; rand0-062
    # float32: f32[32128, 384] beside f32[256, 32128]; rand0-199: f32[20096, 384]). Where few
    # rows meet a wide vocabulary that copy outweighs the logits-sized buffers. In float32,
    # with the head trained, the unpadded float32 gradient is still live there too: the pad
    # reads it as it is (no cast between) and the head's weight-gradient GEMM reads it as
    # well (rand0-173, f32: f32[4, 512, 32001] beside f32[2048, 32016] and f32[320, 32016];
    # in 16-bit the cast the weight-gradient GEMM reads is gone by then, rand0-172 bf16:
    # bf16[320, 32256] and bf16[128, 32256] alone; under LoRA no GEMM reads it, rand0-062).
    head_gemm = padded * (n["act_bytes"] * (logit_elems + head_vocab * n["h"])
                          + (1.0 - lowp) * (1.0 - lora) * 4.0 * logit_elems)
    logits_bytes = jnp.maximum(logits_bytes, head_gemm)
    # A fused linear cross-entropy (``loss = "fused-linear"``, tp = 1) holds one chunk of
    # logits in the compute dtype, its gradient written in place, beside the head's input
    # gradient, allocated whole (zeros_like of the input, its stream dtype) and saved for the
    # backward pass, and a float32 loss per token (Liger at ead96b6,
    # fused_linear_cross_entropy_forward); the head's weight gradient, written there too, is
    # counted with the gradients.
    fl = n["loss_fused_linear"]
    fl_logits = logits_mb * (fused_linear_chunk(n, tokens) * n["V"] * n["act_bytes"]
                             + tokens * (n["h"] * stream_bytes(n) + 4.0))
    logits_bytes = (1.0 - fl) * logits_bytes + fl * fl_logits
    # The chunked loss (``loss = "chunked"``, tp = 1): of its slices' float32
    # log-probabilities, all saved, the largest of: the first slice's backward (`loss_copies`:
    # its nll_loss gradient and log_softmax backward's result beside all of them), the second
    # slice's (the first slice's freed, its head weight gradient held) and the second slice's
    # head backward (two freed; its weight gradient, the one held and their sum: autograd
    # accumulates a gradient used twice out of place, three head-sized buffers in the
    # matmul's dtype; the torch tier's live set at the peak of a float32 8191-entry head)
    ch, n_slices = n["loss_chunked"], n["loss_chunks"]
    slice_fp32 = logit_elems * 4.0 / n_slices
    head_wgrad = (logits_mb * (1 - n["lora"]) * (n["P_head_tp"] + n["tied"] * n["P_embed_tp"])
                  * vocab_share * n["act_bytes"])
    ch_logits = jnp.maximum(logits_bytes, jnp.maximum(
        slice_fp32 * (n_slices + 1.0) + head_wgrad, slice_fp32 * (n_slices - 2.0)
        + 3.0 * head_wgrad))
    logits_bytes = (1.0 - ch) * logits_bytes + ch * ch_logits
    # the final norm's input and output (the head's input) at the loss
    # (under autocast: the norm's input in the stream's dtype, the head's cast of its output;
    # under the fused linear cross-entropy, run inside the forward pass, the output itself,
    # in the stream's dtype, each chunk cast as the matmul reads it)
    head_out = (1.0 - fl) * n["act_bytes"] + fl * stream_bytes(n)
    # (offloaded, the norm's saved input is on the host by the loss's backward: the head's
    # own saved input, under its no-op context, stays)
    head_acts = (logits_mb * tokens * ((1.0 - ao) * stream_bytes(n) + head_out) * n["h"] * rep_div
                 * (1.0 - n["mlp"]))

    # --- weight casts to the compute dtype (a matmul's operand) ---
    # A stored block keeps its casts for the backward pass, a recomputed block casts again
    # when it is rebuilt (one block's worth); the head's cast is live at the loss; the
    # embedding table is read by a gather, never cast whole.
    # (autocast casts the weight the module holds: under ZeRO-3 / FSDP the gathered one)
    cast_share = n["rt_autocast_casts"] + (1.0 - n["rt_autocast_casts"]) * shard(f_param, dp)
    wcf = n["weight_copy_bytes"] * n["rt_weight_copy_fraction"]
    wcb = wcf * (1 - lora)
    # under LoRA the frozen model is in the compute dtype already; autocast casts the
    # adapters (float32) instead
    lora_casts = lora * n["rt_autocast_casts"] * lora_tp
    # A quantised (8- or 4-bit) base is dequantised to the compute dtype before its matmuls,
    # whole; a runtime whose backward pass reads the forward's copies (``lora_dequant`` and
    # not ``lora_dequant_in_backward``) keeps them as it keeps a stored block's casts, and a
    # rebuilt block dequantises again (XLA: the forward's and the backward's dequantisations
    # are one value; Llama-2-7B shape, 4 blocks, 4- and 8-bit bases, remat none: every
    # block's bf16[45088768] gate/up/down and q/k/v/o copies live at the loss)
    dequant_kept = (lora * n["base_quantised"] * n["rt_lora_dequant"]
                    * (1.0 - n["rt_lora_dequant_in_backward"]))
    dequant_layer = dequant_kept * wrapped_base_per_device(k, n) * n["act_bytes"]
    cast_layer = wcf * ((1 - lora) * per_layer + lora_casts) * cast_share + dequant_layer
    cast_head = logits_mb * wcb * cast_share * (
        n["P_head_tp"] + n["tied"] * n["P_embed_tp"]) * vocab_share
    # (offloaded with the activations, a stored block's casts come back with its window)
    casts_kept = layers * w_none * cast_layer
    casts_stored = (1.0 - ao) * casts_kept + ao * jnp.minimum(casts_kept, cast_layer)
    casts_rebuilt = (w_sel + w_full) * cast_layer
    # a runtime that caches every cast for the whole forward pass (``autocast_weight_cache``)
    casts_cached = jnp.maximum(casts_kept, n["rt_autocast_weight_cache"] * layers * cast_layer)

    # --- ZeRO-3 gathered weights ---
    # Whole blocks gathered for compute (the layer in use plus prefetch): an all-gather's
    # output is world size x shard elements, a buffer of its own beside the device's shard
    # (counted in params_bytes). A runtime that gathers module by module
    # bounds the gathered parameters instead: DeepSpeed stops prefetching once
    # ``zero3_max_live_params`` elements are resident (stage3_max_live_parameters) but always
    # fetches the module about to run. XLA (``zero3_keeps_stored_gathered`` = 1) gathers the
    # weights cast to the compute dtype, and a block that is not recomputed keeps them for its
    # backward pass.
    in_use = jnp.minimum(n["rt_zero3_prefetch_layers"], layers)
    keep = n["rt_zero3_keeps_stored_gathered"]
    gather_param = gathered_param_bytes(n)
    gather_bytes = (1.0 - keep) * gather_param + keep * compute_weight_bytes(n)
    expert_layer = expert_layer_params(k, n)
    gathered_layer = ((per_layer - expert_layer) * step_at_least(dp, 2.0)
                      + expert_layer * step_at_least(edp, 2.0))
    bounded = (n["rt_zero3_max_live_params"] + largest_module(k, n)) * step_at_least(dp, 2.0)
    gather_window = f_param * jnp.minimum(in_use * gathered_layer, bounded) * gather_bytes
    # (FSDP2 prefetches the next group in the backward pass; below the bottom block it is
    # the root, gathered already: the bottom block's backward has no block prefetched)
    in_bottom = in_use - n["rt_zero3_root_group"] * jnp.clip(in_use - 1.0, 0.0, 1.0)
    gather_bottom = f_param * jnp.minimum(in_bottom * gathered_layer, bounded) * gather_bytes
    gather_stored = f_param * keep * layers * w_none * gathered_layer * gather_bytes
    gathered = jnp.maximum(gather_window, gather_stored)
    # FSDP-style groups (``zero3_root_group``): the embeddings, final norm and head are one
    # group; under ZeRO-3 it is gathered whole from the forward pass to the end of the
    # backward pass. Under ZeRO-2/3 its unsharded gradient lives from the head's backward to
    # the end, and each block's unsharded gradients sit beside their flat reduce-scatter
    # input (``zero_unsharded_grad_copies``) while the block is differentiated.
    root = n["rt_zero3_root_group"] * multi_dp * extra_params
    root_gathered = f_param * root * gather_param
    # (through the backward pass the root's unsharded gradient is the head's: a tied table's
    # contribution, or the head's own weights; the embedding's comes at the end)
    head_share = (n["P_head_tp"] + n["tied"] * n["P_embed_tp"]) * vocab_share + n["P_head_rep"]
    # (the root's gradient reduce-scattered every micro-batch: accumulated in its shard)
    root_sharded = f_grad * n["rt_zero3_root_group"] * multi_dp
    root_grad = root_sharded * (1 - lora) * logits_mb * head_share * ugb
    block_unsharded = f_grad * n["rt_zero_unsharded_grad_copies"] * layer_unsharded * ugb
    buckets = step_at_least(dp, 2.0) * n["rt_comm_bucket_bytes"]
    # (DeepSpeed's ZeRO gradient bucket, ``zero_bucket_elements`` in the gradient dtype,
    # allocated at a backward pass's first gradient and freed by the reduction epilogue:
    # ZeRO-2's after every backward pass, ZeRO-1's at the accumulation boundary only, so
    # under accumulation it is live through the later micro-batches' forward passes too;
    # ZeRO-3's allocated once, in every phase)
    z_bucket = n["rt_zero_bucket_elements"] * gb
    bwd_bucket = (k.zero[..., 1] + k.zero[..., 2]) * z_bucket
    acc_bucket = k.zero[..., 1] * step_at_least(k.grad_accum, 2.0) * z_bucket
    buckets = buckets + k.zero[..., 3] * z_bucket
    p2p = step_at_least(k.pp, 2.0) * 2.0 * tokens * n["h"] * n["act_bytes"] * rep_div
    comm_bytes = gathered + buckets + p2p + root_gathered
    # A runtime that gathers along a tensor's major dimension (``zero3_loop_layout_copies``,
    # XLA GPU) transposes each ZeRO-3 shard split on its minor one before its all-gather;
    # inside the micro-batch loop the copy of that loop-invariant parameter is hoisted out
    # and held through the loop: every such shard of the stage's blocks, in the parameter's
    # dtype, in every phase but the update (`minor_sharded_groups`: at tp = 1 the kernels
    # wider than their input, at tp > 1 the row-parallel ones)
    tp_split = step_at_least(k.tp, 2.0)
    minor = (1.0 - tp_split) * n["P_minor_tp1"] + tp_split * n["P_minor_row"] / k.tp
    loop_copies = (n["rt_zero3_loop_layout_copies"] * f_param * multi_dp * accumulating
                   * (1 - lora) * layers * minor / dp * n["param_bytes"])

    # ZeRO-2 as FSDP2 runs it (``zero2_keeps_shards``): the parameters stay sharded, and each
    # group's unsharded copy, gathered for its forward pass, is kept to its backward pass
    # beside them (counted as the parameters above): the shards are the extra, until the
    # backward pass reshards each group after its own backward (FSDP2's post-backward; not
    # under a pipeline schedule without per-micro-batch sync): at the bottom block's
    # backward the blocks above are resharded (``z2_above``), at the embedding's every block
    # (``z2_blocks``), after the backward pass the root too (``z2_root``)
    z2_shards = (n["rt_zero2_keeps_shards"] * z2_kept * (1 - lora)
                 * zero_shard(1.0, dense_params, expert_params, k) * n["param_bytes"])
    z2_synced = k.zero[..., 2] * (1.0 - pp_nosync(k, n))    # (ZeRO-2, reduced every micro-batch)
    z2_resharded = n["rt_zero2_keeps_shards"] * z2_synced * (1 - lora) * gather_param
    # (one block's parameters whole, as a gather of it holds them)
    layer_whole = zero_shard(0.0, per_layer, expert_layer, k)
    z2_block = z2_resharded * layer_whole
    z2_above = jnp.maximum(layers - 1.0, 0.0) * z2_block
    z2_blocks = layers * z2_block
    z2_root = z2_resharded * extra_params

    # FSDP2's forward pass keeps the last group's all-gather output (its ``AllGatherState``,
    # to overlap that group's copy-out with the next all-gather; torch v2.13
    # _fsdp_param_group.py wait_for_unshard) until the next group's copy-out, the last of
    # them until the root's post-forward (_fsdp_state.py _post_forward): at the forward
    # pass's end the top block's flat output is live (``zero_holds_gather_output``)
    fwd_flat = (n["rt_zero_holds_gather_output"] * multi_dp * (1 - lora)
                * (k.zero[..., 2] + k.zero[..., 3]) * layer_whole * gather_param
                * step_at_least(layers, 1.0))

    # --- the phases ---
    # gradients live in each phase: the accumulator always (under accumulation), the head's
    # once the loss is differentiated, the stored blocks' as the backward pass reaches the
    # bottom (when they must all stay live), one block's while it is differentiated
    above_bottom = jnp.maximum(layers - 1.0, 0.0) * grad_layer
    stored_share = jnp.where(layers > 0, w_none, 0.0)
    # (an FSDP root's gradient is its unsharded one, ``root_grad``, until the root's
    # reduce-scatter after the embedding's backward: no shard of it in the backward pass)
    head_kept = head_grad * (1.0 - root_sharded)
    kept_bottom = keep_all * (head_kept + above_bottom)
    kept_rebuild = keep_all * (head_kept + layers * stored_share * grad_layer)
    dp_bwd = root_grad + block_unsharded       # (FSDP groups' unsharded gradients)
    # (the block under differentiation's own gradients: its unsharded ones where FSDP keeps
    # them, the shard coming only from their reduce-scatter, after its backward)
    grad_own = grad_layer * (1.0 - n["rt_zero_unsharded_grad_copies"] * f_grad)
    # Within a block's backward pass (top, rebuild, bottom) its own part is the largest of
    # its points, each transient beside the gradients produced by then: node by node in an
    # eager backward (``block_grads_in_order``: at the MLP's peak down's alone, at the
    # attention core's the MLP's and the output projection's, `backward_grad_shares`), none
    # at a rebuild's input cast, all of them at the backward's end, where the block's own
    # saved (or rebuilt) activations are freed; otherwise every transient beside the whole
    # block's gradients. `own_split` gives what the chosen point changes, activations and
    # gradients, against the largest transient beside every gradient of the block.
    block_grads = grad_own + block_unsharded
    order = n["rt_block_grads_in_order"]
    largest_t = points["largest"]
    # (offloaded, a stored block's own saved tensors at a point are its window there, the
    # MLP's or the attention's set, not the whole block's: at the attention's, the copies
    # downstream of a materialised softmax are freed by then only when dropout's node lies
    # between (two nodes back), and probabilities both the softmax and the P V matmul save
    # come back once for each; at a GELU MLP's, down's input, freed by its own node when
    # kept, is the previous node's, held beside the gradients it becomes (a gated MLP's
    # four saved tensors are never back at once: three and three gradients at its mul and
    # silu nodes, its window's four and its two net gradients). A recomputed block's are
    # rebuilt on the device: per phase, top, rebuild and bottom, the stored share of the
    # block under backward)
    stored_here = ao * jnp.stack(jnp.broadcast_arrays(top_stored, 0.0 * top_stored,
                                                      1.0 - remat_share))
    points = {**points,
              "mlp": points["mlp"] + stored_here * (
                  window_mlp - window
                  + (1.0 - n["gated"]) * tokens * n["act_bytes"] * mlp_width(n) / k.tp),
              "attention": points["attention"] + stored_here * (
                  points["attention_released_mlp"] + window_attn - window
                  + (1.0 - n["attn_dropout"]) * points["attention_released_post"]
                  + points["attention_probs_shared"])}

    # (at the MLP's point the residual stream's gradient is the block's incoming one alone:
    # the branch's gradient to the MLP's input comes after its nodes; half of ``stream``)
    def own_split(own_saved):
        at = [(points["mlp"] - order * 0.5 * points["stream"],
               1.0 - order * (1.0 - n["grad_share_mlp"])),
              (points["attention"], 1.0 - order * (1.0 - n["grad_share_attn"])),
              (points["input_cast"], 1.0 - order),
              (order * -own_saved + (1.0 - order) * largest_t, 1.0)]
        values = [t + g * block_grads for t, g in at]
        best = jnp.maximum(jnp.maximum(values[0], values[1]), jnp.maximum(values[2], values[3]))
        chosen_t, chosen_g = at[-1]
        for (t, g), v in reversed(list(zip(at[:-1], values[:-1]))):
            chosen_t = jnp.where(v >= best, t, chosen_t)
            chosen_g = jnp.where(v >= best, g, chosen_g)
        return chosen_t - largest_t, (chosen_g - 1.0) * block_grads

    # (the block's own activations: stored whole, or its checkpoint and what is rebuilt; the
    # three phases' on a leading axis, split once)
    own_remat = (w_sel * (a_sel + rebuilt_sel) + w_full * (a_full + rebuilt_full)) / w_rec
    # (offloaded, a stored block's own on the device is its window)
    own_none = (1.0 - ao) * a_none + ao * window
    own_acts, own_grads = own_split(jnp.stack(jnp.broadcast_arrays(
        top_stored * own_none + (1.0 - top_stored) * own_remat, own_remat,
        (1.0 - remat_share) * own_none + remat_share * own_remat)))
    acts_top, acts_rebuild, acts_bottom = own_acts
    grads_top, grads_rebuild, grads_bottom = own_grads
    # A group's flat reduce-scatter input, in the reduce dtype (float32 under FSDP's mixed
    # precision), held until the next group's reduction starts (``zero_holds_reduce_input``,
    # FSDP2's ReduceScatterState): the block above's through a block's backward, the bottom
    # block's through the embedding's. The top and rebuild phases are the top block's, with
    # nothing held; under ZeRO-3 the block below it, with the top block's input held and its
    # own neighbour prefetched, holds more where that input outweighs one block's stored
    # activations (and weight casts), freed by then; under ZeRO-2 the block below the top
    # holds the top block's input in place of that block's copy, resharded, so more only
    # where the reduce dtype is wider than the gathered one (float32 against bf16).
    held_reduce = n["rt_zero_holds_reduce_input"] * f_grad * layer_unsharded * gb
    held_above = step_at_least(layers, 2.0) * held_reduce
    held_mid = (step_at_least(layers, 3.0) * f_param * held_reduce
                + step_at_least(layers, 2.0) * jnp.maximum(z2_synced * held_reduce - z2_block,
                                                           0.0))
    per_stored = stored / jnp.maximum(layers, 1.0)
    per_stored_remat = stored_remat / jnp.maximum(layers, 1.0)
    held_top = jnp.maximum(held_mid - per_stored - w_none * cast_layer, 0.0)
    held_rebuild = jnp.maximum(held_mid - per_stored_remat, 0.0)
    # (the fused linear cross-entropy writes the head's weight gradient at the loss)
    at_loss = jnp.maximum(n["rt_head_grad_at_loss"], fl)
    # An optimizer that copies the gradients it updates (``update_flat_grad_copies``,
    # DeepSpeed's), bytes per element of the device's gradient share: without ZeRO
    # (FP16_Optimizer) each 16-bit gradient cast to float32 and those flattened, 8; ZeRO-1/2
    # first a float64 copy of the flat partition for its norm (8), then its float32 cast for
    # the master weights' .grad (4, none in fp32); ZeRO-3 a flat copy of each sub-group in
    # the gradient dtype and its float32 cast
    # Without ZeRO, a runtime that all-reduces the gradients in flat buckets of at most
    # ``allreduce_bucket_elements`` (DeepSpeed's engine, at the accumulation boundary) copies
    # one bucket's worth beside them at the backward pass's end.
    # (ZeRO-3 steps one sub-group of at most ``zero3_sub_group_elements`` at a time, where set)
    mixed = jnp.clip(n["master_bytes"], 0.0, 1.0)
    z0 = k.zero[..., 0]
    grad_share = state_elems
    sub = n["rt_zero3_sub_group_elements"]
    capped = jnp.where(sub > 0, jnp.minimum(grad_share, sub), grad_share)
    copied = grad_share + k.zero[..., 3] * (capped - grad_share)
    step_grad_copies = jnp.maximum(
        n["rt_update_flat_grad_copies"]
        * (z0 * mixed * 8.0 + (k.zero[..., 1] + k.zero[..., 2]) * jnp.maximum(8.0, mixed * 4.0)
           + k.zero[..., 3] * (gb + mixed * 4.0)) * copied,
        z0 * jnp.minimum(grad_share, n["rt_allreduce_bucket_elements"]) * gb)
    # (a runtime whose ZeRO-1 keeps only the device's partition of the gradients by the
    # update, ``zero1_step_grad_partition``: the rest are reduced and freed at the boundary)
    f_step = f_grad + k.zero[..., 1] * n["rt_zero1_step_grad_partition"]
    grads_step = (zero_shard(f_step, trainable, trainable_expert, k) * ghb
                  + embed_wider * shard(f_step, dp) + embed_whole * gb) * on_device
    # stepped in the backward pass (``opt_in_bwd``), the update runs one tensor at a time:
    # the largest trainable tensor on the device (the vocabulary table or head on their
    # stages, else a block's largest matrix; LoRA: a block's adapters together, a bound)
    # with its gradient, the moments' temporaries on it
    one_tensor = jnp.maximum(jnp.maximum(
        first * (1 - lora) * n["P_embed_tp"] * vocab_share,
        logits_mb * (1 - lora) * n["P_head_tp"] * vocab_share),
        lora * lora_tp + (1 - lora) * largest_module(k, n)) * shard(f_opt, dp)
    update_temps = ((1.0 - oib) * state_elems
                    + oib * one_tensor)
    # (the fused linear cross-entropy's weight gradient: the head's matrix whole, a tied
    # table too, in its parameter's dtype, from the loss's forward pass on: at the loss and
    # when the backward pass regathers an FSDP root)
    fl_head_grad = (logits_mb * (1 - lora) * (n["P_head_tp"] + n["tied"] * n["P_embed_tp"])
                    * vocab_share * ugb)
    # (a scan over the layers, ``scan_grad_stacks``: every block's gradient slice held in
    # stacks from the blocks' backward pass's start to its end, whatever is clipped; under
    # ZeRO-3, ``scan_grad_zero3_copies`` more)
    stacks = (n["rt_scan_grad_stacks"] + n["rt_scan_grad_zero3_copies"] * f_param
              * step_at_least(dp, 2.0)) * layers * grad_layer
    scanned = accum + stacks + grad_own + dp_bwd
    grads = {
        # (the head's gradient where it is produced, at the loss's backward or at the top
        # block's: kept, or, stepped in the backward pass, the tensor being stepped)
        "loss": accum + (1.0 - fl) * jnp.maximum(embed_grad + at_loss * jnp.maximum(
            keep_all, oib) * head_kept, in_grad)
                + fl * (jnp.maximum(embed_grad, in_grad) + fl_head_grad),
        "top": accum + jnp.maximum(embed_grad + jnp.maximum(keep_all, (1.0 - at_loss) * oib)
                                   * head_kept, in_grad) + grad_own + dp_bwd + held_top
               + grads_top,
        # (pending: only what the blocks above have produced, the stored ones)
        "rebuild": accum + grad_own + held_rebuild + jnp.maximum(embed_grad + jnp.maximum(
            kept_rebuild, jnp.minimum(pending, multi_dp * (head_grad + layers * stored_share
                                                           * grad_layer))), in_grad) + dp_bwd
                   + grads_rebuild,
        "bottom": accum + jnp.maximum(embed_grad + jnp.maximum(kept_bottom, pending_bottom),
                                      in_grad) + grad_own + dp_bwd + held_above + grads_bottom,
        # (without sharded gradients the embedding's scatter-add output is its gradient,
        # reduced in place and counted in ``grads_step``; ZeRO-2/3 reduce-scatter it into a
        # buffer of its own, the scatter-add's output beside it)
        # (an update fused into its gradient's producer is not fused into a scatter-add: a
        # table created at the embedding's backward is live at its update, kept or not, and
        # among the gradients a collective still holds)
        "update": (accum + jnp.maximum(jnp.maximum(
            keep_all * (grads_step + f_grad * embed_grad), pending),
            fused * (1.0 - keep_all) * (1.0 - n["rt_embed_grad_early"]) * embed_live)
                   + flat + flat_tp + on_device * oib * one_tensor * gb),
        "forward": accum + in_grad,
        "regather": accum + jnp.maximum(embed_grad, in_grad) + fl * fl_head_grad,
    }
    for p in ("top", "rebuild", "bottom"):
        grads[p] = jnp.where(n["rt_scan_grad_stacks"] > 0, jnp.maximum(grads[p], scanned),
                             grads[p])
    # every block's saved activations and the head's input: from the forward pass's end to
    # the loss's backward (the head's backward gathers an FSDP root again in between)
    at_head = stored + edge_kept + head_acts
    acts = {
        "loss": at_head,
        "top": stored + edge_kept + top_own + acts_top,
        "rebuild": stored_remat + edge_kept + rebuild_own + remat_share * acts_rebuild,
        "bottom": (edge_bytes + bottom_own + acts_bottom
                   + (in_flight - 1.0) * layers * per_block - unsaved * edge_in_flight),
        # after the blocks' backward pass, the larger of: the embedding's backward (a runtime
        # that writes its dense gradient last: the table's gradient, a tied head's waiting
        # contribution and their sum, or the addition into an accumulated .grad, which an
        # FSDP root reduce-scattered every micro-batch does not have: it accumulates its
        # shard; with FSDP groups, the root's gathered weights and unsharded gradient still
        # live) and an Adam
        # update's temporaries (torch's foreach path: the square root of every second moment
        # at once), on the device's share of the state
        "update": jnp.maximum(
            n["rt_embed_grad_last"] * (2.0 * n["tied"] * word_full
                                       + embed_full * accumulating * (1.0 - root_sharded)
                                       + root_gathered + root_grad + held_reduce + z2_root
                                       + word_partial
                                       + root_sharded * (embed_full - n["tied"] * word_full)),
            # (or the step's gradient copies, ``update_flat_grad_copies``: after the
            # backward pass, before the update; or, 8-bit Adam's update in a runtime that
            # copies a tensor's old moment codes while it writes the new ones,
            # ``quant_moment_copies``, the largest tensor's copies)
            # (none on the device where the step runs on the host, parameter offload)
            on_device * jnp.maximum(jnp.maximum(
                n["rt_adam_update_copies"] * n["adam"] * n["state_bytes"] * update_temps,
                step_grad_copies), n["rt_quant_moment_copies"] * n["adam8"] * one_tensor))
                  + 0.0 * stored,
        "forward": at_head,
        "regather": at_head,
    }
    # (at the forward pass's end: the head's output, one compute-dtype copy)
    # (the fused linear cross-entropy: none, it never holds them whole)
    # (the chunked loss, run at the forward pass's end, before an FSDP root's pre-backward
    # regather: every slice's float32 log-probabilities)
    # (a float32 loss inside the model's forward pass, ``loss_in_forward``: the logits, their
    # float32 upcast and log_softmax's saved output at once, beside every cast autocast has
    # cached; then, the region left, the logits converted to float32 beside the saved output
    # in the compute dtype's place: as many bytes. At the backward pass's start only the saved
    # output is left.)
    in_fwd = n["rt_loss_in_forward"] * (1.0 - fl - ch - n["loss_fused"])
    logits_fwd = ((1.0 - fl - ch) * n["act_bytes"] + ch * 4.0
                  + in_fwd * (4.0 * lowp + 4.0)) * logit_elems
    logits_start = logits_fwd - in_fwd * (n["act_bytes"] + 4.0 * lowp) * logit_elems
    # (offloaded, the loss's last saved tensor brought back, its log-probabilities in float32
    # or a fused kernel's logits, stays until the next offloaded node, past the head's
    # backward, whose own tensors were never offloaded)
    loss_back = (ao * (1.0 - fl) * logit_elems
                 * ((1.0 - n["loss_fused"]) * 4.0 + n["loss_fused"] * n["act_bytes"]))
    logits = {"loss": logits_bytes, "top": 0.0 * logits_bytes, "rebuild": 0.0 * logits_bytes,
              "bottom": 0.0 * logits_bytes, "update": 0.0 * logits_bytes,
              "forward": logits_fwd, "regather": logits_start + loss_back}
    # (autocast caches the cast of a leaf parameter, not of a view of one: the fused linear
    # cross-entropy's logits matmul reads ``weight.t()`` and casts the whole head again for
    # every chunk, a transient beside the cached cast; torch v2.13 autocast_mode.cpp
    # cached_cast)
    casts = {
        # (and it runs inside the forward pass's autocast region: every cast it cached is
        # still held)
        "loss": ((1.0 - fl) * casts_stored + fl * casts_cached
                 + cast_head * (1.0 + fl * n["rt_autocast_casts"])),
        "top": casts_stored + casts_rebuilt,
        "rebuild": casts_rebuilt,
        "bottom": jnp.minimum(casts_stored, cast_layer) + casts_rebuilt,
        "update": 0.0 * casts_stored,
        "forward": casts_cached + cast_head,
        # (the fused linear cross-entropy saves no cast for its backward pass: autocast's
        # cache is gone with the forward pass)
        "regather": casts_stored + (1.0 - fl) * cast_head,
    }
    # FSDP-style groups are gathered when the pass reaches them (pre-forward and pre-backward
    # hooks): at the forward pass's end only the root is; at the loss's backward no block is,
    # and the root only if it was not resharded after the forward pass (``regather``)
    fsdp = n["rt_zero3_root_group"]
    regather = n["rt_zero3_root_regather"]
    # (the fused linear cross-entropy runs inside the forward pass, before the root's
    # post-forward: what the forward pass's end holds)
    # (buffers held in every phase but the update: ZeRO-2's kept shards, XLA's hoisted
    # transposed shards)
    held = z2_shards + loop_copies
    comm_fwd = comm_bytes - fsdp * gathered + held + acc_bucket + fwd_flat
    comm = {
        # (a loss inside the forward pass, the chunked one or ``loss_in_forward``'s, is
        # differentiated after the root's pre-backward, which its output, the loss, sets
        # off: the root gathered again by then)
        "loss": (1.0 - fl) * (comm_bytes - fsdp * (gathered + (1.0 - ch - in_fwd) * regather
                                                   * root_gathered)
                              + held + acc_bucket) + fl * comm_fwd,
        "top": comm_bytes + held + bwd_bucket,
        "rebuild": gather_window + buckets + p2p + root_gathered + held + bwd_bucket,
        "bottom": gather_bottom + buckets + p2p + root_gathered + held + bwd_bucket,
        "update": buckets + 0.0 * comm_bytes,
        "forward": comm_fwd,
        # (the collective's flat output is the whole group, world size x shard, a buffer of
        # its own; the parameters copied out of it are counted as the gathered root is in
        # every phase)
        "regather": buckets + bwd_bucket + p2p + held + regather * fsdp * (
            root_gathered + f_param * extra_params * gather_param),
    }
    # (the rebuild phase exists only where a block is recomputed: weight 0 otherwise)
    exists = {"rebuild": remat_share}
    weight = _by_phase({p: exists.get(p, 1.0) + 0.0 * params_bytes for p in PHASES})
    terms = {"grads_bytes": _by_phase(grads), "activations_bytes": _by_phase(acts),
             "logits_bytes": _by_phase(logits), "comm_bytes": _by_phase(comm)}
    cast = _by_phase(casts)
    dynamic = sum(terms.values()) + cast
    terms["overhead_bytes"] = (n["rt_context_bytes"] + n["rt_workspace_bytes"] + cast
                               + n["rt_fragmentation"] * dynamic)
    # (the parameters held in each phase: ZeRO-2's unsharded copies resharded by then leave
    # them, not the dynamic buffers the allocator's fragmentation is counted on; after the
    # backward pass only the shards are left)
    released = {p: 0.0 for p in PHASES}
    released.update(bottom=z2_above, update=z2_blocks + z2_root - z2_shards)
    held_params = params_bytes - _by_phase(released)
    fixed = held_params + optimizer_bytes
    totals = weight * (fixed + sum(terms.values()))
    which = jnp.argmax(totals)
    w = weight[which]
    out = {key: w * v[which] for key, v in terms.items()}
    out["params_bytes"] = w * held_params[which]
    out["optimizer_bytes"] = w * optimizer_bytes
    out["total_bytes"] = totals[which]
    out["weight_copy_bytes"] = w * cast[which]
    # the three figures people compare: live tensors (allocated), what the caching allocator
    # holds (reserved: + fragmentation, + the cached slack it keeps while memory is not short
    # and gives back before failing, ``cached_slack``) and what the device needs (the total:
    # allocated + fragmentation + context, workspaces)
    frag = w * n["rt_fragmentation"] * dynamic[which]
    held = out["total_bytes"] - w * (n["rt_context_bytes"] + n["rt_workspace_bytes"])
    out["allocated_bytes"] = held - frag
    out["reserved_bytes"] = held + w * n["rt_cached_slack"] * dynamic[which]
    out["peak_phase"] = which.astype(totals.dtype)
    out.update({f"phase_{p}_bytes": totals[i] for i, p in enumerate(PHASES)})
    out.update({
        "host_optimizer_bytes": opt_device * host_state,
        # under parameter offload: the parameter shards copied to the device for each
        # all-gather, the gradient shards copied back after each reduce-scatter
        "offloaded_param_bytes": offloaded_params, "offloaded_grad_bytes": offloaded_grads,
        "paged_optimizer_bytes": paged_bytes,
        # what activation offloading copies to the host and back for each micro-batch: the
        # stored blocks' saved tensors and weight casts, the recomputed blocks' inputs
        "offloaded_activation_bytes": ao * layers * (w_none * (a_none + cast_layer)
                                                     + (w_sel + w_full) * a_full),
        "trainable_params": trainable, "device_params": dense_params,
        # one replica's gradients as the data-parallel collectives reduce them (unsharded, as
        # held: `held_grad_bytes`, the embedding's float32 table apart)
        "grads_reduced_bytes": unsharded_all,
        # every gradient on this device (ZeRO-2/3: its slice): the model states' gradients
        "grads_all_bytes": grads_all,
        # the trainable state's bytes on this device (ZeRO-3 splits it, experts over dp / ep)
        "trainable_bytes": (zero_shard(f_param, trainable, trainable_expert, k)
                            * n["param_bytes"] * on_device),
    })
    return out


def pipeline_in_flight(k: Knobs, p, rank):
    """Micro-batches' worth of activations of all a rank's blocks that pipeline rank ``rank``
    of ``p`` holds at its peak (the end of its warmup).

    1F1B (``vpp`` = 1): ``min(p - rank, m)`` micro-batches. Interleaved 1F1B (``vpp`` = v > 1,
    each rank v chunks of 1/v of its blocks) warms up with ``(v - 1) p + 2 (p - 1 - rank)``
    chunk forwards and holds one more before its first backward (Megatron-Core 0.16.1
    schedules.py ``get_pp_rank_microbatches``: warmup ``(pp - rank - 1) x 2 + (v - 1) x
    microbatch_group_size_per_vp_stage``, the group size pp; torch v2.13
    ``_get_warmup_ops`` with ``microbatches_per_round`` = pp), at most ``m v`` chunks: in
    units of the rank's whole blocks, that over v. Rank 0 holds ``p (1 + (p - 1) / (p v))``
    micro-batches at ``m >= p``: Korthikanti et al. 2022, sec. 4.2.3."""
    m = k.grad_accum
    v = jnp.maximum(k.vpp, 1.0)
    plain = jnp.minimum(p - rank, m)
    chunks = jnp.minimum((v - 1.0) * p + 2.0 * (p - 1.0 - rank) + 1.0, m * v)
    return jnp.where(v > 1.0, chunks / v, plain)


def first_chunk_in_flight(k: Knobs, p):
    """Micro-batches whose input edge (the embedding's output) rank 0 holds: those in flight
    through its first chunk, ``min(p, m)`` under 1F1B and ``min(2 p, m)`` interleaved (torch
    v2.13 ``ScheduleInterleaved1F1B``: its first chunk runs a second round of p forwards
    before the first of them comes back; counted in tests/test_pipeline_schedules.py)."""
    m = k.grad_accum
    return jnp.where(k.vpp > 1.0, jnp.minimum(2.0 * p, m), jnp.minimum(p, m))


def end_stage_args(k: Knobs, n) -> tuple[dict, dict]:
    """The `stage_memory` arguments of the first pipeline stage (embedding; the micro-batches
    `pipeline_in_flight` counts for rank 0) and of the last (head and loss: one micro-batch
    under 1F1B, more interleaved); at pp = 1 one stage holds both."""
    _, first_extra, last_extra, multi = stage_params(k, n)
    single = 1.0 - multi
    first = {"extra_params": first_extra + single * last_extra,
             "in_flight": pipeline_in_flight(k, k.pp, 0.0),
             "edge_in_flight": first_chunk_in_flight(k, k.pp),
             "logits_mb": single, "first_stage": True}
    last = {"extra_params": last_extra + single * first_extra,
            "in_flight": pipeline_in_flight(k, k.pp, k.pp - 1.0),
            "edge_in_flight": first_chunk_in_flight(k, k.pp),
            "logits_mb": 1.0, "first_stage": single > 0.5}
    return first, last


def end_stage_memory(k: Knobs, n) -> dict:
    """`stage_memory` of the first and the last pipeline stage, stacked on a leading axis of
    two (first, last): one stage evaluation under `jax.vmap` over the stage arguments, so what
    the two stages share is computed once."""
    first, last = end_stage_args(k, n)
    args = {key: jnp.stack(jnp.broadcast_arrays(first[key], last[key])) for key in first}
    layers = stage_blocks(k, n)
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
    # what the step holds of the device's memory while nothing runs short: the allocator's
    # reserved memory (its cached free blocks too), the context and the workspaces; what a
    # paged optimizer's state has beside it (`capopt.cost.time`)
    out["device_used_bytes"] = (out["reserved_bytes"] + n["rt_context_bytes"]
                                + n["rt_workspace_bytes"])
    return out


__all__ = ["PHASES", "compute_weight_bytes", "end_stage_args", "end_stage_memory",
           "expert_layer_params", "gathered_param_bytes", "head_grad_split", "indivisible",
           "largest_module", "loss_copies", "lora_per_device", "memory", "pp_nosync", "shard",
           "splitk_tile_limit", "stage_blocks", "stage_memory", "stage_params", "step_at_least",
           "tp_replication", "wrapped_base_per_device", "zero_shard", "zero_shares"]
