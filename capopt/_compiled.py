"""`Compiled`: a function jitted and compiled ahead of time per argument shape, optionally
cached whole on disk (`capopt._jaxcache`); and the worker threads that compile programs
before they are needed (`in_background`)."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from . import _jaxcache


class Compiled:
    """``fn`` under `jax.jit` (with ``jit_options``), compiled ahead of time, once per shape of
    its arguments.

    ``on_traced`` runs between tracing and XLA's compilation: other Python work started there
    (another program's tracing) overlaps the compilation, which releases the GIL, instead of
    contending with the tracing, which holds it. A ``name`` puts the executables in the
    on-disk ahead-of-time cache (`capopt._jaxcache.load_program`): a later process with the
    same code and argument shapes loads one without tracing. Threads calling one `Compiled`
    with new shapes take turns: each program is built once.
    """

    def __init__(self, fn, name: str | None = None, **jit_options):
        if name is not None:
            body = fn

            def fn(*args):
                return body(*args)
            # the program's (HLO module's) name: see `capopt._jaxcache.program_label`
            fn.__name__ = fn.__qualname__ = _jaxcache.program_label(name)
        self.jitted = jax.jit(fn, **jit_options)
        self.name = name
        self._exe: dict = {}
        self._lock = threading.RLock()
        self.loaded_from_disk = 0        # how many executables came from the disk cache

    @staticmethod
    def signature(args) -> tuple:
        """What one compiled program is specialised to: the arguments' tree, shapes, dtypes
        and weak types."""
        leaves, tree = jax.tree.flatten(args)
        return (tree, tuple((np.shape(x), jnp.result_type(x), getattr(x, "weak_type", False))
                            for x in leaves))

    def __call__(self, *args, on_traced=None):
        key = self.signature(args)
        exe = self._exe.get(key)
        if exe is None:
            with self._lock:
                exe = self._exe.get(key)
                if exe is None:
                    exe, out = self._build(key, args, on_traced)
                    self._exe[key] = exe
                    if out is not None:
                        return out
                    on_traced = None        # `_build` called it
        if on_traced is not None:
            on_traced()
        return exe(*args)

    def _build(self, key, args, on_traced):
        """(executable, its result on ``args`` or None): loaded from disk when the cache has
        it, else traced and compiled. Calls ``on_traced`` exactly once."""
        path = (_jaxcache.program_path(self.name, repr(key)) if self.name is not None
                else None)
        if path is not None and _jaxcache.has_program(path):
            if on_traced is not None:      # loading overlaps the other work too
                on_traced()
                on_traced = None
            exe = _jaxcache.load_program(path)
            if exe is not None:
                try:    # a broken entry fails on its first run, loudly: then it is compiled
                    out = jax.block_until_ready(exe(*args))
                except Exception as e:  # noqa: BLE001 - any failure: discard, compile
                    _jaxcache.discard_program(path, f"{type(e).__name__}: {e}")
                else:
                    self.loaded_from_disk += 1
                    return exe, out
        lowered = self.jitted.trace(*args).lower()
        if on_traced is not None:
            on_traced()
        if self.name is None:
            return lowered.compile(), None
        exe, fresh = _jaxcache.compile_for_cache(lowered)
        if fresh and path is not None:
            _jaxcache.store_program(path, self.name, exe)
        return exe, None

    def cache_size(self) -> int:
        """Programs compiled or loaded so far (one per argument shape)."""
        return len(self._exe)


# --------------------------------------------------------------------------------------------
# Warm-up: programs compiled on worker threads while the main thread does other work (XLA's
# compilation releases the GIL)
@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The two worker threads, made on first use and shared by every search in the process."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="capopt-warm")


def in_background(fn, *args) -> Future:
    """``fn(*args)`` on a worker thread; its future."""
    return _pool().submit(fn, *args)


def result_or_none(future: Future | None):
    """Wait for a warm-up job and return its result; None for no job or a failed one (warming
    is an optimisation only: a failure there leaves the compilation to the first real call)."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception:   # noqa: BLE001 - warming is an optimisation only
        return None
