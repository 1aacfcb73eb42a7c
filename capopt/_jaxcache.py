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
  when the process exits.

Both live under ``$XDG_CACHE_HOME/capopt/xla`` (``~/.cache/capopt/xla``). Set
``CAPOPT_CACHE_DIR`` to move them, or to an empty string to turn them off. Like JAX's cache,
the entries are executables: keep the directory private. Neither cache is ever a reason to
fail: a directory that cannot be read or written, an entry that is damaged or belongs to
another program, each falls back to compiling, with at most one warning line per process.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import pickle
import sys
import threading
from pathlib import Path

_log = logging.getLogger("capopt")
_warned = threading.Event()      # set once the one warning line has been printed
_WARN_LOCK = threading.Lock()    # the solver and the warm-up threads may fail at once


def _cannot_use(what: Path, err: BaseException | str) -> None:
    """Say, once per process, that the cache cannot be used and the program is compiled."""
    with _WARN_LOCK:
        if _warned.is_set():
            return
        _warned.set()
    why = str(err).splitlines()[0] if str(err) else type(err).__name__
    _log.warning("capopt: not using the compilation cache at %s (%s); compiling instead",
                 what, why)


def cache_root() -> Path | None:
    """The cache directory (created), or None when caching is off or impossible (a folder
    that cannot be created, read or written: said once)."""
    target = os.environ.get("CAPOPT_CACHE_DIR")
    if target == "":
        return None
    path = Path(target) if target else Path(os.environ.get(
        "XDG_CACHE_HOME", Path.home() / ".cache")) / "capopt" / "xla"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        _cannot_use(path, e)
        return None
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        _cannot_use(path, "no permission to read and write it")
        return None
    return path


@functools.cache
def enable() -> None:
    """Point JAX's persistent compilation cache at `cache_root` (once per process), unless the
    user chose a directory already."""
    import jax
    if jax.config.jax_compilation_cache_dir:     # the user chose one already
        return
    path = cache_root()
    if path is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


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


# --------------------------------------------------------------------------------------------
# Ahead-of-time executables
# --------------------------------------------------------------------------------------------
AOT_FORMAT = 3          # bump when the entry layout or the key changes


def source_hash() -> str:
    """A hash of capopt's source files as they are on disk now."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


# Taken when capopt is imported, i.e. of the code this process runs: a file edited while it
# runs must not label this process's programs (`_write` checks the hash again).
_SOURCE_HASH = source_hash()


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


@functools.cache
def _fixed_part() -> str:
    """What cannot change while a process runs: source, versions, backend, host."""
    import platform

    import jax
    import jaxlib
    import optax
    devices = jax.devices()
    parts = [f"format {AOT_FORMAT}", _SOURCE_HASH, jax.__version__, jaxlib.__version__,
             optax.__version__, sys.version, platform.machine(), _cpu_flags(),
             jax.default_backend(), getattr(devices[0].client, "platform_version", ""),
             repr(sorted({d.device_kind for d in devices})), repr(len(devices)),
             repr(compile_options()), os.environ.get("XLA_FLAGS", "")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def fingerprint() -> str:
    """A hash of everything besides a program's name and argument shapes that its compiled
    executable depends on: capopt's source as imported, the JAX, jaxlib, optax and Python
    versions, the backend and its devices, the host CPU, compiler options, ``XLA_FLAGS``, and
    JAX's configuration as it is now (less its cache settings, which change no program)."""
    import jax
    config = repr(sorted((k, repr(v)) for k, v in jax.config.values.items()
                         if "cache" not in k))
    return hashlib.sha256(f"{_fixed_part()}\n{config}".encode()).hexdigest()


def program_label(name: str) -> str:
    """The name a cached program is compiled under (its HLO module name): it carries the
    fixed part of the fingerprint, so JAX's own persistent cache, whose key starts with the
    module name, never holds an entry for it from other code (see `compile_for_cache`)."""
    return f"capopt_{name.replace('-', '_')}_{_fixed_part()[:12]}"


def program_path(name: str, signature: str) -> Path | None:
    """Where the executable of program ``name`` for argument ``signature`` is cached."""
    root = cache_root()
    if root is None:
        return None
    key = hashlib.sha256(f"{fingerprint()}\n{name}\n{signature}".encode()).hexdigest()
    return root / "aot" / f"{name}-{key[:40]}.pkl"


def has_program(path: Path) -> bool:
    """Whether an entry is at ``path`` (False, said once, where it cannot be looked at)."""
    try:
        return path.is_file()
    except OSError as e:
        _cannot_use(path.parent, e)
        return False


def load_program(path: Path):
    """The executable cached at ``path`` (a `jax.stages.Compiled`), or None: missing,
    unreadable (a partial write, another JAX, no permission) or written for another entry (a
    file renamed or copied over another), which counts as a miss. An entry written for
    another is discarded (and said once), so that the next run does not trip on it again; one
    that does not unpickle is left to be overwritten by the next write."""
    try:
        blob = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        _cannot_use(path, e)
        return None
    try:
        from jax.experimental.serialize_executable import deserialize_and_load
        entry, payload, in_tree, out_tree = pickle.loads(blob)
    except Exception:   # noqa: BLE001 - any failure to load is a miss; the caller compiles
        return None
    if entry != path.name:
        discard_program(path, f"it holds the entry {str(entry)[:60]!r}")
        return None
    try:
        exe = deserialize_and_load(payload, in_tree, out_tree)
        os.utime(path)          # most recently used: `_prune` keeps it
        return exe
    except Exception:   # noqa: BLE001 - any failure to load is a miss; the caller compiles
        return None


def discard_program(path: Path, why: str) -> None:
    """Remove an entry that loaded but cannot run (and say so, once: it should not happen)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
    _cannot_use(path, f"discarded: {why}" if why else "discarded: it failed to run")


def store_program(path: Path, name: str, compiled) -> None:
    """Queue ``compiled`` (program ``name``) for ``path``. Serialising the solver takes 0.2 s
    and holds the GIL, which would stall the search that is waiting for its answer, so entries
    are written at exit (after the answer is printed) or when a long-lived process calls
    `flush_writes`. A program queued twice is written once."""
    with _LOCK:
        _flush_at_exit()
        _PENDING[path] = (name, compiled)


def flush_writes() -> None:
    """Write the queued entries now, each to a temporary file that is then renamed (readers
    never see part of one). Nothing is written if capopt's source changed on disk since this
    process imported it. Runs at exit."""
    with _LOCK:
        jobs = list(_PENDING.items())
        _PENDING.clear()
    if not jobs or source_hash() != _SOURCE_HASH:
        return
    from jax.experimental.serialize_executable import serialize
    for path, (name, compiled) in jobs:
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            blob = pickle.dumps((path.name, *serialize(compiled)))
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp.write_bytes(blob)
            os.replace(tmp, path)
            _prune(path.parent, name)
        except OSError as e:      # caching is an optimisation only: say so once, go on
            _cannot_use(path.parent, e)
        except Exception:   # noqa: BLE001 - an executable that does not serialise: no entry
            pass
        finally:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


_LOCK = threading.Lock()
_PENDING: dict = {}


@functools.cache
def _flush_at_exit() -> None:
    """Register `flush_writes` at exit, once (after JAX's own exit handler: it runs first)."""
    atexit.register(flush_writes)


KEEP_PER_NAME = 8      # entries kept per program name, most recently used first


def _prune(folder: Path, name: str) -> None:
    """Drop all but the `KEEP_PER_NAME` most recently used entries of ``name``: every change
    to capopt's source or to JAX makes new ones (about 4 MB each for the solver)."""
    def used(p: Path) -> int:
        try:
            return p.stat().st_mtime_ns
        except FileNotFoundError:       # pruned by another process meanwhile
            return -1
    entries = sorted(folder.glob(f"{name}-*.pkl"), key=used, reverse=True)
    for old in entries[KEEP_PER_NAME:]:
        old.unlink(missing_ok=True)


_TLS = threading.local()
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT and getattr(_TLS, "watching", False):
        _TLS.hit = True


@functools.cache
def _listen_for_cache_hits() -> None:
    import jax
    jax.monitoring.register_event_listener(_on_event)


def compile_for_cache(lowered):
    """Compile ``lowered`` for `store_program`: (executable, fresh). ``fresh`` is False when
    JAX's own persistent cache supplied the executable: XLA:CPU cannot serialise one that was
    itself deserialised (its kernels are missing when it is loaded again), so such an
    executable is used but not stored. (`program_label` keeps JAX's cache from holding these
    programs in the first place; this is the safety net.) JAX's cache does not write them
    either, where JAX lets a thread say so."""
    import contextlib

    with _LOCK:
        _listen_for_cache_hits()
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
