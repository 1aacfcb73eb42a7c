"""The random-config generator, and the results file the README's memory figures come from."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from capopt._specs import OPTIMIZERS, PRECISIONS
from capopt._validity import config_problems
from capopt.validation.random_configs import STYLES, draw_cases, shape_split

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _recorded(path: Path) -> dict:
    """The measurements a benchmark recorded, by key (the ok ones)."""
    from capopt.validation.runner import load_results
    return {r["key"]: r for r in load_results(path) if r.get("status") == "ok"}


def _sampled(points, cases, recs: dict, key, size: int):
    """A fixed sample of a results file's points, each with its case and its recorded
    measurement: (point, case, record)."""
    by_name = {c.name: c for c in cases}
    rng = np.random.default_rng(0)
    for q in rng.choice(points, size=min(size, len(points)), replace=False):
        case = by_name[q["case"]]
        yield q, case, recs[key(case)]


def test_draws_are_reproducible_valid_and_cover_every_feature():
    a, b = draw_cases(200, 0), draw_cases(200, 0)
    assert [c.name for c in a] == [c.name for c in b]
    assert [c.config for c in a] == [c.config for c in b]
    assert all(not config_problems(c.config, c.scenario) for c in a)
    assert all(c.config.pp == 1 and not c.config.offload_optimizer for c in a)
    f = lambda key: Counter(c.features[key] for c in a)  # noqa: E731
    assert set(f("optimizer")) == set(OPTIMIZERS)
    assert set(f("precision")) == set(PRECISIONS)
    assert set(f("style")) == set(STYLES)
    assert set(f("family")) == {"decoder", "encoder", "vit", "mlp"}
    assert {"accum 1", "accum 2", "accum 4"} <= set(f("grad_accum"))
    assert {"none", "selective", "full", "fraction"} <= set(f("remat"))
    assert {"MHA", "GQA", "MQA"} <= set(f("attention"))
    assert {"tied", "untied"} <= set(f("tied"))
    assert {"clip", "no clip"} <= set(f("clipping"))
    layouts = set(f("layout"))
    assert {"1 device", "tp", "dp ZeRO-1", "dp ZeRO-2", "dp ZeRO-3"} <= layouts
    assert any(c.config.sequence_parallel for c in a)
    assert any(c.scenario.model.head_dim and c.scenario.model.head_dim
               * c.scenario.model.num_attention_heads != c.scenario.model.hidden_size
               for c in a)
    seqs = [c.scenario.seq_len for c in a]
    assert min(seqs) <= 64 and max(seqs) >= 4096
    assert {c.config.micro_batch for c in a} >= {1, 16}
    assert max(c.config.dp * c.config.tp for c in a) == 8


def test_tensor_parallel_torch_draws_are_valid_and_split_the_vocabulary_on_half_the_cards():
    """``draw_torch_cases(tp=...)``: every case tensor-parallel alone (dp 1), valid for its
    card, both degrees drawn; some cards keep a prime vocabulary (the tables replicated),
    others are padded to a multiple of 128 (split over tp); the plain draw is untouched by
    the option (every case of seed 2 finds its stored measurement by its key)."""
    from capopt.validation.random_configs import draw_torch_cases
    cases = draw_torch_cases(60, 0, tp=(2, 4))
    assert len(cases) == 60
    assert all(c.config.dp == 1 and c.config.tp in (2, 4) for c in cases)
    assert all(not config_problems(c.config, c.scenario) for c in cases)
    assert {c.config.tp for c in cases} == {2, 4}
    split = [c.scenario.model.vocab_size % c.config.tp == 0 for c in cases]
    assert 10 <= sum(split) <= 50
    assert any(c.scenario.model.vocab_size % 128 == 0 for c in cases)
    stored = RESULTS / "torch_random_seed2.jsonl"
    if stored.exists():
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import torch_random as bench
        keys = {json.loads(line)["key"] for line in stored.read_text().splitlines()}
        assert all(bench.measurement_key(c) in keys for c in draw_torch_cases(120, 2))


def test_split_is_by_card_shape_and_held_out_shapes_are_unseen():
    cases = draw_cases(200, 0)
    by_shape = {}
    for c in cases:
        by_shape.setdefault(c.shape, set()).add(c.split)
        assert c.split == shape_split(c.shape)
    assert all(len(s) == 1 for s in by_shape.values())        # one split per shape
    held = [c for c in cases if c.split == "heldout"]
    fit = [c for c in cases if c.split == "fit"]
    assert len(held) >= 80 and len(fit) >= 40
    assert not {c.shape for c in held} & {c.shape for c in fit}


def test_memory_random_results_come_from_the_current_model():
    """benchmarks/results/memory_random.json holds, for every measured case, the peak the
    current cost model predicts: recomputed here from the recorded measurements."""
    path = RESULTS / "memory_random.json"
    if not path.exists():
        pytest.skip("no memory_random.json (run benchmarks/memory_random.py)")
    doc = json.loads(path.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_random as bench
    cases = draw_cases(doc["cases"], doc["seed"]) + bench.full_size_cases()
    recs = _recorded(RESULTS / "memory_random.jsonl")
    points = doc["points"]
    assert len(points) >= 80
    for q, case, rec in _sampled(points, cases, recs, bench.measurement_key, 25):
        p = bench.predicted_peak(case, rec)
        # float32 cost model, the same program: equal to float32 rounding
        assert p["peak_bytes"] == pytest.approx(q["predicted_peak_bytes"], rel=1e-6), q["case"]
        assert rec["measured"]["peak_bytes"] == q["measured_peak_bytes"]


def test_a_twin_differs_from_its_config_by_its_vocabulary_alone():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import xla_twins
    pairs = xla_twins.pairs(draw_cases(200, 0), 16, 0)
    assert len(pairs) >= 20
    for c, t in pairs:
        assert c.split == "heldout" and c.config.dp * c.config.tp == 1
        assert t.scenario.model.vocab_size == c.scenario.model.vocab_size + 16
        assert dataclasses.replace(t.scenario.model, vocab_size=c.scenario.model.vocab_size) \
            == c.scenario.model
        assert t.config == c.config and t.scenario.workload == c.scenario.workload
    for c, t in xla_twins.pairs(draw_cases(200, 0), 64, 0, "seq_len"):
        assert c.scenario.model.family != "vit" and t.scenario.model == c.scenario.model
        assert t.scenario.workload == dataclasses.replace(
            c.scenario.workload, seq_len=c.scenario.workload.seq_len + 64)
    heads = xla_twins.pairs(draw_cases(200, 0), 1, 0, "heads")
    assert len(heads) >= 15
    for c, t in heads:
        m, n = c.scenario.model, t.scenario.model
        assert not c.config.flash_attention and m.family != "mlp"
        assert n.head_size == m.head_size and t.config == c.config
        if m.kv_heads < m.num_attention_heads:      # grouped: one more query head a group
            assert (n.num_attention_heads, n.kv_heads) == (m.num_attention_heads + m.kv_heads,
                                                           m.kv_heads)
        else:                                        # one-to-one: one more of both
            assert n.num_attention_heads == n.kv_heads == m.num_attention_heads + 1
        assert dataclasses.replace(n, num_attention_heads=m.num_attention_heads,
                                   num_key_value_heads=m.num_key_value_heads,
                                   head_dim=m.head_dim) == m
    assert xla_twins.main(["--delta", "0", "--no-measure"]) == 2


@pytest.mark.parametrize("name", ["xla_twins", "xla_twins_seq_len", "xla_twins_heads"])
def test_xla_twins_results_come_from_the_current_model(name):
    """benchmarks/results/xla_twins*.json hold the current model's predictions of each pair,
    recomputed here from the recorded compiles, and the excess they report is theirs."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        pytest.skip(f"no {name}.json (run benchmarks/xla_twins.py)")
    doc = json.loads(path.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_random as bench
    import xla_twins
    pairs = {c.name: (c, t) for c, t in xla_twins.pairs(draw_cases(200, 0), doc["delta"], 0,
                                                         doc.get("field", "vocab_size"))}
    recs = {**_recorded(RESULTS / "memory_random.jsonl"), **_recorded(RESULTS / "xla_twins.jsonl")}
    # (every pair compiled; at least 15 of them)
    assert doc["measured"] == doc["pairs"] >= 15
    for row in doc["rows"][:8]:
        c, t = pairs[row["case"]]
        pb = bench.predicted_peak(c, recs[bench.measurement_key(c)])["peak_bytes"]
        pt = bench.predicted_peak(t, recs[bench.measurement_key(t)])["peak_bytes"]
        assert pb == pytest.approx(row["predicted_base_bytes"], rel=1e-6), row["case"]
        assert pt == pytest.approx(row["predicted_twin_bytes"], rel=1e-6), row["case"]
        assert row["excess"] == pytest.approx(
            (row["measured_twin_bytes"] / row["measured_base_bytes"]) / (pt / pb) - 1, abs=1e-6)


@pytest.mark.parametrize("name", ["maxtext_random", "maxtext_random_seed1"])
def test_maxtext_random_results_come_from_the_current_model(name):
    """benchmarks/results/maxtext_random*.json hold, for every MaxText step measured, the peak
    the current maxtext profile predicts: recomputed here from the recorded measurements."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        pytest.skip(f"no {name}.json (run benchmarks/maxtext_random.py)")
    doc = json.loads(path.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import maxtext_random as bench
    from capopt.validation.predict import predicted_terms
    cases = bench.draw(doc["cases"], doc["seed"]) + bench.full_size_cases()
    recs = _recorded(RESULTS / f"{name}.jsonl")
    points = doc["points"]
    assert len(points) >= 40
    for q, case, rec in _sampled(points, cases, recs, bench.key_of, 20):
        m = rec["measured"]
        p = predicted_terms(case.config, case.scenario, input_bytes=m["input_bytes"])
        # float32 cost model, the same program: equal to float32 rounding
        assert p["peak_bytes"] == pytest.approx(q["predicted_peak_bytes"], rel=1e-6), q["case"]
        assert m["peak_bytes"] == q["measured"]["peak_bytes"]


@pytest.mark.parametrize("name, draw", [
    ("torch_random_seed12", dict(n=120, seed=12)),
    ("torch_random_seed2", dict(n=120, seed=2)),
    ("torch_random_seed3", dict(n=120, seed=3)),
    ("torch_lora_seed1", dict(n=60, seed=1, lora=True)),
    ("torch_tp", dict(n=60, seed=0, tp=(2, 4))),
    ("torch_tp_seed1", dict(n=60, seed=1, tp=(2, 4))),
    ("torch_tp2d_seed1", dict(n=60, seed=1, tp=(2, 4), tp_dp=2)),
    ("torch_tp_sp_seed1", dict(n=60, seed=1, tp=(2, 4), tp_sp=True)),
    ("torch_random_fused-linear_seed1", dict(n=120, seed=1, loss="fused-linear")),
    ("torch_random_offload_seed2", dict(n=120, seed=2, activation_offload=True)),
    ("torch_random_chunked_seed2", dict(n=120, seed=2, loss="chunked")),
    # (hf: no selective recomputation, 93 of 120 and 44 of 60)
    ("torch_random_hf", dict(n=120, seed=0, runtime="hf")),
    ("torch_random_seed1_hf", dict(n=60, seed=1, runtime="hf", min_points=40)),
    # (torchtune: its precisions, the chunked loss, no selective recomputation: 44 and 49)
    ("torch_random_chunked_torchtune",
     dict(n=120, seed=0, loss="chunked", runtime="torchtune", min_points=40)),
    ("torch_random_chunked_seed1_torchtune",
     dict(n=120, seed=1, loss="chunked", runtime="torchtune", min_points=40)),
    ("torch_random_torchtune", dict(n=120, seed=0, runtime="torchtune", min_points=40)),
])
def test_torch_results_come_from_the_current_model(name, draw):
    """Each torch-tier results file the README quotes holds, for its measured cases, the
    peak the current profile (pytorch-eager, or the file's runtime) predicts (recomputed from the recorded
    measurements; no torch needed), and the measurement it was compared with."""
    from capopt.validation.predict import predicted_torch_terms
    from capopt.validation.random_configs import draw_torch_cases
    path = RESULTS / f"{name}.json"
    if not path.exists():
        pytest.skip(f"no {path.name} (run benchmarks/torch_random.py)")
    doc = json.loads(path.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch_random as bench
    recs = _recorded(RESULTS / f"{name}.jsonl")
    workload = {k: draw[k] for k in ("loss", "activation_offload") if k in draw}
    cases = draw_torch_cases(draw["n"], **{k: v for k, v in draw.items()
                                            if k not in ("n", "runtime", "min_points")
                                            and k not in workload})
    if workload:                        # (the same draw, --loss / --activation-offload)
        import dataclasses
        cases = [dataclasses.replace(c, scenario=c.scenario.replace(workload=dataclasses.replace(
            c.scenario.workload, **workload))) for c in cases]
    if "runtime" in draw:               # (the same draw, --runtime: its precisions only)
        import dataclasses

        from capopt._runtime import get_profile
        from capopt._specs import runtime_runs_config
        rt = get_profile(draw["runtime"])
        names = set(rt.precision_names)
        cases = [dataclasses.replace(c, scenario=c.scenario.replace(runtime=rt)) for c in cases
                 if c.scenario.workload.precision in names]
        cases = [c for c in cases if runtime_runs_config(rt, c.config)]
    points = doc["points"]
    assert len(points) >= draw.get("min_points", 50)
    for q, case, rec in _sampled(points, cases, recs, bench.measurement_key, 12):
        p = predicted_torch_terms(case.config, case.scenario)
        # float32 cost model, the same program: equal to float32 rounding
        assert p["peak_bytes"] == pytest.approx(q["predicted"]["peak_bytes"], rel=1e-6), q["case"]
        assert rec["measured"]["peak_bytes"] == q["measured"]["peak_bytes"]


def test_measurement_keys_survive_a_field_added_with_its_default():
    """A stored measurement is found again after a card or workload field is added with a
    default (its key names only what differs from the defaults)."""
    import dataclasses

    from capopt._specs import stable_text

    @dataclasses.dataclass(frozen=True)
    class Before:
        a: int
        b: str = "x"

    @dataclasses.dataclass(frozen=True)
    class After:
        a: int
        b: str = "x"
        c: bool = False

    Before.__name__ = After.__name__ = "Spec"
    assert stable_text(Before(1)) == stable_text(After(1)) == "Spec(a=1)"
    assert stable_text(After(1, c=True)) != stable_text(Before(1))
    assert stable_text((Before(2, "y"), {"k": [1, 2]})) == "(Spec(a=2, b='y'), {'k': (1, 2)})"


def test_nf4_draws_need_whole_blocks_in_every_matrix_stored_in_nf4():
    """A 4-bit base stores every block matmul in NF4, wrapped or not: an MLP of odd width
    cannot take one even when the adapters sit on the attention alone (16 bits can)."""
    from capopt._model import ModelSpec
    from capopt._specs import LoRA
    from capopt.validation.random_configs import _lora_ok
    m = ModelSpec(name="odd-mlp", family="decoder", hidden_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, intermediate_size=101,
                  vocab_size=997, position_embedding="rotary", norm_type="rmsnorm",
                  mlp_type="gated", hidden_act="silu")
    assert not _lora_ok(m, LoRA(rank=4, targets=("attn",), base_bits=4))
    assert _lora_ok(m, LoRA(rank=4, targets=("attn",), base_bits=16))
    assert _lora_ok(m.replace(intermediate_size=128), LoRA(rank=4, targets=("attn",),
                                                           base_bits=4))
