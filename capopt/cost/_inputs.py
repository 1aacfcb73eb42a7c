"""The cost model's two inputs: `Knobs` (decision variables) and `Numbers` (the scenario).

Both are pytrees of scalars, so `estimate` is one traced function: the optimiser
differentiates it in the knobs, and scenarios of the same shape reuse one compilation.
Categorical scenario choices (precision, optimizer, family) arrive here already turned
into numbers; categorical *knobs* (ZeRO stage, remat policy) are weight vectors, one-hot at a
real config and mixtures at a relaxed point.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime import (ADAM8BIT_MIN_SIZE, INT8_SCALE_BYTES, PAGED_STATE_MIN_SIZE,
                        adafactor_state_elems, adam8bit_moment_bytes, flash_share_sm90,
                        nf4_bytes_per_weight, nf4_scale_bytes)
from .._inventory import inventory, trainable
from .._specs import CHUNKED_LOSS_CHUNKS, Config, LoRA, Scenario, lora_adapters_bf16

DTYPE = jnp.float32


@dataclass(frozen=True)
class Knobs:
    """Per-knob values; floats, integers at a real config.

    zero:  weights over ZeRO stages (0, 1, 2, 3), shape (..., 4)
    remat: fraction of layers under (none, selective, full) recomputation, shape (..., 3)
    sp, offload, flash: in [0, 1]
    cp: the context-parallel degree, a sub-group of dp (`capopt._specs.Config.cp`)
    vpp: virtual pipeline stages a pipeline rank (interleaved 1F1B; `capopt._specs.Config.vpp`)
    dpr: hybrid-sharding replicas of the ZeRO shard group (`capopt._specs.Config.dp_replicate`;
         the group is ``dp / dpr``, `shard_group`); 1 where a caller leaves it out
    offload_params: parameters, gradients and the optimizer step on the host, in [0, 1]
         (`capopt._specs.Config.offload_params`); 0 where a caller leaves it out
    """

    micro_batch: jax.Array
    grad_accum: jax.Array
    dp: jax.Array
    tp: jax.Array
    pp: jax.Array
    ep: jax.Array
    zero: jax.Array
    remat: jax.Array
    sp: jax.Array
    offload: jax.Array
    flash: jax.Array
    cp: jax.Array
    vpp: jax.Array
    dpr: jax.Array = 1.0
    offload_params: jax.Array = 0.0

    def replace(self, **changes) -> "Knobs":
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    Knobs, data_fields=[f.name for f in dataclasses.fields(Knobs)], meta_fields=[])


def shard_group(k: Knobs):
    """Ranks ZeRO splits the state over: ``dp / dpr`` (all of dp without hybrid sharding)."""
    return k.dp / k.dpr


def runtime_knobs(k: Knobs, n: dict) -> Knobs:
    """The knobs as the runtime applies them: blockwise attention only where its kernel tiles
    the sequence (``flash_ok``, `scenario_numbers`); elsewhere the scores are materialised
    whatever ``flash_attention`` says."""
    return k.replace(flash=k.flash * n["flash_ok"])


def step_at_least(x, threshold):
    """0 at ``x <= threshold - 1``, 1 at ``x >= threshold``, linear between (exact at integers)."""
    return jnp.clip(x - (threshold - 1.0), 0.0, 1.0)


def rank_sequences(k: Knobs):
    """Sequences' worth of tokens one rank computes per micro-batch: ``micro_batch / cp``.

    Context-parallel ranks share each micro-batch's sequences, a rank holding 1/cp of every
    one, so every token-proportional term (activations, GEMMs, logits, the step's sequences)
    counts ``micro_batch / cp`` sequences; the rank's queries still attend to the whole
    sequence (``s`` keys, as the attention terms count them). What the exchange of keys and
    values adds is `capopt.cost.activations.context_parallel_transient` (memory) and the
    ring's traffic in `capopt.cost.time` (time)."""
    return k.micro_batch / k.cp


def runtime_numbers(k: Knobs, n: dict) -> dict:
    """The numbers as the runtime's rules apply at these knobs: a runtime that mixes precision
    by FSDP's parameter dtype (``fsdp_mixed_precision``) uses no autocast under ZeRO-2/3 (its
    weight of the two stages), and autocast as its profile says below them."""
    fsdp = n["rt_fsdp_mixed_precision"] * (k.zero[..., 2] + k.zero[..., 3])
    keep = 1.0 - fsdp
    # the attention kernel's share of the peak over its sequence (``flash_half_seq``, below):
    # under context parallelism each kernel call sees s / cp keys
    half = n["flash_half_seq"]
    s_cp = n["s"] / k.cp
    flash_eff = n["rt_flash_eff"] * (s_cp / (s_cp + half)) * ((n["s"] + half) / n["s"])
    return {**n, "rt_autocast_casts": n["rt_autocast_casts"] * keep,
            "rt_autocast_weight_cache": n["rt_autocast_weight_cache"] * keep,
            "rt_weight_copy_fraction": n["rt_weight_copy_fraction"] * keep,
            "rt_flash_eff": flash_eff}


def knobs_from_config(cfg: Config, layers: float | None = None) -> Knobs:
    """The knobs of a real config; with the model's ``layers``, a recomputed fraction counts
    whole blocks of a stage (`capopt._specs.remat_weights`)."""
    zero = np.zeros(4, np.float32)
    zero[cfg.zero_stage] = 1.0
    f = lambda v: jnp.asarray(float(v), DTYPE)  # noqa: E731
    return Knobs(
        micro_batch=f(cfg.micro_batch), grad_accum=f(cfg.grad_accum), dp=f(cfg.dp),
        tp=f(cfg.tp), pp=f(cfg.pp), ep=f(cfg.ep), zero=jnp.asarray(zero),
        remat=jnp.asarray(cfg.remat_weights(layers), DTYPE), sp=f(cfg.sequence_parallel),
        offload=f(cfg.offload_optimizer), flash=f(cfg.flash_attention), cp=f(cfg.cp),
        vpp=f(cfg.vpp), dpr=f(cfg.dp_replicate), offload_params=f(cfg.offload_params))


def stack_knobs(configs: list[Config], layers: float | None = None) -> Knobs:
    """Many configs as one batched `Knobs` (leading axis), for `vmap`."""
    ks = [knobs_from_config(c, layers) for c in configs]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *ks)


# --------------------------------------------------------------------------------------------
# Scenario -> numbers
# --------------------------------------------------------------------------------------------
OPT_STATES = {  # optimizer-state elements per trainable parameter
    "adamw": 2.0, "adam": 2.0, "sgd": 0.0, "sgd-momentum": 1.0, "lion": 1.0,
    "adafactor": None, "adamw-8bit": None,
}


def parameter_groups(tensors, layers: int, topk: int) -> dict[str, float]:
    """Parameters by how tensor parallelism splits them, from the inventory's roles, per
    block averaged over the ``layers`` blocks (an MoE's dense first layers and its expert
    layers hold different tensors; uniform blocks are counted exactly):

    ``P_layer_tp``   one block's column- and row-parallel tensors (q/k/v/gate/up kernels and
                     biases, o/down kernels; the plain MLP stack: every layer): split by tp;
    ``P_layer_kv``   the k/v part of ``P_layer_tp``: replicated when tp exceeds the KV heads;
    ``P_layer_rep``  one block's replicated tensors (norms, router, row-parallel biases);
    ``P_expert``     one expert of one block; ``P_expert_rep`` its replicated part (down bias);
    ``P_embed_tp`` / ``P_head_tp``  vocabulary-parallel tables, heads and logit biases;
    ``P_embed_rep`` / ``P_head_rep``  the rest of the embeddings / of the head.
    ``W_*``: one block's GEMM weight elements applied to every token (routed experts: the
    ``topk`` each token visits), for the matmul FLOPs (`capopt.cost.flops`); ``W_ex_in`` /
    ``W_ex_down`` the routed experts' part of ``W_in`` / ``W_down``; ``W_qkv_rep`` the
    replicated part of ``W_qkv`` (latent attention's q_a and kv_a).
    """
    g = dict.fromkeys(("P_layer_tp", "P_layer_kv", "P_layer_rep", "P_expert", "P_expert_rep",
                       "P_embed_tp", "P_embed_rep", "P_head_tp", "P_head_rep"), 0.0)
    w = dict.fromkeys(("W_qkv", "W_qkv_rep", "W_out", "W_in", "W_down", "W_ex_in",
                       "W_ex_down", "W_router", "W_dense"), 0.0)
    for t in tensors:
        if t.lora == "adapter":
            continue
        if t.where == "block":
            per = t.elements / layers
            if t.expert:
                experts = t.shape[0]
                g["P_expert"] += per / experts
                if t.tp == "rep":
                    g["P_expert_rep"] += per / experts
            elif t.tp == "rep":
                g["P_layer_rep"] += per
            else:
                g["P_layer_tp"] += per
                if t.tp == "kv":
                    g["P_layer_kv"] += per
            key = {"q": "W_qkv", "k": "W_qkv", "v": "W_qkv", "q_a": "W_qkv", "kv_a": "W_qkv",
                   "kv_b": "W_qkv", "o": "W_out", "gate": "W_in", "up": "W_in",
                   "down": "W_down", "router": "W_router", "dense": "W_dense"}.get(t.matmul)
            if key:
                applied = per * topk / t.shape[0] if t.expert else per
                w[key] += applied
                if t.expert:
                    w["W_ex_in" if key == "W_in" else "W_ex_down"] += applied
                if key == "W_qkv" and t.tp == "rep":
                    w["W_qkv_rep"] += applied
        else:
            part = "embed" if t.where == "embed" else "head"
            g[f"P_{part}_{'tp' if t.tp == 'vocab' else 'rep'}"] += t.elements
    return {**g, **w}


def paged_state_share(opt: str, shapes, state_bytes: float) -> float:
    """The share of an optimizer's state bytes that a paged optimizer puts in managed memory:
    the state of the trainable tensors (``(shape, count)`` pairs) of `PAGED_STATE_MIN_SIZE`
    elements or more, counted as `scenario_numbers` counts the state (8-bit Adam blockwise,
    every other optimizer ``state_bytes`` a moment)."""
    total = paged = 0.0
    for shape, count in shapes:
        size = math.prod(shape)
        if opt == "adamw-8bit":
            state = 2.0 * adam8bit_moment_bytes(size)
            moved = 2.0 * size if size >= ADAM8BIT_MIN_SIZE else state
        else:
            state = moved = state_bytes * OPT_STATES[opt] * size
        total += state * count
        if size >= PAGED_STATE_MIN_SIZE:
            paged += moved * count
    return paged / total if total else 0.0


def minor_sharded_groups(tensors, layers: int) -> dict[str, float]:
    """One block's GEMM weight elements that ZeRO-3 splits on their minor (output) dimension,
    as `capopt.validation.sharding` places them: the data axes go to a dimension tensor
    parallelism leaves whole, the largest one (the first on a tie), that the group divides.

    ``P_minor_tp1``  at tp = 1: kernels ``(in, out)`` with ``out > in`` (gate, up and a plain
                     MLP's input matrix wider than the model; q where the heads are wider);
    ``P_minor_row``  at tp > 1: the row-parallel kernels (o, down), whose input dimension
                     tensor parallelism splits, so the data axes take the output one.

    Dense blocks only (routed experts are split on their own axes; not counted); every
    dimension is taken to divide by the data-parallel group.
    """
    g = {"P_minor_tp1": 0.0, "P_minor_row": 0.0}
    for t in tensors:
        if t.where != "block" or t.expert or not t.matmul or len(t.shape) != 2 \
                or t.lora == "adapter":
            continue
        per = t.elements / layers
        if t.shape[1] > t.shape[0]:
            g["P_minor_tp1"] += per
        if t.tp == "row":
            g["P_minor_row"] += per
    return g


def backward_grad_shares(tensors) -> dict[str, float]:
    """The share of one block's trainable elements (the adapters under LoRA) whose gradients
    an eager backward pass has produced by each point where the block's backward can peak:
    autograd runs the block's nodes in the reverse of their forward order and a linear
    layer's weight gradient is written by the same node as its input gradient
    (tools/autograd/derivatives.yaml, torch v2.13: mm's ``self`` and ``mat2`` gradients).
    ``grad_share_mlp``: at the MLP's backward peak (the gate/up or the activation's input
    gradients, after down's node) only down's (kernel, bias, adapters); ``grad_share_attn``:
    at the attention core's (its score gradients, after the output projection's node) the
    whole MLP's (router and experts included) and the output projection's. Norms are in
    neither (their gradients are h wide). A card without attention (the plain MLP stack) has
    share 1 at both: its backward holds nothing but the stream's gradient."""
    if not any(t.name.startswith("blocks.attn.") for t in tensors):
        return {"grad_share_mlp": 1.0, "grad_share_attn": 1.0}
    adapters = [t for t in tensors if t.lora == "adapter"]
    block = [t for t in (adapters or tensors) if t.where == "block"]
    total = sum(t.elements for t in block) or 1
    down = sum(t.elements for t in block if ".down." in t.name)
    mlp = sum(t.elements for t in block if t.name.startswith(
        ("blocks.mlp.", "blocks.dense_mlp.", "blocks.attn.o.")))
    return {"grad_share_mlp": down / total, "grad_share_attn": mlp / total}


def attention_widths(m) -> dict[str, float]:
    """Per-token widths of one block's attention (and its MLP), for activations and traffic.

    ``q_w`` / ``k_w`` / ``v_w``: the attention core's q, k and v (heads x head width; latent
    attention expands k and v for every head); ``o_w``: its output (the output projection's
    input); ``latent_w``: latent attention's tensors outside the core that its backward reads,
    replicated over tp (q_a's output and its norm's, kv_a's output and its norm's);
    ``latent_norms``: the norms over them. ``dots_tp`` / ``dots_rep``: the output widths of
    the projections before the core, split over tp / replicated (q, k, v; latent attention's
    q and kv_b / q_a and kv_a). ``f_routed_frac``: the share of blocks whose MLP is
    routed experts ``f`` wide per slot (0 for a dense model); ``f_unrouted``: the MLP width
    every token goes through, averaged over blocks (a dense model's MLP; an MoE's shared
    experts and dense first blocks); ``f_max``: the widest MLP of any block.
    """
    a, hd, dv = m.num_attention_heads, m.head_size, m.v_head_size
    kvh = m.kv_heads                       # (latent attention: every head, ModelSpec checks)
    L = m.num_hidden_layers
    if m.is_mla:
        qr, kvr, rope = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
        latent = 2.0 * qr + 2.0 * kvr + rope
        dots_tp, dots_rep = a * hd + a * (hd - rope + dv), qr + kvr + rope
    else:
        latent, dots_tp, dots_rep = 0.0, a * hd + 2 * kvh * hd, 0.0
    if m.is_moe:
        frac = m.moe_layers / L
        unrouted = (m.moe_layers * m.shared_expert_intermediate_size
                    + m.first_k_dense_replace * m.dense_intermediate_size) / L
        widest = max(m.intermediate_size, m.shared_expert_intermediate_size,
                     m.dense_intermediate_size)
    else:
        frac, unrouted, widest = 0.0, m.intermediate_size, m.intermediate_size
    return {"q_w": float(a * hd), "k_w": float(kvh * hd), "v_w": float(kvh * dv),
            "o_w": float(a * dv), "latent_w": float(latent), "dots_tp": float(dots_tp),
            "dots_rep": float(dots_rep),
            "latent_norms": float((m.q_lora_rank > 0) + 1.0) if m.is_mla else 0.0,
            "f_routed_frac": float(frac), "f_unrouted": float(unrouted), "f_max": float(widest)}


def op_checkpoint_widths(tensors, layers: int, topk: int = 1) -> dict[str, float]:
    """What per-op selective checkpointing as torchtitan writes it keeps of one block's
    projections, per token, averaged over the blocks (``selective_saves_ops``).

    torchtitan's policy (``torchtitan/parallelisms/parallelize_llama.py`` at 9dec370,
    ``_apply_ac_to_transformer_block``) saves the output of every op in its ``_save_list``
    (``aten.mm``, the flash and efficient SDPA kernels, ``reduce_scatter_tensor``, ``abs``,
    ``max``) except every second ``aten.mm`` of a block, counted in the order the block runs
    them; everything else is recomputed. A projection with a bias runs as ``aten.addmm``,
    which is neither counted nor saved; batched expert GEMMs are not ``aten.mm`` either. The
    order is the inventory's (q, k, v, o; gate, up, down; an adapter's two matmuls after the
    matrix it wraps).

    ``ops_tp``: widths of the saved outputs split by tensor parallelism (column-parallel
    projections; an adapter's B on one); ``ops_whole``: widths of those whole on every tp
    rank (row-parallel outputs, partial sums before their reduction; replicated ones);
    ``ops_rows``: row-parallel projections per block (their reduce-scatters' outputs are saved
    under sequence parallelism); ``ops_recompute_w``: weight elements per token of the
    matmuls recomputed, for the FLOPs.
    """
    names = {t.name for t in tensors}
    mats = [t for t in tensors if t.where == "block"
            and (t.matmul or t.lora == "adapter") and t.matmul != "dense"]
    out = dict.fromkeys(("ops_tp", "ops_whole", "ops_rows", "ops_recompute_w"), 0.0)
    if not mats or layers <= 0:
        return out
    attn = [t for t in mats if t.name.startswith("blocks.attn.")]
    # the kinds of block: the MLP tensors each holds, by their count (an MoE's dense first
    # blocks hold ``dense_mlp``; the others the router, the experts and the shared experts)
    kinds: dict[bool, list] = {}
    for t in mats:
        if t not in attn:
            kinds.setdefault(t.name.startswith("blocks.dense_mlp."), []).append(t)
    for mlp in (kinds.values() or [[]]):
        count = mlp[0].count if mlp else layers
        share = count / layers
        mm = 0
        for t in attn + mlp:
            din, dout = t.shape[-2], t.shape[-1]
            applied = din * dout
            if t.expert:                   # a batched GEMM: recomputed, never saved
                out["ops_recompute_w"] += share * applied * topk
                continue
            row = t.tp == "row" and t.lora != "adapter"
            if row:
                out["ops_rows"] += share
            biased = (t.name.endswith(".kernel")
                      and t.name[:-len(".kernel")] + ".bias" in names)
            saved = False
            if not biased:
                mm += 1
                saved = mm % 2 == 1
            if not saved:
                out["ops_recompute_w"] += share * applied
                continue
            # an adapter's A of a column-parallel matrix is whole (its rank-wide output), B
            # split; of a row-parallel matrix both are whole (partial sums)
            split = (t.tp in ("col", "kv") and not (t.lora == "adapter"
                                                   and t.name.endswith(".lora_a")))
            out["ops_tp" if split else "ops_whole"] += share * dout
    return out


def _attn_in_names(tensors) -> tuple[str, ...]:
    """The block matrices that read the first norm's output (latent attention: q_a when the
    queries have a latent, else q; kv_a)."""
    q = "q_a" if any(t.matmul == "q_a" for t in tensors) else "q"
    return (q, "k", "v", "kv_a")


def lora_numbers(tensors, layers: int, lora: LoRA, prec: dict, coeffs: dict) -> dict:
    """LoRA's numbers from the inventory: adapters and wrapped (base) matrices per block, the
    wrapped k/v part, bytes per base weight and the 8-bit bases' float32 per-column scales
    (split by tp on column-parallel matrices, replicated on row-parallel ones)."""
    per = lambda ts: sum(t.elements for t in ts) / layers  # noqa: E731
    # per token, the inputs of the dense matrices among ``ts`` (experts' are per slot)
    inputs = lambda ts: sum(t.count * t.shape[0] for t in ts if not t.expert) / layers  # noqa
    adapters = [t for t in tensors if t.lora == "adapter"]
    base = [t for t in tensors if t.lora == "base"]
    # the wrapped dense matrices reading the first norm's output, and the second's
    attn_in = [t for t in base if t.matmul in _attn_in_names(tensors) and not t.expert]
    mlp_in = [t for t in base if t.matmul in ("gate", "up") and not t.expert]
    # the matrices stored in ``base_bits``: the wrapped ones, and under an 8- or 4-bit base
    # every other block matmul too (``quant``, `capopt._inventory.inventory`)
    stored = [t for t in tensors if t.lora in ("base", "quant")]
    eight = float(lora.base_bits == 8) * INT8_SCALE_BYTES
    # an NF4 base's scale bytes a weight (`nf4_scale_bytes`), for a runtime that keeps them
    # whole over tp (``nf4_scales_whole_over_tp``): the absmax of column-parallel and k/v
    # matrices, the absmax codes' scales of every split one
    absmax, scale2 = (nf4_scale_bytes(lora.double_quant) if lora.base_bits == 4
                      else (0.0, 0.0))
    role = lambda *roles: per([t for t in stored if t.tp in roles and not t.expert])  # noqa
    cols = lambda t: t.count * t.shape[-1] * (t.shape[0] if t.expert else 1)  # noqa: E731
    return {
        "lora_layer": per(adapters),
        "lora_base_layer": per(stored),
        "lora_base_kv": per([t for t in stored if t.tp == "kv"]),
        # (replicated over tp: latent attention's q_a and kv_a, and their adapters)
        "lora_base_rep": per([t for t in stored if t.tp == "rep"]),
        "lora_rep": per([t for t in adapters if t.tp == "rep"]),
        # (of which in experts: split over ep with the experts)
        "lora_expert": per([t for t in adapters if t.expert]),
        "lora_base_expert": per([t for t in stored if t.expert]),
        "base_bytes": {4: nf4_bytes_per_weight(lora.double_quant), 8: coeffs["base_bytes_8bit"],
                       16: float(prec["act_bytes"])}[lora.base_bits],
        # (a 4-bit base is dequantised before its matmuls: ``lora_dequant``; these wrapped
        # matrices a block, each of them one dequantisation a pass)
        "base_nf4": float(lora.base_bits == 4),
        # (its absmax codes double-quantised: dequantised before the weight,
        # ``lora_dequant_nested_kernels``)
        "base_nested": float(lora.base_bits == 4 and lora.double_quant),
        # (stored in 8 or 4 bits: dequantised to the compute dtype where a matmul reads it)
        "base_quantised": float(lora.base_bits < 16),
        # (an expert-stacked base: one matrix an expert; ``lora_base_expert_mats`` of them,
        # split over ep)
        "lora_base_mats": sum(t.count * (t.shape[0] if t.expert else 1)
                              for t in stored) / layers,
        "lora_base_expert_mats": sum(t.count * t.shape[0] for t in stored if t.expert) / layers,
        "base_scale_tp_bytes": eight * sum(cols(t) for t in stored
                                           if t.tp not in ("row", "rep")) / layers,
        "base_scale_rep_bytes": eight * sum(cols(t) for t in stored
                                            if t.tp in ("row", "rep")) / layers,
        "base_whole_bytes": absmax * role("col") + scale2 * role("col", "row"),
        "base_whole_kv_bytes": (absmax + scale2) * role("kv"),
        "frozen_bytes": float(prec["act_bytes"]),
        # which matrices' inputs an adapter keeps for its gradient (a runtime that keeps no
        # input for a frozen matmul, ``frozen_inputs_dropped``, keeps only these): the first
        # norm's output (q or latent attention's q_a, k, v, kv_a), the attention's output
        # (o), the second norm's output (gate, up), the MLP's activation (down)
        **{key: float(any(t.matmul in names for t in base)) for key, names in (
            ("lora_attn_in", _attn_in_names(tensors)),
            # (q or k: the attention's scores need a gradient)
            ("lora_qk", ("q", "k", "q_a", "kv_a", "kv_b")),
            ("lora_o", ("o",)), ("lora_mlp_in", ("gate", "up")), ("lora_down", ("down",)))},
        # PEFT's input cast (``lora_input_cast``), per token: the input widths kept again
        # when every wrapped matrix keeps its own copy of its input and a frozen one keeps
        # none: a tensor read by several wrapped matrices (the first norm's output: q or
        # q_a, k, v, kv_a; the second's: gate, up) is kept once a matrix, not once (dense
        # matrices; experts' are not wrapped this way)
        "lora_cast_rep": sum(max(inputs(ts) - (ts[0].shape[0] if ts else 0.0), 0.0)
                             for ts in (attn_in, mlp_in)),
        "lora_base16": float(lora.base_bits == 16),
        # PEFT's lora_dropout on each wrapped matrix's adapter input: per token, the inputs
        # of the wrapped matrices (each one a dropped copy and a 1-byte mask), of which those
        # reading the two norms' outputs (the rest: o's, down's, latent attention's second
        # matrices, split by tp)
        "lora_dropout": float(lora.dropout > 0),
        "lora_in_total": inputs(base),
        # (by reader, for the first block, where an input computed before any adapter needs
        # no gradient and its dropout keeps no mask)
        "lora_in_attn": inputs(attn_in),
        "lora_in_mlp": inputs(mlp_in),
        "lora_in_o": inputs([t for t in base if t.matmul == "o"]),
        "lora_in_down": inputs([t for t in base if t.matmul == "down"]),
        # (the widest input of a wrapped dense matrix, per token)
        "lora_in_width": float(max((t.shape[0] for t in base if not t.expert), default=0)),
        # per token, the widths of every adapter's two matmul outputs (x A and x A B)
        "lora_out_width": sum(t.count * (t.shape[-1] + lora.rank) for t in base) / layers,
        # (of which the adapters of replicated matrices, whole on every tensor-parallel rank)
        "lora_out_width_rep": sum(t.count * (t.shape[-1] + lora.rank) for t in base
                                  if t.tp == "rep") / layers,
    }


def _flop_shape_numbers(model) -> dict[str, float]:
    """Matmul shapes outside the blocks, as exact integer products (for `cost.flops`).

    head_tok_tp:  weight elements of the vocabulary-sized matmul applied to every token
                  (decoder LM head, encoder MLM decoder); split by tensor parallelism.
    head_tok_rep: other per-token head matmuls (the MLM transform, h x h); replicated.
    head_seq:     per-sequence head matmuls (pooler h x h, classifier h x labels).
    embed_seq:    per-sequence input matmuls (ViT patch projection on every patch).
    patch_dim:    the patch projection's input width (channels x patch^2).
    norms_per_layer: norms inside one block (element-wise traffic).
    """
    h = model.hidden_size
    fam = model.family
    lm = model.has_vocab_head
    labels = model.num_labels if fam in ("encoder", "vit") else 0
    patch_dim = model.num_channels * model.patch_size ** 2 if fam == "vit" else 0
    return {
        "head_tok_tp": float(model.vocab_size * h if lm else 0),
        "head_tok_rep": float(h * h if fam == "encoder" and model.mlm_head else 0),
        "head_seq": float((h * h if model.pooler else 0) + h * labels),
        "embed_seq": float(model.num_patches * patch_dim * h),
        "patch_dim": float(patch_dim),
        "embed_vocab": float(fam in ("decoder", "encoder")),
        "rotary": float(model.position_embedding == "rotary"),
        "moe": float(model.is_moe),
        "norms_per_layer": float(getattr(model, "norms_per_layer", 2)),
    }


def scenario_numbers(sc: Scenario) -> dict[str, float]:
    """Everything the cost model needs from a scenario, as named floats."""
    m, w, hw, rt = sc.model, sc.workload, sc.hardware, sc.runtime
    prec = rt.precision(w.precision)
    c = rt.coeff_dict()
    if lora_adapters_bf16(sc):
        # a runtime that keeps a quantised model's adapters in bfloat16 (TRL's SFTTrainer):
        # they, their gradients and their optimizer state are 2 bytes, nothing cast
        prec = {**prec, "param_bytes": 2.0, "grad_bytes": 2.0, "state_bytes": 2.0,
                "master_bytes": 0.0, "weight_copy_bytes": 0.0}
    s = float(sc.seq_len)
    n: dict[str, float] = {}

    # --- model shape ---
    L = m.num_hidden_layers
    n.update(L=L, h=m.hidden_size, a=m.num_attention_heads, kv=m.kv_heads, hd=m.head_size,
             f=m.intermediate_size, V=m.vocab_size, E=m.num_local_experts,
             topk=m.num_experts_per_tok, s=s,
             gated=float(m.mlp_type == "gated"), mlp=float(m.family == "mlp"),
             qk_norm=float(getattr(m, "qk_norm", False)),
             causal=float(m.family == "decoder"),
             hidden_dropout=float(m.hidden_dropout > 0), attn_dropout=float(m.attention_dropout > 0),
             layernorm=float(m.norm_type == "layernorm"))
    n["P_total"] = float(m.num_params())
    n["P_active"] = float(m.active_params())
    # Parameter groups by how tensor parallelism shards them (Megatron-LM layout, as
    # `capopt.validation.sharding` places them):
    #   P_layer_tp   column-parallel q/k/v/gate/up (kernels and biases) and row-parallel
    #                o/down kernels: split by tp (the plain MLP stack: every layer);
    #   P_layer_kv   the k/v part of P_layer_tp: replicated when tp does not divide the KV heads;
    #   P_layer_rep  norms, router, and the row-parallel layers' output biases: replicated;
    #   P_expert     one expert; P_expert_rep its down-projection bias (replicated over tp);
    #   P_embed_tp / P_head_tp  vocabulary-parallel tables, logit biases and heads: split by
    #                tp when tp divides the vocabulary, else replicated;
    #   *_rep        positions, token types, patch projection, class token, pooler,
    #                classifier, MLM transform and norms: replicated.
    h_ = m.hidden_size
    n.update(parameter_groups(inventory(m), L, m.num_experts_per_tok))
    n.update(minor_sharded_groups(inventory(m), L))
    n.update(attention_widths(m))
    n.update(op_checkpoint_widths(inventory(m, w.lora), L, m.num_experts_per_tok))
    n.update(backward_grad_shares(inventory(m, w.lora)))
    n["tied"] = float(m.family == "decoder" and m.tie_word_embeddings)
    # Output elements per sequence that go through the loss.
    if m.has_vocab_head:
        n["logit_elems_per_seq"] = s * m.vocab_size
        n["logit_tp"] = 1.0
    else:
        n["logit_elems_per_seq"] = float(max(m.num_labels, 1) if m.family != "mlp" else m.hidden_size)
        n["logit_tp"] = 0.0
    n.update(_flop_shape_numbers(m))
    # The embedding tables whose gradient is a dense scatter-add target (word embeddings,
    # vocabulary-parallel; learned positions and token types, replicated)
    tables = m.family in ("decoder", "encoder")
    n["embed_grad_tp"] = float(m.vocab_size * h_ if tables else 0)
    n["embed_grad_rep"] = float(
        ((m.max_position_embeddings if m.position_embedding == "learned" else 0)
         + m.type_vocab_size) * h_ if tables else 0)
    # Blockwise attention runs where the runtime's kernel tiles the sequence: a fused kernel
    # (attn_chunk_queries = 0) always; a chunked one (the validation step's) only with more
    # than one whole block of queries, else it materialises the scores.
    chunk = c["attn_chunk_queries"]
    n["vocab_unaligned"] = float(m.vocab_size % 16 != 0)
    n["flash_ok"] = float(chunk <= 0 or (s > chunk and s % chunk == 0))

    # --- precision ---
    for key in ("param_bytes", "grad_bytes", "master_bytes", "act_bytes", "weight_copy_bytes",
                "state_bytes"):
        n[key] = float(prec[key])
    n["matmul_peak"] = float(hw.effective_peak(str(prec["matmul_dtype"])))
    n["attn_peak"] = float(hw.effective_peak(str(prec["attention_dtype"])))
    # a part whose power limit holds its clocks below the datasheet's (`Hardware.
    # sustained_tensor_share`): its GEMMs run at this share of the rates the GEMM model gives
    # the datasheet peaks (the attention kernel, further from the peak, keeps its rate); MFU
    # is still counted against the datasheet
    n["tensor_share"] = float(hw.sustained_tensor_share)
    # an 8-bit GEMM where the device has 8-bit units (elsewhere the recipe's matmuls run in
    # 16 bits): its operands are 1 byte for the roofline (`capopt.cost.flops.
    # matmul_efficiency`; both are cast before the GEMM) and its linear layers' casts are
    # priced as memory-bound work (`capopt.cost.time.memory_bound_times`, ``fp8_cast_bytes``)
    mm_dtype = str(prec["matmul_dtype"])
    n["fp8_linear"] = float(mm_dtype in ("fp8", "int8") and mm_dtype in hw.peaks)
    n["matmul_bytes"] = n["fp8_linear"] * 1.0 + (1.0 - n["fp8_linear"]) * n["act_bytes"]

    # --- optimizer state bytes per trainable parameter ---
    # Adafactor and 8-bit Adam keep per-tensor layouts (factored or full moments; 8-bit blocks
    # or float32 below a size threshold): their bytes are counted tensor by tensor over the
    # trainable tensors and spread evenly over the trainable parameters.
    opt = w.optimizer
    lora = w.lora
    trainable_shapes = [(t.shape, t.count) for t in trainable(inventory(m, lora))]
    # (bitsandbytes' 32-bit optimizers, the paged ones, keep float32 state whatever the
    # parameter's dtype: Optimizer2State.init_state, optim_bits 32)
    state_bytes = 4.0 if w.paged_optimizer else float(prec["state_bytes"])
    n_trainable = sum(math.prod(sh) * cnt for sh, cnt in trainable_shapes) or 1
    if opt == "adafactor":
        # optax keeps Adafactor's accumulators in the parameter dtype
        elems = sum(adafactor_state_elems(sh) * cnt for sh, cnt in trainable_shapes)
        n["opt_bytes"] = float(prec["param_bytes"]) * elems / n_trainable
    elif opt == "adamw-8bit":
        nbytes = sum(2 * adam8bit_moment_bytes(math.prod(sh)) * cnt
                     for sh, cnt in trainable_shapes)
        n["opt_bytes"] = nbytes / n_trainable
    else:
        n["opt_bytes"] = state_bytes * OPT_STATES[opt]
    n["opt_states"] = OPT_STATES.get(opt) or (2.0 if opt == "adamw-8bit" else 1.0)
    # a paged optimizer (``training.paged_optimizer``): the share of the state bytes in CUDA
    # managed memory, the state of every trainable tensor of PAGED_STATE_MIN_SIZE elements
    # or more (8-bit Adam: its codes; the per-block absmax stays on the device); a LoRA
    # adapter of rank 16 on a 4096-wide projection (65,536 elements) keeps its state on the
    # device
    n["opt_paged"] = (paged_state_share(opt, trainable_shapes, state_bytes)
                      if w.paged_optimizer else 0.0)
    n["grad_clip"] = float(w.grad_clip)
    n["adam"] = float(opt in ("adam", "adamw"))
    n["adam8"] = float(opt == "adamw-8bit")
    # an optimizer stepped in the backward pass (``training.optimizer_in_backward``): one a
    # trainable tensor, so a block's update launches one kernel a trainable tensor
    n["opt_in_bwd"] = float(w.optimizer_in_backward)
    # asynchronous tensor parallelism (``training.async_tp``): `capopt.cost.time.stage_time`
    n["async_tp"] = float(w.async_tp)
    trained = inventory(m, w.lora) if w.lora is not None else inventory(m)
    n["tensors_per_layer"] = sum(
        t.count for t in trained if t.where == "block"
        and ((t.lora == "adapter") == (w.lora is not None))) / max(L, 1)

    # --- LoRA / QLoRA ---
    if w.lora is not None:
        n.update(lora_numbers(inventory(m, w.lora), L, w.lora, prec, c))
        n["lora"] = 1.0
        n["lora_rank"] = float(w.lora.rank)
    else:
        n.update(lora=0.0, lora_layer=0.0, lora_base_layer=0.0, lora_base_kv=0.0,
                 lora_base_rep=0.0, lora_rep=0.0, lora_out_width_rep=0.0,
                 base_bytes=0.0, base_scale_tp_bytes=0.0, base_scale_rep_bytes=0.0,
                 base_whole_bytes=0.0, base_whole_kv_bytes=0.0,
                 frozen_bytes=0.0, lora_rank=0.0, lora_attn_in=0.0, lora_qk=0.0, lora_o=0.0,
                 lora_mlp_in=0.0, lora_down=0.0, lora_out_width=0.0,
                 base_nf4=0.0, base_nested=0.0, base_quantised=0.0, lora_base_mats=0.0,
                 lora_expert=0.0, lora_base_expert=0.0, lora_base_expert_mats=0.0,
                 lora_cast_rep=0.0, lora_in_width=0.0,
                 lora_dropout=0.0, lora_in_total=0.0, lora_in_attn=0.0,
                 lora_in_mlp=0.0, lora_in_o=0.0, lora_in_down=0.0,
                 lora_base16=0.0)

    # --- workload, hardware, budget ---
    n.update(B=float(w.global_batch), N=float(sc.count), per_node=float(sc.per_node),
             vram_bytes=float(sc.budget.vram_bytes), usable_bytes=float(sc.budget.usable_bytes),
             mem_bw=float(hw.mem_bw), intra_bw=float(hw.intra_node_bw),
             sm_count=float(hw.sm_count or 0),
             inter_bw=float(hw.inter_node_bw), host_bw=float(hw.host_bw),
             input_rate=float(w.input_samples_per_s or 0.0),
             train_tokens=float(w.train_tokens or 0.0),
             price=float(sc.gpu_hour_price or 0.0))
    # --- runtime coefficients, prefixed ---
    n.update({f"rt_{k}": v for k, v in c.items()})
    # the attention kernel's efficiency on Hopper (compute capability 9.x), where the profile
    # names one (``flash_eff_sm90``): a kernel written for Ampere reaches a smaller share of
    # Hopper's peak, less of it on shorter sequences (``flash_half_seq_sm90``: the share
    # is flash_eff_sm90 x s / (s + flash_half_seq_sm90)) and, where its exponentials run
    # between its matmuls, on narrower heads (`capopt._runtime.flash_share_sm90`)
    n["flash_half_seq"] = 0.0
    if c.get("flash_eff_sm90", 0.0) > 0.0 and (hw.compute_capability or "").startswith("9."):
        half = float(c.get("flash_half_seq_sm90", 0.0))
        n["rt_flash_eff"] = flash_share_sm90(c, float(m.head_size)) * s / (s + half)
        n["flash_half_seq"] = half
    # A fused cross-entropy (``loss = "fused"``) takes the place of the profile's loss rules
    # (`capopt.cost.memory.loss_copies`; torch.compile's partitioner saves the loss's input
    # and recomputes the softmax in the backward kernel:
    # torch/_functorch/partitioners.py min_cut_rematerialization_partition)
    n["loss_fused"] = float(w.loss == "fused")
    # The fused linear cross-entropy (``loss = "fused-linear"``) takes the head's matmul too:
    # chunk by chunk of tokens, never the whole logits (`capopt.cost.flops.fused_linear_chunk`)
    n["loss_fused_linear"] = float(w.loss == "fused-linear")
    # The chunked loss (``loss = "chunked"``: torchtune's) runs the head and the float32
    # cross-entropy slice by slice of the tokens, eagerly: its own rules at the loss
    # (`capopt.cost.memory.loss_copies`); its matmuls and element-wise passes are the float32
    # loss's, on slices (`CHUNKED_LOSS_CHUNKS`)
    n["loss_chunked"] = float(w.loss == "chunked")
    n["loss_chunks"] = float(CHUNKED_LOSS_CHUNKS)
    # torch.compile (``training.compile``): TorchInductor fuses each chain of element-wise ops
    # and reductions into kernels that read their inputs and write their outputs once, so the
    # profile's eager extras (``ew_*_extra``) vanish (`capopt.cost.time.memory_bound_times`)
    n["compile"] = float(w.compile)
    # activation offloading (``training.activation_offload``): the saved tensors of the
    # blocks that are not recomputed go to host memory (`capopt.cost.memory`)
    n["act_offload"] = float(w.activation_offload)
    return n


def numbers_pytree(sc_or_numbers) -> dict[str, jax.Array]:
    nums = sc_or_numbers if isinstance(sc_or_numbers, dict) else scenario_numbers(sc_or_numbers)
    return {k: jnp.asarray(v, DTYPE) for k, v in nums.items()}
