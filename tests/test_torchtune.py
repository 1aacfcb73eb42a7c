"""The ``torchtune`` runtime: torchtune's fine-tuning recipes (pytorch/torchtune bd2a0fc) as
capopt prices them and ``--emit torchtune`` launches them. The whole model in one dtype
(``dtype: bf16`` or ``fp32``), FSDP2 over every data-parallel rank with the root group kept
gathered (``shard_model``'s root ``reshard_after_forward=False``), fused AdamW, the float32
or the chunked loss (torch's cross-entropy on the float32 logits, LinearCrossEntropyLoss),
expandable segments; no pipeline, expert or context parallelism, no optimizer-only offload,
no selective recomputation, no compile (it compiles the loss, priced eager) and no activation
offloading (its context leaves the loss out)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import capopt
from capopt._errors import CapoptError
from capopt._hardware import get_hardware
from capopt._runtime import get_profile
from capopt._scenario import CapoptWarning, load_scenario
from capopt._specs import Config, KnobDomain, LoRA
from capopt._validity import broken, config_problems
from capopt.cli import main
from capopt.cost import estimate, scenario_numbers
from capopt.report.launch import emit
from conftest import llama_like, make_scenario, runtime_scenario_file

# float32 arithmetic on byte counts up to ~1e11 carries ~1e-7 relative error.
F32_RTOL = 1e-6


def _sc(runtime="torchtune", **kw):
    kw = {"precision": "bf16", "loss": "chunked", "count": 8, "global_batch": 16,
          "seq_len": 1024, **kw}
    return make_scenario(kw.pop("model", llama_like(hidden=1024, heads=8, kv=2)),
                         runtime=runtime, **kw)


def _scenario_file(tmp_path, training: str, config: str = "") -> str:
    return runtime_scenario_file(tmp_path, "torchtune", training, config)


def test_the_profile_trains_in_one_dtype_and_names_what_it_allows(tmp_path, capsys):
    """torchtune's cfg.dtype is bf16 or fp32 (fp16 raises, and there is no autocast): a
    scenario in mixed precision exits 2 naming the field and the two it allows; one that names
    no precision takes bf16."""
    prof = get_profile("torchtune")
    assert prof.precision_names == ("bf16", "fp32")
    assert main(["plan", _scenario_file(tmp_path, 'precision = "bf16-mixed"'),
                 "--set", "micro_batch=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.precision" in err[0] and "bf16, fp32" in err[0]
    sc = load_scenario(_scenario_file(tmp_path, ""))
    assert sc.workload.precision == "bf16"


@pytest.mark.parametrize("loss", ["fused", "fused-linear"])
def test_losses_torchtune_does_not_run_are_refused(tmp_path, capsys, loss):
    """Its recipes take LinearCrossEntropyLoss (chunked) or torch's cross-entropy on the float32
    logits the model returns (float32), not the one-kernel or Liger loss capopt prices: each is
    refused naming training.loss and the two it runs."""
    assert main(["plan", _scenario_file(tmp_path, f'loss = "{loss}"'),
                 "--set", "micro_batch=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.loss" in err[0] and "chunked" in err[0]


def test_auto_loss_searches_the_two_it_runs(tmp_path):
    sc = load_scenario(_scenario_file(tmp_path, 'loss = "auto"'))
    assert sc.choices == ("loss",)
    assert {v.workload.loss for v in sc.variants} == {"float32", "chunked"}
    with pytest.warns(CapoptWarning, match="compile"):
        one = load_scenario(_scenario_file(tmp_path, 'compile = "auto"'))
    assert one.workload.compile is False


@pytest.mark.parametrize("knob, value, field", [
    ("pp", "2", "config.pp"), ("zero_stage", "1", "config.zero_stage"),
    ("offload_optimizer", "true", "config.offload_optimizer"),
    ("remat", '"selective"', "config.remat"), ("ep", "2", "config.ep"),
    ("tp", "2", "config.tp")])
def test_what_the_recipes_cannot_run_is_refused_when_named(tmp_path, capsys, knob, value,
                                                           field):
    """No pipeline or expert dimension in torchtune's mesh, tensor parallelism only with the
    model's own plan (which capopt does not write), FSDP2 (never ZeRO-1) over every
    data-parallel rank, no host offload of the optimizer state alone, whole blocks
    checkpointed (no selective activation checkpointing): named, each exits 2 naming the
    field."""
    assert main(["plan", _scenario_file(tmp_path, "", f"{knob} = {value}"),
                 "--set", "micro_batch=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "torchtune" in err[0]


def test_searched_knobs_are_narrowed_to_what_torchtune_runs():
    """Left to the optimiser, pp is 1, offload off, ZeRO 0, 2 or 3; ZeRO-0 at dp > 1 (DDP) is
    a broken config under torchtune and an allowed one under pytorch-eager."""
    sc = _sc()
    assert sc.knob("pp").values == (1,) and sc.knob("offload_optimizer").values == (False,)
    assert sc.knob("zero_stage").values == (0, 2, 3)
    assert sc.knob("remat").values == ("none", "full") and sc.knob("ep").values == (1,)
    assert sc.knob("tp").values == (1,)
    half = _sc(knobs={"remat": (0.5, "selective")})          # (a named fraction stays)
    assert half.knob("remat").values == (0.5,)
    eager = _sc("pytorch-eager")
    assert eager.knob("zero_stage").auto and eager.knob("pp").auto
    cols = {"micro_batch": [2, 2, 2], "grad_accum": [1, 1, 1], "dp": [8, 8, 8],
            "tp": [1, 1, 1], "pp": [1, 1, 1], "ep": [1, 1, 1], "cp": [1, 1, 1],
            "vpp": [1, 1, 1], "zero_stage": [0, 2, 3], "sequence_parallel": [0, 0, 0],
            "dp_replicate": [1, 1, 1]}
    assert broken(cols, sc).tolist() == [True, False, False]
    assert broken(cols, eager).tolist() == [False, False, False]
    assert any(f == "config.zero_stage" for f, _ in
               config_problems(Config(micro_batch=2, dp=8, zero_stage=0), sc))
    res = capopt.optimize(sc, method="exhaustive", top_k=5, remedies=False)
    assert res.status == "ok"
    assert all(c.config.zero_stage in (2, 3) and c.config.pp == 1 for c in res.candidates)


PHASES = ("loss", "top", "rebuild", "bottom", "update", "forward", "regather")


def _phases(est) -> dict:
    return {p: float(est.memory[f"phase_{p}_bytes"]) for p in PHASES}


def test_changes_against_pytorch_eager_are_the_ones_its_code_makes():
    """Against the pytorch-eager profile on the same configs: the same parameters, gradients,
    optimizer state and activations, and the same live set in every phase but two. Under
    ZeRO-3 the root group is kept gathered, so the re-gather at the head's gradient (its flat
    all-gather output beside the parameters) is gone; on one device the update's peak drops
    by the foreach path's square root of the second moments, which fused AdamW never writes.
    The step time is the same."""
    cases = ((Config(micro_batch=2, dp=8, zero_stage=3, remat="full"), {}, "regather"),
             (Config(micro_batch=2, dp=1, remat="full"), {"count": 1, "global_batch": 2},
              "update"))
    for cfg, kw, moved in cases:
        tune, eager = (estimate(cfg, _sc(rt, **kw)) for rt in ("torchtune", "pytorch-eager"))
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"):
            assert float(tune.memory[key]) == pytest.approx(float(eager.memory[key]),
                                                            rel=F32_RTOL), key
        pt, pe = _phases(tune), _phases(eager)
        for phase in PHASES:
            if phase != moved:
                assert pt[phase] == pytest.approx(pe[phase], rel=F32_RTOL), (cfg.dp, phase)
        assert pt[moved] < pe[moved] * (1 - 1e-4), (cfg.dp, moved)
        if moved == "update":
            # (exactly one moment's bytes: AdamW's state is two moments, the square root a
            # copy of the second; a dynamic buffer, with the allocator's fragmentation share)
            frag = get_profile("torchtune").coeff("fragmentation")
            # (a difference of two float32 totals ~1e9 bytes: 1e-5 of a 4e7-byte moment is
            # 400 bytes, above their rounding, 64 bytes each)
            assert pe[moved] - pt[moved] == pytest.approx(
                float(eager.memory["optimizer_bytes"]) / 2 * (1 + frag), rel=1e-5)
        # (seconds from float32 sums of ~1e3 terms: a few ulps apart at most)
        assert float(tune.time["step_s"]) == pytest.approx(float(eager.time["step_s"]),
                                                           rel=1e-5)


def test_float32_matmuls_run_at_the_fp32_rate_not_tf32():
    """torchtune never sets torch.set_float32_matmul_precision: an fp32 run's matmuls are full
    float32 (pytorch-eager prices them as TF32), so its compute time is longer."""
    cfg = Config(micro_batch=2, grad_accum=1, dp=8, zero_stage=3, remat="full")
    tune = estimate(cfg, _sc(precision="fp32"))
    eager = estimate(cfg, _sc("pytorch-eager", precision="fp32"))
    hw = get_hardware("h100-sxm-80gb")
    assert hw.effective_peak("tf32") > 2 * hw.effective_peak("fp32")
    assert float(tune.time["compute_s"]) > 2 * float(eager.time["compute_s"])


# ---- --emit torchtune ------------------------------------------------------------------------
def test_emit_writes_the_recipe_and_the_keys_it_reads():
    """Eight devices, ZeRO-3, full recomputation: full_finetune_distributed with FSDP2 over 8
    ranks resharding after the forward pass, the chunked loss, fused AdamW, packed sequences of
    the scenario's length; ZeRO-2 writes fsdp_reshard_after_forward=False."""
    sc = _sc()
    text = emit("torchtune", Config(micro_batch=2, grad_accum=1, dp=8, zero_stage=3,
                                    remat="full"), sc)
    assert "tune run --nnodes 1 --nproc_per_node 8 full_finetune_distributed" in text
    for kv in ("batch_size=2", "gradient_accumulation_steps=1", "dtype=bf16",
               "dataset.packed=True", "tokenizer.max_seq_len=1024",
               "loss._component_=torchtune.modules.loss.LinearCrossEntropyLoss",
               "compile=False", "enable_activation_offloading=False",
               "optimizer._component_=torch.optim.AdamW", "optimizer.fused=True",
               "enable_activation_checkpointing=True", "data_parallel_shard_dim=8",
               "fsdp_reshard_after_forward=True", "'custom_sharded_layers=[]'",
               "clip_grad_norm=1.0"):
        assert kv in text.split(), kv
    z2 = emit("torchtune", Config(micro_batch=2, dp=8, zero_stage=2), sc)
    assert "fsdp_reshard_after_forward=False" in z2.split()
    assert "enable_activation_checkpointing=False" in z2.split()


def test_emit_one_device_lora_and_every_nth_layer():
    """One device is the single-device recipe; LoRA on q and v is lora_attn_modules without
    the MLP; checkpointing half the layers is ac_mode=selective every 2nd layer (the
    distributed full recipe's), which the single-device recipes refuse."""
    lora = _sc(count=1, global_batch=2, lora=LoRA(rank=8, targets=("q", "v")))
    text = emit("torchtune", Config(micro_batch=2), lora)
    assert "tune run lora_finetune_single_device" in text
    assert "'model.lora_attn_modules=[q_proj,v_proj]'" in text.split()
    assert "model.apply_lora_to_mlp=False" in text.split()
    assert "optimizer_in_bwd" not in text              # (the full recipes' key only)
    assert "model.quantize_base=False" in text.split()
    qlora = _sc(count=1, global_batch=2, lora=LoRA(rank=8, targets=("attn", "mlp"), base_bits=4))
    words = emit("torchtune", Config(micro_batch=2), qlora).split()
    assert {"model.quantize_base=True", "model.apply_lora_to_mlp=True",
            "'model.lora_attn_modules=[q_proj,k_proj,v_proj,output_proj]'"} <= set(words)
    f32 = emit("torchtune", Config(micro_batch=2, dp=8, zero_stage=3), _sc(loss="float32"))
    assert "loss._component_=torch.nn.CrossEntropyLoss" in f32.split()
    half = emit("torchtune", Config(micro_batch=2, dp=8, zero_stage=3, remat=0.5), _sc())
    assert {"ac_mode=selective", "ac_option=2"} <= set(half.split())
    with pytest.raises(CapoptError, match="config.remat"):
        emit("torchtune", Config(micro_batch=2, remat=0.5), _sc(count=1, global_batch=2))


@pytest.mark.parametrize("change, knob", [
    ({"precision": "bf16-mixed"}, "training.precision"),
    ({"lora": LoRA(rank=8, targets=("q", "v"), base_bits=8)}, "training.lora.base_bits"),
    ({"lora": LoRA(rank=8, targets=("q", "v"), base_bits=4, double_quant=False)},
     "training.lora.double_quant"),
    ({"lora": LoRA(rank=8, targets=("q", "gate"))}, "training.lora.targets"),
    ({"lora": LoRA(rank=8, targets=("mlp",))}, "training.lora.targets"),
    ({"loss": "fused"}, "training.loss"),
])
def test_emit_refuses_what_the_recipes_refuse(change, knob):
    """Mixed precision, an 8-bit base (torchtune's QLoRA is NF4, its block scales always
    quantised again: torchao's NF4Tensor), LoRA on part of the MLP
    (apply_lora_to_mlp wraps all three or none) or on no attention projection (its builders
    raise on an empty lora_attn_modules), a loss it has not: the error names the knob."""
    sc = _sc(runtime="pytorch-eager")
    sc = sc.replace(workload=dataclasses.replace(sc.workload, **change))
    with pytest.raises(CapoptError) as e:
        emit("torchtune", Config(micro_batch=2, dp=8, zero_stage=3), sc)
    assert knob in str(e.value) and e.value.field == "--emit"


def test_the_command_line_answers_and_emits(capsys):
    """`capopt optimize --runtime torchtune --emit torchtune` on a one-line scenario: the
    answer's launch command, exit 0."""
    args = ["--model", "llama-3.2-1b", "--gpu", "h100-sxm-80gb", "--count", "8",
            "--seq-len", "2048", "--global-batch", "32", "--runtime", "torchtune"]
    assert main(["optimize", *args, "--emit", "torchtune"]) == 0
    out = capsys.readouterr().out
    assert "full_finetune_distributed" in out and "dtype=bf16" in out.split()
