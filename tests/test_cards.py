"""Architecture cards: exact parameter counts against published checkpoints, Hugging Face
imports, and errors that name the file and the key for every kind of bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from capopt._cards import (HF_MODEL_TYPES, card_from_hf_config, list_cards, load_card,
                           models_dir)
from capopt._errors import CapoptError
from capopt._model import ModelSpec

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

CATALOG = ("gpt2-124m", "gpt2-1.5b", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
           "llama-3-70b", "mistral-7b", "mixtral-8x7b", "vit-b16", "vit-l16", "bert-base",
           "tiny-gpt", "tiny-llama")


# ---- the catalog ------------------------------------------------------------------------------
def test_catalog_lists_every_named_card():
    assert set(CATALOG) <= set(list_cards())
    assert list_cards() == sorted(list_cards())


@pytest.mark.parametrize("name", list_cards())
def test_card_count_is_the_published_count(name):
    card = load_card(name)
    assert card.name == name                      # file name = card name
    assert card.source, "every card cites where its count comes from"
    assert card.published_params is not None
    assert card.num_params() == card.published_params
    assert sum(card.param_breakdown().values()) == card.num_params()
    assert all(v >= 0 for v in card.param_breakdown().values())


@pytest.mark.parametrize("name", list_cards())
def test_card_round_trips_through_toml(name, tmp_path):
    """Every field a card can hold is written and read back unchanged."""
    card = load_card(name)
    lines = []
    for f in dataclasses.fields(ModelSpec):
        value = getattr(card, f.name)
        if value is None or f.name == "extra":
            continue
        lines.append(f"{f.name} = {json.dumps(value)}")
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_card(path) == card


def test_load_card_accepts_a_name_a_path_and_a_path_string():
    by_name = load_card("llama-2-7b")
    path = models_dir() / "llama-2-7b.toml"
    assert load_card(path) == by_name
    assert load_card(str(path)) == by_name
    assert load_card("Llama-2-7B") == by_name     # names are lower case; lookup ignores case


def test_dropout_is_recorded_where_the_authors_train_with_it():
    for name in ("gpt2-124m", "gpt2-1.5b", "bert-base"):
        card = load_card(name)
        assert card.hidden_dropout == 0.1 and card.attention_dropout == 0.1
    assert load_card("llama-2-7b").hidden_dropout == 0.0


def test_tiny_cards_have_the_shapes_fast_tests_rely_on():
    gpt = load_card("tiny-gpt")
    assert (gpt.num_hidden_layers, gpt.hidden_size, gpt.num_attention_heads, gpt.vocab_size,
            gpt.max_position_embeddings) == (2, 64, 4, 256, 128)
    llama = load_card("tiny-llama")
    assert (llama.mlp_type, llama.norm_type, llama.position_embedding) == (
        "gated", "rmsnorm", "rotary")
    assert (llama.num_attention_heads, llama.kv_heads, llama.num_hidden_layers) == (4, 2, 2)


def test_mixtral_active_parameters_match_the_announcement():
    card = load_card("mixtral-8x7b")
    # Mistral AI: "46.7B total parameters but only uses 12.9B parameters per token". The
    # figure is rounded to 0.1B, i.e. known to +-0.05B = +-0.39% of 12.9B; 0.5% allows that
    # rounding and nothing more (the exact count, 12,879,925,248, is 0.16% below 12.9B).
    assert card.active_params() == pytest.approx(12.9e9, rel=0.005)
    assert card.num_params() == 46_702_792_704
    dense = card.replace(num_local_experts=1, num_experts_per_tok=1)
    # top-2 of 8: each layer touches one SwiGLU expert (3 x 4096 x 14336) and the router
    # (4096 x 8) beyond the dense Mistral-7B-shaped model.
    assert card.active_params() - dense.num_params() == 32 * (3 * 4096 * 14336 + 4096 * 8)


def test_bert_heads_give_each_published_checkpoint_class():
    base = load_card("bert-base")                       # BertModel: encoder + pooler
    assert base.num_params() == 109_482_240
    # BertForMaskedLM: no pooler; transform dense + LayerNorm + decoder bias (weight tied).
    assert base.replace(pooler=False, mlm_head=True).num_params() == 109_514_298
    # BertForPreTraining (the Hub checkpoint's safetensors total): + next-sentence classifier.
    assert base.replace(mlm_head=True, num_labels=2).num_params() == 110_106_428


# ---- Hugging Face config.json ---------------------------------------------------------------
# (fixture, exact parameter count of the official checkpoint as transformers loads it, source)
HF_COUNTS = [
    ("llama-2-7b.json", 6_738_415_616, "meta-llama/Llama-2-7b-hf; keras-hub llama2_7b_en"),
    ("mistral-7b-v0.1.json", 7_241_732_096, "mistralai/Mistral-7B-v0.1; keras-hub"),
    ("mixtral-8x7b-v0.1.json", 46_702_792_704, "mistralai/Mixtral-8x7B-v0.1 safetensors"),
    ("qwen2.5-0.5b.json", 494_032_768, "Qwen/Qwen2.5-0.5B (tied); keras-hub qwen2.5_0.5b_en"),
    ("gpt2.json", 124_439_808, "openai-community/gpt2 GPT2LMHeadModel; keras-hub"),
    ("phi-3-mini-4k-instruct.json", 3_821_079_552, "microsoft/Phi-3-mini-4k-instruct"),
    ("gemma-2b.json", 2_506_172_416, "google/gemma-2b; keras-hub gemma_2b_en"),
    ("gemma-2-2b-it.json", 2_614_341_888, "google/gemma-2-2b(-it) Gemma2ForCausalLM"),
    ("bert-base-uncased.json", 109_514_298, "bert-base-uncased as BertForMaskedLM"),
]


@pytest.mark.parametrize("fixture, expected, source", HF_COUNTS,
                         ids=[c[0].removesuffix(".json") for c in HF_COUNTS])
def test_hf_import_counts_the_official_checkpoint(fixture, expected, source):
    card = load_card(FIXTURES / fixture)
    assert card.num_params() == expected, source
    assert card.name == fixture.removesuffix(".json")
    assert dict(card.extra)["model_type"] in HF_MODEL_TYPES


@pytest.mark.parametrize("fixture, name", [
    ("llama-2-7b.json", "llama-2-7b"), ("mistral-7b-v0.1.json", "mistral-7b"),
    ("mixtral-8x7b-v0.1.json", "mixtral-8x7b"), ("gpt2.json", "gpt2-124m"),
    ("qwen3-4b.json", "qwen3-4b"), ("qwen3-30b-a3b.json", "qwen3-30b-a3b"),
    ("gemma-3-1b-pt.json", "gemma-3-1b"), ("deepseek-v2-lite.json", "deepseek-v2-lite"),
    ("deepseek-v3.json", "deepseek-v3"),
])
def test_hf_import_agrees_with_the_catalog_card(fixture, name):
    imported, card = load_card(FIXTURES / fixture), load_card(name)
    assert imported.param_breakdown() == card.param_breakdown()
    keys = ("family", "position_embedding", "norm_type", "mlp_type", "kv_heads", "head_size",
            "tie_word_embeddings", "hidden_dropout", "attention_dropout", "num_experts_per_tok",
            "v_head_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
            "first_k_dense_replace", "dense_intermediate_size",
            "shared_expert_intermediate_size", "router_bias")
    assert {k: getattr(imported, k) for k in keys} == {k: getattr(card, k) for k in keys}


def test_deepseek_blocks_count_as_the_papers_describe_them():
    """Latent attention, dense first blocks and shared experts, each against its arithmetic."""
    v3 = load_card("deepseek-v3")
    h, a, L = 7168, 128, 61
    attn = (h * 1536 + 1536 + 1536 * a * 192          # q_a, its norm, q_b (q heads 128 + 64)
            + h * (512 + 64) + 512                    # kv_a (latent + shared rotary key), norm
            + 512 * a * (128 + 128) + a * 128 * h)    # kv_b (k's 128 + v's 128 per head), o
    assert v3.param_breakdown()["attention"] == L * attn
    dense, expert = 3 * h * 18432, 3 * h * 2048
    assert v3.param_breakdown()["mlp"] == 3 * dense + 58 * (256 + 1) * expert
    assert v3.param_breakdown()["router"] == 58 * (h * 256 + 256)
    # per token: 8 routed experts and the shared one in 58 blocks; "37B activated" (the
    # paper) leaves the input embedding out
    assert round((v3.active_params() - v3.param_breakdown()["embedding"]) / 1e9) == 37
    lite = load_card("deepseek-v2-lite")                # q straight from the hidden state
    assert lite.param_breakdown()["attention"] == 27 * (
        2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048)
    # a config whose experts skip layers is refused, naming the key
    with pytest.raises(CapoptError) as err:
        card_from_hf_config({**json.loads((FIXTURES / "deepseek-v3.json").read_text()),
                             "moe_layer_freq": 2}, file="c.json")
    assert err.value.field == "moe_layer_freq" and err.value.file == "c.json"


@pytest.mark.parametrize("change, field", [
    (dict(kv_lora_rank=16, qk_rope_head_dim=0), "qk_rope_head_dim"),
    (dict(kv_lora_rank=16, qk_rope_head_dim=8, num_key_value_heads=2), "num_key_value_heads"),
    (dict(q_lora_rank=16), "q_lora_rank"),
    (dict(first_k_dense_replace=1, dense_intermediate_size=64), "first_k_dense_replace"),
])
def test_latent_attention_and_moe_sizes_are_checked(change, field):
    base = load_card("tiny-llama")
    with pytest.raises(CapoptError) as err:
        base.replace(**{"num_key_value_heads": None, **change})
    assert err.value.field == f"model.{field}"


def test_hf_family_conventions():
    qwen = load_card(FIXTURES / "qwen2.5-0.5b.json")
    assert (qwen.attention_bias, qwen.attention_out_bias, qwen.tie_word_embeddings) == (
        True, False, True)
    phi3 = load_card(FIXTURES / "phi-3-mini-4k-instruct.json")
    assert not phi3.tie_word_embeddings and not phi3.attention_bias
    gemma = load_card(FIXTURES / "gemma-2b.json")
    assert (gemma.head_size, gemma.kv_heads, gemma.tie_word_embeddings, gemma.mlp_type) == (
        256, 1, True, "gated")
    assert load_card(FIXTURES / "gemma-2-2b-it.json").norms_per_layer == 4
    mixtral = load_card(FIXTURES / "mixtral-8x7b-v0.1.json")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (8, 2)
    llama = card_from_hf_config({**json.loads((FIXTURES / "llama-2-7b.json").read_text()),
                                 "attention_bias": True, "mlp_bias": True})
    plain = load_card(FIXTURES / "llama-2-7b.json")
    # q, k, v and o biases (4 x 4096) and gate, up (2 x 11008) and down (4096) biases, per layer
    assert llama.num_params() - plain.num_params() == 32 * (4 * 4096 + 2 * 11008 + 4096)
    assert llama.name == "llama-2-7b-hf"              # from _name_or_path


def test_per_head_qk_norms_are_two_head_dim_vectors_per_layer():
    card = load_card("qwen3-8b")
    without = dataclasses.replace(card, qk_norm=False)
    assert card.num_params() - without.num_params() == 2 * card.head_size * card.num_hidden_layers
    for fixture in ("qwen3-4b.json", "qwen3-30b-a3b.json", "gemma-3-1b-pt.json"):
        assert load_card(FIXTURES / fixture).qk_norm


def test_qwen3_moe_with_dense_layers_is_refused_in_one_line():
    config = {**json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text()),
              "mlp_only_layers": [0, 1]}
    with pytest.raises(CapoptError) as e:
        card_from_hf_config(config, name="mixed")
    assert "mlp_only_layers" in str(e.value) and "\n" not in str(e.value)


def test_hf_gpt2_defaults_n_inner_to_four_times_width():
    config = {"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25,
              "n_positions": 1024, "vocab_size": 50257, "n_inner": None}
    card = card_from_hf_config(config, name="gpt2-xl")
    assert card.intermediate_size == 6400
    assert card.num_params() == load_card("gpt2-1.5b").num_params() == 1_557_611_200


def test_hf_vit_classifier_and_bare_model():
    config = {"model_type": "vit", "architectures": ["ViTForImageClassification"],
              "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "intermediate_size": 3072, "image_size": 224, "patch_size": 16,
              "num_channels": 3, "qkv_bias": True,
              "id2label": {str(i): f"class {i}" for i in range(1000)}}
    assert card_from_hf_config(config).num_params() == load_card("vit-b16").num_params()
    bare = card_from_hf_config({**config, "architectures": ["ViTModel"]})
    # ViTModel: no classifier, a 768x768 pooler instead (86,389,248, e.g.
    # google/vit-base-patch16-224-in21k).
    assert bare.num_params() == 86_567_656 - (768 * 1000 + 1000) + (768 * 768 + 768)


def test_hf_bert_classes():
    config = json.loads((FIXTURES / "bert-base-uncased.json").read_text())
    assert card_from_hf_config({**config, "architectures": ["BertModel"]}).num_params() == (
        load_card("bert-base").num_params())
    pretraining = card_from_hf_config({**config, "architectures": ["BertForPreTraining"]})
    assert pretraining.num_params() == 110_106_428
    classifier = card_from_hf_config({**config, "architectures": [
        "BertForSequenceClassification"], "id2label": {"0": "neg", "1": "pos", "2": "mixed"}})
    assert classifier.num_params() == 109_482_240 + 768 * 3 + 3


# ---- bad input --------------------------------------------------------------------------------
def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


GOOD_CARD = """name = "mini"
family = "decoder"
hidden_size = 64
num_hidden_layers = 2
num_attention_heads = 4
intermediate_size = 256
vocab_size = 256
"""


def test_a_minimal_card_loads(tmp_path):
    card = load_card(_write(tmp_path, "mini.toml", GOOD_CARD))
    assert card.name == "mini" and card.published_params is None


@pytest.mark.parametrize("text, field, words", [
    ("name = \"x\"\nfamily = \n", None, "malformed TOML"),
    (GOOD_CARD + "hiden_size = 64\n", "hiden_size", "did you mean 'hidden_size'"),
    (GOOD_CARD.replace("hidden_size = 64", "hidden_size = \"64\""), "hidden_size", "integer"),
    (GOOD_CARD + "tie_word_embeddings = 1\n", "tie_word_embeddings", "true or false"),
    (GOOD_CARD.replace('family = "decoder"\n', ""), "family", "missing"),
    (GOOD_CARD.replace("num_attention_heads = 4", "num_attention_heads = 5"),
     "num_attention_heads", "does not divide"),
    (GOOD_CARD + 'norm_type = "batchnorm"\n', "norm_type", "unknown norm"),
    (GOOD_CARD + "num_key_value_heads = 0\n", "num_key_value_heads", "positive integer"),
    (GOOD_CARD + "extra = [1, 2]\n", "extra", "table"),
])
def test_bad_card_files_name_the_file_and_the_key(tmp_path, text, field, words):
    path = _write(tmp_path, "bad.toml", text)
    with pytest.raises(CapoptError) as info:
        load_card(path)
    err = info.value
    assert err.file == str(path)
    assert err.field == field
    assert words in str(err) and str(path) in str(err)
    assert "\n" not in str(err)                   # the CLI prints it as one line


def test_unknown_key_lists_the_allowed_keys(tmp_path):
    with pytest.raises(CapoptError) as info:
        load_card(_write(tmp_path, "bad.toml", GOOD_CARD + "flash = true\n"))
    assert "'flash'" in info.value.message
    assert "hidden_size" in info.value.allowed and "published_params" in info.value.allowed


def test_unknown_card_name_lists_the_known_cards():
    with pytest.raises(CapoptError) as info:
        load_card("llama-9-1t")
    err = info.value
    assert err.field == "model.card"
    assert all(name in err.allowed for name in list_cards())


@pytest.mark.parametrize("text, field, words", [
    ("{\"model_type\": \"llama\",", None, "not valid JSON"),
    ("[1, 2, 3]", None, "JSON object"),
    ("{\"hidden_size\": 64}", "model_type", "missing"),
    ("{\"model_type\": \"t5\"}", "model_type", "unsupported model_type 't5'"),
    ("{\"model_type\": \"llama\", \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
     "hidden_size", "missing"),
    ("{\"model_type\": \"gpt2\", \"n_embd\": 64, \"n_layer\": \"2\"}", "n_layer", "integer"),
    ("{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
     "\"num_attention_heads\": 4, \"intermediate_size\": 128, \"vocab_size\": 256, "
     "\"tie_word_embeddings\": \"no\"}", "tie_word_embeddings", "true or false"),
    ("{\"model_type\": \"bert\", \"position_embedding_type\": \"relative_key\"}",
     "position_embedding_type", "not supported"),
    ("{\"model_type\": \"vit\", \"architectures\": [\"ViTForMaskedImageModeling\"]}",
     "architectures", "unsupported ViT class"),
])
def test_bad_hf_configs_name_the_file_and_the_key(tmp_path, text, field, words):
    path = _write(tmp_path, "config.json", text)
    with pytest.raises(CapoptError) as info:
        load_card(path)
    err = info.value
    assert err.file == str(path)
    assert err.field == field
    assert words in str(err)


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(CapoptError) as info:
        card_from_hf_config({"model_type": "mamba"})
    assert info.value.allowed == ", ".join(HF_MODEL_TYPES)
    for family in ("llama", "mistral", "mixtral", "qwen2", "gpt2", "phi3", "gemma", "gemma2",
                   "bert", "vit"):
        assert family in HF_MODEL_TYPES


def test_missing_and_unrecognised_files(tmp_path):
    with pytest.raises(CapoptError) as info:
        load_card(tmp_path / "nowhere.toml")
    assert info.value.file == str(tmp_path / "nowhere.toml") and "no such file" in str(info.value)
    with pytest.raises(CapoptError) as info:
        load_card(_write(tmp_path, "card.yaml", "name: x\n"))
    assert info.value.file == str(tmp_path / "card.yaml") and ".toml" in info.value.allowed


def test_a_config_json_takes_its_directory_name(tmp_path):
    folder = tmp_path / "Mistral-7B-v0.1"
    folder.mkdir()
    (folder / "config.json").write_text((FIXTURES / "mistral-7b-v0.1.json").read_text())
    assert load_card(folder / "config.json").name == "mistral-7b-v0.1"


def test_models_dir_follows_the_environment(tmp_path, monkeypatch):
    _write(tmp_path, "mini.toml", GOOD_CARD)
    monkeypatch.setenv("CAPOPT_MODELS_DIR", str(tmp_path))
    assert models_dir() == tmp_path
    assert list_cards() == ["mini"]
    assert load_card("mini").hidden_size == 64
    with pytest.raises(CapoptError) as info:
        load_card("gpt2-124m")
    assert info.value.allowed == "mini"
