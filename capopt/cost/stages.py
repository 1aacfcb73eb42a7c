"""Uneven pipeline stages: per-stage layer counts and per-stage recomputation.

The main cost model splits the ``L`` blocks evenly over ``p`` pipeline stages and applies one
recomputation policy everywhere. Here stage ``i`` holds ``layers[i]`` blocks and fully
recomputes ``recompute[i]`` of them (the others keep the config's base policy, none or
selective), built from the same per-stage terms the main model uses:

- memory of stage ``i``: `memory.stage_memory` with its own layers and recompute mixture,
  ``min(p - i, m)`` micro-batches in flight under 1F1B (``m`` = grad_accum), the embedding on
  the first stage and the final norm, head and loss (and logits) on the last;
- time of stage ``i`` per micro-batch: `time.stage_time` with its own compute and memory-bound
  terms (recomputation adds forward work);
- step: the slowest stage sets the pace of the steady state and of the bubble,
  ``(m + (p - 1) / v) * max_i t_i``, plus the once-per-step terms of the even split
  (data-parallel synchronisation, optimizer, offload), at least the input pipeline's time.

At the even split with the config's own recomputation, memory equals `memory.memory` and the
step equals `time.time_terms` (the tests check both). Everything is traceable: layer counts
and recompute counts may be relaxed to real numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._inputs import Knobs, runtime_knobs, runtime_numbers
from .model import Estimate, estimate_numbers
from .flops import compute_times, step_tokens
from .memory import first_chunk_in_flight, pipeline_in_flight, stage_memory, stage_params
from .time import memory_bound_times, stage_extras, stage_time


def stage_remat(k: Knobs, layers, recompute):
    """(p, 3) recompute mixtures: ``recompute / layers`` fully recomputed, the rest split as
    the config's non-full share (none vs selective)."""
    w = k.remat
    rest = jnp.maximum(w[0] + w[1], 1e-9)
    base = jnp.stack([w[0] / rest, w[1] / rest])
    full = jnp.clip(recompute / jnp.maximum(layers, 1e-6), 0.0, 1.0)
    return jnp.concatenate([(1.0 - full)[:, None] * base[None, :], full[:, None]], axis=1)


def even_layout(k: Knobs, n: dict, p: int):
    """(layers, recompute) of the main model's even split with the config's recomputation."""
    layers = jnp.full((p,), n["L"] / p)
    return layers, layers * k.remat[2]


def runtime_split(num_layers: int, pp: int, chunks: int = 1) -> np.ndarray:
    """Blocks per pipeline rank when ``pp`` does not divide them, as torchtitan splits them
    (``generate_split_points``, torchtitan/parallelisms/pipelining_utils.py at 9dec370):
    ``pp * chunks`` stages, the first ``L // stages`` blocks, each middle one a block more
    while ``L % stages`` lasts, the last what is left; rank ``r`` runs stages ``r, r + pp,
    ...`` (the "loop" style of ``stage_ids_this_rank``)."""
    stages = pp * chunks
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} pipeline stages for {num_layers} blocks")
    base, extra = divmod(num_layers, stages)
    sizes = [base]
    for _ in range(stages - 2):
        more = 1 if extra > 0 else 0
        extra -= more
        sizes.append(base + more)
    if stages > 1:
        sizes.append(num_layers - sum(sizes))
    return np.asarray(sizes, dtype=np.float64).reshape(chunks, pp).sum(axis=0)


def stage_terms(k: Knobs, n: dict, layers, recompute) -> dict:
    """Per-stage ``total_bytes`` (p,) and per-micro-batch seconds ``t_mb`` (p,), p >= 2."""
    p = layers.shape[0]
    k = runtime_knobs(k, n)
    n = runtime_numbers(k, n)
    _, first_p, last_p, _ = stage_params(k, n)
    i = jnp.arange(p)
    first = (i == 0).astype(jnp.float32)
    last = (i == p - 1).astype(jnp.float32)
    remat = stage_remat(k, layers, recompute)
    in_flight = pipeline_in_flight(k, float(p), i.astype(jnp.float32))
    edge_in_flight = first_chunk_in_flight(k, float(p))

    def one(L, w, inf, lg, is_first, is_last):
        ki = k.replace(remat=w)
        c = compute_times(ki, n)
        mb = memory_bound_times(ki, n)
        extras = stage_extras(n, c, mb, first_p, last_p, is_first, is_last)
        kw = dict(layers=L, extra_params=extras["extra_params"], in_flight=inf, logits_mb=lg,
                  edge_in_flight=edge_in_flight)
        mem = stage_memory(ki, n, first_stage=is_first > 0.5, **kw)
        t = stage_time(ki, n, layers=L, c=c, mb=mb, **extras)
        return mem, t["total"]

    mem, t = jax.vmap(one)(layers, remat, in_flight, last, first, last)
    return {"total_bytes": mem["total_bytes"], "t_mb": t, "memory": mem}


def _pace(k: Knobs, n: dict, p: int):
    return k.grad_accum + (p - 1.0) / k.vpp


def even_numbers(n: dict) -> dict:
    """The scenario's numbers priced as an even split, L / pp blocks a stage (the runtime's
    ``uneven_stages`` bound of `capopt.cost.memory.stage_blocks` off): what a layout's own
    stage terms are measured against."""
    return {**n, "rt_uneven_stages": 0.0 * n["rt_uneven_stages"]}


def per_step_rest(k: Knobs, n: dict, p: int):
    """(once-per-step seconds outside the pipeline, input seconds) from the even split."""
    el, er = even_layout(k, n, p)
    t_even = jnp.max(stage_terms(k, n, el, er)["t_mb"])
    return rest_from_terms(estimate_numbers(k, even_numbers(n)).time, t_even, k, n, p)


def rest_from_terms(t: dict, t_even_mb, k: Knobs, n: dict, p: int):
    """`per_step_rest` from the even split's time terms ``t`` and its slowest stage's
    micro-batch seconds (numpy or jax values alike)."""
    # The step before the input-pipeline floor: the step itself unless input-bound.
    summed = (t["compute_s"] + t["memory_bound_s"] + t["comm_exposed_s"] + t["bubble_s"]
              + t["optimizer_s"] + t["offload_s"])
    input_bound = t["step_s"] > t["input_s"]
    where = np.where if isinstance(input_bound, (np.ndarray, np.generic)) else jnp.where
    busy = where(input_bound, t["step_s"], summed)
    return busy - _pace(k, n, p) * t_even_mb, t["input_s"]


def layout_step(k: Knobs, n: dict, layers, recompute, rest, input_s, smooth: float = 0.0,
                breakdown: bool = False):
    """Step seconds, per-stage bytes and per-stage micro-batch seconds of one layout (and,
    with ``breakdown``, every memory term per stage as a fourth result).

    ``smooth > 0`` replaces the max over stages by a log-sum-exp of that sharpness (relative
    to the slowest stage): what the relaxed solve differentiates."""
    p = layers.shape[0]
    st = stage_terms(k, n, layers, recompute)
    t = st["t_mb"]
    if smooth > 0.0:
        top = jax.lax.stop_gradient(jnp.max(t))
        slowest = top * (1.0 + jax.nn.logsumexp(smooth * (t / top - 1.0)) / smooth)
    else:
        slowest = jnp.max(t)
    step = jnp.maximum(rest + _pace(k, n, p) * slowest, input_s)
    if breakdown:
        return step, st["total_bytes"], t, st["memory"]
    return step, st["total_bytes"], t


def layout_tokens_per_s(k: Knobs, n: dict, step):
    return step_tokens(k, n)[1] / step


def layout_estimate(k: Knobs, n: dict, layers, recompute) -> Estimate:
    """An `Estimate` of one layout (see `assemble_estimate`)."""
    p = layers.shape[0]
    even = estimate_numbers(k, even_numbers(n))
    rest, inp = per_step_rest(k, n, p)
    step, mem, t, terms = layout_step(k, n, layers, recompute, rest, inp, breakdown=True)
    return assemble_estimate(even, k.vpp, step, t, terms)


def assemble_estimate(even: Estimate, vpp, step, t_mb, terms: dict) -> Estimate:
    """The Estimate of a layout from the even split's and the layout's own terms: memory of
    the stage that needs the most (its breakdown), the even split's time terms with this
    layout's step and bubble (the slowest stage paces both), throughput rescaled to this
    step. Works on arrays or on numpy values alike."""
    xp = jnp if isinstance(step, jax.Array) else __import__("numpy")
    p = t_mb.shape[-1]
    i = xp.argmax(terms["total_bytes"])
    memory = {key: v[i] for key, v in terms.items()}
    memory.update({"first_stage_bytes": terms["total_bytes"][0],
                   "last_stage_bytes": terms["total_bytes"][-1],
                   "budget_bytes": even.memory["budget_bytes"],
                   "vram_bytes": even.memory["vram_bytes"]})
    memory["free_bytes"] = memory["budget_bytes"] - memory["total_bytes"]
    # (the context and workspaces beside the binding stage's reserved memory; a paged
    # optimizer's time stays the even split's, as the other per-step terms do)
    memory["device_used_bytes"] = memory["reserved_bytes"] + (
        even.memory["device_used_bytes"] - even.memory["reserved_bytes"])
    time = dict(even.time)
    ratio = even.time["step_s"] / step
    time["bubble_s"] = (p - 1.0) / vpp * xp.max(t_mb)
    time["step_s"] = step
    thr = dict(even.throughput)
    for key in ("tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "mfu", "hfu",
                "tflops_per_device"):
        if key in thr:
            thr[key] = thr[key] * ratio
    for key in ("time_to_train_s", "cost_per_million_tokens"):
        if key in thr:
            thr[key] = thr[key] / ratio
    return Estimate(memory=memory, time=time, throughput=thr)


__all__ = ["assemble_estimate", "even_layout", "even_numbers", "layout_estimate",
           "layout_step", "layout_tokens_per_s", "per_step_rest", "runtime_split", "stage_remat",
           "stage_terms"]
