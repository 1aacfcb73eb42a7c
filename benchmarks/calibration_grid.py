"""The calibration grid: measure it on a tier and fit a runtime profile.

    python benchmarks/calibration_grid.py [--tier xla-gpu] [--gpu h100-sxm-80gb] [--points 40]
        [--profile-out my-xla-gpu.toml]

Measurements stream to ``--measurements`` and ``--heldout-measurements`` (JSONL; a rerun
resumes by scenario name and config, since a measurement does not depend on the cost model,
and only refits); the fit, the peak errors before and after it on both grids, and every
point to ``--results-out``. The grids are `GRID_DOC` (fitting) and `HELDOUT_DOC` (other
cards, shapes, precisions and multi-GPU layouts, never fitted).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capopt._specs import Config, Scenario  # noqa: E402
from capopt.validation.calibrate import (FIT_COEFFS, PRIOR_WEIGHT, calibrate,  # noqa: E402
                                         samples_from_results)

# --------------------------------------------------------------------------------------------
# The documented grid
# --------------------------------------------------------------------------------------------
GRID_DOC = """Calibration grid (xla-gpu tier, one GPU of the target, autotuning off): two 4-layer
decoders 512 wide with an 8192-token vocabulary, GPT-2-shaped (GELU MLP 4h, LayerNorm,
learned positions, tied embeddings, biases, dropout 0.1) and Llama-shaped (GQA 8/2, SwiGLU
1376, RMSNorm, RoPE, untied), crossed with sequence length {512, 1024}, micro-batch {2, 8}
(global batch 8: grad_accum 4 or 1),
remat {none, selective, full}, flash attention {on, off} and precision {bf16-mixed, fp32};
``points`` of the 96 combinations are drawn with a fixed seed. Two more shapes vary the
vocabulary-to-width ratio, which the first two share (16): a GPT-shaped 1024 wide x 2 layers
(16 heads, GELU 4096, 4096-token untied vocabulary, no dropout: ratio 4) and a Llama-shaped
256 wide x 8 layers (4 heads, one KV head, SwiGLU 704, 16384-token vocabulary: ratio 64),
crossed with sequence length {256, 1024}, micro-batch {1, 4} (global batch 4), the same remat,
flash and precision choices; ``extra_points`` of those 96 are drawn with another seed. All
points fit the profile (target: peak bytes); the separate held-out grid (`HELDOUT_DOC`)
judges it."""




def _draw(models: tuple, seqs: tuple, mbs: tuple, points: int, seed: int,
          accum_of: int | None) -> list[tuple[str, int, str, Config]]:
    """``points`` of the product models x seqs x mbs x remat x flash x precision, drawn with
    ``seed``; ``accum_of`` sets grad_accum to make that many sequences per step."""
    import itertools
    combos = list(itertools.product(models, seqs, mbs, ("none", "selective", "full"),
                                    (True, False), ("bf16-mixed", "fp32")))
    rng = np.random.default_rng(seed)
    pick = sorted(rng.choice(len(combos), size=min(points, len(combos)), replace=False))
    out = []
    for i in pick:
        model, s, mb, remat, flash, prec = combos[i]
        accum = {"grad_accum": accum_of // mb} if accum_of else {}
        out.append((model, s, prec, Config(micro_batch=mb, remat=remat, flash_attention=flash,
                                           **accum)))
    return out


def extra_grid_points(points: int = 20, seed: int = 1) -> list[tuple[str, int, str, Config]]:
    """(model, seq_len, precision, config) of the fitting grid's second part (`GRID_DOC`)."""
    return _draw(("wide", "mqa"), (256, 1024), (1, 4), points, seed, accum_of=4)


def grid_points(points: int = 40, seed: int = 0) -> list[tuple[str, int, str, Config]]:
    """(model, seq_len, precision, config) for the calibration grid (see `GRID_DOC`)."""
    import itertools
    combos = list(itertools.product(("gpt", "llama"), (512, 1024), (2, 8),
                                    ("none", "selective", "full"), (True, False),
                                    ("bf16-mixed", "fp32")))
    rng = np.random.default_rng(seed)
    pick = sorted(rng.choice(len(combos), size=min(points, len(combos)), replace=False))
    out = []
    for i in pick:
        model, s, mb, remat, flash, prec = combos[i]
        out.append((model, s, prec, Config(micro_batch=mb, remat=remat, flash_attention=flash)))
    return out


HELDOUT_DOC = """Held-out grid (same tier and target, never used to fit): two other cards,
GPT-shaped 768 wide x 3 layers (12 heads, GELU 3072, a 16000-token untied vocabulary, no
dropout) and Llama-shaped 384 wide x 6 layers (6 heads, 2 KV heads, SwiGLU 1024, a
32000-token vocabulary), at sequence lengths 256 to 2048, global batches 1 to 32 (micro-batch 1
to 32, grad_accum up to 4), precisions bf16-mixed, fp32 and pure bf16 (not in the fitting
grid), every remat policy, flash on and off, and 2- and 4-GPU layouts (ZeRO-3/FSDP over 2,
tensor parallel 2, and dp 2 x tp 2): 14 points, listed in `heldout_points`."""


def heldout_points() -> list[tuple[str, int, int, str, int, Config]]:
    """(model, seq_len, global_batch, precision, count, config) of the held-out grid."""
    C = Config
    return [
        ("wide-gpt", 256, 16, "bf16-mixed", 1, C(micro_batch=16, remat="none")),
        ("wide-gpt", 2048, 2, "bf16-mixed", 1, C(micro_batch=1, grad_accum=2,
                                                  remat="selective")),
        ("wide-gpt", 2048, 1, "fp32", 1, C(micro_batch=1, remat="full", flash_attention=False)),
        ("wide-gpt", 256, 16, "bf16", 1, C(micro_batch=4, grad_accum=4, remat="full",
                                            flash_attention=False)),
        ("wide-gpt", 1024, 4, "bf16-mixed", 1, C(micro_batch=4, remat="selective",
                                                  flash_attention=False)),
        ("deep-llama", 256, 32, "bf16-mixed", 1, C(micro_batch=32, remat="selective",
                                                    flash_attention=False)),
        ("deep-llama", 2048, 4, "bf16-mixed", 1, C(micro_batch=4, remat="none")),
        ("deep-llama", 2048, 2, "fp32", 1, C(micro_batch=2, remat="full")),
        ("deep-llama", 1024, 8, "bf16", 1, C(micro_batch=2, grad_accum=4, remat="none",
                                              flash_attention=False)),
        ("deep-llama", 512, 16, "fp32", 1, C(micro_batch=16, remat="selective")),
        ("wide-gpt", 1024, 8, "bf16-mixed", 2, C(micro_batch=4, dp=2, zero_stage=3)),
        ("deep-llama", 1024, 8, "bf16-mixed", 2, C(micro_batch=2, grad_accum=2, dp=2,
                                                    zero_stage=3, remat="full",
                                                    flash_attention=False)),
        ("deep-llama", 512, 8, "bf16-mixed", 2, C(micro_batch=8, tp=2, remat="selective")),
        ("wide-gpt", 512, 8, "fp32", 4, C(micro_batch=4, dp=2, tp=2, flash_attention=False)),
    ]


# The block styles of the grid's cards: GPT-2 (biases, learned positions, GELU MLP) and Llama
# (rotary, RMSNorm, gated SiLU MLP, grouped KV heads)
_GPT = dict(family="decoder", tie_word_embeddings=False, attention_bias=True,
            attention_out_bias=True, mlp_bias=True)
_LLAMA = dict(family="decoder", position_embedding="rotary", norm_type="rmsnorm",
              mlp_type="gated", hidden_act="silu")
# kind: (style, name, hidden, layers, heads, kv heads, intermediate, vocab, extra fields)
_CARDS = {
    "wide-gpt": (_GPT, "heldout-gpt", 768, 3, 12, None, 3072, 16000,
                 dict(max_position_embeddings=2048)),
    "wide": (_GPT, "calib-wide", 1024, 2, 16, None, 4096, 4096,
             dict(max_position_embeddings=1024)),
    "gpt": (_GPT, "calib-gpt", 512, 4, 8, None, 2048, 8192,
            dict(max_position_embeddings=1024, tie_word_embeddings=True, hidden_dropout=0.1,
                 attention_dropout=0.1)),
    "mqa": (_LLAMA, "calib-mqa", 256, 8, 4, 1, 704, 16384, {}),
    "deep-llama": (_LLAMA, "heldout-llama", 384, 6, 6, 2, 1024, 32000, {}),
    "llama": (_LLAMA, "calib-llama", 512, 4, 8, 2, 1376, 8192, {}),
}


def grid_model(kind: str):
    from capopt._model import ModelSpec
    style, name, hidden, layers, heads, kv, ffn, vocab, extra = _CARDS.get(kind, _CARDS["llama"])
    kv_heads = {} if kv is None else {"num_key_value_heads": kv}
    return ModelSpec(**{**style, "name": name, "hidden_size": hidden,
                        "num_hidden_layers": layers, "num_attention_heads": heads, **kv_heads,
                        "intermediate_size": ffn, "vocab_size": vocab, **extra})


def _scenario(name, model, seq, batch, prec, count, hw, runtime) -> Scenario:
    from capopt._specs import Budget, Workload
    return Scenario(name=name, model=grid_model(model), hardware=hw, count=count,
                    per_node=count, workload=Workload(seq_len=seq, global_batch=batch,
                                                      precision=prec),
                    budget=Budget(vram_bytes=hw.memory_bytes), runtime=runtime)


def fit_scenarios(points: int, hw, runtime, extra_points: int = 0
                  ) -> list[tuple[Scenario, list[Config]]]:
    groups: dict[tuple, list[Config]] = {}
    for model, s, prec, cfg in grid_points(points):
        groups.setdefault((model, s, prec, 8), []).append(cfg.replace(
            grad_accum=8 // cfg.micro_batch))
    for model, s, prec, cfg in extra_grid_points(extra_points) if extra_points else []:
        groups.setdefault((model, s, prec, 4), []).append(cfg)
    return [(_scenario(f"calib-{m}-s{s}-{p}" + ("" if b == 8 else f"-b{b}"), m, s, b, p, 1,
                       hw, runtime), cfgs)
            for (m, s, p, b), cfgs in groups.items()]


def heldout_scenarios(hw, runtime) -> list[tuple[Scenario, list[Config]]]:
    return [(_scenario(f"heldout-{m}-s{s}-b{b}-{p}-n{n}", m, s, b, p, n, hw, runtime), [cfg])
            for m, s, b, p, n, cfg in heldout_points()]


def measure(groups, path, *, tier: str, jobs: int) -> list[tuple[Scenario, dict]]:
    """Measure every (scenario, config), resuming from ``path`` by scenario name and config
    (measurements do not depend on the cost model's coefficients)."""
    import json

    from capopt.validation.runner import load_results, validate
    done = {}
    if Path(path).exists():
        for r in load_results(path):
            if r.get("status") == "ok" and r.get("tier") == tier:
                done[(r.get("scenario"), json.dumps(r["config"], sort_keys=True))] = r
    out = []
    for sc, cfgs in groups:
        key = lambda c: (sc.name, json.dumps(c.key_dict(), sort_keys=True))  # noqa: E731
        todo = [c for c in cfgs if key(c) not in done]
        if todo:
            rep = validate(sc, tier=tier, configs=todo, out=path, jobs=jobs, progress=True)
            for r in rep.results:
                r["scenario"] = sc.name
                done[key(Config(**r["config"]))] = r
        out += [(sc, done[key(c)]) for c in cfgs if key(c) in done]
    return out


def peak_errors(pairs, profile) -> list[float]:
    """(predicted - measured) / measured peak bytes of each (scenario, record) under
    ``profile``."""
    from capopt.validation.predict import predicted_terms
    errs = []
    for sc, r in pairs:
        m = r["measured"]
        p = predicted_terms(Config(**r["config"]), sc.replace(runtime=profile),
                            input_bytes=m["input_bytes"],
                            output_leaves=r.get("details", {}).get("output_leaves", 0))
        errs.append((p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"])
    return errs


def _summary(errs) -> dict:
    a = np.abs(np.asarray(errs, float))
    return {"n": int(a.size), "median_abs": float(np.median(a)), "max_abs": float(a.max()),
            "mean_abs": float(a.mean())}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import time

    from capopt._hardware import get_hardware
    from capopt.report import calibration_table
    from capopt._runtime import get_profile

    ap = argparse.ArgumentParser(prog="python benchmarks/calibration_grid.py",
                                 description="Measure the calibration grid and fit a profile. "
                                 + GRID_DOC + " " + HELDOUT_DOC)
    ap.add_argument("--tier", default="xla-gpu", choices=["xla-gpu", "device"])
    ap.add_argument("--gpu", default="h100-sxm-80gb")
    ap.add_argument("--points", type=int, default=40)
    ap.add_argument("--extra-points", type=int, default=20,
                    help="points of the grid's second part (other vocabulary/width ratios)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--measurements", default="benchmarks/results/xla_gpu_calibration.jsonl")
    ap.add_argument("--heldout-measurements",
                    default="benchmarks/results/xla_gpu_heldout.jsonl")
    ap.add_argument("--no-heldout", action="store_true", help="skip the held-out grid")
    ap.add_argument("--results-out", default="benchmarks/results/xla_gpu_calibration.json")
    ap.add_argument("--profile-out", default=None,
                    help="write the fitted profile here (e.g. my-xla-gpu.toml)")
    ap.add_argument("--coeffs", default=",".join(FIT_COEFFS))
    ap.add_argument("--target", default="peak_bytes", choices=["peak_bytes", "temp_bytes"])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--learning-rate", type=float, default=0.03)
    ap.add_argument("--prior-weight", type=float, default=PRIOR_WEIGHT,
                    help="weight of the log-normal prior that keeps coefficients near their "
                         "physical starting values")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    hw = get_hardware(args.gpu)
    base = get_profile("xla-gpu")
    fit_pairs = measure(fit_scenarios(args.points, hw, base, args.extra_points),
                        args.measurements,
                        tier=args.tier, jobs=args.jobs)
    held_pairs = [] if args.no_heldout else measure(
        heldout_scenarios(hw, base), args.heldout_measurements, tier=args.tier, jobs=args.jobs)
    samples = []
    for sc, r in fit_pairs:
        samples += samples_from_results([r], sc, target=args.target)
    coeffs = tuple(c for c in args.coeffs.split(",") if c)
    # every fitting point trains; the held-out grid (other cards, shapes, layouts) judges
    res = calibrate(samples, coeffs=coeffs, target=args.target, steps=args.steps,
                    learning_rate=args.learning_rate, holdout=0.0,
                    prior_weight=args.prior_weight,
                    name=f"{base.name}-calibrated")
    errors = {"fit_before": _summary(peak_errors(fit_pairs, base)),
              "fit_after": _summary(peak_errors(fit_pairs, res.profile))}
    if held_pairs:
        errors["heldout_before"] = _summary(peak_errors(held_pairs, base))
        errors["heldout_after"] = _summary(peak_errors(held_pairs, res.profile))
    held = errors.get("heldout_after")
    res.profile = dataclasses.replace(res.profile, source=(
        f"{base.source}; coefficients {', '.join(coeffs)} fitted by capopt calibrate "
        f"(benchmarks/calibration_grid.py) to {res.n_train} {args.tier} measurements of "
        f"{args.target.replace('_', ' ')} on {hw.name} (grid: GRID_DOC there)"
        + (f"; held-out grid (HELDOUT_DOC, {held['n']} points): median |peak error| "
           f"{100 * held['median_abs']:.1f}%, worst {100 * held['max_abs']:.1f}%"
           if held else "")))
    print(calibration_table(res))
    for k, v in errors.items():
        print(f"  peak |error| {k:<15} median {100 * v['median_abs']:5.1f}%  "
              f"worst {100 * v['max_abs']:5.1f}%  (n={v['n']})")
    per_point = []
    for name, pairs in (("fit", fit_pairs), ("heldout", held_pairs)):
        if not pairs:
            continue
        for (sc, r), e0, e1 in zip(pairs, peak_errors(pairs, base),
                                   peak_errors(pairs, res.profile)):
            per_point.append({"set": name, "scenario": sc.name, "config": r["config"],
                              "measured_peak_bytes": r["measured"]["peak_bytes"],
                              "measured_temp_bytes": r["measured"]["temp_bytes"],
                              "peak_error_before": e0, "peak_error_after": e1})
    out = {"tier": args.tier, "gpu": hw.name, "grid": GRID_DOC, "heldout_grid": HELDOUT_DOC,
           "fit": res.to_dict(), "peak_errors": errors, "points": per_point,
           "history": res.history, "total_s": time.perf_counter() - t0}
    Path(args.results_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results_out).write_text(json.dumps(out, indent=1, default=str))
    if args.profile_out:
        Path(args.profile_out).write_text(res.to_toml())
        print(f"wrote {args.profile_out}")
    print(f"wrote {args.results_out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
