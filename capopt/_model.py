"""`ModelSpec`: an architecture card, and its exact parameter count by group.

Field names follow Hugging Face ``config.json`` where a field exists there. Every count is
plain integer arithmetic: the cost model reads the groups below, the Flax validation builds
the same shapes, and the tests compare the total to the number the authors published.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import _inventory
from ._errors import CapoptError

FAMILIES = ("decoder", "encoder", "vit", "mlp")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary", "none")
MLP_TYPES = ("gelu", "gated")


@dataclass(frozen=True)
class ModelSpec:
    """One architecture. Sizes are integers; flags are booleans.

    family: "decoder" (causal LM), "encoder" (BERT-like, post-norm), "vit" (image classifier),
    "mlp" (plain stack of dense layers; ``hidden_size`` wide, ``num_hidden_layers`` deep).

    Heads are explicit flags, so one card can describe each published checkpoint class:
    an encoder with ``pooler`` only is Hugging Face ``BertModel``; with ``mlm_head`` only it is
    ``BertForMaskedLM`` (the decoder weight is the word embedding when
    ``tie_word_embeddings``); ``pooler`` + ``mlm_head`` + ``num_labels=2`` is
    ``BertForPreTraining``. An encoder produces vocabulary logits only with ``mlm_head``.
    A ViT with ``num_labels`` has a classifier on the class token; with ``pooler`` it has
    Hugging Face ``ViTModel``'s pooler.
    """

    name: str
    family: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int = 1
    intermediate_size: int = 0
    vocab_size: int = 0
    num_key_value_heads: int | None = None      # None: = num_attention_heads (MHA)
    head_dim: int | None = None                 # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 0
    position_embedding: str = "learned"         # learned | rotary | none
    norm_type: str = "layernorm"                # layernorm (weight+bias) | rmsnorm (weight)
    norms_per_layer: int = 2                    # 2: before (or after) attention and MLP;
                                                # 4: Gemma 2 also normalises each output
    qk_norm: bool = False                       # a norm over each head's q and k, head_dim
                                                # wide, shared by the heads (Qwen3, Gemma 3)
    mlp_type: str = "gelu"                      # gelu (up, down) | gated (gate, up, down)
    hidden_act: str = "gelu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False                # biases on q, k, v
    attention_out_bias: bool = False            # bias on the output projection
    mlp_bias: bool = False
    lm_head_bias: bool = False
    # Multi-head latent attention (DeepSeek-V2, Liu et al. 2024), when kv_lora_rank > 0: k and
    # v come from one kv_lora_rank-wide latent (kv_a, its norm, kv_b: heads x (nope + v) wide)
    # plus one qk_rope_head_dim-wide rotary key shared by the heads; q from a q_lora_rank-wide
    # latent (q_a, its norm, q_b) or, with q_lora_rank 0, straight from the hidden state.
    # head_dim is each q/k head's width, nope + rope; v_head_dim each v head's (None: head_dim).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int | None = None
    # MoE (num_local_experts > 1): the MLP is num_local_experts experts of intermediate_size
    # and a router, in every layer but the first first_k_dense_replace (a dense MLP of
    # dense_intermediate_size there); shared_expert_intermediate_size > 0 adds an always-active
    # MLP that wide beside the experts (DeepSeek's shared experts, together).
    num_local_experts: int = 1
    num_experts_per_tok: int = 1
    router_bias: bool = False
    first_k_dense_replace: int = 0
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Encoder (BERT) extras
    type_vocab_size: int = 0
    embedding_norm: bool = False                # a norm right after the embeddings
    pooler: bool = False                        # dense h->h + bias on the first token
    mlm_head: bool = False                      # transform dense + norm + decoder bias
    # ViT extras
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 3
    num_labels: int = 0                         # classifier head width (0: none)
    # Regularisation (affects saved masks in activations)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # Provenance
    published_params: int | None = None
    source: str = ""
    extra: tuple = field(default=(), compare=False)   # (key, value) pairs kept from imports

    def __post_init__(self):
        def bad(fieldname, msg, allowed=None):
            raise CapoptError(msg, field=f"model.{fieldname}", allowed=allowed)

        if self.family not in FAMILIES:
            bad("family", f"unknown family {self.family!r}", ", ".join(FAMILIES))
        if self.norm_type not in NORMS:
            bad("norm_type", f"unknown norm {self.norm_type!r}", ", ".join(NORMS))
        if self.position_embedding not in POSITIONS:
            bad("position_embedding", f"unknown {self.position_embedding!r}", ", ".join(POSITIONS))
        if self.mlp_type not in MLP_TYPES:
            bad("mlp_type", f"unknown {self.mlp_type!r}", ", ".join(MLP_TYPES))
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, f"must be a positive integer, got {v!r}")
        for name in ("intermediate_size", "vocab_size", "max_position_embeddings",
                     "type_vocab_size", "image_size", "patch_size", "num_labels",
                     "norms_per_layer", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                     "first_k_dense_replace", "dense_intermediate_size",
                     "shared_expert_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, f"must be a non-negative integer, got {v!r}")
        for name in ("num_key_value_heads", "head_dim", "v_head_dim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                bad(name, f"must be a positive integer (or left out), got {v!r}")
        for name in ("num_local_experts", "num_experts_per_tok", "num_channels"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, f"must be a positive integer, got {v!r}")
        if self.family != "mlp":
            if self.intermediate_size < 1:
                bad("intermediate_size", "must be a positive integer")
            if self.head_dim is None and self.hidden_size % self.num_attention_heads:
                bad("num_attention_heads",
                    f"{self.num_attention_heads} does not divide hidden_size {self.hidden_size}")
            if self.num_attention_heads % self.kv_heads:
                bad("num_key_value_heads",
                    f"{self.kv_heads} does not divide num_attention_heads "
                    f"{self.num_attention_heads}")
        if self.family in ("decoder", "encoder") and self.vocab_size < 1:
            bad("vocab_size", "must be a positive integer for a language model")
        if self.family == "vit":
            if self.patch_size < 1 or self.image_size < self.patch_size:
                bad("patch_size", "needs image_size >= patch_size >= 1")
        if self.num_local_experts < 1 or not (1 <= self.num_experts_per_tok
                                               <= self.num_local_experts):
            bad("num_experts_per_tok", "must be between 1 and num_local_experts")
        for name in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            if not 0.0 <= float(v) < 1.0:
                bad(name, f"must be in [0, 1), got {v!r}")
        if self.is_mla:
            if self.family != "decoder":
                bad("kv_lora_rank", "multi-head latent attention is a decoder's",
                    "0 unless family = \"decoder\"")
            if self.kv_heads != self.num_attention_heads:
                bad("num_key_value_heads", "latent attention expands k and v for every head",
                    f"{self.num_attention_heads} (num_attention_heads) or left out")
            if self.position_embedding != "rotary":
                bad("position_embedding", "latent attention's shared key is rotary",
                    "rotary when kv_lora_rank > 0")
            for name in ("attention_bias", "qk_norm"):
                if getattr(self, name):
                    bad(name, "is not part of multi-head latent attention",
                        "false unless kv_lora_rank = 0")
            if not 0 < self.qk_rope_head_dim < self.head_size or self.qk_rope_head_dim % 2:
                bad("qk_rope_head_dim", f"must be even and between 0 and head_dim "
                    f"{self.head_size} (the rotary part of each q/k head), got "
                    f"{self.qk_rope_head_dim}")
        else:
            for name in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name):
                    bad(name, "is a multi-head latent attention size",
                        "0 (left out) unless kv_lora_rank > 0")
        if not self.is_moe:
            for name in ("first_k_dense_replace", "dense_intermediate_size",
                         "shared_expert_intermediate_size"):
                if getattr(self, name):
                    bad(name, "is an MoE size", "0 (left out) unless num_local_experts > 1")
        if self.first_k_dense_replace:
            if self.first_k_dense_replace >= self.num_hidden_layers:
                bad("first_k_dense_replace", f"must be below num_hidden_layers "
                    f"{self.num_hidden_layers} (some layer keeps its experts)")
            if self.dense_intermediate_size < 1:
                bad("dense_intermediate_size", "the dense layers' MLP width must be positive "
                    "when first_k_dense_replace > 0")
        elif self.dense_intermediate_size:
            bad("dense_intermediate_size", "no layer is dense",
                "0 (left out) unless first_k_dense_replace > 0")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def v_head_size(self) -> int:
        """Each v head's width (multi-head latent attention: ``v_head_dim``)."""
        return self.v_head_dim or self.head_size

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is the experts (all but the first ``first_k_dense_replace``)."""
        return self.num_hidden_layers - self.first_k_dense_replace if self.is_moe else 0

    @property
    def has_vocab_head(self) -> bool:
        """Whether the model ends in a head over its vocabulary (a decoder, or an encoder with
        its masked-LM head): the logits a cross-entropy takes."""
        return self.family == "decoder" or (self.family == "encoder" and self.mlm_head)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.family == "vit" else 0

    @property
    def native_seq_len(self) -> int:
        """Tokens per sample fixed by the architecture (ViT: patches + class token), else 0."""
        return self.num_patches + 1 if self.family == "vit" else 0

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    # ---- parameters: sums over the tensor inventory (`capopt._inventory`) -------------------
    def tensors(self):
        """Every parameter tensor, once (`capopt._inventory.model_tensors`)."""
        return _inventory.model_tensors(self)

    def param_breakdown(self) -> dict[str, int]:
        """Parameters by group: embedding, attention, mlp (experts included), router, norms
        (inside the blocks), head (everything after the last block)."""
        out = dict.fromkeys(("embedding", "attention", "mlp", "router", "norms", "head"), 0)
        for t in self.tensors():
            if t.where == "embed":
                key = "embedding"
            elif t.where == "head":
                key = "head"
            elif ".norm" in t.name:
                key = "norms"
            elif "router" in t.name:
                key = "router"
            elif ".attn." in t.name:
                key = "attention"
            else:
                key = "mlp"
            out[key] += t.elements
        return out

    def num_params(self) -> int:
        return sum(t.elements for t in self.tensors())

    def active_params(self) -> int:
        """Parameters touched per token (MoE: top-k experts)."""
        idle = 1.0 - self.num_experts_per_tok / self.num_local_experts
        return self.num_params() - round(sum(t.elements * idle for t in self.tensors()
                                             if t.expert))

    def param_shapes(self) -> list[tuple[tuple[int, ...], int]]:
        """(shape, count) of every parameter tensor (the inventory's, kernels ``(in, out)``,
        MoE experts stacked on a leading axis)."""
        return [(t.shape, t.count) for t in self.tensors()]
