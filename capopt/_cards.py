"""Architecture cards: the `models/` catalog, card TOML files and Hugging Face ``config.json``.

A card is a TOML file whose top-level keys are `ModelSpec` field names (plus ``name``,
``family``, ``published_params`` and ``source``); unknown keys are errors. A Hugging Face
``config.json`` (a path, or a repo id such as ``meta-llama/Llama-3.1-8B`` read through the
Hub's cache, `capopt._hub`) imports as a card through `card_from_hf_config`, which applies
each model family's conventions (which projections carry biases, whether the LM head is
tied, ...), so that the imported card counts exactly the parameters of the checkpoint.

Every problem with the input raises `CapoptError` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._errors import CapoptError
from ._hub import hub_config_path, parse_repo_id
from ._io import check_depth, is_file, parse_json, parse_toml, path_exists, read_text
from ._model import ModelSpec

__all__ = ["HF_MODEL_TYPES", "card_from_dict", "card_from_hf_config", "list_cards", "load_card",
           "models_dir"]

_ENV_MODELS_DIR = "CAPOPT_MODELS_DIR"
_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(ModelSpec)}
_TYPES: dict[str, Any] = typing.get_type_hints(ModelSpec)
_REQUIRED = tuple(f.name for f in dataclasses.fields(ModelSpec)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


# ---- the catalog ------------------------------------------------------------------------------
def models_dir() -> Path:
    """The card catalog: ``$CAPOPT_MODELS_DIR`` if set, else the package's ``models/`` (the
    repository's ``models/`` links to it; a wheel ships it)."""
    env = os.environ.get(_ENV_MODELS_DIR)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "models"


def list_cards() -> list[str]:
    """Names of the cards in `models_dir`, sorted."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.stem for p in root.glob("*.toml") if p.is_file())


def load_card(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """A `ModelSpec` from a card name, a path to a card ``.toml`` or a ``.json``, or a Hugging
    Face repo id (``owner/name`` or ``owner/name@revision``) whose ``config.json`` is read.

    A name is looked up in `models_dir` (case-insensitively); ``owner/name`` that is not an
    existing path is a repo id; another string is taken as a path when it ends in ``.toml`` or
    ``.json``, contains a path separator, or names an existing file.

    >>> load_card("gpt2-124m").num_params()
    124439808
    """
    if not isinstance(name_or_path, os.PathLike):
        hub = parse_repo_id(str(name_or_path))
        if hub is not None and not path_exists(Path(str(name_or_path))):
            return _load_hub(*hub)
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(str(name_or_path)):
        return _load_path(Path(name_or_path))
    name = str(name_or_path).strip()
    known = list_cards()
    match = name if name in known else name.lower()
    if match not in known:
        near = difflib.get_close_matches(match, known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise CapoptError(f"unknown card {name!r}{hint}", field="model.card",
                          allowed=", ".join(known) or f"none: {models_dir()} has no cards")
    return _load_path(models_dir() / f"{match}.toml")


def _load_hub(repo_id: str, revision: str | None) -> ModelSpec:
    """A Hugging Face repo id's ``config.json`` (`capopt._hub`), named as the repo is
    (lower case) and, in errors, as ``repo_id/config.json``."""
    path = hub_config_path(repo_id, revision)
    where = f"{repo_id}/config.json"
    data = parse_json(read_text(path, field="model.card"), where)
    check_depth(data, where)
    return card_from_hf_config(data, name=repo_id.split("/")[-1].lower(), file=where)


def _looks_like_path(s: str) -> bool:
    return (s.endswith((".toml", ".json")) or "/" in s or os.sep in s
            or (os.altsep is not None and os.altsep in s) or is_file(s))


def _load_path(path: Path) -> ModelSpec:
    file = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise CapoptError(f"cannot tell what {path.name!r} is from its suffix", file=file,
                          allowed=".toml (a card), .json (a Hugging Face config)")
    text = read_text(path, field="model.card")
    if suffix == ".toml":
        data = parse_toml(text, file)
        check_depth(data, file)
        return card_from_dict(data, name=path.stem, file=file)
    data = parse_json(text, file)
    check_depth(data, file)
    name = path.parent.name if path.stem.lower() == "config" and path.parent.name else path.stem
    return card_from_hf_config(data, name=name.lower(), file=file)


# ---- card TOML -----------------------------------------------------------------------------
def card_from_dict(data: Mapping[str, Any], *, name: str | None = None,
                   file: str | None = None) -> ModelSpec:
    """A `ModelSpec` from a card's parsed TOML: `ModelSpec` field names at the top level.

    ``name`` is used when the card has no ``name`` key (the file stem, for a catalog card).
    Unknown keys, values of the wrong type and missing required keys raise `CapoptError`.
    """
    if not isinstance(data, Mapping):
        raise CapoptError(f"a card is a table of keys, got {type(data).__name__}", file=file)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _FIELDS:
            near = difflib.get_close_matches(key, list(_FIELDS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise CapoptError(f"unknown key {key!r}{hint}", file=file, field=key,
                              allowed=", ".join(sorted(_FIELDS)))
        kwargs[key] = _check_type(key, value, file)
    if "name" not in kwargs and name is not None:
        kwargs["name"] = name
    missing = [k for k in _REQUIRED if k not in kwargs]
    if missing:
        raise CapoptError(f"missing required key {missing[0]!r}", file=file, field=missing[0])
    return _build(kwargs, file, strip_prefix=True)


def _check_type(key: str, value: Any, file: str | None) -> Any:
    """``value`` checked against the `ModelSpec` annotation of ``key`` (TOML has no null)."""
    want = _TYPES[key]
    args = set(typing.get_args(want)) - {type(None)}
    base = next(iter(args)) if args else want
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base is str:
        ok = isinstance(value, str)
    elif key == "extra":
        ok = isinstance(value, Mapping) and all(
            isinstance(v, (str, int, float, bool)) for v in value.values())
        if ok:
            return tuple(sorted(value.items()))
        raise CapoptError("must be a table of strings, numbers or booleans", file=file,
                          field=key)
    else:                                       # a field type this loader does not know
        ok = isinstance(value, base) if isinstance(base, type) else True
    if not ok:
        kind = {bool: "true or false", int: "an integer", float: "a number",
                str: "a string"}.get(base, getattr(base, "__name__", str(base)))
        raise CapoptError(f"must be {kind}, got {value!r}", file=file, field=key)
    return value


def _build(kwargs: dict[str, Any], file: str | None, *, strip_prefix: bool) -> ModelSpec:
    """`ModelSpec(**kwargs)`, its validation errors located in ``file``.

    In a card file the keys are the field names themselves, so the ``model.`` prefix that
    `ModelSpec` puts on its fields (as they appear in a scenario) is dropped there.
    """
    try:
        return ModelSpec(**kwargs)
    except CapoptError as err:
        fieldname = err.field
        if strip_prefix and fieldname and fieldname.startswith("model."):
            fieldname = fieldname[len("model."):]
        raise CapoptError(err.message, file=err.file or file, field=fieldname,
                          allowed=err.allowed) from None


# ---- Hugging Face config.json ---------------------------------------------------------------
class _HF:
    """Typed access to one Hugging Face config dict; every problem names the key and file."""

    def __init__(self, config: Mapping[str, Any], file: str | None):
        self.config = config
        self.file = file

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def get_int(self, key: str, default: int | None = None, *, positive: bool = True) -> int:
        value = self.config.get(key)
        if value is None:
            if default is None:
                raise CapoptError(f"missing required key {key!r}", file=self.file, field=key)
            return default
        if not isinstance(value, int) or isinstance(value, bool) or (positive and value < 1):
            raise CapoptError(f"must be a {'positive ' if positive else ''}integer, "
                              f"got {value!r}", file=self.file, field=key)
        return value

    def opt_int(self, key: str) -> int | None:
        return self.get_int(key) if self.has(key) else None

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise CapoptError(f"must be true or false, got {value!r}", file=self.file,
                              field=key)
        return value

    def get_float(self, key: str, default: float) -> float:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CapoptError(f"must be a number, got {value!r}", file=self.file, field=key)
        return float(value)

    def get_str(self, key: str, default: str) -> str:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise CapoptError(f"must be a string, got {value!r}", file=self.file, field=key)
        return value

    def architecture(self) -> str | None:
        archs = self.config.get("architectures")
        if archs is None:
            return None
        if (not isinstance(archs, list) or not archs
                or not all(isinstance(a, str) for a in archs)):
            raise CapoptError(f"must be a list of class names, got {archs!r}", file=self.file,
                              field="architectures")
        return archs[0]

    def num_labels(self) -> int:
        """Classifier width as transformers sets it: ``id2label``, else ``num_labels``, else 2."""
        id2label = self.config.get("id2label")
        if id2label is not None:
            if not isinstance(id2label, Mapping) or not id2label:
                raise CapoptError("must be a non-empty table of labels", file=self.file,
                                  field="id2label")
            return len(id2label)
        return self.get_int("num_labels", 2)


# Keys kept (when present and scalar) in `ModelSpec.extra`: they change no parameter count but
# describe the checkpoint (attention window, numerics, ...).
_EXTRA_KEYS = ("model_type", "torch_dtype", "rope_theta", "sliding_window", "use_sliding_window",
               "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "attn_logit_softcapping",
               "final_logit_softcapping", "query_pre_attn_scalar", "router_aux_loss_coef")


def _decoder_common(hf: _HF) -> dict[str, Any]:
    """The Llama-style decoder shared by llama, mistral, mixtral, qwen2, phi3 and gemma."""
    heads = hf.get_int("num_attention_heads")
    return dict(
        family="decoder",
        hidden_size=hf.get_int("hidden_size"),
        num_hidden_layers=hf.get_int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=hf.get_int("num_key_value_heads", heads),
        head_dim=hf.opt_int("head_dim"),
        intermediate_size=hf.get_int("intermediate_size"),
        vocab_size=hf.get_int("vocab_size"),
        max_position_embeddings=hf.get_int("max_position_embeddings", 0, positive=False),
        position_embedding="rotary",
        norm_type="rmsnorm",
        mlp_type="gated",
        hidden_act=hf.get_str("hidden_act", "silu"),
        attention_dropout=hf.get_float("attention_dropout", 0.0),
    )


def _llama(hf: _HF) -> dict[str, Any]:
    # LlamaAttention puts `attention_bias` on q, k, v and o; LlamaMLP `mlp_bias` on all three.
    bias = hf.get_bool("attention_bias", False)
    return {**_decoder_common(hf), "attention_bias": bias, "attention_out_bias": bias,
            "mlp_bias": hf.get_bool("mlp_bias", False),
            "tie_word_embeddings": hf.get_bool("tie_word_embeddings", False)}


def _mistral(hf: _HF) -> dict[str, Any]:
    # No biases anywhere; the sliding window changes no parameter.
    return {**_decoder_common(hf), "tie_word_embeddings": hf.get_bool("tie_word_embeddings", False)}


def _mixtral(hf: _HF) -> dict[str, Any]:
    # Every layer: num_local_experts SwiGLU experts and a bias-free router (hidden -> experts).
    return {**_mistral(hf), "num_local_experts": hf.get_int("num_local_experts", 8),
            "num_experts_per_tok": hf.get_int("num_experts_per_tok", 2), "router_bias": False}


def _qwen2(hf: _HF) -> dict[str, Any]:
    # Qwen2Attention: q, k, v always carry a bias; o_proj never does.
    return {**_decoder_common(hf), "attention_bias": True, "attention_out_bias": False,
            "tie_word_embeddings": hf.get_bool("tie_word_embeddings", False)}


def _qwen3(hf: _HF) -> dict[str, Any]:
    # Qwen3Attention: `attention_bias` on q, k, v and o (false in the released models), and an
    # RMSNorm over each head's q and k (q_norm, k_norm: head_dim wide).
    bias = hf.get_bool("attention_bias", False)
    return {**_decoder_common(hf), "attention_bias": bias, "attention_out_bias": bias,
            "qk_norm": True, "tie_word_embeddings": hf.get_bool("tie_word_embeddings", False)}


def _qwen3_moe(hf: _HF) -> dict[str, Any]:
    # Qwen3MoeSparseMoeBlock: num_experts SwiGLU experts of moe_intermediate_size and a
    # bias-free router, in every layer when decoder_sparse_step is 1 and mlp_only_layers is
    # empty (the released models); no shared expert.
    step = hf.get_int("decoder_sparse_step", 1)
    dense = hf.config.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise CapoptError("some layers have a dense MLP (decoder_sparse_step "
                          f"{step}, mlp_only_layers {dense}); a card has one MLP kind for "
                          "every layer", file=hf.file, field="decoder_sparse_step",
                          allowed="decoder_sparse_step = 1 and no mlp_only_layers")
    return {**_qwen3(hf), "intermediate_size": hf.get_int("moe_intermediate_size"),
            "num_local_experts": hf.get_int("num_experts"),
            "num_experts_per_tok": hf.get_int("num_experts_per_tok"), "router_bias": False}


def _deepseek(hf: _HF) -> dict[str, Any]:
    # DeepseekV2/V3 (Liu et al. 2024, DeepSeek-AI 2024): multi-head latent attention (q_a,
    # q_a_layernorm and q_b, or q_proj when q_lora_rank is null; kv_a_proj_with_mqa,
    # kv_a_layernorm, kv_b_proj; o_proj; no biases), the first first_k_dense_replace layers a
    # dense SwiGLU MLP of intermediate_size, the rest n_routed_experts SwiGLU experts of
    # moe_intermediate_size with n_shared_experts always-active ones (one MLP that much
    # wider) and a bias-free router; V3's noaux_tc routing adds e_score_correction_bias (one
    # per expert) to the checkpoint. The multi-token-prediction layers
    # (num_nextn_predict_layers) are not part of the model the config describes.
    freq = hf.get_int("moe_layer_freq", 1)
    if freq != 1:
        raise CapoptError(f"every {freq}th layer has experts; a card has the experts in every "
                          "layer after the first first_k_dense_replace", file=hf.file,
                          field="moe_layer_freq", allowed="1")
    nope, rope = hf.get_int("qk_nope_head_dim"), hf.get_int("qk_rope_head_dim")
    experts, shared = hf.get_int("n_routed_experts"), hf.get_int("n_shared_experts", 0,
                                                                   positive=False)
    moe_f = hf.get_int("moe_intermediate_size")
    routing = hf.get_str("topk_method", "noaux_tc" if hf.config.get("model_type")
                         == "deepseek_v3" else "greedy")
    common = _decoder_common(hf)
    dense = hf.get_int("first_k_dense_replace", 0, positive=False)
    return {**common, "num_key_value_heads": None, "head_dim": nope + rope,
            "v_head_dim": hf.get_int("v_head_dim"), "qk_rope_head_dim": rope,
            "q_lora_rank": hf.get_int("q_lora_rank") if hf.has("q_lora_rank") else 0,
            "kv_lora_rank": hf.get_int("kv_lora_rank"),
            "intermediate_size": moe_f, "num_local_experts": experts,
            "num_experts_per_tok": hf.get_int("num_experts_per_tok"),
            "router_bias": routing == "noaux_tc",
            "first_k_dense_replace": dense,
            "dense_intermediate_size": common["intermediate_size"] if dense else 0,
            "shared_expert_intermediate_size": shared * moe_f,
            "tie_word_embeddings": hf.get_bool("tie_word_embeddings", False)}


def _phi3(hf: _HF) -> dict[str, Any]:
    # Fused qkv_proj and gate_up_proj hold exactly the q, k, v and gate, up matrices.
    bias = hf.get_bool("attention_bias", False)
    return {**_decoder_common(hf), "attention_bias": bias, "attention_out_bias": bias,
            "hidden_dropout": hf.get_float("resid_pdrop", 0.0),
            "tie_word_embeddings": hf.get_bool("tie_word_embeddings", False)}


def _gemma(hf: _HF) -> dict[str, Any]:
    # GeGLU (gated, tanh GELU), RMSNorm, tied embeddings, explicit head_dim.
    bias = hf.get_bool("attention_bias", False)
    act = hf.get_str("hidden_activation", hf.get_str("hidden_act", "gelu_pytorch_tanh"))
    return {**_decoder_common(hf), "head_dim": hf.get_int("head_dim", 256), "hidden_act": act,
            "attention_bias": bias, "attention_out_bias": bias,
            "tie_word_embeddings": hf.get_bool("tie_word_embeddings", True)}


def _gemma2(hf: _HF) -> dict[str, Any]:
    # Gemma 2 adds a norm after attention and after the MLP: four per layer.
    return {**_gemma(hf), "norms_per_layer": 4}


def _gemma3_text(hf: _HF) -> dict[str, Any]:
    # Gemma 3's text model: Gemma 2's four norms per layer, plus an RMSNorm over each head's
    # q and k (head_dim wide); local/global attention changes no parameter.
    return {**_gemma2(hf), "qk_norm": True}


def _gpt2(hf: _HF) -> dict[str, Any]:
    # Conv1D projections with biases everywhere, learned positions, LM head tied to wte.
    n_embd = hf.get_int("n_embd")
    inner = hf.opt_int("n_inner")
    return dict(
        family="decoder", hidden_size=n_embd, num_hidden_layers=hf.get_int("n_layer"),
        num_attention_heads=hf.get_int("n_head"), intermediate_size=inner or 4 * n_embd,
        vocab_size=hf.get_int("vocab_size"), max_position_embeddings=hf.get_int("n_positions"),
        position_embedding="learned", norm_type="layernorm", mlp_type="gelu",
        hidden_act=hf.get_str("activation_function", "gelu_new"),
        tie_word_embeddings=hf.get_bool("tie_word_embeddings", True),
        attention_bias=True, attention_out_bias=True, mlp_bias=True,
        hidden_dropout=hf.get_float("resid_pdrop", 0.1),
        attention_dropout=hf.get_float("attn_pdrop", 0.1),
    )


# Which heads each BERT checkpoint class carries (see `ModelSpec`).
_BERT_HEADS: dict[str, dict[str, Any]] = {
    "BertModel": dict(pooler=True),
    "BertForMaskedLM": dict(mlm_head=True),
    "BertForPreTraining": dict(pooler=True, mlm_head=True, num_labels=2),   # + NSP classifier
    "BertForSequenceClassification": dict(pooler=True),                    # + num_labels
}


def _bert(hf: _HF) -> dict[str, Any]:
    kind = hf.get_str("position_embedding_type", "absolute")
    if kind != "absolute":
        raise CapoptError(f"position_embedding_type {kind!r} is not supported", file=hf.file,
                          field="position_embedding_type", allowed="absolute")
    arch = hf.architecture() or "BertModel"
    if arch not in _BERT_HEADS:
        raise CapoptError(f"unsupported BERT class {arch!r}", file=hf.file,
                          field="architectures", allowed=", ".join(_BERT_HEADS))
    heads = dict(_BERT_HEADS[arch])
    if arch == "BertForSequenceClassification":
        heads["num_labels"] = hf.num_labels()
    return dict(
        family="encoder", hidden_size=hf.get_int("hidden_size"),
        num_hidden_layers=hf.get_int("num_hidden_layers"),
        num_attention_heads=hf.get_int("num_attention_heads"),
        intermediate_size=hf.get_int("intermediate_size"), vocab_size=hf.get_int("vocab_size"),
        max_position_embeddings=hf.get_int("max_position_embeddings"),
        type_vocab_size=hf.get_int("type_vocab_size", 2, positive=False),
        position_embedding="learned", norm_type="layernorm", mlp_type="gelu",
        hidden_act=hf.get_str("hidden_act", "gelu"),
        tie_word_embeddings=hf.get_bool("tie_word_embeddings", True),
        attention_bias=True, attention_out_bias=True, mlp_bias=True, embedding_norm=True,
        hidden_dropout=hf.get_float("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get_float("attention_probs_dropout_prob", 0.1),
        **heads,
    )


def _vit(hf: _HF) -> dict[str, Any]:
    arch = hf.architecture() or "ViTModel"
    if arch == "ViTForImageClassification":
        heads: dict[str, Any] = dict(num_labels=hf.num_labels())
    elif arch == "ViTModel":
        heads = dict(pooler=True)               # ViTModel's default add_pooling_layer=True
    else:
        raise CapoptError(f"unsupported ViT class {arch!r}", file=hf.file,
                          field="architectures",
                          allowed="ViTModel, ViTForImageClassification")
    bias = hf.get_bool("qkv_bias", True)
    return dict(
        family="vit", hidden_size=hf.get_int("hidden_size"),
        num_hidden_layers=hf.get_int("num_hidden_layers"),
        num_attention_heads=hf.get_int("num_attention_heads"),
        intermediate_size=hf.get_int("intermediate_size"), image_size=hf.get_int("image_size", 224),
        patch_size=hf.get_int("patch_size", 16), num_channels=hf.get_int("num_channels", 3),
        position_embedding="learned", norm_type="layernorm", mlp_type="gelu",
        hidden_act=hf.get_str("hidden_act", "gelu"),
        attention_bias=bias, attention_out_bias=True, mlp_bias=True,
        hidden_dropout=hf.get_float("hidden_dropout_prob", 0.0),
        attention_dropout=hf.get_float("attention_probs_dropout_prob", 0.0),
        **heads,
    )


_IMPORTERS: dict[str, Callable[[_HF], dict[str, Any]]] = {
    "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "llama": _llama, "mistral": _mistral, "mixtral": _mixtral, "qwen2": _qwen2,
    "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "phi3": _phi3, "gemma": _gemma, "gemma2": _gemma2,
    "gemma3_text": _gemma3_text, "gpt2": _gpt2, "bert": _bert, "vit": _vit,
}
HF_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_IMPORTERS))
"""The Hugging Face ``model_type`` values that `card_from_hf_config` imports."""


def card_from_hf_config(config: Mapping[str, Any], name: str | None = None, *,
                        file: str | None = None) -> ModelSpec:
    """A `ModelSpec` from a Hugging Face ``config.json`` dict; ``model_type`` picks the family.

    Sizes missing from the config are errors (not the library's defaults), except where a
    family's default is part of its convention (``n_inner`` of GPT-2, ``num_key_value_heads``
    = heads, ``tie_word_embeddings``, bias flags). The card's ``name`` is ``name``, else the
    last part of ``_name_or_path``, else the ``model_type``.

    >>> card_from_hf_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12,
    ...                      "n_head": 12, "n_positions": 1024, "vocab_size": 50257}).num_params()
    124439808
    """
    if not isinstance(config, Mapping):
        raise CapoptError(f"a config is a JSON object, got {type(config).__name__}", file=file)
    hf = _HF(config, file)
    model_type = config.get("model_type")
    if model_type is None:
        raise CapoptError("missing required key 'model_type'", file=file, field="model_type",
                          allowed=", ".join(HF_MODEL_TYPES))
    if model_type not in _IMPORTERS:
        raise CapoptError(f"unsupported model_type {model_type!r}", file=file,
                          field="model_type", allowed=", ".join(HF_MODEL_TYPES))
    kwargs = _IMPORTERS[model_type](hf)
    if name is None:
        path_name = config.get("_name_or_path")
        name = (path_name.rstrip("/").rsplit("/", 1)[-1].lower()
                if isinstance(path_name, str) and path_name.strip("/") else str(model_type))
    extra = {"architecture": hf.architecture()} if hf.architecture() else {}
    extra.update({k: config[k] for k in _EXTRA_KEYS
                  if isinstance(config.get(k), (str, int, float, bool))})
    kwargs.update(name=name, extra=tuple(sorted(extra.items())),
                  source=f"Hugging Face config.json{f' ({file})' if file else ''}, "
                         f"model_type {model_type!r}")
    return _build(kwargs, file, strip_prefix=False)
