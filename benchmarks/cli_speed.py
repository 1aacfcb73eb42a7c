"""How long the command line takes, as whole processes, against importing JAX in the same run.

    python benchmarks/cli_speed.py [--runs 5] [--out benchmarks/results/cli_speed.json]

Rows (each the median and the slowest of ``--runs`` fresh processes, wall clock):
``import jax``; ``capopt plan`` cold (an empty compilation cache) and cached (the cache a first
run left); ``capopt optimize`` cached; the error path (a scenario with a bad field: exit 2).
Ratios are to ``import jax`` of the same run, so a slower or busier machine moves the
seconds, not the comparison. Targets: cached plan no slower than cached optimize; the error
path faster than importing JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "gpt2-124m-rtx4090"
BAD = '[model]\ncard = "gpt2-124m"\n[hardware]\ngpu = "rtx-4090-24gb"\n[training]\nseq_len = -1\n'


def _time(cmd: list[str], env: dict, expect: int = 0) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != expect:
        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr[-500:]}")
    return wall


def _row(name, cmd, runs, env_for, expect=0):
    times = [_time(cmd, env_for(i), expect) for i in range(runs)]
    return {"row": name, "median_s": statistics.median(times), "max_s": max(times),
            "runs": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cli_speed.json"))
    args = ap.parse_args(argv)
    py = sys.executable
    capopt = [py, "-m", "capopt.cli"]
    base = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cache = tempfile.mkdtemp(prefix="capopt-bench-cache-")
    cached = lambda i: {**base, "CAPOPT_CACHE_DIR": cache}  # noqa: E731
    cold = lambda i: {**base, "CAPOPT_CACHE_DIR": tempfile.mkdtemp(prefix="capopt-cold-")}  # noqa: E731
    bad = Path(tempfile.mkdtemp()) / "bad.toml"
    bad.write_text(BAD)
    plan = [*capopt, "plan", SCENARIO, "--set", "micro_batch=4"]
    opt = [*capopt, "optimize", SCENARIO]
    _time(plan, cached(0))                  # fill the cache (programs are written at exit)
    _time(opt, cached(0))
    rows = [_row("python -c 'import jax'", [py, "-c", "import jax"], args.runs, cached),
            _row("capopt plan, cold", plan, args.runs, cold),
            _row("capopt plan, cached", plan, args.runs, cached),
            _row("capopt optimize, cached", opt, args.runs, cached),
            _row("error path (bad training.seq_len)", [*capopt, "plan", str(bad)], args.runs,
                 cached, expect=2)]
    ref = rows[0]["median_s"]
    for r in rows:
        r["ratio_to_import_jax"] = r["median_s"] / ref
    by = {r["row"]: r for r in rows}
    checks = {
        "cached plan <= cached optimize": by["capopt plan, cached"]["median_s"]
        <= by["capopt optimize, cached"]["median_s"],
        "error path < import jax": by["error path (bad training.seq_len)"]["median_s"] < ref,
    }
    print(f"{'row':<36} {'median':>8} {'slowest':>8} {'x import jax':>13}")
    for r in rows:
        print(f"{r['row']:<36} {r['median_s']:7.2f}s {r['max_s']:7.2f}s "
              f"{r['ratio_to_import_jax']:12.2f}x")
    for k, v in checks.items():
        print(f"{k}: {'yes' if v else 'NO'}")
    Path(args.out).write_text(json.dumps({"runs": args.runs, "rows": rows, "checks": checks},
                                         indent=1))
    print(f"wrote {args.out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
