"""The cost model on raw pytrees: `estimate_numbers(knobs, numbers) -> Estimate`, traceable (what
`jit`, `grad` and `vmap` see); `capopt.cost.estimate` is its entry point for one config."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from ._inputs import Knobs, runtime_knobs, runtime_numbers
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


__all__ = ["Estimate", "estimate_numbers"]
