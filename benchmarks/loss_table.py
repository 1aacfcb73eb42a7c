"""The head and loss against the kernel benchmark of a fused linear cross-entropy: Liger on an A100.

``loss = "fused-linear"`` prices the head's three GEMMs (logits, input gradient, weight
gradient) over chunks of `capopt.cost.flops.fused_linear_chunk` rows instead of all the
tokens at once, at the GEMM model's efficiency for that shape
(`capopt.cost.flops.matmul_efficiency`: small chunks read the whole head for few rows), and
the cross-entropy's passes over the logits at the card's achieved bandwidth. Liger publishes
the kernel's speed against the plain head and loss on an A100 (H 4096, V 128256, bf16;
``benchmarks/published/liger_flce_a100.json``). This script prices every row with the model,
nothing fitted here:

    seconds = 3 x 2 BT H V / (peak x matmul_efficiency(gemm_dim(rows, H, V)))
              + BT V x bytes per logit / (mem_bw x mem_eff)

with ``rows`` the chunk (Liger) or all ``BT`` tokens (the plain head), and the bytes per logit
element the measured version's passes, counted from its code: Liger 0.4.2 upcasts each
chunk (read 2, write 4), its kernel rewrites it in place (read 4, write 4), it is cast back
(read 4, write 2) and scaled (read 2, write 2): 24; the plain path's ``cross_entropy`` on
bf16 logits: log_softmax (read 2, write 2), nll_loss_backward's zeros (write 2) and
log_softmax_backward (read 4, write 2): 12. (The model prices the current kernel, which
keeps the chunk in bf16 and rewrites it once: 4.)

Usage: ``python benchmarks/loss_table.py [--profile pytorch-eager]`` prints the table and
writes ``benchmarks/results/loss_table.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _kernel_probe import probe_numbers, profile_args, write_results  # noqa: E402
from _random_cases import summary as error_summary  # noqa: E402

from capopt._hardware import get_hardware  # noqa: E402

DATA = ROOT / "benchmarks" / "published" / "liger_flce_a100.json"
RESULTS = ROOT / "benchmarks" / "results" / "loss_table.json"
# bytes moved per logit element by the measured code's memory-bound passes (see above)
PASS_BYTES = {"liger": 24.0, "huggingface": 12.0}


def predicted_ms(provider: str, bt: int, h: int, v: int, n: dict) -> dict:
    """The model's milliseconds for one forward and backward of the head and loss."""
    import jax.numpy as jnp

    from capopt.cost.flops import fused_linear_chunk, gemm_dim, matmul_efficiency
    rows = (float(fused_linear_chunk({"V": v, "h": h}, jnp.asarray(float(bt))))
            if provider == "liger" else float(bt))
    eff = float(matmul_efficiency(gemm_dim(rows, h, v), n))
    gemm_s = 3 * 2.0 * bt * h * v / (eff * float(n["matmul_peak"]))
    mem_s = bt * v * PASS_BYTES[provider] / (float(n["mem_bw"]) * float(n["rt_mem_eff"]))
    return {"rows": rows, "gemm_efficiency": eff, "gemm_ms": 1e3 * gemm_s,
            "memory_ms": 1e3 * mem_s, "ms": 1e3 * (gemm_s + mem_s)}


def main(argv=None) -> int:
    args = profile_args(__doc__, "pytorch-eager", argv)
    if args is None:
        return 2
    t0 = time.perf_counter()
    doc = json.loads(DATA.read_text())
    hw = get_hardware(doc["card"])
    n = probe_numbers(hw, doc["dtype"], args.profile)
    h, v = doc["hidden"], doc["vocab"]
    rows = []
    for r in doc["rows"]:
        for provider in ("liger", "huggingface"):
            p = predicted_ms(provider, r["BT"], h, v, n)
            measured = r[f"{provider}_full_ms"]
            rows.append({"provider": provider, "BT": r["BT"], "measured_ms": measured,
                         **{f"predicted_{k}": x for k, x in p.items()},
                         "error": (p["ms"] - measured) / measured})
    print(f"capopt's head and loss ({args.profile} profile, {hw.name}) against {doc['source']}"
          f"\nH {h}, V {v}, {doc['dtype']}; forward and backward\n")
    print(f"{'provider':<12} {'BT':>6} {'rows':>6} {'GEMM eff':>8} {'measured':>9} "
          f"{'predicted':>9} {'error':>7}")
    for r in rows:
        print(f"{r['provider']:<12} {r['BT']:>6} {r['predicted_rows']:>6.0f} "
              f"{r['predicted_gemm_efficiency']:>8.3f} {r['measured_ms']:>7.1f}ms "
              f"{r['predicted_ms']:>7.1f}ms {100 * r['error']:>+6.1f}%")
    ratios = []
    for r in doc["rows"]:
        lig = next(x for x in rows if x["provider"] == "liger" and x["BT"] == r["BT"])
        hf = next(x for x in rows if x["provider"] == "huggingface" and x["BT"] == r["BT"])
        measured = lig["measured_ms"] / hf["measured_ms"]
        predicted = lig["predicted_ms"] / hf["predicted_ms"]
        ratios.append({"BT": r["BT"], "measured": measured, "predicted": predicted,
                       "error": (predicted - measured) / measured})
    print("\nLiger's time over the plain head's (the cost of chunking):")
    for q in ratios:
        print(f"  BT {q['BT']:>6}: measured x{q['measured']:.2f}, predicted x{q['predicted']:.2f}"
              f" ({100 * q['error']:+.1f}%)")
    summary = {p: error_summary([r["error"] for r in rows if r["provider"] == p])
               for p in ("liger", "huggingface")}
    summary["ratio"] = error_summary([q["error"] for q in ratios])
    print()
    for label, s in summary.items():
        print(f"{label:<12} n {s['n']}: median |error| {100 * s['median_abs']:.1f}%, worst "
              f"{100 * s['worst_signed']:+.1f}%")
    out = {"source": doc["source"], "profile": args.profile, "card": hw.name,
           "pass_bytes": PASS_BYTES, "summary": summary, "rows": rows, "ratios": ratios,
           "total_s": time.perf_counter() - t0}
    return write_results(RESULTS, out)


if __name__ == "__main__":
    raise SystemExit(main())
