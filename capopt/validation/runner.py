"""`validate`: each candidate in its own process, results streamed to JSONL, resumable.

Every candidate runs ``python -m capopt.validation.worker`` with the environment its tier
needs (virtual CPU devices, the GPU target's flags) and a timeout. An out-of-memory error or a
crash is recorded (status ``oom`` / ``error``, with its message) and the others go on. With
``out=...`` each finished result is appended to that JSONL file at once, so an interrupted
run keeps what finished; running again skips the configs already in the file (``retry=True``
runs the failed ones again).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .._errors import CapoptError
from .._format import bar, config_line
from .._specs import Config, Scenario, stable_text
from .predict import (judged_torch_measurement, predicted_terms, predicted_torch_terms,
                      relative_error, tier_terms)
from .tiers import (TIERS, deepspeed_available, environment, torch_available,
                    xla_gpu_available)
from .worker import looks_like_oom

DEFAULT_TIMEOUT_S = 900.0


def tier_scenario(scenario: Scenario, tier: str, profile: str | None = None) -> Scenario:
    """The scenario with the runtime profile of what the tier runs: ``xla-cpu`` for exact,
    ``xla-gpu`` (or the scenario's own ``xla-gpu*`` profile, e.g. a calibrated one) for the
    GPU tiers, ``pytorch-eager`` for the torch tier, ``deepspeed`` (or the scenario's own
    ``deepspeed*``) for the deepspeed tier, ``maxtext`` (or the scenario's own ``maxtext*``)
    for the maxtext tier; ``profile`` (a name or a path) overrides."""
    from .._runtime import get_profile
    if profile is not None:
        return scenario.replace(runtime=get_profile(profile))
    own = scenario.runtime.name
    if tier == "torch":
        return (scenario if own.startswith("pytorch-eager")
                else scenario.replace(runtime=get_profile("pytorch-eager")))
    if tier == "deepspeed":
        return (scenario if own.startswith("deepspeed")
                else scenario.replace(runtime=get_profile("deepspeed")))
    if tier == "exact":
        return scenario if own == "xla-cpu" else scenario.replace(runtime=get_profile("xla-cpu"))
    if tier == "maxtext":
        return (scenario if own.startswith("maxtext")
                else scenario.replace(runtime=get_profile("maxtext")))
    if own.startswith("xla-gpu"):
        return scenario
    return scenario.replace(runtime=get_profile("xla-gpu"))


def scenario_fingerprint(sc: Scenario) -> str:
    text = stable_text((sc.model, sc.workload, sc.hardware.name, sc.count, sc.runtime.name,
                        sc.runtime.coeffs))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


# (compiled without XLA's latency-hiding scheduler: another measurement of the config)
NO_LHS_SUFFIX = "|no-latency-hiding"


def result_key(tier: str, sc: Scenario, config: Config, options: dict | None = None) -> str:
    key = f"{tier}|{scenario_fingerprint(sc)}|{json.dumps(config.key_dict(), sort_keys=True)}"
    return key + (NO_LHS_SUFFIX if (options or {}).get("latency_hiding") is False else "")


def without_latency_hiding(key: str) -> bool:
    """Whether a record's ``key`` (see `result_key`) is a compile without the scheduler."""
    return key.endswith(NO_LHS_SUFFIX)


def input_bytes(sc: Scenario, config: Config) -> int:
    """One device's share of the step's batch, plus the 8-byte PRNG key (see `step`)."""
    from .step import batch_shapes, precision_dtypes
    import numpy as np
    try:
        compute = precision_dtypes(sc)["compute"]
    except Exception:
        return 0
    total = 0
    for shape, dtype in batch_shapes(sc, config, compute).values():
        n = int(np.prod(shape)) // config.dp
        total += n * np.dtype(dtype).itemsize
    return total + 8


# --------------------------------------------------------------------------------------------
@dataclass
class ValidationReport:
    """Results in candidate order; ``to_dict()`` is the ``validate --json`` contract."""

    scenario: str
    tier: str
    results: list[dict[str, Any]]
    out: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "tier": self.tier, "results": self.results,
                "notes": self.notes, "out": self.out}

    @property
    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r["status"] == "ok"]

# --------------------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr (one line per event when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()          # updates come from worker threads (jobs > 1)
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def start(self, label: str) -> None:
        """A candidate begins (on a terminal: the bar says which one is being measured)."""
        with self.lock:
            if self.enabled and self.tty:
                self.stream.write("\r\033[K" + self._line("running", label))
                self.stream.flush()

    def update(self, label: str, status: str) -> None:
        with self.lock:
            self._update(label, status)

    def _line(self, status: str, label: str) -> str:
        return (f"[{bar(self.done / max(self.total, 1), 20)}] {self.done}/{self.total} "
                f"{status:<7} {label}  {time.perf_counter() - self.t0:,.0f} s")

    def _update(self, label: str, status: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        text = self._line(status, label)
        if self.tty:
            self.stream.write("\r\033[K" + text)
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


# --------------------------------------------------------------------------------------------
TMP_PREFIX = "capopt-validate-"


def _die_with_parent() -> None:
    """In the worker, before exec: be killed when the validating process dies (Linux), so a
    SIGKILLed ``capopt validate`` leaves no compile running."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _remove_stale_work_dirs() -> None:
    """Work folders of validating processes that no longer exist (killed before cleaning)."""
    import shutil
    root = Path(tempfile.gettempdir())
    for d in root.glob(f"{TMP_PREFIX}*"):
        try:
            pid = int(d.name[len(TMP_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue


def quiet_exec_fork_warning() -> None:
    """Filter JAX's warning that os.fork() in a multithreaded process may deadlock, for forks
    made by `subprocess`. It is about a child that goes on running JAX; subprocess's children
    exec at once (a worker after one prctl call, `_die_with_parent`; Ray's local processes).
    Set where the processes start rather than at import, so it holds under any caller's
    ``catch_warnings`` (idempotent: filterwarnings replaces an identical filter)."""
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                            category=RuntimeWarning, module="subprocess")


def _run_one(job: dict, timeout_s: float) -> dict[str, Any]:
    """Run one worker process; never raises for what happens inside it."""
    quiet_exec_fork_warning()
    with tempfile.TemporaryDirectory(prefix=f"{TMP_PREFIX}{os.getpid()}-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "result.json")
        with open(job_path, "wb") as f:
            pickle.dump(job, f)
        env = environment(job["tier"], job["config"])
        cmd = [sys.executable, "-m", "capopt.validation.worker", job_path, result_path]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout_s, cwd=_package_root(),
                                  preexec_fn=_die_with_parent if os.name == "posix" else None)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or "")[-800:] if isinstance(e.stderr, str) else ""
            return {"status": "error", "error": f"timeout after {timeout_s:g} s" +
                    (f": {tail.strip()}" if tail.strip() else ""),
                    "wall_s": time.perf_counter() - t0}
        if os.path.exists(result_path):
            with open(result_path) as f:
                return json.load(f)
        tail = (proc.stderr or "")[-2000:].strip()
        why = _exit_reason(proc.returncode)
        status = "oom" if (looks_like_oom(tail) or proc.returncode == -9) else "error"
        last = tail.splitlines()[-1] if tail else ""
        return {"status": status, "error": f"worker {why}" + (f": {last}" if last else ""),
                "stderr_tail": tail, "wall_s": time.perf_counter() - t0}


def run_deepspeed(scenario: Scenario, config: Config, *, explain: bool = False,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Measure one steady-state DeepSpeed step of ``config`` in a fresh worker process (the
    validation runner's): ``{"measured": {...}, "details": {...}}``; with ``explain``,
    ``details["live_at_peak"]`` lists what was live at the peak (category, op, dtype, shape,
    bytes), largest first. Raises `Unsupported` for a candidate the tier does not run and
    `RuntimeError` (with the worker's error) when the step fails or times out."""
    from .deepspeed_step import check_supported
    check_supported(scenario, config)
    res = _run_one({"tier": "deepspeed", "scenario": scenario, "config": config, "index": -1,
                    "options": {"explain": explain}}, timeout_s)
    if res.get("status") != "ok":
        raise RuntimeError(f"the DeepSpeed step failed: {res.get('error')}")
    return {"measured": res["measured"], "details": res["details"]}


def _exit_reason(code: int) -> str:
    if code is not None and code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code} and no result"


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def predicted_compiled_terms(config: Config, sc: Scenario, *, tier: str, measured: dict,
                             details: dict) -> dict[str, Any]:
    """The current model's terms for a compiled tier's measurement (xla-gpu, exact,
    maxtext): the batch the step takes (MaxText's is its own: the tier measures it), the
    leaves it returns and the compiler options it was compiled with, as recorded."""
    batch = (measured.get("input_bytes", 0) if tier == "maxtext"
             else input_bytes(sc, config))
    return predicted_terms(config, sc, input_bytes=batch,
                           output_leaves=int(details.get("output_leaves", 0)),
                           compiler_options=details.get("compiler_options"))


def _finish(result: dict, *, tier: str, sc: Scenario, config: Config, index: int,
            key: str) -> dict[str, Any]:
    """The contract's record: config, tier, status, predicted, measured, error."""
    measured = result.get("measured") or {}
    if tier == "torch":
        measured = judged_torch_measurement(measured, sc.runtime)
    details = result.get("details") or {}
    terms, parts = tier_terms(tier)
    try:
        if tier in ("torch", "deepspeed"):
            predicted = predicted_torch_terms(config, sc)
            if tier == "deepspeed":      # its meter marks no gradients: they are in the rest
                predicted["rest_bytes"] += predicted["grads_bytes"]
        else:
            predicted = predicted_compiled_terms(config, sc, tier=tier, measured=measured,
                                                 details=details)
    except Exception as e:   # a prediction that fails is itself a finding; keep going
        predicted = {}
        details["prediction_error"] = f"{type(e).__name__}: {e}"
    rec: dict[str, Any] = {
        "config": config.to_dict(), "tier": tier, "status": result.get("status", "error"),
        "predicted": {k: predicted.get(k) for k in (*terms, *parts, "step_s")},
        "measured": {k: measured.get(k) for k in (*terms, *parts, "step_s")},
    }
    if sc.choices:                      # (the [training] values the search chose for it)
        rec["training"] = training_choices(sc)
    extra_pred = {k: v for k, v in predicted.items() if k not in rec["predicted"]}
    if extra_pred:
        rec["predicted_terms"] = extra_pred
    for k, v in measured.items():
        if k not in rec["measured"]:
            rec["measured"][k] = v
    if rec["status"] == "ok":
        rec["error"] = {k: relative_error(rec["predicted"].get(k), rec["measured"].get(k))
                        for k in rec["measured"] if k in rec["predicted"]}
    else:
        rec["error"] = result.get("error", "unknown failure")
        for k in ("traceback", "stderr_tail"):
            if result.get(k):
                rec[k] = result[k]
    rec.update(index=index, key=key, scenario=sc.name, runtime=sc.runtime.name,
               details=details, wall_s=result.get("wall_s"))
    return rec


def load_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record in a JSONL results file: a torn last line from a crash, and lines that are
    not a JSON object, are skipped; a file that is not text is an error naming it."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    if p.is_dir():
        raise CapoptError("is a directory, not a results file", file=str(p), field="--out")
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise CapoptError(f"not a JSONL results file: {e}", file=str(p), field="--out") from None
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def finished(rec: dict) -> bool:
    """A record that can stand for its candidate on a rerun: one whose measurement is whole
    (status ok with every measured term), or a failure that says why."""
    status = rec.get("status")
    if status == "ok":
        m = rec.get("measured")
        terms = tier_terms(str(rec.get("tier")))[0]
        return isinstance(m, dict) and all(isinstance(m.get(k), (int, float)) for k in terms)
    return status in ("oom", "error") and isinstance(rec.get("error"), str)


def _append(path: Path, rec: dict) -> None:
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():                  # a torn last line (a crash mid-write) ends here first
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(rec, default=str) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _as_config(c) -> Config:
    if isinstance(c, Config):
        return c
    if isinstance(c, dict):
        return Config(**c)
    cfg = getattr(c, "config", None)       # a Plan
    if isinstance(cfg, Config):
        return cfg
    raise CapoptError(f"not a config: {c!r}", field="configs")


def validate(scenario: Scenario | str | dict, *, top_k: int = 3, tier: str = "exact",
             configs: Iterable[Config | dict] | None = None, out: str | os.PathLike | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, progress: bool = True,
             profile: str | None = None, retry: bool = False, jobs: int = 1,
             options: dict | None = None, ray: str | None = None) -> ValidationReport:
    """Compile (tier ``exact`` / ``xla-gpu``) or run (tier ``device``) candidates as real Flax
    training steps and compare XLA's memory with the cost model's prediction.

    Args:
        scenario: a `Scenario`, a scenario path or name, or a dict.
        top_k: how many of `capopt.optimize`'s candidates to check (when ``configs`` is None).
        tier: ``"exact"`` | ``"xla-gpu"`` | ``"device"``.
        configs: explicit configs (`Config`, dicts of knobs, or plans) instead of optimizing.
        out: a JSONL file: results are appended as they finish; configs already there are
            skipped (``retry=True`` runs failed ones again).
        timeout_s: per candidate, compile and run included.
        progress: a progress bar on stderr.
        profile: the runtime profile for the prediction (default: the tier's, see
            `tier_scenario`).
        jobs: candidates measured at once (each in its own process).
        ray: a Ray cluster's address (``auto``, ``local`` or ``ray://HOST:PORT``): each
            candidate runs there as a task (`capopt.validation.cluster`) instead of here.
        options: passed to the tier (device: ``warmup``, ``steps``, ``monitor``; xla-gpu:
            ``latency_hiding=False`` compiles without XLA's latency-hiding scheduler,
            `capopt.validation.compiler_options.NO_LATENCY_HIDING_OPTIONS`).

    Returns:
        A `ValidationReport`; ``to_dict()`` is ``{"results": [{"config", "tier", "status",
        "predicted", "measured", "error", ...}]}``.

    Example::

        report = capopt.validate("gpt2-124m-rtx4090", top_k=2)
        print(capopt.report.render(report))
    """
    from .._scenario import load_scenario
    if tier not in TIERS:
        raise CapoptError(f"unknown tier {tier!r}", field="--tier", allowed=", ".join(TIERS))
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    notes: list[str] = []
    if configs is None:
        from ..search import optimize
        res = optimize(sc, top_k=top_k)
        cands = [p.config for p in res.candidates]
        # (each candidate with its own scenario: the GPU and the [training] values the
        # search chose for it)
        scenarios = [p.scenario for p in res.candidates]
        if not cands:
            notes.append(f"optimize found no config that fits ({res.status}); nothing to "
                         "validate")
    else:
        cands = [_as_config(c) for c in configs]
        scenarios = [sc] * len(cands)
    tscs = [tier_scenario(s, tier, profile) for s in scenarios]
    tier_scenario(sc, tier, profile)     # (the tier and profile checked, candidates or not)
    if tier in ("xla-gpu", "torch", "deepspeed", "maxtext"):
        from .maxtext_tier import maxtext_available
        ok, why = {"xla-gpu": xla_gpu_available, "torch": torch_available,
                   "deepspeed": deepspeed_available, "maxtext": maxtext_available}[tier]()
        if not ok:
            raise CapoptError(why, field="--tier")
    path = Path(out) if out is not None else None
    done: dict[str, dict] = {}
    _remove_stale_work_dirs()
    if path is not None:
        if path.is_dir():
            raise CapoptError("is a directory; give a .jsonl file to stream results to",
                              file=str(path), field="--out")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CapoptError(f"cannot create its folder: {e.strerror}", file=str(path),
                              field="--out") from None
        for rec in load_results(path):
            if (isinstance(rec.get("key"), str) and finished(rec)
                    and (not retry or rec.get("status") == "ok")):
                done[rec["key"]] = rec
    keys = [result_key(tier, t, c, options) for t, c in zip(tscs, cands)]
    todo = [i for i, k in enumerate(keys) if k not in done]
    if path is not None and len(todo) < len(cands):
        notes.append(f"resumed: {len(cands) - len(todo)} result(s) from {path}")
    if ray is not None:
        from .cluster import connect
        quiet_exec_fork_warning()      # "local" starts Ray's processes by fork and exec
        connect(ray)
    bar = Progress(len(todo), enabled=progress and bool(todo))
    results: dict[int, dict] = {}

    def job(i: int) -> dict:
        return {"tier": tier, "scenario": tscs[i], "config": cands[i], "index": i,
                "options": dict(options or {})}

    def keep(i: int, result: dict) -> dict:
        """A finished candidate: its record, streamed to ``out`` at once."""
        rec = _finish(result, tier=tier, sc=tscs[i], config=cands[i], index=i, key=keys[i])
        if path is not None:
            _append(path, rec)
        bar.update(config_line(rec["config"]), rec["status"])
        return rec

    def work(i: int) -> dict:
        bar.start(config_line(cands[i].to_dict()))
        return keep(i, _run_one(job(i), timeout_s))

    if tier == "device":
        jobs = 1             # one accelerator: candidates timed one after another
    if ray is not None:
        from .cluster import run_tasks
        for i, result in run_tasks(((i, job(i)) for i in todo), _run_one, timeout_s,
                                   gpus=1.0 if tier == "device" else 0.0):
            results[i] = keep(i, result)
    elif jobs > 1 and len(todo) > 1:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for i, rec in zip(todo, pool.map(work, todo)):
                results[i] = rec
    else:
        for i in todo:
            results[i] = work(i)
    ordered = [results[i] if i in results else done[keys[i]] for i in range(len(cands))]
    return ValidationReport(scenario=sc.name, tier=tier, results=ordered,
                            out=str(path) if path else None, notes=notes)


__all__ = ["Progress", "ValidationReport", "input_bytes", "load_results",
           "predicted_compiled_terms", "result_key",
           "run_deepspeed", "tier_scenario", "validate"]
