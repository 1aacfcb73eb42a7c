"""How much of XLA's peak follows the shapes smoothly: each config beside a near twin.

    python benchmarks/xla_twins.py [--field vocab_size|seq_len|heads] [--delta N] [--limit N]
                                   [--jobs 2] [--no-measure]

The memory model prices a step's live set from the tensor inventory; XLA's buffer assignment
also follows its own fusion and scheduling choices, which can change with a shape the model
prices smoothly. This script measures how far that goes. It takes the held-out one-device
configs of ``memory_random.py``'s draw (seed 0, the cards no coefficient was read from; one
device, so XLA's latency-hiding scheduler does not run) that have a vocabulary, and compiles
each once more with the vocabulary ``--delta`` entries larger (16 by default: the same residue
modulo 16, so the same padding of the head's GEMMs) on the xla-gpu tier. The base compiles
are ``memory_random.jsonl``'s own. ``--field seq_len`` lengthens the sequence instead
(every family but ViT, whose sequence is its image's patches; ``--delta 128`` keeps it a
multiple of the flash stand-in's 128-query chunks where it was one: off them the step falls
back to materialised scores, `capopt.validation.models.attention`, a change of structure).
``--field heads`` gives the materialised-attention configs (flash off, every family with
attention) ``--delta`` more query heads (1 by default) a key-value head, the head width kept:
grouped heads one more each group, one-to-one heads (MHA) one more of both. How many
score-sized tensors XLA keeps a block for the backward pass is its fusion's choice, one or two,
and the head count moves it; the model keeps two (``score_copies``).

For a pair it reports the measured change of the peak (twin / base - 1), the predicted change
and the excess of the one over the other, (1 + measured) / (1 + predicted) - 1: what the
oracle moved that the model, by construction, cannot. A small excess everywhere says the
model's remaining misses on these configs are systematic (a mechanism to find); a large one
says they include choices that a shape change of a fraction of a percent can flip, a floor
under what a model of the inventory alone can reach.

Results: ``results/xla_twins.json`` (``xla_twins_seq_len.json``, ``xla_twins_heads.json``;
table printed); compiles in
``results/xla_twins.jsonl`` (resumable).
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

from capopt.validation.random_configs import Case, describe, draw_cases  # noqa: E402
from capopt.validation.tiers import devices_needed  # noqa: E402
from _random_cases import add_worker_args, measure, pct, summary, xla_gpu_refusal  # noqa: E402
from memory_random import measurement_key, predicted_peak  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


FIELDS = ("vocab_size", "seq_len", "heads")
#: --delta when none is given: vocabulary entries or tokens, and query heads a key-value head
DEFAULT_DELTA = {"vocab_size": 16, "seq_len": 16, "heads": 1}


def twin(case: Case, delta: int, field: str = "vocab_size") -> Case:
    """``case`` with ``delta`` more vocabulary entries (``vocab_size``), tokens a sequence
    (``seq_len``) or query heads a key-value head (``heads``: grouped heads ``delta`` more a
    group, one-to-one heads ``delta`` more of both; each head as wide as before)."""
    sc = case.scenario
    tag = {"vocab_size": "v", "seq_len": "s", "heads": "h"}[field]
    if field == "vocab_size":
        sc = dataclasses.replace(sc, model=dataclasses.replace(
            sc.model, vocab_size=sc.model.vocab_size + delta))
    elif field == "heads":
        m = sc.model
        a, kv = m.num_attention_heads, m.kv_heads
        heads = a + delta * kv if kv < a else a + delta
        sc = dataclasses.replace(sc, model=dataclasses.replace(
            m, num_attention_heads=heads, num_key_value_heads=kv if kv < a else heads,
            head_dim=m.head_size))
    else:
        sc = dataclasses.replace(sc, workload=dataclasses.replace(
            sc.workload, seq_len=sc.workload.seq_len + delta))
    sc = dataclasses.replace(sc, name=sc.name + f"-{tag}{delta:+d}")
    return dataclasses.replace(case, name=case.name + f"-{tag}{delta:+d}", scenario=sc)


def pairs(cases: list[Case], delta: int, limit: int,
          field: str = "vocab_size") -> list[tuple[Case, Case]]:
    """The held-out one-device cases the field applies to (a vocabulary; a sequence that is
    not an image's patches; materialised attention), each with its twin (at most ``limit``)."""
    def applies(c: Case) -> bool:
        m = c.scenario.model
        if field == "heads":
            return m.family != "mlp" and not c.config.flash_attention
        return m.vocab_size > 0 if field == "vocab_size" else m.family != "vit"
    out = [(c, twin(c, delta, field)) for c in cases
           if c.split == "heldout" and devices_needed(c.config) == 1 and applies(c)]
    return out[:limit] if limit else out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200, help="memory_random.py's draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--field", choices=FIELDS, default="vocab_size",
                    help="what the twin changes (results/xla_twins[_seq_len|_heads].json)")
    ap.add_argument("--delta", type=int, default=None,
                    help="vocabulary entries, tokens a sequence (16 by default) or query heads a "
                         "key-value head (1) the twin adds")
    ap.add_argument("--limit", type=int, default=0, help="at most this many pairs (0: all)")
    add_worker_args(ap)
    ap.add_argument("--no-measure", action="store_true",
                    help="only recompute the predictions for what is already measured")
    ap.add_argument("--out", default=None,
                    help="default results/xla_twins.json (vocab_size), "
                         "results/xla_twins_<field>.json (seq_len, heads)")
    args = ap.parse_args(argv)
    args.delta = DEFAULT_DELTA[args.field] if args.delta is None else args.delta
    args.out = args.out or str(RESULTS / ("xla_twins.json" if args.field == "vocab_size"
                                          else f"xla_twins_{args.field}.json"))
    if args.delta == 0:
        print("error: --delta: 0 makes no twin (allowed: a nonzero integer)", file=sys.stderr)
        return 2
    refused = None if args.no_measure else xla_gpu_refusal()
    if refused:
        return refused
    t0 = time.perf_counter()
    todo = pairs(draw_cases(args.cases, args.seed), args.delta, args.limit, args.field)
    from capopt.validation.runner import load_results
    base = {r["key"]: r for r in load_results(RESULTS / "memory_random.jsonl")
            if r.get("status") == "ok"}
    path = RESULTS / "xla_twins.jsonl"
    if args.no_measure:
        done = {r["key"]: r for r in load_results(path) if r.get("status") == "ok"}
    else:
        # (a base missing from memory_random's own file is compiled here too)
        want = [t for _, t in todo] + [c for c, _ in todo if measurement_key(c) not in base]
        done = measure(want, path, tier="xla-gpu", key=measurement_key, jobs=args.jobs,
                       timeout_s=args.timeout)
    done = {**base, **done}
    rows = []
    for c, t in todo:
        rb, rt = done.get(measurement_key(c)), done.get(measurement_key(t))
        if rb is None or rt is None:
            continue
        pb, pt = predicted_peak(c, rb)["peak_bytes"], predicted_peak(t, rt)["peak_bytes"]
        mb, mt = rb["measured"]["peak_bytes"], rt["measured"]["peak_bytes"]
        rows.append({"case": c.name, "describe": describe(c),
                     "vocab": c.scenario.model.vocab_size, "seq_len": c.scenario.workload.seq_len,
                     "heads": c.scenario.model.num_attention_heads,
                     "kv_heads": c.scenario.model.kv_heads,
                     "twin_heads": t.scenario.model.num_attention_heads,
                     "twin_kv_heads": t.scenario.model.kv_heads,
                     "measured_base_bytes": mb, "measured_twin_bytes": mt,
                     "predicted_base_bytes": pb, "predicted_twin_bytes": pt,
                     "measured_change": mt / mb - 1.0, "predicted_change": pt / pb - 1.0,
                     "excess": (mt / mb) / (pt / pb) - 1.0,
                     "error_base": pb / mb - 1.0, "error_twin": pt / mt - 1.0})
    excess = [r["excess"] for r in rows]
    s = summary(excess)
    doc = {"tier": "xla-gpu", "gpu": "h100-sxm-80gb", "field": args.field,
           "delta": args.delta, "pairs": len(todo),
           "measured": len(rows), "summary_excess": s,
           "over_2pct": sum(abs(e) > 0.02 for e in excess),
           "over_5pct": sum(abs(e) > 0.05 for e in excess),
           "rows": rows, "total_s": round(time.perf_counter() - t0, 1)}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'case':<28} {'V':>6} {'measured':>9} {'predicted':>9} {'excess':>8} "
          f"{'err base':>9} {'err twin':>9}")
    for r in sorted(rows, key=lambda r: -abs(r["excess"])):
        print(f"{r['case']:<28} {r['vocab']:>6} {r['measured_change'] * 100:>+8.2f}% "
              f"{r['predicted_change'] * 100:>+8.2f}% {r['excess'] * 100:>+7.2f}% "
              f"{r['error_base'] * 100:>+8.1f}% {r['error_twin'] * 100:>+8.1f}%")
    if rows:
        print(f"\n{len(rows)} pairs ({args.field} {args.delta:+d}): |excess| median "
              f"{pct(s['median_abs'])}, p90 {pct(s['p90_abs'])}, worst "
              f"{s['worst_signed'] * 100:+.2f}%; over 2%: {doc['over_2pct']}, over 5%: "
              f"{doc['over_5pct']}")
    print(f"wrote {args.out} in {doc['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
