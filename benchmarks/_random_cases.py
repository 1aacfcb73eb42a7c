"""What the random-config benchmarks share: their worker options, the xla-gpu tier's
availability check, measuring cases in worker processes (resumable JSONL) and summarising
signed relative errors. Imported by ``memory_random.py``, ``torch_random.py``,
``deepspeed_random.py``, ``xla_liveness.py``, ``xla_headroom.py`` and ``xla_splitk.py`` from
this folder."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from capopt.validation.random_configs import Case, describe


def add_worker_args(ap, timeout_s: float = 900.0, jobs: int = 2) -> None:
    """``--jobs`` (worker processes at once) and ``--timeout`` (seconds a case may take)."""
    ap.add_argument("--jobs", type=int, default=jobs)
    ap.add_argument("--timeout", type=float, default=timeout_s)


def xla_gpu_refusal() -> int | None:
    """2, after saying why on stderr, where the xla-gpu tier cannot run here; else None."""
    from capopt.validation.tiers import xla_gpu_available
    ok, why = xla_gpu_available()
    if ok:
        return None
    print(f"error: {why}", file=sys.stderr)
    return 2


def measure(cases: list[Case], path: Path, *, tier: str, key: Callable[[Case], str],
            jobs: int, timeout_s: float,
            describe_case: Callable[[Case], str] = describe,
            options: dict | None = None) -> dict[str, dict]:
    """Measure every case not already in ``path`` on ``tier`` (one worker process per case,
    ``jobs`` at once, with the tier's ``options``; each record appended as it finishes);
    returns the ok records by key."""
    from capopt.validation.runner import _append, _run_one, load_results
    done = {r["key"]: r for r in load_results(path) if r.get("status") == "ok"}
    todo = [c for c in cases if key(c) not in done]
    if not todo:
        return done
    print(f"measuring {len(todo)} case(s) on the {tier} tier ({len(done)} already in "
          f"{path.name})", file=sys.stderr)
    t0 = time.perf_counter()

    def one(case: Case) -> dict:
        job = {"tier": tier, "scenario": case.scenario, "config": case.config, "index": 0,
               "options": dict(options or {})}
        res = _run_one(job, timeout_s)
        rec = {"key": key(case), "case": case.name, "split": case.split,
               "describe": describe_case(case), "status": res.get("status", "error"),
               "measured": res.get("measured"), "details": res.get("details", {}),
               "error": res.get("error"), "wall_s": res.get("wall_s")}
        _append(path, rec)
        print(f"  [{time.perf_counter() - t0:6.0f} s] {rec['status']:<5} {rec['describe']}",
              file=sys.stderr)
        return rec

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for rec in pool.map(one, todo):
            if rec["status"] == "ok":
                done[rec["key"]] = rec
    return done


def summary(errors: list[float]) -> dict:
    """n, median / p90 / worst |error|, the worst's sign, the mean, how many under."""
    e = np.asarray(errors, float)
    if not e.size:
        return {"n": 0}
    a = np.abs(e)
    worst = int(np.argmax(a))
    return {"n": int(a.size), "median_abs": float(np.median(a)),
            "p90_abs": float(np.percentile(a, 90)), "worst_abs": float(a[worst]),
            "worst_signed": float(e[worst]), "mean_signed": float(e.mean()),
            "under_predicted": int((e < 0).sum())}


def by_feature(points: list[dict], groups) -> dict:
    """The held-out points' `summary` for each value of each feature group (values as text)."""
    held = [q for q in points if q["split"] == "heldout"]
    out = {}
    for g in groups:
        vals = sorted({str(q["features"][g]) for q in held})
        out[g] = {v: summary([q["error"] for q in held if str(q["features"][g]) == v])
                  for v in vals}
    return out


def print_splits(splits: dict) -> None:
    """The table of each split's `summary`: n, median, p90, worst, mean, how many under."""
    print(f"{'split':<10} {'n':>4} {'median':>7} {'p90':>7} {'worst':>7} {'mean':>7} {'under':>6}")
    for split, s in splits.items():
        print(f"{split:<10} {s['n']:>4} {pct(s['median_abs']):>7} {pct(s['p90_abs']):>7} "
              f"{100 * s['worst_signed']:+6.1f}% {100 * s['mean_signed']:+6.1f}% "
              f"{s['under_predicted']:>6}")


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"
