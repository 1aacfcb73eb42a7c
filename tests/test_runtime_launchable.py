"""A framework's runtime searches only what the launch file capopt writes for it can run.

``hf``: Hugging Face's Trainer (transformers 5.25) and TRL's ``trl sft`` (1.16) take a tensor
or expert degree from a model sharded when it is loaded (``from_pretrained``'s
``distributed_config``), which neither TrainingArguments (``--emit hf-trainer``) nor TRL's
SFTConfig / ModelConfig (``--emit trl-sft``) sets; the Trainer has no pipeline stages; context
parallelism is an Accelerate ``parallelism_config`` object the files leave unset; activation
checkpointing wraps whole decoder layers; ZeRO-1 and optimizer offload are written as a
DeepSpeed section, run by DeepSpeed's engine, which ``--runtime deepspeed`` prices.

``llm-foundry``: Composer v0.17.2 wraps the model in DDP or FSDP only (no tensor, pipeline or
expert degree), its sharding strategies have no ZeRO-1, its FSDP CPU offload raises, and its
activation checkpointing wraps every MPT block or none.

Named, each is refused in one line naming its field; searched, each is narrowed, so the
optimiser's best config under the runtime is one its formats write."""

from __future__ import annotations

import pytest

import capopt
from capopt._specs import Config
from capopt._validity import broken
from capopt.cli import main
from capopt.cost import estimate
from capopt.report.launch import emit
from conftest import llama_like, make_scenario, runtime_scenario_file

# float32 arithmetic on byte counts up to ~1e11 carries ~1e-7 relative error.
F32_RTOL = 1e-6

# runtime -> the formats that write it, the knobs named that it refuses, its new rules
RUNTIMES = {
    "hf": (("hf-trainer", "trl-sft"),
           (("tp", "2"), ("pp", "2"), ("ep", "2"), ("cp", "2"), ("remat", '"selective"'),
            ("zero_stage", "1"), ("offload_optimizer", "true")),
           {"tensor_parallel": 0.0, "expert_parallel": 0.0, "pipeline_parallel": 0.0,
            "uneven_stages": 0.0, "interleaved_pipeline": 0.0, "context_parallel": 0.0,
            "selective_remat": 0.0, "deepspeed_paths_priced": 0.0}),
    "llm-foundry": (("llm-foundry",),
                    (("tp", "2"), ("pp", "2"), ("ep", "2"), ("zero_stage", "1"),
                     ("offload_optimizer", "true"), ("remat", '"selective"'), ("remat", "0.5")),
                    {"tensor_parallel": 0.0, "pipeline_parallel": 0.0, "uneven_stages": 0.0,
                     "expert_parallel": 0.0, "optimizer_offload": 0.0, "zero1_sharding": 0.0,
                     "remat_every_block_or_none": 1.0}),
}
# (the rules set off: each coefficient at the value that lets the knob through)
OPEN = {"remat_every_block_or_none": 0.0}


def _sc(runtime, **kw):
    kw = {"count": 8, "global_batch": 16, "seq_len": 1024, **kw}
    return make_scenario(kw.pop("model", llama_like(hidden=1024, heads=8, kv=2)),
                         runtime=runtime, **kw)


@pytest.mark.parametrize("runtime, knob, value", [
    (rt, knob, value) for rt, (_, named, _) in RUNTIMES.items() for knob, value in named])
def test_what_the_written_files_cannot_launch_is_refused_when_named(tmp_path, capsys, runtime,
                                                                    knob, value):
    path = runtime_scenario_file(tmp_path, runtime, "", f"{knob} = {value}")
    assert main(["plan", path, "--set", "micro_batch=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config.{knob}" in err[0] and runtime in err[0], err


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_searched_knobs_are_narrowed_and_the_best_config_is_written(runtime):
    """Left to the optimiser, tp, pp and ep are 1 and remat none or full (pytorch-eager, the
    base, searches them all); the exhaustive optimum stays inside and every format of the
    runtime writes it."""
    formats, _, _ = RUNTIMES[runtime]
    sc = _sc(runtime)
    for knob in ("tp", "pp", "ep"):
        assert sc.knob(knob).values == (1,), knob
    assert sc.knob("remat").values == ("none", "full")
    eager = _sc("pytorch-eager")
    assert eager.knob("tp").auto and eager.knob("remat").auto and eager.knob("zero_stage").auto
    res = capopt.optimize(sc, method="exhaustive", top_k=5, remedies=False)
    assert res.status == "ok" and res.candidates
    for c in res.candidates:
        assert (c.config.tp, c.config.pp, c.config.ep, c.config.cp) == (1, 1, 1, 1)
        assert c.config.remat in ("none", "full")
    for fmt in formats:
        assert emit(fmt, res.candidates[0].config, sc)


def test_hf_refuses_context_parallelism_in_the_lattice_and_llm_foundry_zero1():
    """cp > 1 is a broken config under hf and an allowed one under pytorch-eager; searched,
    llm-foundry's ZeRO stages are 0, 2 and 3."""
    cols = {"micro_batch": [2, 2], "grad_accum": [1, 2], "dp": [8, 8], "tp": [1, 1],
            "pp": [1, 1], "ep": [1, 1], "cp": [1, 2], "vpp": [1, 1], "zero_stage": [3, 3],
            "sequence_parallel": [0, 0], "dp_replicate": [1, 1]}
    assert broken(cols, _sc("hf")).tolist() == [False, True]
    assert broken(cols, _sc("pytorch-eager")).tolist() == [False, False]
    assert _sc("llm-foundry").knob("zero_stage").values == (0, 2, 3)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_config_it_runs_is_priced_as_before(runtime):
    """The rules only narrow what is searched: a data-parallel config's memory and step time
    are the same with the rules set off (the runtime compared against itself)."""
    _, _, rules = RUNTIMES[runtime]
    sc = _sc(runtime)
    assert all(sc.runtime.coeff(r) == v for r, v in rules.items())
    cfg = Config(micro_batch=2, dp=8, zero_stage=3, remat="full")
    opened = sc.replace(runtime=sc.runtime.with_coeffs(
        **{r: OPEN.get(r, 1.0) for r in rules}))
    a, b = estimate(cfg, sc), estimate(cfg, opened)
    assert float(a.memory["total_bytes"]) == pytest.approx(float(b.memory["total_bytes"]),
                                                           rel=F32_RTOL)
    assert float(a.time["step_s"]) == pytest.approx(float(b.time["step_s"]), rel=F32_RTOL)


def test_optimize_writes_the_best_config_the_format_can_write(capsys):
    """``optimize --emit``: where the format cannot write the optimum (DeepSpeed's JSON has no
    switch for recomputation, model code's), the best config it can write is written, and one
    line on stderr names the optimum, why, and the one written; a format that writes the
    optimum adds no line."""
    import json
    import re
    args = ["--model", "llama-3.2-1b", "--gpu", "rtx-4090-24gb", "--count", "2",
            "--seq-len", "1024", "--global-batch", "8", "--runtime", "deepspeed"]
    assert main(["optimize", *args, "--emit", "deepspeed"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    notes = [line for line in err.splitlines() if line.startswith("capopt: note:")]
    assert len(notes) == 1 and "remat=selective" in notes[0] and "config.remat" in notes[0]
    mb, ga = map(int, re.search(r"writing the best one deepspeed can: mb=(\d+) ga=(\d+)",
                                notes[0]).groups())
    assert (doc["train_micro_batch_size_per_gpu"], doc["gradient_accumulation_steps"]) == (mb, ga)
    assert main(["optimize", *args, "--emit", "megatron"]) == 0
    assert "capopt: note:" not in capsys.readouterr().err


def test_deepspeed_runs_autotp_without_sequence_parallelism(tmp_path, capsys):
    """DeepSpeed's tensor parallelism is AutoTP's (``tensor_parallel.autotp_size`` in its JSON,
    row-parallel outputs all-reduced): sequence parallelism is refused when named and left out
    when searched; a tensor-parallel config is written with its AutoTP degree."""
    import json
    path = runtime_scenario_file(tmp_path, "deepspeed", "",
                                 "tp = 2\nsequence_parallel = true")
    assert main(["plan", path, "--set", "micro_batch=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.sequence_parallel" in err[0] and "deepspeed" in err[0]
    sc = _sc("deepspeed")
    assert sc.knob("sequence_parallel").values == (False,) and sc.knob("tp").auto
    cfg = Config(micro_batch=2, grad_accum=2, dp=4, tp=2, zero_stage=1)
    assert json.loads(emit("deepspeed", cfg, sc))["tensor_parallel"] == {"autotp_size": 2}
