"""`capopt.report.figures`: each figure carries the artists a reader relies on, drawn from real
estimates (bars per memory term, the budget line, the chosen config, shaded infeasible cells).

Positions are compared in GiB with a relative tolerance of 1e-6: the figures divide float32
byte counts by 2^30 in float64, so they agree to float32 rounding, nothing more is claimed.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install -e '.[plot]')")

import capopt  # noqa: E402
from capopt.report import figures  # noqa: E402
from capopt.search import explore  # noqa: E402
from capopt._terms import MEMORY_TERMS  # noqa: E402
from capopt.cost import numbers_pytree  # noqa: E402
from capopt.search import build_lattice  # noqa: E402
from capopt.search._evaluate import evaluate  # noqa: E402
from matplotlib.collections import LineCollection, PathCollection  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

GiB = 2**30
REL = 1e-6
DEFAULT = "llama3-8b-8xh100"


def by_gid(fig, gid):
    return fig.findobj(lambda a: a.get_gid() == gid)


def bars(ax, term):
    """The bar rectangles of one memory term, left to right."""
    rects = [r for r in ax.patches if isinstance(r, Rectangle) and r.get_gid() == f"mem:{term}"]
    return sorted(rects, key=lambda r: r.get_x())


@pytest.fixture(scope="module")
def default():
    return capopt.load_scenario(DEFAULT)


@pytest.fixture(scope="module")
def exhaustive(default):
    return capopt.optimize(default, method="exhaustive", top_k=3, remedies=False)


def test_import_capopt_does_not_import_matplotlib():
    code = "import sys, capopt; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
def test_memory_breakdown_one_bar_per_term_stacked_to_the_total(exhaustive):
    best = exhaustive.best
    fig = figures.memory_breakdown(best)
    ax = fig.axes[0]
    tops = 0.0
    for term in MEMORY_TERMS:
        (r,) = bars(ax, term)
        assert r.get_height() == pytest.approx(best.memory[term] / GiB, rel=REL, abs=1e-9)
        assert r.get_y() == pytest.approx(tops, rel=REL, abs=1e-9)
        tops += r.get_height()
    assert tops == pytest.approx(best.memory["total_bytes"] / GiB, rel=REL)
    (budget,) = by_gid(fig, "budget")
    (vram,) = by_gid(fig, "vram")
    assert isinstance(budget, Line2D)
    assert budget.get_ydata()[0] == pytest.approx(best.memory["budget_bytes"] / GiB, rel=REL)
    assert vram.get_ydata()[0] == pytest.approx(80.0, rel=REL)
    assert "GiB" in ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "activations" in labels and "optimizer state" in labels


def test_memory_breakdown_several_plans_dicts_and_result(exhaustive):
    fig = figures.memory_breakdown(exhaustive)                 # an OptimizeResult: candidates
    for term in MEMORY_TERMS:
        assert len(bars(fig.axes[0], term)) == len(exhaustive.candidates)
    fig = figures.memory_breakdown([c.to_dict() for c in exhaustive.candidates], labels=list("abc"))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a", "b", "c"]
    with pytest.raises(ValueError):
        figures.memory_breakdown([exhaustive.best], labels=["a", "b"])


def test_memory_breakdown_marks_a_config_over_budget(default):
    p = capopt.plan(default, micro_batch=1, dp=8, tp=1, pp=1, zero_stage=0, remat="none",
                    sequence_parallel=False)
    assert not p.fits
    fig = figures.memory_breakdown(p)
    assert by_gid(fig, "over"), "a bar over the budget is hatched"


def test_memory_breakdown_different_budgets_get_one_budget_mark_per_bar(default):
    import dataclasses
    h200 = capopt.get_hardware("h200-sxm-141gb")
    big = dataclasses.replace(default, hardware=h200,
                              budget=capopt.Budget(h200.memory_bytes, 0.1))
    cfg = capopt.optimize(default, method="exhaustive", top_k=1, remedies=False).best.config
    a, b = capopt.plan(default, config=cfg), capopt.plan(big, config=cfg)
    fig = figures.memory_breakdown([a, b])
    (budget,) = by_gid(fig, "budget")
    assert isinstance(budget, LineCollection)
    ys = sorted(seg[0][1] for seg in budget.get_segments())
    assert ys == pytest.approx([a.memory["budget_bytes"] / GiB, b.memory["budget_bytes"] / GiB],
                               rel=REL)


# --------------------------------------------------------------------------------------------
def test_pareto_front_helper():
    mem = np.array([3.0, 1.0, 2.0, 2.0, 4.0])
    val = np.array([6.0, 5.0, 4.0, 5.5, 6.0])
    assert explore.pareto_front(mem, val).tolist() == [1, 3, 0]


def test_pareto_marks_the_chosen_config_and_the_front(default, exhaustive):
    fig = figures.pareto(exhaustive, explore.landscape(default))
    best = exhaustive.best
    (chosen,) = by_gid(fig, "chosen")
    x, y = chosen.get_offsets()[0]
    assert x == pytest.approx(best.memory["total_bytes"] / GiB, rel=REL)
    assert y == pytest.approx(best.throughput["tokens_per_s"], rel=REL)
    (front,) = by_gid(fig, "front")
    fx, fy = front.get_xdata(), front.get_ydata()
    usable = default.budget.usable_bytes / GiB
    assert np.all(np.diff(fx) >= 0) and np.all(np.diff(fy) > 0), "a front rises with memory"
    assert fx.max() <= usable * (1 + REL)
    assert fy.max() == pytest.approx(best.throughput["tokens_per_s"], rel=REL), \
        "the chosen config tops the front of the configs that fit"
    (budget,) = by_gid(fig, "budget")
    assert budget.get_xdata()[0] == pytest.approx(usable, rel=REL)
    trust = best.trust()["memory"]
    for gid, key in (("trust_p90", "at_p90_under_bytes"), ("trust_worst", "at_worst_under_bytes")):
        (line,) = by_gid(fig, gid)
        assert line.get_xdata()[0] == pytest.approx(x, rel=REL)
        assert line.get_xdata()[1] == pytest.approx(trust[key] / GiB, rel=REL)
    fits, nofit = by_gid(fig, "fits")[0], by_gid(fig, "nofit")[0]
    lat = build_lattice(default)
    assert len(fits.get_offsets()) + len(nofit.get_offsets()) == len(lat)


def test_figures_draw_what_they_are_given_and_refuse_a_scenario(default, exhaustive):
    # a figure computes nothing: handed a scenario in place of the data, it says what it needs
    with pytest.raises(TypeError, match="landscape"):
        figures.pareto(exhaustive, default)
    with pytest.raises(TypeError, match="OptimizeResult"):
        figures.pareto(DEFAULT, explore.landscape(default))
    for draw, what in ((figures.heatmap, "knob_grid"), (figures.sweep, "explore.sweep"),
                       (figures.shadow_price_curve, "budget_curve")):
        with pytest.raises(TypeError, match=what):
            draw(default)


# --------------------------------------------------------------------------------------------
def _cell_minima(sc, x, y):
    lat = build_lattice(sc)
    res = evaluate(lat, numbers_pytree(sc), 0.0)
    cells = {}
    for i in range(len(lat)):
        key = (int(lat.cols[x][i]), int(lat.cols[y][i]))
        cells[key] = min(cells.get(key, np.inf), float(res["total_bytes"][i]))
    return cells


def test_heatmap_shades_cells_where_nothing_fits(scenario_factory):
    sc = scenario_factory(count=8, vram_gib=80.0)
    minima = _cell_minima(sc, "tp", "pp")
    # A budget between the cells' smallest requirements: some cells fit, some do not.
    usable = float(np.median(sorted(minima.values())))
    sc = scenario_factory(count=8, vram_gib=usable / GiB / 0.9 * (1 + 1e-6))
    minima = _cell_minima(sc, "tp", "pp")
    over = {k for k, v in minima.items() if v > sc.budget.usable_bytes}
    assert 0 < len(over) < len(minima)
    fig = figures.heatmap(explore.knob_grid(sc, x="tp", y="pp"))
    ax = fig.axes[0]
    shaded = by_gid(fig, "infeasible")
    assert len(shaded) == len(over)
    xt = [int(t.get_text()) for t in ax.get_xticklabels()]
    yt = [int(t.get_text()) for t in ax.get_yticklabels()]
    got = {(xt[round(r.get_x() + 0.5)], yt[round(r.get_y() + 0.5)]) for r in shaded}
    assert got == over
    best = capopt.optimize(sc, method="exhaustive", top_k=1, remedies=False).best
    (chosen,) = by_gid(fig, "chosen")
    assert (xt[round(chosen.get_x() + 0.5)], yt[round(chosen.get_y() + 0.5)]) == (
        best.config.tp, best.config.pp)
    grid = len(xt) * len(yt)
    assert len(by_gid(fig, "invalid")) == grid - len(minima)


def test_heatmap_rejects_unknown_knobs(default):
    with pytest.raises(ValueError):
        explore.knob_grid(default, x="tp", y="nonsense")
    with pytest.raises(ValueError):
        explore.knob_grid(default, x="tp", y="tp")


# --------------------------------------------------------------------------------------------
def test_sweep_reoptimised_draws_one_bar_per_value(default):
    values = [1, 2, 4]
    fig = figures.sweep(explore.sweep(default, "micro_batch", values))
    top = fig.axes[0]
    for term in MEMORY_TERMS:
        assert len(bars(top, term)) == len(values)
    # each value's bar is the best config with that micro-batch: it fits here
    usable = default.budget.usable_bytes / GiB
    totals = np.sum([[r.get_height() for r in bars(top, t)] for t in MEMORY_TERMS], axis=0)
    assert np.all(totals <= usable * (1 + REL))
    assert len(by_gid(fig, "budget")) == 1
    (fits,) = by_gid(fig, "fits")
    assert len(fits.get_offsets()) == len(values)


def test_sweep_holding_a_config_marks_values_without_a_real_config(default, exhaustive):
    fig = figures.sweep(explore.sweep(default, "tp", [1, 2, 3], config=exhaustive.best))
    assert len(by_gid(fig, "invalid")) == 1                  # tp=3 divides nothing here
    assert len(bars(fig.axes[0], "params_bytes")) == 2
    fig = figures.sweep(explore.sweep(default, "seq_len", [4096, 8192]))
    assert len(bars(fig.axes[0], "activations_bytes")) == 2
    with pytest.raises(ValueError):
        explore.sweep(default, "seq_len")
    with pytest.raises(ValueError):
        explore.sweep(default, "nonsense", [1])


# --------------------------------------------------------------------------------------------
def test_shadow_price_curve_matches_optimize_at_the_scenario_budget(default, exhaustive):
    vram = default.budget.vram_bytes / GiB
    fig = figures.shadow_price_curve(explore.budget_curve(default, budgets_gib=[4.0, vram]))
    (price,) = by_gid(fig, "shadow_price")
    xs, ys = price.get_xdata(), price.get_ydata()
    assert list(xs) == [vram], "nothing fits 4 GiB: no price there"
    assert ys[0] == pytest.approx(exhaustive.shadow_price["tokens_per_s_per_gib"], rel=REL,
                                  abs=1e-6)
    assert by_gid(fig, "infeasible"), "budgets where nothing fits are shaded"
    assert by_gid(fig, "budget")


def test_best_objective_within():
    res = {"total_bytes": np.array([3.0, 1.0, 2.0]), "objective": np.array([9.0, 1.0, 5.0])}
    got = explore.best_objective_within(res, [0.5, 1.0, 2.5, 10.0])
    assert np.isnan(got[0])
    assert got[1:].tolist() == [1.0, 5.0, 9.0]


# --------------------------------------------------------------------------------------------
def _result(tier, status, pred, meas):
    return {"config": {}, "tier": tier, "status": status, "predicted": pred, "measured": meas}


def test_predicted_vs_measured_plots_only_pairs_that_exist():
    # Contract-shaped test inputs (not measurements): one exact result with two byte
    # quantities, one device result with a step time, one OOM with nothing measured.
    doc = {"results": [
        _result("exact", "ok", {"argument_bytes": 2 * GiB, "temp_bytes": GiB},
                {"argument_bytes": 2 * GiB, "temp_bytes": 1.5 * GiB}),
        _result("device", "ok", {"peak_bytes": 10 * GiB, "step_s": 0.5},
                {"peak_bytes": 11 * GiB, "step_s": 0.6}),
        _result("device", "oom", {"peak_bytes": 90 * GiB}, {}),
    ]}
    fig = figures.predicted_vs_measured(doc)
    assert len(fig.axes) == 2                                  # memory and step time
    assert len(by_gid(fig, "identity")) == 2
    (temp,) = by_gid(fig, "pair:temp_bytes:exact")
    assert temp.get_offsets()[0].tolist() == pytest.approx([1.5, 1.0])   # (measured, predicted)
    (peak,) = by_gid(fig, "pair:peak_bytes:device")
    assert len(peak.get_offsets()) == 1, "the OOM run has no measurement to draw"
    (step,) = by_gid(fig, "pair:step_s:device")
    assert step.get_offsets()[0].tolist() == pytest.approx([0.6, 0.5])
    assert "1 oom" in fig._suptitle.get_text()
    # a list of documents works the same
    fig2 = figures.predicted_vs_measured([doc, {"results": []}])
    assert len(by_gid(fig2, "pair:temp_bytes:exact")) == 1


def test_predicted_vs_measured_without_measurements_says_so():
    fig = figures.predicted_vs_measured({"results": []})
    (msg,) = by_gid(fig, "empty")
    assert "no measurements" in msg.get_text()
    assert not fig.findobj(PathCollection)


# --------------------------------------------------------------------------------------------
def test_save_writes_png_and_makes_folders(tmp_path, exhaustive):
    out = figures.save(figures.memory_breakdown(exhaustive.best), tmp_path / "a" / "b" / "m.png")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    svg = figures.save(figures.memory_breakdown(exhaustive.best), tmp_path / "m.svg")
    assert "<svg" in open(svg).read(500)


def test_cli_plot_flags(tmp_path):
    from capopt.cli import main
    p1, p2 = tmp_path / "plan.png", tmp_path / "opt.png"
    assert main(["plan", "llama2-13b-zero3-8xa100", "--plot", str(p1)]) == 0
    assert main(["optimize", "gpt2-124m-rtx4090", "--method", "exhaustive", "--plot",
                 str(p2)]) == 0
    assert p1.stat().st_size > 10_000 and p2.stat().st_size > 10_000


def test_peak_errors_draws_every_point_at_its_error():
    pts = [{"split": "fit", "measured_peak_bytes": 2**30, "error": 0.12},
           {"split": "fit", "measured_peak_bytes": 2**31, "error": -0.05},
           {"split": "heldout", "measured_peak_bytes": 2**29, "error": 0.2},
           {"split": "heldout", "measured_peak_bytes": 2**28, "error": None}]
    fig = figures.peak_errors(pts)
    (fit,) = by_gid(fig, "err:fit")
    assert sorted(float(y) for _, y in fit.get_offsets()) == pytest.approx([-5.0, 12.0])
    assert sorted(float(x) for x, _ in fit.get_offsets()) == pytest.approx([1024.0, 2048.0])
    (held,) = by_gid(fig, "err:heldout")
    assert len(held.get_offsets()) == 1       # a point without a number is left out
    assert not by_gid(fig, "err:full-size")
    assert by_gid(fig, "band2") and by_gid(fig, "band5") and by_gid(fig, "band8")


def test_published_runs_draws_each_row_by_generation_and_source():
    def row(src, gpu, tokens, err, mem=None, mem_err=None):
        return {"source": src, "gpu": gpu, "throughput_error": err, "memory_error": mem_err,
                "published": {"tokens_per_gpu": tokens, "memory_gib": mem}}
    rows = [row("llm-foundry", "a100-sxm-80gb", 1000.0, 0.05),
            row("llm-foundry", "h100-sxm-80gb", 2000.0, 0.30),
            row("torchtitan", "h100-sxm-96gb", 5000.0, -0.20, 80.0, -0.1),
            row("megatron", "h100-sxm-80gb", 300.0, None)]       # refused: not drawn
    fig = figures.published_runs(rows, within=0.15)
    (a100,) = by_gid(fig, "thr:a100:llm-foundry")
    assert [tuple(map(float, p)) for p in a100.get_offsets()] == [(1000.0, 5.0)]
    (titan,) = by_gid(fig, "thr:h100:torchtitan")
    assert [tuple(map(float, p)) for p in titan.get_offsets()] == [(5000.0, -20.0)]
    assert not by_gid(fig, "thr:h100:megatron")
    (mem,) = by_gid(fig, "mem")
    assert [tuple(map(float, p)) for p in mem.get_offsets()] == [(80.0, -10.0)]
    labels = [t.get_text() for a in fig.axes for t in a.get_legend().get_texts()]
    assert any(t.startswith("Hopper (H100): median 25.0%, 0/2 within") for t in labels)
    assert any(t.startswith("median 10.0%, 1/1 within") for t in labels)
