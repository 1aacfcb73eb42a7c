"""The GEMM model against a measured kernel table: XLA's own matmul throughput on Hopper.

XLA's GPU cost model ships measured matmul throughput per GPU generation, shape and dtype
(``kDefaultMatmulPTable`` in ``xla/service/gpu/model/matmul_interpolator_data.h``; extracted to
``benchmarks/published/xla_matmul_table.json`` with its commit). This script prices every entry
with capopt's GEMM model, nothing fitted to the table:

    seconds = b x 2 m n k / (peak x matmul_efficiency(gemm_dim(m, k, n)))

with the profile's ``gemm_eff_max`` and ``gemm_half_scale`` (the roofline's harmonic form,
`capopt.cost.flops.matmul_efficiency`), and prints the ratio predicted / measured throughput
by dtype and by the measured kernel time (short kernels are dominated by per-launch latency,
which capopt prices apart as ``kernel_gap_s``, so they are reported, not judged).

A second table checks a part that its power limit holds below the datasheet's rates:
FBGEMM's GEMM benchmark on Meta's 500 W H100 (``benchmarks/published/fbgemm_h100_500w.json``,
pytorch/FBGEMM#2546; capopt's ``h100-sxm-96gb``). Its bf16 rows, priced at the datasheet peak by
the ``torchtitan`` profile's GEMM model (the pytorch profile's ``gemm_eff_max`` and
``gemm_half_scale``), give the part's ``sustained_tensor_share`` (the
mean of measured / modelled throughput); its fp8 rows are held out: priced with the share the
catalog holds, they check it on another dtype and kernel (rowwise-scaled CUTLASS, not cuBLAS).

Usage: ``python benchmarks/gemm_table.py [--profile xla-gpu]`` prints the tables and writes
``benchmarks/results/gemm_table.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _kernel_probe import probe_numbers, profile_args, write_results  # noqa: E402
from _random_cases import summary as error_summary  # noqa: E402

from capopt._errors import CapoptError  # noqa: E402
from capopt._hardware import get_hardware  # noqa: E402

DATA = ROOT / "benchmarks" / "published" / "xla_matmul_table.json"
POWER_LIMITED = ROOT / "benchmarks" / "published" / "fbgemm_h100_500w.json"
# the precision whose matmul dtype each of that table's dtypes is, and the profile that runs
# its kernels (cuBLAS and CUTLASS GEMMs called from PyTorch)
POWER_DTYPES = {"bf16": "bf16-mixed", "fp8": "fp8-mixed"}
POWER_PROFILE = "torchtitan"
POWER_FIT = "bf16"
RESULTS = ROOT / "benchmarks" / "results" / "gemm_table.json"
# the table's generation keys and the card each is priced on
CARDS = {"sm_90": "h100-sxm-80gb", "sm_100": "b200-sxm-180gb"}
# the table's dtype keys and the capopt precision whose matmul dtype they are (XLA runs an
# f32 dot on tensor cores as TF32 by default: the table's f32 rates exceed the FP32 vector peak)
DTYPES = {"bf16xbf16->bf16": "bf16-mixed", "f32xf32->f32": "fp32"}
# measured kernel time buckets, seconds
BUCKETS = ((0.0, 10e-6, "under 10 us"), (10e-6, 100e-6, "10-100 us"),
           (100e-6, float("inf"), "over 100 us"))


def predicted_flops(entry: dict, n: dict) -> float:
    """FLOP/s of one table entry under capopt's GEMM model."""
    from capopt.cost.flops import gemm_dim, matmul_efficiency
    m, k, nn = (float(entry[x]) for x in ("m", "k", "n"))
    eff = float(matmul_efficiency(gemm_dim(m, k, nn), n))
    return eff * float(n["matmul_peak"])


def power_limited() -> dict:
    """The power-limited part's GEMMs: the share they sustain of the modelled rate (fitted on
    the bf16 rows), and the fp8 rows held out."""
    from dataclasses import replace
    doc = json.loads(POWER_LIMITED.read_text())
    hw = get_hardware(doc["card"])
    datasheet = replace(hw, sustained_tensor_share=1.0)
    rows = []
    for r in doc["rows"]:
        precision = POWER_DTYPES[r["dtype"]]
        entry = dict(zip(("m", "n", "k"), r["shape"]))
        at_sheet = predicted_flops(entry, probe_numbers(datasheet, precision, POWER_PROFILE))
        pred = predicted_flops(entry, probe_numbers(hw, precision, POWER_PROFILE))
        measured = r["tflops"] * 1e12
        rows.append({"dtype": r["dtype"], "kernel": r["kernel"], "shape": r["shape"],
                     "split": "fit" if r["dtype"] == POWER_FIT else "heldout",
                     "measured_flops": measured, "datasheet_model_flops": at_sheet,
                     "sustained_share": measured / at_sheet, "predicted_flops": pred,
                     "error": (pred - measured) / measured})
    fit = [r["sustained_share"] for r in rows if r["split"] == "fit"]
    derived = float(np.mean(fit))
    print(f"\n{hw.name} under its power limit: {doc['source']}")
    print(f"{'dtype':<5} {'shape':<20} {'measured':>9} {'model at datasheet':>19} "
          f"{'ratio':>6} {'predicted':>9} {'error':>7}  split")
    for r in rows:
        print(f"{r['dtype']:<5} {'x'.join(map(str, r['shape'])):<20} "
              f"{r['measured_flops'] / 1e12:8.0f}T {r['datasheet_model_flops'] / 1e12:18.0f}T "
              f"{r['sustained_share']:6.3f} {r['predicted_flops'] / 1e12:8.0f}T "
              f"{r['error']:+7.1%}  {r['split']}")
    held = error_summary([r["error"] for r in rows if r["split"] == "heldout"])
    print(f"sustained share from the {POWER_FIT} rows: {derived:.3f} (the catalog's "
          f"{hw.sustained_tensor_share:.3f}); held-out {held['n']} rows: median |error| "
          f"{held['median_abs']:.1%}, worst {held['worst_signed']:+.1%}")
    return {"source": doc["source"], "card": hw.name, "profile": POWER_PROFILE,
            "derived_share": derived, "catalog_share": hw.sustained_tensor_share,
            "heldout": held, "rows": rows}


def main(argv=None) -> int:
    args = profile_args(__doc__, "xla-gpu", argv)
    if args is None:
        return 2
    t0 = time.perf_counter()
    doc = json.loads(DATA.read_text())
    rows, summary = [], {}
    for gen, entries in doc["tables"].items():
        card = CARDS.get(gen)
        if card is None:
            continue
        try:
            hw = get_hardware(card)
        except Exception:                       # noqa: BLE001 - a card capopt does not ship
            print(f"{gen}: no card {card} in capopt's catalog; skipped")
            continue
        for dtype, precision in DTYPES.items():
            try:
                n = probe_numbers(hw, precision, args.profile)
            except CapoptError as e:            # a profile without this precision
                print(f"{gen} {dtype}: {e}")
                continue
            for e in entries:
                measured = e["flops"].get(dtype)
                if not measured:
                    continue
                flops = 2.0 * e["b"] * e["m"] * e["n"] * e["k"]
                pred = predicted_flops(e, n)
                rows.append({"gen": gen, "card": card, "dtype": dtype, "b": e["b"], "m": e["m"],
                             "n": e["n"], "k": e["k"], "measured_flops": measured,
                             "measured_s": flops / measured,
                             "measured_peak_share": measured / float(n["matmul_peak"]),
                             "predicted_flops": pred, "ratio": pred / measured})
    print(f"capopt's GEMM model ({args.profile} profile) against XLA's measured matmul table "
          f"({doc['source']})\n")
    print(f"{'gen':<7} {'dtype':<17} {'kernel time':<12} {'n':>4} {'median':>7} {'p10':>6} "
          f"{'p90':>6}   (predicted / measured throughput)")
    for gen in sorted({r["gen"] for r in rows}):
        for dtype in DTYPES:
            for lo, hi, label in BUCKETS:
                sel = [r["ratio"] for r in rows if r["gen"] == gen and r["dtype"] == dtype
                       and lo <= r["measured_s"] < hi]
                if not sel:
                    continue
                a = np.asarray(sel)
                s = {"n": int(a.size), "median": float(np.median(a)),
                     "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90))}
                summary[f"{gen} {dtype} {label}"] = s
                print(f"{gen:<7} {dtype:<17} {label:<12} {s['n']:>4} {s['median']:7.2f} "
                      f"{s['p10']:6.2f} {s['p90']:6.2f}")
    big = sorted((r for r in rows if r["measured_s"] >= 100e-6),
                 key=lambda r: -r["measured_flops"])
    if big:
        print("\nthe largest kernels (over 100 us), measured and predicted share of the peak:")
        for r in big[:12]:
            print(f"  {r['gen']} {r['dtype']:<16} b{r['b']} {r['m']}x{r['n']}x{r['k']:<6} "
                  f"measured {r['measured_peak_share']:.2f}  predicted "
                  f"{r['ratio'] * r['measured_peak_share']:.2f}")
    limited = power_limited()
    out = {"source": doc["source"], "profile": args.profile, "summary": summary,
           "rows": rows, "power_limited": limited, "total_s": time.perf_counter() - t0}
    return write_results(RESULTS, out)


if __name__ == "__main__":
    raise SystemExit(main())
