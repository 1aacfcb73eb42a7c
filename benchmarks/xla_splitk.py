"""When XLA splits a GEMM's contracting dimension: the rule behind the padded logits gradient.

    python benchmarks/xla_splitk.py [--quick]

XLA's GPU compiler (jaxlib 0.10.2, autotuning off, as the xla-gpu tier compiles) splits the
contracting dimension K of a GEMM whose output has few tiles for the device's SMs, and pads K
to a multiple of the split. The head's input-gradient GEMM (logits gradient [tokens, V] x head
[V, h]) is such a GEMM when a micro-batch has few tokens: split, its padded operand is a
logits-sized copy the loss holds (the ``xla-gpu`` profile's ``logits_pad_copies``); not split,
there is none.

This script compiles one GEMM ``bf16(x[m, K]) @ bf16(w[K, n])`` (both cast from float32, as
the mixed-precision step's head gradient and weight are) for a deviceless GPU target and finds
by bisection the largest ``m`` at which XLA still splits K, for a grid of K, output widths n
and GPUs. It states the measured limit as output rows x 128-wide column tiles per SM, and
compares it with the profile's rule (`capopt.cost.memory.splitk_tile_limit`):

    rows x ceil(n / 128) < SMs x head_splitk_rows_per_sm x K / (K + head_splitk_half_k)

The two coefficients are read off the H100 points with K >= 1999 (1 / limit is linear in
1 / K: a least-squares line, printed); the H100 points with K < 1999 or another n and the
other GPUs (A100, B200, RTX A6000, L4) are held out. Results: ``results/xla_splitk.json``.

``--weight-grad`` measures instead the split XLA makes of square weight-gradient GEMMs
(``x[tokens, in]^T @ g[tokens, out]``, K the tokens) over a grid of sizes and token counts,
the partial sums of which, float32 ``[split, in, out]``, are buffers of the step
(``results/xla_splitk_wgrad.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
FIT_GPU = "h100-sxm-80gb"
FIT_MIN_K = 1999
# (gpu, n, K): the H100 grid over K at n = 128, wider outputs, and other GPUs at K = 5003
GRID = ([(FIT_GPU, 128, k) for k in (600, 997, 1999, 3001, 5003, 8191, 10007, 16411, 32001,
                                      50257, 128256)]
        + [(FIT_GPU, n, k) for n, k in ((256, 50257), (384, 997), (768, 5003), (256, 8191))]
        + [(g, 128, k) for g in ("a100-sxm-80gb", "b200-sxm-192gb", "rtx-a6000-48gb",
                                 "l4-pcie-24gb") for k in (1999, 5003, 32001)])
QUICK = [(FIT_GPU, 128, 1999), (FIT_GPU, 128, 5003), (FIT_GPU, 128, 32001),
         ("a100-sxm-80gb", 128, 5003)]


def _compiled_split(gpu: str, gemm):
    """In a process set up for the xla-gpu tier: a function of a GEMM's arguments (for
    ``gemm(jnp, sharding, *args)``, which returns the function and its argument shapes)
    giving the split XLA makes of its K for ``gpu`` (1: none)."""
    import glob
    import re
    import tempfile

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from capopt._hardware import get_hardware
    from capopt.validation.tiers import gpu_topology
    sharding = SingleDeviceSharding(gpu_topology(get_hardware(gpu), 1).devices[0])

    def split(*args: int) -> int:
        fn, shapes = gemm(jnp, sharding, *args)
        with tempfile.TemporaryDirectory() as d:
            # (the tier's XLA_FLAGS, autotuning off, come with the worker's environment)
            jax.jit(fn).trace(*shapes).lower().compile(compiler_options={
                "xla_dump_to": d, "xla_dump_hlo_as_text": True})
            text = Path(glob.glob(f"{d}/*after_optimizations.txt")[0]).read_text()
        # a split dot computes [split, m, n] partial sums (float32) before their reduction
        dims = re.findall(r"ROOT %dot[.\d]* = \w+\[([\d,]*)\]", text)
        shape = [int(x) for x in dims[0].split(",")] if dims else []
        return shape[0] if len(shape) == 3 else 1
    return split


def splitter(gpu: str):
    """In a process set up for the xla-gpu tier: a function of (m, n, K) giving the split XLA
    makes of the GEMM's K for ``gpu`` (1: none): ``bf16(x[m, K]) @ bf16(w[K, n])``, both
    cast from float32."""
    def gemm(jnp, sharding, m: int, n: int, k: int):
        import jax
        return ((lambda x, w: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)),
                (jax.ShapeDtypeStruct((m, k), jnp.float32, sharding=sharding),
                 jax.ShapeDtypeStruct((k, n), jnp.float32, sharding=sharding)))
    return _compiled_split(gpu, gemm)


def wgrad_splitter(gpu: str):
    """In a process set up for the xla-gpu tier: a function of (in, out, tokens) giving the
    split XLA makes of a weight-gradient GEMM's K, the tokens (``x[t, in]^T @ g[t, out]``,
    both bf16, as a mixed-precision step's activations and output gradients are)."""
    def gemm(jnp, sharding, i: int, o: int, t: int):
        import jax
        return ((lambda x, g: jnp.einsum("ti,to->io", x, g)),
                (jax.ShapeDtypeStruct((t, i), jnp.bfloat16, sharding=sharding),
                 jax.ShapeDtypeStruct((t, o), jnp.bfloat16, sharding=sharding)))
    return _compiled_split(gpu, gemm)


# square weight-gradient outputs x tokens of a micro-batch (one H100)
WGRAD_SIZES = (64, 128, 256, 384, 512, 768, 1024, 2048)
WGRAD_TOKENS = (128, 512, 1024, 2048, 4096, 8192, 32768)


def weight_grad_table() -> int:
    """Print and write (``results/xla_splitk_wgrad.json``) the split XLA makes of square
    weight-gradient GEMMs over the grid, on an H100 target."""
    from capopt._specs import Config
    from capopt.validation.tiers import environment
    from _random_cases import xla_gpu_refusal
    refused = xla_gpu_refusal()
    if refused:
        return refused
    t0 = time.perf_counter()
    jobs = [(s, s, t) for s in WGRAD_SIZES for t in WGRAD_TOKENS]
    proc = subprocess.run([sys.executable, __file__, "--wgrad-worker", FIT_GPU,
                           json.dumps(jobs)], env=environment("xla-gpu", Config()),
                          capture_output=True, text=True)
    got = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or len(got) != len(jobs):
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        print(f"error: the worker failed: {tail[0]}", file=sys.stderr)
        return 1
    split = {(r["in"], r["tokens"]): r["split"] for r in got}
    print(f"split of K (tokens) XLA makes of x^T g, bf16, output in x out, on {FIT_GPU}")
    print(f"{'in = out':>9s} " + " ".join(f"{t:>6d}" for t in WGRAD_TOKENS))
    for s in WGRAD_SIZES:
        print(f"{s:>9d} " + " ".join(f"{split[(s, t)]:>6d}" for t in WGRAD_TOKENS))
    out = {"compiler": "jaxlib 0.10.2 (XLA GPU, autotuning off, deviceless target)",
           "gpu": FIT_GPU, "points": got, "total_s": time.perf_counter() - t0}
    path = RESULTS / "xla_splitk_wgrad.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path} in {out['total_s']:.0f} s")
    return 0


def worker(gpu: str, jobs: list[tuple[int, int]]) -> None:
    """One JSON line per (n, K) with the largest m at which XLA splits the GEMM's K (0 if it
    does not split even at m = 64)."""
    from capopt._hardware import get_hardware
    split = splitter(gpu)
    sm_count = get_hardware(gpu).sm_count
    for n, k in jobs:
        t0 = time.perf_counter()
        lo, hi = 64, 1024
        if split(lo, n, k) == 1:
            lo = 0
        else:
            while split(hi, n, k) > 1:
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if split(mid, n, k) > 1 else (lo, mid)
        print(json.dumps({"gpu": gpu, "sm_count": sm_count, "n": n, "k": k,
                          "last_split_rows": lo, "s": round(time.perf_counter() - t0, 1)}),
              flush=True)


def measure(grid: list[tuple[str, int, int]], path: Path) -> list[dict]:
    """Every point of ``grid`` (measured ones read back from the JSONL at ``path``)."""
    from capopt._specs import Config
    from capopt.validation.tiers import environment
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            done[(r["gpu"], r["n"], r["k"])] = r
    todo: dict[str, list] = {}
    for g, n, k in grid:
        if (g, n, k) not in done:
            todo.setdefault(g, []).append((n, k))
    env = environment("xla-gpu", Config())
    for g, jobs in todo.items():
        print(f"  {g}: {len(jobs)} GEMMs to bisect", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--worker", g, json.dumps(jobs)],
                              env=env, capture_output=True, text=True)
        got = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 and not got:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            print(f"  {g}: failed: {tail[0]}", flush=True)
        with path.open("a") as f:
            for r in got:
                f.write(json.dumps(r) + "\n")
                done[(r["gpu"], r["n"], r["k"])] = r
                print(f"    n {r['n']:4d} K {r['k']:6d}: splits up to {r['last_split_rows']} "
                      f"rows ({r['s']:.0f} s)", flush=True)
    return [done[p] for p in grid if p in done]


def per_sm(r: dict) -> float:
    return r["last_split_rows"] * -(-r["n"] // 128) / r["sm_count"]


def derive(points: list[dict]) -> dict:
    """``head_splitk_rows_per_sm`` and ``head_splitk_half_k`` from the fitting points:
    limit = R K / (K + K_half), so 1 / limit = 1 / R + (K_half / R) / K (least squares)."""
    import numpy as np
    x = np.array([1.0 / r["k"] for r in points])
    y = np.array([1.0 / per_sm(r) for r in points])
    slope, icept = np.polyfit(x, y, 1)
    return {"head_splitk_rows_per_sm": 1.0 / icept, "head_splitk_half_k": slope / icept}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="four points only")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--probe", nargs=4, metavar=("GPU", "M", "N", "K"),
                    help="print the split XLA makes of one GEMM's K (run in the tier's "
                         "environment, as the workers are)")
    ap.add_argument("--weight-grad", action="store_true",
                    help="instead: the split of square weight-gradient GEMMs over a grid of "
                         "sizes and tokens (results/xla_splitk_wgrad.json)")
    ap.add_argument("--wgrad-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.wgrad_worker:
        split = wgrad_splitter(args.wgrad_worker[0])
        for i, o, t in json.loads(args.wgrad_worker[1]):
            print(json.dumps({"in": i, "out": o, "tokens": t, "split": split(i, o, t)}),
                  flush=True)
        return 0
    if args.weight_grad:
        return weight_grad_table()
    if args.probe:
        gpu, m, n, k = args.probe
        print(splitter(gpu)(int(m), int(n), int(k)))
        return 0
    if args.worker:
        worker(args.worker[0], [tuple(j) for j in json.loads(args.worker[1])])
        return 0
    from capopt._runtime import get_profile
    from capopt.cost.memory import splitk_tile_limit
    from _random_cases import xla_gpu_refusal
    refused = xla_gpu_refusal()
    if refused:
        return refused
    t0 = time.perf_counter()
    grid = QUICK if args.quick else GRID
    rows = measure(grid, RESULTS / "xla_splitk.jsonl")
    profile = get_profile("xla-gpu")
    rule = {k: profile.coeff(k) for k in ("head_splitk_rows_per_sm", "head_splitk_half_k")}
    fit = [r for r in rows if r["gpu"] == FIT_GPU and r["n"] == 128 and r["k"] >= FIT_MIN_K]
    derived = derive(fit) if len(fit) >= 2 else {}
    print("\nlargest output rows x 128-wide column tiles at which XLA splits K, per SM, "
          "against the xla-gpu profile's rule")
    print(f"{'gpu':16s} {'SMs':>4s} {'n':>4s} {'K':>7s} {'split':>7s}  {'measured':>8s} "
          f"{'rule':>7s} {'error':>7s}")
    points = []
    for r in rows:
        limit = float(splitk_tile_limit(r["sm_count"], r["k"], rule["head_splitk_rows_per_sm"],
                                        rule["head_splitk_half_k"])) / r["sm_count"]
        split = "fit" if r in fit else "heldout"
        err = limit / per_sm(r) - 1.0 if per_sm(r) > 0 else float("nan")
        points.append({**r, "split": split, "measured_per_sm": per_sm(r),
                       "rule_per_sm": limit, "error": err})
        print(f"{r['gpu']:16s} {r['sm_count']:4d} {r['n']:4d} {r['k']:7d} {split:>7s}  "
              f"{per_sm(r):8.1f} {limit:7.1f} {100 * err:+6.1f}%")
    summary = {}
    for s in ("fit", "heldout"):
        errs = sorted(abs(p["error"]) for p in points if p["split"] == s)
        if errs:
            summary[s] = {"n": len(errs), "median_abs": errs[len(errs) // 2],
                          "worst_abs": errs[-1]}
            print(f"{s:8s} n {len(errs):2d}  median |error| {100 * errs[len(errs) // 2]:.1f}%  "
                  f"worst {100 * errs[-1]:.1f}%")
    if derived:
        print("read off the fitting points: " + ", ".join(f"{k} = {v:.0f}"
                                                          for k, v in derived.items())
              + "; the profile holds " + ", ".join(f"{k} = {v:g}" for k, v in rule.items()))
    out = {"compiler": "jaxlib 0.10.2 (XLA GPU, autotuning off, deviceless target)",
           "profile_rule": rule, "derived_from_fit": derived, "summary": summary,
           "points": points, "total_s": time.perf_counter() - t0}
    if args.quick:
        return 0
    path = RESULTS / "xla_splitk.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path} in {out['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
