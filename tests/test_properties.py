"""Properties of the memory model over ten thousand random configs, evaluated in batches.

Each property pairs a config with one changed knob whose effect on memory is certain:
recomputing more never needs more memory, nor does a larger recomputed share, a higher ZeRO
stage or offloading the optimizer state; a larger micro-batch never needs less; every term
is finite and non-negative.
"""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from capopt._specs import Config
from capopt._validity import config_problems
from capopt.cost import Knobs, numbers_pytree
from capopt.cost.model import estimate_numbers
from conftest import gpt_like, llama_like, make_scenario

_batched = jax.jit(jax.vmap(estimate_numbers, in_axes=(0, None)))
TERMS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "logits_bytes",
         "comm_bytes", "overhead_bytes", "total_bytes")
# float32 sums of terms up to ~1e12 bytes: equal configs may differ in the last bits
RTOL = 1e-5


def _scenario(rng: random.Random):
    layers = rng.choice([2, 4, 8, 16])
    model = rng.choice([gpt_like(layers=layers, hidden=rng.choice([256, 512]),
                                 dropout=rng.choice([0.0, 0.1])),
                        llama_like(layers=layers, hidden=rng.choice([256, 512]), kv=2,
                                   vocab=rng.choice([1000, 32000])),
                        llama_like(layers=layers, num_local_experts=4, num_experts_per_tok=2)])
    return make_scenario(model, runtime=rng.choice(["xla-gpu", "pytorch"]), count=64,
                         seq_len=rng.choice([128, 512, 2048]), global_batch=65536,
                         optimizer=rng.choice(["adamw", "sgd", "lion", "adafactor",
                                               "adamw-8bit"]),
                         precision=rng.choice(["fp32", "bf16-mixed", "bf16", "fp8-mixed"]),
                         grad_clip=rng.random() < 0.5)


def _config(rng: random.Random, sc) -> Config:
    L = sc.model.num_hidden_layers
    while True:
        tp = rng.choice([1, 2, 4])
        pp = rng.choice([p for p in (1, 2, 4, 8, 16) if L % p == 0 and p * tp <= 64])
        dp = 64 // (tp * pp)
        mb = rng.choice([1, 2, 4, 8, 16, 128])
        ga = 65536 // (mb * dp)
        cfg = Config(micro_batch=mb, grad_accum=ga, dp=dp, tp=tp, pp=pp,
                     zero_stage=rng.choice([0, 1] if pp > 1 else [0, 1, 2, 3]),
                     sequence_parallel=tp > 1 and rng.random() < 0.5,
                     remat=rng.choice(["none", "selective", "full", 0.25, 0.5]),
                     offload_optimizer=rng.random() < 0.3,
                     flash_attention=rng.random() < 0.5)
        if not config_problems(cfg, sc):
            return cfg


BATCH = 256


def _stack(configs) -> Knobs:
    """`capopt.cost.stack_knobs` built in numpy (the same values, without a device array
    per config)."""
    f = lambda name: np.asarray([float(getattr(c, name)) for c in configs], np.float32)  # noqa: E731
    zero = np.zeros((len(configs), 4), np.float32)
    zero[np.arange(len(configs)), [c.zero_stage for c in configs]] = 1.0
    return Knobs(micro_batch=f("micro_batch"), grad_accum=f("grad_accum"), dp=f("dp"),
                 tp=f("tp"), pp=f("pp"), ep=f("ep"), zero=zero,
                 remat=np.asarray([c.remat_weights() for c in configs], np.float32),
                 sp=f("sequence_parallel"), offload=f("offload_optimizer"),
                 flash=f("flash_attention"), cp=f("cp"), vpp=f("vpp"),
                 dpr=f("dp_replicate"), offload_params=f("offload_params"))


def _totals(sc, configs) -> dict:
    """Every term of each config, evaluated in batches of one size (one compilation)."""
    padded = list(configs) + [configs[0]] * (-len(configs) % BATCH)
    out = {k: [] for k in TERMS}
    n = numbers_pytree(sc)
    for i in range(0, len(padded), BATCH):
        m = _batched(_stack(padded[i:i + BATCH]), n).memory
        for k in TERMS:
            out[k].append(np.asarray(m[k], np.float64))
    return {k: np.concatenate(v)[:len(configs)] for k, v in out.items()}


CHANGES = {
    "remat full <= selective": (lambda c: c.replace(remat="full"),
                                lambda c: c.replace(remat="selective")),
    "remat selective <= none": (lambda c: c.replace(remat="selective"),
                                lambda c: c.replace(remat="none")),
    "larger recomputed share": (lambda c: c.replace(remat=0.75), lambda c: c.replace(remat=0.25)),
    "offload <= no offload": (lambda c: c.replace(offload_optimizer=True),
                              lambda c: c.replace(offload_optimizer=False)),
    "higher ZeRO stage": (lambda c: c.replace(zero_stage=min(c.zero_stage + 1, 1 if c.pp > 1
                                                              else 3)), lambda c: c),
    "micro-batch 1 <= micro-batch 2": (lambda c: c.replace(micro_batch=1, grad_accum=c.grad_accum
                                                            * c.micro_batch),
                                       lambda c: c.replace(micro_batch=2, grad_accum=c.grad_accum
                                                           * c.micro_batch // 2)),
}


@pytest.mark.slow
def test_memory_properties_over_ten_thousand_random_configs():
    rng = random.Random(0)
    violations: dict[str, list] = {k: [] for k in CHANGES}
    checked = 0
    for _ in range(40):
        sc = _scenario(rng)
        base = [_config(rng, sc) for _ in range(BATCH)]
        m = _totals(sc, base)
        for k in TERMS:
            assert np.all(np.isfinite(m[k])) and np.all(m[k] >= 0), (k, sc.model.name)
        for name, (smaller, larger) in CHANGES.items():
            pairs = [(smaller(c), larger(c)) for c in base]
            pairs = [(a, b) for a, b in pairs if not config_problems(a, sc)
                     and not config_problems(b, sc)]
            if not pairs:
                continue
            ta = _totals(sc, [p[0] for p in pairs])
            a, b = ta["total_bytes"], _totals(sc, [p[1] for p in pairs])["total_bytes"]
            # (ZeRO-3 gathers whole blocks, an all-gather's output being world size x shard,
            # beside the device's shards: where its window spans a stage's every block it
            # holds what ZeRO-2 holds plus those shards, never more)
            allow = np.array([float(p[0].zero_stage == 3 and name == "higher ZeRO stage")
                              for p in pairs]) * ta["params_bytes"]
            bad = np.nonzero(a > (b + allow) * (1 + RTOL))[0]
            violations[name] += [(sc.model.name, sc.runtime.name, pairs[i][1], a[i] / b[i])
                                 for i in bad[:3]]
            checked += len(pairs)
    assert checked >= 10_000
    found = {k: v[:3] for k, v in violations.items() if v}
    assert not found, found
