"""One candidate in its own process: ``python -m capopt.validation.worker JOB RESULT``.

``JOB`` is a pickle of ``{"tier", "scenario", "config", "index", "options"}``; the worker
writes ``RESULT`` (JSON: ``status``, ``measured``, ``details``, ``error``) and exits 0. A crash
(a signal, XLA aborting, the kernel's OOM killer) leaves no result file: the runner records it
from the exit status and the end of stderr.

``CAPOPT_VALIDATION_FAULT`` injects failures for tests: a comma-separated list of
``kind:index`` with kind ``crash`` (abort the process), ``oom`` (raise an XLA-style
``RESOURCE_EXHAUSTED``) or ``hang`` (sleep past any timeout).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback

FAULT_ENV = "CAPOPT_VALIDATION_FAULT"
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemory",
               "CUDA_ERROR_OUT_OF_MEMORY", "Resource exhausted")


def looks_like_oom(text: str) -> bool:
    return any(m in text for m in OOM_MARKERS)


def _inject(index: int) -> None:
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        kind, _, at = item.partition(":")
        if at.strip() != str(index):
            continue
        kind = kind.strip()
        if kind == "crash":
            sys.stderr.write(f"injected crash ({FAULT_ENV})\n")
            sys.stderr.flush()
            os.abort()
        if kind == "oom":
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                               f"(injected by {FAULT_ENV})")
        if kind == "hang":
            time.sleep(10 ** 6)


def _write(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(x):
    try:
        import numpy as np
        if isinstance(x, np.generic):
            return x.item()
    except ImportError:
        pass
    return str(x)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_path, result_path = argv[0], argv[1]
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    from .step import Unsupported
    from .tiers import configure_jax_for, run_tier
    tier = job["tier"]
    configure_jax_for(tier)
    t0 = time.perf_counter()
    try:
        _inject(job.get("index", -1))
        out = run_tier(tier, job["scenario"], job["config"], **job.get("options", {}))
        out["status"] = "ok"
    except Unsupported as e:
        out = {"status": "error", "error": f"unsupported: {e}"}
    except Exception as e:   # recorded, not fatal: the runner goes on with the others
        text = f"{type(e).__name__}: {e}"
        out = {"status": "oom" if looks_like_oom(text) else "error", "error": text[:4000],
               "traceback": traceback.format_exc()[-4000:]}
    out["wall_s"] = time.perf_counter() - t0
    _write(result_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
