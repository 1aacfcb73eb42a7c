"""Validation candidates as tasks on a Ray cluster (a local one with two workers here)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from capopt._model import ModelSpec
from capopt._specs import Config
from capopt.validation import validate
from capopt.validation.runner import load_results

from conftest import make_scenario

HAVE_RAY = importlib.util.find_spec("ray") is not None
MLP = ModelSpec(name="tiny-mlp", family="mlp", hidden_size=64, num_hidden_layers=3)
CONFIGS = [Config(micro_batch=8), Config(micro_batch=4, grad_accum=2)]


@pytest.fixture(scope="module")
def local_ray():
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.skipif(not HAVE_RAY, reason="Ray (the ray extra) is not installed")
def test_an_unreachable_cluster_is_one_line():
    import os
    import subprocess
    import sys
    # (Ray's client retries for 30 s by default; one second per try keeps the test short)
    env = dict(os.environ, RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S="1",
               RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S="1")
    code = ("from capopt.validation.cluster import connect\n"
            "from capopt._errors import CapoptError\n"
            "try:\n    connect('ray://127.0.0.1:9')\n"
            "except CapoptError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("--ray: cannot reach a Ray cluster at 'ray://127.0.0.1:9'")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_RAY, reason="Ray (the ray extra) is not installed")
def test_candidates_run_as_ray_tasks_and_stream_to_the_file(local_ray, tmp_path):
    sc = make_scenario(MLP, seq_len=16, global_batch=8)
    t0 = time.perf_counter()
    here = validate(sc, configs=CONFIGS, progress=False, jobs=1)
    t_here = time.perf_counter() - t0
    out = tmp_path / "r.jsonl"
    t0 = time.perf_counter()
    there = validate(sc, configs=CONFIGS, progress=False, out=out, ray="auto")
    t_ray = time.perf_counter() - t0
    print(f"\n2 candidates: --jobs 1 {t_here:.1f} s, Ray (2 workers) {t_ray:.1f} s")
    assert [r["status"] for r in there.results] == ["ok", "ok"]
    # the same measurement as a local run, candidate by candidate, in the caller's order
    for a, b in zip(here.results, there.results):
        assert a["config"] == b["config"] and a["measured"] == b["measured"]
    assert [r["config"] for r in load_results(out)] != []
    assert len(load_results(out)) == 2
    # a rerun finds both in the file and runs nothing
    again = validate(sc, configs=CONFIGS, progress=False, out=out, ray="auto")
    assert [r["measured"] for r in again.results] == [r["measured"] for r in there.results]
