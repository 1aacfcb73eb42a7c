"""How XLA's compiled peak depends on the card's memory: the latency-hiding scheduler spends
what the step does not need.

    python benchmarks/xla_headroom.py [--cases 6] [--jobs 2]

Where a step has collectives and the target is a Hopper or Blackwell GPU, XLA's latency-hiding
scheduler reorders the memory scheduler's order to overlap them with compute, and may use
memory up to its limit, (80% of the card's memory - the step's unaliased arguments and
outputs) x 95% (``GetSchedulerMemoryLimit`` in ``xla/service/gpu/gpu_hlo_schedule.cc``, jaxlib
0.10.2; `capopt.validation.xla_log`). A small step compiled for an 80 GiB card has gigabytes
to spare, so its compiled peak is the latency-hiding scheduler's and can sit far above what the
step needs.

For the first ``--cases`` multi-device configs of `memory_random.py`'s fitting split (draw
order, fixed seed), this compiles the step for an H100 (xla-gpu tier) with and without the
latency-hiding scheduler, then for H100s whose memory is set so that the latency-hiding limit
is k x the temporaries without it (k = 0.8, 1, 1.25, 1.5, 2; the limit XLA used is read back
from its log), and prints the compiled temporaries at each size against those without latency
hiding. Nothing of the cost model is involved. Records are appended to a JSONL file as they
finish (a rerun resumes); the table and ``--out`` (JSON) are rebuilt from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _random_cases import add_worker_args, measure, xla_gpu_refusal  # noqa: E402
from capopt.validation.random_configs import Case, describe, draw_cases  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: latency-hiding limit / the temporaries without latency hiding, asked for
SIZES = (0.8, 1.0, 1.25, 1.5, 2.0)
#: ``GetSchedulerMemoryLimit``: the base is 80% of the card's memory, the slop factor 95%
BASE_SHARE, SLOP = 0.80, 0.95


def on_card(case: Case, memory_bytes: int, tag: str) -> Case:
    """``case`` compiled for its GPU with ``memory_bytes`` of memory."""
    sc = case.scenario
    hw = dataclasses.replace(sc.hardware, memory_bytes=int(memory_bytes))
    return dataclasses.replace(case, name=f"{case.name}@{tag}",
                               scenario=dataclasses.replace(sc, hardware=hw))


def key(case: Case) -> str:
    return f"{case.name}:{case.scenario.hardware.memory_bytes}"


def io_bytes(rec: dict) -> int:
    """What the latency-hiding limit leaves out: the arguments and the unaliased outputs."""
    m = rec["measured"]
    return m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"]


def memory_for(need: int, io: int, k: float) -> int:
    """The card memory whose latency-hiding limit is ``k`` x ``need``."""
    return int((k * need / SLOP + io) / BASE_SHARE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=6)
    add_worker_args(ap)
    ap.add_argument("--measurements", default=str(RESULTS / "xla_headroom.jsonl"))
    ap.add_argument("--out", default=str(RESULTS / "xla_headroom.json"))
    args = ap.parse_args(argv)
    refused = xla_gpu_refusal()
    if refused:
        return refused
    t0 = time.perf_counter()
    chosen = [c for c in draw_cases(200, 0) if c.split == "fit"
              and c.features["layout"] != "1 device"][:args.cases]
    path = Path(args.measurements)
    own = [on_card(c, c.scenario.hardware.memory_bytes, "card") for c in chosen]
    calm = [on_card(c, c.scenario.hardware.memory_bytes, "no-lhs") for c in chosen]
    done = measure(own, path, tier="xla-gpu", key=key, jobs=args.jobs, timeout_s=args.timeout)
    done.update(measure(calm, path, tier="xla-gpu", key=key, jobs=args.jobs,
                        timeout_s=args.timeout, options={"latency_hiding": False}))
    need = {c.name: (done[key(q)]["measured"]["temp_bytes"], io_bytes(done[key(q)]))
            for c, q in zip(chosen, calm) if key(q) in done}
    # (each measured case on its own card, then on the cards sized from its temporaries)
    cards = {c.name: [(None, o)] + [(k, on_card(c, memory_for(*need[c.name], k), f"k{k:g}"))
                                    for k in SIZES]
             for c, o in zip(chosen, own) if c.name in need}
    done.update(measure([q for qs in cards.values() for _, q in qs[1:]], path, tier="xla-gpu",
                        key=key, jobs=args.jobs, timeout_s=args.timeout))
    rows = []
    print("\nXLA's compiled temporaries by the card's memory, against the same step's without "
          "latency hiding\n(xla-gpu tier, H100 target)\n")
    print(f"{'case':<26} {'card':>10} {'LHS limit':>11} {'limit/need':>10} {'need':>10} "
          f"{'compiled':>10} {'ratio':>6}")
    for c in chosen:
        if c.name not in cards:
            print(f"{c.name:<26} not measured")
            continue
        base = need[c.name][0]
        for k, q in cards[c.name]:
            rec = done.get(key(q))
            if rec is None:
                continue
            sched = rec["details"].get("xla_schedule") or {}
            limit = sched.get("lhs_limit_bytes")
            temp = rec["measured"]["temp_bytes"]
            mem = q.scenario.hardware.memory_bytes
            rows.append({"case": c.name, "describe": describe(c), "card_bytes": mem,
                         "asked": k, "lhs_limit_bytes": limit, "need_temp_bytes": base,
                         "compiled_temp_bytes": temp,
                         "compiled_peak_bytes": rec["measured"]["peak_bytes"],
                         "lhs_bytes": sched.get("lhs_bytes"), "ratio": temp / base})
            print(f"{c.name:<26} {mem / 2**20:>8.0f} M {(limit or 0) / 2**20:>9.1f} M "
                  f"{(limit or 0) / base:>10.2f} {base / 2**20:>8.1f} M {temp / 2**20:>8.1f} M "
                  f"{temp / base:>6.2f}")
    out = {"tier": "xla-gpu", "gpu": "h100-sxm-80gb", "sizes": list(SIZES),
           "base_share": BASE_SHARE, "slop": SLOP, "rows": rows,
           "cases": [c.name for c in chosen], "total_s": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
