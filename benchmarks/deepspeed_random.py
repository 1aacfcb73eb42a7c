"""Live-tensor peak on configs drawn at random, judged by DeepSpeed's own step (deepspeed tier).

    python benchmarks/deepspeed_random.py [--cases 40] [--jobs 2] [--runtime deepspeed]

Draws ``--cases`` configs with `capopt.validation.random_configs.draw_deepspeed_cases` (fixed
seed; 1, 2 or 4 data-parallel ranks, ZeRO stage 0-3, bf16-mixed or fp32, Adam or
AdamW, sequences of 64-512 tokens; card shapes split into fitting and held-out by a hash of
their sizes), runs each as DeepSpeed's training step with the JSON ``--emit deepspeed``
writes (`capopt.validation.deepspeed_step`: real CPU tensors, PyTorch's fake process group,
one process per case) and compares the ``--runtime`` profile's predicted peak of live tensor
bytes (no context, workspace or fragmentation; `predicted_torch_terms`) with the peak the
tier counted, by split, ZeRO stage and precision. ``--runtime pytorch`` judges the generic
profile on the same measurements.

Measurements go to a JSONL file as they finish and a rerun resumes (a measurement does not
depend on the cost model); the table and ``--out`` (JSON) are recomputed every time. Needs
torch and deepspeed (``pip install 'capopt[torch,frameworks]'``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _random_cases import add_worker_args, measure, pct, summary  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import stable_text  # noqa: E402
from capopt.validation.random_configs import describe, draw_deepspeed_cases  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GROUPS = ("zero", "precision", "layout", "remat", "grad_accum", "style")


def measurement_key(case) -> str:
    sc = case.scenario
    text = stable_text(("deepspeed", sc.model, sc.workload,
                        json.dumps(case.config.key_dict(), sort_keys=True)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    add_worker_args(ap)
    ap.add_argument("--runtime", default="deepspeed",
                    help="the profile judged (default deepspeed; e.g. pytorch)")
    ap.add_argument("--measurements", default=None, help="JSONL of measurements (resumed)")
    ap.add_argument("--out", default=None, help="JSON results (default benchmarks/results/)")
    args = ap.parse_args(argv)
    from capopt.validation.predict import predicted_torch_terms

    t0 = time.perf_counter()
    stem = f"deepspeed_random{'' if args.seed == 0 else f'_seed{args.seed}'}"
    path = Path(args.measurements or RESULTS / f"{stem}.jsonl")
    out = Path(args.out or RESULTS / (stem + ("" if args.runtime == "deepspeed"
                                              else f"_{args.runtime}") + ".json"))
    cases = draw_deepspeed_cases(args.cases, args.seed)
    done = measure(cases, path, tier="deepspeed", key=measurement_key, jobs=args.jobs,
                   timeout_s=args.timeout)
    rt = get_profile(args.runtime)
    points, missing = [], []
    for case in cases:
        rec = done.get(measurement_key(case))
        if rec is None:
            missing.append(case.name)
            continue
        sc = dataclasses.replace(case.scenario, runtime=rt)
        pred = predicted_torch_terms(case.config, sc)
        meas = rec["measured"]["peak_bytes"]
        c = case.config
        feats = {"zero": f"ZeRO-{c.zero_stage}", "layout": f"dp {c.dp}",
                 "precision": case.features["precision"], "remat": case.features["remat"],
                 "grad_accum": case.features["grad_accum"], "style": case.features["style"]}
        points.append({"case": case.name, "split": case.split, "describe": describe(case),
                       "features": feats, "measured_peak_bytes": meas,
                       "predicted_peak_bytes": pred["peak_bytes"],
                       "peak_phase": rec["details"].get("peak_phase"),
                       "predicted_phase": pred["peak_phase"],
                       "error": pred["peak_bytes"] / meas - 1.0})
    splits = {s: summary([p["error"] for p in points if p["split"] == s])
              for s in ("fit", "heldout")}
    by_feature = {g: {v: summary([p["error"] for p in points if p["split"] == "heldout"
                                  and p["features"][g] == v])
                      for v in sorted({p["features"][g] for p in points})} for g in GROUPS}

    print(f"deepspeed tier: {len(points)} configs measured ({len(missing)} not), profile "
          f"{args.runtime!r}: predicted / measured live-tensor peak - 1")
    for p in points:
        print(f"  {p['split']:<7} {p['error']:+7.1%}  {p['measured_peak_bytes'] / 2**20:9.1f} "
              f"MiB  {p['describe']}")
    for s, v in splits.items():
        if v.get("n"):
            print(f"{s:<8} n {v['n']:3d}  median {pct(v['median_abs'])}  p90 "
                  f"{pct(v['p90_abs'])}  worst {v['worst_signed']:+.1%}  mean "
                  f"{v['mean_signed']:+.1%}")
    print("held out, by feature (median |error|, worst):")
    for g, vals in by_feature.items():
        for v, sm in vals.items():
            if sm.get("n"):
                print(f"  {g:<11} {v:<14} n {sm['n']:3d}  {pct(sm['median_abs'])}  "
                      f"{sm['worst_signed']:+.1%}")
    payload = {"tier": "deepspeed", "profile": args.runtime, "seed": args.seed,
               "cases": args.cases, "splits": splits, "by_feature": by_feature,
               "points": points, "not_measured": missing,
               "total_s": time.perf_counter() - t0}
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
