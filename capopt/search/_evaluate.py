"""Exact evaluation of many integer configs at once: the vectorised cost model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._jaxcache import compile_options
from ..cost._inputs import Knobs
from ..cost.estimate import estimate_numbers
from ._space import Lattice

SECONDS_PER_HOUR = 3600.0
CHUNKS = (512, 16384)     # padded batch sizes: two compilations, ever


def objective_value(est, n, mode_cost):
    """What the search maximises: tokens/s, or tokens per dollar when ``mode_cost`` is 1."""
    tps = est.throughput["tokens_per_s"]
    dollars_per_s = n["N"] * n["price"] / SECONDS_PER_HOUR
    # Select rather than blend: tokens/s over a zero price overflows float32, and 0 * inf
    # would turn every throughput objective into NaN.
    priced = (mode_cost > 0.5) & (dollars_per_s > 0.0)
    per_dollar = tps / jnp.where(priced, dollars_per_s, 1.0)
    return jnp.where(mode_cost > 0.5, per_dollar, tps)


def _eval_batch_impl(k: Knobs, n: dict, mode_cost):
    def one(kk):
        e = estimate_numbers(kk, n)
        return {"total_bytes": e.memory["total_bytes"], "objective": objective_value(
            e, n, mode_cost), "tokens_per_s": e.throughput["tokens_per_s"],
            "step_s": e.time["step_s"]}
    return jax.vmap(one)(k)


_JITTED: list = []


def _eval_batch(k: Knobs, n: dict, mode_cost):
    if not _JITTED:     # built on first use: the backend decides the compiler options
        _JITTED.append(jax.jit(_eval_batch_impl, compiler_options=compile_options()))
    return _JITTED[0](k, n, mode_cost)


def _pad_rows(idx: np.ndarray) -> tuple[np.ndarray, int]:
    size = next((c for c in CHUNKS if len(idx) <= c), CHUNKS[-1])
    if len(idx) < size:
        idx = np.concatenate([idx, np.full(size - len(idx), idx[0] if len(idx) else 0)])
    return idx, size


def evaluate(lat: Lattice, n: dict, mode_cost: float, rows: np.ndarray | None = None
             ) -> dict[str, np.ndarray]:
    """Memory and objective of lattice rows (all rows by default), in fixed-size chunks."""
    rows = np.arange(len(lat)) if rows is None else np.asarray(rows)
    out: dict[str, list] = {}
    step = CHUNKS[-1]
    mode = jnp.asarray(mode_cost, jnp.float32)
    for start in range(0, len(rows), step):
        part = rows[start:start + step]
        padded, _ = _pad_rows(part)
        res = _eval_batch(lat.knobs(padded), n, mode)
        for key, v in res.items():
            out.setdefault(key, []).append(np.asarray(v)[:len(part)])
    if not out:
        return {k: np.zeros(0) for k in ("total_bytes", "objective", "tokens_per_s", "step_s")}
    return {k: np.concatenate(v) for k, v in out.items()}
