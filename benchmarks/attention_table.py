"""The attention model against the kernel benchmark it came from: FlashAttention-2 on an H100.

capopt prices a fused attention kernel's forward and backward together over the whole s x s
score matrix at ``flash_eff`` of the attention dtype's peak; on Hopper the ``pytorch-eager``
profile (and those built on it) sets that share from FlashAttention-2's published bars,
``flash_eff_sm90 x s / (s + flash_half_seq_sm90)``, read off the non-causal head-dim-128 bars
of Shah et al. 2024 (``benchmarks/published/flash_attention_h100.json``), at other head dims
through the exponentials the kernel pays between its matmuls (``flash_exp_flops_sm90``, the
paper's 989 against 3.9 TFLOPS; `capopt._runtime.flash_share_sm90`). This script prices every
bar with the model, nothing fitted here:

    measured share = (1 + 2.5) / (1 / forward + 2.5 / backward) / peak     (fwd + bwd FLOPs)

for the rows with both passes (the fitting rows, head dim 128, and the held-out head dim 64),
and, for the causal forward bars (held out), the rate over the whole matrix the causal kernel
reaches (twice the printed rate: the paper counts half the FLOPs) against the model's, which
prices causal and non-causal alike.

Usage: ``python benchmarks/attention_table.py [--profile pytorch-eager]`` prints the table and
writes ``benchmarks/results/attention_table.json``.
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
from capopt._runtime import ATTN_BWD_FLOPS as BWD_FLOPS  # noqa: E402

DATA = ROOT / "benchmarks" / "published" / "flash_attention_h100.json"
RESULTS = ROOT / "benchmarks" / "results" / "attention_table.json"


def model_share(card: str, profile: str, seq: int, head_dim: int) -> float:
    """The share of the bf16 peak capopt's attention model gives a fused kernel at ``seq``
    tokens (one decoder block whose heads are ``head_dim`` wide)."""
    return float(probe_numbers(get_hardware(card), "bf16-mixed", profile, seq=seq,
                               head_dim=head_dim)["rt_flash_eff"])


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def main(argv=None) -> int:
    args = profile_args(__doc__, "pytorch-eager", argv)
    if args is None:
        return 2
    t0 = time.perf_counter()
    doc = json.loads(DATA.read_text())
    hw = get_hardware(doc["card"])
    peak = hw.peak("bf16")
    seqs = doc["seq"]
    by = {(r["head_dim"], r["causal"], r["pass"]): r["tflops"] for r in doc["rows"]}
    rows = []
    for hd, split in ((128, "fit"), (64, "heldout")):
        fwd, bwd = by[(hd, False, "forward")], by[(hd, False, "backward")]
        for s, f, b in zip(seqs, fwd, bwd):
            measured = (1.0 + BWD_FLOPS) / (1.0 / f + BWD_FLOPS / b) * 1e12 / peak
            pred = model_share(hw.name, args.profile, s, hd)
            rows.append({"head_dim": hd, "causal": False, "passes": "forward + backward",
                         "seq": s, "split": split, "measured_share": measured,
                         "predicted_share": pred, "error": (pred - measured) / measured})
    for s, f in zip(seqs, by[(128, True, "forward")]):
        measured = 2.0 * f * 1e12 / peak       # over the whole matrix
        pred = model_share(hw.name, args.profile, s, 128)
        rows.append({"head_dim": 128, "causal": True, "passes": "forward", "seq": s,
                     "split": "heldout", "measured_share": measured, "predicted_share": pred,
                     "error": (pred - measured) / measured})

    print(f"capopt's attention model ({args.profile} profile, {hw.name}) against "
          f"{doc['source']}\n")
    print(f"{'kernel rows':<34} {'seq':>6} {'measured':>9} {'predicted':>9} {'error':>7}  split")
    summary = {}
    for key in (("fit", False, 128), ("heldout", False, 64), ("heldout", True, 128)):
        sel = [r for r in rows if (r["split"], r["causal"], r["head_dim"]) == key]
        label = (f"hd {key[2]} {'causal' if key[1] else 'non-causal'} "
                 f"{sel[0]['passes']}")
        for r in sel:
            print(f"{label:<34} {r['seq']:>6} {r['measured_share']:9.3f} "
                  f"{r['predicted_share']:9.3f} {_pct(r['error']):>7}  {r['split']}")
        summary[label] = {"split": key[0], **error_summary([r["error"] for r in sel])}
    print()
    for label, s in summary.items():
        print(f"{label:<34} ({s['split']}): median |error| {100 * s['median_abs']:.1f}%, "
              f"worst {_pct(s['worst_signed'])}")
    out = {"source": doc["source"], "profile": args.profile, "card": hw.name,
           "summary": summary, "rows": rows, "total_s": time.perf_counter() - t0}
    return write_results(RESULTS, out)


if __name__ == "__main__":
    raise SystemExit(main())
