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


def test_plan_reports_allocated_reserved_and_device_memory_apart(capsys):
    """Published figures are torch.cuda.max_memory_allocated, max_memory_reserved or
    nvidia-smi: the three are reported apart. The budgeted total is the live tensors plus
    the fragmentation the allocator cannot give back, the CUDA context and workspaces; the
    reserved figure is the live tensors plus the fragmentation plus, where the profile
    measures it (cached_slack), the free blocks it keeps cached while memory is not short."""
    from capopt._runtime import get_profile
    code, out, _ = run(["plan", "llama2-13b-zero3-8xa100", "--json"], capsys)
    assert code == 0
    m = json.loads(out)["memory"]
    rt = get_profile("pytorch")                 # the scenario's profile: no cached slack
    assert rt.coeff("cached_slack") == 0.0
    assert m["allocated_bytes"] < m["reserved_bytes"] < m["total_bytes"]
    gap = m["total_bytes"] - m["reserved_bytes"]
    assert abs(gap - rt.coeff("context_bytes") - rt.coeff("workspace_bytes")) < 1.0
    # under pytorch-eager the reserved figure carries the cached slack on top, the total not
    code, out, _ = run(["plan", "llama2-13b-zero3-8xa100", "--json", "--runtime",
                        "pytorch-eager"], capsys)
    assert code == 0
    e = json.loads(out)["memory"]
    eager = get_profile("pytorch-eager")
    frag = e["total_bytes"] - eager.coeff("context_bytes") - eager.coeff("workspace_bytes") \
        - e["allocated_bytes"]
    slack = e["reserved_bytes"] - e["allocated_bytes"]
    assert frag > 0
    # (reserved - allocated over the budgeted fragmentation: (0.05 + 0.20) / 0.05 = 5;
    # float32 GiB-scale totals: 1e-4)
    ratio = (eager.coeff("fragmentation") + eager.coeff("cached_slack")) \
        / eager.coeff("fragmentation")
    assert slack / frag == pytest.approx(ratio, rel=1e-4)
    code, out, _ = run(["plan", "llama2-13b-zero3-8xa100"], capsys)
    assert "live tensors" in out and "reserved" in out and "nvidia-smi" in out


@pytest.mark.parametrize("value", ["-0.1", "1", "nan", "half"])
def test_calibrate_refuses_a_holdout_share_outside_0_to_1(value, capsys):
    code, _, err = run(["calibrate", "llama2-13b-zero3-8xa100", "--measurements", "m.jsonl",
                        "--holdout", value], capsys)
    assert code == 2 and "--holdout" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
def test_validate_refuses_a_timeout_that_is_not_a_positive_number(value, capsys):
    code, _, err = run(["validate", "llama2-13b-zero3-8xa100", "--tier", "torch",
                        "--timeout", value], capsys)
    assert code == 2
    assert "--timeout" in err and "Traceback" not in err


def test_validate_refuses_no_latency_hiding_outside_the_xla_gpu_tier(capsys):
    code, _, err = run(["validate", "llama2-13b-zero3-8xa100", "--tier", "torch",
                        "--no-latency-hiding"], capsys)
    assert code == 2
    assert "--no-latency-hiding" in err and "xla-gpu" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_plan_table_shows_memory_time_and_throughput(tmp_path, capsys):
    code, out, _ = run(["plan", write(tmp_path, GOOD), "--set", "remat=full"], capsys)
    assert code == 0
    for word in ("parameters", "activations", "FITS", "step", "tok/s", "MFU", "remat=full",
                 "assumed rates", "TFLOP/s"):
        assert word in out


@pytest.mark.parametrize("name, knobs", [
    ("llama3-70b-64xh100", dict(micro_batch=1, dp=4, tp=8, pp=2, zero_stage=1,
                                remat="selective", sequence_parallel=True)),
    ("llama2-13b-zero3-8xa100", {})])
def test_step_table_rows_add_up_to_the_step(name, knobs):
    from capopt._terms import TIME_LABELS
    from capopt.report import time_rows
    tm = plan(name, **knobs).time
    top = sum(tm[key] for key, _, indent in TIME_LABELS if indent == 0)
    assert top == pytest.approx(tm["step_s"], rel=1e-5)      # float32 sum of a few terms
    for key, _, indent in TIME_LABELS:                      # the parts fit inside their term
        if indent == 1 and key.startswith("comm_"):
            assert tm[key] <= tm["comm_exposed_s"] * (1 + 1e-5)
    shares = [float(r[2].rstrip("%")) for r in time_rows(tm) if r[2] and r[0] != "step"]
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
    ("neither micro_batch nor grad_accum pinned", GOOD.replace("micro_batch = 2\n", ""), [],
     ["s.toml", "config.micro_batch", "optimize", "--set micro_batch="]),
    ("unknown top-level key", GOOD + "\n[bogus]\nx = 1\n", [], ["s.toml", "bogus", "allowed"]),
    ("unknown GPU", GOOD.replace("h100-sxm-80gb", "h100-xxl"), [],
     ["s.toml", "hardware.gpu", "h100-xxl", "a100-sxm-80gb"]),
    ("unknown card", GOOD.replace("tiny-gpt", "gpt-9"), [], ["s.toml", "gpt-9", "llama-2-7b"]),
    ("negative batch", GOOD.replace("global_batch = 8", "global_batch = -8"), [],
     ["s.toml", "training.global_batch", "positive"]),
    ("unknown precision", GOOD.replace("seq_len = 128", 'seq_len = 128\nprecision = "fp7"'),
     [], ["s.toml", "training.precision", "bf16-mixed"]),
    ("unknown loss", GOOD.replace("seq_len = 128", 'seq_len = 128\nloss = "chunky"'),
     [], ["s.toml", "training.loss", "fused"]),
    ("fused linear loss on the xla step",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nloss = "fused-linear"'),
     [], ["s.toml", "training.loss", "xla-gpu", "PyTorch runtime"]),
    ("fused linear loss on a vocabulary-parallel head",
     GOOD.replace("count = 2", "count = 4").replace("tp = 1", "tp = 2").replace(
         "seq_len = 128", 'seq_len = 128\nloss = "fused-linear"\nruntime = "hf"'),
     [], ["s.toml", "config.tp", "1 (or auto)"]),
    ("activation offloading the runtime does not run",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nactivation_offload = true'),
     [], ["s.toml", "training.activation_offload", "xla-gpu", "hf"]),
    ("activation offloading not a boolean",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nactivation_offload = "yes"'),
     [], ["s.toml", "training.activation_offload"]),
    ("a fused loss on the xla step",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nloss = "fused"'),
     [], ["s.toml", "training.loss", "xla-gpu", "PyTorch runtime"]),
    ("a listed loss the runtime does not run",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nloss = ["float32", "fused-linear"]'),
     [], ["s.toml", "training.loss", "xla-gpu"]),
    ("an empty list of losses", GOOD.replace("seq_len = 128", "seq_len = 128\nloss = []"),
     [], ["s.toml", "training.loss", "auto"]),
    ("an unknown loss in a list",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nloss = ["float32", "chunky"]'),
     [], ["s.toml", "training.loss", "chunky", "fused-linear"]),
    ("a listed switch the scenario refuses",
     GOOD.replace("seq_len = 128", "seq_len = 128\noptimizer_in_backward = [false, true]"),
     [], ["s.toml", "training.optimizer_in_backward"]),
    ("a chunked loss on the xla step",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nloss = "chunked"'),
     [], ["s.toml", "training.loss", "xla-gpu", "PyTorch runtime"]),
    ("a chunked loss on a runtime without one",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nloss = "chunked"\nruntime = "hf"'),
     [], ["s.toml", "training.loss", "pytorch-eager"]),
    ("a chunked loss with offloaded activations",
     GOOD.replace("seq_len = 128", 'seq_len = 128\nloss = "chunked"\n'
                  'runtime = "pytorch-eager"\nactivation_offload = true'),
     [], ["s.toml", "training.activation_offload", "chunked"]),
    ("a paged optimizer the runtime does not run",
     GOOD.replace("seq_len = 128", "seq_len = 128\npaged_optimizer = true"),
     [], ["s.toml", "training.paged_optimizer", "xla-gpu", "hf"]),
    ("a paged optimizer not a boolean",
     GOOD.replace("seq_len = 128", "seq_len = 128\npaged_optimizer = 3"),
     [], ["s.toml", "training.paged_optimizer"]),
    ("a paged optimizer bitsandbytes has not",
     GOOD.replace("seq_len = 128", 'seq_len = 128\npaged_optimizer = true\n'
                  'runtime = "hf"\noptimizer = "sgd"'),
     [], ["s.toml", "training.paged_optimizer", "adamw-8bit"]),
    ("a paged optimizer under ZeRO-3",
     GOOD.replace("seq_len = 128", 'seq_len = 128\npaged_optimizer = true\nruntime = "hf"')
         .replace("pp = 1", "pp = 1\nzero_stage = 3"),
     [], ["s.toml", "config.zero_stage", "0 (or auto)"]),
    ("double quantisation not a boolean",
     GOOD.replace("seq_len = 128", 'seq_len = 128\n'
                  'lora = { rank = 8, base_bits = 4, double_quant = "no" }'),
     [], ["s.toml", "training.lora.double_quant", "true or false"]),
    ("double quantisation turned off on a 16-bit base",
     GOOD.replace("seq_len = 128", "seq_len = 128\nlora = { rank = 8, double_quant = false }"),
     [], ["s.toml", "training.lora.double_quant", "base_bits = 4"]),
    ("bad knob value", GOOD.replace("tp = 1", "tp = 0"), [], ["s.toml", "config.tp"]),
    ("unknown knob", GOOD + "", ["--set", "warp=3"], ["--set", "warp", "micro_batch"]),
    ("no field to choose", GOOD, ["--choose", ","], ["--choose", "activation_offload"]),
    ("a field chosen and given", GOOD, ["--choose", "loss", "--loss", "float32"],
     ["--choose", "--loss"]),
    ("impossible layout", GOOD.replace("dp = 2", "dp = 4"), [], ["s.toml", "config."]),
    ("budget nothing fits", GOOD.replace("[config]", "[budget]\nvram_gib = 0.01\n[config]"),
     [], ["s.toml", "budget", "nothing fits"]),
    ("missing file", None, [], ["nope.toml", "allowed"]),
    ("context parallelism the runtime cannot run", GOOD.replace("pp = 1", "pp = 1\ncp = 2"),
     [], ["s.toml", "config.cp", "xla-gpu", "torchtitan"]),
    ("context parallelism not dividing dp",
     GOOD.replace("pp = 1", "pp = 1\ncp = 3").replace("seq_len = 128",
                                                      'seq_len = 128\nruntime = "torchtitan"'),
     [], ["s.toml", "config.cp", "divide dp 2"]),
    ("interleaving the runtime cannot run",
     GOOD.replace("dp = 2", "dp = 1").replace("pp = 1", "pp = 2\nvpp = 2"),
     [], ["s.toml", "config.vpp", "xla-gpu", "megatron"]),
    ("interleaving without a pipeline",
     GOOD.replace("pp = 1", "pp = 1\nvpp = 2").replace("seq_len = 128",
                                                       'seq_len = 128\nruntime = "megatron"'),
     [], ["s.toml", "config.vpp", "pp > 1"]),
    ("interleaving with micro-batches not a multiple of pp",
     GOOD.replace("dp = 2", "dp = 1").replace("micro_batch = 2", "micro_batch = 8")
     .replace("pp = 1", "pp = 2\nvpp = 2").replace("tiny-gpt", "gpt2-124m")
     .replace("seq_len = 128", 'seq_len = 128\nruntime = "megatron"'),
     [], ["s.toml", "config.vpp", "multiple of pp 2"]),
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
    # the file and the field are named once each ("s.toml: model.card: ...")
    head = lines[0].split(" (allowed:")[0].split(": ")
    assert len(head) == len(set(head)), lines[0]


def test_explain_of_a_scenario_that_pins_no_batch_split_says_so_and_how_to_pin(tmp_path,
                                                                                  capsys):
    """explain (like plan) needs one config: its refusal names the field and the way out, not
    another command's name."""
    path = write(tmp_path, GOOD.replace("micro_batch = 2\n", ""))
    code, out, err = run(["explain", path], capsys)
    assert code == 2 and not out
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "config.micro_batch" in lines[0] and "plan needs" not in lines[0]
    assert "--set micro_batch=" in lines[0]
    code, out, err = run(["explain", path, "--set", "micro_batch=2"], capsys)
    assert code == 0 and "FITS" in out


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


def test_catalog_of_scenarios_gives_each_its_name(capsys):
    from capopt._scenario import list_scenarios, load_scenario
    code, out, _ = run(["catalog", "scenarios"], capsys)
    rows = {ln.split()[0]: ln for ln in out.splitlines()[2:]}
    assert sorted(rows) == list_scenarios()
    for name in ("llama3-8b-8xh100", "qlora-llama2-7b-24gb"):
        assert load_scenario(name).name in rows[name]


def test_optimize_says_when_fewer_than_top_fit(tmp_path, capsys):
    # one device, everything pinned but remat: at most four configs exist
    f = _write(tmp_path, '[model]\ncard = "tiny-llama"\n[hardware]\ngpu = "a100-sxm-80gb"\n'
                         '[training]\nseq_len = 128\nglobal_batch = 4\n[config]\n'
                         'micro_batch = 4\nremat = ["none", "full"]\n')
    code, out, _ = run(["optimize", f, "--top", "5", "--method", "exhaustive"], capsys)
    assert code == 0
    assert "only 2 of the 2 configs evaluated fit (--top 5 asked)" in out
    code, out, _ = run(["optimize", f, "--top", "2", "--method", "exhaustive"], capsys)
    assert code == 0 and "only" not in out


# ---- answers that used to be wrong without a word ------------------------------------------
def _write(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_a_budget_larger_than_the_gpu_is_refused(tmp_path, capsys):
    path = _write(tmp_path, GOOD.replace('gpu = "h100-sxm-80gb"', 'gpu = "rtx-4090-24gb"')
                  + "[budget]\nvram_gib = 80\n")
    code, out, err = run(["plan", path], capsys)
    assert code == 2 and "budget.vram_gib" in err and "24.00 GiB" in err and path in err


def test_explain_offers_changes_to_pinned_knobs_and_says_so():
    sc = load_scenario({"model": {"card": "llama-2-13b"},
                        "hardware": {"gpu": "a100-sxm-80gb", "count": 8},
                        "training": {"seq_len": 4096, "global_batch": 32},
                        "config": {"micro_batch": 4, "dp": 8, "tp": 1, "pp": 1,
                                   "zero_stage": 0, "remat": "none"}})
    rep = explain(sc, pinned_config(sc))
    assert not rep["fits"] and rep["combination_fits"]
    zero3 = [r for r in rep["remedies"] if r["change"].startswith("ZeRO stage 3")]
    assert zero3 and "pinned in the scenario" in zero3[0]["change"]
    # the combination keeps the training the same (layout, recomputation) when that suffices
    assert all(not c.startswith(("QLoRA", "LoRA", "sequence length", "pure bf16", "lighter"))
               for c in rep["combination"])


def test_offload_auto_searches_both_values():
    from capopt.search._space import Space
    base = {"model": {"card": "tiny-gpt"}, "hardware": {"gpu": "h100-sxm-80gb", "count": 1},
            "training": {"seq_len": 128, "global_batch": 8}}
    assert Space(load_scenario({**base, "config": {"offload_optimizer": "auto"}})
                 ).offloads == [False, True]
    assert Space(load_scenario(base)).offloads == [False]        # left out: its default


def test_three_devices_find_tensor_parallel_three(tmp_path, capsys):
    """Three GPUs and a global batch of 32: no data-parallel degree but 1 divides both, and
    tp = 3 fits; the relaxed solve's rounding misses it, the exhaustive check does not."""
    path = _write(tmp_path, '[model]\ncard = "gpt2-124m"\n[hardware]\ngpu = "rtx-4090-24gb"\n'
                            'count = 3\n[training]\nseq_len = 512\nglobal_batch = 32\n')
    code, out, err = run(["optimize", path, "--json", "--top", "1"], capsys)
    d = json.loads(out)
    assert code == 0 and d["status"] == "ok" and d["best"]["config"]["tp"] == 3


def test_no_valid_layout_is_said_to_be_that(tmp_path, capsys):
    path = _write(tmp_path, '[model]\ncard = "gpt2-124m"\n[hardware]\ngpu = "rtx-4090-24gb"\n'
                            'count = 3\n[training]\nseq_len = 512\nglobal_batch = 32\n'
                            '[config]\ntp = 1\npp = 1\n')
    code, out, err = run(["optimize", path], capsys)
    assert code == 2 and "no valid layout" in err and "not divisible by dp 3" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("pins, field, words, allowed", [
    # (gpt2-124m: 12 heads, 12 layers)
    ("tp = 16", "config.tp", "tp 16 leaves no dp x tp x pp = 8", "1, 2, 4"),
    ("tp = 2\npp = 8", "config.pp", "pp 8 leaves no dp x tp x pp = 8 devices that the model "
     "and the scenario allow (beside tp 2)", "1, 2, 4"),
    ("dp = [3, 5]", "config.dp", "dp [3, 5] leaves no", "1, 2, 4, 8"),
])
def test_a_pinned_degree_that_leaves_no_layout_is_named(tmp_path, capsys, pins, field, words,
                                                        allowed):
    """dp, tp or pp pinned to values no layout of the devices takes: exit 2, one line naming
    that field and the degrees the layouts of the same scenario with it free do take (before,
    "no dp x tp x pp = 8 devices suits the model", naming no field)."""
    path = _write(tmp_path, '[model]\ncard = "gpt2-124m"\n[hardware]\ngpu = "rtx-4090-24gb"\n'
                            'count = 8\n[training]\nseq_len = 512\nglobal_batch = 32\n'
                            f'[config]\n{pins}\n')
    code, out, err = run(["optimize", path], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f": {field}: " in lines[0] and words in lines[0], lines[0]
    assert lines[0].endswith(f"(allowed: {allowed})"), lines[0]


def test_output_into_a_closed_pipe_is_quiet():
    cmd = (f"{sys.executable} -m capopt.cli catalog models | head -1")
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert "card" in done.stdout and "Traceback" not in done.stderr and "Broken" not in done.stderr


def test_the_error_path_does_not_import_jax(tmp_path):
    path = _write(tmp_path, "[model]\ncard = 1\n")
    code = ("import sys; from capopt.cli import main; rc = main(['plan', %r]); "
            "print(rc, 'jax' in sys.modules)" % path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr


@pytest.mark.parametrize("setting, words", [
    ("vpp=2", ["config.vpp", "pytorch runtime", "megatron"]),
    ("cp=2", ["config.cp", "pytorch runtime", "torchtitan"]),
])
def test_optimize_names_the_rule_that_refuses_a_pinned_knob_everywhere(setting, words, capsys):
    """A knob pinned to values the runtime refuses beside every layout: exit 2, one line with
    that rule's words (not "no config fits", nor a batch that does not divide)."""
    code, out, err = run(["optimize", "llama3-70b-64xh100", "--set", setting], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "fits" not in out
