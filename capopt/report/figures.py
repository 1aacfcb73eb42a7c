"""Figures of the trade-offs: memory breakdowns, sweeps, Pareto fronts, heat maps, shadow prices,
predicted vs measured.

Every function returns a `matplotlib.figure.Figure` built without `matplotlib.pyplot`: no
global backend is chosen, no window opens and nothing needs a display, so the figures work the
same in a terminal, on a headless CI machine and in Jupyter (``%matplotlib inline`` shows a
returned figure once). `save` writes PNG/SVG/PDF through the Agg renderer.

Memory is shown per device in GiB (2^30 bytes); throughput in tokens/s. A figure draws the
data handed to it and computes nothing: a plan or an `OptimizeResult`, validation records, or
the what-ifs of `capopt.search.explore` (`landscape`: every real config of the scenario
evaluated, the same numbers the exhaustive search ranks; `sweep`; `knob_grid`;
`budget_curve`).

Artists that tests and readers look for carry a ``gid``: ``"budget"`` and ``"vram"`` lines,
``"chosen"`` for the selected config, ``"infeasible"`` / ``"invalid"`` for shaded cells,
``"front"`` for a Pareto front, ``"mem:<term>"`` for the bar segments of one memory term.

    >>> from capopt import load_scenario, optimize
    >>> from capopt.report import figures
    >>> from capopt.search import explore
    >>> sc = load_scenario("llama3-8b-8xh100")
    >>> fig = figures.pareto(optimize(sc), explore.landscape(sc))
    >>> figures.save(fig, "pareto.png")                                 # doctest: +SKIP

``import capopt`` does not import this module (nor matplotlib): callers import it on first use.
"""

from __future__ import annotations

import os
import textwrap
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from .._format import CONFIG_SHORT
from .._plan import Plan
from .._specs import KNOBS, Scenario
from .._terms import MEMORY_LABELS as _MEMORY_LABELS
from .._terms import MEMORY_TERMS
from .._units import GiB
from ..search.explore import BudgetCurve, KnobGrid, Landscape, Sweep, pareto_front

if TYPE_CHECKING:
    from ..search.optimize import OptimizeResult

#: How each memory term is named on a figure: the CLI's words, one table for both.
MEMORY_LABELS = dict(_MEMORY_LABELS)
MEMORY_COLORS = {"params_bytes": "#4c72b0", "grads_bytes": "#dd8452",
                 "optimizer_bytes": "#55a868", "activations_bytes": "#c44e52",
                 "logits_bytes": "#8172b3", "comm_bytes": "#937860",
                 "overhead_bytes": "#8c8c8c"}
BUDGET_COLOR = "#d62728"
VRAM_COLOR = "black"
CHOSEN_COLOR = "#ff7f0e"


def _compact(x: float, pos=None) -> str:
    """3 significant digits with k/M/G: 76.4k."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g}{prefix}"
    return f"{x:.3g}"


_TOKENS = FuncFormatter(_compact)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _figure(width: float = 8.0, height: float = 5.0) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _fmt_value(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "on" if v else "off"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _config_text(cfg: Mapping, keys: Iterable[str] | None = None, width: int = 22) -> str:
    keys = list(keys) if keys is not None else [k for k in cfg if k in KNOBS]
    text = " ".join(f"{CONFIG_SHORT.get(k, k)}={_fmt_value(cfg[k])}" for k in keys)
    return "\n".join(textwrap.wrap(text, width)) if width else text


def _plan_dict(p) -> dict:
    if isinstance(p, Plan):
        return p.to_dict()
    if isinstance(p, Mapping) and "memory" in p:
        return dict(p)
    raise TypeError(f"expected a capopt Plan or a plan dict (to_dict()), got {type(p).__name__}")


def _as_plans(plans) -> list[dict]:
    if isinstance(plans, (Plan, Mapping)):
        plans = [plans]
    elif hasattr(plans, "candidates") and hasattr(plans, "scenario"):   # an OptimizeResult
        plans = plans.candidates
    out = [_plan_dict(p) for p in plans]
    if not out:
        raise ValueError("no plans to draw")
    return out


def _gib(x) -> np.ndarray | float:
    return np.asarray(x, dtype=float) / GiB if np.ndim(x) else float(x) / GiB


def _objective_name(sc: Scenario) -> str:
    return "tokens per $" if sc.objective == "cost_efficiency" else "tokens/s"


def _budget_lines(ax, budgets: Sequence[float], vrams: Sequence[float], xs: Sequence[float],
                  half: float = 0.45, label_budget: str | None = None,
                  label_vram: str | None = None) -> None:
    """The usable budget and the VRAM per device: one line across the axes when every bar has
    the same, else a short line over each bar."""
    if len(set(budgets)) == 1 and len(set(vrams)) == 1:
        ax.axhline(_gib(budgets[0]), color=BUDGET_COLOR, ls="--", lw=1.6, gid="budget",
                   label=label_budget or f"budget {_gib(budgets[0]):.1f} GiB usable")
        ax.axhline(_gib(vrams[0]), color=VRAM_COLOR, ls=":", lw=1.2, gid="vram",
                   label=label_vram or f"VRAM {_gib(vrams[0]):.0f} GiB")
    else:
        xs = np.asarray(xs, float)
        ax.hlines(_gib(np.asarray(budgets)), xs - half, xs + half, colors=BUDGET_COLOR,
                  linestyles="--", lw=1.6, gid="budget", label=label_budget or "budget (usable)")
        ax.hlines(_gib(np.asarray(vrams)), xs - half, xs + half, colors=VRAM_COLOR,
                  linestyles=":", lw=1.2, gid="vram", label=label_vram or "VRAM")


def _memory_ylim(mems: Sequence[Mapping]) -> tuple[float, float]:
    """Top of a memory axis: the tallest bar, but no more than twice the VRAM (taller bars are
    cut there and say so), so bars that fit stay readable next to ones that do not.
    Returns (y limit, the height above which a bar is cut)."""
    vram = max(_gib(m["vram_bytes"]) for m in mems)
    cap = 2.0 * vram
    tallest = max(_gib(m["total_bytes"]) for m in mems)
    if tallest > cap:
        return cap * 1.1, cap
    return max(tallest, vram) * 1.18, cap


def _stacked_bars(ax, mems: Sequence[Mapping], xs: Sequence[float], width: float = 0.7,
                  hatch_over: bool = True) -> float:
    """One stacked bar per memory dict, a segment per term (GiB), total on top; sets and
    returns the y limit (see `_memory_ylim`)."""
    ymax, cap = _memory_ylim(mems)
    ax.set_ylim(0, ymax)
    xs = np.asarray(xs, float)
    bottom = np.zeros(len(mems))
    for term in MEMORY_TERMS:
        vals = np.array([_gib(m.get(term, 0.0)) for m in mems])
        ax.bar(xs, vals, width, bottom=bottom, color=MEMORY_COLORS[term],
               label=MEMORY_LABELS[term], gid=f"mem:{term}", edgecolor="white", lw=0.5)
        bottom += vals
    for x, m, top in zip(xs, mems, bottom):
        over = m["total_bytes"] > m["budget_bytes"]
        note = f"{_gib(m['total_bytes']):.1f}"
        if over:
            note += f"\nover by {_gib(m['total_bytes'] - m['budget_bytes']):.1f}"
            if hatch_over:
                ax.bar([x], [top], width, fill=False, hatch="//", edgecolor=BUDGET_COLOR,
                       lw=0, gid="over")
        if top > cap:   # the bar runs off the axes: say how tall it is, inside it
            note = f"{_gib(m['total_bytes']):.0f} GiB\n(cut)"
        ax.annotate(note, (x, min(top, cap)), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8, color=BUDGET_COLOR if over else "black",
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
    return ymax


# --------------------------------------------------------------------------------------------
# Memory breakdown
# --------------------------------------------------------------------------------------------
def memory_breakdown(plans, labels: Sequence[str] | None = None,
                     title: str | None = None) -> Figure:
    """Stacked per-device memory of one or several configs against the budget and VRAM lines.

    Args:
      plans: a `Plan`, a plan dict (``Plan.to_dict()``), an `OptimizeResult` (its candidates)
        or a list of plans/dicts. Each bar is the device that needs the most memory.
      labels: one x label per bar; default: the knobs that differ between the configs (all of
        them for one config), or the scenario names when the plans come from several.
      title: default: the scenario's name.

    Returns:
      A `Figure` with one bar segment per memory term (``gid="mem:<term>"``), a ``"budget"``
      and a ``"vram"`` line, and totals in GiB on top of the bars.
    """
    ps = _as_plans(plans)
    n = len(ps)
    scen = [p.get("scenario", "") for p in ps]
    if labels is None:
        cfgs = [p["config"] for p in ps]
        if len(set(scen)) > 1:
            labels = [textwrap.fill(s, 22) for s in scen]
        else:
            differ = [k for k in cfgs[0] if len({str(c[k]) for c in cfgs}) > 1]
            labels = [_config_text(c, differ or None) for c in cfgs]
    if len(labels) != n:
        raise ValueError(f"{len(labels)} labels for {n} plans")
    mems = [p["memory"] for p in ps]
    fig = _figure(max(6.0, 1.3 * n + 4.5), 5.0)
    ax = fig.add_subplot()
    xs = np.arange(n)
    _stacked_bars(ax, mems, xs)
    _budget_lines(ax, [m["budget_bytes"] for m in mems], [m["vram_bytes"] for m in mems], xs)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("memory per device (GiB)")
    ax.set_title(title if title is not None else (scen[0] if len(set(scen)) == 1 else
                                                  "memory per device"))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return fig


# --------------------------------------------------------------------------------------------
# One knob at a time
# --------------------------------------------------------------------------------------------
def sweep(data: Sweep, *, title: str | None = None) -> Figure:
    """Memory per device and throughput as one knob moves (`capopt.search.explore.sweep`).

    Returns:
      A `Figure`: stacked memory (GiB) per value against the budget, and throughput below
      (filled markers fit the budget, hollow ones do not); values that make no real config
      leave a gap marked "invalid".
    """
    if not isinstance(data, Sweep):
        raise TypeError("sweep draws a capopt.search.explore.sweep(...) result, got a "
                        f"{type(data).__name__}")
    sc, knob, values, plans = data.scenario, data.knob, data.values, data.plans
    notes = [_config_text(p.config.to_dict(), keys, width=14) if p is not None and keys else ""
             for p, keys in zip(plans, data.shown)]

    fig = _figure(max(7.0, 0.9 * len(values) + 4.5), 7.0)
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    xs = np.arange(len(values))
    ok = [i for i, p in enumerate(plans) if p is not None]
    mems = [plans[i].memory for i in ok]
    if ok:
        _stacked_bars(ax, mems, xs[ok])
        _budget_lines(ax, [m["budget_bytes"] for m in mems], [m["vram_bytes"] for m in mems],
                      xs[ok])
    for i, p in enumerate(plans):
        if p is None:
            ax.text(i, 0.04, "no real\nconfig", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8, color="0.4", gid="invalid")
    ax.set_xlim(-0.6, len(values) - 0.4)
    ax.set_ylabel("memory per device (GiB)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)

    tps = np.array([p.throughput["tokens_per_s"] if p else np.nan for p in plans])
    fits = np.array([bool(p and p.fits) for p in plans])
    ax2.plot(xs, tps, color="0.5", lw=1, zorder=1)
    ax2.scatter(xs[fits], tps[fits], color="C0", s=40, zorder=2, label="fits", gid="fits")
    nofit = ~fits & ~np.isnan(tps)
    ax2.scatter(xs[nofit], tps[nofit], facecolors="none", edgecolors=BUDGET_COLOR, s=40,
                zorder=2, label="does not fit", gid="nofit")
    ax2.yaxis.set_major_formatter(_TOKENS)
    ax2.set_ylabel("throughput (tokens/s)")
    ax2.set_ylim(0, (np.nanmax(tps) if np.isfinite(tps).any() else 1.0) * 1.15)
    ax2.grid(alpha=0.3)
    if nofit.any():
        ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax2.set_xticks(xs, [_fmt_value(v) + (f"\n{n}" if n else "") for v, n in zip(values, notes)],
                   fontsize=8)
    ax2.set_xlabel(knob.replace("_", " "))
    if data.held is None:
        how = "other knobs re-optimised at each value"
    else:
        how = "others held at\n" + _config_text(data.held.to_dict(), width=0)
    ax.set_title(title if title is not None else f"{sc.name}: {knob} sweep ({how})",
                 fontsize=10)
    return fig


# --------------------------------------------------------------------------------------------
# The throughput-memory Pareto front
# --------------------------------------------------------------------------------------------
def pareto(result: OptimizeResult, land: Landscape, *, title: str | None = None) -> Figure:
    """Throughput against memory per device for every real config, the front, the choice.

    Args:
      result: an `OptimizeResult`: its best config is marked, its other candidates circled.
      land: every real config of the scenario, evaluated (`capopt.search.explore.landscape`).

    Returns:
      A `Figure`: configs that fit as dots, those that do not as grey crosses, the Pareto front
      of the fitting ones (``gid="front"``; dashed beyond the budget: what more memory buys),
      the ``"budget"`` and ``"vram"`` lines and the ``"chosen"`` config, with how far to trust
      its memory (`capopt._trust`): lines to its peak were it short by the held-out
      90th-percentile shortfall (``"trust_p90"``) and the largest under-prediction
      (``"trust_worst"``) of its runtime and layout.
    """
    if type(result).__name__ != "OptimizeResult":
        raise TypeError("pareto draws an OptimizeResult (capopt.optimize(...)), got a "
                        f"{type(result).__name__}")
    if not isinstance(land, Landscape):
        raise TypeError("pareto needs the scenario's landscape "
                        f"(capopt.search.explore.landscape(...)), got a {type(land).__name__}")
    sc = result.scenario
    lat, res = land.lattice, land.columns
    usable, vram = sc.budget.usable_bytes, sc.budget.vram_bytes
    mem = _gib(res["total_bytes"])
    tps = res["tokens_per_s"]
    fit = res["total_bytes"] <= usable

    fig = _figure(8.5, 5.2)
    ax = fig.add_subplot()
    ax.scatter(mem[~fit], tps[~fit], marker="x", s=14, color="0.65", lw=0.8,
               label=f"does not fit ({int((~fit).sum())})", gid="nofit")
    ax.scatter(mem[fit], tps[fit], s=14, color="C0", alpha=0.6,
               label=f"fits ({int(fit.sum())})", gid="fits")
    if fit.any():
        idx = np.nonzero(fit)[0]
        f = idx[pareto_front(mem[idx], tps[idx])]
        ax.step(mem[f], tps[f], where="post", color="C0", lw=1.8, gid="front",
                label="Pareto front (fits)")
    if (~fit).any():
        fa = pareto_front(mem, tps)
        beyond = fa[res["total_bytes"][fa] > usable]
        if len(beyond):
            last_fit = f[-1:] if fit.any() else np.zeros(0, int)
            g = np.concatenate([last_fit, beyond])
            ax.step(mem[g], tps[g], where="post", color="0.45", lw=1.2, ls="--",
                    gid="front_beyond", label="front beyond the budget")
    ax.axvline(_gib(usable), color=BUDGET_COLOR, ls="--", lw=1.6, gid="budget",
               label=f"budget {_gib(usable):.1f} GiB usable")
    ax.axvline(_gib(vram), color=VRAM_COLOR, ls=":", lw=1.2, gid="vram",
               label=f"VRAM {_gib(vram):.0f} GiB")
    for k, c in enumerate(result.candidates[1:]):
        ax.scatter([_gib(c.memory["total_bytes"])], [c.throughput["tokens_per_s"]], s=70,
                   facecolors="none", edgecolors=CHOSEN_COLOR, lw=1.2, gid="candidate",
                   label="other candidates" if k == 0 else None)
    best = result.best
    if best is not None:
        bm, bt = _gib(best.memory["total_bytes"]), best.throughput["tokens_per_s"]
        what = "max " + _objective_name(sc)
        ax.scatter([bm], [bt], marker="*", s=260, color=CHOSEN_COLOR, edgecolors="black",
                   lw=0.8, zorder=5, gid="chosen", label=f"chosen ({what})")
        ax.annotate(_config_text(best.config.to_dict(), width=28), (bm, bt),
                    xytext=(14, -22), textcoords="offset points", ha="left", va="top",
                    fontsize=7, bbox=dict(boxstyle="round", fc="white", ec="0.7", alpha=0.9))
        # how far to trust its memory: the peak were it short by its runtime and layout's
        # held-out 90th-percentile |error| (solid) and by the largest under-prediction (dotted)
        trust = best.trust()["memory"]
        if trust is not None:
            for key, ls, gid, what in (("at_worst_under_bytes", ":", "trust_worst",
                                        "largest held-out under-prediction"),
                                       ("at_p90_under_bytes", "-", "trust_p90",
                                        "held-out p90 shortfall")):
                if trust[key] is None:          # (an error of 100% or more bounds nothing)
                    continue
                ax.plot([bm, _gib(trust[key])], [bt, bt], color=CHOSEN_COLOR, ls=ls, lw=2.0,
                        zorder=4, gid=gid, label=f"chosen, short by the {what}")
    elif result.smallest is not None:
        s = result.smallest
        ax.scatter([_gib(s.memory["total_bytes"])], [s.throughput["tokens_per_s"]], marker="v",
                   s=120, color=BUDGET_COLOR, zorder=5, gid="smallest",
                   label="smallest requirement (nothing fits)")
    ax.yaxis.set_major_formatter(_TOKENS)
    ax.set_xlabel("memory per device (GiB)")
    ax.set_ylabel("throughput (tokens/s)")
    xmax = min(float(mem.max()) if len(mem) else 0.0, 2.0 * _gib(vram))
    xmax = max(xmax, _gib(vram)) * 1.05
    ax.set_xlim(0, xmax)
    hidden = int((mem > xmax).sum())
    if hidden:
        ax.text(0.99, 0.01, f"{hidden} configs need more than {xmax:.0f} GiB (not shown)",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="0.4")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title if title is not None else
                 f"{sc.name}: all {len(lat):,} real configs, chosen by the "
                 f"{result.method} search")
    return fig


# --------------------------------------------------------------------------------------------
# Two knobs: a heat map
# --------------------------------------------------------------------------------------------
def heatmap(grid: KnobGrid, *, title: str | None = None) -> Figure:
    """Best throughput per cell of two knobs (`capopt.search.explore.knob_grid`).

    Returns:
      A `Figure`: fitting cells coloured by the best tokens/s (with that config's GiB), cells
      where configs exist but none fits shaded and hatched (``gid="infeasible"``, with the
      least memory any of them needs), cells no real config reaches greyed (``"invalid"``), and
      the cell of the best fitting config outlined (``"chosen"``).
    """
    if not isinstance(grid, KnobGrid):
        raise TypeError("heatmap draws a capopt.search.explore.knob_grid(...) result, got a "
                        f"{type(grid).__name__}")
    sc, x, y = grid.scenario, grid.x, grid.y
    usable = sc.budget.usable_bytes
    fig = _figure(8.0, 5.6)
    ax = fig.add_subplot()
    if not grid.configs:
        ax.text(0.5, 0.5, "no real config in this scenario", ha="center", va="center",
                transform=ax.transAxes)
        return fig
    xn = [_fmt_value(v) for v in grid.x_values]
    yn = [_fmt_value(v) for v in grid.y_values]
    xc, yc = grid.x_values, grid.y_values
    best, best_mem, least = grid.best, grid.best_bytes, grid.least_bytes

    masked = np.ma.masked_invalid(best)
    mesh = ax.pcolormesh(np.arange(len(xc) + 1) - 0.5, np.arange(len(yc) + 1) - 0.5, masked,
                         cmap="viridis", shading="flat", gid="throughput")
    if np.isfinite(best).any():
        cb = fig.colorbar(mesh, ax=ax, format=_TOKENS)
        cb.set_label("best throughput of the configs that fit (tokens/s)")
    lo, hi = (np.nanmin(best), np.nanmax(best)) if np.isfinite(best).any() else (0, 1)
    for j in range(len(yc)):
        for i in range(len(xc)):
            if np.isfinite(best[j, i]):
                bright = (best[j, i] - lo) / (hi - lo) > 0.6 if hi > lo else True
                ax.text(i, j, f"{_compact(best[j, i])} tok/s\n{_gib(best_mem[j, i]):.1f} GiB",
                        ha="center", va="center", fontsize=7,
                        color="black" if bright else "white")
            elif np.isfinite(least[j, i]):
                ax.add_patch(Rectangle((i - 0.5, j - 0.5), 1, 1, facecolor="#f4c7c3",
                                       edgecolor=BUDGET_COLOR, hatch="///", lw=0.5,
                                       gid="infeasible"))
                ax.text(i, j, f"does not fit\nneeds {_gib(least[j, i]):.1f} GiB",
                        ha="center", va="center", fontsize=7, color="#8b1a1a",
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.85))
            else:
                ax.add_patch(Rectangle((i - 0.5, j - 0.5), 1, 1, facecolor="0.92",
                                       edgecolor="0.8", hatch="..", lw=0.5, gid="invalid"))
    if grid.chosen is not None:
        bi, bj = grid.chosen
        ax.add_patch(Rectangle((bi - 0.5, bj - 0.5), 1, 1, fill=False, edgecolor=CHOSEN_COLOR,
                               lw=3, gid="chosen", zorder=5))
    ax.set_xticks(range(len(xc)), xn)
    ax.set_yticks(range(len(yc)), yn)
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(y.replace("_", " "))
    ax.set_xlim(-0.5, len(xc) - 0.5)
    ax.set_ylim(-0.5, len(yc) - 0.5)
    handles = [Patch(facecolor="#f4c7c3", edgecolor=BUDGET_COLOR, hatch="///",
                     label=f"nothing fits {_gib(usable):.1f} GiB"),
               Patch(facecolor="0.92", edgecolor="0.8", hatch="..", label="no real config"),
               Patch(fill=False, edgecolor=CHOSEN_COLOR, lw=3, label="chosen")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3,
              fontsize=8, frameon=False)
    ax.set_title(title if title is not None else
                 f"{sc.name}: best over the other knobs per ({x}, {y})")
    return fig


# --------------------------------------------------------------------------------------------
# The shadow price of memory
# --------------------------------------------------------------------------------------------
def shadow_price_curve(curve: BudgetCurve, *, title: str | None = None) -> Figure:
    """The best objective and the shadow price of memory as the VRAM budget per device varies
    (`capopt.search.explore.budget_curve`: the price `optimize` reports, what the best fitting
    config gains when the usable budget grows by 1 GiB).

    Returns:
      A `Figure`: the best objective (top) and the shadow price (bottom) against the budget,
      the budgets where nothing fits shaded (``gid="infeasible"``), the scenario's own budget
      marked (``gid="budget"``).
    """
    if not isinstance(curve, BudgetCurve):
        raise TypeError("shadow_price_curve draws a capopt.search.explore.budget_curve(...) "
                        f"result, got a {type(curve).__name__}")
    sc = curve.scenario
    vram_gib = sc.budget.vram_bytes / GiB
    budgets, best, price = curve.budgets_gib, curve.best, curve.price

    fig = _figure(8.0, 6.2)
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    name = _objective_name(sc)
    ax.step(budgets, best, where="post", color="C0", lw=1.8, gid="best")
    ax.set_ylabel(f"best {name}")
    ax.yaxis.set_major_formatter(_TOKENS)
    ok = np.isfinite(price)
    ax2.vlines(budgets[ok], 0, price[ok], color="C2", lw=1.2)
    ax2.plot(budgets[ok], price[ok], "o", ms=3, color="C2", gid="shadow_price")
    ax2.set_ylabel(f"shadow price\n({name} per extra GiB)")
    ax2.yaxis.set_major_formatter(_TOKENS)
    ax2.set_xlabel(f"VRAM budget per device (GiB; {100 * sc.budget.headroom:.0f}% kept free)")
    none_fit = ~np.isfinite(best)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.axvline(vram_gib, color=BUDGET_COLOR, ls="--", lw=1.4, gid="budget",
                  label=f"scenario budget {vram_gib:.0f} GiB")
        if none_fit.any():
            edge = budgets[none_fit].max()
            nxt = budgets[budgets > edge]
            right = nxt.min() if len(nxt) else edge
            a.axvspan(budgets.min(), right, color="#f4c7c3", alpha=0.6, gid="infeasible",
                      label="nothing fits" if a is ax else None)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title if title is not None else f"{sc.name}: what memory is worth")
    return fig


# --------------------------------------------------------------------------------------------
# Predicted vs measured
# --------------------------------------------------------------------------------------------
MEASURED_BYTES = ("peak_bytes", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes")
_TIER_MARKERS = {"exact": "o", "xla-gpu": "s", "device": "D"}


def _results(results) -> list[dict]:
    if hasattr(results, "to_dict"):
        results = results.to_dict()
    if isinstance(results, Mapping):
        return list(results.get("results", []))
    out: list[dict] = []
    for r in results:
        if hasattr(r, "to_dict"):
            r = r.to_dict()
        out += list(r["results"]) if "results" in r else [r]
    return out


def _pairs(rows: list[dict], key: str):
    """(predicted, measured, tier) for every result that has both numbers, status ok."""
    out = []
    for r in rows:
        if r.get("status", "ok") != "ok":
            continue
        p, m = (r.get("predicted") or {}).get(key), (r.get("measured") or {}).get(key)
        if p is None or m is None:
            continue
        out.append((float(p), float(m), r.get("tier", "?")))
    return out


def predicted_vs_measured(results, keys: Sequence[str] = MEASURED_BYTES, *,
                          title: str | None = None) -> Figure:
    """Predicted against measured memory (GiB) and step time (s), one marker per tier.

    Args:
      results: the validate JSON (``{"results": [{"predicted": {...}, "measured": {...},
        "tier": ..., "status": ...}]}``), a list of such dicts, a list of result dicts, or an
        object with ``to_dict()``. Only results with status ``ok`` and a number on both sides
        are drawn; nothing is filled in. OOM and error results are counted in the title.
      keys: the byte quantities to compare (``step_s`` gets its own panel when present).

    Returns:
      A `Figure` with a y = x line (``gid="identity"``), a +-10% band, and per quantity and
      tier the median signed error (predicted / measured - 1) in the legend; when there is no
      measurement at all, a figure that says so.
    """
    rows = _results(results)
    mem_pairs = {k: _pairs(rows, k) for k in keys}
    mem_pairs = {k: v for k, v in mem_pairs.items() if v}
    time_pairs = _pairs(rows, "step_s")
    status = {s: sum(1 for r in rows if r.get("status", "ok") == s) for s in ("ok", "oom",
                                                                             "error")}
    panels = (1 if mem_pairs else 0) + (1 if time_pairs else 0)
    fig = _figure(6.0 * max(panels, 1) + 1.5, 5.2)
    head = title if title is not None else "predicted vs measured"
    counts = ", ".join(f"{n} {s}" for s, n in status.items() if n)
    fig.suptitle(f"{head} ({counts or 'no results'})")
    if not panels:
        ax = fig.add_subplot()
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no measurements to compare\n(no validation result has both a "
                "predicted and a measured value)", ha="center", va="center",
                transform=ax.transAxes, gid="empty")
        return fig
    axes = list(np.atleast_1d(fig.subplots(1, panels)))

    def panel(ax, series: dict[str, list], scale: float, unit: str):
        allv = [v / scale for s in series.values() for p, m, _ in s for v in (p, m)]
        lo, hi = min(allv), max(allv)
        log = lo > 0 and hi / lo > 20
        pad = (lo * 0.7, hi * 1.4) if log else (0.0, hi * 1.1 if hi > 0 else 1.0)
        xx = np.linspace(pad[0], pad[1], 50)
        ax.plot(xx, xx, color="0.3", lw=1, gid="identity", label="predicted = measured")
        ax.fill_between(xx, xx / 1.1, xx * 1.1, color="0.85", gid="band", label="within 10%")
        for ci, (key, pts) in enumerate(series.items()):
            for tier in sorted({t for *_, t in pts}):
                sel = [(p / scale, m / scale) for p, m, t in pts if t == tier]
                err = np.median([p / m - 1 for p, m in sel if m]) if any(
                    m for _, m in sel) else np.nan
                ax.scatter([m for _, m in sel], [p for p, _ in sel],
                           marker=_TIER_MARKERS.get(tier, "^"), color=f"C{ci}", s=36,
                           edgecolors="black", lw=0.4, gid=f"pair:{key}:{tier}",
                           label=f"{key.removesuffix('_bytes').removesuffix('_s')} [{tier}]"
                                 f" median error {100 * err:+.0f}%")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlim(*pad)
        ax.set_ylim(*pad)
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")

    i = 0
    if mem_pairs:
        panel(axes[i], mem_pairs, GiB, "GiB per device")
        axes[i].set_title("memory")
        i += 1
    if time_pairs:
        panel(axes[i], {"step_s": time_pairs}, 1.0, "s per step")
        axes[i].set_title("step time")
    return fig


PEAK_ERROR_GROUPS = {"fit": ("fitting split", "o", "C0"),
                     "heldout": ("held-out split", "s", "C3"),
                     "full-size": ("full-size cards", "D", "C2")}


def peak_errors(points: Sequence[Mapping], *, title: str | None = None,
                groups: Mapping[str, tuple[str, str, str]] | None = None) -> Figure:
    """Error of the predicted peak against an oracle's, case by case, per group.

    Args:
      points: the ``points`` of ``benchmarks/results/memory_random.json``, each with
        ``split`` (``fit``, ``heldout`` or ``full-size``), ``measured_peak_bytes`` and
        ``error`` (predicted / measured - 1).
      groups: ``split`` value -> (legend name, marker, colour); the memory_random splits by
        default. The first group is drawn hollow.

    Returns:
      A `Figure`: error (%) against measured peak (MiB, log), one series per split
      (``gid="err:<split>"``), bands at 2%, 5% and 8%, and each series' median, 90th
      percentile and worst |error| in the legend.
    """
    fig = _figure(8.5, 5.0)
    ax = fig.add_subplot()
    for band, shade in ((8, "0.94"), (5, "0.88"), (2, "0.80")):
        ax.axhspan(-band, band, color=shade, gid=f"band{band}", label=f"within {band}%")
    ax.axhline(0, color="0.3", lw=0.8)
    groups = dict(groups or PEAK_ERROR_GROUPS)
    first = next(iter(groups), None)
    for group, (name, marker, colour) in groups.items():
        sel = [p for p in points if p.get("split") == group and p.get("error") is not None]
        if not sel:
            continue
        x = [p["measured_peak_bytes"] / 2**20 for p in sel]
        y = [100 * p["error"] for p in sel]
        a = np.abs(y)
        ax.scatter(x, y, marker=marker, facecolors="none" if group == first else colour,
                   edgecolors=colour, s=30, lw=1.0, gid=f"err:{group}",
                   label=f"{name}: median {np.median(a):.1f}%, "
                         f"p90 {np.percentile(a, 90):.1f}%, worst {a.max():.1f}% (n={len(sel)})")
    ax.set_xscale("log")
    ax.set_xlabel("measured peak per device (MiB)")
    ax.set_ylabel("predicted / measured - 1 (%)")
    ax.set_title(title or "peak memory on random configs: cost model against XLA's GPU "
                          "buffer assignment")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    return fig


#: GPU generation of a published run's GPU, by its catalog name's prefix
_GENERATIONS = (("a100", "Ampere (A100)", "C0"), ("h100", "Hopper (H100)", "C3"),
                ("h200", "Hopper (H200)", "C1"))
_SOURCE_MARKERS = {"llm-foundry": "o", "torchtitan": "s", "megatron": "^"}


def published_runs(rows: Sequence[Mapping], *, within: float = 0.15,
                   title: str | None = None) -> Figure:
    """Predictions against published runs of real frameworks.

    Args:
      rows: the ``rows`` of ``benchmarks/results/published_runs.json``: ``source``, ``gpu``,
        ``published`` (``tokens_per_gpu``, ``memory_gib``), ``throughput_error`` and
        ``memory_error`` (predicted / published - 1, or None where not compared).
      within: the band drawn around 0 (a share).

    Returns:
      A `Figure` of two panels: throughput error (%) against published tokens/s per GPU (log),
      one series per GPU generation (``gid="thr:<generation>"``) with a marker per source,
      and memory error against published GiB (``gid="mem"``); each legend gives the series'
      median |error| and how many are within the band.
    """
    fig = _figure(11.0, 4.8)
    ax, axm = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1.0]})
    for a in (ax, axm):
        a.axhspan(-100 * within, 100 * within, color="0.90", gid="band",
                  label=f"within {100 * within:.0f}%")
        a.axhline(0, color="0.3", lw=0.8)
        a.grid(alpha=0.3)
    ok = [r for r in rows if r.get("throughput_error") is not None]
    for prefix, name, colour in _GENERATIONS:
        sel = [r for r in ok if str(r.get("gpu", "")).startswith(prefix)]
        if not sel:
            continue
        err = np.array([100 * r["throughput_error"] for r in sel])
        inside = int(np.sum(np.abs(err) <= 100 * within))
        for src, marker in _SOURCE_MARKERS.items():
            part = [(r["published"]["tokens_per_gpu"], 100 * r["throughput_error"])
                    for r in sel if r.get("source") == src]
            if part:
                x, y = zip(*part)
                ax.scatter(x, y, marker=marker, color=colour, s=22, alpha=0.8, lw=0.5,
                           gid=f"thr:{prefix}:{src}")
        ax.scatter([], [], marker="o", color=colour, gid=f"thr:{prefix}",
                   label=f"{name}: median {np.median(np.abs(err)):.1f}%, "
                         f"{inside}/{len(sel)} within")
    for src, marker in _SOURCE_MARKERS.items():
        if any(r.get("source") == src for r in ok):
            ax.scatter([], [], marker=marker, color="0.4", label=src)
    ax.set_xscale("log")
    ax.set_xlabel("published throughput (tokens/s per GPU)")
    ax.set_ylabel("predicted / published - 1 (%)")
    ax.set_title("throughput")
    ax.legend(fontsize=7, loc="upper left")
    mem = [r for r in rows if r.get("memory_error") is not None]
    if mem:
        x = [r["published"]["memory_gib"] for r in mem]
        y = np.array([100 * r["memory_error"] for r in mem])
        inside = int(np.sum(np.abs(y) <= 100 * within))
        axm.scatter(x, y, marker="s", color="C2", s=26, gid="mem",
                    label=f"median {np.median(np.abs(y)):.1f}%, {inside}/{len(y)} within")
        axm.legend(fontsize=7, loc="upper left")
    axm.set_xlabel("published peak memory (GiB)")
    axm.set_title("memory")
    fig.suptitle(title or "capopt against published training runs (nothing fitted to them)")
    return fig


# --------------------------------------------------------------------------------------------
def save(fig: Figure, path: str | os.PathLike, *, dpi: int = 150, **savefig_kw) -> str:
    """Write ``fig`` to ``path`` (the format from its suffix: .png, .svg, .pdf); folders are
    made as needed; other keywords go to `Figure.savefig`. Returns the path written."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches=savefig_kw.pop("bbox_inches", "tight"), **savefig_kw)
    return path


__all__ = sorted(["MEMORY_LABELS", "heatmap", "memory_breakdown", "pareto",
                  "predicted_vs_measured", "published_runs", "save", "shadow_price_curve",
                  "sweep"])
