"""What-ifs over a scenario's whole lattice, for the figures and notebooks: every config
evaluated exactly, the best one within a budget, a knob pinned or changed with the rest
rebalanced. The same evaluator and objective as `optimize`'s exhaustive reference."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from .._plan import Plan
from .._specs import Config, KnobDomain, Scenario
from .._validity import config_problems, mend
from ..cost import numbers_pytree
from ._evaluate import cost_mode, evaluate
from ._space import build_lattice

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
    ZeRO-2/3 with pp, ep that does not divide dp). Returns (scenario, config or
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
    if knob == "grad_accum":
        d["micro_batch"] = max(batch // (d["dp"] * d["grad_accum"]), 1)
    else:
        d["grad_accum"] = max(batch // (d["dp"] * d["micro_batch"]), 1)
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


__all__ = ["WORKLOAD_KNOBS", "best_objective_within", "best_pinned", "best_row",
           "evaluate_all", "held_config", "pin"]
