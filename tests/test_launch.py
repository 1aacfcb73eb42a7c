"""Launch configs (`capopt.report.launch`): each format's text, read back with a parser of its
own syntax, gives the config's knobs again; what a format cannot carry is refused in one line
that names the knob; the text is the same every time.

The frameworks' own loaders (TrainingArguments, TRL's parser, Accelerate's ClusterConfig,
DeepSpeedConfig, torchtitan's ConfigManager, megatron-core's config dataclasses) are tried where
the framework is installed (the `frameworks` extra installs them all); MaxText needs Python >= 3.12 and is checked
against its documented keys only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import tomllib

import pytest
import yaml

from capopt._errors import CapoptError
from capopt._scenario import load_scenario
from capopt._specs import Config, LoRA
from capopt.report.launch import FORMATS, SUFFIX, emit

SC = load_scenario("llama3-8b-8xh100")        # 32 layers, 8 GPUs on one node, bf16-mixed AdamW
LAYERS = SC.model.num_hidden_layers

# global batch 256 = micro x accumulation x dp in each
CONFIGS = {
    "dp-only": Config(micro_batch=4, grad_accum=8, dp=8, zero_stage=0),
    "zero3-full": Config(micro_batch=1, grad_accum=32, dp=8, zero_stage=3, remat="full"),
    "zero1": Config(micro_batch=2, grad_accum=16, dp=8, zero_stage=1),
    "tp-pp-sp": Config(micro_batch=1, grad_accum=64, dp=2, tp=2, pp=2, zero_stage=1,
                       sequence_parallel=True, remat="selective"),
    "tp-sp-zero3": Config(micro_batch=1, grad_accum=64, dp=4, tp=2, zero_stage=3,
                          sequence_parallel=True, remat="selective"),
    # tensor parallelism without sequence parallelism (DeepSpeed's AutoTP)
    "tp-zero1": Config(micro_batch=2, grad_accum=32, dp=4, tp=2, zero_stage=1),
    "fraction": Config(micro_batch=2, grad_accum=16, dp=8, zero_stage=3, remat=0.25),
    "offload": Config(micro_batch=2, grad_accum=16, dp=8, zero_stage=2, offload_optimizer=True),
    # context parallelism: 2 ranks share each sequence, the batch over dp / cp = 4 replicas
    "cp-zero3": Config(micro_batch=2, grad_accum=32, dp=8, cp=2, zero_stage=3, remat="full"),
    # interleaved 1F1B: two chunks of 32 / (2 x 2) = 8 blocks a pipeline rank
    "pp-vpp": Config(micro_batch=1, grad_accum=64, dp=2, tp=2, pp=2, vpp=2, zero_stage=1,
                     sequence_parallel=True, remat="selective"),
    "pp-vpp-fsdp": Config(micro_batch=1, grad_accum=64, dp=4, pp=2, vpp=2, zero_stage=3,
                          remat="full"),
    # hybrid sharding: 2 replicas of a 4-rank FSDP group
    "hsdp-zero3": Config(micro_batch=1, grad_accum=32, dp=8, dp_replicate=2, zero_stage=3,
                         remat="full"),
}
# which formats carry which config (the rest must refuse it)
EXPRESSES = {
    "dp-only": {"deepspeed", "megatron", "torchtitan", "accelerate", "hf-trainer", "trl-sft",
                "maxtext", "llm-foundry"},
    "zero3-full": {"megatron", "torchtitan", "accelerate", "hf-trainer", "trl-sft", "maxtext",
                   "llm-foundry"},
    "zero1": {"deepspeed", "megatron", "accelerate", "hf-trainer", "trl-sft", "maxtext"},
    "tp-pp-sp": {"megatron"},
    "tp-sp-zero3": {"megatron", "torchtitan"},
    "tp-zero1": {"deepspeed", "megatron", "maxtext"},
    "fraction": {"megatron", "torchtitan", "hf-trainer", "trl-sft"},
    "offload": {"deepspeed", "megatron", "accelerate", "hf-trainer", "trl-sft"},
    "cp-zero3": {"megatron", "torchtitan"},
    "pp-vpp": {"megatron"},
    "pp-vpp-fsdp": {"torchtitan"},
    "hsdp-zero3": {"megatron", "torchtitan", "maxtext"},
}


def _remat(c: Config):
    """The recomputation a framework can be asked for: none | selective | full | ("blocks", k)
    with k of a stage's blocks (capopt's whole-block count)."""
    if isinstance(c.remat, str):
        return c.remat
    k = round(c.remat * LAYERS / c.pp)
    return "none" if k == 0 else "full" if k == LAYERS // c.pp else ("blocks", k)


def expected(c: Config) -> dict:
    return {"micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "dp": c.dp, "tp": c.tp,
            "pp": c.pp, "zero_stage": c.zero_stage, "sequence_parallel": c.sequence_parallel,
            "remat": _remat(c), "offload_optimizer": c.offload_optimizer, "grad_clip": True,
            "precision": "bf16-mixed", "cp": c.cp, "vpp": c.vpp, "dp_replicate": c.dp_replicate}


# --------------------------------------------------------------------------------------------
# Readers: each format's text back to capopt's knobs, with that format's own syntax
# --------------------------------------------------------------------------------------------
def read_deepspeed(text: str) -> dict:
    d = json.loads(text)
    zero = d["zero_optimization"]
    micro, accum = d["train_micro_batch_size_per_gpu"], d["gradient_accumulation_steps"]
    return {"micro_batch": micro, "grad_accum": accum, "dp": d["train_batch_size"] // (micro
            * accum), "tp": d.get("tensor_parallel", {}).get("autotp_size", 1), "pp": 1,
            "zero_stage": zero["stage"], "sequence_parallel": False,
            "remat": "none", "offload_optimizer": zero.get("offload_optimizer", {}).get("device")
            == "cpu", "grad_clip": d["gradient_clipping"] == 1.0,
            "precision": "bf16-mixed" if d.get("bf16", {}).get("enabled") else "?"}


def megatron_parser() -> argparse.ArgumentParser:
    """The flags capopt writes, spelled as Megatron-LM's arguments.py spells them."""
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for name in ("tensor-model-parallel-size", "pipeline-model-parallel-size", "micro-batch-size",
                 "global-batch-size", "seq-length", "expert-model-parallel-size",
                 "context-parallel-size", "recompute-num-layers",
                 "num-virtual-stages-per-pipeline-rank", "num-distributed-optimizer-instances"):
        p.add_argument(f"--{name}", type=int, default=1 if "parallel-size" in name else None)
    for name in ("sequence-parallel", "use-distributed-optimizer", "use-megatron-fsdp", "bf16",
                 "fp16", "optimizer-cpu-offload", "overlap-grad-reduce", "overlap-param-gather",
                 "tp-comm-overlap"):
        p.add_argument(f"--{name}", action="store_true")
    p.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--optimizer", choices=["adam", "sgd", "muon", "lion", "soap"])
    p.add_argument("--sgd-momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--optimizer-offload-fraction", type=float, default=1.0)
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
    p.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"])
    return p


def megatron_argv(text: str) -> list[str]:
    body = text.split("MEGATRON_ARGS=(\n", 1)[1].split("\n)", 1)[0]
    return shlex.split(body)


def read_megatron(text: str) -> dict:
    a = megatron_parser().parse_args(megatron_argv(text))
    devices, cp = 8, a.context_parallel_size
    # Megatron's data-parallel size leaves the context-parallel ranks out; capopt's dp counts
    # them (the group the distributed optimizer shards over)
    dp = devices // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size * cp)
    zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
    stage = (zero[a.data_parallel_sharding_strategy] if a.use_megatron_fsdp
             else 1 if a.use_distributed_optimizer else 0)
    per_stage = LAYERS // a.pipeline_model_parallel_size
    if a.recompute_granularity is None:
        remat = "none"
    elif a.recompute_granularity == "selective":
        remat = "selective"
    elif a.recompute_method == "uniform" and a.recompute_num_layers == 1:
        remat = "full"
    else:
        assert a.recompute_method == "block"
        remat = ("full" if a.recompute_num_layers == per_stage
                 else ("blocks", a.recompute_num_layers))
    return {"micro_batch": a.micro_batch_size,
            "grad_accum": a.global_batch_size // (a.micro_batch_size * dp), "dp": dp * cp,
            "cp": cp, "vpp": a.num_virtual_stages_per_pipeline_rank or 1,
            "dp_replicate": a.num_distributed_optimizer_instances or 1,
            "tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size,
            "zero_stage": stage, "sequence_parallel": a.sequence_parallel, "remat": remat,
            "offload_optimizer": a.optimizer_cpu_offload, "grad_clip": a.clip_grad == 1.0,
            "precision": "bf16-mixed" if a.bf16 and not a.fp8_format else "?"}


def read_torchtitan(text: str) -> dict:
    d = tomllib.loads(text)
    par, tr, ac = d["parallelism"], d["training"], d["activation_checkpoint"]
    replicas = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    cp = par.get("context_parallel_degree", 1)
    dp = replicas * cp                  # FSDP2 shards over dp_shard x cp (ParallelDims' fsdp)
    sharded = par["data_parallel_shard_degree"] * cp > 1
    # HSDP: FSDP2 over the shard group, replicated dp_replicate times (DDP when unsharded)
    hsdp = par["data_parallel_replicate_degree"] if sharded else 1
    if not sharded:
        stage = 0
    else:
        stage = 2 if par.get("fsdp_reshard_after_forward") == "never" else 3
    pp = par["pipeline_parallel_degree"]
    vpp = 1
    if par.get("pipeline_parallel_schedule", "1F1B") == "Interleaved1F1B":
        assert par["pipeline_parallel_first_stage_less_layers"] == 0
        assert par["pipeline_parallel_last_stage_less_layers"] == 0
        vpp = LAYERS // (pp * par["pipeline_parallel_layers_per_stage"])
    micro = par.get("pipeline_parallel_microbatch_size", tr["local_batch_size"])
    if ac["mode"] == "selective":
        opt = ac["selective_ac_option"]
        remat = "selective" if opt == "op" else ("blocks", (LAYERS // pp) // int(opt))
    else:
        remat = ac["mode"]
    return {"micro_batch": micro, "grad_accum": tr["global_batch_size"] // (micro * replicas),
            "dp": dp, "cp": cp, "vpp": vpp, "dp_replicate": hsdp,
            "tp": par["tensor_parallel_degree"], "pp": pp,
            "zero_stage": stage,
            # torchtitan's TP shards norms over the sequence: SP whenever tp > 1
            "sequence_parallel": par["tensor_parallel_degree"] > 1, "remat": remat,
            "offload_optimizer": False, "grad_clip": tr["max_norm"] == 1.0,
            "precision": "bf16-mixed" if (tr["dtype"], tr["mixed_precision_param"])
            == ("float32", "bfloat16") else "?"}


def _script_value(text: str, pattern: str):
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


def read_accelerate(text: str) -> dict:
    d = yaml.safe_load(text)
    kind = d["distributed_type"]
    if kind == "DEEPSPEED":
        ds = d["deepspeed_config"]
        stage, accum = ds["zero_stage"], ds["gradient_accumulation_steps"]
        offload, clip, remat = ds.get("offload_optimizer_device") == "cpu", \
            ds["gradient_clipping"] == 1.0, "none"
    else:
        fsdp = d.get("fsdp_config", {})
        stage = (3 if fsdp["fsdp_reshard_after_forward"] else 2) if kind == "FSDP" else 0
        accum = _script_value(text, r"Accelerator\(gradient_accumulation_steps=(\d+)\)")
        offload = False
        clip = "clip_grad_norm_(model.parameters(), max_norm=1.0)" in text
        remat = "full" if fsdp.get("fsdp_activation_checkpointing") else "none"
    return {"micro_batch": _script_value(text, r"DataLoader\(batch_size=(\d+)\)"),
            "grad_accum": accum, "dp": d["num_processes"], "tp": 1, "pp": 1,
            "zero_stage": stage, "sequence_parallel": False, "remat": remat,
            "offload_optimizer": offload, "grad_clip": clip,
            "precision": {"bf16": "bf16-mixed"}.get(d["mixed_precision"], "?")}


def _hf_remat(d: dict):
    if not d["activation_checkpointing"]:
        return "none"
    n = d.get("activation_checkpointing_kwargs", {}).get("every_n_layers", 1)
    return "full" if n == 1 else ("blocks", -(-LAYERS // n))      # layer index % n == 0


def read_hf_trainer(text: str) -> dict:
    d = json.loads(text)
    if "deepspeed" in d:
        zero = d["deepspeed"]["zero_optimization"]
        stage, offload = zero["stage"], zero.get("offload_optimizer", {}).get("device") == "cpu"
    else:
        fsdp = d.get("fsdp", "")
        stage = 3 if "full_shard" in fsdp else 2 if "shard_grad_op" in fsdp else 0
        offload = False
    return {"micro_batch": d["per_device_train_batch_size"],
            "grad_accum": d["gradient_accumulation_steps"], "dp": 8, "tp": 1, "pp": 1,
            "zero_stage": stage, "sequence_parallel": False,
            "remat": _hf_remat(d),
            "offload_optimizer": offload, "grad_clip": d["max_grad_norm"] == 1.0,
            "precision": "bf16-mixed" if d["bf16"] and not d["fp16"] else "?"}


def read_trl_sft(text: str) -> dict:
    """TRL's YAML: TrainingArguments' fields as hf-trainer's, the world size from the launch
    line's --num_processes (1 without)."""
    d = yaml.safe_load(text)
    assert d["max_length"] == SC.seq_len and d["packing"] is True and d["loss_type"] == "nll"
    if not d.get("use_peft"):
        # full fine-tuning under autocast: float32 weights, the master copy bf16-mixed prices
        assert d["dtype"] == "float32", d["dtype"]
    out = read_hf_trainer(json.dumps(d))
    m = re.search(r"--num_processes (\d+)", text)
    out["dp"] = int(m.group(1)) if m else 1
    return out


def maxtext_overrides(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            assert key not in out, key
            out[key] = value
    return out


def read_maxtext(text: str) -> dict:
    d = maxtext_overrides(text)
    axis = {k: int(d[f"ici_{k}_parallelism"]) * int(d[f"dcn_{k}_parallelism"])
            for k in ("data", "fsdp", "tensor", "pipeline", "expert")}
    dp = axis["data"] * axis["fsdp"] * axis["expert"]
    tp, pp = axis["tensor"], axis["pipeline"]
    per_device = float(d["per_device_batch_size"])
    accum = int(d["gradient_accumulation_steps"])
    stage = 3 if axis["fsdp"] > 1 else 1 if d["shard_optimizer_over_data"] == "true" else 0
    remat = {"minimal_with_context": "none", "minimal": "selective", "full": "full"}
    # the data axis beside a sharding fsdp axis: replicas of the FSDP group (hybrid sharding)
    replicate = axis["data"] if stage == 3 and axis["data"] > 1 else 1
    return {"micro_batch": round(per_device * tp), "grad_accum": accum, "dp": dp, "tp": tp,
            "pp": pp, "zero_stage": stage, "sequence_parallel": False,
            "dp_replicate": replicate,
            "remat": remat[d["remat_policy"]],
            "offload_optimizer": d["optimizer_memory_host_offload"] == "true",
            "grad_clip": float(d["gradient_clipping_threshold"]) == 1.0,
            "precision": "bf16-mixed" if (d["dtype"], d["weight_dtype"])
            == ("bfloat16", "float32") and "quantization" not in d else "?"}


def read_llm_foundry(text: str) -> dict:
    d = yaml.safe_load(text)
    fsdp = d.get("fsdp_config")
    stage = {None: 0, "FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[fsdp and fsdp["sharding_strategy"]]
    # the world size: composer -n <processes per node> on <nodes> node(s), from the header
    per_node, nodes = re.search(r"composer -n (\d+) .*\(on (\d+) node", text).groups()
    micro, dp = d["device_train_microbatch_size"], int(per_node) * int(nodes)
    clip = d.get("algorithms", {}).get("gradient_clipping", {})
    return {"micro_batch": micro, "grad_accum": d["global_train_batch_size"] // (micro * dp),
            "dp": dp, "tp": 1, "pp": 1, "zero_stage": stage, "sequence_parallel": False,
            "remat": "full" if fsdp and fsdp["activation_checkpointing"] else "none",
            "offload_optimizer": False,
            "grad_clip": clip == {"clipping_type": "norm", "clipping_threshold": 1.0},
            "precision": {"amp_bf16": "bf16-mixed"}.get(d["precision"], "?")}


def torchtune_command(text: str) -> tuple[list[str], dict[str, str]]:
    """The `tune run` line's arguments before the config, and its key=value overrides (as a
    shell splits them: quotes removed, backslash-newlines joined)."""
    import shlex
    body = text.replace("\\\n", " ")
    line = next(ln for ln in body.splitlines() if ln.startswith("tune run"))
    words = shlex.split(line)
    at = words.index("--config")
    assert words[at + 1] == "$CONFIG"
    overrides = {}
    for w in words[at + 2:]:
        key, value = w.split("=", 1)
        assert key not in overrides, key
        overrides[key] = value
    return words[:at], overrides


def read_torchtune(text: str) -> dict:
    head, d = torchtune_command(text)
    devices = 1
    if "--nproc_per_node" in head:
        devices = (int(head[head.index("--nproc_per_node") + 1])
                   * int(head[head.index("--nnodes") + 1]))
    tp = int(d.get("tensor_parallel_dim", 1))
    cp = int(d.get("context_parallel_dim", 1))
    dp = devices // tp
    if "data_parallel_shard_dim" in d:
        assert (int(d["data_parallel_shard_dim"]) * int(d["data_parallel_replicate_dim"])
                * cp == dp)
    remat = ("full" if d["enable_activation_checkpointing"] == "True" else
             ("blocks", LAYERS // int(d["ac_option"])) if d.get("ac_mode") == "selective"
             else "none")
    return {"micro_batch": int(d["batch_size"]), "grad_accum": int(d["gradient_accumulation_steps"]),
            "dp": dp, "tp": tp, "pp": 1,
            "zero_stage": 0 if dp == 1 else 3 if d["fsdp_reshard_after_forward"] == "True" else 2,
            "sequence_parallel": tp > 1, "remat": remat, "offload_optimizer": False,
            "grad_clip": d["clip_grad_norm"] == "1.0",
            "precision": {"bf16": "bf16", "fp32": "fp32"}[d["dtype"]], "cp": cp,
            "dp_replicate": int(d.get("data_parallel_replicate_dim", 1))}


READERS = {"deepspeed": read_deepspeed, "megatron": read_megatron,
           "torchtitan": read_torchtitan, "accelerate": read_accelerate,
           "hf-trainer": read_hf_trainer, "trl-sft": read_trl_sft, "maxtext": read_maxtext,
           "llm-foundry": read_llm_foundry, "torchtune": read_torchtune}


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------
def test_the_api_names_every_format():
    assert set(FORMATS) == set(SUFFIX) == set(READERS)
    assert all(s.startswith(".") for s in SUFFIX.values())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_knob_reads_back(fmt, name):
    cfg = CONFIGS[name]
    if fmt not in EXPRESSES[name]:
        with pytest.raises(CapoptError) as err:
            emit(fmt, cfg, SC)
        assert err.value.field == "--emit" and "\n" not in str(err.value)
        return
    text = emit(fmt, cfg, SC)
    got = READERS[fmt](text)
    got.setdefault("cp", 1)             # formats with no context-parallel degree: 1
    got.setdefault("vpp", 1)            # nor virtual pipeline stages
    got.setdefault("dp_replicate", 1)   # nor hybrid sharding
    assert got == expected(cfg)
    assert text == emit(fmt, cfg, SC)                        # deterministic
    assert text.endswith("\n")


# torchtune trains in one dtype with its chunked loss: the configs on the scenario in pure bf16
SC_TUNE = load_scenario("llama3-8b-8xh100", values={"training.precision": ("bf16", "t"),
                                                     "training.runtime": ("torchtune", "t")})
TUNE_CONFIGS = {**CONFIGS, "tp-sp-zero3-full": CONFIGS["tp-sp-zero3"].replace(remat="full")}
TUNE_EXPRESSES = {"zero3-full", "fraction", "hsdp-zero3"}


@pytest.mark.parametrize("name", sorted(TUNE_CONFIGS))
def test_torchtune_reads_back(name):
    """What torchtune's recipes run as capopt prices them (FSDP2 at ZeRO-2/3, HSDP, every n-th
    block checkpointed) comes back from the `tune run` line; DDP, ZeRO-1, pipelines,
    optimizer offload, selective recomputation, tensor parallelism (its plan is the model's)
    and context parallelism (refused with packed sequences) are refused naming the knob."""
    cfg = TUNE_CONFIGS[name]
    if name not in TUNE_EXPRESSES:
        with pytest.raises(CapoptError) as err:
            emit("torchtune", cfg, SC_TUNE)
        assert err.value.field == "--emit" and "\n" not in str(err.value)
        return
    got = read_torchtune(emit("torchtune", cfg, SC_TUNE))
    got.setdefault("vpp", 1)
    assert got == {**expected(cfg), "precision": "bf16"}


def test_a_recomputed_fraction_is_whole_blocks_per_stage():
    # 0.25 of 32 layers on 2 stages: round(0.25 * 16) = 4 blocks of each stage
    cfg = Config(micro_batch=1, grad_accum=64, dp=2, tp=2, pp=2, zero_stage=1,
                 sequence_parallel=True, remat=0.25)
    argv = megatron_argv(emit("megatron", cfg, SC))
    a = megatron_parser().parse_args(argv)
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == \
        ("full", "block", 4)
    # torchtitan checkpoints every n-th block: 32 // 4 = 8 of 32 is every 4th
    d = tomllib.loads(emit("torchtitan", CONFIGS["fraction"], SC))
    assert d["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "4"}
    # 0.4 of 32 is 13 blocks: no n gives 32 // n == 13
    with pytest.raises(CapoptError, match="config.remat"):
        emit("torchtitan", CONFIGS["fraction"].replace(remat=0.4), SC)
    # a fraction that rounds to every block is full, to none is none
    assert read_megatron(emit("megatron", CONFIGS["fraction"].replace(remat=0.99), SC)
                         )["remat"] == "full"
    assert read_megatron(emit("megatron", CONFIGS["fraction"].replace(remat=0.01), SC)
                         )["remat"] == "none"


def test_megatron_writes_expert_parallel_and_the_optimizer():
    sc = load_scenario("mixtral-8x7b-ep-32xh100")
    cfg = Config(micro_batch=1, grad_accum=16, dp=32, ep=8, zero_stage=1, remat="full")
    text = emit("megatron", cfg, sc)
    a = megatron_parser().parse_args(megatron_argv(text))
    assert a.expert_model_parallel_size == 8 and a.optimizer == "adam"
    assert "--nnodes 4" in text and "--nproc-per-node 8" in text
    # MaxText across 4 nodes: the data axis crosses them, experts split the batch inside
    d = maxtext_overrides(emit("maxtext", cfg, sc))
    assert (d["ici_expert_parallelism"], d["ici_data_parallelism"],
            d["dcn_data_parallelism"]) == ("8", "1", "4")


def test_megatron_file_turns_on_the_overlap_its_profile_prices():
    """Priced with the megatron profile, the launch file carries the overlap flags that
    profile assumes, where Megatron accepts them (arguments.py at d98e8a64: --overlap-param-
    gather only with --overlap-grad-reduce and the distributed optimizer or Megatron-FSDP,
    --tp-comm-overlap only with sequence parallelism); priced with another profile, none, and
    the header names the profile that prices Megatron's rules."""
    from capopt._runtime import get_profile
    mega = SC.replace(runtime=get_profile("megatron"))
    a = megatron_parser().parse_args(megatron_argv(emit("megatron", CONFIGS["tp-pp-sp"], mega)))
    assert a.overlap_grad_reduce and a.overlap_param_gather and a.tp_comm_overlap
    a = megatron_parser().parse_args(megatron_argv(emit("megatron", CONFIGS["dp-only"], mega)))
    assert a.overlap_grad_reduce and not a.overlap_param_gather and not a.tp_comm_overlap
    a = megatron_parser().parse_args(megatron_argv(emit("megatron", CONFIGS["tp-sp-zero3"],
                                                        mega)))
    assert a.use_megatron_fsdp and a.overlap_grad_reduce and a.overlap_param_gather
    for name in CONFIGS:
        if "megatron" in EXPRESSES[name]:
            a = megatron_parser().parse_args(megatron_argv(emit("megatron", CONFIGS[name], mega)))
            if a.overlap_param_gather:      # arguments.py:1024-1029
                assert a.overlap_grad_reduce
                assert a.use_distributed_optimizer or a.use_megatron_fsdp
            assert not a.tp_comm_overlap or a.sequence_parallel        # :1441-1442
    no_sp = CONFIGS["tp-pp-sp"].replace(sequence_parallel=False)
    assert not megatron_parser().parse_args(
        megatron_argv(emit("megatron", no_sp, mega))).tp_comm_overlap
    text = emit("megatron", CONFIGS["tp-pp-sp"], SC)
    a = megatron_parser().parse_args(megatron_argv(text))
    assert not (a.overlap_grad_reduce or a.overlap_param_gather or a.tp_comm_overlap)
    assert "--runtime megatron prices megatron's own rules" in text


@pytest.mark.parametrize("optimizer, hf, megatron", [
    ("adamw", "adamw_torch", ["adam"]), ("adam", "adamw_torch", ["adam"]),
    ("sgd", "sgd", ["sgd"]), ("sgd-momentum", "sgd", ["sgd"]),
    ("adafactor", "adafactor", None), ("lion", "lion_32bit", ["lion"]),
    ("adamw-8bit", "adamw_bnb_8bit", None)])
def test_optimizer_names(optimizer, hf, megatron):
    sc = SC.replace(workload=SC.workload.__class__(**{**SC.workload.__dict__,
                                                      "optimizer": optimizer}))
    cfg = CONFIGS["dp-only"]
    d = json.loads(emit("hf-trainer", cfg, sc))
    assert d["optim"] == hf
    if optimizer == "sgd-momentum":
        assert d["optim_args"] == "momentum=0.9"
    if megatron is None:
        with pytest.raises(CapoptError, match="training.optimizer"):
            emit("megatron", cfg, sc)
    else:
        a = megatron_parser().parse_args(megatron_argv(emit("megatron", cfg, sc)))
        assert [a.optimizer] == megatron
        if optimizer.startswith("sgd"):
            assert a.sgd_momentum == (0.9 if optimizer == "sgd-momentum" else 0.0)


def _with(sc, **workload):
    return sc.replace(workload=sc.workload.__class__(**{**sc.workload.__dict__, **workload}))


def test_precisions():
    cfg = CONFIGS["zero1"]
    fp16 = _with(SC, precision="fp16-mixed")
    assert json.loads(emit("deepspeed", cfg, fp16))["fp16"] == {"enabled": True}
    assert json.loads(emit("hf-trainer", cfg, fp16))["fp16"] is True
    assert "--fp16" in megatron_argv(emit("megatron", cfg, fp16))
    pure = _with(SC, precision="bf16")
    ds = json.loads(emit("deepspeed", cfg, pure))["bf16"]
    assert ds["bf16_master_weights_and_grads"] and ds["bf16_optimizer_states"]
    assert maxtext_overrides(emit("maxtext", cfg, pure))["weight_dtype"] == "bfloat16"
    t = tomllib.loads(emit("torchtitan", CONFIGS["zero3-full"], pure))["training"]
    assert t["dtype"] == "bfloat16"
    fp8 = _with(SC, precision="fp8-mixed")
    assert "hybrid" in megatron_argv(emit("megatron", cfg, fp8))
    assert maxtext_overrides(emit("maxtext", cfg, fp8))["quantization"] == "fp8"
    for fmt in ("deepspeed", "hf-trainer"):
        with pytest.raises(CapoptError, match="training.precision"):
            emit(fmt, cfg, fp8)
    with pytest.raises(CapoptError, match="training.precision"):
        emit("megatron", cfg, pure)


def test_no_clipping_is_written_as_such():
    sc = _with(SC, grad_clip=False)
    cfg = CONFIGS["zero1"]
    assert json.loads(emit("deepspeed", cfg, sc))["gradient_clipping"] == 0.0
    assert json.loads(emit("hf-trainer", cfg, sc))["max_grad_norm"] == 0.0
    assert megatron_parser().parse_args(megatron_argv(emit("megatron", cfg, sc))).clip_grad == 0
    with pytest.raises(CapoptError, match="training.grad_clip"):
        emit("torchtitan", CONFIGS["zero3-full"], sc)       # torchtitan always clips


def test_compile_is_written_where_the_format_switches_it_on_and_refused_elsewhere():
    """``training.compile``: torchtitan's [compile] (components "model", with "loss" when
    the loss is fused too: torchtitan 0.2.2 config/job_config.py Compile), the Trainer's
    torch_compile (TrainingArguments, TRL's SFTConfig) and Accelerate's dynamo_config; the
    other formats' files have no switch for it, and each refusal names the ones that do."""
    from capopt._runtime import get_profile
    sc = _with(SC.replace(runtime=get_profile("torchtitan")), compile=True)
    cfg = CONFIGS["zero3-full"]
    assert tomllib.loads(emit("torchtitan", cfg, sc))["compile"] == {
        "enable": True, "components": ["model"]}
    both = tomllib.loads(emit("torchtitan", cfg, _with(sc, loss="fused")))["compile"]
    assert both == {"enable": True, "components": ["model", "loss"]}
    for fmt in ("hf-trainer", "trl-sft"):
        assert yaml.safe_load(emit(fmt, cfg, sc))["torch_compile"] is True
        assert "torch_compile" not in yaml.safe_load(emit(fmt, cfg, _with(sc, compile=False)))
    assert yaml.safe_load(emit("accelerate", cfg, sc))["dynamo_config"] == {
        "dynamo_backend": "INDUCTOR"}
    for fmt in FORMATS:
        if fmt not in ("torchtitan", "hf-trainer", "trl-sft", "accelerate"):
            with pytest.raises(CapoptError) as err:
                emit(fmt, CONFIGS["dp-only"], sc)
            assert "training.compile" in str(err.value), fmt
            assert err.value.allowed == "torchtitan, accelerate, hf-trainer, trl-sft", fmt


def test_a_fused_loss_is_torchtitans_compiled_loss_or_mpts_and_refused_elsewhere():
    """``loss = "fused"`` is torchtitan's compiled loss ([compile] enable, components
    ["loss"]: torchtitan/components/loss.py at v0.2.2) and MPT's flash-attn cross-entropy
    (llm-foundry's loss_fn: fused_crossentropy, its default); no other format's file chooses
    the cross-entropy kernel, and each refusal names the two formats that express it. (A
    PyTorch runtime's scenario: the XLA step refuses the fused loss.)"""
    sc = _with(load_scenario("llama3-8b-8xh100",
                             values={"training.runtime": ("torchtitan", "t")}), loss="fused")
    cfg = CONFIGS["zero3-full"]
    t = tomllib.loads(emit("torchtitan", cfg, sc))
    assert t["compile"] == {"enable": True, "components": ["loss"]}
    assert "compile" not in tomllib.loads(emit("torchtitan", cfg, SC))
    assert yaml.safe_load(emit("llm-foundry", cfg, sc))["model"]["loss_fn"] == \
        "fused_crossentropy"
    assert yaml.safe_load(emit("llm-foundry", cfg, SC))["model"]["loss_fn"] == \
        "torch_crossentropy"
    for fmt in FORMATS:
        if fmt not in ("torchtitan", "llm-foundry"):
            with pytest.raises(CapoptError) as err:
                emit(fmt, cfg, sc)
            assert "training.loss" in str(err.value)
            assert err.value.allowed == "torchtitan, llm-foundry"


def test_a_chunked_loss_is_torchtunes_and_refused_by_every_other_format():
    """``loss = "chunked"`` is torchtune's LinearCrossEntropyLoss: every other format refuses
    it by name and offers torchtune, which writes it (in one dtype: a bf16 scenario)."""
    sc = _with(load_scenario("llama3-8b-8xh100",
                             values={"training.runtime": ("pytorch-eager", "t"),
                                     "training.precision": ("bf16", "t")}),
               loss="chunked")
    for fmt in FORMATS:
        if fmt == "torchtune":
            continue
        with pytest.raises(CapoptError) as err:
            emit(fmt, CONFIGS["zero3-full"], sc)
        assert "training.loss" in str(err.value) and "torchtune" in str(err.value)
        assert err.value.allowed == "torchtune"
    assert torchtune_command(emit("torchtune", CONFIGS["zero3-full"], sc))[1][
        "loss._component_"] == "torchtune.modules.loss.LinearCrossEntropyLoss"


def test_llm_foundry_files_say_what_composer_cannot_do():
    """Composer's FSDP has ZeRO-2 (SHARD_GRAD_OP) and ZeRO-3 (FULL_SHARD) and recomputes
    every block or none; DDP (no fsdp_config) checkpoints nothing; fp8 is Transformer
    Engine's linear layers; materialised attention is MPT's attn_impl torch."""
    d = yaml.safe_load(emit("llm-foundry", CONFIGS["zero3-full"].replace(zero_stage=2), SC))
    assert d["fsdp_config"]["sharding_strategy"] == "SHARD_GRAD_OP"
    with pytest.raises(CapoptError, match="config.remat"):
        emit("llm-foundry", CONFIGS["zero3-full"].replace(zero_stage=0), SC)
    fp8 = yaml.safe_load(emit("llm-foundry", CONFIGS["dp-only"], _with(SC, precision="fp8-mixed")))
    assert (fp8["precision"], fp8["model"]["fc_type"]) == ("amp_fp8", "te")
    eager = yaml.safe_load(emit("llm-foundry", CONFIGS["dp-only"].replace(flash_attention=False),
                                SC))
    assert eager["model"]["attn_config"]["attn_impl"] == "torch"
    with pytest.raises(CapoptError, match="training.optimizer"):
        emit("llm-foundry", CONFIGS["dp-only"], _with(SC, optimizer="sgd"))


def test_a_torchtitan_file_priced_by_another_profile_says_so():
    from capopt._runtime import get_profile
    cfg = CONFIGS["zero3-full"]
    assert SC.runtime.name != "torchtitan"
    assert "--runtime torchtitan" in emit("torchtitan", cfg, SC)
    own = SC.replace(runtime=get_profile("torchtitan"))
    assert "--runtime" not in emit("torchtitan", cfg, own)


# (torchtune writes LoRA too: its test is in tests/test_torchtune.py; this scenario is in
# mixed precision, which it refuses first)
@pytest.mark.parametrize("fmt", [f for f in FORMATS if f not in ("trl-sft", "torchtune")])
def test_lora_is_refused_naming_the_knob(fmt):
    sc = load_scenario("qlora-llama2-7b-24gb")
    assert sc.workload.lora == LoRA(rank=64, targets=("attn", "mlp"), base_bits=4)
    with pytest.raises(CapoptError) as err:
        emit(fmt, Config(micro_batch=4, grad_accum=4, remat="full"), sc)
    msg = str(err.value)
    assert "training.lora" in msg and "\n" not in msg and msg.startswith("--emit: ")
    assert err.value.allowed == "trl-sft"


@pytest.mark.parametrize("targets, modules", [
    (("attn", "mlp"), "all-linear"), (("q", "v"), ["q_proj", "v_proj"]),
    (("mlp",), ["gate_proj", "up_proj", "down_proj"])])
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_trl_writes_lora_and_the_quantised_base(targets, modules, bits):
    """TRL's ModelConfig carries what capopt priced: the adapters' rank and modules (every
    block matmul is PEFT's "all-linear"), no adapter dropout (PEFT would keep a dropped copy
    of each wrapped input), the base in NF4 with its scales quantised again (NF4's bytes as
    capopt counts them) or 8-bit, the model in the compute dtype."""
    import dataclasses
    sc = load_scenario("qlora-llama2-7b-24gb")
    sc = sc.replace(workload=dataclasses.replace(
        sc.workload, lora=LoRA(rank=64, targets=targets, base_bits=bits)))
    d = yaml.safe_load(emit("trl-sft", Config(micro_batch=4, grad_accum=4, remat="full"), sc))
    assert d["use_peft"] is True and d["lora_r"] == 64 and d["lora_dropout"] == 0.0
    assert d["lora_target_modules"] == modules
    assert d.get("load_in_4bit", False) == (bits == 4)
    assert d.get("load_in_8bit", False) == (bits == 8)
    assert d.get("bnb_4bit_quant_type") == ("nf4" if bits == 4 else None)
    assert d["dtype"] == "bfloat16" and d["bf16"] is True
    assert d["activation_checkpointing"] is True and d["per_device_train_batch_size"] == 4


def test_trl_writes_the_adapter_dropout_priced():
    """``training.lora.dropout`` is TRL's lora_dropout (ModelConfig; TRL's own default is
    0.05, so capopt's 0 is written out too)."""
    import dataclasses
    sc = load_scenario("qlora-llama2-7b-24gb")
    cfg = Config(micro_batch=4, grad_accum=4, remat="full")
    for p in (0.0, 0.05):
        lora = dataclasses.replace(sc.workload.lora, dropout=p)
        d = yaml.safe_load(emit("trl-sft", cfg, sc.replace(
            workload=dataclasses.replace(sc.workload, lora=lora))))
        assert d["lora_dropout"] == p


def test_trl_refuses_lora_it_cannot_name_or_shard():
    from capopt._cards import load_card
    sc = load_scenario("qlora-llama2-7b-24gb")
    with pytest.raises(CapoptError, match="config.zero_stage"):
        emit("trl-sft", Config(micro_batch=1, grad_accum=2, dp=8, zero_stage=3),
             sc.replace(count=8))
    with pytest.raises(CapoptError, match="model.family"):
        emit("trl-sft", Config(micro_batch=1, grad_accum=16),
             sc.replace(model=load_card("bert-base")))
    moe = sc.replace(model=load_card("mixtral-8x7b"))
    with pytest.raises(CapoptError, match="training.lora"):
        emit("trl-sft", Config(micro_batch=1, grad_accum=16), moe)


def test_a_refusal_names_the_formats_that_express_the_config():
    with pytest.raises(CapoptError) as err:
        emit("deepspeed", CONFIGS["tp-pp-sp"], SC)
    assert "config.sequence_parallel = true" in str(err.value)
    assert err.value.allowed == "megatron"
    with pytest.raises(CapoptError) as err:
        emit("deepspeed", CONFIGS["zero3-full"], SC)
    assert "config.remat = 'full'" in str(err.value)
    assert err.value.allowed == ("megatron, torchtitan, accelerate, hf-trainer, trl-sft, "
                                 "maxtext, llm-foundry")


def test_unknown_format_and_flash_off():
    with pytest.raises(CapoptError) as err:
        emit("jax", CONFIGS["dp-only"], SC)
    assert err.value.allowed == ", ".join(FORMATS)
    eager = CONFIGS["dp-only"].replace(flash_attention=False)
    for fmt in ("deepspeed", "torchtitan", "accelerate", "hf-trainer"):
        with pytest.raises(CapoptError, match="config.flash_attention"):
            emit(fmt, eager, SC)
    assert "--attention-backend unfused" in emit("megatron", eager, SC)
    assert maxtext_overrides(emit("maxtext", eager, SC))["attention"] == "dot_product"


# --------------------------------------------------------------------------------------------
# The frameworks' own config classes, where they are installed
# --------------------------------------------------------------------------------------------
def _installed(*names):
    return all(importlib.util.find_spec(n) is not None for n in names)


@pytest.mark.skipif(not _installed("transformers", "accelerate"),
                    reason="transformers and accelerate are not installed")
def test_the_trainer_and_accelerate_take_the_compile_switch(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig
    from transformers import HfArgumentParser, TrainingArguments
    from capopt._runtime import get_profile
    sc = _with(SC.replace(runtime=get_profile("torchtitan")), compile=True)
    d = json.loads(emit("hf-trainer", CONFIGS["dp-only"], sc))
    d["use_cpu"] = True                 # no GPU here: bf16 is refused without it
    (tmp_path / "args.json").write_text(json.dumps(d))
    (args,) = HfArgumentParser(TrainingArguments).parse_json_file(tmp_path / "args.json")
    assert args.torch_compile is True
    (tmp_path / "acc.yaml").write_text(emit("accelerate", CONFIGS["dp-only"], sc))
    acc = ClusterConfig.from_yaml_file(tmp_path / "acc.yaml")
    assert acc.dynamo_config == {"dynamo_backend": "INDUCTOR"}


HF_CASES = ["dp-only", "zero3-full", "zero1", "offload", "fraction"]


@pytest.mark.skipif(not _installed("transformers", "accelerate"),
                    reason="transformers and accelerate are not installed")
@pytest.mark.parametrize("name", HF_CASES)
def test_training_arguments_take_the_file(name, tmp_path):
    from transformers import HfArgumentParser, TrainingArguments
    cfg = CONFIGS[name]
    d = json.loads(emit("hf-trainer", cfg, SC))
    if "deepspeed" in d and not _installed("deepspeed"):
        pytest.skip("deepspeed is not installed")
    path = tmp_path / "args.json"
    # this machine has no GPU: TrainingArguments refuses bf16 there unless told use_cpu
    d["use_cpu"] = True
    path.write_text(json.dumps(d))
    (args,) = HfArgumentParser(TrainingArguments).parse_json_file(path)
    assert args.per_device_train_batch_size == cfg.micro_batch
    assert args.gradient_accumulation_steps == cfg.grad_accum
    assert args.activation_checkpointing == (cfg.remat != "none")
    assert args.optim.value == "adamw_torch" and args.bf16


@pytest.mark.skipif(not _installed("trl", "peft"), reason="trl and peft are not installed")
@pytest.mark.parametrize("targets", [("q", "v"), ("attn", "mlp")], ids="+".join)
def test_trl_parser_takes_the_file_and_builds_the_lora_priced(targets, tmp_path):
    """`trl sft --config FILE` parses the file with TrlParser into SFTConfig and ModelConfig;
    TRL's own get_peft_config / get_quantization_config then build PEFT's LoraConfig and the
    BitsAndBytesConfig capopt priced: its modules, no dropout, NF4 with nested scales."""
    import dataclasses

    from trl import ModelConfig, SFTConfig, TrlParser
    from trl.trainer.utils import get_peft_config, get_quantization_config
    sc = load_scenario("qlora-llama2-7b-24gb")
    sc = sc.replace(workload=dataclasses.replace(
        sc.workload, lora=LoRA(rank=16, targets=targets, base_bits=4)))
    cfg = Config(micro_batch=4, grad_accum=4, remat="full")
    d = yaml.safe_load(emit("trl-sft", cfg, sc))
    d["use_cpu"] = True              # no GPU here: TrainingArguments refuses bf16 otherwise
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(d))
    args, model_args = TrlParser((SFTConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(path), "--output_dir", str(tmp_path / "out")])
    assert args.per_device_train_batch_size == 4 and args.gradient_accumulation_steps == 4
    assert args.max_length == sc.seq_len and args.packing and args.bf16
    lora = get_peft_config(model_args)
    assert lora.r == 16 and lora.lora_dropout == 0.0
    want = {"q_proj", "v_proj"} if targets == ("q", "v") else "all-linear"
    got = lora.target_modules
    assert (set(got) if isinstance(got, (set, list, tuple)) else got) == want
    quant = get_quantization_config(model_args)
    assert quant.load_in_4bit and quant.bnb_4bit_quant_type == "nf4"
    assert quant.bnb_4bit_use_double_quant


def test_trl_file_turns_double_quantisation_off_as_priced(tmp_path):
    """``training.lora.double_quant = false``: TRL's use_bnb_nested_quant false, so
    BitsAndBytesConfig keeps a float32 absmax per block (bnb_4bit_use_double_quant off)."""
    import dataclasses

    from trl import ModelConfig, SFTConfig, TrlParser
    from trl.trainer.utils import get_quantization_config
    sc = load_scenario("qlora-llama2-7b-24gb")
    sc = sc.replace(workload=dataclasses.replace(
        sc.workload, lora=dataclasses.replace(sc.workload.lora, double_quant=False)))
    d = yaml.safe_load(emit("trl-sft", Config(micro_batch=4, grad_accum=4, remat="full"), sc))
    assert d["use_bnb_nested_quant"] is False
    d["use_cpu"] = True
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(d))
    _, model_args = TrlParser((SFTConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(path), "--output_dir", str(tmp_path / "out")])
    quant = get_quantization_config(model_args)
    assert quant.load_in_4bit and not quant.bnb_4bit_use_double_quant


@pytest.mark.skipif(not _installed("accelerate"), reason="accelerate is not installed")
@pytest.mark.parametrize("name", ["dp-only", "zero3-full", "zero1", "offload"])
def test_accelerate_loads_the_file(name, tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig
    path = tmp_path / "accelerate.yaml"
    path.write_text(emit("accelerate", CONFIGS[name], SC))
    loaded = ClusterConfig.from_yaml_file(path)
    assert loaded.num_processes == 8
    assert str(loaded.distributed_type).split(".")[-1] == \
        yaml.safe_load(path.read_text())["distributed_type"]


@pytest.mark.skipif(not _installed("deepspeed"), reason="deepspeed is not installed")
@pytest.mark.parametrize("name", ["dp-only", "zero1", "offload", "tp-zero1"])
def test_deepspeed_config_takes_the_file(name, monkeypatch):
    from deepspeed.runtime.config import DeepSpeedConfig
    cfg = CONFIGS[name]
    class DataParallel:          # stands in for an initialised process group of dp ranks
        def get_data_parallel_world_size(self):
            return cfg.dp

        def get_sequence_parallel_world_size(self):
            return 1

    import deepspeed.runtime.config as ds_config
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    ds = DeepSpeedConfig(json.loads(emit("deepspeed", cfg, SC)), mpu=DataParallel())
    assert ds.train_micro_batch_size_per_gpu == cfg.micro_batch
    assert ds.gradient_accumulation_steps == cfg.grad_accum
    assert ds.zero_optimization_stage == cfg.zero_stage
    assert ds.gradient_clipping == 1.0 and ds.bfloat16_config.enabled
    assert ds.tensor_parallel_config.autotp_size == (cfg.tp if cfg.tp > 1 else 0)


# --- the command line ----------------------------------------------------------------------
PINS = ["--set", "micro_batch=1", "--set", "zero_stage=3", "--set", "remat=full"]


def test_emit_writes_the_launch_file_to_stdout_in_place_of_the_table(capsys):
    from capopt.cli import main
    assert main(["plan", "llama3-8b-8xh100", *PINS, "--emit", "torchtitan"]) == 0
    out = capsys.readouterr().out
    t = tomllib.loads(out)                          # the whole of stdout is the TOML file
    assert t["parallelism"]["data_parallel_shard_degree"] == 8
    assert t["activation_checkpoint"]["mode"] == "full"


def test_emit_out_writes_the_file_and_prints_the_table(tmp_path, capsys):
    from capopt.cli import main
    f = tmp_path / "ds.json"
    assert main(["plan", "llama3-8b-8xh100", *PINS, "--set", "remat=none", "--emit",
                 "deepspeed", "--out", str(f)]) == 0
    out, err = capsys.readouterr()
    assert "per device" in out and f"wrote {f}" in err
    d = json.loads(f.read_text())
    assert d["zero_optimization"]["stage"] == 3 and d["train_micro_batch_size_per_gpu"] == 1


def test_emit_refusal_is_one_line_exit_2(capsys):
    from capopt.cli import main
    code = main(["plan", "llama3-8b-8xh100", *PINS, "--set", "tp=2", "--emit", "deepspeed"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--emit" in err and "config.remat" in err and "megatron" in err


# torchtitan 0.2.2 is the last release that reads a TOML job file (0.3.0 builds its config in
# Python); its package __init__ imports the triton kernels of its MoE, which a CPU torch lacks,
# so the config modules are loaded under a bare package, as `torchtitan.config` alone needs.
@pytest.fixture
def torchtitan_config_manager(monkeypatch):
    import sys
    import types
    if not _installed("torchtitan", "tyro"):
        pytest.skip("torchtitan is not installed")
    spec = importlib.util.find_spec("torchtitan")
    bare = types.ModuleType("torchtitan")
    bare.__path__ = list(spec.submodule_search_locations)
    for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchtitan", bare)
    from torchtitan.config.manager import ConfigManager
    return ConfigManager


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if "torchtitan" in EXPRESSES[n]))
def test_torchtitan_config_manager_takes_the_file(name, tmp_path, torchtitan_config_manager):
    """torchtitan's own `ConfigManager.parse_args(["--job.config_file", ...])` builds its
    `JobConfig` from the file (an unknown key there is a ValueError), and the knobs it holds
    are the config's."""
    cfg = CONFIGS[name]
    path = tmp_path / "job.toml"
    path.write_text(emit("torchtitan", cfg, SC))
    job = torchtitan_config_manager().parse_args([f"--job.config_file={path}"])
    par, tr, ac = job.parallelism, job.training, job.activation_checkpoint
    assert (par.data_parallel_replicate_degree * par.data_parallel_shard_degree
            * par.context_parallel_degree) == cfg.dp
    assert par.context_parallel_degree == cfg.cp
    assert (par.data_parallel_shard_degree * par.context_parallel_degree > 1) == \
        (cfg.zero_stage >= 2)
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (cfg.tp, cfg.pp)
    # interleaved: torchtitan 0.2.2's pipeline_llm makes ceil((L + first_less + last_less) /
    # layers_per_stage) stages, pp x vpp of them
    if cfg.vpp > 1:
        assert par.pipeline_parallel_schedule == "Interleaved1F1B"
        stages = -(-(LAYERS + par.pipeline_parallel_first_stage_less_layers
                     + par.pipeline_parallel_last_stage_less_layers)
                   // par.pipeline_parallel_layers_per_stage)
        assert stages == cfg.pp * cfg.vpp
    else:
        assert par.pipeline_parallel_schedule == "1F1B"
    # with pp the local batch is one step's pipeline micro-batches together
    assert tr.local_batch_size == cfg.micro_batch * (cfg.grad_accum if cfg.pp > 1 else 1)
    assert tr.global_batch_size == cfg.micro_batch * cfg.grad_accum * cfg.replicas
    assert tr.seq_len == SC.workload.seq_len and tr.max_norm == 1.0
    assert (tr.mixed_precision_param, tr.dtype) == ("bfloat16", "float32")
    want = {"none": "none", "full": "full", "selective": "selective"}.get(cfg.remat, "selective")
    assert ac.mode == want
    if isinstance(cfg.remat, float):        # every n-th block: n = 1 / fraction
        assert int(ac.selective_ac_option) == round(1 / cfg.remat)


def test_torchtitan_config_manager_refuses_a_key_it_does_not_have(tmp_path,
                                                                   torchtitan_config_manager):
    """The check above can fail: a key torchtitan lacks is refused by its own loader."""
    path = tmp_path / "job.toml"
    path.write_text(emit("torchtitan", CONFIGS["zero3-full"], SC).replace(
        "[parallelism]\n", "[parallelism]\nfsdp_degree = 8\n"))
    with pytest.raises(ValueError, match="fsdp_degree"):
        torchtitan_config_manager().parse_args([f"--job.config_file={path}"])


# Megatron-LM's argument parser (megatron/training/arguments.py) is not on PyPI; megatron-core
# is, and Megatron-LM builds megatron-core's config dataclasses from the parsed arguments by
# field name (`core_transformer_config_from_args`, the DDP and optimizer configs in training.py):
# every flag capopt writes must be one of their fields or one of the three the training loop
# reads itself, and megatron-core's own checks must pass on the values.
MEGATRON_LOOP_ARGS = {"micro_batch_size", "global_batch_size", "seq_length"}
# flags Megatron-LM's validate_args turns into a megatron-core field (arguments.py: the virtual
# pipeline size is --num-virtual-stages-per-pipeline-rank, None where it is 1)
MEGATRON_DERIVED = {"num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size"}


def _megatron_core():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # "Transformer Engine and Apex are not installed"
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.enums import AttnBackend
        from megatron.core.transformer.transformer_config import TransformerConfig
    return (TransformerConfig, DistributedDataParallelConfig, OptimizerConfig,
            ConstantNumMicroBatchesCalculator, AttnBackend)


def _megatron_configs(text: str, devices: int = 8):
    import dataclasses

    import torch
    TC, DDP, OPT, Micro, AttnBackend = _megatron_core()
    argv = megatron_argv(text)
    written = {a[2:].replace("-", "_") for a in argv if a.startswith("--")}
    names = {c: {f.name for f in dataclasses.fields(c)} for c in (TC, DDP, OPT)}
    unknown = written - MEGATRON_LOOP_ARGS - set(MEGATRON_DERIVED) - set().union(*names.values())
    assert not unknown, f"flags megatron-core has no field for: {sorted(unknown)}"
    a = vars(megatron_parser().parse_args(argv))
    for flag, core in MEGATRON_DERIVED.items():
        if flag in written:
            a[core] = a[flag] if a[flag] != 1 else None
            written = (written - {flag}) | {core}
    a["attention_backend"] = AttnBackend[a["attention_backend"]]
    pick = lambda c: {k: a[k] for k in written & names[c]}          # noqa: E731
    m = SC.model
    # params_dtype from --bf16/--fp16 (arguments.py:1194-1206 at d98e8a64) and pipeline_dtype
    # set to it (argument_utils.py:306), as Megatron-LM does before building the config
    dtype = torch.bfloat16 if a["bf16"] else torch.half if a["fp16"] else torch.float
    tc = TC(num_layers=m.num_hidden_layers, hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads, params_dtype=dtype,
            pipeline_dtype=dtype, **pick(TC))
    ddp, opt = DDP(**pick(DDP)), OPT(**pick(OPT))
    dp = devices // (tc.tensor_model_parallel_size * tc.pipeline_model_parallel_size
                     * tc.context_parallel_size)
    micro = Micro(a["global_batch_size"], a["micro_batch_size"], dp, False, rank=1)
    return tc, ddp, opt, micro, dp


@pytest.mark.skipif(not _installed("megatron.core"), reason="megatron-core is not installed")
@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if "megatron" in EXPRESSES[n]))
def test_megatron_core_configs_take_the_flags(name):
    cfg = CONFIGS[name]
    tc, ddp, opt, micro, dp = _megatron_configs(emit("megatron", cfg, SC))
    # (Megatron's data-parallel size leaves the context-parallel ranks out)
    assert (dp * tc.context_parallel_size, tc.tensor_model_parallel_size,
            tc.pipeline_model_parallel_size, tc.context_parallel_size) == \
        (cfg.dp, cfg.tp, cfg.pp, cfg.cp)
    assert (tc.virtual_pipeline_model_parallel_size or 1) == cfg.vpp
    assert tc.sequence_parallel == cfg.sequence_parallel
    assert (micro.micro_batch_size, micro.get()) == (cfg.micro_batch, cfg.grad_accum)
    zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
    stage = (zero[ddp.data_parallel_sharding_strategy] if ddp.use_megatron_fsdp
             else 1 if ddp.use_distributed_optimizer else 0)
    assert stage == cfg.zero_stage
    assert opt.optimizer_cpu_offload == cfg.offload_optimizer
    assert opt.clip_grad == 1.0 and opt.optimizer == "adam" and tc.bf16
    assert _remat(cfg) == ("none" if tc.recompute_granularity is None
                           else "selective" if tc.recompute_granularity == "selective"
                           else "full" if tc.recompute_method == "uniform"
                           else ("blocks", tc.recompute_num_layers))


@pytest.mark.skipif(not _installed("megatron.core"), reason="megatron-core is not installed")
def test_megatron_core_refuses_a_flag_or_a_batch_it_cannot_take():
    """The checks above can fail: a misspelt flag has no field, and a global batch that is not
    a multiple of micro-batch x dp is refused by megatron-core's own calculator."""
    text = emit("megatron", CONFIGS["zero1"], SC)
    with pytest.raises(AssertionError, match="sequence_paralel"):
        _megatron_configs(text.replace("--use-distributed-optimizer",
                                       "--use-distributed-optimizer --sequence-paralel"))
    with pytest.raises(AssertionError, match="not divisible"):
        _megatron_configs(text.replace("--global-batch-size 256", "--global-batch-size 250"))


# MaxText needs Python >= 3.12, so its pydantic `types.py` cannot load the file here. What it
# does with an override: `key=value` must name a key of configs/base.yml, with a value its
# readers take. The keys and values below were read from the maxtext 0.2.5 wheel
# (maxtext/configs/base.yml, line of each key; remat policies from layers/nnx_decoders.py
# get_remat_policy, attention kernels from base.yml:486, optimizers from base.yml:1100).
MAXTEXT_BASE_KEYS = {
    "dtype": 128, "quantization": 137, "weight_dtype": 194, "num_layers_per_pipeline_stage": 409,
    "num_pipeline_microbatches": 419, "remat_policy": 450, "optimizer_memory_host_offload": 478,
    "attention": 486, "shard_optimizer_over_data": 799, "opt_type": 1100,
    "adam_weight_decay": 1121, "per_device_batch_size": 840, "gradient_accumulation_steps": 1098,
    "max_target_length": 1004, "gradient_clipping_threshold": 1094,
    "dcn_data_parallelism": 769, "dcn_fsdp_parallelism": 770, "dcn_tensor_parallelism": 776,
    "dcn_pipeline_parallelism": 778, "dcn_expert_parallelism": 779, "ici_data_parallelism": 782,
    "ici_fsdp_parallelism": 783, "ici_tensor_parallelism": 789, "ici_pipeline_parallelism": 792,
    "ici_expert_parallelism": 793}
MAXTEXT_VALUES = {"remat_policy": {"full", "minimal", "minimal_with_context"},
                  "attention": {"autoselected", "dot_product", "flash", "cudnn_flash_te"},
                  "opt_type": {"adamw", "adam_pax", "sgd", "muon"},
                  "quantization": {"", "fp8", "int8"},
                  "dtype": {"float32", "bfloat16"}, "weight_dtype": {"float32", "bfloat16"}}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16", "fp8-mixed", "fp32"])
@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if "maxtext" in EXPRESSES[n]))
def test_maxtext_overrides_are_base_yml_keys(name, precision):
    d = maxtext_overrides(emit("maxtext", CONFIGS[name], _with(SC, precision=precision)))
    assert set(d) <= set(MAXTEXT_BASE_KEYS), sorted(set(d) - set(MAXTEXT_BASE_KEYS))
    for key, allowed in MAXTEXT_VALUES.items():
        assert d.get(key, "") in allowed | {""}, (key, d.get(key))


@pytest.mark.skipif(not _installed("transformers", "accelerate"),
                    reason="transformers / accelerate are not installed")
def test_a_fused_linear_loss_is_ligers_kernel_alone_in_the_trainers_files():
    """``loss = "fused-linear"`` is Liger's fused linear cross-entropy: the Trainer's and TRL's
    files switch Liger on (TrainingArguments.use_liger_kernel, transformers 5.25) with
    liger_kernel_config naming that kernel alone (apply_liger_kernel_to_llama's arguments at
    Liger ead96b6: its RMSNorm, RoPE and SwiGLU kernels change activations capopt prices as
    the model's own); TrainingArguments takes both fields; every other format refuses it,
    naming the two."""
    from transformers import TrainingArguments

    from capopt._runtime import get_profile
    hf = SC.replace(runtime=get_profile("hf"))
    sc = _with(hf, loss="fused-linear")
    cfg = CONFIGS["zero3-full"]
    flce = {"fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False,
            "rms_norm": False, "swiglu": False}
    for fmt in ("hf-trainer", "trl-sft"):
        d = yaml.safe_load(emit(fmt, cfg, sc))
        assert d["use_liger_kernel"] is True and d["liger_kernel_config"] == flce, fmt
        assert "use_liger_kernel" not in yaml.safe_load(emit(fmt, cfg, hf)), fmt
    d = json.loads(emit("hf-trainer", cfg, sc))
    fields = {k: d[k] for k in ("use_liger_kernel", "liger_kernel_config")}
    args = TrainingArguments(output_dir="/tmp/capopt-test-args", **fields)
    assert args.use_liger_kernel is True and args.liger_kernel_config == flce
    for fmt in FORMATS:
        if fmt not in ("hf-trainer", "trl-sft"):
            with pytest.raises(CapoptError) as err:
                emit(fmt, CONFIGS["dp-only"], sc)
            assert "training.loss" in str(err.value), fmt
            assert err.value.allowed == "hf-trainer, trl-sft", fmt


@pytest.mark.skipif(not _installed("trl", "peft"), reason="trl and peft are not installed")
def test_activation_offloading_is_trls_and_refused_elsewhere():
    """``training.activation_offload`` is TRL's SFTConfig.activation_offloading (trl 1.16:
    OffloadActivations over each training step); SFTConfig takes the field; the other
    formats' files have no such switch and refuse it, naming trl-sft."""
    import dataclasses

    from trl import SFTConfig

    from capopt._runtime import get_profile
    sc = SC.replace(runtime=get_profile("hf"))
    sc = sc.replace(workload=dataclasses.replace(sc.workload, activation_offload=True))
    cfg = CONFIGS["dp-only"]
    d = yaml.safe_load(emit("trl-sft", cfg, sc))
    assert d["activation_offloading"] is True
    # (SFTConfig defaults to bf16, which it refuses on a machine without a GPU)
    assert SFTConfig(output_dir="/tmp/capopt-test-sft", activation_offloading=True,
                     bf16=False).activation_offloading is True
    plain = sc.replace(workload=dataclasses.replace(sc.workload, activation_offload=False))
    assert "activation_offloading" not in yaml.safe_load(emit("trl-sft", cfg, plain))
    for fmt in FORMATS:
        if fmt != "trl-sft":
            with pytest.raises(CapoptError) as err:
                emit(fmt, cfg, sc)
            assert "training.activation_offload" in str(err.value), fmt
            assert err.value.allowed == "trl-sft", fmt
