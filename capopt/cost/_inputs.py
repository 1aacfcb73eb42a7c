"""The cost model's two inputs: `Knobs` (decision variables) and `Numbers` (the scenario).

Both are pytrees of scalars, so `estimate` is one traced function: the optimiser
differentiates it in the knobs, and scenarios of the same shape reuse one compilation.
Categorical scenario choices (precision, optimizer, family) arrive here already turned
into numbers; categorical *knobs* (ZeRO stage, remat policy) are weight vectors, one-hot at a
real config and mixtures at a relaxed point.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

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
    # Parameter groups by how tensor parallelism shards them.
    norms = m.layer_norm_params() if m.family != "mlp" else 0
    expert = m.expert_params() if m.is_moe else 0
    n["P_layer_tp"] = float(m.layer_params() - norms - m.router_params()
                            - m.num_local_experts * expert)
    n["P_layer_rep"] = float(norms + m.router_params())
    n["P_expert"] = float(expert)
    word = m.vocab_size * m.hidden_size if m.family in ("decoder", "encoder") else 0
    n["P_embed_tp"] = float(word)
    n["P_embed_rep"] = float(m.embedding_params() - word)
    head = m.head_params()
    head_tp = m.vocab_size * m.hidden_size if (
        m.family == "decoder" and not m.tie_word_embeddings) else 0
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
    opt = w.optimizer
    if opt == "adafactor":
        shapes = m.matrix_shapes()
        mat = sum(r * cc * k for r, cc, k in shapes)
        factored = sum((r + cc) * k for r, cc, k in shapes)
        other = max(m.num_params() - mat, 0)   # vectors keep a full second moment
        n["opt_bytes"] = float(prec["state_bytes"]) * (factored + other) / m.num_params()
    elif opt == "adamw-8bit":
        n["opt_bytes"] = 2.0 * c["adam8bit_state_bytes"]
    else:
        n["opt_bytes"] = float(prec["state_bytes"]) * OPT_STATES[opt]
    n["opt_states"] = OPT_STATES.get(opt) or (2.0 if opt == "adamw-8bit" else 1.0)
    n["grad_clip"] = float(w.grad_clip)

    # --- LoRA / QLoRA ---
    if w.lora is not None:
        n["lora"] = 1.0
        n["lora_layer"] = _lora_params_per_layer(m, w.lora.rank, w.lora.targets)
        n["lora_base_layer"] = _lora_base_matrix_params_per_layer(m, w.lora.targets)
        n["base_bytes"] = {4: c["base_bytes_4bit"], 8: c["base_bytes_8bit"],
                           16: float(prec["act_bytes"])}[w.lora.base_bits]
        n["frozen_bytes"] = float(prec["act_bytes"])
        n["lora_rank"] = float(w.lora.rank)
    else:
        n.update(lora=0.0, lora_layer=0.0, lora_base_layer=0.0, base_bytes=0.0,
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
