"""What one block keeps for its backward pass, and what its backward pass adds, per device.

One inventory of a block's activations, op by op, in bytes per token of the micro-batch
(before tensor and sequence parallelism split it). Each entry says how it is split and under
which recomputation policy it is kept; which entries a runtime keeps, and how many copies, are
the runtime profile's rules (``rt_*`` counts, each with its source in the profile).

Residual stream (split by tp only under sequence parallelism), ``resid_saved`` h-wide tensors:
the block input, the first norm's output, the stream after attention and the second norm's
output (Korthikanti et al. 2022: the two norm inputs and the two projection inputs); a block
with four norms (Gemma 2) keeps the inputs of the two extra norms too. Attention (split by
tp): q, k, v and the attention output (q + 2 kv + q wide); per-head q/k norms (Qwen3, Gemma 3)
add their inputs (q + kv wide) and their statistics. MLP (split by tp; top-k x capacity
slots per token in an MoE): ``mlp_gated_saved`` f-wide tensors for a gated MLP, ``mlp_gelu_saved``
(+ ``mlp_gelu_lowp_saved`` in 16-bit) for a GELU one. Materialised attention: ``score_copies``
score matrices in the compute dtype and ``score_fp32_copies`` in float32 per head and key, a
1-byte dropout mask and the dropped probabilities (``attn_dropout_out_saved``); blockwise
attention keeps ``attn_lse_bytes`` per head instead. Hidden dropout: two 1-byte masks.

Policies: ``none`` keeps all of it. ``selective`` is a mixture by ``selective_saves_dots`` and
``selective_saves_ops``: neither is Korthikanti et al.'s (everything but the attention core);
``selective_saves_dots`` is JAX's ``dots_with_no_batch_dims_saveable``: the block input and the
outputs of the projections the backward pass reads (q, k, v, the attention's output
projection, gate and up), nothing else; ``selective_saves_ops`` is torchtitan's per-op policy:
the block input, every other plain matmul's output and the flash kernel's
(`capopt.cost._inputs.op_checkpoint_widths`).
``full`` keeps the block input. An MoE keeps its dispatch (``moe_dispatch_saved`` h-wide
tensors per expert slot, not split by tp) when nothing is recomputed.

Sequence parallelism splits the residual-stream tensors over tp; a runtime that gathers the
attention's and the MLP's inputs whole before their projections and lets the matmuls save
the gathered tensor (``sp_gathered_inputs_saved``: PyTorch's DTensor plan) keeps those whole.

The knobs arrive as the runtime applies them (`capopt.cost._inputs.runtime_knobs`): blockwise
("flash") attention is off where the runtime's kernel does not tile the sequence.
"""

from __future__ import annotations

import jax.numpy as jnp

from ._inputs import Knobs, step_at_least


def shard(fraction, degree):
    """Share of a buffer one device holds when ``fraction`` of it is split ``degree`` ways."""
    return 1.0 - fraction + fraction / degree


def split_over(total, whole, degree):
    """What one device holds of ``total`` when ``whole`` of it is replicated and the rest is
    split ``degree`` ways."""
    return (total - whole) / degree + whole


def autocast_mixed(n: dict):
    """1 where the runtime mixes precision by autocast (``autocast_casts``) and the compute
    dtype is narrower than the parameters, else 0. Under LoRA the frozen model is in the
    compute dtype (`frozen_bytes`): the stream and the norms are too, and autocast has only
    the adapters to cast."""
    return (n["rt_autocast_casts"] * (1.0 - n["lora"])
            * (n["param_bytes"] > n["act_bytes"]).astype(jnp.result_type(float)))


def stream_bytes(n: dict):
    """Bytes per element of the residual stream: the compute dtype, or under autocast the
    parameter dtype (the embedding's output and every residual add keep it)."""
    mixed = autocast_mixed(n)
    return (1.0 - mixed) * n["act_bytes"] + mixed * n["param_bytes"]


def lora_frozen_dropped(n: dict):
    """1 under LoRA in a runtime that keeps no input for a frozen matmul
    (``frozen_inputs_dropped``), else 0."""
    return n["lora"] * n["rt_frozen_inputs_dropped"]


def lora_input_cast(n: dict):
    """1 where PEFT's lora.Linear casts a wrapped matrix's input to its adapters' dtype and
    autocast casts it back (``lora_input_cast``: a 16-bit base, adapters wider than the
    compute dtype), else 0."""
    return (n["lora"] * n["rt_lora_input_cast"] * n["lora_base16"]
            * (n["param_bytes"] > n["act_bytes"]).astype(jnp.result_type(float)))


def routed_width(n: dict):
    """The routed experts' part of `mlp_width`: top-k x capacity factor slots ``f`` wide, in
    the blocks that have them (0 for a dense model)."""
    return n["f_routed_frac"] * n["topk"] * n["rt_moe_capacity_factor"] * n["f"]


def mlp_width(n: dict):
    """MLP width per token of one block, averaged over the blocks: the routed experts'
    (`routed_width`) plus what every token goes through (a dense MLP; shared experts; an
    MoE's dense first blocks)."""
    return routed_width(n) + n["f_unrouted"]


def kv_replicated(k: Knobs, n: dict):
    """1 where k and v stay whole on every tensor-parallel rank (``tp`` exceeds the KV
    heads: a valid config has tp | kv or kv | tp), else 0 (Megatron-LM's layout; the
    validation steps': `capopt.validation.sharding`, `capopt.validation.torch_tp`)."""
    return step_at_least(k.tp, n["kv"] + 1.0)


def block_inventory(k: Knobs, n: dict) -> dict:
    """Bytes per token one block produces for its backward pass, by how they split.

    ``rep``: residual-stream tensors (divide by tp under sequence parallelism); ``tp``: sharded
    by tensor parallelism; ``scores``: the materialised attention matrix (or, blockwise, its
    statistics), sharded by tp. ``input``: the block input alone (full recomputation);
    ``sel_rep`` / ``sel_tp`` / ``sel_whole``: what ``dots_with_no_batch_dims_saveable`` keeps
    (split by sp, by tp, whole); ``ops_tp`` / ``ops_whole`` / ``ops_rs``: what torchtitan's
    per-op policy keeps besides the block input (split by tp, whole, and the row-parallel
    reduce-scatters' outputs kept under sequence parallelism). ``proj`` / ``whole``: the
    projections' inputs within ``rep``; latent attention's and an MoE's dispatch tensors.
    """
    ab = n["act_bytes"]
    h, a, kv, s = n["h"], n["a"], n["kv"], n["s"]
    q, kw, vw, ow = n["q_w"], n["k_w"], n["v_w"], n["o_w"]
    tf = 1.0 - n["mlp"]                                  # transformer families
    width = mlp_width(n)
    extra_norms = jnp.maximum(n["norms_per_layer"] - 2.0, 0.0)

    lowp = (ab < 4.0).astype(jnp.result_type(float))
    # autocast (``autocast_casts``): the stream keeps the parameter dtype; the two norms save
    # their inputs in it, and each projection saves its own cast of its norm's output (q, k,
    # v; up, and gate when gated) instead of the ``resid_saved`` shared copies
    mixed = autocast_mixed(n)
    casts = (3.0 + 1.0 + n["gated"]) * ab * h
    stream = n["param_bytes"] * 2.0 * h + casts
    # LoRA, in a runtime that keeps no input for a frozen matmul: a norm output no adapter
    # reads (the first's: q, k, v; the second's: gate, up) is not kept, nor the MLP's
    # activation when down has no adapter, nor (materialised attention) the attention's
    # output when o has none: a flash kernel keeps its output for its own backward
    dropped = lora_frozen_dropped(n)
    frozen_in = dropped * ((1.0 - n["lora_attn_in"]) + (1.0 - n["lora_mlp_in"]))
    frozen_down = dropped * (1.0 - n["lora_down"])
    frozen_o = dropped * (1.0 - n["lora_o"]) * (1.0 - k.flash)
    rep = ((1.0 - mixed) * ab * (n["rt_resid_saved"] - frozen_in) * h + mixed * stream
           + ab * extra_norms * h + 2.0 * n["hidden_dropout"] * h)
    # of which the projections' inputs (the two norm outputs, or under autocast each
    # projection's cast of them): a runtime whose sequence parallelism gathers them whole
    # before the projections saves them whole (``sp_gathered_inputs_saved``)
    proj = (1.0 - mixed) * ab * (2.0 - frozen_in) * h + mixed * casts
    # PEFT's lora.Linear casts its input to the adapters' dtype before them (``lora_input_cast``;
    # a 16-bit base under autocast with adapters wider than the compute dtype): autocast casts
    # it back for lora_A, which keeps that cast, so each wrapped matrix keeps a copy of its
    # input of its own where one tensor was kept for all that read it (o's and down's inputs
    # have one reader each: their copy takes the place of the original)
    cast = lora_input_cast(n)
    # PEFT's lora_dropout (``training.lora.dropout`` > 0; peft 0.21.2 lora.Linear:
    # lora_B(lora_A(dropout(x))), nn.Dropout a module per wrapped matrix): each wrapped
    # matrix's adapter reads a dropped copy of its own, which lora_A keeps, and dropout keeps
    # its 1-byte mask; the copies take the place of the one tensor its readers shared
    drop = n["lora"] * n["lora_dropout"]
    copies = jnp.maximum(cast, drop)
    norm_outs = n["lora_in_attn"] + n["lora_in_mlp"]           # the two norms' readers
    masks = drop * (n["lora_in_total"] - norm_outs)             # o's and down's: tp-split
    rep = rep + copies * ab * n["lora_cast_rep"] + drop * norm_outs
    proj = proj + copies * ab * n["lora_cast_rep"] + drop * norm_outs
    # float32 router probabilities, in the blocks with experts
    rep = rep + jnp.where(n["E"] > 1, 4.0 * n["E"] * n["f_routed_frac"], 0.0)
    stats = n["rt_norm_stats"] + n["rt_layernorm_mean_saved"] * n["layernorm"]
    rep = rep + 4.0 * stats * n["norms_per_layer"]                   # float32 norm statistics
    gelu = n["rt_mlp_gelu_saved"] + lowp * n["rt_mlp_gelu_lowp_saved"]
    mlp = n["gated"] * n["rt_mlp_gated_saved"] + (1.0 - n["gated"]) * gelu - frozen_down
    # (materialised attention in a runtime that expands grouped k and v heads to the query
    # heads before its matmuls, ``gqa_expanded_saved``: the expanded copies are kept)
    expand = n["rt_gqa_expanded_saved"] * (1.0 - k.flash)
    kw, vw = kw + expand * (q - kw), vw + expand * (ow - vw)
    # (k and v replicated over tp, `kv_replicated`: every rank computes them whole and keeps
    # every KV head, ``tp`` times the share the ``tp`` bucket below divides them to, or, in a
    # runtime that slices out the KV head its query heads share (``kv_replicated_one_head``),
    # that one: tp / kv times)
    one = n["rt_kv_replicated_one_head"]
    kv_whole = 1.0 + kv_replicated(k, n) * ((1.0 - one) * k.tp + one * k.tp / n["kv"] - 1.0)
    attn = ab * (q + (kw + vw) * kv_whole + ow * (1.0 - frozen_o))
    # per-head q/k norms (Qwen3, Gemma 3): each keeps its input (the projection's output, in
    # the compute dtype) and ``norm_stats`` float32 statistics per head for its backward; its
    # output goes on to the rotary embedding, whose backward needs only the angles
    attn = attn + n["qk_norm"] * (ab * (q + kw * kv_whole)
                                  + 4.0 * n["rt_norm_stats"] * (a + kv * kv_whole))
    tp = attn + ab * mlp * width + masks
    # latent attention: the latents' norms keep their inputs and the projections after them
    # their outputs, replicated over tp (``latent_w``), with float32 statistics per norm
    latent = ab * n["latent_w"] + 4.0 * n["rt_norm_stats"] * n["latent_norms"]
    # an MoE's dispatch (``moe_dispatch_saved`` h-wide tensors per routed slot, in the blocks
    # with experts), whole on every tensor-parallel rank
    dispatch = (ab * n["rt_moe_dispatch_saved"] * n["f_routed_frac"] * n["topk"]
                * n["rt_moe_capacity_factor"] * h)

    score_copies = (n["rt_score_copies"] * (1.0 - n["rt_score_cast_lowp_only"] * (1.0 - lowp))
                    * (1.0 - n["attn_dropout"] * n["rt_attn_dropout_replaces_probs"]))
    mask_a = n["attn_dropout"]
    materialised = a * s * (score_copies * ab + n["rt_score_fp32_copies"] * 4.0
                            + mask_a * (1.0 + n["rt_attn_dropout_out_saved"] * ab))
    materialised = materialised + 4.0 * a * n["rt_softmax_stats"]
    # (a runtime that applies rotary embeddings to heads-first q and k, ``flash_out_copy``:
    # the flash kernel's output follows q's memory layout, heads-first, and the output
    # projection reads a sequence-first copy of it: both kept, the kernel's for its own
    # backward, the copy as o's input, unless o is frozen and keeps no input)
    o_copy = (n["rt_flash_out_copy"] * n["rotary"]
              * (1.0 - dropped * (1.0 - n["lora_o"])))
    blockwise = a * n["rt_attn_lse_bytes"] + o_copy * ab * ow
    fl = k.flash
    scores = fl * blockwise + (1.0 - fl) * materialised

    # dots_with_no_batch_dims_saveable: the block input, the attention's output projection
    # (and a four-norm block's MLP output, both norm inputs), q, k, v, gate and up
    # (under autocast the block input is in the stream's dtype; a runtime whose policy keeps
    # every matmul's output, ``selective_saves_down``, keeps the MLP's down projection too)
    sel_rep = (ab * (2.0 + 0.5 * extra_norms + n["rt_selective_saves_down"]) * h
               + mixed * (n["param_bytes"] - ab) * h)
    adapters = n["lora"] * n["rt_selective_saves_adapters"]
    # (an MoE's routed experts in a runtime that runs them as one dot batched over the
    # experts, ``expert_dots_batched``: a dot with a batch dimension, which the policy
    # does not keep; the dense and shared MLPs' outputs it does)
    sel_width = width - n["rt_expert_dots_batched"] * routed_width(n)
    sel_tp = ab * (n["dots_tp"] + (n["k_w"] + n["v_w"]) * (kv_whole - 1.0)
                   + (1.0 + n["gated"]) * sel_width
                   + adapters * (n["lora_out_width"] - n["lora_out_width_rep"]))
    # (latent attention: q_a's and kv_a's outputs, and their adapters', replicated)
    sel_whole = ab * (n["dots_rep"] + adapters * n["lora_out_width_rep"])

    # per-op checkpointing (``selective_saves_ops``, torchtitan's): the block input, every
    # other plain matmul's output (`capopt.cost._inputs.op_checkpoint_widths`), the flash
    # kernel's output and log-sum-exp (materialised attention's matmuls are batched, not
    # saved), and under sequence parallelism the row-parallel projections' reduce-scatters
    ops_tp = ab * n["ops_tp"] + k.flash * (ab * n["o_w"] + a * n["rt_attn_lse_bytes"])
    ops_whole = ab * n["ops_whole"]

    # LoRA's first block (a frozen embedding: its input needs no gradient), in a runtime
    # that saves a tensor only for a gradient someone needs (``frozen_inputs_dropped``):
    # nothing before the block's first adapter is kept. Always the first norm's input and
    # statistics; with no adapter on q, k or v, the attention's saved tensors too; with none
    # on o either, the attention's output and the second norm's input; with none on gate or
    # up either, the MLP's tensors but down's input. With v's adapter but none on q or k,
    # materialised attention keeps only the probabilities (for v's gradient): not q, k, the
    # scores or softmax's statistics (a flash kernel keeps its inputs whatever needs a
    # gradient). (rep: residual-stream; tp: sharded over tp.)
    norm_in = ab * h + 4.0 * stats
    no_a, no_o = 1.0 - n["lora_attn_in"], 1.0 - n["lora_o"]
    no_m = 1.0 - n["lora_mlp_in"]
    v_only = n["lora_attn_in"] * (1.0 - n["lora_qk"]) * (1.0 - k.flash)
    mlp_pre = jnp.maximum(mlp - (1.0 - frozen_down), 0.0) * ab * width
    # (with adapter dropout: no mask for an input computed before the block's first adapter,
    # dropout's input needing no gradient: q, k, v's always, gate and up's without an
    # adapter in the attention, o's without one on q, k or v, down's without any before it)
    first_rep = dropped * (norm_in + no_a * no_o * norm_in
                           + drop * (n["lora_in_attn"] + no_a * no_o * n["lora_in_mlp"]))
    first_tp = dropped * (no_a * (attn - ab * ow * (1.0 - frozen_o)
                                  + no_o * (ab * ow * (1.0 - frozen_o) + no_m * mlp_pre))
                          + v_only * ab * (q + kw)
                          + drop * no_a * (n["lora_in_o"] + no_o * no_m * n["lora_in_down"]))
    first_scores = dropped * (no_a * scores
                              + v_only * jnp.maximum(materialised - a * s * ab, 0.0))

    # A plain MLP stack (family "mlp", XLA): each layer keeps its matmul's output alone, in
    # the compute dtype and split over tp; the activation and its mask are recomputed from it
    # inside the fusions that read them (the next layer's GEMMs, the mask's select), so the
    # next layer's input is no tensor of its own. With tp > 1 each layer is column-parallel
    # and the next one reads its activation all-gathered whole: that copy is kept as well.
    # (Read off the fitting configs' buffer assignments: rand0-143, tp 1, five
    # bf16[2048, 384] dot outputs for five layers; rand0-124 and rand0-178, tp 4, each layer's
    # tp-split output beside its all-gather's whole output. Only the xla-gpu tier runs the
    # stack: these are XLA's rules.)
    gathered = ab * h * step_at_least(k.tp, 2.0)
    zero = jnp.zeros_like(h)
    return {
        "rep": jnp.where(tf > 0, rep, gathered),
        "proj": jnp.where(tf > 0, proj, zero),
        "tp": jnp.where(tf > 0, tp, ab * h),
        "scores": jnp.where(tf > 0, scores, zero),
        # (an MLP stack's stream is in the compute dtype: it casts its input once)
        "input": jnp.where(tf > 0, ((1.0 - mixed) * ab + mixed * n["param_bytes"]) * h, ab * h),
        "sel_rep": jnp.where(tf > 0, sel_rep, ab * h),
        "sel_tp": jnp.where(tf > 0, sel_tp, zero),
        "whole": jnp.where(tf > 0, latent + dispatch, zero),
        "sel_whole": jnp.where(tf > 0, sel_whole, zero),
        "ops_tp": jnp.where(tf > 0, ops_tp, zero),
        "ops_whole": jnp.where(tf > 0, ops_whole, zero),
        "ops_rs": jnp.where(tf > 0, ab * n["ops_rows"] * h, zero),
        "first_rep": jnp.where(tf > 0, first_rep, zero),
        "first_tp": jnp.where(tf > 0, first_tp, zero),
        "first_scores": jnp.where(tf > 0, first_scores, zero),
    }


def saved_bytes(k: Knobs, n: dict, tokens, inv: dict | None = None) -> tuple:
    """Bytes one block keeps for ``tokens`` tokens under each policy: (none, selective, full).
    ``inv``: the block's `block_inventory`, where the caller has it already."""
    inv = block_inventory(k, n) if inv is None else inv
    rep_div = shard(k.sp, k.tp)
    whole = n["rt_sp_gathered_inputs_saved"] * inv["proj"]      # not split by sp
    none = tokens * ((inv["rep"] - whole) * rep_div + whole + inv["whole"]
                     + (inv["tp"] + inv["scores"]) / k.tp)
    korthikanti = none - tokens * inv["scores"] / k.tp
    dots = tokens * (inv["sel_rep"] * rep_div + inv["sel_whole"] + inv["sel_tp"] / k.tp)
    # (the reduce-scatters exist only where tensor parallelism splits the sequence)
    rs = jnp.minimum(k.sp, jnp.maximum(k.tp - 1.0, 0.0)) * inv["ops_rs"] / k.tp
    ops = tokens * (inv["input"] * rep_div + inv["ops_whole"] + inv["ops_tp"] / k.tp + rs)
    ops = jnp.where(n["mlp"] > 0, dots, ops)
    c, o = n["rt_selective_saves_dots"], n["rt_selective_saves_ops"]
    selective = (1.0 - c - o) * korthikanti + c * dots + o * ops
    full = tokens * inv["input"] * rep_div
    return none, selective, full


def first_block_unsaved(k: Knobs, n: dict, tokens, inv: dict | None = None) -> tuple:
    """Bytes the first block does not keep under LoRA (`block_inventory`'s ``first_*``),
    under each policy: (none, selective, full). Selective recomputation as Korthikanti's
    drops the scores anyway; the other selective policies and full recomputation keep the
    block's input, which the first block's rule does not touch. ``inv`` as `saved_bytes`."""
    inv = block_inventory(k, n) if inv is None else inv
    none = tokens * (inv["first_rep"] * shard(k.sp, k.tp)
                     + (inv["first_tp"] + inv["first_scores"]) / k.tp)
    korthikanti = none - tokens * inv["first_scores"] / k.tp
    c, o = n["rt_selective_saves_dots"], n["rt_selective_saves_ops"]
    return none, (1.0 - c - o) * korthikanti, 0.0 * none


def backward_transient_points(k: Knobs, n: dict, tokens) -> dict:
    """What a block's backward pass holds on top of what the block saved, at each of the
    points where it can peak (`capopt.cost.memory` adds the gradients produced by each):
    ``mlp`` the MLP's backward, ``attention`` the attention core's (less the MLP's saved
    tensors, released by then in an eager backward: it can be negative), ``input_cast`` a
    wrapped matrix's input cast (in the forward pass or the rebuild, before any of the
    block's gradients), ``largest`` the largest transient with every saved tensor counted
    (what a backward that ignores the gradients' order adds to the block's activations) and
    ``stream`` (the residual stream's gradient, live at every point).

    The score gradients of the attention's backward: ``score_grad_copies`` float32 matrices
    per head (the whole s x s matrix when materialised; one block of ``attn_chunk_queries``
    queries at a time when blockwise, the validation step's chunked stand-in); and the
    MLP's input gradients: ``mlp_grad_saved`` f-wide tensors in the compute dtype (the gate
    and up gradients of a gated MLP, the up gradient of a GELU one) with the residual
    stream's gradient (two h-wide).
    """
    ab = n["act_bytes"]
    fl = k.flash
    tf = 1.0 - n["mlp"]
    seqs = tokens / n["s"]
    per_head = n["rt_score_grad_copies"] * seqs * n["a"] * 4.0 / k.tp
    scores = per_head * n["s"] * ((1.0 - fl) * n["s"]
                                  + fl * jnp.minimum(n["rt_attn_chunk_queries"], n["s"]))
    # (``frozen_down_grads``: with a frozen, unwrapped down under LoRA in a runtime that keeps
    # no input for it, the MLP's backward holds the product's gradient and the two it
    # becomes on top of what the block saved, no input of down's freed before them)
    frozen_down = lora_frozen_dropped(n) * (1.0 - n["lora_down"])
    # (down's input is freed by its node beside the (1 + gated) gradients it becomes, unless
    # a frozen down keeps none: then the ``frozen_down_grads`` rule describes the point)
    frozen_rule = frozen_down * n["rt_frozen_down_grads"]
    mlp = (tokens * ab * ((1.0 - frozen_rule) * n["rt_mlp_grad_saved"] * (1.0 + n["gated"])
                          + frozen_rule * (2.0 + n["gated"]))
           * mlp_width(n) / k.tp)
    stream = tokens * stream_bytes(n) * 2.0 * n["h"] * shard(k.sp, k.tp)
    # (an MLP stack has no residual stream: its layer's backward writes the input's gradient
    # while the incoming one is recomputed from the saved output inside the GEMMs that read
    # it, the loss's gradient at the top layer too; with tp > 1 the incoming gradient, whole,
    # is a tensor of its own, as rand0-124's backward holds it)
    plain = tokens * ab * n["h"] * shard(k.sp, k.tp) * (1.0 + step_at_least(k.tp, 2.0))
    stream = jnp.where(tf > 0, stream, plain)
    # ``score_grad_after_release``: the score gradients of materialised attention peak in the
    # softmax's backward, after the MLP's backward released its saved tensors and the
    # probabilities' copies downstream of the softmax (the compute-dtype cast, dropout's mask
    # and output) were consumed: those bytes of the block's own are no longer live
    lowp = (ab < 4.0).astype(jnp.result_type(float))
    gated = n["gated"]
    gelu = n["rt_mlp_gelu_saved"] + lowp * n["rt_mlp_gelu_lowp_saved"]
    mlp_saved = ab * (gated * n["rt_mlp_gated_saved"] + (1.0 - gated) * gelu) * mlp_width(n)
    copies = (n["rt_score_copies"] * (1.0 - n["rt_score_cast_lowp_only"] * (1.0 - lowp))
              * (1.0 - n["attn_dropout"] * n["rt_attn_dropout_replaces_probs"]))
    post_softmax = n["a"] * n["s"] * (copies * ab + n["attn_dropout"]
                                      * (1.0 + n["rt_attn_dropout_out_saved"] * ab))
    release = n["rt_score_grad_after_release"] * tokens / k.tp
    released = release * (1.0 - fl) * (mlp_saved + post_softmax)
    ring = context_parallel_transient(k, n, tokens)
    # (at the attention core's backward point itself the MLP's saved tensors are gone with
    # a flash kernel too)
    # (a flash kernel's backward, ``flash_bwd_outputs``: dq, dk and dv written while the
    # output's gradient is live, o's node having freed its input copy of the same width)
    flash_bwd = fl * n["rt_flash_bwd_outputs"] * tokens * ab * (
        n["q_w"] + n["k_w"] + n["v_w"]) / k.tp
    attention = (scores + ring + flash_bwd
                 - release * (mlp_saved + (1.0 - fl) * post_softmax))
    scores = jnp.maximum(scores - released, 0.0)
    # PEFT's input cast (``lora_input_cast``, see `block_inventory`): while a wrapped matrix
    # runs, its input's float32 cast and the input itself are live beside the compute-dtype
    # copy its adapter keeps; the widest wrapped input (down's, f wide, when down is wrapped)
    # at once, in the block's forward pass or its rebuild
    cast = lora_input_cast(n)
    drop = n["lora"] * n["lora_dropout"]
    # (with dropout as well: its output, float32 after the cast; without the cast, the input
    # itself beside the dropped copy the adapter keeps)
    cast_in = (jnp.maximum(cast, drop) * tokens * n["lora_in_width"] / k.tp
               * (ab + cast * n["param_bytes"] * (1.0 + drop)))
    largest = tf * jnp.maximum(jnp.maximum(scores + ring, mlp), cast_in)
    return {"attention": tf * attention, "mlp": tf * mlp, "input_cast": tf * cast_in,
            "largest": largest, "stream": stream,
            # (what ``attention`` counts as released by its point: the MLP's saved tensors,
            # the copies downstream of a materialised softmax)
            "attention_released_mlp": tf * release * mlp_saved,
            "attention_released_post": tf * release * (1.0 - fl) * post_softmax,
            # (materialised probabilities with no copy between the softmax and the P V
            # matmul, neither a cast nor dropout: one tensor both nodes save)
            "attention_probs_shared": tf * (1.0 - fl) * (1.0 - n["attn_dropout"])
            * jnp.maximum(1.0 - copies, 0.0) * tokens / k.tp * n["a"] * n["s"] * ab}


def context_parallel_transient(k: Knobs, n: dict, tokens):
    """Bytes ring attention holds during a block's attention backward under context
    parallelism (``cp`` >= 2; 0 otherwise), for this rank's ``tokens``, as PyTorch's
    ``_templated_ring_attention_backward`` allocates them
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py, v2.13): the
    keys and values all-gathered from every rank of the group (``cp x tokens`` of each, in
    the compute dtype, one flat buffer), the float32 accumulators of dq, dk and dv and each
    ring step's float32 partials of the three (``convert_to_f32``), and dk, dv in flight
    round the ring (the all-to-all's send and receive buffers, float32). The forward pass's
    buffers (the same gathered keys and values, a float32 output) are a subset of these.
    Heads are split over tp."""
    ab = n["act_bytes"]
    cp = k.cp
    active = jnp.clip(cp - 1.0, 0.0, 1.0)
    kv = n["k_w"] + n["v_w"]
    qkv = n["q_w"] + kv
    per_token = cp * kv * ab + 2.0 * 4.0 * qkv + 2.0 * 4.0 * kv
    return active * tokens * per_token / k.tp


__all__ = ["autocast_mixed", "backward_transient_points", "block_inventory",
           "context_parallel_transient", "kv_replicated", "mlp_width", "routed_width",
           "saved_bytes", "shard", "split_over", "stream_bytes"]
