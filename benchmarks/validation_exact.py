"""The exact tier on a grid of configs: cost model vs XLA, term by term.

    python benchmarks/validation_exact.py [--out benchmarks/results/validation_exact.json]
                                          [--jobs 2] [--quick]

1. Compiled grid: tiny cards and tiny members of every family, on 1 to 8 virtual CPU devices
   (data, ZeRO 1/2/3, tensor and sequence parallel, expert parallel), every optimizer and
   precision, LoRA / QLoRA, remat and gradient accumulation. Each candidate is lowered and
   compiled in its own process (`capopt.validate`); XLA's memory analysis gives argument,
   output and alias bytes per device exactly. Parameters and optimizer state are compared
   with the cost model. Temp is printed but CPU temp is not a proxy for GPU activations.
2. State at scale: real cards (GPT-2, Llama, Mixtral, ViT, BERT) with the step built
   abstractly on 8 virtual devices (nothing compiled or allocated): parameter and optimizer
   bytes per device from the shard shapes, against the cost model, for sharded configs and
   every optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # noqa: BLE001 - older JAX: the flag above does it
    pass

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capopt._cards import load_card  # noqa: E402
from capopt._format import table  # noqa: E402
from capopt._hardware import get_hardware  # noqa: E402
from capopt._model import ModelSpec  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import Budget, Config, LoRA, Scenario, Workload  # noqa: E402
from capopt.validation import validate  # noqa: E402
from capopt.validation.predict import predicted_terms  # noqa: E402
from capopt.validation.step import build_step  # noqa: E402

HF = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"

TINY = {
    "tiny-bert": ModelSpec(
        name="tiny-bert", family="encoder", hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, vocab_size=128,
        max_position_embeddings=64, type_vocab_size=2, embedding_norm=True, pooler=True,
        mlm_head=True, num_labels=2, attention_bias=True, attention_out_bias=True,
        mlp_bias=True, tie_word_embeddings=True, hidden_dropout=0.1, attention_dropout=0.1),
    "tiny-vit": ModelSpec(
        name="tiny-vit", family="vit", hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8,
        num_labels=10, attention_bias=True, attention_out_bias=True, mlp_bias=True),
    "tiny-mlp": ModelSpec(name="tiny-mlp", family="mlp", hidden_size=64, num_hidden_layers=3),
    "tiny-moe": ModelSpec(
        name="tiny-moe", family="decoder", hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=128,
        position_embedding="rotary", norm_type="rmsnorm", mlp_type="gated", hidden_act="silu",
        num_local_experts=4, num_experts_per_tok=2),
}


def scenario(card, count=1, *, seq=64, batch=8, precision="bf16-mixed", optimizer="adamw",
             lora=None, grad_clip=True, runtime="xla-cpu", gpu="h100-sxm-80gb") -> Scenario:
    spec = TINY[card] if card in TINY else load_card(card)
    if spec.family == "vit":
        seq = spec.native_seq_len
    return Scenario(
        name=f"{card}", model=spec, hardware=get_hardware(gpu), count=count,
        per_node=min(8, count),
        workload=Workload(seq_len=seq, global_batch=batch, precision=precision,
                          optimizer=optimizer, grad_clip=grad_clip, lora=lora),
        budget=Budget(vram_bytes=80 * 2**30), runtime=get_profile(runtime))


C = Config
GRID = [
    # (label, scenario kwargs, config)
    ("tiny-gpt dp1", dict(card="tiny-gpt"), C(micro_batch=8)),
    ("tiny-gpt dp8", dict(card="tiny-gpt", count=8), C(micro_batch=1, dp=8)),
    ("tiny-gpt dp8 zero1", dict(card="tiny-gpt", count=8), C(micro_batch=1, dp=8, zero_stage=1)),
    ("tiny-gpt dp8 zero2", dict(card="tiny-gpt", count=8), C(micro_batch=1, dp=8, zero_stage=2)),
    ("tiny-gpt dp8 zero3", dict(card="tiny-gpt", count=8), C(micro_batch=1, dp=8, zero_stage=3)),
    ("tiny-gpt dp4 tp2", dict(card="tiny-gpt", count=8), C(micro_batch=2, dp=4, tp=2)),
    ("tiny-gpt ga2 remat full", dict(card="tiny-gpt"),
     C(micro_batch=4, grad_accum=2, remat="full")),
    ("tiny-gpt fp32 no-clip", dict(card="tiny-gpt", precision="fp32", grad_clip=False),
     C(micro_batch=8, flash_attention=False)),
    ("tiny-llama dp1", dict(card="tiny-llama"), C(micro_batch=8)),
    ("tiny-llama dp8 zero3", dict(card="tiny-llama", count=8),
     C(micro_batch=1, dp=8, zero_stage=3)),
    ("tiny-llama dp4 tp2 zero1 sp", dict(card="tiny-llama", count=8),
     C(micro_batch=2, dp=4, tp=2, zero_stage=1, sequence_parallel=True)),
    ("tiny-llama dp2 tp4 (kv 2)", dict(card="tiny-llama", count=8), C(micro_batch=4, dp=2, tp=4)),
    ("tiny-llama bf16 lion", dict(card="tiny-llama", precision="bf16", optimizer="lion"),
     C(micro_batch=8)),
    ("tiny-llama adam", dict(card="tiny-llama", optimizer="adam"), C(micro_batch=8)),
    ("tiny-llama sgd", dict(card="tiny-llama", optimizer="sgd"), C(micro_batch=8)),
    ("tiny-llama sgd-momentum", dict(card="tiny-llama", optimizer="sgd-momentum"),
     C(micro_batch=8)),
    ("tiny-llama adafactor", dict(card="tiny-llama", optimizer="adafactor"), C(micro_batch=8)),
    ("tiny-llama adamw-8bit", dict(card="tiny-llama", optimizer="adamw-8bit"), C(micro_batch=8)),
    ("tiny-llama lora r8", dict(card="tiny-llama", lora=LoRA(rank=8)), C(micro_batch=8)),
    ("tiny-llama lora 8-bit base", dict(card="tiny-llama", lora=LoRA(rank=8, base_bits=8)),
     C(micro_batch=8)),
    ("tiny-llama qlora 4-bit", dict(card="tiny-llama", lora=LoRA(rank=8, base_bits=4)),
     C(micro_batch=8)),
    ("tiny-llama lora dp4 tp2", dict(card="tiny-llama", count=8, lora=LoRA(rank=8)),
     C(micro_batch=2, dp=4, tp=2)),
    ("tiny-bert dp2 zero3", dict(card="tiny-bert", count=2), C(micro_batch=4, dp=2, zero_stage=3)),
    ("tiny-vit dp2 tp2", dict(card="tiny-vit", count=4), C(micro_batch=4, dp=2, tp=2)),
    ("tiny-mlp dp2 tp4 zero3", dict(card="tiny-mlp", count=8),
     C(micro_batch=4, dp=2, tp=4, zero_stage=3)),
    ("tiny-moe dp1", dict(card="tiny-moe"), C(micro_batch=8)),
    ("tiny-moe dp4 ep2", dict(card="tiny-moe", count=4), C(micro_batch=2, dp=4, ep=2)),
    ("tiny-moe dp4 ep2 zero1", dict(card="tiny-moe", count=4),
     C(micro_batch=2, dp=4, ep=2, zero_stage=1)),
    ("tiny-moe dp4 ep2 zero3", dict(card="tiny-moe", count=4),
     C(micro_batch=2, dp=4, ep=2, zero_stage=3)),
]
QUICK = {0, 4, 5, 10, 18, 26}

AT_SCALE = [
    ("gpt2-124m dp8 zero3", dict(card="gpt2-124m", count=8, seq=1024),
     C(micro_batch=1, dp=8, zero_stage=3)),
    ("gpt2-124m dp2 tp4", dict(card="gpt2-124m", count=8, seq=1024), C(micro_batch=4, dp=2, tp=4)),
    ("llama-2-7b tp8", dict(card="llama-2-7b", count=8, seq=2048), C(micro_batch=8, tp=8)),
    ("llama-3-8b dp8 zero3", dict(card="llama-3-8b", count=8, seq=2048),
     C(micro_batch=1, dp=8, zero_stage=3)),
    ("llama-3-8b dp2 tp4 zero1", dict(card="llama-3-8b", count=8, seq=2048),
     C(micro_batch=4, dp=2, tp=4, zero_stage=1)),
    ("llama-3-8b lora r16 tp8", dict(card="llama-3-8b", count=8, seq=2048, lora=LoRA(16)),
     C(micro_batch=8, tp=8)),
    ("mixtral-8x7b dp8 ep8 zero1", dict(card="mixtral-8x7b", count=8, seq=2048),
     C(micro_batch=1, dp=8, ep=8, zero_stage=1)),
    ("mixtral-8x7b dp8 ep8 zero3", dict(card="mixtral-8x7b", count=8, seq=2048),
     C(micro_batch=1, dp=8, ep=8, zero_stage=3)),
    ("vit-l16 dp8 zero3", dict(card="vit-l16", count=8), C(micro_batch=1, dp=8, zero_stage=3)),
    ("bert-base dp2 tp4", dict(card="bert-base", count=8, seq=512), C(micro_batch=4, dp=2, tp=4)),
    ("gemma-2-2b (4 norms) tp2", dict(card=str(HF / "gemma-2-2b-it.json"), count=2, seq=1024),
     C(micro_batch=4, tp=2)),
] + [(f"llama-3-8b dp8 zero1 {o}", dict(card="llama-3-8b", count=8, seq=2048, optimizer=o),
      C(micro_batch=1, dp=8, zero_stage=1))
     for o in ("adafactor", "adamw-8bit", "lion", "sgd-momentum")] + [
    ("gpt2-124m adafactor", dict(card="gpt2-124m", count=1, seq=1024, optimizer="adafactor"),
     C(micro_batch=8)),
]


def pct(p, m):
    if p is None or m is None or m == 0:
        return "-"
    return f"{100 * (p - m) / m:+.3f}%"


def mib(x):
    return "-" if x is None else f"{x / 2**20:,.3f}"


def run_grid(indices, jobs):
    rows, records = [], []
    for i in indices:
        label, kw, cfg = GRID[i]
        sc = scenario(**kw)
        t0 = time.perf_counter()
        rep = validate(sc, configs=[cfg], progress=False, jobs=1, timeout_s=900)
        (r,) = rep.results
        r["label"] = label
        r["wall_s"] = time.perf_counter() - t0
        records.append(r)
        p, m = r["predicted"], r["measured"]
        if r["status"] != "ok":
            rows.append((label, r["status"], "-", "-", "-", "-", "-", "-", "-", "-"))
            print(f"  {label}: {r['status']}: {r.get('error')}", file=sys.stderr)
            continue
        rows.append((label, "ok", mib(p["params_bytes"]), pct(p["params_bytes"], m["params_bytes"]),
                     mib(p["optimizer_bytes"]),
                     pct(p["optimizer_bytes"], m["optimizer_bytes"]),
                     pct(p["argument_bytes"], m["argument_bytes"]),
                     pct(p["output_bytes"], m["output_bytes"]),
                     pct(p["alias_bytes"], m["alias_bytes"]),
                     f"{mib(m['temp_bytes'])} ({pct(p['temp_bytes'], m['temp_bytes'])})"))
        print(f"  {label}: done in {r['wall_s']:.1f} s", file=sys.stderr)
    return rows, records


def run_at_scale():
    rows, records = [], []
    devices = jax.devices("cpu")
    for label, kw, cfg in AT_SCALE:
        sc = scenario(**kw)
        t0 = time.perf_counter()
        step = build_step(sc, cfg, devices)         # abstract: nothing compiled or allocated
        p = predicted_terms(cfg, sc)
        m = {"params_bytes": step.params_bytes, "optimizer_bytes": step.optimizer_bytes}
        records.append({"label": label, "config": cfg.to_dict(), "optimizer":
                        sc.workload.optimizer, "predicted": {k: p[k] for k in m},
                        "measured": m, "build_s": time.perf_counter() - t0,
                        "unsharded": step.unsharded[:20]})
        rows.append((label, sc.workload.optimizer, mib(p["params_bytes"]), mib(m["params_bytes"]),
                     pct(p["params_bytes"], m["params_bytes"]), mib(p["optimizer_bytes"]),
                     mib(m["optimizer_bytes"]), pct(p["optimizer_bytes"], m["optimizer_bytes"])))
        print(f"  {label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rows, records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"
                                         / "validation_exact.json"))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help=f"only grid rows {sorted(QUICK)}")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    idx = sorted(QUICK) if args.quick else list(range(len(GRID)))
    print("1. compiled grid (exact tier, one process per config)", file=sys.stderr)
    grid_rows, grid = run_grid(idx, args.jobs)
    print(table(grid_rows, ["config", "status", "params MiB", "err", "opt MiB", "err",
                            "argument err", "output err", "alias err", "temp MiB (err)"],
                "llrrrrrrrr"))
    print("\n2. state at scale (abstract step on 8 virtual devices)", file=sys.stderr)
    scale_rows, scale = run_at_scale()
    print()
    print(table(scale_rows, ["config", "optimizer", "params pred MiB", "measured", "err",
                             "opt pred MiB", "measured", "err"], "llrrrrrr"))
    out = {"jax": jax.__version__, "devices": "8 virtual CPU devices",
           "grid": grid, "at_scale": scale, "total_s": time.perf_counter() - t0,
           "notes": "err = (predicted - measured) / measured. Temp on CPU is not a proxy for "
                    "GPU activations (the CPU backend ignores remat for memory and upcasts "
                    "bf16); it is recorded, not judged."}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"\nwrote {args.out} in {out['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
