"""`estimate(config, scenario) -> Estimate`: the one pure entry point to the cost model."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._specs import Config, Scenario
from ._inputs import DTYPE, Knobs, knobs_from_config, numbers_pytree
from .model import Estimate, estimate_numbers
from .stages import layout_estimate, runtime_split


_estimate_jit = None


def _compiled_estimate():
    """`estimate_numbers` compiled once per argument shape, and cached whole on disk across
    processes (`capopt._compiled`, `capopt._jaxcache`): a second `capopt plan` loads the
    program instead of tracing and compiling it."""
    global _estimate_jit
    if _estimate_jit is None:
        from .. import _jaxcache
        from .._compiled import Compiled
        _jaxcache.enable()
        _estimate_jit = Compiled(estimate_numbers, name="estimate",
                                 compiler_options=_jaxcache.compile_options())
    return _estimate_jit


_layout_jitted = None


def _layout_jit():
    global _layout_jitted
    if _layout_jitted is None:
        _layout_jitted = jax.jit(layout_estimate)
    return _layout_jitted


def splits_unevenly(config, n: dict) -> bool:
    """Whether ``config`` (a `Config`) runs stages of unequal blocks in a scenario of numbers
    ``n``: a runtime that splits them (``uneven_stages``) and a pipeline depth that does not
    divide them."""
    L = int(round(float(n["L"])))
    return (isinstance(config, Config) and 1 < config.pp <= L and L % config.pp != 0
            and float(n["rt_uneven_stages"]) > 0.5)


def estimate(config: Config | Knobs, scenario: Scenario | dict, *, jit: bool = True) -> Estimate:
    """Memory and time of ``config`` (a `Config` or relaxed `Knobs`) in ``scenario``."""
    n = numbers_pytree(scenario)
    k = (knobs_from_config(config, float(n["L"])) if isinstance(config, Config) else config)
    if splits_unevenly(config, n):
        # stages of unequal blocks: each stage priced with its own blocks as the runtime
        # splits them, the slowest pacing the pipeline (`capopt.cost.stages`); elsewhere
        # L / pp blocks a stage, the relaxation of an even split
        chunks = config.vpp
        L = int(round(float(n["L"])))
        layers = jnp.asarray(runtime_split(L, config.pp, chunks), DTYPE)
        return (_layout_jit() if jit else layout_estimate)(
            k, n, layers, layers * k.remat[2])
    return (_compiled_estimate() if jit else estimate_numbers)(k, n)


__all__ = ["estimate", "splits_unevenly"]
