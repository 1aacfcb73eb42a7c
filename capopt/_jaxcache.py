"""Persistent caches of capopt's compiled programs.

The solver's compiled program depends only on the shapes of a scenario, never on its numbers,
so one compilation serves every later run. Two caches keep it:

- JAX's persistent compilation cache (`enable`), for every program: a fresh process still
  traces and lowers a program (about 1.2 s for the solver) to find its entry, then loads it
  instead of compiling.
- An ahead-of-time cache of whole executables (`load_program`, `store_program`) for the
  programs that name themselves: keyed by the program's name, its argument shapes and a
  fingerprint of everything that could change the program (capopt's source files, the JAX,
  jaxlib and Python versions, the backend and its devices, the host CPU, compiler options,
  ``XLA_FLAGS`` and JAX's configuration), so a hit skips tracing as well. Entries are written
  on a background thread after the program is compiled.

Both live under ``$XDG_CACHE_HOME/capopt/xla`` (``~/.cache/capopt/xla``). Set
``CAPOPT_CACHE_DIR`` to move them, or to an empty string to turn them off. Like JAX's cache,
the entries are executables: keep the directory private.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import sys
import threading
from pathlib import Path

_done = False


def cache_root() -> Path | None:
    """The cache directory (created), or None when caching is off or impossible."""
    target = os.environ.get("CAPOPT_CACHE_DIR")
    if target == "":
        return None
    path = Path(target) if target else Path(os.environ.get(
        "XDG_CACHE_HOME", Path.home() / ".cache")) / "capopt" / "xla"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path


def enable() -> None:
    global _done
    if _done:
        return
    _done = True
    import jax
    if jax.config.jax_compilation_cache_dir:     # the user chose one already
        return
    path = cache_root()
    if path is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


# --------------------------------------------------------------------------------------------
# Ahead-of-time executables
# --------------------------------------------------------------------------------------------
AOT_FORMAT = 1          # bump when the entry layout changes
_FINGERPRINT: list[str] = []
_WRITERS: list[threading.Thread] = []


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform
    return platform.processor()


def fingerprint() -> str:
    """A hash of everything besides a program's name and argument shapes that its compiled
    executable depends on (computed once per process)."""
    if _FINGERPRINT:
        return _FINGERPRINT[0]
    import platform

    import jax
    import jaxlib
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    devices = jax.devices()
    parts = [f"format {AOT_FORMAT}", jax.__version__, jaxlib.__version__, sys.version,
             platform.machine(), _cpu_flags(), jax.default_backend(),
             getattr(devices[0].client, "platform_version", ""),
             repr(sorted({d.device_kind for d in devices})), repr(len(devices)),
             repr(compile_options()), os.environ.get("XLA_FLAGS", ""),
             # JAX's configuration, less the cache settings (they change no program)
             repr(sorted((k, repr(v)) for k, v in jax.config.values.items()
                         if "cache" not in k))]
    for part in parts:
        h.update(part.encode())
    _FINGERPRINT.append(h.hexdigest())
    return _FINGERPRINT[0]


def program_path(name: str, signature: str) -> Path | None:
    """Where the executable of program ``name`` for argument ``signature`` is cached."""
    root = cache_root()
    if root is None:
        return None
    key = hashlib.sha256(f"{fingerprint()}\n{name}\n{signature}".encode()).hexdigest()
    return root / "aot" / f"{name}-{key[:40]}.pkl"


def has_program(name: str, signature: str) -> bool:
    path = program_path(name, signature)
    return path is not None and path.exists()


def load_program(name: str, signature: str):
    """The cached executable (a `jax.stages.Compiled`), or None. An unreadable entry (a
    partial write, another JAX) counts as a miss."""
    path = program_path(name, signature)
    if path is None or not path.exists():
        return None
    try:
        from jax.experimental.serialize_executable import deserialize_and_load
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        exe = deserialize_and_load(payload, in_tree, out_tree)
        os.utime(path)          # most recently used: `_prune` keeps it
        return exe
    except Exception:   # noqa: BLE001 - any failure to load is a miss; the caller compiles
        return None


def store_program(name: str, signature: str, compiled) -> None:
    """Queue ``compiled`` for the cache. Serialising the solver takes 0.2 s and holds the GIL,
    which would stall the search that is waiting for its answer, so entries are written at
    exit (after the answer is printed) or when a long-lived process calls `flush_writes`."""
    path = program_path(name, signature)
    if path is not None:
        with _LOCK:
            _PENDING.append((name, path, compiled))


def flush_writes() -> None:
    """Write the queued entries on a background thread (Python joins it at exit, so a
    short-lived process still finishes them)."""
    with _LOCK:
        jobs = list(_PENDING)
        _PENDING.clear()
    if jobs:
        thread = threading.Thread(target=_write, args=(jobs,), name="capopt-cache-write",
                                  daemon=False)
        thread.start()
        _WRITERS.append(thread)


def _write(jobs: list[tuple]) -> None:
    """Each entry to a temporary file, then renamed: readers never see part of one."""
    from jax.experimental.serialize_executable import serialize
    for name, path, compiled in jobs:
        try:
            blob = pickle.dumps(serialize(compiled))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, path)
            _prune(path.parent, name)
        except Exception:   # noqa: BLE001 - caching is an optimisation only
            pass


def _write_at_exit() -> None:
    """What is still queued at exit is written here, on the exiting thread (no new threads
    may start while the interpreter shuts down)."""
    with _LOCK:
        jobs = list(_PENDING)
        _PENDING.clear()
    _write(jobs)


_LOCK = threading.Lock()
_PENDING: list[tuple] = []
atexit.register(_write_at_exit)


KEEP_PER_NAME = 8      # entries kept per program name, most recently used first


def _prune(folder: Path, name: str) -> None:
    """Drop all but the `KEEP_PER_NAME` most recently used entries of ``name``: every change
    to capopt's source or to JAX makes new ones (about 4 MB each for the solver)."""
    entries = sorted(folder.glob(f"{name}-*.pkl"), key=lambda p: p.stat().st_mtime,
                     reverse=True)
    for old in entries[KEEP_PER_NAME:]:
        old.unlink(missing_ok=True)


def wait_for_writes() -> None:
    """Write what is queued and block until every cache write has finished."""
    flush_writes()
    while _WRITERS:
        _WRITERS.pop().join()


def discard_program(name: str, signature: str) -> None:
    path = program_path(name, signature)
    if path is not None:
        path.unlink(missing_ok=True)


_TLS = threading.local()
_LISTENING: list[bool] = []
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT and getattr(_TLS, "watching", False):
        _TLS.hit = True


def compile_for_cache(lowered):
    """Compile ``lowered`` for `store_program`: (executable, fresh). ``fresh`` is False when
    JAX's own persistent cache supplied the executable: XLA:CPU cannot serialise one that was
    itself deserialised (its kernels are missing when it is loaded again), so such an
    executable is used but not stored. JAX's cache does not write these programs either (they
    are cached whole), where JAX lets a thread say so."""
    import contextlib

    import jax
    if not _LISTENING:
        jax.monitoring.register_event_listener(_on_event)
        _LISTENING.append(True)
    try:
        from jax._src import config as jax_config
        no_writes = jax_config.persistent_cache_min_compile_time_secs(float("inf"))
    except (ImportError, AttributeError, TypeError):
        no_writes = contextlib.nullcontext()
    _TLS.watching, _TLS.hit = True, False
    try:
        with no_writes:
            exe = lowered.compile()
    finally:
        _TLS.watching = False
    return exe, not _TLS.hit


def compile_options() -> dict | None:
    """XLA options for capopt's own small programs on the CPU backend.

    The solver is a few thousand scalar operations inside a scan; XLA:CPU's fusion emitters
    and full LLVM optimisation spend seconds on it for no measurable run-time gain (the warm
    solve stays well under a second). Dropping them cuts compilation about threefold. Other
    backends keep their defaults.
    """
    import jax
    if jax.default_backend() != "cpu" or os.environ.get("CAPOPT_XLA_DEFAULTS"):
        return None
    return {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
