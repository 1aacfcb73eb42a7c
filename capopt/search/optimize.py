"""`optimize`: relax, solve with optax, discretise, polish, rank; or the exhaustive reference."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optax

from .. import _jaxcache
from .._compiled import in_background, result_or_none
from .._errors import CapoptError
from .._plan import Plan
from .._scenario import load_scenario
from .._specs import Scenario, training_choices
from .._units import GiB
from ..cost import numbers_pytree
from ..cost.estimate import estimate as cost_estimate
from ..cost.estimate import splits_unevenly
from ..cost.model import Estimate
from ..cost.stages import even_numbers
from ._evaluate import CHUNKS, compiled_sizes, cost_mode, evaluate, objective_from
from ._evaluate import estimates as _estimates
from ._space import COLUMNS, Lattice, Space, build_lattice, factorizations
from .relax import continuous_values, initial_points, make_solver, scenario_bounds
from .remedies import remedies as find_remedies

EXHAUSTIVE_BELOW = 500_000     # method='auto': lattices this small are evaluated whole
# When the relaxed solve finds nothing that fits, a lattice this small is evaluated whole
# before "infeasible" is said (about 2 s at this size): the rounding can miss a corner of the
# lattice (e.g. tp = 3 on three devices), the exhaustive reference cannot.
CONFIRM_INFEASIBLE_BELOW = 2_000_000


def estimate(config, sc: Scenario) -> Estimate:
    """The `Estimate` of one config as the search reports it (see `estimates`)."""
    return estimates([config], sc)[0]


def estimates(configs: list, sc: Scenario) -> list[Estimate]:
    """The batch evaluator's figures of each config, the ones it was ranked by; a config whose
    runtime splits its stages unevenly (`splits_unevenly`), which the evaluator bounds with
    its fullest rank on every stage, priced stage by stage (`capopt.cost.estimate`)."""
    n = numbers_pytree(sc)
    return [cost_estimate(c, sc) if splits_unevenly(c, n) else e
            for c, e in zip(configs, _estimates(configs, n))]


def _warm(space: Space, n, mode, x0, bounds) -> None:
    """Compile the batch evaluator for this scenario's shapes by evaluating a config near the
    starting points (the result is discarded)."""
    rows = discretise(space, continuous_values(np.asarray(x0), bounds))[:1]
    if rows:
        evaluate(space.lattice(rows), n, mode)


def _warm_up(sc: Scenario, space: Space, n, mode, x0, bounds, optimizer=None):
    """On a worker thread, while the solver compiles: start the layout programs of the
    pipeline depth (when the scenario asks for uneven stages and allows one depth >= 2; they
    are compiled per depth) on the other worker, and compile the batch evaluator here unless it
    is. Returns the layout job's future (or None). Deciding runs here too, so the main thread
    goes straight from tracing the solver to compiling it."""
    layouts = None
    if sc.pipeline_layers == "auto" or sc.stage_recompute == "auto":
        pps = sorted({f[2] for f in factorizations(sc)} - {1})
        if len(pps) == 1:
            from .stages import warm as warm_layouts
            layouts = in_background(warm_layouts, sc, n, pps[0], optimizer)
    if CHUNKS[0] not in compiled_sizes():
        try:
            _warm(space, n, mode, x0, bounds)
        except Exception:   # noqa: BLE001 - warming is an optimisation only
            pass
    return layouts


@functools.lru_cache(maxsize=8)
def _solver(optimizer, steps):
    """The jitted solver for an optax transformation (None: the default) and a step count.
    Keyed by the transformation itself (a tuple of its two functions), which the cache holds:
    a transformation made later can never be taken for one that is gone."""
    return make_solver(optimizer, steps)


# --------------------------------------------------------------------------------------------
# Discretisation: the real configs around each continuous answer
# --------------------------------------------------------------------------------------------
def _nearest(values: list, target: float, width: float) -> list:
    """Values within ``width`` (in log2) of ``target``, and at least the nearest one."""
    if not values:
        return []
    d = [abs(np.log2(v) - np.log2(max(target, 1e-9))) for v in values]
    best = min(d)
    return [v for v, di in zip(values, d) if di <= max(width, best + 1e-9)]


def _top(probs: np.ndarray, allowed: list, k: int = 2) -> list:
    order = [i for i in np.argsort(-probs) if i in allowed]
    return order[:k]


def _remat_candidates(space: Space, w: np.ndarray) -> list[int]:
    from .._specs import remat_weights
    d = [float(np.abs(np.asarray(remat_weights(v)) - w).sum()) for v in space.remat_table]
    return list(np.argsort(d)[:2])


def _bool_candidates(allowed: list[bool], p: float) -> list[bool]:
    if 0.05 < p < 0.95:
        return list(allowed)
    want = p >= 0.5
    return [want] if want in allowed else list(allowed)


def discretise(space: Space, cont: dict[str, np.ndarray]) -> list[tuple]:
    rows: dict[tuple, None] = {}
    if not space.facts:
        return []
    logs = np.log2(np.asarray(space.facts, np.float64))
    for i in range(len(cont["dp"])):
        point = np.log2([cont["dp"][i], cont["tp"][i], cont["pp"][i]])
        dists = np.abs(logs - point).sum(1).tolist()
        near = min(dists)
        for fact, d in zip(space.facts, dists):
            if d > near + 2.0:
                continue
            dp, tp, pp = fact
            eps = _nearest(space.expert_degrees(dp), cont["ep"][i], 1.0)
            zeros = _top(cont["zero"][i], space.zero_stages(dp, pp))
            remats = _remat_candidates(space, cont["remat"][i])
            sps = _bool_candidates(space.seq_parallel(tp), cont["sp"][i])
            offs = _bool_candidates(space.offloads, cont["offload"][i])
            flashes = _bool_candidates(space.flashes, cont["flash"][i])
            # every allowed context-parallel degree, each at the micro-batch that keeps a
            # rank's tokens (micro_batch / cp) where the relaxed point put them; every
            # allowed number of virtual stages (the relaxation holds the fewest allowed)
            for cp, vpp in space.outer(fact):
                mbs = _nearest(space.micro_batches(dp, cp, pp, vpp),
                               cont["micro_batch"][i] * cp / cont["cp"][i], 1.0)
                for r in space.rows_for(fact, mbs, eps, zeros, sps, remats, offs, flashes,
                                        cps=[cp], vpps=[vpp]):
                    rows[r] = None
    return list(rows)


def neighbours(space: Space, row: tuple) -> list[tuple]:
    """Configs one move away: another factorisation, the next micro-batch, any other value of
    one categorical knob, another context-parallel degree (at the same tokens per rank),
    another number of virtual pipeline stages."""
    mb, ga, dp, tp, pp, ep, z, s, r, o, f, cp, vpp, dpr, opo = row
    out: list[tuple] = []
    here = np.log2([dp, tp, pp])
    dists = (np.abs(np.log2(np.asarray(space.facts, np.float64)) - here).sum(1).tolist()
             if space.facts else [])
    for fact, dist in zip(space.facts, dists):
        if fact == (dp, tp, pp) or dist > 2.0 + 1e-9:
            continue
        # Keep the tokens per device about the same: the micro-batch scales with dp. The
        # ZeRO stage moves with the layout (a wider data-parallel group shards more, so the
        # best stage often changes with it).
        cps = [cp] if cp in space.context_degrees(fact[0]) else None
        vpps = [vpp] if vpp in space.virtual_degrees(fact[2]) else None
        mbs = _nearest(space.micro_batches(fact[0], cp if cps else 1, fact[2],
                                           vpp if vpps else 1), mb * dp / fact[0], 1.0)
        dprs = ([dpr] if dpr in space.replica_degrees(fact[0], cp if cps else 1) else None)
        out += space.rows_for(fact, mbs, [ep] if ep in space.expert_degrees(fact[0]) else None,
                              None,
                              [bool(s)] if bool(s) in space.seq_parallel(fact[1]) else None,
                              [r], [bool(o)], [bool(f)], cps=cps, vpps=vpps, dprs=dprs,
                              opps=[bool(opo)])

    def here(*subsets, dprs=(dpr,), opps=(opo,)):   # this layout, cp, virtual stages, replicas
        return space.rows_for((dp, tp, pp), *subsets, cps=[cp], vpps=[vpp],
                              dprs=None if dprs is None else list(dprs),
                              opps=None if opps is None else [bool(v) for v in opps])
    # Micro-batch and ZeRO stage trade memory for speed together: move them jointly.
    out += here(None, [ep], None, [bool(s)], [r], [bool(o)], [bool(f)])
    out += here([mb], None, [z], [bool(s)], [r], [bool(o)], [bool(f)])
    out += here([mb], [ep], None, [bool(s)], [r], [bool(o)], [bool(f)])
    out += here([mb], [ep], [z], None, [r], [bool(o)], [bool(f)])
    out += here([mb], [ep], [z], [bool(s)], None, [bool(o)], [bool(f)])
    out += here([mb], [ep], [z], [bool(s)], [r], None, [bool(f)])
    out += here([mb], [ep], [z], [bool(s)], [r], [bool(o)], None)
    out += here([mb], [ep], None, [bool(s)], [r], [bool(o)], [bool(f)], dprs=None)
    # (parameter offload moves with the ZeRO stage: it needs ZeRO-3)
    out += here([mb], [ep], None, [bool(s)], [r], [bool(o)], [bool(f)], opps=None)
    for other in space.context_degrees(dp):
        if other != cp:
            out += space.rows_for((dp, tp, pp), _nearest(space.micro_batches(dp, other, pp,
                                                                             vpp),
                                                         mb * other / cp, 1.0),
                                  [ep], None, [bool(s)], [r], [bool(o)], [bool(f)],
                                  cps=[other], vpps=[vpp],   # (every replica count)
                                  opps=[bool(opo)])
    for other in space.virtual_degrees(pp):
        if other != vpp:
            out += space.rows_for((dp, tp, pp), _nearest(space.micro_batches(dp, cp, pp, other),
                                                         mb, 1.0),
                                  [ep], [z], [bool(s)], [r], [bool(o)], [bool(f)],
                                  cps=[cp], vpps=[other], opps=[bool(opo)])
    return [x for x in dict.fromkeys(out) if x != row]


# --------------------------------------------------------------------------------------------
@dataclass
class OptimizeResult:
    scenario: Scenario
    status: str                          # "ok" | "infeasible"
    method: str
    candidates: list[Plan]
    solve_s: float
    evaluated: int
    space_size: int | None
    shadow_price: dict[str, float]
    smallest: Plan | None = None         # infeasible: the least memory found
    remedies: list = field(default_factory=list)     # list[Remedy]
    timings: dict[str, float] = field(default_factory=dict)
    per_variant: list[dict] = field(default_factory=list)
    layouts: list = field(default_factory=list)       # list[stages.Layout], best first

    @property
    def layout(self):
        """The best uneven stage layout found (scenarios with pipeline_layers or
        stage_recompute = "auto"), or None."""
        return self.layouts[0] if self.layouts else None

    @property
    def best(self) -> Plan | None:
        return self.candidates[0] if self.candidates else None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "status": self.status, "scenario": self.scenario.name, "method": self.method,
            "objective": self.scenario.objective,
            "best": self.best.to_dict() if self.best else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "solve_s": self.solve_s, "evaluated": self.evaluated,
            "space_size": self.space_size, "shadow_price": self.shadow_price,
            "timings": self.timings,
        }
        if self.per_variant:
            d["per_variant"] = self.per_variant
        if self.layouts:
            lay = self.layout.to_dict()
            even = next((c for c in self.candidates if getattr(c, "layout", None) is None),
                        None)
            if even is not None:
                lay["gain_vs_best_even_split"] = (self.layout.tokens_per_s
                                                  / even.throughput["tokens_per_s"] - 1.0)
            d["stage_layout"] = lay
        if self.status == "infeasible":
            d["smallest_requirement"] = self.smallest.to_dict() if self.smallest else None
            d["smallest_requirement_bytes"] = (self.smallest.memory["total_bytes"]
                                               if self.smallest else None)
            d["remedies"] = [r.to_dict() for r in self.remedies]
        return d

# --------------------------------------------------------------------------------------------
def _min_rate(sc: Scenario) -> float:
    """The throughput a deadline demands (0 without one)."""
    if sc.deadline_s and sc.workload.train_tokens:
        return sc.workload.train_tokens / sc.deadline_s
    return 0.0


def _rank(lat: Lattice, res: dict, usable: float, top_k: int, min_rate: float = 0.0
          ) -> list[int]:
    ok = ((res["total_bytes"] <= usable) & (res["tokens_per_s"] >= min_rate)
          & np.isfinite(res["objective"]))
    fits = np.nonzero(ok)[0]
    order = fits[np.argsort(-res["objective"][fits], kind="stable")]
    return [int(i) for i in order[:top_k]]


# a start whose relaxed memory is at most this far over the budget counts as fitting (the
# smoothed penalty lets the relaxation sit a little on either side of it)
RELAXED_FITS = 0.01


def _relaxed_price(sol, usable: float) -> dict[str, float] | None:
    """The memory constraint's price in the relaxation, from the penalty's multiplier at the
    best start that fits: loss = -log(objective) + penalty(total / usable - 1), so at a
    stationary point d log(objective) / d(usable / usable) is the multiplier, and the
    objective gained per GiB of budget is objective * multiplier * GiB / usable. A local
    derivative of the continuous problem; the lattice's price (`_shadow_price`) is a step."""
    over, obj, mult = (np.asarray(a, float) for a in (sol.over, sol.objective,
                                                      sol.multiplier))
    ok = (over <= RELAXED_FITS) & np.isfinite(obj) & np.isfinite(mult)
    if not ok.any():
        return None
    i = int(np.flatnonzero(ok)[np.argmax(obj[ok])])
    return {"relaxed_tokens_per_s_per_gib": float(obj[i] * mult[i] * GiB / usable),
            "relaxed_memory_fraction": float(over[i] + 1.0)}


def _shadow_price(res: dict, usable: float, best_obj: float | None) -> dict[str, float]:
    """Objective gained per extra GiB of budget, among the configs evaluated exactly."""
    if best_obj is None:
        return {"tokens_per_s_per_gib": None, "basis": "infeasible"}
    obj, total = res["objective"], res["total_bytes"]
    ok = np.isfinite(obj)
    more = obj[ok & (total <= usable + GiB)]
    gain = float(more.max() - best_obj) if len(more) else 0.0
    out = {"tokens_per_s_per_gib": gain, "basis": "best evaluated config with 1 GiB more"}
    # Where the price is 0 the budget is not what holds the answer back: say how much memory
    # the best config leaves unused and what the next faster config would need.
    used = total[ok & (obj >= best_obj)]
    out["unused_bytes"] = float(usable - used.min()) if len(used) else None
    faster = ok & (obj > best_obj * (1 + 1e-6))
    if faster.any():
        i = np.flatnonzero(faster)[np.argmin(total[faster])]
        out["next_faster_bytes"] = float(total[i])
        out["next_faster_gain"] = float(obj[i] / best_obj - 1.0)
    return out


def optimize(scenario: Scenario | str | dict | None = None, *, top_k: int = 5,
             method: str = "gradient", seed: int = 0, starts: int = 32, steps: int = 300,
             optimizer: optax.GradientTransformation | None = None, polish: bool = True,
             remedies: bool = True, exhaustive_below: int | None = None
             ) -> OptimizeResult:
    """The fastest configs that fit.

    ``method="gradient"`` (the default) solves the continuous relaxation with optax, rounds its
    answers to real configs and polishes them by exact local search. ``method="exhaustive"``
    evaluates every config of the lattice: the reference. ``method="auto"`` evaluates the whole
    lattice when it has at most ``exhaustive_below`` configs (default `EXHAUSTIVE_BELOW`), which
    is exact and compiles faster, and solves otherwise.
    """
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    if method not in ("gradient", "auto", "exhaustive"):
        raise CapoptError(f"unknown method {method!r}", field="--method",
                          allowed="gradient, auto, exhaustive")
    if exhaustive_below is None:
        exhaustive_below = EXHAUSTIVE_BELOW if method == "auto" else 0
    if method == "auto":
        method = "gradient"
    _jaxcache.enable()
    opts = dict(top_k=top_k, method=method, seed=seed, starts=starts, steps=steps,
                optimizer=optimizer, polish=polish, exhaustive_below=exhaustive_below)
    if sc.variants:
        return _optimize_fleet(sc, remedies=remedies, **opts)
    t0 = time.perf_counter()
    n = numbers_pytree(sc)
    mode = cost_mode(sc)
    usable = sc.budget.usable_bytes
    space = Space(sc)
    timings: dict[str, float] = {}

    small = None
    if method == "gradient" and exhaustive_below > 0 and space.size() <= exhaustive_below:
        small = build_lattice(sc)
    layout_warm = None
    relaxed = None
    if method == "exhaustive" or small is not None:
        lat = small if small is not None else build_lattice(sc)
        # the ranked plans are read back through the smallest batch program: compile it on a
        # worker thread while a large lattice is evaluated
        warm = (in_background(evaluate, lat, n, mode, np.zeros(1, int))
                if len(lat) > CHUNKS[0] and CHUNKS[0] not in compiled_sizes() else None)
        res = evaluate(lat, n, mode)
        result_or_none(warm)
        space_size = len(lat)
        if small is not None:
            method = "exhaustive"
            timings["small_space"] = float(len(lat))
    else:
        bounds = scenario_bounds(sc)
        x0 = initial_points(starts, seed)
        # the evaluator compiles on a worker thread once the solver is traced, while XLA
        # compiles the solver (it releases the GIL; tracing would contend for it)
        started: list = []
        sol = _solver(optimizer, steps)(x0, n, bounds, on_traced=lambda: started.append(
            in_background(_warm_up, sc, space, n, mode, x0, bounds, optimizer)))
        x = np.asarray(sol.x)
        relaxed = _relaxed_price(sol, usable)
        layout_warm = result_or_none(started[0] if started else None)
        timings["continuous_s"] = time.perf_counter() - t0
        rows = discretise(space, continuous_values(x, bounds))
        lat = space.lattice(rows)
        res = evaluate(lat, n, mode)
        timings["discretise_s"] = time.perf_counter() - t0 - timings["continuous_s"]
        if polish and len(lat):
            lat, res = _polish(space, lat, res, n, mode, usable)
        space_size = None

    order = _rank(lat, res, usable, top_k, _min_rate(sc))
    if not order and space_size is None and space.size() <= CONFIRM_INFEASIBLE_BELOW:
        lat = build_lattice(sc)
        res = evaluate(lat, n, mode)
        space_size = len(lat)
        order = _rank(lat, res, usable, top_k, _min_rate(sc))
        timings["confirmed_exhaustively"] = float(space_size)
    best_obj = float(res["objective"][order[0]]) if order else None
    solve_s = time.perf_counter() - t0
    shadow = _shadow_price(res, usable, best_obj)
    if relaxed is not None and best_obj is not None:
        shadow.update(relaxed)
    configs = [lat.config(i) for i in order]
    plans = [Plan(sc, c, e) for c, e in zip(configs, estimates(configs, sc))]
    if any(splits_unevenly(c, n) for c in configs):
        # ranked by the bound, reported by the split: the exact figures can only be better
        # (less memory, a shorter step), and may reorder the plans
        plans.sort(key=plan_objective, reverse=True)
    layouts = []
    if sc.pipeline_layers == "auto" or sc.stage_recompute == "auto":
        t1 = time.perf_counter()
        result_or_none(layout_warm)
        layouts = _layouts(sc, lat, res, n, usable, seed, optimizer)
        # An uneven layout that fits and beats the best even-split plan leads the ranking
        # (its plan carries the stage layout).
        lay = layouts[0] if layouts else None
        if (lay is not None and lay.fits and lay.tokens_per_s >= _min_rate(sc) and (
                not plans or lay.tokens_per_s > plans[0].throughput["tokens_per_s"])):
            from .stages import layout_plan
            even = _estimates([lay.config], even_numbers(n))[0]
            plans = ([layout_plan(sc, lay, even)]
                     + plans[:max(top_k - 1, 0)])
        timings["stage_layout_s"] = time.perf_counter() - t1
        solve_s = time.perf_counter() - t0
    status = "ok" if plans else "infeasible"
    smallest = None
    rem: list = []
    if not plans:
        smallest = _smallest(sc, space, lat, res, n, mode)
        if remedies:
            rem = find_remedies(sc, optimize)
    return OptimizeResult(sc, status, method, plans, solve_s, len(lat), space_size, shadow,
                          smallest, rem, timings, layouts=layouts)


def _layouts(sc: Scenario, lat: Lattice, res: dict, n, usable: float, seed: int,
             optimizer=None, per_pp: int = 2) -> list:
    """Uneven stage layouts for the best evaluated configs of each pipeline depth >= 2 (those
    within 1.5x the budget: recomputing more on the heavy stages can make them fit)."""
    from .stages import best_layouts
    pp = lat.cols["pp"]
    ok = (pp >= 2) & (res["total_bytes"] <= 1.5 * usable) & np.isfinite(res["objective"])
    configs = []
    for p in sorted(set(pp[ok].tolist())):
        idx = np.nonzero(ok & (pp == p))[0]
        fits = res["total_bytes"][idx] <= usable
        order = idx[np.lexsort((-res["objective"][idx], ~fits))]
        configs += [lat.config(int(i)) for i in order[:per_pp]]
    return best_layouts(sc, n, configs, seed=seed, optimizer=optimizer)


def plan_objective(p: Plan) -> float:
    """A plan's objective, as the search computed it (`objective_from`)."""
    sc = p.scenario
    return float(objective_from(float(p.throughput["tokens_per_s"]), float(sc.count),
                                float(sc.gpu_hour_price or 0.0), cost_mode(sc), xp=np))


def _optimize_fleet(sc: Scenario, *, remedies: bool, **opts) -> OptimizeResult:
    """Choose the GPU type and count, and the [training] fields left to the optimiser
    (`Scenario.choices`), too: solve each variant the scenario lists (same shapes, the
    workload's switches are numbers of the cost model: one compilation serves all) and rank
    everything found together."""
    t0 = time.perf_counter()
    results = [optimize(v, remedies=False, **opts) for v in sc.variants]
    plans = [p for r in results for p in r.candidates]
    plans.sort(key=plan_objective, reverse=True)
    top = plans[:opts["top_k"]]
    evaluated = sum(r.evaluated for r in results)
    space = (sum(r.space_size for r in results) if all(r.space_size for r in results)
             else None)
    status = "ok" if top else "infeasible"
    smallest = min((r.smallest or r.best for r in results if (r.smallest or r.best)),
                   key=lambda p: p.memory["total_bytes"] / p.scenario.budget.usable_bytes,
                   default=None)
    best_res = next((r for r in results if top and r.best is top[0]), None)
    shadow = best_res.shadow_price if best_res else {"tokens_per_s_per_gib": None,
                                                      "basis": "infeasible"}
    rem = []
    if not top and remedies:
        rem = find_remedies(sc if sc.choices else sc.variants[0], optimize)
    # stage layouts: the winning variant's; with no winner, every variant's, fitting and
    # fastest first
    layouts = (best_res.layouts if best_res is not None and best_res.layouts else sorted(
        (lay for r in results for lay in r.layouts),
        key=lambda lay: (not lay.fits, -lay.tokens_per_s)))
    res = OptimizeResult(sc, status, opts["method"], top, time.perf_counter() - t0, evaluated,
                         space, shadow, None if top else smallest, rem,
                         {"variants": len(sc.variants)}, layouts=list(layouts))
    res.per_variant = [{"gpu": v.hardware.name, "count": v.count,
                        **({"training": training_choices(v)} if v.choices else {}),
                        "status": r.status,
                        "best_tokens_per_s": r.best.throughput["tokens_per_s"] if r.best
                        else None,
                        "best_objective": plan_objective(r.best) if r.best else None,
                        "stage_layout": r.layout.to_dict() if r.layout else None}
                       for v, r in zip(sc.variants, results)]
    return res


def _polish(space: Space, lat: Lattice, res: dict, n, mode, usable, rounds: int = 20,
            seeds: int = 6):
    """Local search from the best fitting configs: move to a better fitting neighbour while one
    exists. Every configuration seen stays in the pool that is ranked."""
    rows = lat.keys()
    seen = {r: i for i, r in enumerate(rows)}
    cols = {k: list(v) for k, v in res.items()}
    ok = lambda i: cols["total_bytes"][i] <= usable and np.isfinite(cols["objective"][i])  # noqa
    score = lambda i: cols["objective"][i] if ok(i) else -np.inf  # noqa
    least = lambda i: -cols["total_bytes"][i]  # noqa  (the least memory first)

    def leaders(pool, key):
        """The best ``seeds`` of ``pool`` by ``key``, one per parallel layout (dp, tp, pp)
        first, so that the walk starts from as many layouts as it can: two layouts a near
        tie apart may be more than one move from each other."""
        ranked = sorted(pool, key=key, reverse=True)
        firsts, layouts = [], set()
        for i in ranked:
            lay = rows[i][2:5]
            if lay not in layouts:
                layouts.add(lay)
                firsts.append(i)
        chosen = set(firsts)
        return (firsts + [i for i in ranked if i not in chosen])[:seeds]

    fits = [i for i in range(len(rows)) if ok(i)]
    if not fits:   # start from the least memory: walk towards feasibility
        current = leaders(range(len(rows)), least)
    else:
        current = leaders(fits, score)
    for _ in range(rounds):
        new_rows = []
        for i in current:
            new_rows += [r for r in neighbours(space, rows[i]) if r not in seen]
        new_rows = list(dict.fromkeys(new_rows))
        if not new_rows:
            break
        nl = space.lattice(new_rows)
        nr = evaluate(nl, n, mode)
        for j, r in enumerate(new_rows):
            seen[r] = len(rows)
            rows.append(r)
            for k in cols:
                cols[k].append(nr[k][j])
        fits = [i for i in range(len(rows)) if ok(i)]
        pool = fits or list(range(len(rows)))
        key = score if fits else least
        nxt = leaders(pool, key)
        if set(nxt) == set(current):
            break
        current = nxt
    lat2 = space.lattice(rows)
    return lat2, {k: np.asarray(v) for k, v in cols.items()}


def _smallest(sc, space, lat, res, n, mode) -> Plan | None:
    """The least per-device memory among the configs evaluated (infeasible reports)."""
    if not len(lat):
        return None
    i = int(np.argmin(res["total_bytes"]))
    cfg = lat.config(i)
    return Plan(sc, cfg, estimate(cfg, sc))


__all__ = ["OptimizeResult", "optimize", "COLUMNS"]
