"""`capopt calibrate`: a fit from `capopt validate --out` measurements, and its bad input.

The fixture is real: `capopt validate tests/fixtures/validation/tiny-llama-h100.toml --tier
xla-gpu --top 4 --out ...` (tiny-llama compiled for an H100 by the CUDA plugin, no GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capopt._runtime import get_profile
from capopt._scenario import load_scenario
from capopt.cli import main

FIX = Path(__file__).parent / "fixtures" / "validation"
SCENARIO = str(FIX / "tiny-llama-h100.toml")
MEASURED = str(FIX / "tiny-llama-h100-xla-gpu.jsonl")


def test_calibrate_fits_and_writes_a_profile_that_plans(tmp_path, capsys):
    out = tmp_path / "fitted.toml"
    rc = main(["calibrate", SCENARIO, "--measurements", MEASURED, "--coeffs",
               "resid_saved,logits_fp32_copies", "--holdout", "0", "--json",
               "--profile-out", str(out)])
    assert rc == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["n_train"] == 4 and fit["target"] == "peak_bytes"
    # The fit may only lower the training error it minimises (it starts at the priors).
    assert fit["train_error"]["after"] < fit["train_error"]["before"]
    prof = get_profile(str(out))
    assert prof.coeff("resid_saved") == pytest.approx(fit["coeffs"]["resid_saved"], rel=1e-6)
    sc = load_scenario(SCENARIO).replace(runtime=prof)
    from capopt._plan import plan
    assert plan(sc, micro_batch=8).memory["total_bytes"] > 0


@pytest.mark.parametrize("argv, words", [
    (["calibrate", SCENARIO], ["--measurements", "calibration_grid.py"]),
    (["calibrate", SCENARIO, "--measurements", "nowhere.jsonl"], ["nowhere.jsonl", "no such"]),
    (["calibrate", SCENARIO, "--measurements", MEASURED, "--coeffs", "bogus"],
     ["--coeffs", "bogus", "allowed", "resid_saved"]),
    (["calibrate", SCENARIO, "--measurements", MEASURED, "--tier", "device"],
     ["0 usable device", "at least 2"]),
])
def test_bad_calibrate_input_exits_2_with_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
