"""A card's tensor inventory: every weight, bias, norm, embedding and head once.

Each `Tensor` says its shape, how many of it the model has (``count``: one per block for the
block's tensors; an MoE's experts only in its ``moe_layers``, its dense MLP in the others),
where it sits (``block`` / ``embed`` / ``head``), how tensor parallelism splits it (``tp``),
whether it is stacked over MoE experts, whether it is a GEMM weight, and its LoRA role. Parameter counts (`ModelSpec.num_params`), the cost model's parameter groups,
optimizer state (per-tensor rules: Adafactor's factoring, 8-bit blocks), LoRA adapters and the
matmul FLOPs all read this one list; the validation models build the same shapes
(`capopt.validation.models`: kernels ``(in, out)``, experts stacked on a leading axis).

Tensor-parallel roles (Megatron-LM's layout, as `capopt.validation.sharding` places them):
``col`` splits the output dimension (q, gate, up and their biases; latent attention's kv_b);
``kv`` is ``col`` for the k and v projections, replicated when tp exceeds the KV heads; ``row`` splits the input
dimension (o, down); ``vocab`` splits the vocabulary (word embeddings, LM and MLM heads and
their biases) when tp divides it; ``rep`` is replicated (norms, router, row-parallel biases,
latent attention's down-projections q_a and kv_a, as Megatron-Core's MLA duplicates them,
positions, token types, patch projection, class token, pooler, classifier, MLM transform).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:                         # typing only: _model imports this module
    from ._model import ModelSpec
    from ._specs import LoRA

TP_ROLES = ("col", "kv", "row", "vocab", "rep")
# Block matmuls LoRA may wrap, by target
# (latent attention: every projection, q_a, q, kv_a, kv_b and o, as PEFT's "all-linear" has it)
LORA_MATRICES = {"attn": ("q", "k", "v", "o", "q_a", "kv_a", "kv_b"),
                 "mlp": ("gate", "up", "down")}
# ... or one by one, as PEFT's ``target_modules`` names them (Hugging Face Llama: q_proj,
# v_proj, ...; PEFT 0.21's default for Llama-family models is q_proj and v_proj alone: its
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
LORA_SINGLE = tuple(name for group in LORA_MATRICES.values() for name in group)


# Bumped when what a LoRA base stores changes (benchmarks' measurement keys name it): 2, an
# 8- or 4-bit base quantises every block matmul, wrapped or not (1: only the wrapped ones)
LORA_QUANT_REVISION = 2


def lora_quant_key(m: "ModelSpec", lora: "LoRA | None") -> tuple[str, ...]:
    """What a measurement key adds for ``lora`` on ``m``: `LORA_QUANT_REVISION` where the
    measurement depends on it (a quantised base with block matmuls it does not wrap; the
    first revision, only the wrapped ones quantised, left the keys as they were), else
    nothing."""
    if lora is None or not any(t.lora == "quant" for t in inventory(m, lora)):
        return ()
    return (f"lora quantised base revision {LORA_QUANT_REVISION}",)


def lora_wrapped(targets) -> frozenset[str]:
    """The block matmuls ``targets`` (group names and single matrices) wrap."""
    return frozenset(name for t in targets for name in LORA_MATRICES.get(t, (t,)))


@dataclass(frozen=True)
class Tensor:
    name: str                 # dotted path, e.g. "blocks.attn.q.kernel"
    shape: tuple[int, ...]
    count: int                # how many the model holds (per-block tensors: one per block)
    where: str                # "block" | "embed" | "head"
    tp: str                   # one of TP_ROLES
    expert: bool = False      # stacked over the experts (leading axis), split by ep
    matmul: str = ""          # a GEMM weight: "q k v o q_a kv_a kv_b gate up down router head
                              # mlm_transform pooler classifier patch dense", else ""
    lora: str = ""            # "" | "base" (wrapped by LoRA, maybe quantised) | "adapter" |
    #                           "quant" (quantised, frozen, not wrapped)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def elements(self) -> int:
        """Elements of every instance together."""
        return self.size * self.count


def _add(out: list, name, shape, count, where, tp, **kw):
    if count and all(d > 0 for d in shape):
        out.append(Tensor(name, tuple(int(d) for d in shape), int(count), where, tp, **kw))


def mlp(out: list, prefix: str, lead: tuple, h: int, f: int, count: int, gated: bool,
        bias: bool, **kw):
    """An MLP ``f`` wide in ``count`` blocks (``lead``: the experts' leading axis): gate (when
    gated) and up column-parallel, down row-parallel, down's bias replicated; none at
    ``f = 0`` (an MoE without shared experts has no shared MLP, its bias included)."""
    if not f:
        return
    if gated:
        _add(out, f"{prefix}.gate.kernel", (*lead, h, f), count, "block", "col", matmul="gate",
             **kw)
    _add(out, f"{prefix}.up.kernel", (*lead, h, f), count, "block", "col", matmul="up", **kw)
    _add(out, f"{prefix}.down.kernel", (*lead, f, h), count, "block", "row", matmul="down", **kw)
    if bias:
        if gated:
            _add(out, f"{prefix}.gate.bias", (*lead, f), count, "block", "col", **kw)
        _add(out, f"{prefix}.up.bias", (*lead, f), count, "block", "col", **kw)
        _add(out, f"{prefix}.down.bias", (*lead, h), count, "block", "rep", **kw)


def model_tensors(m: "ModelSpec") -> list[Tensor]:
    """Every parameter tensor of ``m`` (no LoRA adapters)."""
    h, f, hd, L = m.hidden_size, m.intermediate_size, m.head_size, m.num_hidden_layers
    out: list[Tensor] = []
    ln = m.norm_type == "layernorm"

    def norm(name, count, where, width=h):
        _add(out, f"{name}.scale", (width,), count, where, "rep")
        if ln:
            _add(out, f"{name}.bias", (width,), count, where, "rep")

    if m.family == "mlp":
        _add(out, "blocks.kernel", (h, h), L, "block", "col", matmul="dense")
        _add(out, "blocks.bias", (h,), L, "block", "col")
        return out
    # --- embeddings ---
    if m.family == "vit":
        _add(out, "patch.kernel", (m.num_channels * m.patch_size ** 2, h), 1, "embed", "rep",
             matmul="patch")
        _add(out, "patch.bias", (h,), 1, "embed", "rep")
        _add(out, "cls", (h,), 1, "embed", "rep")
        _add(out, "pos", (m.num_patches + 1, h), 1, "embed", "rep")
    else:
        _add(out, "embed.embedding", (m.vocab_size, h), 1, "embed", "vocab")
        if m.position_embedding == "learned":
            _add(out, "pos_embed.embedding", (m.max_position_embeddings, h), 1, "embed", "rep")
        if m.type_vocab_size:
            _add(out, "type_embed.embedding", (m.type_vocab_size, h), 1, "embed", "rep")
        if m.embedding_norm:
            norm("embed_norm", 1, "embed")
    # --- blocks ---
    for i in range(1, m.norms_per_layer + 1):
        norm(f"blocks.norm{i}", L, "block")
    q, kv = m.num_attention_heads * hd, m.kv_heads * hd
    if m.is_mla:                   # multi-head latent attention (DeepSeek-V2/V3)
        a, qr, kvr, rope = m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
        if qr:
            _add(out, "blocks.attn.q_a.kernel", (h, qr), L, "block", "rep", matmul="q_a")
            norm("blocks.attn.q_a_norm", L, "block", qr)
        _add(out, "blocks.attn.q.kernel", (qr or h, q), L, "block", "col", matmul="q")
        _add(out, "blocks.attn.kv_a.kernel", (h, kvr + rope), L, "block", "rep", matmul="kv_a")
        norm("blocks.attn.kv_a_norm", L, "block", kvr)
        _add(out, "blocks.attn.kv_b.kernel", (kvr, a * (hd - rope + m.v_head_size)), L, "block",
             "col", matmul="kv_b")
        _add(out, "blocks.attn.o.kernel", (a * m.v_head_size, h), L, "block", "row", matmul="o")
    else:
        _add(out, "blocks.attn.q.kernel", (h, q), L, "block", "col", matmul="q")
        _add(out, "blocks.attn.k.kernel", (h, kv), L, "block", "kv", matmul="k")
        _add(out, "blocks.attn.v.kernel", (h, kv), L, "block", "kv", matmul="v")
        _add(out, "blocks.attn.o.kernel", (q, h), L, "block", "row", matmul="o")
    if m.qk_norm:                  # one head_dim-wide norm for every head's q, one for k
        for which in ("q", "k"):
            _add(out, f"blocks.attn.{which}_norm.scale", (hd,), L, "block", "rep")
            if ln:
                _add(out, f"blocks.attn.{which}_norm.bias", (hd,), L, "block", "rep")
    if m.attention_bias:
        _add(out, "blocks.attn.q.bias", (q,), L, "block", "col")
        _add(out, "blocks.attn.k.bias", (kv,), L, "block", "kv")
        _add(out, "blocks.attn.v.bias", (kv,), L, "block", "kv")
    if m.attention_out_bias:
        _add(out, "blocks.attn.o.bias", (h,), L, "block", "rep")
    gated = m.mlp_type == "gated"
    if m.is_moe:
        E, Lm = m.num_local_experts, m.moe_layers
        _add(out, "blocks.mlp.router", (h, E), Lm, "block", "rep", matmul="router")
        if m.router_bias:
            _add(out, "blocks.mlp.router_bias", (E,), Lm, "block", "rep")
        mlp(out, "blocks.mlp", (E,), h, f, Lm, gated, m.mlp_bias, expert=True)
        mlp(out, "blocks.mlp.shared", (), h, m.shared_expert_intermediate_size, Lm, gated,
            m.mlp_bias)
        mlp(out, "blocks.dense_mlp", (), h, m.dense_intermediate_size, m.first_k_dense_replace,
            gated, m.mlp_bias)
    else:
        mlp(out, "blocks.mlp", (), h, f, L, gated, m.mlp_bias)
    # --- heads ---
    if m.family in ("decoder", "vit"):
        norm("final_norm", 1, "head")
    if m.family == "decoder":
        if not m.tie_word_embeddings:
            _add(out, "lm_head.kernel", (h, m.vocab_size), 1, "head", "vocab", matmul="head")
        if m.lm_head_bias:
            _add(out, "lm_head.bias", (m.vocab_size,), 1, "head", "vocab")
    if m.pooler:
        _add(out, "pooler.kernel", (h, h), 1, "head", "rep", matmul="pooler")
        _add(out, "pooler.bias", (h,), 1, "head", "rep")
    if m.mlm_head:
        _add(out, "mlm_transform.kernel", (h, h), 1, "head", "rep", matmul="mlm_transform")
        _add(out, "mlm_transform.bias", (h,), 1, "head", "rep")
        norm("mlm_norm", 1, "head")
        if not m.tie_word_embeddings:
            _add(out, "mlm_decoder.kernel", (h, m.vocab_size), 1, "head", "vocab",
                 matmul="head")
        _add(out, "mlm_bias", (m.vocab_size,), 1, "head", "vocab")
    if m.num_labels:
        _add(out, "classifier.kernel", (h, m.num_labels), 1, "head", "rep",
             matmul="classifier")
        _add(out, "classifier.bias", (m.num_labels,), 1, "head", "rep")
    return out


def inventory(m: "ModelSpec", lora: "LoRA | None" = None) -> tuple[Tensor, ...]:
    """The model's tensors; with ``lora``, the wrapped matrices marked ``base`` and one
    ``adapter`` pair per wrapped matrix (A ``(in, r)``, B ``(r, out)``; experts: one pair per
    expert), with the wrapped matrix's tensor-parallel role (A of a row-parallel matrix is
    split over its input, B of a column-parallel one over its output; the other factor is
    counted with them, as `capopt.cost` splits a block's adapters over tp).

    A quantised base (``base_bits`` 8 or 4) quantises every block matmul, wrapped or not
    (``quant``: frozen, quantised, no adapters), as loading a model with bitsandbytes'
    ``load_in_4bit`` / ``load_in_8bit`` (transformers' ``replace_with_bnb_linear``) replaces
    every ``nn.Linear`` but the output head before PEFT wraps its targets; stacked expert
    weights are quantised only where wrapped."""
    tensors = model_tensors(m)
    if lora is None or m.family == "mlp":
        return tuple(tensors)
    wrapped = lora_wrapped(lora.targets)
    quantised = set(LORA_SINGLE) if lora.base_bits < 16 else set()
    out = []
    for t in tensors:
        if t.where == "block" and t.matmul in quantised - wrapped and not t.expert:
            out.append(Tensor(t.name, t.shape, t.count, t.where, t.tp, t.expert, t.matmul,
                              "quant"))
        elif t.where == "block" and t.matmul in wrapped:
            out.append(Tensor(t.name, t.shape, t.count, t.where, t.tp, t.expert, t.matmul,
                              "base"))
            *lead, din, dout = t.shape
            for part, shape in (("lora_a", (*lead, din, lora.rank)),
                                ("lora_b", (*lead, lora.rank, dout))):
                out.append(Tensor(t.name.replace(".kernel", f".{part}"), shape, t.count,
                                  t.where, t.tp, t.expert, "", "adapter"))
        else:
            out.append(t)
    return tuple(out)


def trainable(tensors) -> list[Tensor]:
    """The tensors that train: the adapters under LoRA, else every tensor."""
    adapters = [t for t in tensors if t.lora == "adapter"]
    return adapters or list(tensors)


__all__ = ["LORA_MATRICES", "LORA_QUANT_REVISION", "LORA_SINGLE", "TP_ROLES", "Tensor",
           "inventory", "lora_quant_key", "lora_wrapped", "model_tensors", "trainable"]
