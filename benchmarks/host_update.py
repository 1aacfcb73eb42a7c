"""How fast a PyTorch optimizer steps on the host: the rate behind parameter offload's step.

    python benchmarks/host_update.py [--params 50e6] [--threads 1]

Under parameter offload (``config.offload_params``: FSDP2's CPUOffloadPolicy, torch v2.13)
the optimizer step runs on the CPU over the device's shard of the parameters. torchrun gives
each process one OpenMP thread when it starts more than one a node (torch/distributed/run.py:
OMP_NUM_THREADS = 1 unless set), so the step is one thread's. This script times
``torch.optim.AdamW(foreach=True)`` on float32 parameters with float32 gradients, the state
created by a first step, on this machine's CPU with that many threads, and states the rate as
bytes a second of the update's memory traffic as the cost model counts it
(`capopt.cost.time`: gradient 4 + two moments read and written 16 + the parameter read and
written 8 = 28 bytes a parameter). The profiles' ``host_update_bytes_s`` cites the figure in
``results/host_update.json``; a different CPU gives a different one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BYTES_PER_PARAM = 4 + 2 * 8 + 2 * 4          # AdamW, float32 parameter, gradient and moments


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50e6, help="parameters stepped")
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "host_update.json"))
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    n = int(args.params)
    tensors = 10
    params = [torch.nn.Parameter(torch.randn(n // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    opt.step()                                   # (the state, created by a first step)
    times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        print(f"  step {i + 1}/{args.repeats}: {times[-1]:.3f} s", flush=True)
    best = min(times)
    stepped = tensors * (n // tensors)
    rate = BYTES_PER_PARAM * stepped / best
    out = {"cpu": cpu_name(), "torch": torch.__version__, "threads": args.threads,
           "load_average": os.getloadavg()[0], "params": stepped,
           "bytes_per_param": BYTES_PER_PARAM, "step_s": times, "best_step_s": best,
           "bytes_per_s": rate, "params_per_s": stepped / best}
    print(f"\n{out['cpu']}, torch {out['torch']}, {args.threads} thread(s), load "
          f"{out['load_average']:.1f}")
    print(f"AdamW(foreach) step of {stepped / 1e6:.0f}M float32 parameters: best "
          f"{best:.3f} s of {args.repeats}, {stepped / best / 1e6:.0f}M parameters/s, "
          f"{rate / 1e9:.2f} GB/s of {BYTES_PER_PARAM} B a parameter")
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
