"""The command line: plan/optimize/explain output, and every bad-input class -> exit 2 with one
line naming the file and field, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from capopt._plan import plan
from capopt._specs import Budget
from capopt._scenario import load_scenario, pinned_config
from capopt.cli import main
from capopt.search.remedies import explain

ROOT = Path(__file__).resolve().parent.parent
GOOD = """
name = "t"
[model]
card = "tiny-gpt"
[hardware]
gpu = "h100-sxm-80gb"
count = 2
[training]
seq_len = 128
global_batch = 8
[config]
micro_batch = 2
dp = 2
tp = 1
pp = 1
"""


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def write(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_plan_json_follows_the_output_contract(tmp_path, capsys):
    code, out, _ = run(["plan", write(tmp_path, GOOD), "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    assert set(d) >= {"fits", "config", "memory", "time", "throughput"}
    assert set(d["memory"]) >= {"params_bytes", "grads_bytes", "optimizer_bytes",
                                "activations_bytes", "overhead_bytes", "total_bytes",
                                "budget_bytes"}
    assert "step_s" in d["time"] and "tokens_per_s" in d["throughput"]
    assert d["config"]["micro_batch"] == 2 and d["config"]["grad_accum"] == 2


def test_plan_table_shows_memory_time_and_throughput(tmp_path, capsys):
    code, out, _ = run(["plan", write(tmp_path, GOOD), "--set", "remat=full"], capsys)
    assert code == 0
    for word in ("parameters", "activations", "FITS", "step", "tok/s", "MFU", "remat=full"):
        assert word in out


@pytest.mark.parametrize("name, knobs", [
    ("llama3-70b-64xh100", dict(micro_batch=1, dp=4, tp=8, pp=2, zero_stage=1,
                                remat="selective", sequence_parallel=True)),
    ("llama2-13b-zero3-8xa100", {})])
def test_step_table_rows_add_up_to_the_step(name, knobs):
    from capopt.cli import TIME_LABELS, _time_rows
    tm = plan(name, **knobs).time
    top = sum(tm[key] for key, _, indent in TIME_LABELS if indent == 0)
    assert top == pytest.approx(tm["step_s"], rel=1e-5)      # float32 sum of a few terms
    for key, _, indent in TIME_LABELS:                      # the parts fit inside their term
        if indent == 1 and key.startswith("comm_"):
            assert tm[key] <= tm["comm_exposed_s"] * (1 + 1e-5)
    shares = [float(r[2].rstrip("%")) for r in _time_rows(tm) if r[2] and r[0] != "step"]
    assert sum(shares) == pytest.approx(100.0, abs=0.1 * len(shares))   # rounded to 0.1

def test_optimize_json_contract(capsys):
    code, out, _ = run(["optimize", "gpt2-124m-rtx4090", "--json", "--top", "3"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["status"] == "ok" and len(d["candidates"]) == 3
    assert d["best"] == d["candidates"][0]
    assert all(c["fits"] for c in d["candidates"])
    assert "solve_s" in d and "shadow_price" in d


BAD = [  # (description, text or None, argv extra, words the one line must contain)
    ("malformed TOML", "name = [", [], ["s.toml", "malformed TOML"]),
    ("unknown top-level key", GOOD + "\n[bogus]\nx = 1\n", [], ["s.toml", "bogus", "allowed"]),
    ("unknown GPU", GOOD.replace("h100-sxm-80gb", "h100-xxl"), [],
     ["s.toml", "hardware.gpu", "h100-xxl", "a100-sxm-80gb"]),
    ("unknown card", GOOD.replace("tiny-gpt", "gpt-9"), [], ["s.toml", "gpt-9", "llama-2-7b"]),
    ("negative batch", GOOD.replace("global_batch = 8", "global_batch = -8"), [],
     ["s.toml", "training.global_batch", "positive"]),
    ("unknown precision", GOOD.replace("seq_len = 128", 'seq_len = 128\nprecision = "fp7"'),
     [], ["s.toml", "training.precision", "bf16-mixed"]),
    ("bad knob value", GOOD.replace("tp = 1", "tp = 0"), [], ["s.toml", "config.tp"]),
    ("unknown knob", GOOD + "", ["--set", "warp=3"], ["--set", "warp", "micro_batch"]),
    ("impossible layout", GOOD.replace("dp = 2", "dp = 4"), [], ["s.toml", "config."]),
    ("budget nothing fits", GOOD.replace("[config]", "[budget]\nvram_gib = 0.01\n[config]"),
     [], ["s.toml", "budget", "nothing fits"]),
    ("missing file", None, [], ["nope.toml", "allowed"]),
]


@pytest.mark.parametrize("desc,text,extra,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_exits_2_with_one_clear_line(tmp_path, capsys, desc, text, extra, words):
    path = write(tmp_path, text) if text is not None else str(tmp_path / "nope.toml")
    cmd = "optimize" if desc == "budget nothing fits" else "plan"
    code, out, err = run([cmd, path, *extra], capsys)
    assert code == 2, (desc, out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_real_process_bad_input_has_no_traceback(tmp_path):
    path = write(tmp_path, "name = [")
    p = subprocess.run([sys.executable, "-m", "capopt.cli", "plan", path], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_explain_remedies_really_fit_according_to_plan(tmp_path):
    sc = load_scenario(write(tmp_path, GOOD.replace("seq_len = 128", "seq_len = 1024")
                             .replace("tiny-gpt", "gpt2-124m")))
    cfg = pinned_config(sc, remat="none", zero_stage=0)
    need = plan(sc, cfg).memory["total_bytes"]
    # A budget 3% short of what the config needs: several single changes save more than that.
    sc = sc.replace(budget=Budget(vram_bytes=int(need * 0.97), headroom=0.0))
    rep = explain(sc, cfg)
    assert not rep["fits"]
    fitting = [r for r in rep["remedies"] if r["fits"]]
    assert fitting or rep["combination_fits"]
    for r in fitting:
        p = plan(r["_scenario"], r["_config"])
        assert p.fits
        assert r["saves_bytes"] == pytest.approx(
            rep["total_bytes"] - p.memory["total_bytes"], rel=1e-9)


def test_catalogs_list(capsys):
    for what in ("gpus", "models", "scenarios", "profiles"):
        code, out, _ = run(["catalog", what], capsys)
        assert code == 0 and out.strip()
