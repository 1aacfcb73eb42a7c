"""Optimality and speed of the optimiser against the exhaustive reference.

    python benchmarks/optimizer.py [--scenarios 300] [--out benchmarks/results/optimizer.json]
    python benchmarks/optimizer.py --context-parallel 60     # section 5 alone, into --out
    python benchmarks/optimizer.py --virtual-stages 100      # section 6 alone, into --out
    python benchmarks/optimizer.py --hybrid-shard 100        # section 7 alone, into --out
    python benchmarks/optimizer.py --workload-choices 100    # section 8 alone, into --out

1. Optimality: seeded random scenarios (real cards, catalog GPUs, 1-64 devices, random
   precision / optimizer / runtime / budget) whose exhaustive search finds a fitting config:
   does the optimiser's best equal the exhaustive optimum, and how far is it in throughput?
2. Speed: warm solve time per scenario (after the first call compiled everything) and cold
   time (a fresh process, compilation included) on a few scenarios.
   Cold is measured for the default path (the relaxed solve), ``--method auto`` (lattices of
   at most ``EXHAUSTIVE_BELOW`` configs evaluated whole) and an uneven-stage scenario, each
   with no compilation cache (three fresh processes: their median and each run), with an
   empty cache directory, and again with that cache warm.
3. A space of over 10^6 configs (remat as any number of recomputed layers): exhaustive time
   over optimiser time, measured in one run.
4. Beyond a grid: uneven pipeline stages (layer count and recompute count per stage, over
   10^9 integer layouts): the optimiser's layout and time, checked by hill-climbing from its
   answer and from random layouts (one layer moved / one recompute changed per move).

5. With context parallelism searched (``--context-parallel N``): section 1 over long-sequence
   scenarios (16k-128k tokens, torchtitan or megatron, ``cp = "auto"``).
6. With interleaved pipeline stages searched (``--virtual-stages N``): section 1 over
   scenarios of 8-64 devices and few micro-batches a step (torchtitan or megatron,
   ``vpp = "auto"``, pp searched or drawn from 2-8).
7. With hybrid sharding searched (``--hybrid-shard N``): section 1 over multi-node scenarios
   (16-512 devices, torchtitan or megatron, ``dp_replicate = "auto"``).
8. With [training] fields searched (``--workload-choices N``): section 1 over PyTorch
   scenarios (pytorch-eager or hf, 1-8 devices, LoRA in half) with ``loss`` and
   ``activation_offload`` "auto" (``compile`` and ``paged_optimizer`` too, each in half): the
   exhaustive reference scores every config of every workload variant.

The optimality section runs the default method, the relaxed solve: it measures the optimiser,
not the small-space shortcut of ``--method auto``.
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
import warnings
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


LONG_CARDS = ["llama-2-7b", "llama-3-8b", "mistral-7b", "tiny-llama", "llama-2-13b"]


def random_long_scenario(rng: random.Random) -> dict:
    """A long-sequence scenario whose runtime runs context parallelism, every knob searched
    (``cp`` too): for the optimality of the relaxed context-parallel degree."""
    count = rng.choice([4, 8, 8, 16, 32])
    return {
        "name": f"random-long-{rng.randrange(10**9)}",
        "model": {"card": rng.choice(LONG_CARDS)},
        "hardware": {"gpu": rng.choice(["a100-sxm-80gb", "h100-sxm-80gb", "h200-sxm-141gb"]),
                     "count": count},
        "training": {"seq_len": rng.choice([16384, 32768, 65536, 131072]),
                     "global_batch": max(count // rng.choice([1, 2, 4, 8]), 1),
                     "precision": "bf16-mixed", "optimizer": "adamw", "grad_clip": True,
                     "runtime": rng.choice(["torchtitan", "megatron"])},
        "config": {"micro_batch": "auto", "grad_accum": "auto", "dp": "auto", "tp": "auto",
                   "pp": "auto", "zero_stage": "auto", "sequence_parallel": "auto",
                   "remat": "auto", "cp": "auto"},
    }


PIPELINE_CARDS = ["llama-2-7b", "llama-2-13b", "llama-3-8b", "mistral-7b", "tiny-llama",
                  "gpt2-1.5b"]


def random_pipeline_scenario(rng: random.Random) -> dict:
    """A scenario whose runtime interleaves pipeline stages, a few micro-batches a step (where
    the 1F1B bubble is large), every knob searched (``vpp`` too; half of them with pp drawn
    above 1): for the optimality of the rounded and locally searched number of chunks."""
    count = rng.choice([8, 16, 32, 64])
    d = {
        "name": f"random-pipe-{rng.randrange(10**9)}",
        "model": {"card": rng.choice(PIPELINE_CARDS)},
        "hardware": {"gpu": rng.choice(["a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb"]),
                     "count": count},
        "training": {"seq_len": rng.choice([1024, 2048, 4096]),
                     "global_batch": count * rng.choice([1, 2, 4]) // rng.choice([1, 2]),
                     "precision": "bf16-mixed", "optimizer": "adamw", "grad_clip": True,
                     "runtime": rng.choice(["torchtitan", "megatron"])},
        "config": {"micro_batch": "auto", "grad_accum": "auto", "dp": "auto", "tp": "auto",
                   "pp": "auto", "zero_stage": "auto", "sequence_parallel": "auto",
                   "remat": "auto", "vpp": "auto"},
    }
    if rng.random() < 0.5:
        d["config"]["pp"] = [p for p in (2, 4, 8) if p <= count]
    return d


HSDP_CARDS = ["gpt2-124m", "gpt2-1.5b", "tiny-llama", "llama-3.2-1b", "llama-2-7b",
              "llama-3-8b"]


def random_multinode_scenario(rng: random.Random) -> dict:
    """A multi-node scenario whose runtime runs hybrid sharding, every knob searched
    (``dp_replicate`` too): for the optimality of the rounded number of replicas, which the
    relaxation holds at 1."""
    count = rng.choice([16, 32, 64, 128, 256, 512])
    return {
        "name": f"random-hsdp-{rng.randrange(10**9)}",
        "model": {"card": rng.choice(HSDP_CARDS)},
        "hardware": {"gpu": rng.choice(["a100-sxm-80gb", "h100-sxm-80gb", "h200-sxm-141gb"]),
                     "count": count},
        "training": {"seq_len": rng.choice([1024, 2048, 4096]),
                     "global_batch": count * rng.choice([1, 2, 4]),
                     "precision": "bf16-mixed", "optimizer": "adamw", "grad_clip": True,
                     "runtime": rng.choice(["torchtitan", "megatron"])},
        "config": {"micro_batch": "auto", "grad_accum": "auto", "dp": "auto", "tp": "auto",
                   "pp": "auto", "zero_stage": "auto", "sequence_parallel": "auto",
                   "remat": "auto", "dp_replicate": "auto"},
    }


CHOICE_CARDS = ["llama-3.2-1b", "gemma-2-2b", "qwen2.5-1.5b", "llama-3-8b", "mistral-7b",
                "gpt2-1.5b"]


def random_workload_scenario(rng: random.Random) -> dict:
    """A PyTorch scenario with [training] fields left to the optimiser (``loss`` and
    ``activation_offload`` "auto", ``compile`` and ``paged_optimizer`` "auto" in half each),
    on one to eight cards and large vocabularies, LoRA in half: for the optimality of the
    search over workload variants (each solved like a GPU of a fleet and ranked together)."""
    count = rng.choice([1, 1, 2, 4, 8])
    d = {
        "name": f"random-choices-{rng.randrange(10**9)}",
        "model": {"card": rng.choice(CHOICE_CARDS)},
        "hardware": {"gpu": rng.choice(["rtx-4090-24gb", "a100-sxm-40gb", "a100-sxm-80gb",
                                        "h100-sxm-80gb"]), "count": count},
        "training": {"seq_len": rng.choice([2048, 4096, 8192, 16384]),
                     "global_batch": count * rng.choice([1, 2, 4, 8]),
                     "precision": rng.choice(["bf16-mixed", "bf16"]),
                     "optimizer": rng.choice(["adamw", "adamw-8bit"]),
                     "grad_clip": rng.random() < 0.7,
                     "runtime": rng.choice(["pytorch-eager", "hf"]),
                     "loss": "auto", "activation_offload": "auto",
                     "compile": rng.choice([False, "auto"])},
        "config": {"micro_batch": "auto", "grad_accum": "auto", "dp": "auto", "tp": "auto",
                   "pp": "auto", "zero_stage": "auto", "sequence_parallel": "auto",
                   "remat": "auto"},
    }
    if rng.random() < 0.5:
        d["training"]["lora"] = {"rank": 16, "base_bits": rng.choice([4, 16])}
    d["training"]["paged_optimizer"] = rng.choice([False, "auto"])
    return d


def _training(plan) -> dict:
    """The [training] values a search chose (`capopt._specs.training_choices`), or {}."""
    from capopt._specs import training_choices
    return training_choices(plan.scenario) if plan is not None else {}


def optimality(n_scenarios: int, seed: int, draw=random_scenario) -> dict:
    rng = random.Random(seed)
    rows, skipped = [], 0
    t_start = time.perf_counter()
    while len(rows) < n_scenarios:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # sequences past a card's position table
            sc = capopt.load_scenario(draw(rng))
        ex = optimize(sc, top_k=1, method="exhaustive", remedies=False)
        if ex.status != "ok":
            skipped += 1
            continue
        gr = optimize(sc, top_k=1, remedies=False)   # the relaxed solve; warm after the first
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
            "warm_s": warm, "exhaustive_s": ex.solve_s,
            "cp": ex.best.config.cp, "optimizer_cp": gr.best.config.cp if gr.best else None,
            "vpp": ex.best.config.vpp,
            "optimizer_vpp": gr.best.config.vpp if gr.best else None,
            "dp_replicate": ex.best.config.dp_replicate,
            "optimizer_dp_replicate": gr.best.config.dp_replicate if gr.best else None,
            "training": _training(ex.best), "optimizer_training": _training(gr.best)})
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
arg = sys.argv[1]
sc = capopt.load_scenario(json.loads(arg) if arg.startswith("{") else arg)
r = optimize(sc, top_k=5, remedies=False,
             exhaustive_below=int(sys.argv[2]))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "solve_s": t2 - t1, "status": r.status,
                  "method": r.method, "layout": r.layout is not None,
                  "load": os.getloadavg()[0]}))
"""


COLD_REPEATS = 5     # fresh processes per scenario and path with no cache: median and max


def cold(scenarios: list[str]) -> list[dict]:
    """Fresh processes: with no compilation cache at all (`COLD_REPEATS` of them), with an
    empty cache directory, then with that cache warm; for the default path (the relaxed
    solve), ``--method auto`` and an uneven-stage scenario (default path plus the layout
    solve). Each run reports the import and the solve; a cold start is their sum."""
    import tempfile

    from capopt.search.optimize import EXHAUSTIVE_BELOW
    out = []
    runs = ([("default", 0, s) for s in scenarios]
            + [("auto", EXHAUSTIVE_BELOW, s) for s in scenarios]
            + [("layout", 0, json.dumps(LAYOUT_CASES[0]))])

    def fresh(name, below, cache_dir):
        env = dict(os.environ, CAPOPT_CACHE_DIR=cache_dir)
        p = subprocess.run([sys.executable, "-c", COLD_SNIPPET, name, str(below)],
                           capture_output=True, text=True, env=env, check=True)
        return json.loads(p.stdout.strip().splitlines()[-1])

    for path in ("default", "auto", "layout"):
        with tempfile.TemporaryDirectory() as cache:
            for _, below, name in [r for r in runs if r[0] == path]:
                label_name = (json.loads(name)["name"] if name.startswith("{") else name)
                row = {"scenario": label_name, "path": path}
                reps = [fresh(name, below, "") for _ in range(COLD_REPEATS)]
                for rep in reps:
                    rep["total_s"] = rep["import_s"] + rep["solve_s"]
                row["no_cache_runs"] = reps
                row["no_cache"] = sorted(reps, key=lambda x: x["total_s"])[len(reps) // 2]
                row["no_cache_max_total_s"] = max(x["total_s"] for x in reps)
                row["disk_cache"] = fresh(name, below, cache)
                row["disk_cache_again"] = fresh(name, below, cache)
                out.append(row)
    return out


def print_cold(rows: list[dict]) -> None:
    print("\nCold start (fresh process: import + solve, compilation included)   target <= 5 s")
    print(f"  {'scenario':<24} {'path':<8} {'no cache: median':>16} {'max':>6} "
          f"{'import':>7} {'solve':>6} {'cache cold':>11} {'cache warm':>11}   runs")
    for r in rows:
        med = r["no_cache"]
        runs = "/".join(f"{x['total_s']:.2f}" for x in r["no_cache_runs"])
        print(f"  {r['scenario'][:24]:<24} {r['path']:<8} {med['total_s']:>15.2f}s "
              f"{r['no_cache_max_total_s']:>5.2f}s {med['import_s']:>6.2f}s "
              f"{med['solve_s']:>5.2f}s {r['disk_cache']['solve_s']:>10.2f}s "
              f"{r['disk_cache_again']['solve_s']:>10.2f}s   {runs}")
    print("  (cache columns: the solve alone, the first process writing an empty cache "
          "directory and the next one reading it)")


def big_space() -> dict:
    sc = capopt.load_scenario("llama3-70b-64xh100")
    L = sc.model.num_hidden_layers
    remat = tuple(["selective"] + [i / L for i in range(L + 1)])
    free = ("remat", "offload_optimizer", "flash_attention")
    knobs = tuple(k for k in sc.knobs if k.name not in free) + (
        KnobDomain("remat", remat), KnobDomain("offload_optimizer", (False, True)),
        KnobDomain("flash_attention", (False, True)))
    # 1280 GPUs (5 x 256: pipeline depths 5, 10, 20, 40 too) and a global batch of
    # 61440 = 2^12 x 15 sequences (many micro-batch / accumulation splits)
    sc = sc.replace(knobs=knobs, count=1280,
                    workload=sc.workload.__class__(**{**sc.workload.__dict__,
                                                      "global_batch": 61440}))
    t0 = time.perf_counter()
    size = len(build_lattice(sc))
    lattice_s = time.perf_counter() - t0
    optimize(sc, top_k=1, remedies=False)   # compile
    optimize(sc, top_k=1, method="exhaustive", remedies=False)
    g_times, e_times = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        g = optimize(sc, top_k=1, remedies=False)
        g_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        e = optimize(sc, top_k=1, method="exhaustive", remedies=False)
        e_times.append(time.perf_counter() - t0)
    g_s, e_s = statistics.median(g_times), statistics.median(e_times)
    tg, te = g.best.throughput["tokens_per_s"], e.best.throughput["tokens_per_s"]
    return {"scenario": "llama-3-70b on 1280x H100, global batch 61440, remat by layer count, "
                        "offload, flash", "space": size, "repeats": 3,
            "lattice_build_s": lattice_s, "optimizer_s": g_s, "exhaustive_s": e_s,
            "ratio": e_s / g_s, "optimizer_evaluated": g.evaluated,
            "optimizer_tokens_per_s": tg, "exhaustive_tokens_per_s": te, "gap": 1 - tg / te}


LAYOUT_CASES = [
    {"name": "llama-3-8b on 32x A100-40GB, pp 8, uneven stages",
     "model": {"card": "llama-3-8b"}, "hardware": {"gpu": "a100-sxm-40gb", "count": 32},
     "training": {"seq_len": 8192, "global_batch": 64},
     "config": {"pp": 8, "tp": [1, 2, 4], "pipeline_layers": "auto",
                "stage_recompute": "auto"}},
    {"name": "llama-3-70b on 64x H100 (34 GiB budget), pp 8, uneven stages",
     "model": {"card": "llama-3-70b"}, "hardware": {"gpu": "h100-sxm-80gb", "count": 64},
     "training": {"seq_len": 8192, "global_batch": 256}, "budget": {"vram_gib": 34},
     "config": {"pp": 8, "tp": 8, "remat": ["none", "selective"],
                "pipeline_layers": "auto", "stage_recompute": "auto"}},
]


def stage_layouts(restarts: int = 20, seed: int = 0) -> list[dict]:
    """The optimiser's uneven layout, and hill-climbing from it and from random layouts."""
    import numpy as np
    from capopt.cost import numbers_pytree
    from capopt.search.stages import LayoutProblem
    out = []
    for case in LAYOUT_CASES:
        sc = capopt.load_scenario(case)
        optimize(sc, top_k=1, remedies=False)                  # compile
        t0 = time.perf_counter()
        r = optimize(sc, top_k=1, remedies=False)
        total_s = time.perf_counter() - t0
        lay = r.layout
        lp = LayoutProblem(sc, lay.config, numbers_pytree(sc), True, True)
        relaxed_only = lp.solve(polish=False)
        t0 = time.perf_counter()
        cl, cr, moves = lp.climb(np.asarray(lay.layers), np.asarray(lay.recompute))
        climb_s = time.perf_counter() - t0
        climbed = lp.layout(cl, cr, lay.even_tokens_per_s, lay.even_fits)
        rng = np.random.default_rng(seed)
        p, L = lp.p, lp.L
        found = []
        t0 = time.perf_counter()
        for _ in range(restarts):
            li = rng.multinomial(L - p, rng.dirichlet(np.ones(p))) + 1
            ri = rng.integers(0, li + 1)
            a, b, _ = lp.climb(li, ri, max_moves=2000)
            res = lp.layout(a, b, lay.even_tokens_per_s, lay.even_fits)
            found.append(res.tokens_per_s if res.fits else 0.0)
        restart_s = time.perf_counter() - t0
        best_random = max(found)
        out.append({
            "scenario": case["name"], "layouts": lp.size(), "base_config": lay.config.to_dict(),
            "pipeline_layers": lay.layers, "stage_recompute": lay.recompute,
            "stage_gib": [round(b / 2**30, 2) for b in lay.stage_bytes],
            "budget_gib": round(lay.budget_bytes / 2**30, 2), "fits": lay.fits,
            "tokens_per_s": lay.tokens_per_s, "even_split_tokens_per_s": lay.even_tokens_per_s,
            "even_split_fits": lay.even_fits,
            "best_uniform_tokens_per_s": (r.best.throughput["tokens_per_s"] if r.best
                                          else None),
            "optimize_s": total_s, "layout_solve_s": lay.solve_s,
            "relaxed_only": {"layers": relaxed_only.layers, "recompute": relaxed_only.recompute,
                             "tokens_per_s": relaxed_only.tokens_per_s,
                             "fits": relaxed_only.fits},
            "polish_moves": lay.timings.get("polish_moves"),
            "climb_from_answer": {"moves": moves, "tokens_per_s": climbed.tokens_per_s,
                                  "improvement": climbed.tokens_per_s / lay.tokens_per_s - 1,
                                  "s": climb_s},
            "random_restarts": {"restarts": restarts, "best_tokens_per_s": best_random,
                                "beat_answer": int(sum(f > lay.tokens_per_s * (1 + 1e-6)
                                                       for f in found)),
                                "best_vs_answer": best_random / lay.tokens_per_s - 1,
                                "fitting": int(sum(f > 0 for f in found)), "s": restart_s},
        })
    return out


def knob_section(args, key: str, n: int, draw, knob, title: str, uses: str) -> int:
    """Section 1 over ``n`` scenarios drawn by ``draw`` with ``knob`` searched (a config
    knob's name, or a test of a row: whether its exhaustive optimum uses the choice):
    printed and written as the ``key`` section of ``--out`` (the other sections kept)."""
    res = optimality(n, args.seed, draw=draw)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data[key] = res
    out.write_text(json.dumps(data, indent=1))
    used = sum((knob(r) if callable(knob) else r[knob] > 1) for r in res["rows"])
    print(f"\nOptimality with {title}")
    print(f"  scenarios                    {res['scenarios']} "
          f"({res['skipped_infeasible']} infeasible draws skipped); the exhaustive optimum "
          f"{uses} in {used}")
    print(f"  same optimum                 {res['same_optimum']} "
          f"({100 * res['same_optimum_share']:.1f}%)   target >= 99%")
    print(f"  worst throughput gap         {100 * res['worst_gap']:.3f}%   target <= 1%")
    print(f"  every answer fits            {res['all_fit']}")
    print(f"  warm solve median / max      {res['warm_s_median']:.3f} s / "
          f"{res['warm_s_max']:.3f} s")
    print(f"wrote the {key} section of {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/optimizer.json")
    ap.add_argument("--cold-only", action="store_true",
                    help="run only the cold solves and replace the 'cold' section of --out")
    ap.add_argument("--context-parallel", type=int, default=0, metavar="N",
                    help="run only the optimality of N long-sequence scenarios with cp "
                         "searched and replace the 'context_parallel' section of --out")
    ap.add_argument("--virtual-stages", type=int, default=0, metavar="N",
                    help="run only the optimality of N pipeline scenarios with vpp searched "
                         "and replace the 'virtual_stages' section of --out")
    ap.add_argument("--hybrid-shard", type=int, default=0, metavar="N",
                    help="run only the optimality of N multi-node scenarios with dp_replicate "
                         "searched and replace the 'hybrid_shard' section of --out")
    ap.add_argument("--workload-choices", type=int, default=0, metavar="N",
                    help="run only the optimality of N PyTorch scenarios with loss, "
                         "activation_offload (and compile, paged_optimizer) left to the "
                         "optimiser and replace the 'workload_choices' section of --out")
    args = ap.parse_args()

    if args.workload_choices:
        return knob_section(args, "workload_choices", args.workload_choices,
                            random_workload_scenario,
                            lambda r: any(v not in ("float32", False)
                                          for v in r["training"].values()),
                            "[training] fields searched (loss, activation_offload, compile, "
                            "paged_optimizer; pytorch-eager / hf)", "takes a loss other than "
                            "float32, offloading, torch.compile or a paged optimizer")
    if args.hybrid_shard:
        return knob_section(args, "hybrid_shard", args.hybrid_shard,
                            random_multinode_scenario, "dp_replicate",
                            "hybrid sharding searched (16-512 devices, torchtitan / megatron)",
                            "uses dp_replicate > 1")
    if args.virtual_stages:
        return knob_section(args, "virtual_stages", args.virtual_stages,
                            random_pipeline_scenario, "vpp",
                            "interleaved pipeline stages searched (torchtitan / megatron)",
                            "interleaves (vpp > 1)")
    if args.context_parallel:
        return knob_section(args, "context_parallel", args.context_parallel,
                            random_long_scenario, "cp", "context parallelism searched (long "
                            "sequences, torchtitan / megatron)", "uses cp > 1")

    if args.cold_only:
        cold_rows = cold(["llama3-8b-8xh100", "llama3-70b-64xh100", "gpt2-124m-rtx4090"])
        out = Path(args.out)
        data = json.loads(out.read_text()) if out.exists() else {}
        data["cold"] = cold_rows
        out.write_text(json.dumps(data, indent=1))
        print_cold(cold_rows)
        print(f"wrote the cold section of {out}")
        return 0

    print(f"optimality over {args.scenarios} random scenarios ...", file=sys.stderr)
    opt = optimality(args.scenarios, args.seed)
    print("cold solves in fresh processes ...", file=sys.stderr)
    cold_rows = cold(["llama3-8b-8xh100", "llama3-70b-64xh100", "gpt2-124m-rtx4090"])
    print("a space of over 10^6 configs ...", file=sys.stderr)
    big = big_space()
    print("uneven pipeline stages ...", file=sys.stderr)
    layouts = stage_layouts()

    print("\nOptimality (optimiser vs exhaustive, same cost model)")
    print(f"  scenarios                    {opt['scenarios']} "
          f"({opt['skipped_infeasible']} infeasible draws skipped)")
    print(f"  same optimum                 {opt['same_optimum']} "
          f"({100 * opt['same_optimum_share']:.1f}%)   target >= 99%")
    print(f"  worst throughput gap         {100 * opt['worst_gap']:.3f}%   target <= 1%")
    print(f"  every answer fits            {opt['all_fit']}")
    print(f"  warm solve median / max      {opt['warm_s_median']:.3f} s / "
          f"{opt['warm_s_max']:.3f} s   target <= 1 s")
    print_cold(cold_rows)
    print("\nLarge space")
    print(f"  {big['scenario']}: {big['space']:,} configs")
    print(f"  exhaustive {big['exhaustive_s']:.2f} s, optimiser {big['optimizer_s']:.3f} s "
          f"({big['optimizer_evaluated']:,} evaluated): ratio {big['ratio']:.0f}x, "
          f"gap {100 * big['gap']:.3f}%")

    print("\nUneven pipeline stages (layer and recompute count per stage)")
    for c in layouts:
        print(f"  {c['scenario']}: {c['layouts']:.3g} integer layouts")
        print(f"    answer: layers {c['pipeline_layers']}, recompute {c['stage_recompute']}, "
              f"{c['tokens_per_s']:,.0f} tok/s (even split {c['even_split_tokens_per_s']:,.0f}"
              f"{'' if c['even_split_fits'] else ', does not fit'}), fits {c['fits']}; "
              f"layout solve {c['layout_solve_s']:.2f} s, optimize {c['optimize_s']:.2f} s")
        ca, rr = c["climb_from_answer"], c["random_restarts"]
        print(f"    hill-climb from the answer: {ca['moves']} improving moves "
              f"({100 * ca['improvement']:+.3f}%); {rr['restarts']} random restarts: best "
              f"{100 * rr['best_vs_answer']:+.3f}% vs the answer, {rr['beat_answer']} beat it")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the sections run on their own (context parallelism, virtual stages, hybrid sharding)
    # are kept
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update({"machine": f"{os.cpu_count()} CPU cores", "optimality": opt,
                 "load_average_at_end": os.getloadavg(), "cold": cold_rows,
                 "large_space": big, "stage_layouts": layouts})
    out.write_text(json.dumps(data, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
