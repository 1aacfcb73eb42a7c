"""capopt's own answers, compiled: the shipped JAX scenarios' top candidates against XLA.

    python benchmarks/answers_compiled.py [--top 3] [--scenario NAME ...] [--no-lhs] [--jobs 1]

The random-config benchmark (`memory_random.py`) measures the memory model on small steps
drawn at random, most of them far below their card's memory. A user compiles something else:
the candidates `capopt optimize` returns, full size and close to the budget. This script takes
every shipped scenario whose runtime is ``xla-gpu`` (``scenarios/*.toml``), asks the optimiser
for its ``--top`` candidates exactly as ``capopt validate SCENARIO --tier xla-gpu --top N``
does (`capopt.validation.validate`), and compiles each for the scenario's GPU (the xla-gpu
tier: XLA's GPU buffer assignment, no GPU needed). It prints the predicted against the compiled
peak per device, the latency-hiding scheduler's use against its limit where it ran (Hopper
and Blackwell targets with collectives), and whether the compiled peak is within the card's
memory and within the budget's usable share (the runtime's CUDA context, which XLA's figures
leave out, comes on top of both). A candidate the tier cannot compile (pipeline parallelism:
the validation step has none) is listed as not run.

Nothing here is fitted: the profile's rules were written before these answers were compiled.
These are not drawn at random and not held out by card shape (the profile's notes cite
mechanisms read off cut-down Llama-3-8B and Mixtral-8x7B steps); they say how the answers
themselves fare. ``--no-lhs`` also compiles each answer without the latency-hiding
scheduler, where it ran (on Ampere and Ada targets, or on one device, it does not). Results
stream to a JSONL file (a rerun resumes); the table and ``--out`` (JSON) are rebuilt from
it. A compile that fails is recorded and the rest go on.

``--no-measure`` compiles nothing: it asks the optimiser for the candidates again and
judges the current model against the stored compile of each, matched by scenario, config
and scheduler whatever profile coefficients its record was keyed with (the runner keys a
measurement by every coefficient, but the compiled step reads only the profile's precision
dtypes and one coefficient, ``moe_capacity_factor``: `capopt.validation.step`; the match
does not check those, so after changing them measure again); a candidate with no stored
compile is listed as not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _random_cases import add_worker_args, pct, summary, xla_gpu_refusal  # noqa: E402

from capopt._scenario import load_scenario  # noqa: E402
from capopt._specs import Config  # noqa: E402
from capopt.validation.runner import (predicted_compiled_terms,  # noqa: E402
                                      without_latency_hiding)

RESULTS = ROOT / "benchmarks" / "results"
SCENARIOS = ROOT / "scenarios"
GiB = 2 ** 30


def xla_scenarios() -> list[str]:
    """The shipped scenarios whose runtime is the plain JAX step's (``xla-gpu``)."""
    names = []
    for p in sorted(SCENARIOS.glob("*.toml")):
        sc = load_scenario(str(p))
        if sc.runtime.name == "xla-gpu" and not sc.variants:
            names.append(p.stem)
    return names


def short(config: dict) -> str:
    c = config
    s = (f"mb{c['micro_batch']} ga{c['grad_accum']} dp{c['dp']} z{c['zero_stage']} "
         f"tp{c['tp']}")
    s += f" pp{c['pp']}" if c.get("pp", 1) > 1 else ""
    s += f" ep{c['ep']}" if c.get("ep", 1) > 1 else ""
    s += " sp" if c.get("sequence_parallel") else ""
    return s + f" {c['remat']}"


def last_compiles(path: str) -> dict:
    """The last xla-gpu record in ``path`` of each (scenario name, config, scheduler)."""
    last = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("tier") == "xla-gpu":
            config = json.dumps(Config(**rec["config"]).key_dict(), sort_keys=True)
            last[(rec.get("scenario"), config,
                  without_latency_hiding(rec.get("key", "")))] = rec
    return last


def stored(sc, top: int, no_lhs: bool, last: dict) -> list[dict]:
    """The stored compile of each of ``sc``'s ``top`` candidates (``--no-measure``): the last
    record of the same scenario (its records carry ``sc.name``), config and scheduler, or a
    "not measured" one."""
    from capopt.search import optimize
    out = []
    for cand in optimize(sc, top_k=top).candidates:
        key = json.dumps(cand.config.key_dict(), sort_keys=True)
        rec = last.get((sc.name, key, no_lhs))
        out.append(rec if rec is not None else
                   {"config": cand.config.key_dict(), "status": "not measured",
                    "error": "not measured: no stored compile of this candidate"})
    return out


def row(name: str, sc, rank: int, rec: dict) -> dict:
    status = rec["status"]
    if status == "error" and str(rec.get("error") or "").startswith("unsupported"):
        status = "unsupported"          # the tier has no such step (pipeline parallelism)
    out = {"scenario": name, "rank": rank, "config": rec["config"],
           "describe": short(rec["config"]), "status": status,
           "card_bytes": sc.hardware.memory_bytes, "usable_bytes": sc.budget.usable_bytes,
           "error_text": rec.get("error") if rec["status"] != "ok" else None}
    if rec["status"] != "ok":
        return out
    details = rec.get("details") or {}
    # (the prediction of the current model: a record resumed from the JSONL keeps the one
    # made when it was measured)
    p = predicted_compiled_terms(Config(**rec["config"]), sc, tier="xla-gpu",
                                 measured=rec["measured"], details=details)["peak_bytes"]
    p, m = float(p), rec["measured"]["peak_bytes"]
    sched = details.get("xla_schedule") or {}
    out.update(predicted_peak_bytes=p, measured_peak_bytes=m, error=p / m - 1.0,
               lhs_bytes=sched.get("lhs_bytes"), lhs_limit_bytes=sched.get("lhs_limit_bytes"),
               within_card=m <= sc.hardware.memory_bytes,
               within_budget=m <= sc.budget.usable_bytes,
               compile_s=details.get("compile_s"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", action="append", help="a shipped scenario (default: every "
                    "xla-gpu one)")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--no-lhs", action="store_true", help="also compile without XLA's "
                    "latency-hiding scheduler")
    add_worker_args(ap, timeout_s=3600.0, jobs=1)      # (full-size compiles: one at a time)
    ap.add_argument("--no-measure", action="store_true", help="compile nothing: judge the "
                    "current model against the stored compiles (see above)")
    ap.add_argument("--measurements", default=str(RESULTS / "answers_compiled.jsonl"))
    ap.add_argument("--out", default=str(RESULTS / "answers_compiled.json"))
    args = ap.parse_args(argv)
    refused = xla_gpu_refusal()
    if refused:
        return refused
    from capopt.validation import validate
    t0 = time.perf_counter()
    names = args.scenario or xla_scenarios()
    runs = [("compiled", {})] + ([("no-lhs", {"latency_hiding": False})] if args.no_lhs else [])
    rows = []
    last = last_compiles(args.measurements) if args.no_measure else {}
    for name in names:
        sc = load_scenario(name)
        for kind, options in runs:
            if kind == "no-lhs" and not any(r.get("lhs_bytes") for r in rows
                                            if r["scenario"] == name):
                continue            # the scheduler did not run: the same compile again
            if args.no_measure:
                records = stored(sc, args.top, kind == "no-lhs", last)
            else:
                rep = validate(sc, top_k=args.top, tier="xla-gpu", out=args.measurements,
                               timeout_s=args.timeout, jobs=args.jobs, options=options)
                records = rep.to_dict()["results"]
            for rank, rec in enumerate(records, 1):
                rows.append(dict(row(name, sc, rank, rec), compile=kind))

    print("\ncapopt's answers compiled for their GPU (xla-gpu tier): predicted peak per device "
          "against XLA's\n")
    print(f"{'scenario':<28} {'#':>1} {'config':<34} {'kind':<8} {'predicted':>9} "
          f"{'compiled':>9} {'error':>7} {'LHS / limit':>15} {'usable':>8} {'card':>6}")
    for r in rows:
        head = f"{r['scenario']:<28} {r['rank']:>1} {r['describe']:<34} {r['compile']:<8}"
        if r["status"] != "ok":
            text = r["error_text"] or ""
            if not text.startswith(r["status"]):    # ("unsupported: ..." says it already)
                text = f"{r['status']}: {text}"
            print(f"{head} {text[:90]}")
            continue
        lhs = (f"{r['lhs_bytes'] / GiB:6.1f}/{r['lhs_limit_bytes'] / GiB:.1f}"
               if r.get("lhs_bytes") is not None else "-")
        print(f"{head} {r['predicted_peak_bytes'] / GiB:>7.2f} G {r['measured_peak_bytes'] / GiB:>7.2f} G "
              f"{pct(r['error']):>7} {lhs:>15} {r['usable_bytes'] / GiB:>6.1f} G "
              f"{'fits' if r['within_card'] else 'OOM':>6}")
    summaries = {}
    kinds = [(kind, lambda r, kind=kind: r["compile"] == kind) for kind, _ in runs]
    if args.no_lhs:           # the same answers as the no-lhs compiles, for a like comparison
        kinds.insert(1, ("compiled, where the latency-hiding scheduler ran",
                         lambda r: r["compile"] == "compiled" and bool(r.get("lhs_bytes"))))
    for kind, keep in kinds:
        ok = [r for r in rows if keep(r) and r["status"] == "ok"]
        if not ok:
            continue
        s = summary([r["error"] for r in ok])
        s.update(within_card=sum(r["within_card"] for r in ok),
                 within_budget=sum(r["within_budget"] for r in ok),
                 failed=sum(keep(r) and r["status"] not in ("ok", "unsupported")
                            for r in rows),
                 unsupported=sum(keep(r) and r["status"] == "unsupported" for r in rows))
        summaries[kind] = s
        print(f"\n{kind}: {s['n']} answers, median |error| {pct(s['median_abs'])}, p90 "
              f"{pct(s['p90_abs'])}, worst {pct(s['worst_signed'])}, {s['under_predicted']} "
              f"under-predicted; compiled peak within the card {s['within_card']}/{s['n']}, "
              f"within the budget's usable share {s['within_budget']}/{s['n']}; "
              f"{s['failed']} failed, {s['unsupported']} not run (the tier has no such step)")
    out = {"tier": "xla-gpu", "top": args.top, "scenarios": names, "summary": summaries,
           "rows": rows, "total_s": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
