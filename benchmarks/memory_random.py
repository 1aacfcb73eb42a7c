"""Peak memory on configs drawn at random, judged by XLA's GPU buffer assignment.

    python benchmarks/memory_random.py [--cases 200] [--jobs 2] [--full-size] [--styles S,..]

Draws ``--cases`` configs with `capopt.validation.random_configs.draw_cases` (fixed seed; each
card shape in the fitting or the held-out split by a hash of its sizes), compiles each as the
real Flax training step for an H100 through the xla-gpu tier (one process per case, as
``capopt validate`` does), and compares the ``xla-gpu`` profile's predicted peak per device
(argument + output + temp - alias) with XLA's. A step with collectives is compiled a second
time without XLA's latency-hiding scheduler (`capopt.validation.xla_log`: on a card with
memory to spare it spends it on overlapping collectives with compute), and the prediction is
compared with that peak too (``error_no_lhs``; a one-device step has no collective and is
the same compile). ``--full-size`` adds configs of shipped cards
(an 8B-class decoder, an MoE, tensor parallelism, ZeRO-3). Measurements are appended to a
JSONL file as they finish and a rerun resumes (a measurement does not depend on the cost
model); the table and ``--out`` (JSON) are recomputed from the current model every time.

The fitting split is where the profile's rules were read (XLA's buffer assignment of those
configs, `capopt.validation.liveset`); the held-out split's cards share no shape with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capopt._hardware import get_hardware  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import Budget, Config, Scenario, Workload, LoRA, stable_text  # noqa: E402
from capopt.validation.tiers import devices_needed  # noqa: E402
from _random_cases import (add_worker_args, by_feature, measure, pct, print_splits,  # noqa: E402
                           summary, xla_gpu_refusal)
from capopt.validation.random_configs import (EXTRA_STYLES, STYLES, Case, describe,  # noqa: E402
                                              draw_cases, features)

RESULTS = ROOT / "benchmarks" / "results"
TARGETS = {"median": 0.02, "p90": 0.05, "worst": 0.08, "feature_median": 0.04}
GROUPS = ("family", "optimizer", "clipping", "grad_accum", "precision", "remat", "flash",
          "layout", "tied", "attention", "lora")


def full_size_cases() -> list[Case]:
    """Configs of shipped cards, compiled whole (nothing is allocated)."""
    from capopt._cards import load_card
    hw = get_hardware("h100-sxm-80gb")
    rt = get_profile("xla-gpu")
    C = Config
    rows = [  # card, seq, precision, optimizer, clip, count, config, lora
        ("llama-3-8b", 2048, "bf16-mixed", "adamw", True, 8,
         C(micro_batch=1, dp=8, zero_stage=3, remat="full"), None),
        ("llama-3-8b", 4096, "bf16-mixed", "adamw", True, 8,
         C(micro_batch=1, dp=2, tp=4, zero_stage=1, remat="full", sequence_parallel=True), None),
        ("mistral-7b", 2048, "bf16", "adamw", False, 4,
         C(micro_batch=2, dp=4, zero_stage=3, remat="selective"), None),
        ("llama-2-7b", 2048, "bf16-mixed", "adamw", False, 1,
         C(micro_batch=4, remat="full"), LoRA(rank=16, targets=("attn", "mlp"), base_bits=4)),
        ("gpt2-1.5b", 1024, "bf16-mixed", "adamw", True, 1,
         C(micro_batch=4, remat="selective"), None),
        ("mixtral-8x7b", 1024, "bf16-mixed", "adamw", True, 8,
         C(micro_batch=1, dp=8, ep=8, zero_stage=3, remat="full"), None),
        ("llama-2-13b", 2048, "bf16-mixed", "sgd", False, 8,
         C(micro_batch=1, grad_accum=2, dp=8, zero_stage=3, remat="full"), None),
        ("vit-l16", 197, "bf16-mixed", "adamw", True, 4,
         C(micro_batch=32, dp=4, zero_stage=2, remat="none", flash_attention=False), None),
    ]
    out = []
    for i, (card, seq, prec, opt, clip, count, cfg, lora) in enumerate(rows):
        m = load_card(card)
        wl = Workload(seq_len=seq, global_batch=cfg.micro_batch * cfg.grad_accum * cfg.dp,
                      precision=prec, optimizer=opt, grad_clip=clip, lora=lora)
        sc = Scenario(name=f"full-{i}-{card}", model=m, hardware=hw, count=count,
                      per_node=count, workload=wl, budget=Budget(vram_bytes=hw.memory_bytes),
                      runtime=rt)
        out.append(Case(name=sc.name, shape=card, split="full-size", scenario=sc, config=cfg,
                        features=features(sc, cfg, card)))
    return out


def measurement_key(case: Case) -> str:
    """What a measurement depends on (not the cost model): card, workload, target, config."""
    from capopt.validation.models import CHUNKED_REVISION, MOE_REVISION, SP_LAYOUT_REVISION
    sc = case.scenario
    parts = (sc.model, sc.workload, sc.hardware.name, sc.count,
             json.dumps(case.config.key_dict(), sort_keys=True))
    if case.config.flash_attention and CHUNKED_REVISION > 1:
        # compiled with the chunked stand-in for a flash kernel: which revision of it
        # (revision 1, the first, left the keys as they were)
        parts += (f"chunked attention revision {CHUNKED_REVISION}",)
    if sc.model.is_moe and MOE_REVISION > 1:
        # compiled with grouped dispatch (revision 1, every device routing the whole batch,
        # left the keys as they were)
        parts += (f"moe dispatch revision {MOE_REVISION}",)
    if case.config.sequence_parallel and case.config.tp > 1 and SP_LAYOUT_REVISION > 1:
        # compiled with Megatron-LM's layout inside the block (revision 1, the stream alone
        # constrained, left the keys as they were)
        parts += (f"sequence-parallel layout revision {SP_LAYOUT_REVISION}",)
    from capopt._inventory import lora_quant_key
    parts += lora_quant_key(sc.model, sc.workload.lora)
    text = stable_text(parts)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def no_lhs_key(case: Case) -> str:
    """The key of ``case`` compiled without XLA's latency-hiding scheduler."""
    return measurement_key(case) + ":no-latency-hiding"


def predicted_peak(case: Case, rec: dict) -> dict:
    from capopt.validation.predict import predicted_terms
    m = rec["measured"]
    return predicted_terms(case.config, case.scenario, input_bytes=m["input_bytes"],
                           output_leaves=int(rec["details"].get("output_leaves", 0)),
                           compiler_options=rec["details"].get("compiler_options"))


def target_checks(splits: dict, groups: dict) -> dict:
    """The held-out figures the targets are set on: median, p90 and worst |error|, and the
    largest median of a feature value with at least 3 points."""
    held = splits.get("heldout", {})
    return {"median": held.get("median_abs"), "p90": held.get("p90_abs"),
            "worst": held.get("worst_abs"),
            "feature_median": max((s["median_abs"] for vals in groups.values()
                                   for s in vals.values() if s.get("n", 0) >= 3), default=None)}


def targets_line(checks: dict) -> str:
    return "  ".join(f"{k} {pct(v)} {'<=' if v is not None and v <= TARGETS[k] else '>'} "
                     f"{100 * TARGETS[k]:.0f}%" for k, v in checks.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    add_worker_args(ap)
    ap.add_argument("--full-size", action="store_true", help="add configs of shipped cards")
    ap.add_argument("--styles", default="",
                    help="comma-separated card styles to draw instead of the default ones "
                         f"(also: {', '.join(EXTRA_STYLES)}); they add _<styles> to the "
                         "default file names")
    ap.add_argument("--measurements", default=None,
                    help="JSONL of measurements (default results/memory_random[_<styles>].jsonl)")
    ap.add_argument("--out", default=None,
                    help="JSON summary (default results/memory_random[_<styles>].json)")
    ap.add_argument("--no-measure", action="store_true",
                    help="only recompute the predictions for what is already measured")
    args = ap.parse_args(argv)
    styles = tuple(x for x in args.styles.split(",") if x) or STYLES
    unknown = [x for x in styles if x not in STYLES + EXTRA_STYLES]
    if unknown:
        print(f"error: --styles: unknown style {unknown[0]!r} (allowed: "
              f"{', '.join(STYLES + EXTRA_STYLES)})", file=sys.stderr)
        return 2
    stem = "memory_random" + ("" if styles == STYLES else "_" + "_".join(styles))
    args.measurements = args.measurements or str(RESULTS / f"{stem}.jsonl")
    args.out = args.out or str(RESULTS / f"{stem}.json")
    refused = None if args.no_measure else xla_gpu_refusal()
    if refused:
        return refused
    t0 = time.perf_counter()
    cases = draw_cases(args.cases, args.seed, styles=styles)
    if args.full_size:
        cases += full_size_cases()
    path = Path(args.measurements)
    path.parent.mkdir(parents=True, exist_ok=True)
    from capopt.validation.runner import load_results
    if args.no_measure:
        done = done_nolhs = {r["key"]: r for r in load_results(path) if r.get("status") == "ok"}
    else:
        done = measure(cases, path, tier="xla-gpu", key=measurement_key, jobs=args.jobs,
                       timeout_s=args.timeout)
        # the steps with collectives once more, without XLA's latency-hiding scheduler
        done_nolhs = measure([c for c in cases if devices_needed(c.config) > 1], path,
                             tier="xla-gpu", key=no_lhs_key, jobs=args.jobs,
                             timeout_s=args.timeout, options={"latency_hiding": False})
    failed = [c for c in cases if measurement_key(c) not in done]
    points = []
    for case in cases:
        rec = done.get(measurement_key(case))
        if rec is None:
            continue
        p = predicted_peak(case, rec)
        m = rec["measured"]
        err = (p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"]
        if devices_needed(case.config) == 1:   # no collective: the latency-hiding scheduler
            calm = m["peak_bytes"]               # does not run (`capopt.validation.xla_log`)
        else:
            other = done_nolhs.get(no_lhs_key(case))
            calm = other["measured"]["peak_bytes"] if other else None
        points.append({"case": case.name, "split": case.split, "describe": describe(case),
                       "features": case.features, "measured_peak_bytes": m["peak_bytes"],
                       "measured_temp_bytes": m["temp_bytes"],
                       "no_lhs_peak_bytes": calm,
                       "predicted_peak_bytes": p["peak_bytes"],
                       "predicted_temp_bytes": p["temp_bytes"], "error": err,
                       "error_no_lhs": (p["peak_bytes"] - calm) / calm if calm else None,
                       "compiler_options": rec["details"].get("compiler_options", {})})
    splits, splits_nolhs = {}, {}
    for split in ("heldout", "fit", "full-size"):
        errs = [q["error"] for q in points if q["split"] == split]
        if errs:
            splits[split] = summary(errs)
        errs = [q["error_no_lhs"] for q in points
                if q["split"] == split and q["error_no_lhs"] is not None]
        if errs:
            splits_nolhs[split] = summary(errs)
    groups = by_feature(points, GROUPS)
    groups_nolhs = by_feature([dict(q, error=q["error_no_lhs"]) for q in points
                               if q["error_no_lhs"] is not None], GROUPS)
    print(f"\nPeak bytes per device, predicted (xla-gpu profile) against XLA's buffer assignment "
          f"(xla-gpu tier, {get_hardware('h100-sxm-80gb').name})\n")
    print_splits(splits)
    if splits_nolhs:
        print("\nthe same against XLA's peak without its latency-hiding scheduler (which spends "
              "the card's spare\nmemory on overlapping collectives; one-device steps have none "
              "and are the same compile):\n")
        print_splits(splits_nolhs)
    print("\nheld-out, by feature: against the compiled peak | without latency hiding")
    print(f"{'group':<12} {'value':<16} {'n':>4} {'median':>7} {'p90':>7} {'worst':>7}  |"
          f"{'n':>4} {'median':>7} {'p90':>7} {'worst':>7}")
    for g, vals in groups.items():
        for v, s in vals.items():
            if s["n"]:
                t = groups_nolhs.get(g, {}).get(v, {"n": 0})
                other = (f"{t['n']:>4} {pct(t['median_abs']):>7} {pct(t['p90_abs']):>7} "
                         f"{100 * t['worst_signed']:+6.1f}%" if t["n"] else f"{0:>4}")
                print(f"{g:<12} {v:<16} {s['n']:>4} {pct(s['median_abs']):>7} "
                      f"{pct(s['p90_abs']):>7} {100 * s['worst_signed']:+6.1f}%  |{other}")
    worst = sorted((q for q in points if q["split"] == "heldout"), key=lambda q: -abs(q["error"]))
    print("\nworst held-out cases:")
    for q in worst[:10]:
        print(f"  {100 * q['error']:+6.1f}%  {q['describe']}")
    if failed:
        print(f"\n{len(failed)} case(s) not measured: "
              + ", ".join(c.name for c in failed[:10]))
    checks, checks_nolhs = target_checks(splits, groups), target_checks(splits_nolhs, groups_nolhs)
    print("\ntargets (held-out): " + targets_line(checks))
    if splits_nolhs.get("heldout"):
        print("targets (held-out, without latency hiding): " + targets_line(checks_nolhs))
    no_calm = [q["case"] for q in points if q["error_no_lhs"] is None]
    if no_calm:
        print(f"{len(no_calm)} case(s) with collectives not compiled without latency hiding: "
              + ", ".join(no_calm[:10]))
    out = {"tier": "xla-gpu", "gpu": "h100-sxm-80gb", "profile": "xla-gpu",
           "cases": args.cases, "seed": args.seed, "styles": list(styles), "splits": splits,
           "by_feature": groups, "splits_no_lhs": splits_nolhs,
           "by_feature_no_lhs": groups_nolhs, "checks_no_lhs": checks_nolhs,
           "no_lhs_not_measured": no_calm,
           "targets": TARGETS, "checks": checks, "points": points,
           "not_measured": [c.name for c in failed], "total_s": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
