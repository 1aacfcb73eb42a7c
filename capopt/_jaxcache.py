"""A persistent XLA compilation cache for capopt's solver and evaluators.

The solver's compiled program depends only on the shapes of a scenario, never on its numbers,
so one compilation serves every later run: on disk, a fresh process loads it in a fraction of
the compile time. Set ``CAPOPT_CACHE_DIR`` to move it, or to an empty string to turn it off.
"""

from __future__ import annotations

import os
from pathlib import Path

_done = False


def enable() -> None:
    global _done
    if _done:
        return
    _done = True
    import jax
    target = os.environ.get("CAPOPT_CACHE_DIR")
    if target == "":
        return
    if jax.config.jax_compilation_cache_dir:     # the user chose one already
        return
    path = Path(target) if target else Path(os.environ.get(
        "XDG_CACHE_HOME", Path.home() / ".cache")) / "capopt" / "xla"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
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
