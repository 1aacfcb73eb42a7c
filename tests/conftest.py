"""Shared test helpers: scenarios built in code, independent of the data catalogs."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from capopt._hardware import GiB, Hardware  # noqa: E402
from capopt._model import ModelSpec  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import Budget, KnobDomain, Scenario, Workload  # noqa: E402

# An A100-80GB-like device; figures only need to be plausible for property tests.
TEST_GPU = Hardware(
    name="test-gpu-80gb", memory_bytes=80 * GiB,
    peak_flops=(("fp32", 19.5e12), ("tf32", 156e12), ("bf16", 312e12), ("fp16", 312e12),
                ("fp8", 312e12)),
    mem_bw=2.0e12, intra_node_bw=300e9, inter_node_bw=25e9, host_bw=32e9, per_node=8)


def gpt_like(layers=4, hidden=256, heads=8, vocab=1024, seq=512, dropout=0.1, **kw) -> ModelSpec:
    """A GPT-2-shaped decoder (GELU MLP 4h, LayerNorm, learned positions, dropout)."""
    base = dict(name="test-gpt", family="decoder", hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, intermediate_size=4 * hidden, vocab_size=vocab,
                max_position_embeddings=seq, tie_word_embeddings=True, attention_bias=True,
                attention_out_bias=True, mlp_bias=True, hidden_dropout=dropout,
                attention_dropout=dropout)
    base.update(kw)
    return ModelSpec(**base)


def llama_like(layers=4, hidden=256, heads=8, kv=2, vocab=1024, **kw) -> ModelSpec:
    base = dict(name="test-llama", family="decoder", hidden_size=hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                intermediate_size=688, vocab_size=vocab, position_embedding="rotary",
                norm_type="rmsnorm", mlp_type="gated", hidden_act="silu")
    base.update(kw)
    return ModelSpec(**base)


def make_scenario(model=None, *, runtime="xla-gpu", count=8, seq_len=512, global_batch=64,
                  precision="bf16-mixed", optimizer="adamw", grad_clip=True, lora=None,
                  hardware=TEST_GPU, vram_gib=80.0, headroom=0.1, knobs=None, **wl) -> Scenario:
    return Scenario(
        name="test", model=model or gpt_like(seq=seq_len), hardware=hardware, count=count,
        per_node=min(8, count),
        workload=Workload(seq_len=seq_len, global_batch=global_batch, precision=precision,
                          optimizer=optimizer, grad_clip=grad_clip, lora=lora, **wl),
        budget=Budget(vram_bytes=int(vram_gib * GiB), headroom=headroom),
        runtime=get_profile(runtime),
        knobs=tuple(KnobDomain(k, v) for k, v in (knobs or {}).items()))


@pytest.fixture
def scenario_factory():
    return make_scenario
