"""The continuous relaxation and its optax solve.

Decision variables (one vector per start):
  [0:3]   logits of the log2 shares of (dp, tp, pp) on a simplex summing to log2(devices)
  [3]     micro-batch: log2(mb) = sigmoid(.) * log2(global_batch / dp)
  [4]     expert parallelism: log2(ep) = sigmoid(.) * log2(min(experts, dp))
  [5:9]   ZeRO stage logits (softmax mixture)
  [9:12]  remat logits over (none, selective, full): fractions of layers
  [12:15] sequence parallel, optimizer offload, flash attention (sigmoids)
  [15]    context parallelism: log2(cp) between its bounds, at most log2(dp); the batch is
          split over dp / cp replicas (a scenario without it: cp = 1, the variable inert)
The virtual pipeline stages and the hybrid-sharding replicas are held at the fewest the
scenario allows (1 under "auto"; replicas at most dp / 2), parameter offload at the least it
allows (off under "auto"): the rounding tries every allowed value beside each layout
(`capopt.search.optimize.discretise`).
Disallowed categorical values are masked out; pinned values become tight bounds. The memory
constraint enters as a penalty whose weight grows over the solve (annealing); the
objective is -log(tokens/s) (or -log tokens per dollar). Everything runs inside one `jit`,
with starts under `vmap`; scenario numbers are traced, so scenarios of the same shape
share one compilation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._jaxcache import compile_options
from .._specs import Scenario
from .._validity import broken
from ..cost._inputs import DTYPE, Knobs
from ..cost.model import estimate_numbers
from .._compiled import Compiled
from ._evaluate import cost_mode, objective_value
from .penalty import memory_penalty, multiplier, penalty_solve
from ._space import domain, factorizations

DIM = 16
# the variables a scenario without context parallelism uses: its starting points are drawn
# as before the context-parallel variable existed, so its solve is unchanged
_BASE_DIM = 15
NEG = -1e4


class Bounds(NamedTuple):
    """Box and mask data of one scenario (a pytree of arrays; traced, not static)."""

    log2_n: jax.Array
    lo: jax.Array            # (3,) log2 lower bounds of dp, tp, pp
    hi: jax.Array            # (3,)
    log2_batch: jax.Array    # log2 global batch
    cp_lo: jax.Array         # log2 bounds of the context-parallel degree
    cp_hi: jax.Array
    vpp: jax.Array           # virtual pipeline stages held: the fewest the scenario allows
    dpr: jax.Array           # hybrid-sharding replicas held: the fewest the scenario allows
    opo: jax.Array           # parameter offload held: the least the scenario allows (0 or 1)
    mb_lo: jax.Array         # log2 bounds of the micro-batch
    mb_hi: jax.Array
    ep_cap: jax.Array        # log2 of the largest expert-parallel degree
    zero_mask: jax.Array     # (4,) 0 / NEG
    remat_mask: jax.Array    # (3,)
    bool_lo: jax.Array       # (3,) sp, offload, flash: allowed range in [0, 1]
    bool_hi: jax.Array
    mode_cost: jax.Array


def context_bounds(sc: Scenario) -> tuple[float, float]:
    """log2 bounds of the context-parallel degree: the scenario's list, or under ``"auto"``
    the powers of two the runtime and the model allow (`capopt._validity`: a runtime that
    runs it, a decoder whose sequence splits into 2 x cp chunks), up to the device count."""
    dom = sc.knob("cp").values
    if dom is not None:
        return float(np.log2(min(dom))), float(np.log2(max(dom)))
    cands = [c for c in (2 ** i for i in range(int(np.log2(sc.count)) + 1))
             if not broken({"cp": np.asarray([c]), "dp": np.asarray([c])}, sc,
                           known={"cp", "dp"}).any()]
    return 0.0, float(np.log2(max(cands))) if cands else 0.0


def scenario_bounds(sc: Scenario) -> Bounds:
    facts = factorizations(sc) or [(sc.count, 1, 1)]
    logs = np.log2(np.asarray(facts, np.float64))
    B = sc.workload.global_batch
    mb_dom = sc.knob("micro_batch").values
    mb_lo = np.log2(min(mb_dom)) if mb_dom else 0.0
    mb_hi = np.log2(max(mb_dom)) if mb_dom else np.log2(B)
    m = sc.model
    cp_lo, cp_hi = context_bounds(sc)
    ep_dom = sc.knob("ep").values
    ep_cap = np.log2(max(ep_dom) if ep_dom else (m.num_local_experts if m.is_moe else 1))
    zeros = domain(sc, "zero_stage", [0, 1, 2, 3])
    rem = domain(sc, "remat", ["none", "selective", "full"])
    remat_mask = [0.0 if p in rem or (p == "full" and any(not isinstance(r, str) for r in rem))
                  else NEG for p in ("none", "selective", "full")]

    def bool_range(name):
        dom = sc.knob(name).values
        vals = [False, True] if dom is None else list(dom)
        return float(min(vals)), float(max(vals))

    b = [bool_range(k) for k in ("sequence_parallel", "offload_optimizer",
                                       "flash_attention")]
    f = lambda x: jnp.asarray(x, DTYPE)  # noqa: E731
    return Bounds(
        log2_n=f(np.log2(sc.count)), lo=f(logs.min(0)), hi=f(logs.max(0)), log2_batch=f(np.log2(B)),
        cp_lo=f(cp_lo), cp_hi=f(cp_hi), vpp=f(min(sc.knob("vpp").values or (1,))),
        dpr=f(min(sc.knob("dp_replicate").values or (1,))),
        opo=f(float(min(sc.knob("offload_params").values or (False,)))),
        mb_lo=f(mb_lo), mb_hi=f(mb_hi), ep_cap=f(ep_cap),
        zero_mask=f([0.0 if z in zeros else NEG for z in range(4)]), remat_mask=f(remat_mask),
        bool_lo=f([x[0] for x in b]), bool_hi=f([x[1] for x in b]),
        mode_cost=f(cost_mode(sc)))


def decode(x: jax.Array, b: Bounds) -> Knobs:
    """Variables -> relaxed knobs (continuous degrees, mixtures)."""
    shares = jax.nn.softmax(x[0:3]) * b.log2_n
    dp, tp, pp = 2.0 ** shares[0], 2.0 ** shares[1], 2.0 ** shares[2]
    log_cp = b.cp_lo + jax.nn.sigmoid(x[15]) * jnp.maximum(
        jnp.minimum(b.cp_hi, shares[0]) - b.cp_lo, 0.0)
    per_replica = b.log2_batch + log_cp - shares[0]         # log2 of B / (dp / cp)
    mb_hi = jnp.minimum(b.mb_hi, per_replica)
    log_mb = b.mb_lo + jax.nn.sigmoid(x[3]) * jnp.maximum(mb_hi - b.mb_lo, 0.0)
    mb = 2.0 ** log_mb
    ga = 2.0 ** (per_replica - log_mb)
    ep = 2.0 ** (jax.nn.sigmoid(x[4]) * jnp.minimum(b.ep_cap, shares[0]))
    zero = jax.nn.softmax(x[5:9] + b.zero_mask)
    remat = jax.nn.softmax(x[9:12] + b.remat_mask)
    bools = b.bool_lo + (b.bool_hi - b.bool_lo) * jax.nn.sigmoid(x[12:15])
    return Knobs(micro_batch=mb, grad_accum=jnp.maximum(ga, 1.0), dp=dp, tp=tp, pp=pp, ep=ep,
                 zero=zero, remat=remat, sp=bools[0], offload=bools[1], flash=bools[2],
                 cp=2.0 ** log_cp, vpp=b.vpp * jnp.ones_like(mb),
                 dpr=jnp.clip(b.dpr, 1.0, jnp.maximum(dp / 2.0, 1.0)),
                 offload_params=b.opo * jnp.ones_like(mb))


def _loss_terms(x, n, b: Bounds, mu):
    """(loss, (relative memory excess, objective)) of variables ``x`` under penalty weight
    ``mu``: one evaluation of the cost model."""
    k = decode(x, b)
    est = estimate_numbers(k, n)
    obj = objective_value(est, n, b.mode_cost)
    over = est.memory["total_bytes"] / n["usable_bytes"] - 1.0
    shares = jnp.log2(jnp.stack([k.dp, k.tp, k.pp]))
    box = jnp.sum(jax.nn.relu(b.lo - shares) ** 2 + jax.nn.relu(shares - b.hi) ** 2)
    ga_short = jax.nn.relu(-(b.log2_batch + jnp.log2(k.cp) - shares[0]
                             - jnp.log2(k.micro_batch)))
    penalty = memory_penalty(over, mu) + 10.0 * (box + ga_short ** 2)
    return -jnp.log(jnp.maximum(obj, 1e-30)) + penalty, (over, obj)


def _loss(x, n, b: Bounds, mu):
    return _loss_terms(x, n, b, mu)[0]


class SolveResult(NamedTuple):
    x: jax.Array          # (starts, DIM) final variables
    loss: jax.Array       # (starts,)
    over: jax.Array       # (starts,) relative memory excess at the end (<= 0 fits)
    objective: jax.Array  # (starts,)
    multiplier: jax.Array  # (starts,) d(penalty)/d(total/usable): the constraint's price


def make_solver(optimizer: optax.GradientTransformation | None = None, steps: int = 300,
                mu0: float = 1.0, mu1: float = 1e4):
    """A jitted ``solve(x0, n, bounds) -> SolveResult`` for a batch of starts."""
    run = penalty_solve(_loss_terms, optimizer or optax.adam(0.08), steps, mu0, mu1)

    def solve(x0, n, b):
        x, (loss, (over, obj)) = run(x0, n, b)
        return SolveResult(x, loss, over, obj, multiplier(over, mu1))

    # the default optimizer is part of the source: its programs can be cached whole on disk
    name = (f"solver-{steps}-{float(mu0)!r}-{float(mu1)!r}".replace(".", "p")
            if optimizer is None else None)
    return Compiled(solve, name=name, compiler_options=compile_options())


_JITTED: dict = {}


def _jitted(name, fn, **kw):
    """``fn`` compiled with the search's XLA options (built on first use: the backend decides
    them); small programs like these compile in tens of milliseconds this way, where running
    them op by op would compile every operation on its own."""
    if name not in _JITTED:
        _JITTED[name] = jax.jit(fn, compiler_options=compile_options(), **kw)
    return _JITTED[name]


def initial_points(starts: int, seed: int) -> np.ndarray:
    """``starts`` starting points, normal with scale 1.5 around the centre of the box (a
    uniform share of the devices to each axis, even mixtures): deterministic in ``seed``.
    Drawn with numpy: a jitted draw costs a compilation in a cold process."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((starts, _BASE_DIM))
    extra = rng.standard_normal((starts, DIM - _BASE_DIM))
    return (np.concatenate([base, extra], 1) * 1.5).astype(np.float32)


def _decode_batch(x, b: Bounds):
    k = jax.vmap(decode, in_axes=(0, None))(x, b)
    return {f: getattr(k, f) for f in Knobs.__dataclass_fields__}


def continuous_values(x: np.ndarray, b: Bounds) -> dict[str, np.ndarray]:
    """Decode a batch of variable vectors into plain numpy knob values."""
    k = _jitted("decode", _decode_batch)(jnp.asarray(x, DTYPE), b)
    return {f: np.asarray(v) for f, v in k.items()}
