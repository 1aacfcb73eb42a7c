"""The device tier end to end on one GPU: real Flax training steps, measured against the cost
model (and against the deviceless xla-gpu compile of the same step, when the CUDA plugin is
there). Sized to finish in under 5 minutes on one H200.

    python benchmarks/gpu_validation.py [--gpu h200-sxm-141gb] [--budget-s 270]
                                        [--out benchmarks/results/gpu_validation.json]
    python benchmarks/gpu_validation.py --smoke      # tiny models; runs on a CPU too

Each candidate runs in its own process (`capopt.validate(tier="device")`) with a timeout: an
OOM or crash is recorded and the suite goes on. Results stream to a JSONL file next to the
JSON (a rerun resumes), and the JSON gathers: per candidate the predicted and measured
argument / output / alias / temp / peak bytes, the allocator's peak (``peak_bytes``) next to
XLA's static peak (``static_peak_bytes``), the median step time, and NVML samples when
``nvidia-ml-py`` is installed. No new candidate starts once ``--budget-s`` has passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capopt._hardware import get_hardware  # noqa: E402
from capopt._model import ModelSpec  # noqa: E402
from capopt._cards import load_card  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import Budget, Config, Scenario, Workload  # noqa: E402

# A ~0.4B Llama-shaped decoder (GQA 16/4, SwiGLU, RMSNorm, RoPE): big enough that activations
# and optimizer state are GiB-sized on an H200, small enough to compile in seconds.
LLAMA_400M = ModelSpec(
    name="llama-400m", family="decoder", hidden_size=1024, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816, vocab_size=32000,
    max_position_embeddings=4096, position_embedding="rotary", norm_type="rmsnorm",
    mlp_type="gated", hidden_act="silu")

C = Config
SUITE = [
    # (label, model, seq_len, precision, optimizer, config)
    ("gpt2-124m bf16 mb8", "gpt2-124m", 1024, "bf16-mixed", "adamw", C(micro_batch=8)),
    ("gpt2-124m bf16 mb8 remat full", "gpt2-124m", 1024, "bf16-mixed", "adamw",
     C(micro_batch=8, remat="full")),
    ("gpt2-124m fp32 mb4 no flash", "gpt2-124m", 1024, "fp32", "adamw",
     C(micro_batch=4, flash_attention=False)),
    ("llama-400m bf16 mb4 s2048", LLAMA_400M, 2048, "bf16-mixed", "adamw", C(micro_batch=4)),
    ("llama-400m bf16 mb4 s2048 selective", LLAMA_400M, 2048, "bf16-mixed", "adamw",
     C(micro_batch=4, remat="selective")),
    ("llama-400m bf16 mb2x2 lion full", LLAMA_400M, 2048, "bf16-mixed", "lion",
     C(micro_batch=2, grad_accum=2, remat="full")),
]
SMOKE = [
    ("tiny-gpt mb4", "tiny-gpt", 64, "bf16-mixed", "adamw", C(micro_batch=4)),
    ("tiny-llama mb2x2 full", "tiny-llama", 64, "bf16-mixed", "lion",
     C(micro_batch=2, grad_accum=2, remat="full")),
]


def scenario(model, seq, precision, optimizer, cfg, gpu) -> Scenario:
    spec = load_card(model) if isinstance(model, str) else model
    hw = get_hardware(gpu)
    return Scenario(
        name=spec.name, model=spec, hardware=hw, count=cfg.dp * cfg.tp, per_node=8,
        workload=Workload(seq_len=seq, global_batch=cfg.micro_batch * cfg.grad_accum * cfg.dp,
                          precision=precision, optimizer=optimizer),
        budget=Budget(vram_bytes=hw.memory_bytes), runtime=get_profile("xla-gpu"))


def environment() -> dict:
    env = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import jax
        env.update(jax=jax.__version__, devices=[str(d) for d in jax.devices()])
    except Exception as e:  # noqa: BLE001 - recorded, the suite still runs in subprocesses
        env["jax_error"] = str(e)
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - no nvidia-smi on this machine
        pass
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h200-sxm-141gb", help="catalog name of the GPU")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"
                                         / "gpu_validation.json"))
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="start no new candidate after this many seconds")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="per candidate")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-xla-gpu", action="store_true",
                    help="skip the deviceless compile of the same steps")
    ap.add_argument("--smoke", action="store_true", help="tiny models (runs on a CPU too)")
    args = ap.parse_args(argv)

    from capopt.validation import validate, xla_gpu_available
    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl = out.with_suffix(".jsonl")
    suite = SMOKE if args.smoke else SUITE
    tiers = ["device"]
    ok, why = xla_gpu_available()
    if not args.no_xla_gpu and ok:
        tiers.append("xla-gpu")
    records, skipped = [], []
    for tier in tiers:
        for label, model, seq, prec, opt, cfg in suite:
            if time.perf_counter() - t0 > args.budget_s:
                skipped.append(f"{tier}: {label}")
                continue
            sc = scenario(model, seq, prec, opt, cfg, args.gpu)
            rep = validate(sc, tier=tier, configs=[cfg], out=jsonl, timeout_s=args.timeout_s,
                           progress=True, options={"steps": args.steps} if tier == "device"
                           else None)
            (r,) = rep.results
            r["label"] = label
            records.append(r)
            m = r["measured"]
            line = f"{tier:8s} {label:40s} {r['status']:5s}"
            if r["status"] == "ok":
                p = r["predicted"]
                peak = m.get("peak_bytes") or m.get("static_peak_bytes")
                line += (f" peak {peak / 2**30:7.2f} GiB (pred {p['peak_bytes'] / 2**30:7.2f})"
                         f" temp {m['temp_bytes'] / 2**30:6.2f} GiB "
                         f"(pred {p['temp_bytes'] / 2**30:6.2f})")
                if m.get("step_s"):
                    line += f" step {1e3 * m['step_s']:.1f} ms (pred {1e3 * p['step_s']:.1f})"
            else:
                line += f" {r.get('error', '')[:120]}"
            print(line, flush=True)
    result = {"gpu": args.gpu, "environment": environment(), "tiers": tiers,
              "xla_gpu_unavailable": None if "xla-gpu" in tiers else (why or "--no-xla-gpu"),
              "records": records, "skipped_for_budget": skipped,
              "total_s": time.perf_counter() - t0}
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out} ({len(records)} results, {time.perf_counter() - t0:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
