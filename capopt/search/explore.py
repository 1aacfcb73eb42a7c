"""What-ifs over a scenario's whole lattice, for the figures and notebooks: every config
evaluated exactly (`landscape`), the best one within a budget, a knob pinned or changed with
the rest rebalanced (`sweep`), the best per pair of knobs (`knob_grid`), the best objective
and the shadow price as the budget varies (`budget_curve`). The same evaluator and objective
as `optimize`'s exhaustive reference. Each returns plain data that `capopt.report.figures`
draws."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .._plan import Plan
from .._scenario import load_scenario
from .._specs import BOOL_KNOBS, KNOBS, Config, KnobDomain, Scenario, data_replicas
from .._units import GiB
from .._validity import config_problems, mend
from ..cost import estimate, numbers_pytree
from ._evaluate import cost_mode, evaluate
from ._space import COLUMNS, Lattice, build_lattice

#: Workload fields a what-if may change besides the `Config` knobs.
WORKLOAD_KNOBS = ("seq_len", "global_batch")


def evaluate_all(sc: Scenario):
    """Every real config of ``sc`` and its exact cost: (lattice, columns)."""
    lat = build_lattice(sc)
    return lat, evaluate(lat, numbers_pytree(sc), cost_mode(sc))


def best_row(res: dict, usable: float) -> int | None:
    """The fitting row with the largest objective (first on ties), as the exhaustive search
    ranks them; None when nothing fits."""
    fits = np.nonzero(res["total_bytes"] <= usable)[0]
    if not len(fits):
        return None
    return int(fits[np.argmax(res["objective"][fits])])


def pin(sc: Scenario, knob: str, value) -> Scenario:
    """``sc`` with one knob pinned (a `Config` knob) or one workload field changed."""
    if knob in WORKLOAD_KNOBS:
        return dataclasses.replace(sc, workload=dataclasses.replace(sc.workload,
                                                                    **{knob: value}))
    knobs = tuple(k for k in sc.knobs if k.name != knob) + (KnobDomain(knob, (value,)),)
    return dataclasses.replace(sc, knobs=knobs)


def held_config(sc: Scenario, base, knob: str, value):
    """``base`` with ``knob`` set to ``value``, the rest rebalanced so the devices and the
    global batch still add up, and knobs the new value rules out mended by the rules' own
    repairs (`capopt._validity.mend`: sequence parallelism without tp, ZeRO without dp,
    ZeRO-2/3 with pp, ep or cp that does not divide dp). Returns (scenario, config or
    None when no such config is real, the knobs that had to change)."""
    cfg = base.config if isinstance(base, Plan) else base
    if not isinstance(cfg, Config):
        raise TypeError(f"config must be a capopt Config or Plan, got {type(cfg).__name__}")
    sc2 = pin(sc, knob, value) if knob in WORKLOAD_KNOBS else sc
    old = cfg.to_dict()
    d = dict(old) if knob in WORKLOAD_KNOBS else old | {knob: value}
    n_dev, batch = sc2.count, sc2.workload.global_batch
    if knob in ("tp", "pp"):
        d["dp"] = max(n_dev // (d["tp"] * d["pp"]), 1)
    elif knob == "dp":
        d["tp"] = max(n_dev // (d["dp"] * d["pp"]), 1)
    d = mend(d, sc2, keep=knob)
    replicas = data_replicas(d["dp"], d.get("cp", 1))
    if knob == "grad_accum":
        d["micro_batch"] = max(batch // (replicas * d["grad_accum"]), 1)
    else:
        d["grad_accum"] = max(batch // (replicas * d["micro_batch"]), 1)
    # rules on the rebalanced batch (interleaving needs micro-batches a multiple of pp)
    d = mend(d, sc2, keep=knob)
    changed = [k for k in d if k != knob and d[k] != old[k]
               and k not in ("dp", "tp", "grad_accum", "micro_batch")]
    try:
        new = Config(**d)
    except Exception:  # noqa: BLE001 - a value the knob cannot take: a gap in the sweep
        return sc2, None, changed
    # Validity of the config itself; the scenario's allowed values do not bind a what-if.
    bare = dataclasses.replace(sc2, knobs=())
    return sc2, (None if config_problems(new, bare) else new), changed


def best_pinned(sc: Scenario, knob: str, value):
    """The best fitting config with ``knob`` pinned to ``value`` (else the least memory)."""
    sc2 = pin(sc, knob, value)
    lat, res = evaluate_all(sc2)
    if not len(lat):
        return sc2, None
    i = best_row(res, sc2.budget.usable_bytes)
    if i is None:
        i = int(np.argmin(res["total_bytes"]))
    return sc2, lat.config(i)


def best_objective_within(res: Mapping[str, np.ndarray], usable_bytes) -> np.ndarray:
    """The best objective among the configs whose memory is at most each ``usable_bytes``
    (NaN where none fits); ``res`` is `evaluate`'s columns."""
    total = np.asarray(res["total_bytes"], float)
    obj = np.asarray(res["objective"], float)
    u = np.atleast_1d(np.asarray(usable_bytes, float))
    if not len(total):
        return np.full(u.shape, np.nan)
    order = np.argsort(total, kind="stable")
    run = np.maximum.accumulate(obj[order])
    k = np.searchsorted(total[order], u, side="right")
    out = np.where(k > 0, run[np.maximum(k - 1, 0)], np.nan)
    return out


def pareto_front(memory: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both (less memory, more value), by memory.

    >>> pareto_front(np.array([1., 2., 3.]), np.array([5., 4., 6.])).tolist()
    [0, 2]
    """
    memory, value = np.asarray(memory, float), np.asarray(value, float)
    order = np.lexsort((-value, memory))
    front, best = [], -np.inf
    for i in order:
        if value[i] > best:
            front.append(int(i))
            best = value[i]
    return np.asarray(front, dtype=int)


def _scenario(s: Scenario | str | Mapping) -> Scenario:
    return s if isinstance(s, Scenario) else load_scenario(s)


# --------------------------------------------------------------------------------------------
# What the figures draw
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Landscape:
    """Every real config of a scenario and its exact cost: ``columns`` are `evaluate`'s
    (``total_bytes``, ``tokens_per_s``, ``objective``, ...), one row per lattice row."""

    scenario: Scenario
    lattice: Lattice
    columns: dict

    def __len__(self) -> int:
        return len(self.lattice)

    @property
    def fits(self) -> np.ndarray:
        return self.columns["total_bytes"] <= self.scenario.budget.usable_bytes


def landscape(scenario: Scenario | str | Mapping) -> Landscape:
    """Every real config of ``scenario`` (a `Scenario`, a name or path, or a dict), evaluated."""
    sc = _scenario(scenario)
    return Landscape(sc, *evaluate_all(sc))


@dataclass(frozen=True)
class Sweep:
    """One knob moved over ``values``: at each, the `Plan` (None where no real config has
    that value) and the other knobs worth naming under it (``shown``)."""

    scenario: Scenario
    knob: str
    values: list
    plans: list           # list[Plan | None]
    shown: list           # list[list[str]]: knob names whose values label each point
    held: Config | None   # the config the other knobs are held at; None: re-optimised


def sweep(scenario: Scenario | str | Mapping, knob: str, values: Sequence | None = None, *,
          config=None) -> Sweep:
    """Memory and throughput as one knob moves.

    Args:
      scenario: a `Scenario`, a scenario name or path, or a dict.
      knob: a config knob (``micro_batch``, ``tp``, ``pp``, ``dp``, ``zero_stage``, ``remat``,
        ...) or a workload field (``seq_len``, ``global_batch``).
      values: the values to visit; default (config knobs only): every value a real config of
        the scenario takes.
      config: None: at each value the other knobs are re-optimised (the best fitting config,
        or the one needing least memory when none fits). A `Config` or `Plan`: only ``knob``
        moves, with ``dp`` (or ``tp``) and ``grad_accum`` rebalanced so devices and global
        batch still add up (`held_config`).
    """
    sc = _scenario(scenario)
    if knob not in KNOBS and knob not in WORKLOAD_KNOBS:
        raise ValueError(f"unknown knob {knob!r}; allowed: "
                         + ", ".join(list(KNOBS) + list(WORKLOAD_KNOBS)))
    if values is None:
        if knob in WORKLOAD_KNOBS:
            raise ValueError(f"sweep over {knob!r} needs explicit values")
        lat = build_lattice(sc)
        vals = sorted(set(lat.cols[knob].tolist()))
        if knob == "remat":
            values = [lat.remat_table[v] for v in vals]
        elif knob in BOOL_KNOBS:
            values = [bool(v) for v in vals]
        else:
            values = vals
    values = list(values)
    plans: list[Plan | None] = []
    shown: list[list[str]] = []
    for v in values:
        if config is None:
            sc2, cfg = best_pinned(sc, knob, v)
            changed: list[str] = []
        else:
            sc2, cfg, changed = held_config(sc, config, knob, v)
        plans.append(Plan(sc2, cfg, estimate(cfg, sc2)) if cfg is not None else None)
        shown.append(changed if cfg is not None else [])
    if config is None:   # name the knobs the re-optimisation moved
        cfgs = [p.config.to_dict() for p in plans if p is not None]
        differ = [k for k in (cfgs[0] if cfgs else {}) if k != knob
                  and k not in ("grad_accum",) and len({str(c[k]) for c in cfgs}) > 1]
        shown = [list(differ) if p is not None else [] for p in plans]
    held = None if config is None else (config.config if isinstance(config, Plan) else config)
    return Sweep(sc, knob, values, plans, shown, held)


@dataclass(frozen=True)
class KnobGrid:
    """The best fitting config per cell of two knobs (over every value of the others).

    ``best`` (tokens/s) and ``best_bytes`` are NaN where no config of the cell fits;
    ``least_bytes`` (the least memory any config of the cell needs) is NaN where the cell has
    no real config. Rows follow ``y_values``, columns ``x_values``; ``chosen`` is the (column,
    row) of the best fitting config of all, as the exhaustive search ranks them."""

    scenario: Scenario
    x: str
    y: str
    x_values: list
    y_values: list
    best: np.ndarray
    best_bytes: np.ndarray
    least_bytes: np.ndarray
    chosen: tuple | None
    configs: int


def _axis_values(lat: Lattice, knob: str) -> tuple[np.ndarray, list]:
    codes = np.asarray(sorted(set(lat.cols[knob].tolist())))
    if knob == "remat":
        values = [lat.remat_table[c] for c in codes]
    elif knob in BOOL_KNOBS:
        values = [bool(c) for c in codes]
    else:
        values = [int(c) for c in codes]
    return codes, values


def knob_grid(land: Landscape | Scenario | str | Mapping, x: str = "tp", y: str = "pp"
              ) -> KnobGrid:
    """``land`` (a `Landscape`, or a scenario to evaluate whole) reduced to a ``y`` x ``x``
    grid of cells."""
    for k in (x, y):
        if k not in COLUMNS:
            raise ValueError(f"unknown knob {k!r}; allowed: {', '.join(COLUMNS)}")
    if x == y:
        raise ValueError("x and y must be different knobs")
    land = land if isinstance(land, Landscape) else landscape(land)
    lat, res, sc = land.lattice, land.columns, land.scenario
    if not len(lat):
        empty = np.zeros((0, 0))
        return KnobGrid(sc, x, y, [], [], empty, empty, empty, None, 0)
    xc, xv = _axis_values(lat, x)
    yc, yv = _axis_values(lat, y)
    best = np.full((len(yc), len(xc)), np.nan)
    best_bytes = np.full_like(best, np.nan)
    least = np.full_like(best, np.nan)
    fit = land.fits
    xi = np.searchsorted(xc, lat.cols[x])
    yi = np.searchsorted(yc, lat.cols[y])
    for j in range(len(yc)):
        for i in range(len(xc)):
            cell = (xi == i) & (yi == j)
            if not cell.any():
                continue
            least[j, i] = res["total_bytes"][cell].min()
            ok = np.nonzero(cell & fit)[0]
            if len(ok):
                k = ok[np.argmax(res["tokens_per_s"][ok])]
                best[j, i] = res["tokens_per_s"][k]
                best_bytes[j, i] = res["total_bytes"][k]
    b = best_row(res, sc.budget.usable_bytes)
    chosen = None if b is None else (int(xi[b]), int(yi[b]))
    return KnobGrid(sc, x, y, xv, yv, best, best_bytes, least, chosen, len(lat))


@dataclass(frozen=True)
class BudgetCurve:
    """The best objective (NaN where nothing fits) and the shadow price of memory (what 1 GiB
    more usable budget gains) at each VRAM budget per device, ``budgets_gib``."""

    scenario: Scenario
    budgets_gib: np.ndarray
    best: np.ndarray
    price: np.ndarray


def budget_curve(land: Landscape | Scenario | str | Mapping,
                 budgets_gib: Sequence[float] | None = None) -> BudgetCurve:
    """The price `optimize` reports, over every real config (the exhaustive lattice), as the
    budget varies; the scenario's headroom is kept: usable = budget x (1 - headroom).
    ``budgets_gib`` default: 60 points from a quarter of the scenario's budget to one and a
    half times it."""
    land = land if isinstance(land, Landscape) else landscape(land)
    sc = land.scenario
    vram_gib = sc.budget.vram_bytes / GiB
    if budgets_gib is None:
        budgets_gib = np.linspace(0.25 * vram_gib, 1.5 * vram_gib, 60)
    budgets = np.asarray(sorted(budgets_gib), float)
    usable = np.floor(budgets * GiB) * (1.0 - sc.budget.headroom)
    best = best_objective_within(land.columns, usable)
    price = best_objective_within(land.columns, usable + GiB) - best
    return BudgetCurve(sc, budgets, best, price)


__all__ = ["BudgetCurve", "KnobGrid", "Landscape", "Sweep", "WORKLOAD_KNOBS",
           "best_objective_within", "best_pinned", "best_row", "budget_curve", "evaluate_all",
           "held_config", "knob_grid", "landscape", "pareto_front", "pin", "sweep"]
