"""Uneven pipeline layouts: how many layers each stage holds and how many it recomputes.

For one base config with ``p >= 2`` pipeline stages, the layout has ``2p`` integers (layer
counts summing to ``L``, each at least 1, and recompute counts ``0 <= r_i <= L_i``): far too
many combinations to enumerate for a real model (``C(L-1, p-1) * prod(L_i + 1)``). It is relaxed
continuously (layer shares on a simplex, recompute fractions as sigmoids), solved with Adam
under an annealed memory penalty over several starts inside one `jit`, rounded to integers
that sum to ``L``, and polished by exact hill-climbing (move one layer between two stages, or
recompute one layer more or fewer on a stage) with the same cost model (`capopt.cost.stages`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._jaxcache import compile_options
from .._plan import Plan
from .._specs import Config, Scenario
from ..cost._inputs import DTYPE, Knobs, knobs_from_config, numbers_pytree
from ..cost.stages import (assemble_estimate, even_numbers, layout_step, layout_tokens_per_s,
                           rest_from_terms)
from .._compiled import Compiled
from .penalty import memory_penalty, penalty_solve

STEPS = 200
STARTS = 16


@dataclass
class Layout:
    """One integer stage layout of a base config, evaluated exactly."""

    config: Config
    layers: list[int]
    recompute: list[int]
    stage_bytes: list[float]
    stage_s: list[float]                 # per micro-batch
    step_s: float
    tokens_per_s: float
    fits: bool
    budget_bytes: float
    even_tokens_per_s: float             # the same config with the even split
    even_fits: bool
    solve_s: float = 0.0
    timings: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "pipeline_layers": self.layers,
                "stage_recompute": self.recompute, "stage_bytes": self.stage_bytes,
                "stage_step_s": self.stage_s, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "fits": self.fits,
                "budget_bytes": self.budget_bytes,
                "even_split_tokens_per_s": self.even_tokens_per_s,
                "even_split_fits": self.even_fits, "solve_s": self.solve_s}


@dataclass(frozen=True)
class LayoutPlan(Plan):
    """A plan whose pipeline stages are uneven: the config plus its stage layout. Memory is
    the stage that needs the most; time and throughput are the layout's."""

    layout: Layout | None = None

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if self.layout is not None:
            d["stage_layout"] = {"pipeline_layers": self.layout.layers,
                                 "stage_recompute": self.layout.recompute,
                                 "stage_bytes": self.layout.stage_bytes}
        return d


def layout_plan(sc: Scenario, lay: Layout, even_estimate) -> LayoutPlan:
    """The plan of a layout, from the even split's estimate of its config and the layout's
    exact per-stage terms (no compilation beyond the evaluator's)."""
    n = numbers_pytree(sc)
    lp = LayoutProblem(sc, lay.config, n, True, True)
    step, _, t = lp.evaluate(np.asarray(lay.layers), np.asarray(lay.recompute))
    terms = {key: v[0] for key, v in lp.last_terms.items()}
    even = jax.tree.map(np.asarray, even_estimate)
    est = assemble_estimate(even, float(lay.config.vpp), step[0], t[0], terms)
    return LayoutPlan(sc, lay.config, est, lay)


# --------------------------------------------------------------------------------------------
def _decode(z, k: Knobs, L, p: int, flags):
    """Variables (2p,) -> real layer counts (>= 1, sum L) and recompute counts."""
    layers_on, rec_on = flags[0], flags[1]
    shares = jax.nn.softmax(z[:p])
    layers = layers_on * (1.0 + (L - p) * shares) + (1.0 - layers_on) * L / p
    frac = rec_on * jax.nn.sigmoid(z[p:]) + (1.0 - rec_on) * k.remat[2]
    return layers, frac * layers


def _loss_terms(z, k, n, rest, inp, L, flags, mu, p):
    """(log step time + memory penalty, nothing else) of layout variables ``z``."""
    layers, rec = _decode(z, k, L, p, flags)
    step, mem, _ = layout_step(k, n, layers, rec, rest, inp, smooth=50.0)
    over = mem / n["usable_bytes"] - 1.0
    return jnp.log(step) + memory_penalty(over, mu), ()


def _loss(z, k, n, rest, inp, L, flags, mu, p):
    return _loss_terms(z, k, n, rest, inp, L, flags, mu, p)[0]


@functools.lru_cache(maxsize=16)
def _solver(p: int, optimizer: optax.GradientTransformation | None = None):
    """The annealed-penalty solve (`penalty_solve`) of the layout of ``p`` stages over a batch
    of starts, one compilation per p: Adam (learning rate 0.1) unless the search was given
    another optax transformation. Keyed by the transformation itself (see
    `optimize._solver`)."""
    run = penalty_solve(lambda z, k, n, rest, inp, L, flags, mu: _loss_terms(
        z, k, n, rest, inp, L, flags, mu, p), optimizer or optax.adam(0.1), STEPS)

    def solve(z0, k, n, rest, inp, L, flags):
        z, _ = run(z0, k, n, rest, inp, L, flags)
        return jax.vmap(_decode, in_axes=(0, None, None, None, None))(z, k, L, p, flags)

    name = f"layout-solver-{p}" if optimizer is None else None
    return Compiled(solve, name=name, compiler_options=compile_options())


@functools.lru_cache(maxsize=1)
def _evaluator():
    """The exact evaluator of a batch of integer layouts (one program, built on first use)."""
    def ev(layers, rec, k, n, rest, inp):
        return jax.vmap(lambda a, b: layout_step(k, n, a, b, rest, inp, breakdown=True))(
            layers, rec)
    return Compiled(ev, name="layout-evaluator", compiler_options=compile_options())


# --------------------------------------------------------------------------------------------
def round_layers(real: np.ndarray, L: int) -> np.ndarray:
    """Integers >= 1 summing to ``L`` nearest to ``real`` (largest remainder)."""
    p = len(real)
    x = np.maximum(np.asarray(real, np.float64) - 1.0, 0.0)
    x = x * (L - p) / max(x.sum(), 1e-12) if x.sum() > 0 else np.full(p, (L - p) / p)
    base = np.floor(x).astype(np.int64)
    left = int(L - p - base.sum())
    order = np.argsort(-(x - base), kind="stable")
    base[order[:left]] += 1
    return base + 1


def round_recompute(frac: np.ndarray, layers: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(np.asarray(frac) * layers), 0, layers).astype(np.int64)


class LayoutProblem:
    """One base config's layout search space and exact evaluator."""

    def __init__(self, sc: Scenario, config: Config, n: dict, layers_on: bool, rec_on: bool):
        self.sc, self.config, self.n = sc, config, n
        self.p = int(config.pp)
        self.L = int(sc.model.num_hidden_layers)
        # (a recomputed fraction is whole blocks of a stage, as in the step estimate `_rest`
        # subtracts from)
        self.k = knobs_from_config(config, float(self.L))
        # numpy copies for the few host-side sums (tokens per step, the per-step rest): on jax
        # values each operation would compile a program of its own in a fresh process
        self.k_host = jax.tree.map(np.asarray, self.k)
        self.n_host = jax.tree.map(np.asarray, n)
        self.layers_on, self.rec_on = layers_on, rec_on
        self.base_full = float(self.k_host.remat[2])
        self.rest, self.inp = self._rest()
        self.usable = float(n["usable_bytes"])

    def _rest(self):
        """`per_step_rest` from the programs the search has compiled anyway: the batch
        evaluator's time terms of the even split and the layout evaluator's stage times."""
        from ._evaluate import estimates
        t = estimates([self.config], even_numbers(self.n))[0].time
        p = self.p
        layers = np.full(p, self.L / p, np.float32)
        zero = jnp.zeros((), DTYPE)
        self.rest, self.inp = zero, zero                # stage times do not depend on them
        _, _, t_mb = self.evaluate(layers, layers * self.base_full)
        rest, inp = rest_from_terms(t, float(t_mb[0].max()), self.k_host, self.n_host, p)
        return jnp.asarray(rest, DTYPE), jnp.asarray(inp, DTYPE)

    def size(self) -> int:
        """How many integer layouts there are (layer compositions x recompute choices)."""
        from math import comb
        p, L = self.p, self.L
        if not self.layers_on:
            per = L // p
            return (per + 1) ** p if self.rec_on else 1
        if not self.rec_on:
            return comb(L - 1, p - 1)
        # sum over compositions of prod (L_i + 1): coefficient of x^L in (x/(1-x)^2)^p
        # = C(L + p - 1, 2p - 1)
        return comb(L + p - 1, 2 * p - 1)

    def even(self) -> tuple[np.ndarray, np.ndarray]:
        layers = np.full(self.p, self.L // self.p, np.int64)
        return layers, round_recompute(np.full(self.p, self.base_full), layers)

    def evaluate(self, layers: np.ndarray, rec: np.ndarray):
        layers = np.asarray(layers, np.float32).reshape(-1, self.p)
        rec = np.asarray(rec, np.float32).reshape(-1, self.p)
        rows = len(layers)
        size = max(128, 1 << (rows - 1).bit_length())     # one padded shape: one compilation
        pad = lambda a: np.concatenate([a, np.repeat(a[:1], size - rows, 0)])  # noqa: E731
        step, mem, t, terms = _evaluator()(jnp.asarray(pad(layers)), jnp.asarray(pad(rec)),
                                           self.k, self.n, self.rest, self.inp)
        self.last_terms = {key: np.asarray(v)[:rows] for key, v in terms.items()}
        return np.asarray(step)[:rows], np.asarray(mem)[:rows], np.asarray(t)[:rows]

    def score(self, step, mem):
        """Higher is better: fitting layouts by speed, then non-fitting ones by memory."""
        worst = mem.max(-1) / self.usable
        return np.where(worst <= 1.0, -step, -1e6 * worst)

    def neighbours(self, layers: np.ndarray, rec: np.ndarray):
        """Move one layer from one stage to another, or recompute one layer more or fewer."""
        p = self.p
        out_l, out_r = [], []
        if self.layers_on:
            for a in range(p):
                for b in range(p):
                    if a == b:
                        continue
                    nl = layers.copy()
                    nr = rec.copy()
                    if nl[a] > 1:
                        nl[a] -= 1
                        nl[b] += 1
                        nr[a] = min(nr[a], nl[a])
                        if not self.rec_on:
                            nr = round_recompute(np.full(p, self.base_full), nl)
                    out_l.append(nl)
                    out_r.append(nr)
        if self.rec_on:
            for a in range(p):
                for d in (-1, 1):
                    nr = rec.copy()
                    nr[a] = np.clip(nr[a] + d, 0, layers[a])
                    out_l.append(layers.copy())
                    out_r.append(nr)
        return np.asarray(out_l), np.asarray(out_r)

    def climb(self, layers, rec, max_moves: int = 500):
        """Best-improvement hill-climbing; returns the local optimum and its move count."""
        step, mem, _ = self.evaluate(layers, rec)
        cur = float(self.score(step, mem)[0])
        for moves in range(max_moves):
            nl, nr = self.neighbours(layers, rec)
            if not len(nl):
                return layers, rec, moves
            s, m, _ = self.evaluate(nl, nr)
            sc = self.score(s, m)
            j = int(np.argmax(sc))
            if sc[j] <= cur:
                return layers, rec, moves
            layers, rec, cur = nl[j], nr[j], float(sc[j])
        return layers, rec, max_moves

    def layout(self, layers, rec, even_tps: float, even_fits: bool) -> Layout:
        step, mem, t = self.evaluate(layers, rec)
        tps = float(layout_tokens_per_s(self.k_host, self.n_host, step[0]))
        return Layout(self.config, [int(v) for v in layers], [int(v) for v in rec],
                      [float(v) for v in mem[0]], [float(v) for v in t[0]], float(step[0]), tps,
                      bool(mem[0].max() <= self.usable), self.usable, even_tps, even_fits)

    def solve(self, starts: int = STARTS, seed: int = 0, polish: bool = True,
              optimizer: optax.GradientTransformation | None = None) -> Layout:
        t0 = time.perf_counter()
        p = self.p
        rng = np.random.default_rng(seed)
        f0 = np.clip(self.base_full, 0.02, 0.98)
        z0 = np.zeros((starts, 2 * p), np.float32)
        z0[:, p:] = np.log(f0 / (1 - f0))
        z0[1:] += rng.normal(0, 1.0, (starts - 1, 2 * p)).astype(np.float32)
        flags = jnp.asarray([float(self.layers_on), float(self.rec_on)], DTYPE)
        real_l, real_r = _solver(p, optimizer)(jnp.asarray(z0), self.k, self.n, self.rest, self.inp,
                                    jnp.asarray(float(self.L), DTYPE), flags)
        real_l, real_r = np.asarray(real_l), np.asarray(real_r)
        t_relax = time.perf_counter() - t0
        cands_l, cands_r = [], []
        for i in range(starts):
            li = (round_layers(real_l[i], self.L) if self.layers_on
                  else self.even()[0])
            frac = real_r[i] / np.maximum(real_l[i], 1e-6)
            for up in (False, True):    # nearest, and one more recompute where it was cut
                ri = (round_recompute(frac, li) if not up else
                      np.minimum(np.ceil(frac * li - 1e-6), li).astype(np.int64))
                cands_l.append(li)
                cands_r.append(ri if self.rec_on
                               else round_recompute(np.full(p, self.base_full), li))
        el, er = self.even()
        cands_l.append(el)
        cands_r.append(er)
        step, mem, _ = self.evaluate(np.asarray(cands_l), np.asarray(cands_r))
        sc = self.score(step, mem)
        j = int(np.argmax(sc))
        layers, rec = np.asarray(cands_l[j]), np.asarray(cands_r[j])
        moves = 0
        if polish:
            layers, rec, moves = self.climb(layers, rec)
        even_tps = float(layout_tokens_per_s(self.k_host, self.n_host, step[-1]))
        out = self.layout(layers, rec, even_tps, bool(mem[-1].max() <= self.usable))
        out.solve_s = time.perf_counter() - t0
        out.timings = {"relaxed_s": t_relax, "polish_moves": moves}
        return out


def warm(sc: Scenario, n: dict, p: int,
         optimizer: optax.GradientTransformation | None = None) -> None:
    """Compile the layout programs of pipeline depth ``p``, the evaluator and the solver, by
    running them once on placeholder inputs (they depend on the shapes only: any config of
    that depth will do). Runs on a worker thread while the main solve compiles."""
    L = float(sc.model.num_hidden_layers)
    k = knobs_from_config(Config(micro_batch=1, grad_accum=1, dp=1, tp=1, pp=p))
    zero = jnp.zeros((), DTYPE)
    layers = jnp.full((128, p), L / p, DTYPE)
    jax.block_until_ready(_evaluator()(layers, layers * 0.0, k, n, zero, zero))
    jax.block_until_ready(_solver(p, optimizer)(jnp.zeros((STARTS, 2 * p), DTYPE), k, n, zero,
                                                zero, jnp.asarray(L, DTYPE), jnp.ones(2, DTYPE)))


def best_layouts(sc: Scenario, n: dict, configs: list[Config], seed: int = 0,
                 optimizer: optax.GradientTransformation | None = None) -> list[Layout]:
    """Solve the layout of each base config (pp >= 2), best first (fitting, then faster);
    ``optimizer`` is the search's optax transformation (None: the layout solve's Adam)."""
    layers_on = sc.pipeline_layers == "auto"
    rec_on = sc.stage_recompute == "auto"
    out = []
    for cfg in configs:
        if cfg.pp < 2 or sc.model.num_hidden_layers < cfg.pp:
            continue
        # the recompute counts take the place of full recomputation (and of a fraction that
        # is every block of a stage)
        if rec_on and cfg.remat_weights(sc.model.num_hidden_layers)[2] == 1.0:
            cfg = dataclasses.replace(cfg, remat="none")
        out.append(LayoutProblem(sc, cfg, n, layers_on, rec_on).solve(seed=seed,
                                                                      optimizer=optimizer))
    out.sort(key=lambda l: (not l.fits, -l.tokens_per_s))
    return out


__all__ = ["Layout", "LayoutPlan", "LayoutProblem", "layout_plan", "best_layouts", "round_layers", "round_recompute"]
