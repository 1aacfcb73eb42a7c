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

from .._runtime import INT8_SCALE_BYTES, adafactor_state_elems, adam8bit_moment_bytes
from .._specs import Config, Scenario

DTYPE = jnp.float32


@dataclass(frozen=True)
class Knobs:
    """Per-knob values; floats, integers at a real config.

    zero:  weights over ZeRO stages (0, 1, 2, 3), shape (..., 4)
    remat: fraction of layers under (none, selective, full) recomputation, shape (..., 3)
    sp, offload, flash: in [0, 1]
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

    def replace(self, **changes) -> "Knobs":
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    Knobs, data_fields=[f.name for f in dataclasses.fields(Knobs)], meta_fields=[])


def knobs_from_config(cfg: Config) -> Knobs:
    zero = np.zeros(4, np.float32)
    zero[cfg.zero_stage] = 1.0
    f = lambda v: jnp.asarray(float(v), DTYPE)  # noqa: E731
    return Knobs(
        micro_batch=f(cfg.micro_batch), grad_accum=f(cfg.grad_accum), dp=f(cfg.dp),
        tp=f(cfg.tp), pp=f(cfg.pp), ep=f(cfg.ep), zero=jnp.asarray(zero),
        remat=jnp.asarray(cfg.remat_weights(), DTYPE), sp=f(cfg.sequence_parallel),
        offload=f(cfg.offload_optimizer), flash=f(cfg.flash_attention))


def stack_knobs(configs: list[Config]) -> Knobs:
    """Many configs as one batched `Knobs` (leading axis), for `vmap`."""
    ks = [knobs_from_config(c) for c in configs]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *ks)


# --------------------------------------------------------------------------------------------
# Scenario -> numbers
# --------------------------------------------------------------------------------------------
OPT_STATES = {  # optimizer-state elements per trainable parameter
    "adamw": 2.0, "adam": 2.0, "sgd": 0.0, "sgd-momentum": 1.0, "lion": 1.0,
    "adafactor": None, "adamw-8bit": None,
}


def _lora_params_per_layer(model, rank: int, targets) -> float:
    h, f, hd = model.hidden_size, model.intermediate_size, model.head_size
    q, kv = model.num_attention_heads * hd, model.kv_heads * hd
    n = 0
    if "attn" in targets:
        n += rank * ((h + q) + 2 * (h + kv) + (q + h))
    if "mlp" in targets:
        mats = 2 if model.mlp_type == "gated" else 1
        n += model.num_local_experts * rank * (mats * (h + f) + (f + h))
    return float(n)


def _lora_wrapped(model, targets) -> list[tuple[int, int, int, str]]:
    """(in, out, count, role) of the matrices LoRA wraps in one block (role: col | row | kv)."""
    h, f, hd = model.hidden_size, model.intermediate_size, model.head_size
    q, kv = model.num_attention_heads * hd, model.kv_heads * hd
    out = []
    if "attn" in targets:
        out += [(h, q, 1, "col"), (h, kv, 2, "kv"), (q, h, 1, "row")]
    if "mlp" in targets:
        E = model.num_local_experts
        out += [(h, f, (2 if model.mlp_type == "gated" else 1) * E, "col"), (f, h, E, "row")]
    return out


def _lora_adapter_shapes(model, rank: int, targets) -> list[tuple[tuple[int, ...], int]]:
    """(shape, count) of every LoRA adapter tensor in the model (A (in, r), B (r, out))."""
    L = model.num_hidden_layers
    shapes = []
    for din, dout, cnt, _ in _lora_wrapped(model, targets):
        shapes += [((din, rank), cnt * L), ((rank, dout), cnt * L)]
    return shapes


def _lora_base_out_columns(model, targets) -> tuple[float, float]:
    """Output columns of one block's wrapped matrices: (tensor-split, replicated)."""
    col = sum(dout * cnt for _, dout, cnt, role in _lora_wrapped(model, targets) if role != "row")
    row = sum(dout * cnt for _, dout, cnt, role in _lora_wrapped(model, targets) if role == "row")
    return float(col), float(row)


def _lora_base_matrix_params_per_layer(model, targets) -> float:
    """Parameters of the matrices LoRA wraps (they can be quantised)."""
    n = 0
    if "attn" in targets:
        hd = model.head_size
        q, kv = model.num_attention_heads * hd, model.kv_heads * hd
        n += model.hidden_size * (2 * q + 2 * kv)
    if "mlp" in targets:
        mats = 3 if model.mlp_type == "gated" else 2
        n += model.num_local_experts * mats * model.hidden_size * model.intermediate_size
    return float(n)


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
    lm = fam == "decoder" or (fam == "encoder" and model.mlm_head)
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
    s = float(sc.seq_len)
    n: dict[str, float] = {}

    # --- model shape ---
    L = m.num_hidden_layers
    n.update(L=L, h=m.hidden_size, a=m.num_attention_heads, kv=m.kv_heads, hd=m.head_size,
             f=m.intermediate_size, V=m.vocab_size, E=m.num_local_experts,
             topk=m.num_experts_per_tok, s=s,
             gated=float(m.mlp_type == "gated"), mlp=float(m.family == "mlp"),
             causal=float(m.family == "decoder"),
             hidden_dropout=float(m.hidden_dropout > 0), attn_dropout=float(m.attention_dropout > 0))
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
    h_, hd_ = m.hidden_size, m.head_size
    norms = m.layer_norm_params() if m.family != "mlp" else 0
    expert = m.expert_params() if m.is_moe else 0
    row_bias = 0
    if m.family != "mlp":
        row_bias = (h_ if m.attention_out_bias else 0) + (
            h_ if (m.mlp_bias and not m.is_moe) else 0)
    kv_part = 0
    if m.family != "mlp":
        kv_part = 2 * (h_ * m.kv_heads * hd_ + (m.kv_heads * hd_ if m.attention_bias else 0))
    n["P_layer_tp"] = float(m.layer_params() - norms - m.router_params()
                            - m.num_local_experts * expert - row_bias)
    n["P_layer_kv"] = float(kv_part)
    n["P_layer_rep"] = float(norms + m.router_params() + row_bias)
    n["P_expert"] = float(expert)
    n["P_expert_rep"] = float(h_ if (m.is_moe and m.mlp_bias) else 0)
    word = m.vocab_size * m.hidden_size if m.family in ("decoder", "encoder") else 0
    n["P_embed_tp"] = float(word)
    n["P_embed_rep"] = float(m.embedding_params() - word)
    head = m.head_params()
    V = m.vocab_size
    head_tp = 0
    if m.family == "decoder":
        head_tp = (0 if m.tie_word_embeddings else V * h_) + (V if m.lm_head_bias else 0)
    elif m.family == "encoder" and m.mlm_head:
        head_tp = (0 if m.tie_word_embeddings else V * h_) + V
    n["P_head_tp"] = float(head_tp)
    n["P_head_rep"] = float(head - head_tp)
    n["tied"] = float(m.family == "decoder" and m.tie_word_embeddings)
    # Output elements per sequence that go through the loss.
    if m.family == "decoder" or (m.family == "encoder" and m.mlm_head):
        n["logit_elems_per_seq"] = s * m.vocab_size
        n["logit_tp"] = 1.0
    else:
        n["logit_elems_per_seq"] = float(max(m.num_labels, 1) if m.family != "mlp" else m.hidden_size)
        n["logit_tp"] = 0.0
    n.update(_flop_shape_numbers(m))

    # --- precision ---
    for key in ("param_bytes", "grad_bytes", "master_bytes", "act_bytes", "weight_copy_bytes",
                "state_bytes"):
        n[key] = float(prec[key])
    n["matmul_peak"] = float(hw.effective_peak(str(prec["matmul_dtype"])))

    # --- optimizer state bytes per trainable parameter ---
    # Adafactor and 8-bit Adam keep per-tensor layouts (factored or full moments; 8-bit blocks
    # or float32 below a size threshold): their bytes are counted tensor by tensor over the
    # trainable tensors and spread evenly over the trainable parameters.
    opt = w.optimizer
    lora = w.lora
    trainable_shapes = (_lora_adapter_shapes(m, lora.rank, lora.targets) if lora is not None
                        else m.param_shapes())
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
        n["opt_bytes"] = float(prec["state_bytes"]) * OPT_STATES[opt]
    n["opt_states"] = OPT_STATES.get(opt) or (2.0 if opt == "adamw-8bit" else 1.0)
    n["grad_clip"] = float(w.grad_clip)

    # --- LoRA / QLoRA ---
    if w.lora is not None:
        n["lora"] = 1.0
        n["lora_layer"] = _lora_params_per_layer(m, w.lora.rank, w.lora.targets)
        n["lora_base_layer"] = _lora_base_matrix_params_per_layer(m, w.lora.targets)
        n["lora_base_kv"] = float(2 * m.hidden_size * m.kv_heads * m.head_size
                                  if "attn" in w.lora.targets else 0)
        n["base_bytes"] = {4: c["base_bytes_4bit"], 8: c["base_bytes_8bit"],
                           16: float(prec["act_bytes"])}[w.lora.base_bits]
        # 8-bit bases: one float32 scale per output column of every wrapped matrix (split by
        # tp on column-parallel layers, replicated on row-parallel ones).
        col, row = _lora_base_out_columns(m, w.lora.targets)
        eight = float(w.lora.base_bits == 8) * INT8_SCALE_BYTES
        n["base_scale_tp_bytes"] = eight * col
        n["base_scale_rep_bytes"] = eight * row
        n["frozen_bytes"] = float(prec["act_bytes"])
        n["lora_rank"] = float(w.lora.rank)
    else:
        n.update(lora=0.0, lora_layer=0.0, lora_base_layer=0.0, lora_base_kv=0.0,
                 base_bytes=0.0, base_scale_tp_bytes=0.0, base_scale_rep_bytes=0.0,
                 frozen_bytes=0.0, lora_rank=0.0)

    # --- workload, hardware, budget ---
    n.update(B=float(w.global_batch), N=float(sc.count), per_node=float(sc.per_node),
             vram_bytes=float(sc.budget.vram_bytes), usable_bytes=float(sc.budget.usable_bytes),
             mem_bw=float(hw.mem_bw), intra_bw=float(hw.intra_node_bw),
             inter_bw=float(hw.inter_node_bw), host_bw=float(hw.host_bw),
             input_rate=float(w.input_samples_per_s or 0.0),
             train_tokens=float(w.train_tokens or 0.0),
             price=float(sc.gpu_hour_price or 0.0))
    # --- runtime coefficients, prefixed ---
    n.update({f"rt_{k}": v for k, v in c.items()})
    return n


def numbers_pytree(sc_or_numbers) -> dict[str, jax.Array]:
    nums = sc_or_numbers if isinstance(sc_or_numbers, dict) else scenario_numbers(sc_or_numbers)
    return {k: jnp.asarray(v, DTYPE) for k, v in nums.items()}
