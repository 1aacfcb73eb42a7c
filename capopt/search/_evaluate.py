"""Exact evaluation of many integer configs at once: the vectorised cost model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._jaxcache import compile_options
from .._specs import Config
from ..cost._inputs import Knobs, knobs_from_config
from ..cost.model import Estimate, estimate_numbers
from .._compiled import Compiled
from ._space import Lattice

SECONDS_PER_HOUR = 3600.0
CHUNKS = (512, 16384)     # padded batch sizes: two compilations, ever
SMALL_CALLS = 8           # up to this many calls of the small program before the large one


def cost_mode(sc) -> float:
    """The objective as the programs take it: 1.0 for tokens per dollar, 0.0 for tokens/s."""
    return 1.0 if sc.objective == "cost_efficiency" else 0.0


def objective_from(tokens_per_s, devices, price_per_hour, mode_cost, xp=jnp):
    """What the search maximises: tokens/s, or tokens per dollar when ``mode_cost`` is 1 and
    the GPUs have a price (without one, tokens/s). ``xp``: `jax.numpy` inside the programs,
    `numpy` for one plan's figures (float64, no dispatch)."""
    dollars_per_s = devices * price_per_hour / SECONDS_PER_HOUR
    # Select rather than blend: tokens/s over a zero price overflows float32, and 0 * inf
    # would turn every throughput objective into NaN.
    priced = (mode_cost > 0.5) & (dollars_per_s > 0.0)
    per_dollar = tokens_per_s / xp.where(priced, dollars_per_s, 1.0)
    return xp.where(priced, per_dollar, tokens_per_s)


def objective_value(est, n, mode_cost):
    """`objective_from` an `Estimate` (or its numbers) and the scenario's numbers ``n``."""
    return objective_from(est.throughput["tokens_per_s"], n["N"], n["price"], mode_cost)


def _eval_batch_impl(k: Knobs, n: dict, mode_cost, full: bool):
    def one(kk):
        e = estimate_numbers(kk, n)
        obj = objective_value(e, n, mode_cost)
        # only what ranking needs, unless the plans' terms are asked for: XLA then drops the
        # rest of the model's outputs (the large batches run ~2.5x faster)
        return (e, obj) if full else (_columns(e, obj), obj)
    return jax.vmap(one)(k)


_PROGRAMS: dict = {}
_SIZES: set = set()      # padded batch sizes compiled so far


def _eval_batch(k: Knobs, n: dict, mode_cost):
    """(columns or batched `Estimate`, objective) of every row of ``k``: one compiled program
    per padded batch size. The small batch returns every term, so one program both ranks
    configs and gives the reported plans their terms; the large one only the columns."""
    size = int(k.dp.shape[0])
    full = size <= CHUNKS[0]
    if full not in _PROGRAMS:     # built on first use: the backend decides the options
        _PROGRAMS.setdefault(full, Compiled(
            functools.partial(_eval_batch_impl, full=full),
            name="evaluator-" + ("terms" if full else "columns"),
            compiler_options=compile_options()))
    out = _PROGRAMS[full](k, n, mode_cost)
    _SIZES.add(size)
    return out


def compiled_sizes() -> set:
    return set(_SIZES)


def _pad_rows(idx: np.ndarray) -> tuple[np.ndarray, int]:
    size = next((c for c in CHUNKS if len(idx) <= c), CHUNKS[-1])
    if len(idx) < size:
        idx = np.concatenate([idx, np.full(size - len(idx), idx[0] if len(idx) else 0)])
    return idx, size


def _columns(est: Estimate, obj) -> dict:
    return {"total_bytes": est.memory["total_bytes"], "objective": obj,
            "tokens_per_s": est.throughput["tokens_per_s"], "step_s": est.time["step_s"]}


def evaluate(lat: Lattice, n: dict, mode_cost: float, rows: np.ndarray | None = None
             ) -> dict[str, np.ndarray]:
    """Memory and objective of lattice rows (all rows by default), in fixed-size chunks."""
    rows = np.arange(len(lat)) if rows is None else np.asarray(rows)
    out: dict[str, list] = {}
    # a few hundred to a few thousand rows (discretisation, polish) go through the small
    # program, several calls of it, rather than compiling the large one
    step = CHUNKS[0] if len(rows) <= SMALL_CALLS * CHUNKS[0] else CHUNKS[-1]
    mode = jnp.asarray(mode_cost, jnp.float32)
    for start in range(0, len(rows), step):
        part = rows[start:start + step]
        padded, _ = _pad_rows(part)
        est, obj = _eval_batch(lat.knobs(padded), n, mode)
        cols = _columns(est, obj) if isinstance(est, Estimate) else est
        for key, v in cols.items():
            out.setdefault(key, []).append(np.asarray(v)[:len(part)])
    if not out:
        return {k: np.zeros(0) for k in ("total_bytes", "objective", "tokens_per_s", "step_s")}
    return {k: np.concatenate(v) for k, v in out.items()}


def estimates(configs: list[Config], n: dict) -> list[Estimate]:
    """The full `Estimate` of each config, from the same compiled evaluator that ranks them
    (so a reported plan shows exactly the figures it was ranked by, and no second program of
    the cost model is compiled for it)."""
    if not configs:
        return []
    if len(configs) > CHUNKS[0]:
        return [e for i in range(0, len(configs), CHUNKS[0])
                for e in estimates(configs[i:i + CHUNKS[0]], n)]
    ks = [knobs_from_config(c, float(n["L"])) for c in configs]
    k = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *ks)
    size = CHUNKS[0]
    pad = size - len(configs)
    k = jax.tree.map(lambda x: np.concatenate([x, np.repeat(x[:1], pad, 0)]), k)
    est, _ = _eval_batch(k, n, jnp.asarray(0.0, jnp.float32))
    est = jax.tree.map(np.asarray, est)
    return [jax.tree.map(lambda v, i=i: v[i], est) for i in range(len(configs))]
