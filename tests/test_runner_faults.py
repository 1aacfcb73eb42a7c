"""The validation runner's results file and worker processes under faults: torn lines,
lines that are not records, files that are not text, a folder given as the file, records that
claim to be finished without a measurement, and a killed validating process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from capopt.report import render
from capopt._errors import CapoptError
from capopt._specs import Config
from capopt.validation import runner
from capopt.validation.runner import _append, finished, load_results, validate
from test_validation import TINY_MLP, tiny

GOOD = {"argument_bytes": 1, "output_bytes": 1, "alias_bytes": 1, "temp_bytes": 1,
        "peak_bytes": 2, "params_bytes": 1, "optimizer_bytes": 0, "input_bytes": 0}


def _fake_worker(calls):
    def run(job, timeout_s):
        calls.append(job["config"])
        return {"status": "ok", "measured": dict(GOOD), "details": {"output_leaves": 1}}
    return run


def test_an_append_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"key": "a", "status": "ok"}\n{"key": "b", "sta')      # a crash mid-write
    _append(p, {"key": "c", "status": "error", "error": "x"})
    recs = load_results(p)
    assert [r["key"] for r in recs] == ["a", "c"]               # the torn line only is lost


def test_lines_that_are_not_records_are_skipped(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('[1, 2]\n"text"\n3\nnull\n{"key": "k", "status": "ok"}\n')
    assert [r["key"] for r in load_results(p)] == ["k"]


def test_a_binary_file_or_a_folder_is_an_error_naming_it(tmp_path):
    b = tmp_path / "bin.jsonl"
    b.write_bytes(b"\xff\xfe\x00\x80junk")
    with pytest.raises(CapoptError, match="bin.jsonl"):
        load_results(b)
    sc = tiny(TINY_MLP, seq_len=16)
    with pytest.raises(CapoptError, match="directory"):
        validate(sc, configs=[Config(micro_batch=8)], out=tmp_path, progress=False)


def test_a_record_without_its_measurement_is_not_finished(tmp_path, monkeypatch):
    assert not finished({"key": "k", "status": "ok"})
    assert not finished({"key": "k", "status": "ok", "measured": {"peak_bytes": 1}})
    assert finished({"key": "k", "status": "ok", "measured": dict(GOOD)})
    assert finished({"key": "k", "status": "oom", "error": "RESOURCE_EXHAUSTED"})
    sc = tiny(TINY_MLP, seq_len=16)
    cfg = Config(micro_batch=8)
    from capopt.validation.runner import result_key, tier_scenario
    key = result_key("exact", tier_scenario(sc, "exact"), cfg)
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps({"key": key, "status": "ok"}) + "\n")
    calls: list = []
    monkeypatch.setattr(runner, "_run_one", _fake_worker(calls))
    rep = validate(sc, configs=[cfg], out=out, progress=False)
    assert calls == [cfg]                          # measured again, not taken as done
    assert rep.results[0]["status"] == "ok" and render(rep)


def test_stale_work_folders_of_dead_processes_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.gettempdir()) / f"{runner.TMP_PREFIX}{dead.pid}-test"
    stale.mkdir(exist_ok=True)
    mine = Path(tempfile.mkdtemp(prefix=f"{runner.TMP_PREFIX}{os.getpid()}-"))
    try:
        runner._remove_stale_work_dirs()
        assert not stale.exists() and mine.exists()
    finally:
        mine.rmdir()


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_validation_takes_its_worker_with_it(tmp_path):
    """SIGKILL the validating process while its worker hangs: the worker dies too."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        os.environ["CAPOPT_VALIDATION_FAULT"] = "hang:0"
        from capopt._specs import Config
        from capopt.validation import validate
        from test_validation import TINY_MLP, tiny
        validate(tiny(TINY_MLP, seq_len=16), configs=[Config(micro_batch=8)],
                 progress=False, timeout_s=600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script])
    worker = None
    for _ in range(600):
        time.sleep(0.1)
        kids = _children(parent.pid)
        if kids:
            worker = kids[0]
            break
    assert worker is not None, "the worker never started"
    time.sleep(1.0)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the worker outlived the validating process")
