"""Shared test helpers: scenarios built in code, independent of the data catalogs."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# compiled programs go to a cache of this session's own: results never depend on what an
# earlier run left in ~/.cache/capopt
os.environ.setdefault("CAPOPT_CACHE_DIR", tempfile.mkdtemp(prefix="capopt-test-cache-"))

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from capopt._hardware import GiB, Hardware  # noqa: E402
from capopt._model import ModelSpec  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import Budget, Config, KnobDomain, Scenario, Workload  # noqa: E402
from capopt.cost import Knobs  # noqa: E402

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


def runtime_scenario_file(tmp_path, runtime: str, training: str = "",
                          config: str = "") -> str:
    """A scenario file of Llama-3.2-1B on 8 H100s (2048 tokens, 16 sequences a step) under
    ``runtime``, with more ``[training]`` and ``[config]`` lines."""
    p = tmp_path / f"{runtime}.toml"
    p.write_text('name = "s"\n[model]\ncard = "llama-3.2-1b"\n[hardware]\ngpu = "h100-sxm-80gb"\n'
                 f'count = 8\n[training]\nseq_len = 2048\nglobal_batch = 16\n'
                 f'runtime = "{runtime}"\n{training}\n[config]\n{config}\n')
    return str(p)


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


# Layouts with pipeline end stages that differ (embeddings / head), and one relaxed point:
# used to check that an end-stage computation done in one call equals one call per stage.
END_STAGE_CONFIGS = [
    Config(micro_batch=1, grad_accum=8, dp=8, tp=4, pp=2, remat="full"),
    Config(micro_batch=2, grad_accum=1, dp=32, tp=2, zero_stage=3),
    Config(micro_batch=1, grad_accum=4, dp=16, tp=2, pp=2, sequence_parallel=True,
           remat="selective", flash_attention=False),
    Config(micro_batch=4, grad_accum=2, dp=8, tp=8, offload_optimizer=True),
    Config(micro_batch=1, grad_accum=2, dp=8, tp=2, pp=4, zero_stage=1),
    Config(micro_batch=2, grad_accum=4, dp=4, tp=4, pp=4, zero_stage=2, remat="full"),
]
RELAXED_KNOBS = Knobs(
    micro_batch=jnp.float32(1.7), grad_accum=jnp.float32(3.3), dp=jnp.float32(5.5),
    tp=jnp.float32(2.5), pp=jnp.float32(1.6), ep=jnp.float32(1.5),
    zero=jnp.asarray([0.4, 0.1, 0.2, 0.3], jnp.float32),
    remat=jnp.asarray([0.5, 0.3, 0.2], jnp.float32), sp=jnp.float32(0.4),
    offload=jnp.float32(0.3), flash=jnp.float32(0.6), cp=jnp.float32(1.0),
    vpp=jnp.float32(1.0))
