"""The search over uneven pipeline stages (`capopt.search.stages`): the even split against the
main model, the layout solve and its gradients, the runtimes' own splits. Apart from
test_search.py so that the two halves can run in separate test processes."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capopt._specs import Config, KnobDomain
from capopt._validity import config_problems
from capopt.report import render
from capopt.cost import numbers_pytree
from capopt.search import build_lattice, optimize
from capopt.search.relax import DIM

from conftest import llama_like, make_scenario

# --------------------------------------------------------------------------------------------
# Uneven pipeline stages
# --------------------------------------------------------------------------------------------
def _pp_scenario(layers=8, vram=2.0):
    sc = make_scenario(llama_like(layers=layers, hidden=512, heads=8, kv=4), count=8,
                       global_batch=32, seq_len=1024, vram_gib=vram)
    return sc.replace(pipeline_layers="auto", stage_recompute="auto")


def _pp_configs(sc, limit=40):
    lat = build_lattice(sc)
    rows = [i for i in range(len(lat)) if lat.cols["pp"][i] >= 2]
    pick = np.random.default_rng(0).choice(rows, size=min(limit, len(rows)), replace=False)
    return [lat.config(int(i)) for i in pick]


def test_even_split_equals_the_main_model():
    from capopt.cost import estimate
    from capopt.cost._inputs import knobs_from_config
    from capopt.cost.stages import even_layout, layout_step, per_step_rest
    sc = _pp_scenario()
    n = numbers_pytree(sc)

    # one compiled program per pipeline depth, as the layout search runs them (op by op the
    # 40 configs took a minute of dispatch)
    @partial(jax.jit, static_argnums=2)
    def even_split(k, n, p):
        rest, inp = per_step_rest(k, n, p)
        layers, rec = even_layout(k, n, p)
        step, mem, _ = layout_step(k, n, layers, rec, rest, inp)
        return step, mem.max()

    for cfg in _pp_configs(sc):
        e = estimate(cfg, sc)
        step, mem = even_split(knobs_from_config(cfg), n, cfg.pp)
        np.testing.assert_allclose(float(mem), float(e.memory["total_bytes"]), rtol=1e-5)
        np.testing.assert_allclose(float(step), float(e.time["step_s"]), rtol=1e-4)


def test_the_layout_search_reads_the_per_step_rest_from_its_compiled_evaluators():
    from capopt.cost._inputs import knobs_from_config
    from capopt.cost.stages import per_step_rest
    from capopt.search.stages import LayoutProblem
    sc = _pp_scenario()
    n = numbers_pytree(sc)
    for cfg in _pp_configs(sc, limit=8):
        lp = LayoutProblem(sc, cfg, n, True, True)
        rest, inp = per_step_rest(knobs_from_config(cfg), n, cfg.pp)
        # the same float32 terms through a vmapped and a plain program, summed in another order
        np.testing.assert_allclose(float(lp.rest), float(rest), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(lp.inp), float(inp), rtol=1e-6)


def test_layer_rounding_sums_to_the_layer_count():
    from capopt.search.stages import round_layers, round_recompute
    rng = np.random.default_rng(0)
    for _ in range(500):
        p = int(rng.integers(2, 9))
        L = int(rng.integers(p, 97))
        real = rng.dirichlet(np.ones(p) * rng.uniform(0.2, 5)) * (L - p) + 1.0
        li = round_layers(real, L)
        assert li.sum() == L and li.min() >= 1
        ri = round_recompute(rng.uniform(0, 1, p), li)
        assert (ri >= 0).all() and (ri <= li).all()


def test_stage_layout_solve_is_valid_and_no_worse_than_even():
    sc = _pp_scenario(layers=8, vram=1.0)
    res = optimize(sc, top_k=3, remedies=False)
    assert res.layouts
    L = sc.model.num_hidden_layers
    for lay in res.layouts:
        assert sum(lay.layers) == L and min(lay.layers) >= 1
        assert all(0 <= r <= li for r, li in zip(lay.recompute, lay.layers))
        assert len(lay.layers) == lay.config.pp
        if lay.even_fits:
            assert lay.fits and lay.tokens_per_s >= lay.even_tokens_per_s * (1 - 1e-6)
        if lay.fits:
            assert max(lay.stage_bytes) <= sc.budget.usable_bytes
    d = res.to_dict()
    assert d["stage_layout"]["pipeline_layers"] == res.layout.layers
    assert "pipeline stages" in render(res)
    # every candidate renders, a LayoutPlan (a Plan with its stage layout) among them
    assert all("config:" in render(c) for c in res.candidates)


def test_stage_layout_gradients_are_finite():
    from capopt.cost._inputs import knobs_from_config
    from capopt.search.stages import LayoutProblem, _loss as layout_loss
    sc = _pp_scenario()
    n = numbers_pytree(sc)
    cfg = next(c for c in _pp_configs(sc) if c.remat != "full")
    lp = LayoutProblem(sc, cfg, n, True, True)
    k = knobs_from_config(cfg)
    zs = jax.random.normal(jax.random.PRNGKey(2), (32, 2 * cfg.pp)) * 3.0
    flags = jnp.asarray([1.0, 1.0])
    for mu in (1.0, 1e4):
        L = jnp.asarray(float(sc.model.num_hidden_layers))
        g = jax.vmap(jax.grad(lambda z: layout_loss(z, k, n, lp.rest, lp.inp, L, flags, mu,
                                                    cfg.pp)))(zs)
        assert bool(jnp.all(jnp.isfinite(g)))


def test_stage_knobs_load_from_the_scenario_file_with_clear_errors():
    import capopt
    from capopt._errors import CapoptError
    base = {"model": {"card": "tiny-llama"}, "hardware": {"gpu": "h100-sxm-80gb", "count": 2},
            "training": {"global_batch": 4, "seq_len": 128}}
    sc = capopt.load_scenario({**base, "config": {"pipeline_layers": "auto",
                                                  "stage_recompute": "auto"}})
    assert (sc.pipeline_layers, sc.stage_recompute) == ("auto", "auto")
    assert capopt.load_scenario(base).pipeline_layers == "even"
    with pytest.raises(CapoptError, match="pipeline_layers"):
        capopt.load_scenario({**base, "config": {"pipeline_layers": "uneven"}})
    with pytest.raises(CapoptError, match="stage_recompute"):
        capopt.load_scenario({**base, "config": {"stage_recompute": 3}})
    with pytest.raises(CapoptError, match="unknown"):
        capopt.load_scenario({**base, "config": {"pipeline_layer": "auto"}})


def test_uneven_stage_scenario_file_finds_a_fitting_layout():
    import capopt
    sc = capopt.load_scenario("llama3-70b-64xh100-uneven-stages")
    res = optimize(sc, top_k=1, remedies=False)
    assert res.layout is not None and res.layout.fits
    assert sum(res.layout.layers) == sc.model.num_hidden_layers
    assert max(res.layout.stage_bytes) <= sc.budget.usable_bytes
    # No even split fits this budget, the uneven one does: it is the answer.
    d = res.to_dict()
    assert d["status"] == "ok" and d["best"]["fits"]
    assert d["best"]["stage_layout"]["pipeline_layers"] == res.layout.layers
    np.testing.assert_allclose(d["best"]["memory"]["total_bytes"], max(res.layout.stage_bytes),
                               rtol=1e-6)
    np.testing.assert_allclose(d["best"]["throughput"]["tokens_per_s"], res.layout.tokens_per_s,
                               rtol=1e-5)


def test_layout_estimate_of_the_even_split_is_the_main_estimate():
    from capopt.cost import estimate
    from capopt.cost._inputs import knobs_from_config
    from capopt.cost.stages import even_layout, layout_estimate
    sc = _pp_scenario()
    n = numbers_pytree(sc)
    for cfg in _pp_configs(sc, limit=10):
        k = knobs_from_config(cfg)
        a = estimate(cfg, sc)
        b = layout_estimate(k, n, *even_layout(k, n, cfg.pp))
        for part in ("memory", "time", "throughput"):
            for key, v in getattr(a, part).items():
                np.testing.assert_allclose(float(getattr(b, part)[key]), float(v), rtol=1e-4,
                                           atol=1e-6, err_msg=f"{part}.{key}")


def test_a_gpu_list_carries_each_variants_stage_layout_into_the_result():
    import capopt
    sc = capopt.load_scenario({
        "model": {"card": "llama-2-7b"},
        "hardware": {"gpu": ["a100-sxm-40gb", "l40s-pcie-48gb"], "count": 16},
        "training": {"global_batch": 64, "seq_len": 4096, "runtime": "pytorch"},
        "config": {"pipeline_layers": "auto", "stage_recompute": "auto", "pp": [2, 4]}})
    res = optimize(sc, top_k=3, remedies=False)
    assert len(res.per_variant) == 2
    for v in res.per_variant:
        lay = v["stage_layout"]
        assert lay is not None and sum(lay["pipeline_layers"]) == sc.model.num_hidden_layers
    # the result's layout is the winning variant's, with the pipeline depth of its configs
    assert res.layout is not None
    winner = next(v for v in res.per_variant if v["gpu"] == res.best.scenario.hardware.name)
    assert res.layout.to_dict() == winner["stage_layout"]
    assert "pipeline stages" in render(res)
    assert res.to_dict()["stage_layout"]["pipeline_layers"] == res.layout.layers


def test_a_users_optax_transformation_drives_both_solves():
    """One penalty solver serves the config solve and the stage-layout solve, and the
    optimizer a user passes reaches both (each traces its update once)."""
    import optax
    base = optax.adam(0.1)
    traced = []

    def update(g, s, x=None):
        traced.append(g.shape[-1])       # the number of variables of the solve tracing it
        return base.update(g, s, x)
    opt = optax.GradientTransformation(base.init, update)
    sc = _pp_scenario(layers=8, vram=1.0)
    res = optimize(sc, top_k=1, remedies=False, optimizer=opt, steps=40)
    assert res.layouts
    pps = {lay.config.pp for lay in res.layouts}
    assert DIM in traced                                  # the config solve
    assert {2 * p for p in pps} <= set(traced)            # a layout solve per depth


def test_the_runtime_split_is_torchtitans():
    from capopt.cost.stages import runtime_split
    # Llama 3.1 405B's 126 blocks on 8 ranks: 15, then 16 while the remainder lasts, the rest
    assert runtime_split(126, 8).tolist() == [15, 16, 16, 16, 16, 16, 16, 15]
    # two stages a rank (interleaved): 16 stages, 7 first and last, 8 between; rank r holds
    # stages r and r + 8
    assert runtime_split(126, 8, 2).tolist() == [7 + 8] + [8 + 8] * 6 + [8 + 7]
    rng = np.random.default_rng(3)
    for _ in range(300):
        pp, chunks = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        L = int(rng.integers(pp * chunks, 130))
        split = runtime_split(L, pp, chunks)
        assert split.sum() == L and len(split) == pp and split.min() >= chunks
        if L % (pp * chunks) == 0:
            assert (split == L // pp).all()
    with pytest.raises(ValueError, match="stages"):
        runtime_split(6, 4, 2)


def test_a_runtime_with_uneven_stages_prices_its_own_split():
    """pp not dividing the blocks, under a runtime that splits them unevenly: `estimate` is
    the layout estimate of the runtime's split, its fuller stage pacing the pipeline."""
    from capopt.cost import estimate
    from capopt.cost._inputs import knobs_from_config
    from capopt.cost.stages import layout_estimate, runtime_split
    m = llama_like(layers=6, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=8, global_batch=32, seq_len=1024)
    n = numbers_pytree(sc)
    cfg = Config(micro_batch=1, grad_accum=16, dp=2, pp=4, zero_stage=1)
    assert not config_problems(cfg, sc)
    k = knobs_from_config(cfg)
    layers = jnp.asarray(runtime_split(6, 4), jnp.float32)
    assert layers.tolist() == [1, 2, 2, 1]
    a = estimate(cfg, sc)
    b = layout_estimate(k, n, layers, layers * k.remat[2])
    for part in ("memory", "time", "throughput"):
        for key, v in getattr(a, part).items():
            np.testing.assert_allclose(float(getattr(b, part)[key]), float(v), rtol=1e-5,
                                       err_msg=f"{part}.{key}")
    # a stage of two blocks is slower than the relaxed even share of 1.5: the split costs time
    relaxed = estimate(cfg, sc.replace(runtime=sc.runtime.with_coeffs(uneven_stages=0.0)))
    assert float(a.time["step_s"]) > float(relaxed.time["step_s"])


def test_the_search_bounds_an_uneven_split_and_reports_it_exactly():
    """The batch evaluator prices pp not dividing the blocks, under a runtime that splits them
    unevenly, with the fullest rank's blocks on every stage: never less memory nor a shorter
    step than the split priced stage by stage. A reported plan carries the split's figures."""
    from capopt.cost import estimate
    from capopt.cost.estimate import splits_unevenly
    from capopt.search._evaluate import evaluate
    m = llama_like(layers=7, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=8, global_batch=32, seq_len=1024,
                       vram_gib=4.0)
    n = numbers_pytree(sc)
    lat = build_lattice(sc)
    rows = [i for i in range(len(lat)) if lat.cols["pp"][i] in (2, 4)]
    assert rows, "the lattice holds pipeline depths that do not divide 7 blocks"
    pick = np.random.default_rng(1).choice(rows, size=min(24, len(rows)), replace=False)
    res = evaluate(lat, n, 0.0, np.asarray(pick))
    for j, i in enumerate(pick):
        cfg = lat.config(int(i))
        assert splits_unevenly(cfg, n)
        exact = estimate(cfg, sc)
        # (float32 sums of the same terms in two programs: a few roundings apart)
        assert res["total_bytes"][j] >= float(exact.memory["total_bytes"]) * (1 - 1e-5)
        assert res["step_s"][j] >= float(exact.time["step_s"]) * (1 - 1e-5)
    piped = sc.replace(knobs=sc.knobs + (KnobDomain("pp", (2, 4)),))
    out = optimize(piped, top_k=5, remedies=False)
    assert out.candidates and all(splits_unevenly(p.config, n) for p in out.candidates)
    for p in out.candidates:
        e = estimate(p.config, piped)
        np.testing.assert_allclose(float(p.memory["total_bytes"]),
                                   float(e.memory["total_bytes"]), rtol=1e-5)
        np.testing.assert_allclose(float(p.throughput["tokens_per_s"]),
                                   float(e.throughput["tokens_per_s"]), rtol=1e-5)
