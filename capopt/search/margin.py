"""`optimize --margin`: the fastest configs that fit even were their predicted peak short by the
held-out error measured for their runtime and layout (`capopt._trust`).

The search fits configs against the budget with the cost model's peak. With a margin, a config
fits where its peak, grown as if the prediction were short by its layout's held-out
90th-percentile shortfall (``p90``: in 9 of 10 held-out points the prediction fell short of the
measured peak by at most that share of it) or by the largest under-prediction measured
(``worst``), still fits: ``peak / (1 - e) <= budget``. A layout no held-out draw has
(pipeline or context parallelism) takes the runtime's figures over every layout. The errors differ by layout, so the margin
re-ranks rather than scales the budget: the configs that pass are taken from the search's
candidates and, where fewer pass than were asked for, from the best ``pool`` configs that fit a
second search scored (every config where the space allows), in the search's order (its
objective). Each keeps its own memory and time; only which ones are shown changes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from .._errors import CapoptError
from .._trust import config_group, load_table
from .optimize import plan_objective

MARGINS = {"p90": ("at_p90_under_bytes", "the 90th percentile of the held-out shortfall"),
           "worst": ("at_worst_under_bytes", "the largest held-out under-prediction")}


def margin_bytes(plan, kind: str) -> float | None:
    """``plan``'s peak were it short by the ``kind`` margin: None without held-out figures,
    infinite where the error is 100% or more (nothing bounds it)."""
    mem = plan.trust()["memory"]
    if mem is None:
        return None
    b = mem[MARGINS[kind][0]]
    return math.inf if b is None else b


def passes(plan, kind: str) -> bool:
    """Whether ``plan``'s peak, short by the ``kind`` margin, still fits its usable budget
    (never without held-out figures)."""
    b = margin_bytes(plan, kind)
    return b is not None and b <= plan.scenario.budget.usable_bytes


def with_margin(res, kind: str, top_k: int, pool: Callable[[], object]):
    """(``res`` keeping the configs that fit with the ``kind`` margin, the fastest first, at
    most ``top_k``; what was done, as a dict). CapoptError where the runtime has no held-out
    figures to take a margin from."""
    sc = res.scenario
    if kind not in MARGINS:
        raise CapoptError(f"got {kind!r}", field="--margin", allowed=", ".join(MARGINS))
    budget = sc.budget.usable_bytes
    nominal = res.best
    if nominal is not None and margin_bytes(nominal, kind) is None:
        raise CapoptError(f"the {sc.runtime.name} runtime has no held-out oracle measurement "
                          "to take a margin from (README \"How far to trust it\")",
                          file=sc.path, field="--margin", allowed="a runtime with figures: "
                          + ", ".join(load_table()["memory"]))

    def passing(plans):
        return [p for p in plans if passes(p, kind)]

    keep = passing(res.candidates)
    pooled = 0
    if len(keep) < min(top_k, len(res.candidates)) or not keep:
        more = pool()
        pooled = len(more.candidates)
        seen = {p.config for p in keep}
        keep += [p for p in passing(more.candidates) if p.config not in seen]
        keep.sort(key=plan_objective, reverse=True)
    keep = keep[:top_k]
    info = {"kind": kind, "meaning": MARGINS[kind][1], "budget_bytes": budget,
            "all_layouts": [i for i, p in enumerate(keep) if config_group(p.config) is None],
            "pool": pooled, "nominal_best": nominal.to_dict() if nominal else None,
            "best_margin_bytes": margin_bytes(keep[0], kind) if keep else None,
            "throughput_change": (keep[0].throughput["tokens_per_s"]
                                  / nominal.throughput["tokens_per_s"] - 1.0
                                  if keep and nominal else None)}
    out = dataclasses.replace(res, candidates=keep, shadow_price={},
                              status="ok" if keep else "infeasible")
    return out, info


__all__ = ["MARGINS", "margin_bytes", "passes", "with_margin"]
