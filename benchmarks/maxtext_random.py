"""Peak memory of MaxText's own training step on configs drawn at random, against the
``maxtext`` runtime profile.

    python benchmarks/maxtext_random.py [--cases 60] [--seed 0] [--jobs 2] [--full-size]
                                        [--no-measure]

Needs the maxtext tier (``capopt setup maxtext``: MaxText 0.2.5 in a Python 3.12 environment of
its own). Draws ``--cases`` configs of MaxText's llama2 decoder block (sizes, MHA / GQA,
head_dim, vocabulary; 1-8 H100s over its data, fsdp and tensor axes, hybrid sharding; remat
minimal or full; bf16-mixed, bf16 or fp32; AdamW, Adam or SGD, with and without clipping;
accumulation 1-2), writes each as ``--emit maxtext`` does, compiles MaxText's train step for an
H100 (`capopt.validation.maxtext_tier`) and compares XLA's peak per device (argument + output +
temp - alias) with the ``maxtext`` profile's prediction. Attention is MaxText's dot_product
(materialised). Each card shape falls in the fitting or the held-out split by a hash of its
sizes: rules of the profile may be read off the fitting split's buffer assignments, never off
the held-out one. Measurements are appended to a JSONL file as they finish and a rerun resumes
(a measurement does not depend on the cost model); the table and ``--out`` (JSON) are
recomputed from the current model every time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from capopt._hardware import get_hardware  # noqa: E402
from capopt._model import ModelSpec  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import Budget, Config, Scenario, Workload, stable_text  # noqa: E402
from capopt.validation.random_configs import Case  # noqa: E402
from _random_cases import by_feature, measure, pct, print_splits, summary  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GPU = "h100-sxm-80gb"
GROUPS = ("layout", "remat", "precision", "optimizer", "clipping", "grad_accum")


def card(h: int, heads: int, kv: int, hd: int, ffn: int, layers: int, vocab: int) -> ModelSpec:
    """MaxText's llama2 block at these sizes (decoder_block llama2: RMSNorm, rotary, SwiGLU, no
    biases; logits_via_embedding false: an untied head)."""
    return ModelSpec(name=f"maxtext-h{h}-a{heads}k{kv}-d{hd}-f{ffn}-L{layers}-V{vocab}",
                     family="decoder", hidden_size=h, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                     intermediate_size=ffn, vocab_size=vocab, position_embedding="rotary",
                     norm_type="rmsnorm", mlp_type="gated", hidden_act="silu",
                     tie_word_embeddings=False)


def split_of(shape: tuple) -> str:
    return "fit" if int(hashlib.sha1(repr(shape).encode()).hexdigest(), 16) % 2 else "heldout"


def draw(n_cases: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    hw = get_hardware(GPU)
    rt = get_profile("maxtext")
    out: list[Case] = []
    while len(out) < n_cases:
        h = rng.choice([256, 384, 512, 768, 1024, 1536, 2048])
        hd = rng.choice([64, 128])
        heads = max(1, h // hd // rng.choice([1, 1, 2]))          # head_dim x heads <= h
        kv = rng.choice([d for d in (heads, heads // 2, heads // 4, 1) if d >= 1
                         and heads % d == 0])
        ffn = 128 * round(h * rng.uniform(2.5, 3.5) / 128)
        layers = rng.choice([2, 3, 4, 6, 8])
        vocab = rng.choice([8192, 16384, 32000, 32768, 49152, 50304])
        shape = (h, heads, kv, hd, ffn, layers, vocab)
        n = rng.choice([1, 2, 4, 8])
        tp = rng.choice([t for t in (1, 1, 2, 4) if n % t == 0 and kv % t == 0])
        dp = n // tp
        zero = rng.choice([0, 3]) if dp > 1 else 0
        rep = 2 if zero == 3 and dp >= 4 and rng.random() < 0.3 else 1
        mb = rng.choice([m for m in (1, 2, 4) if m % tp == 0] or [tp])
        ga = rng.choice([1, 1, 2])
        seq = rng.choice([256, 512, 1024, 2048])
        cfg = Config(micro_batch=mb, grad_accum=ga, dp=dp, tp=tp, zero_stage=zero,
                     dp_replicate=rep, remat=rng.choice(["selective", "full"]),
                     flash_attention=False)
        wl = Workload(seq_len=seq, global_batch=mb * ga * dp,
                      precision=rng.choice(["bf16-mixed", "bf16-mixed", "bf16", "fp32"]),
                      optimizer=rng.choice(["adamw", "adam", "sgd"]),
                      grad_clip=rng.random() < 0.6)
        name = f"mt{seed}-{len(out):03d}"
        sc = Scenario(name=name, model=card(*shape), hardware=hw, count=n, per_node=8,
                      workload=wl, budget=Budget(vram_bytes=hw.memory_bytes), runtime=rt)
        layout = ("1 device" if n == 1 else
                  f"{'fsdp' if zero == 3 else 'data'}{' + data (hybrid)' if rep > 1 else ''}"
                  f"{' + tensor' if tp > 1 else ''}" if dp > 1 else "tensor")
        feats = {"layout": layout, "remat": cfg.remat, "precision": wl.precision,
                 "optimizer": wl.optimizer, "clipping": "clip" if wl.grad_clip else "no clip",
                 "grad_accum": f"accum {ga}"}
        out.append(Case(name=name, shape=repr(shape), split=split_of(shape), scenario=sc,
                        config=cfg, features=feats))
    return out


def full_size_cases() -> list[Case]:
    """Shipped cards of MaxText's llama2 block on one node of 8 H100s (FSDP, tensor)."""
    from capopt._cards import load_card
    hw, rt = get_hardware(GPU), get_profile("maxtext")
    rows = [("llama-2-7b", 1024, Config(micro_batch=1, dp=8, zero_stage=3, remat="full")),
            ("llama-2-7b", 2048, Config(micro_batch=2, dp=8, zero_stage=3, remat="selective")),
            ("llama-2-7b", 1024, Config(micro_batch=2, dp=4, tp=2, zero_stage=3,
                                        remat="full")),
            ("llama-3-8b", 2048, Config(micro_batch=1, dp=8, zero_stage=3, remat="full"))]
    out = []
    for i, (name, seq, cfg) in enumerate(rows):
        cfg = cfg.replace(flash_attention=False)
        wl = Workload(seq_len=seq, global_batch=cfg.micro_batch * cfg.dp,
                      precision="bf16-mixed", optimizer="adamw", grad_clip=True)
        sc = Scenario(name=f"full-{i}-{name}", model=load_card(name), hardware=hw, count=8,
                      per_node=8, workload=wl, budget=Budget(vram_bytes=hw.memory_bytes),
                      runtime=rt)
        feats = {"layout": "fsdp + tensor" if cfg.tp > 1 else "fsdp", "remat": cfg.remat,
                 "precision": wl.precision, "optimizer": wl.optimizer, "clipping": "clip",
                 "grad_accum": "accum 1"}
        out.append(Case(name=sc.name, shape=name, split="full-size", scenario=sc, config=cfg,
                        features=feats))
    return out


def describe(c: Case) -> str:
    m, w, k = c.scenario.model, c.scenario.workload, c.config
    return (f"h{m.hidden_size} L{m.num_hidden_layers} a{m.num_attention_heads}/"
            f"{m.num_key_value_heads} d{m.head_dim} f{m.intermediate_size} V{m.vocab_size} "
            f"s{w.seq_len} {w.precision} {w.optimizer}{'+clip' if w.grad_clip else ''} "
            f"mb{k.micro_batch} ga{k.grad_accum} dp{k.dp} z{k.zero_stage}"
            f"{f' rep{k.dp_replicate}' if k.dp_replicate > 1 else ''} tp{k.tp} {k.remat}")


def key_of(c: Case) -> str:
    from capopt.validation.maxtext_tier import REQUIREMENTS
    sc = c.scenario
    parts = (sc.model, sc.workload, sc.hardware.name, sc.count,
             json.dumps(c.config.key_dict(), sort_keys=True), REQUIREMENTS[0])
    return hashlib.sha1(stable_text(parts).encode()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per compile")
    ap.add_argument("--full-size", action="store_true",
                    help="add shipped cards (Llama-2-7B, Llama-3-8B) on 8 H100s")
    ap.add_argument("--no-measure", action="store_true",
                    help="only recompute the predictions for what is already measured")
    ap.add_argument("--measurements", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stem = "maxtext_random" + (f"_seed{args.seed}" if args.seed else "")
    path = Path(args.measurements or RESULTS / f"{stem}.jsonl")
    out_path = Path(args.out or RESULTS / f"{stem}.json")
    if not args.no_measure:
        from capopt.validation.maxtext_tier import maxtext_available
        ok, why = maxtext_available()
        if not ok:
            print(f"error: {why}", file=sys.stderr)
            return 2
    from capopt.validation.predict import predicted_terms
    t0 = time.perf_counter()
    cases = draw(args.cases, args.seed)
    if args.full_size:
        cases += full_size_cases()
    path.parent.mkdir(parents=True, exist_ok=True)
    from capopt.validation.runner import load_results
    done = ({r["key"]: r for r in load_results(path) if r.get("status") == "ok"}
            if args.no_measure else
            measure(cases, path, tier="maxtext", key=key_of, jobs=args.jobs,
                    timeout_s=args.timeout, describe_case=describe))
    points, state_errors = [], []
    for c in cases:
        rec = done.get(key_of(c))
        if rec is None:
            continue
        m = rec["measured"]
        p = predicted_terms(c.config, c.scenario, input_bytes=m["input_bytes"])
        err = (p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"]
        # the donated state (parameters, optimizer state, the step count) against the
        # predicted parameters and optimizer state
        state_errors.append((p["alias_bytes"] - m["alias_bytes"]) / m["alias_bytes"])
        points.append({"case": c.name, "split": c.split, "describe": describe(c),
                       "features": c.features, "measured": m,
                       "predicted_peak_bytes": p["peak_bytes"],
                       "predicted_temp_bytes": p["temp_bytes"], "error": err})
    splits = {s: summary([q["error"] for q in points if q["split"] == s])
              for s in ("heldout", "fit", "full-size") if any(q["split"] == s for q in points)}
    groups = by_feature(points, GROUPS)
    print(f"\nPeak bytes per device, predicted (maxtext profile) against XLA's buffer "
          f"assignment of MaxText's own step ({GPU})\n")
    print_splits(splits)
    print("\nheld-out, by feature:")
    for g, vals in groups.items():
        for v, s in vals.items():
            if s["n"]:
                print(f"  {g:<11} {v:<24} {s['n']:>3} {pct(s['median_abs']):>7} "
                      f"{pct(s['p90_abs']):>7} {100 * s['worst_signed']:+6.1f}%")
    state = max((abs(e) for e in state_errors), default=None)
    print(f"\nparameters + optimizer state against the donated state: worst "
          f"{pct(state)} of {len(state_errors)}")
    failed = [c.name for c in cases if key_of(c) not in done]
    if failed:
        print(f"{len(failed)} case(s) not measured: {', '.join(failed[:10])}")
    Path(out_path).write_text(json.dumps({
        "tier": "maxtext", "gpu": GPU, "profile": "maxtext", "cases": args.cases,
        "seed": args.seed, "splits": splits, "by_feature": groups, "state_worst_abs": state,
        "points": points, "not_measured": failed, "total_s": time.perf_counter() - t0},
        indent=1))
    print(f"wrote {out_path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
