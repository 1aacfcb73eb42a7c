"""Where the xla-gpu peak error comes from: XLA's live set at its peak against its buffer
assignment, and the prediction against both.

    python benchmarks/xla_liveness.py [--cases 200] [--jobs 2] [--split fit]

For each random config of `memory_random.py`'s draw (fixed seed) in ``--split`` (default the
fitting split: its live sets may be read; the held-out split's stay unexamined), compiles the
step for an H100 through the xla-gpu tier with ``--xla_dump_to``, reads the values live at the
peak of XLA's own schedule (`capopt.validation.liveset`) and splits the peak into:

``live``     the measured peak less the heap's packing: the arguments and outputs as XLA
             allocates them and, of its temporary allocation, the most bytes its own buffers
             hold at once over their live ranges, each loop's condition and body held at the
             while instruction at their own peak beside what is live across the loop, as XLA's
             heap simulator holds them (`capopt.validation.liveset.read_temp_heap`);
``packing``  the temporary allocation less those live bytes: buffers never live together
             that cannot share an offset;
``loops``    what the dump's flattened live ranges miss of that: they place a loop's body
             before its while instruction, where the values held across the loop are not
             live (the table's "loop bodies held at their loop"; "measured - the dump's peak
             live set" is the gap to the values the dump lists at its peak instruction,
             ``flat_live_bytes``, which the phase and block below are read from);
``other blocks``  the bytes of the values, live at the peak, that the backward pass (or a
             rebuild) of a block other than the peak's own made: a weight-gradient GEMM that
             XLA scheduled after that block's backward keeps its operands live, and a gradient
             waits there for its collective (the simulated step, one block's backward after
             another, holds none of them);
and compares the ``xla-gpu`` profile's prediction with each: ``error`` (against the measured
peak, as `memory_random.py`) and ``liveness error`` (against ``live``, what a model of XLA's
schedule without packing would be judged on). Where the peak falls in XLA's schedule is its
phase (the scope of the nested peak's instruction, inside the innermost loop body at its own
peak: forward, loss, backward or rebuild of block i, update), and ``other blocks`` are read
from the temporary values live there.

Which order XLA scheduled is recorded too: its memory scheduler (``DefaultMemoryScheduler`` in
``xla/hlo/transforms/simplifiers/hlo_memory_scheduler.cc``, the XLA of jaxlib 0.10.2) builds a
list, a depth-first and a post-order schedule of the step and keeps the one whose heap
simulation peaks lowest; its log names the choice and the three simulated peaks (read by the
xla-gpu tier, `capopt.validation.xla_log`). The depth-first order visits the step's outputs by their
upstream sizes and defers the weight-gradient GEMMs of the blocks it passes on the way, keeping
their inputs live: the table splits the errors by the order chosen.

Records are appended to a JSONL file as they finish (a rerun resumes); the table and ``--out``
(JSON) are recomputed from the current model every time. The dumps are deleted once read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = ROOT / "benchmarks" / "results"

CHILD = """
import json, sys
from capopt.validation.tiers import configure_jax_for, run_xla_gpu
configure_jax_for("xla-gpu")
from capopt.validation.random_configs import draw_cases
case = draw_cases(int(sys.argv[1]), int(sys.argv[2]))[int(sys.argv[3])]
out = run_xla_gpu(case.scenario, case.config)
json.dump(out, open(sys.argv[4], "w"), default=str)
"""


def measure_one(index: int, cases: int, seed: int, config, timeout_s: float) -> dict:
    """Compile case ``index`` with a dump; the measured terms and the peak's live set."""
    from capopt.validation.liveset import LiveValue, read_peak, read_temp_heap
    from capopt.validation.tiers import environment
    tmp = tempfile.mkdtemp(prefix="capopt-liveness-")
    try:
        env = environment("xla-gpu", config)
        env["XLA_FLAGS"] += f" --xla_dump_to={tmp}/dump --xla_dump_hlo_module_re=jit_step"
        res = os.path.join(tmp, "result.json")
        done = subprocess.run([sys.executable, "-c", CHILD, str(cases), str(seed), str(index),
                               res], env=env, capture_output=True, text=True,
                              timeout=timeout_s, cwd=str(ROOT))
        if done.returncode or not os.path.exists(res):
            tail = (done.stderr or "").strip().splitlines()
            return {"status": "error", "error": tail[-1] if tail else f"exit {done.returncode}"}
        out = json.load(open(res))
        peak = read_peak(Path(tmp) / "dump")
        heap = read_temp_heap(Path(tmp) / "dump")
        # the peak instruction's scope says its phase and block: the instruction of the
        # nested peak (inside the innermost loop body at its own peak), the values there
        where = LiveValue(name=heap.peak_at, index="", bytes=0, shape="",
                          op_name=heap.peak_op_name, parameter=False)
        sched = out["details"].get("xla_schedule") or {}
        peaks = {k: v / 2 ** 30 for k, v in sched.get("sequences_bytes", {}).items()}
        other = sum(v.bytes for v in heap.peak_values if v.phase in ("backward", "rebuild")
                    and v.block is not None and v.block != where.block)
        return {"status": "ok", "measured": out["measured"], "details": out["details"],
                "xla_scheduler": sched.get("order", "?"), "scheduler_peaks_gib": peaks,
                "live_bytes": peak.total_bytes,
                "peak_index": heap.peak_index, "schedule_length": peak.length,
                "peak_phase": where.phase, "peak_block": where.block,
                "peak_module": where.module, "other_blocks_bytes": other,
                "temp_heap": {"temp_bytes": heap.temp_bytes,
                              "flat_live_bytes": heap.flat_live_bytes,
                              "nested_live_bytes": heap.nested_live_bytes,
                              "loops": heap.loops, "peak_at": heap.peak_at}}
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timeout after {timeout_s:g} s"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def split_by(points: list[dict], title: str, group) -> dict:
    """The errors and packing of ``points`` by ``group(point)``; printed as a table."""
    from _random_cases import pct, summary
    out = {}
    for name in sorted({group(q) for q in points}):
        sel = [q for q in points if group(q) == name]
        out[name] = {"n": len(sel), "error": summary([q["error"] for q in sel]),
                     "liveness_error": summary([q["liveness_error"] for q in sel]),
                     "packing": summary([q["packing"] for q in sel])}
    print(f"\n{title:<18} {'n':>3} {'|error|':>8} {'|liveness|':>10} {'packing':>8}   "
          "(medians)")
    for name, s in out.items():
        print(f"{name:<18} {s['n']:>3} {pct(s['error']['median_abs']):>8} "
              f"{pct(s['liveness_error']['median_abs']):>10} "
              f"{pct(s['packing']['median_abs']):>8}")
    return out


def other_blocks(points: list[dict]) -> dict:
    """How many cases hold 3% or more of the peak in other blocks' backward values, one
    device against several (a collective to wait for), by the order XLA kept; printed."""
    from _random_cases import pct
    def count(sel):
        shares = [q["other_blocks"] for q in sel]
        return {"n": len(sel), "at_least_3pct": sum(x >= 0.03 for x in shares),
                "at_least_10pct": sum(x >= 0.10 for x in shares),
                "largest": max(shares, default=0.0)}
    groups = {"one device": [q for q in points if q["features"]["layout"] == "1 device"],
              "several devices": [q for q in points if q["features"]["layout"] != "1 device"]}
    out = {}
    print("\nother blocks' backward values live at the peak (share of the measured peak):")
    for name, sel in groups.items():
        out[name] = {"all": count(sel), "by_order": {
            o: count([q for q in sel if q["xla_scheduler"] == o])
            for o in sorted({q["xla_scheduler"] for q in sel})}}
        a = out[name]["all"]
        orders = ", ".join(f"{o} {c['at_least_3pct']} of {c['n']}"
                           for o, c in out[name]["by_order"].items())
        print(f"  {name:<16} {a['at_least_3pct']} of {a['n']} at 3% or more "
              f"({a['at_least_10pct']} at 10% or more, largest {pct(a['largest'])}); "
              f"by the order kept: {orders}")
    return out


def main(argv=None) -> int:
    from _random_cases import add_worker_args, pct, summary, xla_gpu_refusal
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="fit", choices=["fit", "heldout"])
    add_worker_args(ap)
    ap.add_argument("--limit", type=int, default=0, help="only the first N cases of the split")
    ap.add_argument("--measurements", default=str(RESULTS / "xla_liveness.jsonl"))
    ap.add_argument("--out", default=str(RESULTS / "xla_liveness.json"))
    args = ap.parse_args(argv)
    refused = xla_gpu_refusal()
    if refused:
        return refused
    from memory_random import measurement_key, predicted_peak
    from capopt.validation.random_configs import describe, draw_cases
    from capopt.validation.runner import _append, load_results
    t0 = time.perf_counter()
    cases = draw_cases(args.cases, args.seed)
    chosen = [(i, c) for i, c in enumerate(cases) if c.split == args.split]
    if args.limit:
        chosen = chosen[:args.limit]
    path = Path(args.measurements)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["key"]: r for r in load_results(path)
            if r.get("status") == "ok" and r.get("xla_scheduler", "?") != "?"
            and "peak_at" in r.get("temp_heap", {})}
    todo = [(i, c) for i, c in chosen if measurement_key(c) not in done]
    if todo:
        print(f"compiling {len(todo)} case(s) with a dump ({len(done)} already in "
              f"{path.name})", file=sys.stderr)

    def one(item):
        i, c = item
        rec = measure_one(i, args.cases, args.seed, c.config, args.timeout)
        rec.update(key=measurement_key(c), case=c.name, split=c.split, describe=describe(c))
        _append(path, rec)
        print(f"  [{time.perf_counter() - t0:6.0f} s] {rec['status']:<5} {rec['describe']}",
              file=sys.stderr)
        return rec

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for rec in pool.map(one, todo):
            if rec["status"] == "ok":
                done[rec["key"]] = rec
    points = []
    for _, c in chosen:
        rec = done.get(measurement_key(c))
        if rec is None:
            continue
        m = rec["measured"]
        p = predicted_peak(c, rec)["peak_bytes"]
        # measured peak = argument + output + temp - alias; of the temp allocation, the
        # heap's packing is what it holds beyond its buffers' live bytes with each loop held
        # as XLA holds it (`read_temp_heap`): the live peak is the measured peak less that
        h = rec["temp_heap"]
        packing = h["temp_bytes"] - h["nested_live_bytes"]
        live = m["peak_bytes"] - packing
        # the dump's own peak: the values live at one instruction of the flattened sequence
        # (the step's arguments included), which misses what a loop's caller holds
        flat = rec["live_bytes"]
        points.append({
            "case": c.name, "describe": rec["describe"], "features": c.features,
            "measured_peak_bytes": m["peak_bytes"], "live_bytes": live,
            "flat_live_bytes": flat, "loops": h["loops"], "predicted_peak_bytes": p,
            "packing": packing / m["peak_bytes"],
            "loop_reservation": (h["nested_live_bytes"] - h["flat_live_bytes"])
            / m["peak_bytes"],
            "flat_gap": (m["peak_bytes"] - flat) / m["peak_bytes"],
            "error": (p - m["peak_bytes"]) / m["peak_bytes"],
            "liveness_error": (p - live) / live,
            "peak_phase": rec["peak_phase"], "peak_block": rec["peak_block"],
            "peak_module": rec["peak_module"], "xla_scheduler": rec["xla_scheduler"],
            "scheduler_peaks_gib": rec["scheduler_peaks_gib"],
            "peak_position": rec["peak_index"] / max(rec["schedule_length"], 1),
            "other_blocks": rec["other_blocks_bytes"] / m["peak_bytes"]})
    packing = [q["packing"] for q in points]
    table = {"error (vs measured)": summary([q["error"] for q in points]),
             "liveness error (vs live peak)": summary([q["liveness_error"] for q in points]),
             "packing share of the peak": summary(packing),
             "loop bodies held at their loop": summary([q["loop_reservation"]
                                                        for q in points]),
             "measured - the dump's peak live set": summary([q["flat_gap"] for q in points])}
    print(f"\nxla-gpu tier, {args.split} split of the random draw (seed {args.seed}): "
          f"{len(points)} of {len(chosen)} cases\n")
    print(f"{'':<42} {'n':>4} {'median':>7} {'p90':>7} {'worst':>7} {'mean':>7}")
    for name, s in table.items():
        if s.get("n"):
            print(f"{name:<42} {s['n']:>4} {pct(s['median_abs']):>7} {pct(s['p90_abs']):>7} "
                  f"{100 * s['worst_signed']:+6.1f}% {100 * s['mean_signed']:+6.1f}%")
    by_layout = split_by(points, "layout", lambda q: q["features"]["layout"])
    by_scheduler = split_by(points, "order XLA kept", lambda q: q["xla_scheduler"])
    phases = {}
    for q in points:
        phases[q["peak_phase"]] = phases.get(q["peak_phase"], 0) + 1
    print("\nwhere XLA's peak falls: " + ", ".join(f"{k} {v}" for k, v in
                                                    sorted(phases.items())))
    other = other_blocks(points)
    out = {"tier": "xla-gpu", "gpu": "h100-sxm-80gb", "profile": "xla-gpu", "seed": args.seed,
           "cases": args.cases, "split": args.split, "summary": table,
           "by_layout": by_layout, "by_scheduler": by_scheduler, "peak_phases": phases,
           "other_blocks": other,
           "points": points,
           "not_measured": [c.name for _, c in chosen if measurement_key(c) not in done],
           "total_s": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
