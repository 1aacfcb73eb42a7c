"""The held-out figures `capopt plan` and `capopt optimize` print under their answer.

    python benchmarks/trust_table.py            # writes capopt/data/trust.json

Reads the committed results of the random-config benchmarks, of capopt's own answers compiled
(``answers_compiled.py``) and of the published runs (it
measures nothing and calls no cost model) and writes, per runtime profile, the held-out
errors of its predicted peak against its own oracle, pooled over every results file of that
runtime and oracle and grouped by layout (`capopt._trust.label_group`) and by each label of
the answer features the points are filed under (`capopt._trust.FEATURES`), and the published
runs' throughput errors per framework, per GPU and per GPU generation. Only held-out points
count (configs whose card shapes no coefficient was read from); a file whose profile is
measured on another runtime's oracle (a baseline) is left out.

Rerun it whenever a results file changes; ``tests/test_trust.py`` fails while the package's
table and the results disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "capopt" / "data" / "trust.json"

# Each runtime profile's oracle: the tier that runs that runtime's own step.
ORACLES = {
    "xla-gpu": ("xla-gpu", "XLA's GPU buffer assignment of the Flax step (the xla-gpu tier; "
                           "with collectives, what XLA's latency-hiding scheduler spent of an "
                           "H100's spare memory included)"),
    "maxtext": ("maxtext", "MaxText's own train step compiled for the GPU (the maxtext tier)"),
    "deepspeed": ("deepspeed", "DeepSpeed's own engine step (the deepspeed tier)"),
    "pytorch-eager": ("torch", "PyTorch's caching allocator over the step on fake tensors "
                               "(the torch tier)"),
    "hf": ("torch", "the Trainer's step in PyTorch on fake tensors (the torch tier)"),
    "torchtitan": ("torch", "torchtitan's FSDP2 step in PyTorch on fake tensors (the torch "
                            "tier)"),
    "torchtune": ("torch", "torchtune's step in PyTorch on fake tensors (the torch tier)"),
}
PUBLISHED = RESULTS / "published_runs.json"
ANSWERS = RESULTS / "answers_compiled.json"


def stats(errors: list[float]) -> dict:
    """`_random_cases.summary`, the 90th percentile of the shortfall (``p90_under``: of
    max(0, -error), an over-prediction falls short by nothing: in 9 of 10 points the prediction
    fell short of the measured peak by at most that share of it) and the largest
    under-prediction (``worst_under``, 0 where none is under)."""
    import numpy as np
    from _random_cases import summary
    out = summary(errors)
    if errors:
        short = np.maximum(0.0, -np.asarray(errors, float))
        out["p90_under"] = float(np.percentile(short, 90))
        out["worst_under"] = min(0.0, min(errors))
    return out


def label_group(features: dict) -> str:
    """The layout group (`capopt._trust.GROUPS`) of a benchmark point from its ``features``:
    the labels each random-config benchmark writes (``1 device``, ``tp``, ``dp ZeRO-k [+ tp]``,
    DeepSpeed's ``dp N`` beside ``ZeRO-k``, MaxText's ``data`` / ``fsdp`` / ``tensor``
    combinations). `capopt._trust.config_group` is the same grouping of a config."""
    label = str(features["layout"])
    words = label.replace("+", " ").replace("(", " ").replace(")", " ").split()
    if label in ("1 device", "dp 1"):
        return "one device"
    if "tp" in words or "tensor" in words:
        return "tensor parallel"
    if label.startswith("dp ZeRO-"):
        stage = int(label.split("-")[1].split()[0])
        return "data parallel, sharded" if stage >= 2 else "data parallel, replicated"
    if len(words) == 2 and words[0] == "dp" and words[1].isdigit():
        stage = int(str(features["zero"]).split("-")[1])
        return "data parallel, sharded" if stage >= 2 else "data parallel, replicated"
    if words and words[0] == "fsdp":
        return "data parallel, sharded"
    if words == ["data"]:
        return "data parallel, replicated"
    raise ValueError(f"layout label {label!r} has no group")


def memory_section(results: Path) -> dict:
    from capopt._trust import FEATURES, GROUPS
    pooled: dict[str, dict] = {}
    for f in sorted(results.glob("*.json")):
        d = json.loads(f.read_text())
        if not isinstance(d, dict) or "points" not in d or d.get("profile") not in ORACLES:
            continue
        tier, oracle = ORACLES[d["profile"]]
        if d.get("tier") != tier:
            continue
        held = [p for p in d["points"] if p.get("split") == "heldout"
                and isinstance(p.get("error"), (int, float))]
        if not held:
            continue
        rt = pooled.setdefault(d["profile"], {"oracle": oracle, "tier": tier, "files": {},
                                              "points": [], "by_feature": {}})
        rt["files"][f.name] = len(held)
        rt["points"] += [(label_group(p["features"]), float(p["error"])) for p in held]
        # (and by each answer feature the point is labelled with, `capopt._trust.FEATURES`)
        for p in held:
            for key in FEATURES:
                if key in p["features"]:
                    rt["by_feature"].setdefault(key, {}).setdefault(
                        str(p["features"][key]), []).append(float(p["error"]))
    out = {}
    for name, rt in sorted(pooled.items()):
        groups = {g: stats([e for gg, e in rt["points"] if gg == g]) for g in GROUPS}
        out[name] = {"oracle": rt["oracle"], "tier": rt["tier"], "files": rt["files"],
                     "groups": {g: s for g, s in groups.items() if s["n"]},
                     "features": {key: {label: stats(errors)
                                        for label, errors in sorted(labels.items())}
                                  for key, labels in sorted(rt["by_feature"].items())},
                     "all": stats([e for _, e in rt["points"]])}
    return out


def answers_section(path: Path) -> dict:
    """Per runtime, the errors of its own answers compiled on its oracle
    (``answers_compiled.py``: the top candidates of the shipped scenarios of that runtime, full
    size and near their budgets; the compile as the tier does it by default): `stats`, with
    how many scenarios, how many compiled peaks were within the card and how many failed."""
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    rows = [r for r in doc["rows"] if r["compile"] == "compiled"]
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return {}
    out = stats([r["error"] for r in ok])
    out.update(scenarios=len({r["scenario"] for r in ok}),
               within_card=sum(bool(r["within_card"]) for r in ok),
               failed=sum(r["status"] not in ("ok", "unsupported") for r in rows),
               source=f"benchmarks/results/{path.name}")
    return {"xla-gpu": out}


def throughput_section(published: Path) -> dict:
    if not published.exists():
        return {}
    doc = json.loads(published.read_text())
    s = doc["summaries"]
    from capopt._hardware import get_hardware
    from capopt._trust import generation
    by = {}                       # the sources whose rows were predicted, by GPU and generation
    for r in doc["rows"]:
        if r.get("status") == "ok":
            gen = generation(get_hardware(r["gpu"]).compute_capability)
            for key in (r["gpu"], gen):
                by.setdefault(key, set()).add(r["source"])

    def one(v: dict, where: str | None = None) -> dict:
        t = v["throughput"]
        keep = ("n", "median_abs", "worst_signed", "mean_signed", "within_15")
        out = {k: t[k] for k in keep if k in t}
        if where is not None:
            out["sources"] = sorted(by.get(where, ()))
        return out

    return {"source": f"benchmarks/results/{published.name}",
            "frameworks": {k: one(v) for k, v in s.items()
                           if not k.startswith(("gpu ", "all")) and v["throughput"].get("n")},
            "gpus": {k[4:]: one(v, k[4:]) for k, v in s.items()
                     if k.startswith("gpu ") and v["throughput"].get("n")},
            "generations": {k[4:]: one(v, k[4:]) for k, v in s.items()
                            if k.startswith("all ") and v["throughput"].get("n")},
            "all": one(s["all"])}


def build(results: Path = RESULTS) -> dict:
    return {"generated_by": "benchmarks/trust_table.py",
            "memory": memory_section(results),
            "answers": answers_section(results / ANSWERS.name),
            "throughput": throughput_section(results / PUBLISHED.name)}


def dumps(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from _random_cases import pct
    table = build()
    Path(args.out).write_text(dumps(table))
    print("peak memory, held out, against each runtime's oracle (median / p90 / worst |error|; "
          "p90 of the shortfall, largest under-prediction)")
    print(f"{'runtime':<14} {'layout':<27} {'n':>4} {'median':>7} {'p90':>7} {'worst':>8} "
          f"{'p90 short':>9} {'under':>8}")
    for name, rt in table["memory"].items():
        for g, s in [*rt["groups"].items(), ("every layout", rt["all"])]:
            print(f"{name:<14} {g:<27} {s['n']:>4} {pct(s['median_abs']):>7} "
                  f"{pct(s['p90_abs']):>7} {s['worst_signed'] * 100:>+7.1f}% "
                  f"{pct(s['p90_under']):>9} {s['worst_under'] * 100:>+7.1f}%")
    for name, s in table["answers"].items():
        print(f"\n{name}: its own answers compiled ({s['n']} of {s['scenarios']} scenarios): "
              f"median {pct(s['median_abs'])}, p90 {pct(s['p90_abs'])}, worst "
              f"{s['worst_signed'] * 100:+.1f}%")
    thr = table["throughput"]
    if thr:
        print("\nthroughput against published runs (median |error|, worst)")
        for part in ("frameworks", "gpus", "generations"):
            for k, s in thr[part].items():
                print(f"{part[:-1]:<10} {k:<22} {s['n']:>4} {pct(s['median_abs']):>7} "
                      f"{s['worst_signed'] * 100:>+7.1f}%")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
