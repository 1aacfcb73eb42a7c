"""Step time and throughput: compute, memory-bound ops, communication, bubble, optimizer, I/O.

One optimizer step on the slowest device is

    step = m (compute + memory-bound + exposed per-micro-batch communication)   m = grad_accum
         + bubble + exposed per-step communication + optimizer + offload

where memory-bound also holds the micro-batch's gradient-accumulation add and its exposed
kernel-launch overhead, and optimizer the update's.

and the step cannot be shorter than the input pipeline needs to deliver its samples
(``step_s = max(that, input_s)``, so a data-bound run shows as data-bound).

- Compute: every matmul at the shape-dependent efficiency of `flops.matmul_efficiency`
  (`flops.compute_times`); recomputation adds forward passes.
- Memory-bound ops (norms, residual adds, dropout, activations, softmax, rotary embedding, the
  loss on the logits, embedding lookups) move bytes at ``mem_bw x mem_eff``, and so does
  QLoRA's dequantisation of each 4-bit base matrix to the compute dtype (reading its codes and
  scales, writing the weight), once or twice a pass as the runtime does it (`dequant_passes`).
- Gradient accumulation (``grad_accum_s``, part of ``memory_bound_s``): with ``m > 1``
  micro-batches every micro-batch's gradients are added into an accumulator (``m`` adds when
  the loop starts from a zeroed buffer, as a `jax.lax.scan` does; ``m - 1`` when the first
  backward writes it, as PyTorch's ``.grad``), each reading the new gradient and reading and
  writing the accumulator, over the device's gradient shard (ZeRO-2/3 split it), at HBM
  bandwidth. Nothing at ``m = 1``.
- Kernel overhead (``launch_s``, part of ``memory_bound_s`` and ``optimizer_s``): a stage
  launches ``stage_kernels`` kernels per micro-batch and the update a number per block once a
  step. Launches are queued asynchronously, so they cost time only where the kernels run out:
  a stream of K kernels doing W seconds of work takes ``max(W + K gap, K launch)`` (smoothed;
  ``gap`` the per-kernel cost on the device that queueing does not hide). Hence fewer, larger
  micro-batches: the same work in fewer kernels and fewer accumulation adds.
- GEMMs (`flops`) count every operand's HBM traffic once per micro-batch and pass, the weights
  included, so larger micro-batches also re-read the weights fewer times.
- Communication (`comm`): tensor-parallel all-reduces per block (reduce-scatter + all-gather with
  sequence parallelism: the same traffic), pipeline point-to-point per micro-batch and virtual
  stage, MoE all-to-all, ZeRO-3 parameter all-gathers and gradient reduce-scatters per
  micro-batch, and once per step the data-parallel all-reduce (ZeRO 0) or reduce-scatter +
  all-gather (ZeRO 1 and 2; ZeRO-2 keeps only its shard of the accumulator, so it
  reduce-scatters every micro-batch's gradients). Each kind hides ``overlap_<kind>`` of itself behind the compute it
  can run under (its window) and exposes the rest. ZeRO-3 gathers the weights of every block
  for every micro-batch: twice (forward, backward), three times under full recomputation, and
  reduce-scatters the gradients once per micro-batch, so with ``m`` micro-batches the weights
  cross the network ``m (2 + recompute)`` times per step against once for ZeRO 0-2. A gather
  costs the collective (`comm`) plus the framework's own fetch path in series with it
  (``zero3_fetch_s_per_gb`` seconds per GB received; 0 for a framework at link speed).
- Pipeline: 1F1B with ``v`` model chunks per device (``Config.vpp``, interleaved) leaves
  a bubble of ``(p - 1) / v`` micro-batch times: the fraction ``(p - 1) / (m + p - 1)`` of the
  step at ``v = 1``. The slowest stage (first: embeddings; last: head and loss) sets the pace.
- Optimizer: the update streams gradients, master weights and optimizer state once (plus the
  gradient-norm read under clipping) at memory bandwidth; an offloaded share of the state
  crosses the host link both ways every step.

Placement follows Megatron-LM: tensor-parallel ranks innermost, then data-parallel, then
pipeline stages (see `comm`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._terms import COMM_KINDS, STEP_TERMS
from . import comm
from ._inputs import Knobs, rank_sequences, shard_group
from .activations import autocast_mixed, mlp_width
from .flops import compute_times, fused_linear_chunk, model_flops, recompute_flops, step_tokens
from .memory import (compute_weight_bytes, expert_layer_params, gathered_param_bytes,
                     held_grad_bytes, lora_per_device, loss_copies, pp_nosync, shard,
                     stage_blocks, stage_params, step_at_least, wrapped_base_per_device,
                     zero_shard, zero_shares)

# The kinds of communication priced (their names and the step's terms, `STEP_TERMS`, are in
# `capopt._terms`): exposed communication by kind adds up to the step; hidden communication,
# gradient accumulation and kernel launches do not (the first costs nothing, the others are
# parts of memory_bound_s).
KINDS = COMM_KINDS


# ---------------------------------------------------------------------------------------------
# Memory-bound ops
# ---------------------------------------------------------------------------------------------


def memory_bound_times(k: Knobs, n: dict) -> dict:
    """Seconds of memory-bound ops per micro-batch: one block, the first stage's extras, the last's.

    Element counts per token of one block's forward are in the profile (``ew_*``); the backward
    moves ``ew_bwd_factor`` times as much; full recomputation repeats the forward, selective
    recomputation what its policy does not save (the softmax and dropout of the attention
    scores, or with ``selective_saves_dots`` or ``selective_saves_ops`` every non-matmul op).
    """
    tp, s, h, ab = k.tp, n["s"], n["h"], n["act_bytes"]
    tokens = rank_sequences(k) * s
    tf = 1.0 - n["mlp"]
    q, kv = n["q_w"], n["k_w"]
    w_sel, w_full = k.remat[1], k.remat[2]

    rep = shard(k.sp, tp)                              # sequence parallelism splits the h side
    extra_norms = 2.0 * (n["norms_per_layer"] - 2.0)  # ew_h counts a block with two norms
    e_h = (tf * (n["rt_ew_h"] + extra_norms + n["hidden_dropout"] * n["rt_ew_dropout_h"])
           * h * rep)
    e_h = e_h + n["mlp"] * 2.0 * h                     # plain MLP: the activation
    e_f = tf * (2.0 + n["gated"]) * mlp_width(n) / tp
    e_rope = tf * n["rotary"] * 2.0 * (q + kv) / tp
    e_rope = e_rope + tf * n["qk_norm"] * 2.0 * (q + kv) / tp    # per-head q/k norms: read, write
    e_s = (tf * (n["rt_ew_score"] + n["attn_dropout"] * n["rt_ew_score_dropout"])
           * n["a"] / tp * s * (1.0 - k.flash))
    # An eager step runs a Python RMSNorm, rotary embedding and gated activation op by op,
    # each op reading and writing its operands in HBM (``ew_*_extra``, what they move beyond
    # one fused kernel's read and write); compiling fuses each chain into one kernel
    eager = 1.0 - n["compile"]
    rms = 1.0 - n["layernorm"]
    e_eager = tf * eager * (
        rms * n["rt_ew_rmsnorm_extra"] * (n["norms_per_layer"] * h * rep
                                          + n["qk_norm"] * (q + kv) / tp)
        + n["rotary"] * n["rt_ew_rope_extra"] * (q + kv) / tp
        + n["gated"] * n["rt_ew_glu_extra"] * mlp_width(n) / tp)
    # An 8-bit recipe casts each linear layer's input before its forward GEMM and each output
    # gradient before the backward's (``fp8_cast_bytes`` per element, read and written; the
    # transposed copy the weight gradient's GEMM reads included): inputs of the q/k/v
    # projections and the MLP's input matrices (h, cast once for the matrices that share it),
    # of the output projection and the MLP's output matrix; gradients of every output
    cast = n["fp8_linear"] * n["rt_fp8_cast_bytes"] / ab
    c_in = tf * (2.0 * h + n["o_w"] / tp + mlp_width(n) / tp) + n["mlp"] * h
    c_out = (tf * ((q + 2.0 * kv) / tp + 2.0 * h + (1.0 + n["gated"]) * mlp_width(n) / tp)
             + n["mlp"] * h)
    fwd = e_h + e_f + e_rope + e_s + e_eager
    # Selective recomputation repeats what its policy does not save, as the memory model has
    # it (`selective_saves_dots`): 0, the attention core's softmax and dropout (Korthikanti);
    # 1, every non-matmul op of the forward (XLA's dots_with_no_batch_dims_saveable).
    # (torchtitan's per-op policy, ``selective_saves_ops``, recomputes them all too)
    c = n["rt_selective_saves_dots"] + n["rt_selective_saves_ops"]
    elems = fwd * (1.0 + w_full + n["rt_ew_bwd_factor"]) + w_sel * (c * fwd + (1.0 - c) * e_s)
    elems = elems + cast * (c_in * (1.0 + w_full) + c_out)
    rate = n["mem_bw"] * n["rt_mem_eff"]
    layer = tokens * ab * elems / rate

    passes = 1.0 + n["rt_ew_bwd_factor"]
    logit_div = n["logit_tp"] * tp + (1.0 - n["logit_tp"])
    fp32_copies, act_copies, _, _ = loss_copies(n)
    # (the chunked loss runs the float32 loss's element-wise ops, slice by slice: its
    # profile's passes, not its smaller live set)
    ch = n["loss_chunked"]
    fp32_copies = (1.0 - ch) * fp32_copies + ch * n["rt_logits_fp32_copies"]
    act_copies = (1.0 - ch) * act_copies + ch * n["rt_logits_act_copies"]
    per_logit = ab * act_copies + 4.0 * fp32_copies
    logits = 2.0 * rank_sequences(k) * n["logit_elems_per_seq"] / logit_div * per_logit
    final_norm = tf * 2.0 * tokens * h * rep * ab * passes
    # (the fused linear cross-entropy under autocast casts the whole head again for each
    # chunk's logits matmul, a view autocast does not cache: read in the parameter dtype,
    # written in the compute dtype, ``ceil(tokens / chunk)`` times; `capopt.cost.memory`)
    fl = n["loss_fused_linear"]
    chunks = jnp.ceil(tokens / fused_linear_chunk(n, tokens))
    head_w = n["P_head_tp"] + n["tied"] * n["P_embed_tp"]
    fl_casts = fl * autocast_mixed(n) * chunks * head_w * (n["param_bytes"] + ab)
    last = (logits + final_norm + fl_casts) / rate
    first = n["embed_vocab"] * 2.0 * tokens * h * ab * passes / rate   # lookup and its gradient
    dequant = (wrapped_base_per_device(k, n) * dequant_passes(k, n)
               * (n["base_bytes"] + n["frozen_bytes"]))
    return {"layer": layer + dequant / rate, "first": first, "last": last,
            "dequant": dequant / rate}


def dequant_passes(k: Knobs, n: dict):
    """Dequantisations of each 4-bit base matrix per micro-batch (0 without one).

    ``lora_dequant``: the forward pass dequantises every wrapped matrix to the compute dtype
    before its matmul, and a recomputed block does again; ``lora_dequant_in_backward``: the
    backward pass dequantises it once more for the input gradient (bitsandbytes), or reads the
    forward pass's copy (XLA). A selective policy that saves only matmul outputs
    (``selective_saves_dots``, ``selective_saves_ops``) recomputes the dequantisation with the
    block's other non-matmul values: XLA's kept copy, PyTorch's replayed forward (the torch
    tier's ``capopt::dequantize_nf4`` runs three times a matrix under it, as under full).
    """
    w_sel, w_full = k.remat[1], k.remat[2]
    bwd = n["rt_lora_dequant_in_backward"]
    # (a selective policy that saves matmul outputs, or torchtitan's per-op one, replays the
    # block's forward and dequantises again; Korthikanti's recomputes the attention core only)
    replays = jnp.minimum(n["rt_selective_saves_dots"] + n["rt_selective_saves_ops"], 1.0)
    per_pass = 1.0 + w_full + bwd + w_sel * replays
    return n["lora"] * n["base_nf4"] * n["rt_lora_dequant"] * per_pass


# ---------------------------------------------------------------------------------------------
# One stage, one micro-batch
# ---------------------------------------------------------------------------------------------


def fetch_s(nbytes, dp, n: dict):
    """Seconds the ZeRO-3 fetch path adds to the collectives for ``nbytes`` of gathered weights.

    ``rt_zero3_fetch_s_per_gb`` is the framework's own cost per GB a rank receives from the
    others (``nbytes (dp-1)/dp``), in series with the collective: 0 for an implementation that
    hands NCCL one flat buffer and overlaps (the default), nonzero for one that synchronises the
    device and stages shards on the host around each gather, as DeepSpeed's 2021 ZeRO-3 did.
    Vanishes at ``dp = 1``.
    """
    per_gb = n.get("rt_zero3_fetch_s_per_gb", 0.0)
    return per_gb * nbytes / 1e9 * (dp - 1.0) / jnp.maximum(dp, 1.0)


# Coefficients of the per-micro-batch costs, and what a profile written before them means:
# accumulation from a zeroed buffer in the gradient dtype, no kernel overhead.
_DEFAULTS = {"accum_from_zero": 1.0, "accum_bytes": 0.0}


def _coeff(n: dict, key: str):
    return n.get(f"rt_{key}", _DEFAULTS.get(key, 0.0))


def smooth_max(a, b, sharpness: float = 20.0):
    """max(a, b) for non-negative a, b, smoothed over a band of (a + b) / sharpness.

    ``a + tau softplus((b - a) / tau)`` with ``tau = (a + b) / sharpness``: within
    ``tau e^{-|a - b| / tau}`` of the max (nothing in float32 once one side is twice the other),
    ``tau ln 2`` above it where the two are equal; differentiable everywhere.
    """
    total = a + b
    tau = jnp.where(total > 0.0, total, 1.0) / sharpness
    return jnp.where(total > 0.0, a + tau * jnp.logaddexp(0.0, (b - a) / tau), 0.0)


def accum_adds(k: Knobs, n: dict):
    """Gradient-accumulation adds per optimizer step: 0 at ``grad_accum = 1``.

    ``m - 1`` when the first micro-batch's gradients become the accumulator (PyTorch: the first
    backward writes ``.grad``, later ones add into it), ``m`` when the loop starts from a zeroed
    buffer (``rt_accum_from_zero = 1``: a `jax.lax.scan` over micro-batches, as the validation
    step does). Linear in a relaxed ``m`` between 1 and 2.
    """
    m = k.grad_accum
    return jnp.maximum(m - 1.0, 0.0) + _coeff(n, "accum_from_zero") * step_at_least(m, 2.0)


def accum_bytes_per_param(n: dict):
    """Bytes one accumulation add moves per gradient element: read the new gradient, read and
    write the accumulator (kept in the gradient dtype, or ``rt_accum_bytes`` when wider, e.g.
    an fp32 ``main_grad`` buffer under 16-bit gradients)."""
    acc = jnp.maximum(n["grad_bytes"], _coeff(n, "accum_bytes"))
    return n["grad_bytes"] + 2.0 * acc


def stage_grad_elems(k: Knobs, n: dict, layers, extra_params):
    """Gradient elements one device of a stage accumulates: its tensor-parallel share of the
    stage's trainable parameters, split over the data-parallel group under ZeRO-2/3 (experts
    over dp / ep), as `memory` counts the gradient buffers."""
    per_layer, _, _, _ = stage_params(k, n)
    _, f_grad, _, _ = zero_shares(k, n)
    lora = n["lora"]
    dense = layers * per_layer + extra_params
    trainable = lora * layers * lora_per_device(n, k.tp, k.ep)[0] + (1.0 - lora) * dense
    expert = (1.0 - lora) * layers * expert_layer_params(k, n)
    return zero_shard(f_grad, trainable, expert, k)


def stage_kernels(k: Knobs, n: dict, layers):
    """Kernels one device launches per micro-batch for a stage of ``layers`` blocks.

    ``kernels_per_layer`` (a block's forward and backward outside blockwise attention),
    plus, with flash attention implemented blockwise (``attn_chunk_queries`` > 0),
    ``kernels_per_attn_chunk`` per query chunk; full recomputation repeats the forward share
    (``1 / (1 + ew_bwd_factor)``); ``kernels_per_micro_batch`` for the embedding, head and loss;
    under gradient accumulation ``accum_kernels_per_layer`` adds into the accumulator per
    block, and under QLoRA ``lora_dequant_kernels`` per dequantisation of each 4-bit matrix
    (`dequant_passes`), ``lora_dequant_nested_kernels`` more where its absmax is
    double-quantised.
    """
    chunk = n.get("rt_attn_chunk_queries", 0.0)
    chunks = jnp.where(chunk > 0.0, jnp.ceil(n["s"] / jnp.maximum(chunk, 1.0)), 0.0)
    fwd_share = 1.0 / (1.0 + n["rt_ew_bwd_factor"])
    block = (_coeff(n, "kernels_per_layer")
             + k.flash * (1.0 - n["mlp"]) * chunks * _coeff(n, "kernels_per_attn_chunk"))
    block = block * (1.0 + k.remat[2] * fwd_share)
    mats = n["lora_base_mats"] - (1.0 - 1.0 / k.ep) * n["lora_base_expert_mats"]
    block = block + dequant_passes(k, n) * mats * (
        n["rt_lora_dequant_kernels"] + n["base_nested"] * n["rt_lora_dequant_nested_kernels"])
    per_mb_adds = accum_adds(k, n) / jnp.maximum(k.grad_accum, 1.0)
    return (layers * (block + per_mb_adds * _coeff(n, "accum_kernels_per_layer"))
            + _coeff(n, "kernels_per_micro_batch"))


def launch_exposed(work, kernels, n: dict):
    """Seconds a stream of ``kernels`` kernels adds to ``work`` seconds of GPU work.

    Launches are asynchronous: the host queues kernels ahead of the device, so issuing them
    (``kernel_launch_s`` each) costs nothing while the device has work queued, and becomes the
    pace when the kernels are shorter than their launches. On the device every kernel also
    pays a fixed start/drain cost (``kernel_gap_s``) even when queued. So the stream takes
    ``max(work + kernels gap, kernels launch)``, smoothed; this returns that minus ``work``.
    """
    busy = work + kernels * _coeff(n, "kernel_gap_s")
    return smooth_max(busy, kernels * _coeff(n, "kernel_launch_s")) - work


def _col(*values):
    """Scalars (or equally shaped arrays) stacked on a new leading axis: one argument of a
    vectorised evaluation."""
    return jnp.stack(jnp.broadcast_arrays(*values))


def _unstack(x, size):
    return tuple(x[i] for i in range(size))


def _weight_bytes(n: dict):
    """Bytes per parameter of the weights as a ZeRO-3 all-gather moves them."""
    return n["lora"] * n["frozen_bytes"] + (1.0 - n["lora"]) * gathered_param_bytes(n)


def stage_time(k: Knobs, n: dict, *, layers, c: dict, mb: dict, extra_compute, extra_fwd,
               extra_memory, extra_params, tp_extra_ar) -> dict:
    """Per-micro-batch seconds of one stage holding ``layers`` blocks plus its extras.

    ``c`` and ``mb`` are `flops.compute_times` and `memory_bound_times` of the config; the
    extras are the stage's own embedding / head work: matmul seconds, memory-bound seconds,
    parameters and tensor-parallel all-reduces. Returns ``compute``, ``memory`` (with its
    parts ``accum`` and ``launch``), ``hidden`` (communication hidden behind compute),
    ``total``, ``bwd`` (the backward phase's matmul seconds), ``fwd`` (the forward pass's
    matmul seconds) and the exposed seconds of each
    per-micro-batch collective (``tp``, ``moe``, ``zero``, ``pp``). Works elementwise on
    arrays of extras (e.g. under `jax.vmap`).
    """
    tp, dp, ab = k.tp, k.dp, n["act_bytes"]
    zdp = shard_group(k)                 # the ranks ZeRO's collectives run over
    tokens = rank_sequences(k) * n["s"]
    per_node = n["per_node"]
    w_full = k.remat[2]
    act_bytes = tokens * n["h"] * ab

    compute = layers * c["layer"] + extra_compute
    # --- gradient accumulation: this micro-batch's share of the step's adds into the
    #     accumulator, memory-bound over this device's gradient shard ---
    grad_elems = stage_grad_elems(k, n, layers, extra_params)
    accum = (accum_adds(k, n) / jnp.maximum(k.grad_accum, 1.0) * grad_elems
             * accum_bytes_per_param(n) / (n["mem_bw"] * n["rt_mem_eff"]))
    # --- kernel launches: exposed where the kernels are shorter than their launches ---
    launch = launch_exposed(compute + layers * mb["layer"] + extra_memory + accum,
                            stage_kernels(k, n, layers), n)
    memory = layers * mb["layer"] + extra_memory + accum + launch
    busy = compute + memory

    # --- ZeRO-3 traffic: weights gathered for the forward (again when recomputing) and the
    #     backward, gradients reduce-scattered, for every micro-batch ---
    per_layer, _, _, _ = stage_params(k, n)
    lora = n["lora"]
    lora_tp, base_tp = lora_per_device(n, tp, k.ep)
    w_layer = (lora * (base_tp * n["base_bytes"] + (per_layer - base_tp) * n["frozen_bytes"]
                       + lora_tp * n["param_bytes"])
               + (1.0 - lora) * per_layer * gathered_param_bytes(n))
    # (the gradients reduce-scattered as they are held, `held_grad_bytes`, or in the compute
    # dtype where FSDP's mixed precision reduces in it, ``fsdp_reduce_compute_dtype``)
    hgb = held_grad_bytes(n)
    rgb = hgb + (n["rt_fsdp_mixed_precision"] * n["rt_fsdp_reduce_compute_dtype"]
                 * (compute_weight_bytes(n) - hgb))
    g_layer = (lora * lora_tp + (1.0 - lora) * per_layer) * rgb
    gather_once = layers * w_layer + extra_params * _weight_bytes(n)
    # (a fully recomputed block's parameters gathered again for its recomputation, where the
    # runtime does so: ``zero3_regather_for_remat``)
    regathers = w_full * _coeff(n, "zero3_regather_for_remat")
    gather = (2.0 + regathers) * gather_once
    scatter = (layers * g_layer + (1.0 - lora) * extra_params * rgb)
    colls = n["rt_zero3_collectives_per_layer"] * layers

    # --- the stage's ring collectives, in one vectorised evaluation: the tensor-parallel
    #     all-reduce of a block's output, the ZeRO-3 gather (one more, forward and backward,
    #     for the stage's embedding / head) and reduce-scatter, and the pipeline's re-gather
    #     of a tensor-parallel-split activation, and FSDP's ZeRO-2 gather (once, forward) ---
    #     and, under hybrid sharding, the all-reduce of each reduce-scattered gradient shard
    #     across the replicas (``scatter / zdp`` bytes over dp_replicate ranks, tp x zdp apart)
    tp_per, tp_nodes = comm.group_layout(tp, 1.0, per_node)
    dp_per, dp_nodes = comm.group_layout(zdp, tp, per_node)
    rep_per, rep_nodes = comm.group_layout(k.dpr, tp * zdp, per_node)
    one_ar, gather_coll, scatter_coll, regather_coll, gather2_coll, replica_ar = _unstack(
        comm.ring_collectives_s(
            _col(act_bytes, gather, scatter, act_bytes, gather_once, scatter / zdp),
            _col(tp, zdp, zdp, tp, zdp, k.dpr),
            _col(tp_per, dp_per, dp_per, tp_per, dp_per, rep_per),
            _col(tp_nodes, dp_nodes, dp_nodes, tp_nodes, dp_nodes, rep_nodes), n,
            count=_col(1.0, colls * (2.0 + regathers) + 2.0, colls + 1.0, 1.0, colls + 1.0,
                       colls + 1.0),
            passes=jnp.asarray([2.0, 1.0, 1.0, 1.0, 1.0, 2.0])), 6)

    # --- tensor parallelism: all-reduces of the block's output, per block ---
    ar_per_block = 2.0 * (1.0 - n["mlp"]) + n["mlp"]          # attention + MLP (plain MLP: 1)
    # (an 8-bit recipe whose tensor parallelism all-gathers the 8-bit inputs of the block's
    # input matrices, ``tp_fp8_allgather``: under sequence parallelism each forward pair of an
    # all-gather and a reduce-scatter moves 1-byte then compute-dtype elements)
    ag8 = _coeff(n, "tp_fp8_allgather") * n["fp8_linear"] * k.sp
    ag_share = 1.0 - ag8 * (1.0 - 1.0 / n["act_bytes"])
    tp_fwd = ar_per_block * (1.0 + w_full) * one_ar * 0.5 * (1.0 + ag_share)
    tp_bwd = ar_per_block * one_ar
    # (a runtime whose forward overlap needs sequence parallelism, ``overlap_tp_fwd_needs_sp``:
    # Megatron's --tp-comm-overlap pipelines all-gathers and reduce-scatters, not all-reduces)
    needs_sp = _coeff(n, "overlap_tp_fwd_needs_sp")
    fwd_share = n["rt_overlap_tp_fwd"] * (1.0 - needs_sp * (1.0 - k.sp))
    fwd_exp, _ = comm.overlap(tp_fwd, c["layer_fwd"], fwd_share)
    bwd_exp, _ = comm.overlap(tp_bwd, c["layer_dw"], n["rt_overlap_tp_bwd"])
    # asynchronous tensor parallelism (``async_tp``, torchtitan's): TorchInductor's
    # micro-pipeline pass (torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses each
    # all-gather with the matmul that reads its output (fused_all_gather_matmul) and each
    # reduce-scatter with the matmul that writes its input (fused_matmul_reduce_scatter), so a
    # collective (half an all-reduce's time) hides behind that one matmul and no other: forward,
    # recomputed and backward alike (the backward's input-gradient matmul has the forward's
    # FLOPs and shape)
    a_tp = n["async_tp"]
    attn = 1.0 - n["mlp"]
    beside = jnp.stack([attn, attn, 1.0, 1.0])     # a plain MLP block has no attention's pair
    fwd_colls = 0.5 * one_ar * jnp.stack([ag_share, 1.0, ag_share, 1.0])   # AG, RS, AG, RS
    async_fwd = jnp.sum(beside * jnp.maximum(fwd_colls - c["tp_windows"], 0.0))
    async_bwd = jnp.sum(beside * jnp.maximum(0.5 * one_ar - c["tp_windows"], 0.0))
    fwd_exp = a_tp * (1.0 + w_full) * async_fwd + (1.0 - a_tp) * fwd_exp
    bwd_exp = a_tp * async_bwd + (1.0 - a_tp) * bwd_exp
    fwd_hid, bwd_hid = tp_fwd - fwd_exp, tp_bwd - bwd_exp
    tp_exposed = layers * (fwd_exp + bwd_exp) + tp_extra_ar * one_ar
    tp_hidden = layers * (fwd_hid + bwd_hid)

    # --- MoE all-to-all: dispatch and combine, forward (and recomputed) and backward ---
    ep_per, ep_nodes = comm.group_layout(k.ep, tp, per_node)
    cap = n["moe"] * n["rt_moe_capacity_factor"] + (1.0 - n["moe"])
    a2a_bytes = act_bytes * n["topk"] * cap * shard(k.sp, tp) * n["f_routed_frac"]
    a2a = n["moe"] * comm.all_to_all_s(a2a_bytes, k.ep, ep_per, ep_nodes, n) * (4.0 + 2.0 * w_full)
    moe_exp, moe_hid = comm.overlap(a2a, c["layer"], n["rt_overlap_moe"])
    moe_exposed, moe_hidden = layers * moe_exp, layers * moe_hid

    # --- context parallelism: ring attention's keys and values (`rank_sequences`;
    #     torch/distributed/tensor/experimental/_context_parallel/_attention.py, v2.13). The
    #     forward pass all-gathers every rank's keys and values once per block (again when the
    #     block is recomputed), issued before the rank's own chunk is computed and waited on
    #     after it; the backward pass gathers them again and passes the float32 dk, dv round
    #     the ring, cp - 1 steps each behind the next chunk's attention backward. ---
    cp_per, cp_nodes = comm.group_layout(k.cp, tp, per_node)
    kv_bytes = k.cp * tokens * (n["k_w"] + n["v_w"]) / tp * ab     # the gathered buffer
    kv_gather, dkv_ring = _unstack(comm.ring_collectives_s(
        _col(kv_bytes, kv_bytes * 4.0 / ab), k.cp, cp_per, cp_nodes, n,
        passes=jnp.asarray([1.0, 1.0])), 2)
    cp_fwd_exp, cp_fwd_hid = comm.overlap((1.0 + w_full) * kv_gather, c["attn_s"] / k.cp, 1.0)
    cp_bwd_exp, cp_bwd_hid = comm.overlap(kv_gather + dkv_ring, c["attn_bwd_s"], 1.0)
    cp_exposed = layers * (cp_fwd_exp + cp_bwd_exp)
    cp_hidden = layers * (cp_fwd_hid + cp_bwd_hid)

    # --- ZeRO-3 time: the framework's own fetch path, in series with the gathers it stages ---
    # (none of it per micro-batch under a pipeline schedule without per-micro-batch sync,
    # ``zero_pp_nosync``: once a step instead, in `time_terms`)
    per_mb = 1.0 - pp_nosync(k, n)
    gather_s = gather_coll + fetch_s(gather, zdp, n)
    # (under hybrid sharding, each reduce-scattered gradient shard all-reduced across the
    # replicas: with ZeRO's own collectives, or, where the runtime issues it as a data-
    # parallel all-reduce of its own (``replica_ar_as_dp``: XLA's SPMD partitioner, an
    # all-reduce over the data axis after the fsdp axis's reduce-scatter), hidden as the
    # data-parallel gradient all-reduce is, ``overlap_dp``)
    as_dp = _coeff(n, "replica_ar_as_dp")
    z3 = per_mb * k.zero[3] * (gather_s + scatter_coll + (1.0 - as_dp) * replica_ar)
    # --- ZeRO-2 as FSDP's SHARD_GRAD_OP (``zero2_per_group``): each group gathered once per
    #     micro-batch for its forward pass (the unsharded copy kept to its backward pass, a
    #     recomputed block's too) and its gradients reduce-scattered as it is differentiated,
    #     one collective each per group, prefetched and overlapped as ZeRO-3's ---
    z2_groups = _coeff(n, "zero2_per_group") * k.zero[2]
    z3 = z3 + per_mb * z2_groups * (
        gather2_coll + fetch_s(gather_once, zdp, n) + scatter_coll + (1.0 - as_dp) * replica_ar)
    replica_dp = per_mb * (k.zero[3] + z2_groups) * as_dp * replica_ar

    # --- pipeline: send activations forward and gradients back, once per model chunk ---
    v = k.vpp
    split = jnp.maximum(k.sp, n["rt_pp_scatter_gather"])      # each send carries 1/tp of it
    cross = jnp.clip(tp * dp / per_node, 0.0, 1.0)            # stage boundaries between nodes
    send = comm.p2p_s(act_bytes * shard(split, tp), cross, n)
    regather = (1.0 - k.sp) * n["rt_pp_scatter_gather"] * regather_coll
    pp = step_at_least(k.pp, 2.0) * 2.0 * v * (send + regather)
    # (ZeRO's collectives, the sends and the replicas' own all-reduce hide behind the stage's
    # own compute, together no more than all of it)
    (zero_exposed, zero_hidden), (pp_exposed, pp_hidden), (rep_exposed, rep_hidden) = \
        comm.overlap_shared([z3, pp, replica_dp], busy,
                            [n["rt_overlap_zero"], n["rt_overlap_pp"], n["rt_overlap_dp"]])
    zero_exposed, zero_hidden = zero_exposed + rep_exposed, zero_hidden + rep_hidden

    exposed = {"tp": tp_exposed, "moe": moe_exposed, "zero": zero_exposed, "pp": pp_exposed,
               "cp": cp_exposed}
    hidden = tp_hidden + moe_hidden + zero_hidden + pp_hidden + cp_hidden
    total = busy + sum(exposed.values())
    return {"compute": compute, "memory": memory, "hidden": hidden, "total": total,
            "bwd": layers * c["layer_bwd"], "fwd": layers * c["layer_fwd"] + extra_fwd,
            "accum": accum, "launch": launch, **exposed}


def stage_extras(n: dict, c: dict, mb: dict, first_p, last_p, is_first, is_last) -> dict:
    """The `stage_time` extras of a stage holding the embedding (``is_first``) and / or the
    final norm, head and loss (``is_last``), each a weight in [0, 1]: their compute, memory-
    bound work and parameters, and one tensor-parallel all-reduce each (the vocabulary-
    parallel embedding's output; the head's input gradient)."""
    return {"extra_compute": is_first * c["first"] + is_last * c["last"],
            "extra_fwd": is_first * c["first_fwd"] + is_last * c["last_fwd"],
            "extra_memory": is_first * mb["first"] + is_last * mb["last"],
            "extra_params": is_first * first_p + is_last * last_p,
            "tp_extra_ar": is_first * n["embed_vocab"] + is_last * n["logit_tp"]}


def end_stage_extras(k: Knobs, n: dict, c: dict, mb: dict) -> tuple[dict, dict]:
    """The `stage_time` extras of the first pipeline stage (embedding) and of the last (head
    and loss); at pp = 1 one stage holds both, and the two are the same."""
    _, first_p, last_p, multi = stage_params(k, n)
    single = 1.0 - multi
    return (stage_extras(n, c, mb, first_p, last_p, 1.0, single),
            stage_extras(n, c, mb, first_p, last_p, single, 1.0))


def end_stages(k: Knobs, n: dict, c: dict, mb: dict) -> dict:
    """`stage_time` of the first and the last pipeline stage, stacked on a leading axis of two
    (first, last): one stage evaluation under `jax.vmap` over the extras, so what the two
    stages share (everything but their embedding / head terms) is computed once."""
    first, last = end_stage_extras(k, n, c, mb)
    extras = {key: jnp.stack(jnp.broadcast_arrays(first[key], last[key])) for key in first}
    layers = stage_blocks(k, n)
    return jax.vmap(lambda e: stage_time(k, n, layers=layers, c=c, mb=mb, **e))(extras)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------


def time_terms(k: Knobs, n: dict, mem: dict) -> tuple[dict, dict]:
    """(time, throughput) of one optimizer step, as dicts of scalars.

    time: compute_s, memory_bound_s, comm_<kind>_s (exposed, kind in dp zero tp pp moe),
    comm_exposed_s, comm_hidden_s, bubble_s, optimizer_s, offload_s, input_s, step_s; and two
    named parts of those: grad_accum_s (accumulation adds, in memory_bound_s), dequant_s
    (QLoRA's dequantisation of its 4-bit matrices, in memory_bound_s; their launches are in
    launch_s) and launch_s (exposed per-kernel overhead, in memory_bound_s and optimizer_s).
    throughput: tokens_per_s, tokens_per_s_per_device, samples_per_s, model_flops,
    hardware_flops, mfu, hfu, tflops_per_device (hardware FLOPs), time_to_train_s (0 without
    ``train_tokens``), cost_per_million_tokens (USD; 0 without a price).
    """
    c = compute_times(k, n)
    mb = memory_bound_times(k, n)
    layers = stage_blocks(k, n)
    both = end_stages(k, n, c, mb)
    take_first = both["total"][0] >= both["total"][1]
    st = {key: jnp.where(take_first, v[0], v[1]) for key, v in both.items()}

    m = k.grad_accum
    t_mb = st["total"]
    v = k.vpp
    bubble_s = jnp.maximum(k.pp - 1.0, 0.0) / v * t_mb

    # --- once per step: gradient synchronisation across data-parallel replicas ---
    tp, dp, per_node = k.tp, k.dp, n["per_node"]
    zdp = shard_group(k)                 # ZeRO's group: dp, or the shard group under HSDP
    z = k.zero
    dp_per, dp_nodes = comm.group_layout(dp, tp, per_node)
    zdp_per, zdp_nodes = comm.group_layout(zdp, tp, per_node)
    rep_per, rep_nodes = comm.group_layout(k.dpr, tp * zdp, per_node)
    trainable = mem["trainable_params"]
    grads = mem["grads_reduced_bytes"]      # as memory holds them (the embedding's table in f32)
    # buckets of dp_bucket_bytes, each collective bucketed on its own bytes; or, where the
    # runtime buckets by elements (``dp_bucket_elems``: Megatron-Core's buffers, the larger of
    # dp_bucket_elems and dp x dp_bucket_elems_per_rank, which keeps large rings bandwidth-
    # bound), one bucketing shared by the gradients and the parameters gathered after the step
    by_elems = step_at_least(_coeff(n, "dp_bucket_elems"), 1.0)
    bucket_elems = jnp.maximum(jnp.maximum(_coeff(n, "dp_bucket_elems"),
                                           dp * _coeff(n, "dp_bucket_elems_per_rank")), 1.0)
    elem_buckets = jnp.maximum(trainable / bucket_elems, 1.0)
    params_out = trainable * n["param_bytes"]

    def bucketed(nbytes):
        # (dp_bucket_bytes = 0: no bucketing, one collective for all of it)
        size = n["rt_dp_bucket_bytes"]
        by_bytes = jnp.where(size > 0.0, jnp.maximum(nbytes / jnp.where(size > 0.0, size, 1.0),
                                                      1.0), 1.0)
        return by_elems * elem_buckets + (1.0 - by_elems) * by_bytes
    buckets, gather_buckets = bucketed(grads), bucketed(params_out)
    # the all-reduce (ZeRO 0), the reduce-scatter (ZeRO 1, 2) and the re-gather of the
    # updated parameters (ZeRO 1, 2) over the data-parallel group, in one evaluation
    # (ZeRO-1/2 under hybrid sharding: the reduce-scatter and the gather over the shard group,
    # each reduce-scattered bucket's shard then all-reduced across the replicas)
    allreduce, scatter, gathered, replica_ar = _unstack(comm.ring_collectives_s(
        _col(grads, grads, params_out, grads / zdp), _col(dp, zdp, zdp, k.dpr),
        _col(dp_per, zdp_per, zdp_per, rep_per), _col(dp_nodes, zdp_nodes, zdp_nodes, rep_nodes),
        n, count=_col(buckets, buckets, gather_buckets, buckets),
        passes=jnp.asarray([2.0, 1.0, 1.0, 2.0])), 4)
    scatter = scatter + replica_ar
    # the share of the gradient reduction issued during the backward pass: ``overlap_dp``, or
    # every bucket but the last (``overlap_dp_buckets``: each bucket is reduced as soon as its
    # gradients are ready, the last when the backward pass has ended)
    by_bucket = _coeff(n, "overlap_dp_buckets")
    frac_dp = by_bucket * (1.0 - 1.0 / buckets) + (1.0 - by_bucket) * n["rt_overlap_dp"]
    dp_exposed, dp_hidden = comm.overlap(z[0] * allreduce, st["bwd"], frac_dp)
    # ZeRO-1 reduce-scatters the accumulated gradients once per step; ZeRO-2 keeps only its
    # shard of the accumulator, so every micro-batch's gradients are reduce-scattered (the
    # validation step's sharded accumulator; DeepSpeed stage 2 reduces every micro-step)
    rs1_exposed, rs1_hidden = comm.overlap(z[1] * scatter, st["bwd"], frac_dp)
    # (FSDP's ZeRO-2, ``zero2_per_group``, communicates per group in the stage instead: no
    # bucketed reduce-scatter, no gather of the updated parameters after the step)
    z2_buckets = z[2] * (1.0 - _coeff(n, "zero2_per_group"))
    rs2_exposed, rs2_hidden = comm.overlap(z2_buckets * scatter, st["bwd"], frac_dp)
    rs_exposed = rs1_exposed + m * rs2_exposed
    rs_hidden = rs1_hidden + m * rs2_hidden
    # the updated parameters' all-gather: after the step, or (``overlap_param_gather``)
    # bucket by bucket behind the next step's first forward pass, the first bucket waited for
    # (the stage's forward matmul seconds, the window in which its buckets are waited for,
    # the embedding's and the head's forward GEMMs included, their backward not. Tensor-parallel
    # communication hidden in the same GEMMs does not shorten it: it crosses the tensor-
    # parallel group's links, this gather the data-parallel group's, the network once the
    # tensor-parallel group fills a node; below that both share NVLink, which this ignores)
    fwd_window = st["fwd"]
    frac_pg = _coeff(n, "overlap_param_gather") * (1.0 - 1.0 / gather_buckets)
    regather, regather_hidden = comm.overlap((z[1] + z2_buckets) * gathered, fwd_window,
                                             frac_pg)

    # ZeRO-2/3 under a pipeline schedule without per-micro-batch sync (``zero_pp_nosync``):
    # each group gathered once, in the first micro-batch's forward pass (prefetched behind it
    # as ZeRO-3's gathers are, ``overlap_zero``), and the unsharded gradients reduce-scattered
    # once, after the stage's last backward pass, where nothing is left to hide it (the
    # schedule's REDUCE_GRAD action and the wait that ends it, torch/distributed/pipelining/
    # stage.py perform_reduce_grad, v2.13)
    # (under hybrid sharding, each group's reduce-scattered shard all-reduced across the
    # replicas after it)
    ns = pp_nosync(k, n) * (z[2] + z[3])
    ns_gather, ns_scatter, ns_replica = _unstack(comm.ring_collectives_s(
        _col(trainable * _weight_bytes(n), grads, grads / zdp), _col(zdp, zdp, k.dpr),
        _col(zdp_per, zdp_per, rep_per), _col(zdp_nodes, zdp_nodes, rep_nodes), n,
        count=_col(layers + 1.0, layers + 1.0, layers + 1.0),
        passes=jnp.asarray([1.0, 1.0, 2.0])), 3)
    ns_scatter = ns_scatter + ns_replica
    ns_gather_exposed, ns_gather_hidden = comm.overlap(ns * ns_gather, st["fwd"],
                                                       n["rt_overlap_zero"])
    comm_s = {"dp": dp_exposed,
              "zero": (m * st["zero"] + rs_exposed + regather + ns_gather_exposed
                       + ns * ns_scatter),
              "tp": m * st["tp"], "pp": m * st["pp"], "moe": m * st["moe"], "cp": m * st["cp"]}
    comm_exposed = sum(comm_s.values())
    comm_hidden = m * st["hidden"] + dp_hidden + rs_hidden + regather_hidden + ns_gather_hidden

    # --- optimizer update and offload ---
    f_opt = z[1] + z[2] + z[3]
    has_master = jnp.clip(n["master_bytes"], 0.0, 1.0)
    per_param = (n["grad_bytes"] * (1.0 + n["grad_clip"]) + 2.0 * n["opt_bytes"]
                 + has_master * (2.0 * n["master_bytes"] + n["param_bytes"])
                 + (1.0 - has_master) * 2.0 * n["param_bytes"])
    update_bytes = trainable * shard(f_opt, zdp) * per_param
    # (under parameter offload the step runs on the host, ``host_update_bytes_s``)
    op = k.offload_params
    update_s = ((1.0 - op) * update_bytes / (n["mem_bw"] * n["rt_mem_eff"])
                + op * update_bytes / n["rt_host_update_bytes_s"])
    # its kernels: ``optimizer_kernels_per_layer`` per block of the stage, launched once a step
    # (stepped in the backward pass, ``opt_in_bwd``: one fused kernel a trainable tensor,
    # torchtitan's per-parameter optimizers; the same update work, inside the backward pass)
    oib = n["opt_in_bwd"]
    opt_kernels = layers * ((1.0 - oib) * _coeff(n, "optimizer_kernels_per_layer")
                            + oib * n["tensors_per_layer"])
    opt_launch = launch_exposed(update_s, opt_kernels, n)
    optimizer_s = update_s + opt_launch
    link = n["host_bw"] * n["rt_host_eff"]
    # (an offloaded optimizer state streamed to the device and back for its update; stepped
    # on the host under parameter offload, it does not cross)
    offload_s = ((1.0 - n["rt_overlap_offload"]) * 2.0 * (1.0 - op)
                 * mem["host_optimizer_bytes"] / link)
    # parameter offload (FSDP2's CPUOffloadPolicy, torch v2.13): each all-gather's shard
    # copied to the device before it (forward, backward, a recomputed block's regather where
    # the runtime regathers), each reduce-scatter's shard back after it, on the collectives'
    # side streams (non_blocking from pinned memory): exposed where they outlast the matmuls
    # they run beside; from the second micro-batch on a gradient shard is added into the
    # host's .grad, so its copy is synchronous (_fsdp_collectives.py foreach_reduce:
    # non_blocking only where no .grad exists yet), exposed whole
    gathers = 2.0 + k.remat[..., 2] * _coeff(n, "zero3_regather_for_remat")
    h2d = mem["offloaded_param_bytes"] / link
    d2h = mem["offloaded_grad_bytes"] / link
    h2d_fwd = jnp.maximum(h2d - st["fwd"], 0.0)             # (every micro-batch's forward)
    h2d_bwd = (gathers - 1.0) * h2d                         # (its backward's gathers)
    offload_s = offload_s + (m * h2d_fwd + jnp.maximum(h2d_bwd + d2h - st["bwd"], 0.0)
                             + (m - 1.0) * (jnp.maximum(h2d_bwd - st["bwd"], 0.0) + d2h))
    # activation offloading: each micro-batch's saved tensors copied to the host during its
    # forward pass and back during its backward pass, on a side stream: exposed where a copy
    # outlasts the matmuls it runs beside (the stage's forward, its backward)
    act_copy = mem["offloaded_activation_bytes"] / link
    offload_s = offload_s + m * (jnp.maximum(act_copy - st["fwd"], 0.0)
                                 + jnp.maximum(act_copy - st["bwd"], 0.0))
    # a paged optimizer's state beyond what the device has left beside everything else is on
    # the host: the update brings each parameter's pages back (bitsandbytes' prefetch_state,
    # before the parameter's update, in series with it), which sends as many others out, so
    # that share crosses the host link twice a step; none where the state fits. What the
    # device has left: its memory less the caching allocator's reserved memory (the cached
    # free blocks included: an allocation that the driver serves by evicting managed pages
    # does not fail, so the allocator never frees them), the context and the workspaces
    # (`capopt.cost.memory.memory`: ``device_used_bytes``)
    paged = mem["paged_optimizer_bytes"]
    evicted = jnp.clip(paged - (n["vram_bytes"] - mem["device_used_bytes"]), 0.0, paged)
    paging_s = 2.0 * evicted / link
    offload_s = offload_s + paging_s

    # --- input pipeline ---
    seqs, tokens = step_tokens(k, n)
    rate = n["input_rate"]
    input_s = jnp.where(rate > 0.0, seqs / jnp.maximum(rate, 1e-30), 0.0)

    compute_s = m * st["compute"]
    memory_s = m * st["memory"]
    busy_s = (compute_s + memory_s + comm_exposed + bubble_s + optimizer_s + offload_s)
    step_s = jnp.maximum(busy_s, input_s)

    time = {"compute_s": compute_s, "memory_bound_s": memory_s,
            **{f"comm_{kind}_s": comm_s[kind] for kind in KINDS},
            "comm_exposed_s": comm_exposed, "comm_hidden_s": comm_hidden,
            "bubble_s": bubble_s, "optimizer_s": optimizer_s, "offload_s": offload_s,
            "input_s": input_s, "step_s": step_s,
            # parts of the terms above, named: accumulation adds and 4-bit dequantisation (in
            # memory_bound_s), the exposed per-kernel overhead (in memory_bound_s and
            # optimizer_s)
            "grad_accum_s": m * st["accum"], "launch_s": m * st["launch"] + opt_launch,
            "dequant_s": m * layers * mb["dequant"], "paging_s": paging_s}

    # --- throughput ---
    devices = k.dp * k.tp * k.pp
    mf = model_flops(k, n)
    hf = mf + recompute_flops(k, n)           # hardware_flops, model FLOPs counted once
    peak = devices * n["matmul_peak"]
    tps = tokens / step_s
    train = n["train_tokens"]
    price = n["price"]
    throughput = {
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / devices,
        "samples_per_s": seqs / step_s,
        "model_flops": mf,
        "hardware_flops": hf,
        "mfu": mf / (step_s * peak),
        "hfu": hf / (step_s * peak),
        "tflops_per_device": hf / (step_s * devices) / 1e12,
        "time_to_train_s": jnp.where(train > 0.0, train / tps, 0.0),
        "cost_per_million_tokens": jnp.where(
            price > 0.0, price * devices * step_s / 3600.0 / (tokens / 1e6), 0.0),
    }
    throughput.update(assumed_rates(c, n))
    return time, throughput


def assumed_rates(c: dict, n: dict) -> dict:
    """The rates the time terms assume on one device (``c``: `compute_times`): the blocks'
    weight GEMMs and attention core (TFLOP/s, and as a share of the dtype's peak; attention
    FLOPs counted over the whole s x s score matrix, as MFU counts them, which a causal kernel
    executes about half of), streaming element-wise kernels (TB/s of HBM) and ring
    collectives (bus GB/s inside a node and across nodes)."""
    gemm = c["gemm_flops"] / jnp.maximum(c["gemm_s"], 1e-30)
    attn = c["attn_flops"] / jnp.maximum(c["attn_s"], 1e-30)
    intra, inter = comm.links(n)
    return {"gemm_tflops": gemm / 1e12, "gemm_peak_share": gemm / n["matmul_peak"],
            "attention_tflops": attn / 1e12, "attention_peak_share": attn / n["attn_peak"],
            "hbm_tb_s": n["mem_bw"] * n["rt_mem_eff"] / 1e12,
            "nccl_intra_gb_s": intra / 1e9, "nccl_inter_gb_s": inter / 1e9}


__all__ = ["KINDS", "STEP_TERMS", "accum_adds", "accum_bytes_per_param", "assumed_rates",
           "end_stage_extras",
           "end_stages", "launch_exposed",
           "memory_bound_times", "smooth_max", "stage_grad_elems", "stage_kernels", "stage_time",
           "time_terms"]
