"""`ModelSpec`: an architecture card, and its exact parameter count by group.

Field names follow Hugging Face ``config.json`` where a field exists there. Every count is
plain integer arithmetic: the cost model reads the groups below, the Flax validation builds
the same shapes, and the tests compare the total to the number the authors published.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
    mlp_type: str = "gelu"                      # gelu (up, down) | gated (gate, up, down)
    hidden_act: str = "gelu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False                # biases on q, k, v
    attention_out_bias: bool = False            # bias on the output projection
    mlp_bias: bool = False
    lm_head_bias: bool = False
    # MoE (num_local_experts > 1): every layer's MLP is num_local_experts experts + a router.
    num_local_experts: int = 1
    num_experts_per_tok: int = 1
    router_bias: bool = False
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
                     "norms_per_layer"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, f"must be a non-negative integer, got {v!r}")
        for name in ("num_key_value_heads", "head_dim"):
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

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.family == "vit" else 0

    @property
    def native_seq_len(self) -> int:
        """Tokens per sample fixed by the architecture (ViT: patches + class token), else 0."""
        return self.num_patches + 1 if self.family == "vit" else 0

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    # ---- parameters ------------------------------------------------------------------------
    def norm_params(self) -> int:
        """One norm: weight (rmsnorm) or weight and bias (layernorm)."""
        return self.hidden_size * (2 if self.norm_type == "layernorm" else 1)

    def layer_norm_params(self) -> int:
        """All norms inside one block (``norms_per_layer`` of them; none in an "mlp" stack)."""
        if self.family == "mlp":
            return 0
        return self.norms_per_layer * self.norm_params()

    def attention_params(self) -> int:
        h, hd = self.hidden_size, self.head_size
        q = self.num_attention_heads * hd
        kv = self.kv_heads * hd
        n = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            n += q + 2 * kv
        if self.attention_out_bias:
            n += h
        return n

    def expert_params(self) -> int:
        """One MLP (one expert of an MoE layer)."""
        h, f = self.hidden_size, self.intermediate_size
        mats = 3 if self.mlp_type == "gated" else 2
        n = mats * h * f
        if self.mlp_bias:
            n += (mats - 1) * f + h
        return n

    def router_params(self) -> int:
        if not self.is_moe:
            return 0
        return self.hidden_size * self.num_local_experts + (
            self.num_local_experts if self.router_bias else 0)

    def layer_params(self) -> int:
        """All parameters of one block (experts included)."""
        if self.family == "mlp":
            return self.hidden_size * self.hidden_size + self.hidden_size
        return (self.attention_params() + self.num_local_experts * self.expert_params()
                + self.router_params() + self.layer_norm_params())

    def layer_dense_params(self) -> int:
        """One block without its experts (attention, norms, router; the MLP if dense)."""
        if self.is_moe:
            return self.layer_params() - self.num_local_experts * self.expert_params()
        return self.layer_params()

    def embedding_params(self) -> int:
        h = self.hidden_size
        if self.family == "mlp":
            return 0
        if self.family == "vit":
            patch = self.num_channels * self.patch_size ** 2 * h + h
            return patch + h + (self.num_patches + 1) * h   # projection, cls token, positions
        n = self.vocab_size * h
        if self.position_embedding == "learned":
            n += self.max_position_embeddings * h
        n += self.type_vocab_size * h
        if self.embedding_norm:
            n += self.norm_params()
        return n

    def head_params(self) -> int:
        """Everything after the last block: final norm, pooler, LM/MLM/classifier head."""
        h = self.hidden_size
        n = 0
        if self.family in ("decoder", "vit"):
            n += self.norm_params()          # final norm
        if self.family == "decoder":
            if not self.tie_word_embeddings:
                n += self.vocab_size * h
            if self.lm_head_bias:
                n += self.vocab_size
        if self.pooler:
            n += h * h + h
        if self.mlm_head:
            n += h * h + h + self.norm_params() + self.vocab_size
            if not self.tie_word_embeddings:
                n += self.vocab_size * h
        if self.num_labels:
            n += h * self.num_labels + self.num_labels
        return n

    def param_breakdown(self) -> dict[str, int]:
        L = self.num_hidden_layers
        return {
            "embedding": self.embedding_params(),
            "attention": L * (self.attention_params() if self.family != "mlp" else 0),
            "mlp": L * (self.num_local_experts * self.expert_params()
                        if self.family != "mlp" else self.layer_params()),
            "router": L * self.router_params(),
            "norms": L * self.layer_norm_params(),
            "head": self.head_params(),
        }

    def num_params(self) -> int:
        return sum(self.param_breakdown().values())

    def active_params(self) -> int:
        """Parameters touched per token (MoE: top-k experts)."""
        inactive = (self.num_local_experts - self.num_experts_per_tok) * self.expert_params()
        return self.num_params() - self.num_hidden_layers * inactive

    def param_shapes(self) -> list[tuple[tuple[int, ...], int]]:
        """(shape, count) of every parameter tensor, as the validation models build them
        (``capopt.validation.models``: kernels (in, out), MoE experts stacked on a leading
        axis); the element counts sum to `num_params`. Per-tensor optimizer state (Adafactor's
        factored moments, 8-bit Adam's blocks) is counted from these."""
        h, f, hd, L = self.hidden_size, self.intermediate_size, self.head_size, \
            self.num_hidden_layers
        out: list[tuple[tuple[int, ...], int]] = []

        def add(shape, count=1):
            if count and all(d > 0 for d in shape):
                out.append((tuple(shape), count))

        def norm(count):
            add((h,), count * (2 if self.norm_type == "layernorm" else 1))

        if self.family == "mlp":
            add((h, h), L)
            add((h,), L)
            return out
        # embeddings
        if self.family == "vit":
            add((self.num_channels * self.patch_size ** 2, h))
            add((h,))                                   # patch bias
            add((h,))                                   # class token
            add((self.num_patches + 1, h))              # positions
        else:
            add((self.vocab_size, h))
            if self.position_embedding == "learned":
                add((self.max_position_embeddings, h))
            if self.type_vocab_size:
                add((self.type_vocab_size, h))
            if self.embedding_norm:
                norm(1)
        # blocks
        q, kv = self.num_attention_heads * hd, self.kv_heads * hd
        norm(self.norms_per_layer * L)
        add((h, q), L)
        add((h, kv), 2 * L)
        add((q, h), L)
        if self.attention_bias:
            add((q,), L)
            add((kv,), 2 * L)
        if self.attention_out_bias:
            add((h,), L)
        gated = self.mlp_type == "gated"
        if self.is_moe:
            E = self.num_local_experts
            add((h, E), L)
            if self.router_bias:
                add((E,), L)
            add((E, h, f), (2 if gated else 1) * L)
            add((E, f, h), L)
            if self.mlp_bias:
                add((E, f), (2 if gated else 1) * L)
                add((E, h), L)
        else:
            add((h, f), (2 if gated else 1) * L)
            add((f, h), L)
            if self.mlp_bias:
                add((f,), (2 if gated else 1) * L)
                add((h,), L)
        # heads
        if self.family in ("decoder", "vit"):
            norm(1)
        if self.family == "decoder":
            if not self.tie_word_embeddings:
                add((h, self.vocab_size))
            if self.lm_head_bias:
                add((self.vocab_size,))
        if self.pooler:
            add((h, h))
            add((h,))
        if self.mlm_head:
            add((h, h))
            add((h,))
            norm(1)
            if not self.tie_word_embeddings:
                add((h, self.vocab_size))
            add((self.vocab_size,))
        if self.num_labels:
            add((h, self.num_labels))
            add((self.num_labels,))
        return out

    def matrix_shapes(self) -> list[tuple[int, int, int]]:
        """(rows, cols, count) for every 2-D weight tensor (embeddings, positions, patch,
        pooler and classifier matrices included); MoE experts count once per expert."""
        mats = []
        for shape, count in self.param_shapes():
            if len(shape) == 2:
                mats.append((shape[0], shape[1], count))
            elif len(shape) == 3:
                mats.append((shape[1], shape[2], count * shape[0]))
        return mats
