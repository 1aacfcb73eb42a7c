"""Live-tensor peak on configs drawn at random, judged by the torch tier (PyTorch, fake tensors).

    python benchmarks/torch_random.py [--cases 60] [--jobs 2] [--no-measure] [--lora | --tp]

Draws ``--cases`` configs with `capopt.validation.random_configs.draw_torch_cases` (fixed
seed; half on one device, half on 8 ranks as FSDP2 ZeRO-2 or ZeRO-3; card shapes split into
fitting and held-out by a hash of their sizes), runs each as a real PyTorch training step on
fake tensors (the torch tier, one process per case, as ``capopt validate --tier torch`` does)
and compares the ``pytorch-eager`` profile's predicted peak of live tensor bytes (its memory
model with no context, workspace or fragmentation) with the peak the tier counted, whole and
by part (parameters, optimizer state, gradients, the rest). It also times one tier run of a
tiny card and of an 8B-class card (``llama-3-8b``, seq 2048, micro-batch 1, full remat).
``--lora``: every case fine-tunes with LoRA or QLoRA on one device instead (its own draw, its
own results files); ``--lora --lora-targets single``: the same with adapters on single
matrices (q and v, as PEFT's default for Llama-family models; q, k and v; the MLP alone; two
mixed sets; `random_configs.LORA_SINGLE_SETS`), results ``torch_lora_single``. ``--tp``:
every case is tensor-parallel alone (tp 2 or 4 on a fake group of that many ranks; half
the cards with a vocabulary padded to a multiple of 128, so that the embedding and head are
split over it), its own results files too; ``--tp --tp-dp 2``: the
same on a 2 x tp mesh, FSDP2 over the data-parallel dimension (torchtitan's 2-D);
``--tp --tp-sp``: tensor parallelism with sequence parallelism. ``--loss fused-linear``: the
same draw with Liger's fused linear cross-entropy (or ``fused``: one kernel on the
compute-dtype logits; ``chunked``: torchtune's chunked loss), results
``torch_random_fused-linear``. ``--activation-offload``: the
same draw with TRL's / torchtune's activation offloading, results ``torch_random_offload``.

Measurements go to a JSONL file as they finish and a rerun resumes (a measurement does not
depend on the cost model); the tables and ``--out`` (JSON) are recomputed from the current
model every time. Needs torch (``pip install 'capopt[torch]'``).
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

from _random_cases import (add_worker_args, by_feature, measure, pct, print_splits,  # noqa: E402
                           summary)
from capopt._specs import stable_text  # noqa: E402
from capopt.validation.random_configs import Case, describe, draw_torch_cases  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGETS = {"median": 0.03, "worst": 0.10}
GROUPS = ("layout", "style", "optimizer", "clipping", "grad_accum", "precision", "remat",
          "flash", "tied", "attention")
PARTS = ("params_bytes", "optimizer_bytes", "grads_bytes", "rest_bytes")


def measurement_key(case: Case) -> str:
    from capopt.validation.torch_models import TORCH_TIER_REVISION
    sc = case.scenario
    parts = ("torch", sc.model, sc.workload, json.dumps(case.config.key_dict(), sort_keys=True))
    if sc.runtime.name != "pytorch-eager":
        # the runtime changes the step the tier runs (torchtitan: FSDP2's mixed precision
        # under ZeRO-2/3, its per-op selective checkpointing)
        parts += (f"runtime {sc.runtime.name}",)
    if sc.model.norm_type == "rmsnorm" and TORCH_TIER_REVISION > 1:
        # measured with the fused RMSNorm backward (revision 2); revision 1 left the keys as
        # they were, and a card without RMSNorm measures the same under both
        parts += (f"torch tier revision {TORCH_TIER_REVISION}",)
    if (sc.runtime.coeff("loss_in_forward") >= 0.5 and sc.workload.loss == "float32"
            and case.config.tp == 1):
        # the float32 loss inside the forward pass, as Hugging Face's models run it
        parts += ("loss inside the forward pass",)
    from capopt.validation.torch_step import fsdp_mixed_precision
    if (fsdp_mixed_precision(sc, case.config)
            and sc.runtime.coeff("fsdp_reduce_compute_dtype") >= 0.5):
        # FSDP's mixed precision reducing in the compute dtype (Accelerate's, the hf runtime's
        # since its ZeRO-2/3 steps were first measured under autocast alone)
        parts += ("FSDP mixed precision, reductions in the compute dtype",)
    from capopt._inventory import lora_quant_key
    parts += lora_quant_key(sc.model, sc.workload.lora)
    text = stable_text(parts)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def timing_cases() -> list[tuple[str, Case]]:
    """A tiny card and an 8B-class card, one tier run each (seconds per run)."""
    from capopt._cards import load_card
    from capopt._hardware import get_hardware
    from capopt._runtime import get_profile
    from capopt._specs import Budget, Config, Scenario, Workload
    from capopt.validation.random_configs import features
    hw, rt = get_hardware("h100-sxm-80gb"), get_profile("pytorch-eager")
    out = []
    for card, seq, cfg in (("gpt2-124m", 1024, Config(micro_batch=4)),
                           ("llama-3-8b", 2048, Config(micro_batch=1, remat="full"))):
        m = load_card(card)
        sc = Scenario(name=f"timing-{card}", model=m, hardware=hw, count=1, per_node=1,
                      workload=Workload(seq_len=seq, global_batch=cfg.micro_batch,
                                        precision="bf16-mixed", optimizer="adamw"),
                      budget=Budget(vram_bytes=hw.memory_bytes), runtime=rt)
        out.append((card, Case(name=sc.name, shape=card, split="timing", scenario=sc,
                               config=cfg, features=features(sc, cfg, "timing"))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    add_worker_args(ap)
    ap.add_argument("--lora", action="store_true",
                    help="LoRA and QLoRA cases on one device (results: torch_lora.json[l])")
    ap.add_argument("--lora-targets", default="groups", choices=["groups", "single"],
                    help="with --lora: the target sets drawn: attention / attention and MLP "
                         "(groups), or single-matrix sets such as q and v (single; results: "
                         "torch_lora_single.json[l])")
    ap.add_argument("--lora-dropout", action="store_true",
                    help="with --lora: PEFT's adapter dropout on every case, 0.05 or 0.1 "
                         "(results: torch_lora_dropout*.json[l])")
    ap.add_argument("--tp", action="store_true",
                    help="tensor-parallel cases (tp 2 or 4, dp 1; results: torch_tp.json[l])")
    ap.add_argument("--tp-dp", type=int, default=1,
                    help="with --tp: FSDP2 over this many data-parallel ranks too (2-D; "
                         "results: torch_tp2d.json[l] for 2)")
    ap.add_argument("--tp-sp", action="store_true",
                    help="with --tp: sequence parallelism too, on cards without learned "
                         "positions (results: torch_tp_sp.json[l])")
    ap.add_argument("--optimizer-in-backward", action="store_true",
                    help="the same draw with each parameter stepped in the backward pass "
                         "(training.optimizer_in_backward): no clipping, one micro-batch a "
                         "step (the batch shrunk to it), fp16-mixed draws left out")
    ap.add_argument("--loss", default="float32",
                    choices=["float32", "fused", "fused-linear", "chunked"],
                    help="the same draw with this training.loss (fused-linear: Liger's fused "
                         "linear cross-entropy, chunked: torchtune's chunked one, both tp 1; "
                         "results: torch_random_<loss>.json[l])")
    ap.add_argument("--activation-offload", action="store_true",
                    help="the same draw with activation offloading (training.activation_"
                         "offload; results: torch_random_offload.json[l])")
    ap.add_argument("--runtime", default="pytorch-eager",
                    choices=["pytorch-eager", "torchtitan", "hf", "torchtune"],
                    help="the runtime profile that predicts and that the tier runs "
                         "(torchtitan: results torch_random_torchtitan.json[l])")
    ap.add_argument("--measurements", default=None,
                    help="default: benchmarks/results/torch_random.jsonl (torch_lora.jsonl, "
                         "torch_tp*.jsonl; a seed other than 0 adds _seedN: "
                         "torch_random_seed3.jsonl)")
    ap.add_argument("--out", default=None,
                    help="default: as --measurements, .json")
    ap.add_argument("--no-measure", action="store_true",
                    help="only recompute the predictions for what is already measured")
    args = ap.parse_args(argv)
    single = args.lora and args.lora_targets == "single"
    stem = (f"torch_lora{'_single' if single else ''}"
            f"{'_dropout' if args.lora_dropout else ''}" if args.lora else
            f"torch_tp{'' if args.tp_dp == 1 else f'{args.tp_dp}d'}"
            f"{'_sp' if args.tp_sp else ''}" if args.tp else
            "torch_random") + ("_oib" if args.optimizer_in_backward else "") + (
        f"_{args.loss}" if args.loss != "float32" else "") + (
        "_offload" if args.activation_offload else "") + (
        f"_seed{args.seed}" if args.seed else "") + (
        f"_{args.runtime}" if args.runtime != "pytorch-eager" else "")
    args.measurements = args.measurements or str(RESULTS / f"{stem}.jsonl")
    args.out = args.out or str(RESULTS / f"{stem}.json")
    groups_of = GROUPS + (("lora", "lora_rank", "lora_targets") if args.lora else ()) + (
        ("lora_dropout",) if args.lora_dropout else ()) + (
        ("vocab",) if args.tp else ()) + (("sequence_parallel",) if args.tp_sp else ())
    from capopt.validation.predict import judged_torch_measurement, predicted_torch_terms
    from capopt.validation.runner import load_results
    from capopt.validation.tiers import torch_available
    ok, why = torch_available()
    if not ok and not args.no_measure:
        print(f"error: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    from capopt.validation.random_configs import LORA_SINGLE_SETS, LORA_TARGET_SETS
    cases = draw_torch_cases(args.cases, args.seed, lora=args.lora,
                             tp=(2, 4) if args.tp else (), tp_dp=args.tp_dp,
                             tp_sp=args.tp_sp,
                             lora_targets=LORA_SINGLE_SETS if single else LORA_TARGET_SETS,
                             lora_dropout=(0.05, 0.1) if args.lora_dropout else ())
    if args.optimizer_in_backward and args.runtime not in ("pytorch-eager", "torchtitan",
                                                           "torchtune"):
        print(f"error: --runtime {args.runtime}: its step updates after the backward pass "
              "(--optimizer-in-backward takes pytorch-eager or torchtitan)", file=sys.stderr)
        return 2
    if args.optimizer_in_backward:
        # (the same draw: no clipping, one micro-batch a step; fp16's loss scaler needs every
        # gradient before the step, so fp16-mixed draws are left out)
        kept = [c for c in cases if c.scenario.workload.precision != "fp16-mixed"]
        print(f"{len(kept)} of {len(cases)} drawn configs outside fp16-mixed, stepped in the "
              "backward pass")
        cases = [dataclasses.replace(
            c, config=c.config.replace(grad_accum=1),
            features={**c.features, "clipping": "no clip", "grad_accum": "accum 1"},
            scenario=c.scenario.replace(workload=dataclasses.replace(
                c.scenario.workload, grad_clip=False, optimizer_in_backward=True,
                global_batch=c.config.micro_batch * c.config.dp))) for c in kept]
    if args.loss != "float32":
        if args.tp and args.loss in ("fused-linear", "chunked"):
            print(f"error: --loss {args.loss}: the {args.loss} loss runs on the whole head "
                  "(tp 1), not with --tp", file=sys.stderr)
            return 2
        if args.activation_offload and args.loss == "chunked":
            print("error: --loss chunked: not priced with --activation-offload",
                  file=sys.stderr)
            return 2
        cases = [dataclasses.replace(c, features={**c.features, "loss": args.loss},
                                     scenario=c.scenario.replace(workload=dataclasses.replace(
                                         c.scenario.workload, loss=args.loss)))
                 for c in cases]
    if args.activation_offload:
        if args.tp:
            print("error: --activation-offload: the torch tier offloads activations without "
                  "tensor parallelism, not with --tp", file=sys.stderr)
            return 2
        cases = [dataclasses.replace(c, features={**c.features, "offload": "activations"},
                                     scenario=c.scenario.replace(workload=dataclasses.replace(
                                         c.scenario.workload, activation_offload=True)))
                 for c in cases]
    if args.runtime != "pytorch-eager":
        from capopt._runtime import get_profile
        from capopt._specs import runtime_runs_config
        rt = get_profile(args.runtime)
        names = set(rt.precision_names)
        # (the same draw; the precisions the runtime trains in: torchtitan has no fp16-mixed)
        skipped = sum(c.scenario.workload.precision not in names for c in cases)
        cases = [dataclasses.replace(c, scenario=c.scenario.replace(runtime=rt)) for c in cases
                 if c.scenario.workload.precision in names]
        print(f"{len(cases)} of {len(cases) + skipped} drawn configs in precisions the "
              f"{args.runtime} profile prices ({', '.join(sorted(names))})")
        # (torchtune checkpoints whole blocks: the draw's selective configs are left out)
        kept = [c for c in cases if runtime_runs_config(rt, c.config)]
        if len(kept) < len(cases):
            print(f"{len(kept)} of {len(cases)} in layouts the {args.runtime} runtime runs "
                  "(no selective recomputation)")
        cases = kept
    timing = [] if (args.lora or args.tp or args.runtime != "pytorch-eager"
                    or args.optimizer_in_backward or args.loss != "float32"
                    or args.activation_offload) else timing_cases()
    path = Path(args.measurements)
    path.parent.mkdir(parents=True, exist_ok=True)
    every = cases + [c for _, c in timing]
    done = ({r["key"]: r for r in load_results(path) if r.get("status") == "ok"}
            if args.no_measure else
            measure(every, path, tier="torch", key=measurement_key, jobs=args.jobs,
                    timeout_s=args.timeout))
    failed = [c for c in cases if measurement_key(c) not in done]
    points = []
    for case in cases:
        rec = done.get(measurement_key(case))
        if rec is None:
            continue
        p = predicted_torch_terms(case.config, case.scenario)
        m = rec["measured"]
        err = (p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"]
        # the replay of the allocator the runtime runs (``expandable_segments``: torchtitan)
        replayed = judged_torch_measurement(m, case.scenario.runtime)["reserved_bytes"]
        res_err = (p["reserved_bytes"] - replayed) / replayed
        dynamic = m["peak_bytes"] - m["params_bytes"] - m["optimizer_bytes"]
        feats = dict(case.features)
        lora = case.scenario.workload.lora
        if lora is not None:
            feats.update(lora_rank=lora.rank, lora_targets="+".join(lora.targets))
            if args.lora_dropout:
                feats["lora_dropout"] = lora.dropout
        feats["vocab"] = ("split over tp" if case.scenario.model.vocab_size % case.config.tp == 0
                          else "replicated")
        points.append({"case": case.name, "split": case.split, "describe": describe(case),
                       "features": feats, "measured": m, "error": err,
                       "reserved_error": res_err,
                       "replayed_slack": m["reserved_bytes"] / m["peak_bytes"] - 1.0,
                       "replayed_slack_expandable": (m["reserved_expandable_bytes"]
                                                     / m["peak_bytes"] - 1.0),
                       # the replayed slack per byte of dynamic (non-parameter, non-state)
                       # tensors at the peak: what the profile's fragmentation + cached_slack
                       # stand for
                       "slack_per_dynamic": (replayed - m["peak_bytes"]) / max(dynamic, 1),
                       "predicted": {k: p[k] for k in ("peak_bytes", *PARTS, "reserved_bytes",
                                                       "device_bytes")},
                       "measured_phase": rec["details"].get("peak_phase"),
                       "predicted_phase": int(p["peak_phase"]),
                       "wall_s": rec.get("wall_s")})
    splits = {s: summary([q["error"] for q in points if q["split"] == s])
              for s in ("heldout", "fit") if any(q["split"] == s for q in points)}
    groups = by_feature(points, groups_of)
    parts = {}
    for k in PARTS:
        errs = [(q["predicted"][k] - q["measured"][k]) / q["measured"]["peak_bytes"]
                for q in points if q["split"] == "heldout"]
        parts[k] = summary(errs)
    print(f"\nLive tensor bytes at the peak of one step, predicted ({args.runtime} profile) "
          "against the torch tier\n")
    print_splits(splits)
    print("\nheld-out, error of each part as a share of the measured peak:")
    for k, s in parts.items():
        if s["n"]:
            print(f"  {k:<16} median {pct(s['median_abs'])}  worst {100 * s['worst_signed']:+6.1f}%")
    print("\nheld-out, by feature:")
    print(f"{'group':<12} {'value':<16} {'n':>4} {'median':>7} {'p90':>7} {'worst':>7}")
    for g, vals in groups.items():
        for v, s in vals.items():
            if s["n"]:
                print(f"{g:<12} {v:<16} {s['n']:>4} {pct(s['median_abs']):>7} "
                      f"{pct(s['p90_abs']):>7} {100 * s['worst_signed']:+6.1f}%")
    worst = sorted((q for q in points if q["split"] == "heldout"), key=lambda q: -abs(q["error"]))
    print("\nworst held-out cases:")
    for q in worst[:8]:
        print(f"  {100 * q['error']:+6.1f}%  {q['describe']}  (peak in {q['measured_phase']})")
    held_pts = [q for q in points if q["split"] == "heldout"]
    fit_pts = [q for q in points if q["split"] == "fit"]
    allocator = {
        "allocator": ("expandable segments" if cases and cases[0].scenario.runtime.coeff(
            "expandable_segments") >= 0.5 else "default segments"),
        "profile_slack": (cases[0].scenario.runtime.coeff("fragmentation")
                          + cases[0].scenario.runtime.coeff("cached_slack")) if cases else None,
        "slack_per_dynamic_fit": summary([q["slack_per_dynamic"] for q in fit_pts]),
        "slack_per_dynamic_heldout": summary([q["slack_per_dynamic"] for q in held_pts]),
        "reserved_error": summary([q["reserved_error"] for q in held_pts]),
        "replayed_slack": summary([q["replayed_slack"] for q in held_pts]),
        "replayed_slack_expandable": summary([q["replayed_slack_expandable"]
                                              for q in held_pts]),
        "reserved_error_by_layout": {
            v: summary([q["reserved_error"] for q in held_pts
                        if q["features"]["layout"] == v])
            for v in sorted({q["features"]["layout"] for q in held_pts})},
    }
    if held_pts:
        a = allocator
        print("\nthe allocator layer (held-out): the caching allocator's rules replayed on each "
              "step's allocation sequence (two steps, the second's reserved)")
        print(f"  replayed reserved over the live peak: median "
              f"{pct(a['replayed_slack']['median_abs'])}, largest "
              f"{pct(a['replayed_slack']['worst_abs'])}; with expandable_segments median "
              f"{pct(a['replayed_slack_expandable']['median_abs'])}")
        fit, held = a["slack_per_dynamic_fit"], a["slack_per_dynamic_heldout"]
        fit_median = f"{fit['median_abs']:.3f}" if fit["n"] else "-"
        print(f"  slack per byte of dynamic tensors ({a['allocator']}): fit split median "
              f"{fit_median} (n={fit['n']}), held-out {held['median_abs']:.3f}; the "
              f"profile's fragmentation + cached_slack {a['profile_slack']:.3f}")
        print(f"  predicted reserved (fragmentation + cached slack) against replayed: median "
              f"{pct(a['reserved_error']['median_abs'])}, worst "
              f"{100 * a['reserved_error']['worst_signed']:+.1f}%")
        for v, sm in a["reserved_error_by_layout"].items():
            print(f"    {v:<12} n={sm['n']:<3} median {pct(sm['median_abs'])}  worst "
                  f"{100 * sm['worst_signed']:+.1f}%")
    times = {}
    for card, case in timing:
        rec = done.get(measurement_key(case))
        if rec is not None:
            pred = predicted_torch_terms(case.config, case.scenario)["peak_bytes"]
            meas = rec["measured"]["peak_bytes"]
            times[card] = {"wall_s": rec.get("wall_s"), "step_s": rec["details"].get("step_s"),
                           "params": rec["details"].get("params"), "peak_bytes": meas,
                           "predicted_peak_bytes": pred, "error": (pred - meas) / meas,
                           "describe": describe(case)}
    if times:
        print("\ntime per tier run (one process: import, build, one metered step):")
        for card, t in times.items():
            print(f"  {card:<12} {t['params'] / 1e9:6.2f} B params  {t['wall_s']:6.1f} s in the "
                  f"worker ({t['step_s']:.1f} s building and stepping); peak "
                  f"{t['peak_bytes'] / 2**30:.2f} GiB, predicted {100 * t['error']:+.1f}%")
    if failed:
        print(f"\n{len(failed)} case(s) not measured: " + ", ".join(c.name for c in failed[:10]))
    held = splits.get("heldout", {})
    checks = {"median": held.get("median_abs"), "worst": held.get("worst_abs")}
    print("\ntargets (held-out): " + "  ".join(
        f"{k} {pct(v)} {'<=' if v is not None and v <= TARGETS[k] else '>'} "
        f"{100 * TARGETS[k]:.0f}%" for k, v in checks.items()))
    import torch
    out = {"tier": "torch", "profile": args.runtime, "torch": torch.__version__,
           "cases": args.cases, "seed": args.seed, "splits": splits, "by_feature": groups,
           "parts": parts, "allocator": allocator, "targets": TARGETS, "checks": checks, "timing": times,
           "points": points, "not_measured": [c.name for c in failed],
           "total_s": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
