"""Optimality and speed of the optimiser against the exhaustive reference.

    python benchmarks/optimizer.py [--scenarios 300] [--out benchmarks/results/optimizer.json]

1. Optimality: seeded random scenarios (real cards, catalog GPUs, 1-64 devices, random
   precision / optimizer / runtime / budget) whose exhaustive search finds a fitting config:
   does the optimiser's best equal the exhaustive optimum, and how far is it in throughput?
2. Speed: warm solve time per scenario (after the first call compiled everything) and cold
   time (a fresh process, compilation included) on a few scenarios.
3. A space of over 10^6 configs (remat as any number of recomputed layers): exhaustive time
   over optimiser time, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import capopt  # noqa: E402
from capopt._specs import KnobDomain  # noqa: E402
from capopt.search import build_lattice, optimize  # noqa: E402

CARDS = ["gpt2-124m", "gpt2-1.5b", "llama-2-7b", "llama-2-13b", "mistral-7b", "llama-3-8b",
         "mixtral-8x7b", "vit-b16", "vit-l16", "bert-base", "tiny-gpt", "tiny-llama"]
GPUS = ["a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "l4-pcie-24gb", "rtx-4090-24gb",
        "h200-sxm-141gb", "mi300x-oam-192gb"]


def random_scenario(rng: random.Random) -> dict:
    card = rng.choice(CARDS)
    count = rng.choice([1, 2, 4, 8, 8, 16, 32, 64])
    d = {
        "name": f"random-{rng.randrange(10**9)}",
        "model": {"card": card},
        "hardware": {"gpu": rng.choice(GPUS), "count": count},
        "training": {"global_batch": count * rng.choice([1, 2, 4, 8, 16]),
                     "precision": rng.choice(["bf16-mixed", "bf16-mixed", "fp32", "bf16",
                                              "fp16-mixed"]),
                     "optimizer": rng.choice(["adamw", "adamw", "sgd-momentum", "adafactor",
                                              "lion", "adamw-8bit"]),
                     "grad_clip": rng.random() < 0.7,
                     "runtime": rng.choice(["xla-gpu", "pytorch"])},
        "budget": {"headroom": rng.choice([0.0, 0.05, 0.1])},
        "config": {"micro_batch": "auto", "grad_accum": "auto", "dp": "auto", "tp": "auto",
                   "pp": "auto", "zero_stage": "auto", "sequence_parallel": "auto",
                   "remat": "auto", "offload_optimizer": rng.choice([False, "auto"]),
                   "flash_attention": rng.choice([True, "auto"])},
    }
    if not card.startswith("vit"):
        d["training"]["seq_len"] = rng.choice([512, 1024, 2048, 4096, 8192])
    return d


def optimality(n_scenarios: int, seed: int) -> dict:
    rng = random.Random(seed)
    rows, skipped = [], 0
    t_start = time.perf_counter()
    while len(rows) < n_scenarios:
        sc = capopt.load_scenario(random_scenario(rng))
        ex = optimize(sc, top_k=1, method="exhaustive", remedies=False)
        if ex.status != "ok":
            skipped += 1
            continue
        gr = optimize(sc, top_k=1, remedies=False)            # warm after the first
        t0 = time.perf_counter()
        gr = optimize(sc, top_k=1, remedies=False)
        warm = time.perf_counter() - t0
        te = ex.best.throughput["tokens_per_s"]
        tg = gr.best.throughput["tokens_per_s"] if gr.best else 0.0
        rows.append({
            "scenario": sc.name, "model": sc.model.name, "gpu": sc.hardware.name,
            "count": sc.count, "space": ex.space_size, "evaluated": gr.evaluated,
            "exhaustive_tokens_per_s": te, "optimizer_tokens_per_s": tg,
            "same_optimum": gr.best is not None and abs(tg - te) <= 1e-6 * te,
            "gap": 1.0 - tg / te, "fits": bool(gr.best and gr.best.fits),
            "warm_s": warm, "exhaustive_s": ex.solve_s})
        if len(rows) % 25 == 0:
            print(f"  {len(rows)}/{n_scenarios} scenarios "
                  f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    same = sum(r["same_optimum"] for r in rows)
    worst = max(r["gap"] for r in rows)
    return {"scenarios": len(rows), "skipped_infeasible": skipped, "same_optimum": same,
            "same_optimum_share": same / len(rows), "worst_gap": worst,
            "all_fit": all(r["fits"] for r in rows),
            "warm_s_median": statistics.median(r["warm_s"] for r in rows),
            "warm_s_max": max(r["warm_s"] for r in rows), "rows": rows}


COLD_SNIPPET = """
import os, sys, time, json
os.environ.setdefault("JAX_PLATFORMS", "cpu")
t0 = time.perf_counter()
import capopt
from capopt.search import optimize
t1 = time.perf_counter()
r = optimize(capopt.load_scenario(sys.argv[1]), top_k=5, remedies=False)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "solve_s": t2 - t1, "status": r.status}))
"""


def cold(scenarios: list[str]) -> list[dict]:
    """Fresh processes: with no compilation cache at all, then with capopt's disk cache warm."""
    import tempfile
    out = []
    with tempfile.TemporaryDirectory() as cache:
        for name in scenarios:
            row = {"scenario": name}
            for label, cache_dir in (("no_cache", ""), ("disk_cache", cache),
                                     ("disk_cache_again", cache)):
                env = dict(os.environ, CAPOPT_CACHE_DIR=cache_dir)
                p = subprocess.run([sys.executable, "-c", COLD_SNIPPET, name],
                                   capture_output=True, text=True, env=env, check=True)
                row[label] = json.loads(p.stdout.strip().splitlines()[-1])
            out.append(row)
    return out


def big_space() -> dict:
    sc = capopt.load_scenario("llama3-70b-64xh100")
    L = sc.model.num_hidden_layers
    remat = tuple(["selective"] + [i / L for i in range(L + 1)])
    free = ("remat", "offload_optimizer", "flash_attention")
    knobs = tuple(k for k in sc.knobs if k.name not in free) + (
        KnobDomain("remat", remat), KnobDomain("offload_optimizer", (False, True)),
        KnobDomain("flash_attention", (False, True)))
    sc = sc.replace(knobs=knobs, count=1024,
                    workload=sc.workload.__class__(**{**sc.workload.__dict__,
                                                      "global_batch": 16384}))
    t0 = time.perf_counter()
    size = len(build_lattice(sc))
    lattice_s = time.perf_counter() - t0
    optimize(sc, top_k=1, remedies=False)   # compile
    t0 = time.perf_counter()
    g = optimize(sc, top_k=1, remedies=False)
    g_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    e = optimize(sc, top_k=1, method="exhaustive", remedies=False)
    e_s = time.perf_counter() - t0
    tg, te = g.best.throughput["tokens_per_s"], e.best.throughput["tokens_per_s"]
    return {"scenario": "llama-3-70b on 1024x H100, remat by layer count, offload, flash", "space": size,
            "lattice_build_s": lattice_s, "optimizer_s": g_s, "exhaustive_s": e_s,
            "ratio": e_s / g_s, "optimizer_evaluated": g.evaluated,
            "optimizer_tokens_per_s": tg, "exhaustive_tokens_per_s": te, "gap": 1 - tg / te}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/optimizer.json")
    args = ap.parse_args()

    print(f"optimality over {args.scenarios} random scenarios ...", file=sys.stderr)
    opt = optimality(args.scenarios, args.seed)
    print("cold solves in fresh processes ...", file=sys.stderr)
    cold_rows = cold(["llama3-8b-8xh100", "llama3-70b-64xh100", "gpt2-124m-rtx4090"])
    print("a space of over 10^6 configs ...", file=sys.stderr)
    big = big_space()

    print("\nOptimality (optimiser vs exhaustive, same cost model)")
    print(f"  scenarios                    {opt['scenarios']} "
          f"({opt['skipped_infeasible']} infeasible draws skipped)")
    print(f"  same optimum                 {opt['same_optimum']} "
          f"({100 * opt['same_optimum_share']:.1f}%)   target >= 99%")
    print(f"  worst throughput gap         {100 * opt['worst_gap']:.3f}%   target <= 1%")
    print(f"  every answer fits            {opt['all_fit']}")
    print(f"  warm solve median / max      {opt['warm_s_median']:.3f} s / "
          f"{opt['warm_s_max']:.3f} s   target <= 1 s")
    print("\nCold solve (fresh process, compilation included)   target <= 5 s")
    print(f"  {'scenario':<24} {'no cache':>9} {'cache cold':>11} {'cache warm':>11}")
    for r in cold_rows:
        print(f"  {r['scenario']:<24} {r['no_cache']['solve_s']:>8.2f}s "
              f"{r['disk_cache']['solve_s']:>10.2f}s {r['disk_cache_again']['solve_s']:>10.2f}s")
    print("\nLarge space")
    print(f"  {big['scenario']}: {big['space']:,} configs")
    print(f"  exhaustive {big['exhaustive_s']:.2f} s, optimiser {big['optimizer_s']:.3f} s "
          f"({big['optimizer_evaluated']:,} evaluated): ratio {big['ratio']:.0f}x, "
          f"gap {100 * big['gap']:.3f}%")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": f"{os.cpu_count()} CPU cores", "optimality": opt,
                               "cold": cold_rows, "large_space": big}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
