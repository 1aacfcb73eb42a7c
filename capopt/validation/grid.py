"""The calibration grid: measure it on a tier and fit a runtime profile.

    python -m capopt.validation.grid [--tier xla-gpu] [--gpu h100-sxm-80gb] [--points 40]
        [--profile-out capopt/profiles/xla-gpu-calibrated.toml]

Measurements stream to ``--measurements`` (JSONL; a rerun resumes and only refits), the fit
and every record to ``--results-out``. The grid is `GRID_DOC`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._specs import Config, Scenario
from .calibrate import calibrate, samples_from_results

# --------------------------------------------------------------------------------------------
# The documented grid: `python -m capopt.validation.grid`
# --------------------------------------------------------------------------------------------
GRID_DOC = """Calibration grid (xla-gpu tier, one GPU of the target, autotuning off): two 4-layer
decoders 512 wide with an 8192-token vocabulary, GPT-2-shaped (GELU MLP 4h, LayerNorm,
learned positions, tied embeddings, biases, dropout 0.1) and Llama-shaped (GQA 8/2, SwiGLU
1376, RMSNorm, RoPE, untied), crossed with sequence length {512, 1024}, micro-batch {2, 8}
(global batch 8: grad_accum 4 or 1),
remat {none, selective, full}, flash attention {on, off} and precision {bf16-mixed, fp32};
``points`` of the 96 combinations are drawn with a fixed seed, a quarter held out."""


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


def grid_model(kind: str):
    from .._model import ModelSpec
    if kind == "gpt":
        return ModelSpec(name="calib-gpt", family="decoder", hidden_size=512,
                         num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048,
                         vocab_size=8192, max_position_embeddings=1024,
                         tie_word_embeddings=True, attention_bias=True,
                         attention_out_bias=True, mlp_bias=True, hidden_dropout=0.1,
                         attention_dropout=0.1)
    return ModelSpec(name="calib-llama", family="decoder", hidden_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, intermediate_size=1376,
                     vocab_size=8192, position_embedding="rotary", norm_type="rmsnorm",
                     mlp_type="gated", hidden_act="silu")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import time
    from pathlib import Path

    from .._hardware import get_hardware
    from .._runtime import get_profile
    from .._specs import Budget, Workload
    from .runner import validate

    ap = argparse.ArgumentParser(prog="python -m capopt.validation.grid",
                                 description="Measure the calibration grid and fit a profile. "
                                 + GRID_DOC)
    ap.add_argument("--tier", default="xla-gpu", choices=["xla-gpu", "device"])
    ap.add_argument("--gpu", default="h100-sxm-80gb")
    ap.add_argument("--points", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--measurements", default="benchmarks/results/xla_gpu_calibration.jsonl")
    ap.add_argument("--results-out", default="benchmarks/results/xla_gpu_calibration.json")
    ap.add_argument("--profile-out", default=None,
                    help="write the fitted profile here (e.g. "
                         "capopt/profiles/xla-gpu-calibrated.toml)")
    # act_scale, logits copies and weight casts: the set whose fit stays physical (a finer set
    # with norm_inputs_saved trades it off against act_scale: 0.26 x 45 norm inputs).
    ap.add_argument("--coeffs", default=",".join(("act_scale", "logits_fp32_copies",
                                                 "logits_act_copies", "weight_copy_fraction")))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--learning-rate", type=float, default=0.03)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    hw = get_hardware(args.gpu)
    base = get_profile("xla-gpu")
    groups: dict[tuple, list[Config]] = {}
    for model, s, prec, cfg in grid_points(args.points):
        groups.setdefault((model, s, prec), []).append(cfg)
    samples, records = [], []
    for (model, s, prec), cfgs in groups.items():
        sc = Scenario(name=f"calib-{model}-s{s}-{prec}", model=grid_model(model), hardware=hw,
                      count=1, per_node=1,
                      workload=Workload(seq_len=s, global_batch=8, precision=prec),
                      budget=Budget(vram_bytes=hw.memory_bytes), runtime=base)
        cfgs = [c.replace(grad_accum=8 // c.micro_batch) for c in cfgs]
        rep = validate(sc, tier=args.tier, configs=cfgs, out=args.measurements,
                       jobs=args.jobs, progress=True)
        for r in rep.results:
            r["scenario"] = sc.name
        records += rep.results
        samples += samples_from_results(rep.results, sc, target="temp_bytes")
    coeffs = tuple(c for c in args.coeffs.split(",") if c)
    res = calibrate(samples, coeffs=coeffs, target="temp_bytes", steps=args.steps,
                    learning_rate=args.learning_rate, name=f"{base.name}-calibrated")
    he = res.holdout_error
    res.profile = dataclasses.replace(res.profile, source=(
        f"{base.source}; coefficients {', '.join(coeffs)} fitted by capopt calibrate "
        f"(python -m capopt.validation.grid) to {res.n_train} {args.tier} measurements "
        f"of temp bytes on {hw.name}, {res.n_holdout} more held out (mean |error| "
        f"{100 * he['before']:.0f}% -> {100 * he['after']:.0f}%); grid: "
        f"capopt.validation.grid.GRID_DOC"))
    print(res.render())
    out = {"tier": args.tier, "gpu": hw.name, "grid": GRID_DOC, "fit": res.to_dict(),
           "history": res.history, "records": records, "total_s": time.perf_counter() - t0}
    Path(args.results_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results_out).write_text(json.dumps(out, indent=1, default=str))
    if args.profile_out:
        Path(args.profile_out).write_text(res.to_toml())
        print(f"wrote {args.profile_out}")
    print(f"wrote {args.results_out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
