"""Published torchtitan runs, full size, through the torch tier: the oracle at the scale of the run.

For each torchtitan row of ``benchmarks/published/torchtitan.json`` with a published memory
figure that the torch tier can run (tensor parallelism 1, a precision the tier runs: not fp8),
the real PyTorch step of the full-size card runs on fake tensors over a fake process group
(`capopt.validation.torch_step.run_torch`), and three figures are set side by side:

- the live-tensor peak: capopt's allocated figure against the tier's count;
- the allocator: capopt's reserved figure against the caching allocator's rules replayed on
  the tier's allocation sequence (default segments and expandable segments, which torchtitan
  launches with);
- the published peak reserved memory of the run.

Usage: ``python benchmarks/torch_published.py`` prints the table and writes
``benchmarks/results/torch_published.json`` (about 20 s per row on a 2-core machine).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import published_runs as pr  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "torch_published.json"
GiB = 2 ** 30


def main(argv=None) -> int:
    from capopt.cost import estimate
    from capopt.validation.tiers import torch_available
    from capopt.validation.step import Unsupported
    from capopt.validation.torch_step import check_supported, run_torch
    ok, why = torch_available()
    if not ok:
        print(f"error: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    runs = pr.torchtitan_runs(json.loads((pr.DATA / "torchtitan.json").read_text()))
    rows = []
    print(f"{'run':<58} {'alloc capopt':>12} {'tier':>7} {'reserved capopt':>15} "
          f"{'replay':>7} {'expand.':>7} {'published':>9}  (GiB)")
    for run in runs:
        if run.scenario is None or not run.memory_gib:
            continue
        # a compiled run's step as the tier runs it: eagerly (capopt prices compile's memory
        # as the eager step's; what Inductor's partitioner saves is not modelled)
        sc = run.scenario.replace(workload=dataclasses.replace(run.scenario.workload,
                                                               compile=False))
        try:
            check_supported(sc, run.config)
        except Unsupported as e:
            rows.append({"row": run.label, "status": "not run", "why": str(e)})
            continue
        t1 = time.perf_counter()
        mem = estimate(run.config, sc).memory
        out = run_torch(sc, run.config)
        m = out["measured"]
        row = {"row": run.label, "status": "ok", "where": run.where,
               "published_reserved_gib": run.memory_gib,
               "capopt_allocated_gib": float(mem["allocated_bytes"]) / GiB,
               "capopt_reserved_gib": float(mem["reserved_bytes"]) / GiB,
               "tier_peak_gib": m["peak_bytes"] / GiB,
               "replayed_reserved_gib": m["reserved_bytes"] / GiB,
               "replayed_reserved_expandable_gib": m["reserved_expandable_bytes"] / GiB,
               "tier_s": time.perf_counter() - t1,
               "step": "eager" + (" (the run compiled)" if run.scenario.workload.compile else "")}
        row["allocated_error"] = (row["capopt_allocated_gib"] - row["tier_peak_gib"]) \
            / row["tier_peak_gib"]
        rows.append(row)
        print(f"{run.label[:58]:<58} {row['capopt_allocated_gib']:12.1f} "
              f"{row['tier_peak_gib']:7.1f} {row['capopt_reserved_gib']:15.1f} "
              f"{row['replayed_reserved_gib']:7.1f} "
              f"{row['replayed_reserved_expandable_gib']:7.1f} {run.memory_gib:9.1f}")
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        print(f"\n{len(skipped)} row(s) the tier does not run: "
              + "; ".join(sorted({r['why'] for r in skipped})))
    doc = {"rows": rows, "total_s": time.perf_counter() - t0}
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {RESULTS} in {doc['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
