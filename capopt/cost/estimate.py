"""`estimate(config, scenario) -> Estimate`: the one pure entry point to the cost model."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from .._specs import Config, Scenario
from ._inputs import (Knobs, knobs_from_config, numbers_pytree, runtime_knobs,
                      runtime_numbers)
from .memory import memory
from .time import time_terms


@dataclass(frozen=True)
class Estimate:
    """Per-device memory terms (bytes), time terms (seconds) and throughput figures.

    A pytree of scalars (or of arrays, when evaluated under `vmap`).
    """

    memory: dict
    time: dict
    throughput: dict

    def to_dict(self) -> dict:
        conv = lambda d: {k: float(v) for k, v in d.items()}  # noqa: E731
        return {"memory": conv(self.memory), "time": conv(self.time),
                "throughput": conv(self.throughput)}

    @property
    def fits(self):
        return self.memory["total_bytes"] <= self.memory["budget_bytes"]


jax.tree_util.register_dataclass(Estimate, data_fields=["memory", "time", "throughput"],
                                 meta_fields=[])


def estimate_numbers(k: Knobs, n: dict) -> Estimate:
    """The cost model on raw pytrees (traceable; what `jit`, `grad` and `vmap` see)."""
    k = runtime_knobs(k, n)
    n = runtime_numbers(k, n)
    mem = memory(k, n)
    time, thr = time_terms(k, n, mem)
    return Estimate(memory=mem, time=time, throughput=thr)


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


def estimate(config: Config | Knobs, scenario: Scenario | dict, *, jit: bool = True) -> Estimate:
    """Memory and time of ``config`` (a `Config` or relaxed `Knobs`) in ``scenario``."""
    n = numbers_pytree(scenario)
    k = (knobs_from_config(config, float(n["L"])) if isinstance(config, Config) else config)
    return (_compiled_estimate() if jit else estimate_numbers)(k, n)


__all__ = ["Estimate", "estimate", "estimate_numbers"]
