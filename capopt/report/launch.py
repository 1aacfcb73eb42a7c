"""Launch configs: one `Config` written in a training framework's own form.

    >>> from capopt._scenario import load_scenario
    >>> from capopt._specs import Config
    >>> sc = load_scenario("llama3-8b-8xh100")
    >>> cfg = Config(micro_batch=1, grad_accum=32, dp=8, zero_stage=3, remat="full")
    >>> print(emit("hf-trainer", cfg, sc))                              # doctest: +SKIP

`emit(fmt, config, scenario)` returns the text of the file; `SUFFIX[fmt]` is its usual suffix.
Every knob goes into a key the framework reads. Where the framework takes a knob in the training
script rather than in this file (Accelerate's batch size, accumulation and clipping), the file
says so in a comment naming the call. A knob the format cannot carry raises `CapoptError` naming
the knob and the formats that can carry this config; nothing is dropped in silence.

What is common to the PyTorch formats (deepspeed, accelerate, hf-trainer, torchtitan): the
attention kernel is the model's, and PyTorch's scaled-dot-product attention picks a fused
(flash or memory-efficient) kernel by default, so ``flash_attention = true`` needs no key and
``false`` (materialised scores) is refused. LoRA adapters live in the model (peft): only
trl-sft's file (TRL's ModelConfig: use_peft, lora_target_modules, load_in_4bit) carries
``training.lora``.
"""

from __future__ import annotations

import json
from typing import Callable

from .._errors import CapoptError
from .._specs import Config, Scenario, remat_weights

FORMATS: tuple[str, ...] = ("deepspeed", "megatron", "torchtitan", "accelerate", "hf-trainer",
                            "trl-sft", "maxtext", "llm-foundry", "torchtune")
SUFFIX: dict[str, str] = {"deepspeed": ".json", "megatron": ".sh", "torchtitan": ".toml",
                          "accelerate": ".yaml", "hf-trainer": ".json", "trl-sft": ".yaml",
                          "maxtext": ".txt", "llm-foundry": ".yaml", "torchtune": ".sh"}


class _Unexpressible(Exception):
    """A knob this format has no setting for (turned into a `CapoptError` by `emit`)."""

    def __init__(self, knob: str, value, why: str):
        self.knob, self.value, self.why = knob, value, why
        super().__init__(f"{knob} = {value!r}: {why}")


def emit(fmt: str, config: Config, scenario: Scenario) -> str:
    """The text of ``config`` as a launch file for ``fmt`` (one of `FORMATS`).

    Raises `CapoptError` (field ``--emit``) for an unknown format, and for a knob the format
    cannot express: the message names the knob, and ``allowed`` the formats that express this
    whole config."""
    if fmt not in _EMITTERS:
        raise CapoptError(f"unknown launch format {fmt!r}", field="--emit",
                          allowed=", ".join(FORMATS))
    try:
        return _run(fmt, config, scenario)
    except _Unexpressible as err:
        others = [f for f in FORMATS if f != fmt and expresses(f, config, scenario)]
        tail = "" if others else "; no launch format here expresses this config"
        raise CapoptError(f"{fmt} cannot express {err.knob} = {_show(err.value)}: "
                          f"{err.why}{tail}", field="--emit",
                          allowed=", ".join(others) or None) from None


def expresses(fmt: str, config: Config, scenario: Scenario) -> bool:
    """Whether ``fmt`` writes ``config`` whole (`emit` would not refuse it)."""
    try:
        _run(fmt, config, scenario)
    except _Unexpressible:
        return False
    return True


# the formats whose file chooses a fused cross-entropy as capopt prices it (``loss = "fused"``:
# compute-dtype logits and their gradient, no float32 copies)
_FUSED_LOSS = ("torchtitan", "llm-foundry")


# the formats whose file applies Liger's fused linear cross-entropy alone (``loss =
# "fused-linear"``: TrainingArguments' use_liger_kernel with liger_kernel_config, whose keys
# are apply_liger_kernel_to_llama's arguments; transformers 5.25, Liger ead96b6)
_FUSED_LINEAR_LOSS = ("hf-trainer", "trl-sft")
_LIGER_FLCE_ONLY = {"fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False,
                    "rms_norm": False, "swiglu": False}


# the formats whose file switches torch.compile on for the model (``training.compile``)
_COMPILE = ("torchtitan", "accelerate", "hf-trainer", "trl-sft")


def _run(fmt: str, config: Config, scenario: Scenario) -> str:
    if scenario.workload.compile and fmt not in _COMPILE:
        raise _Unexpressible("training.compile", True, "capopt writes torch.compile into "
                             "torchtitan's file ([compile] enable), Accelerate's "
                             "(dynamo_config) and the Trainer's (torch_compile) only "
                             "(torchtune's compiles the loss too, which capopt prices eager)")
    if scenario.workload.loss == "fused" and fmt not in _FUSED_LOSS:
        raise _Unexpressible("training.loss", "fused", f"capopt writes its fused loss (a "
                             "cross-entropy on the compute-dtype logits) into torchtitan's "
                             "file ([compile] components = [\"loss\"]) and llm-foundry's "
                             "(loss_fn: fused_crossentropy) only; "
                             f"{fmt}'s own fused losses keep other buffers, not priced here")
    if scenario.workload.loss == "fused-linear" and fmt not in _FUSED_LINEAR_LOSS:
        raise _Unexpressible("training.loss", "fused-linear", "capopt writes Liger's fused "
                             "linear cross-entropy into the Trainer's file (use_liger_kernel) "
                             f"and TRL's only; {fmt} has no such loss")
    if scenario.workload.loss == "chunked" and fmt != "torchtune":
        raise _Unexpressible("training.loss", "chunked", "the chunked loss is torchtune's "
                             "(loss: torchtune.modules.loss.LinearCrossEntropyLoss in a "
                             "recipe's config): --emit torchtune writes it")
    if scenario.workload.activation_offload and fmt != "trl-sft":
        raise _Unexpressible("training.activation_offload", True, "capopt writes activation "
                             "offloading into TRL's file (activation_offloading) only (not "
                             "torchtune's: its offload context covers the forward pass, not "
                             "the chunked loss, which capopt does not price)")
    if scenario.workload.paged_optimizer and fmt not in ("hf-trainer", "trl-sft", "torchtune"):
        raise _Unexpressible("training.paged_optimizer", True, "capopt writes bitsandbytes' "
                             "paged optimizers into the Trainer's file, TRL's "
                             "(optim = \"paged_adamw_8bit\" ...) and torchtune's only")
    if scenario.workload.optimizer_in_backward and fmt not in ("torchtitan", "torchtune"):
        raise _Unexpressible("training.optimizer_in_backward", True, "capopt writes the "
                             "optimizer step in the backward pass into torchtitan's file "
                             "([optimizer] early_step_in_backward) and torchtune's "
                             "(optimizer_in_bwd) only")
    if scenario.workload.async_tp and config.tp > 1 and fmt != "torchtitan":
        raise _Unexpressible("training.async_tp", True, "capopt writes asynchronous tensor "
                             "parallelism into torchtitan's file ([parallelism] "
                             "enable_async_tensor_parallel) only")
    if config.cp > 1 and fmt not in _CONTEXT_PARALLEL:
        raise _Unexpressible("config.cp", config.cp, "context parallelism as capopt prices "
                             "it (ring attention, the state sharded over dp x cp) is "
                             "torchtitan's context_parallel_degree and Megatron's "
                             "--context-parallel-size (torchtune's refuses the packed "
                             "sequences capopt prices: flex attention)")
    if config.dp_replicate > 1 and fmt not in _HYBRID_SHARD:
        raise _Unexpressible("config.dp_replicate", config.dp_replicate, "hybrid sharding "
                             "(the state sharded over dp / dp_replicate ranks, replicated "
                             "across dp_replicate groups) is torchtitan's "
                             "data_parallel_replicate_degree, torchtune's "
                             "data_parallel_replicate_dim, MaxText's data axis beside its "
                             "fsdp axis and Megatron's --num-distributed-optimizer-instances")
    if config.vpp > 1 and fmt not in _CONTEXT_PARALLEL:
        raise _Unexpressible("config.vpp", config.vpp, "interleaved pipeline stages are "
                             "torchtitan's Interleaved1F1B schedule and Megatron's "
                             "--num-virtual-stages-per-pipeline-rank")
    return _EMITTERS[fmt](config, scenario)


# the formats that write a context-parallel degree (``config.cp``) and virtual pipeline
# stages (``config.vpp``)
_CONTEXT_PARALLEL = ("torchtitan", "megatron")
# the formats that write hybrid sharding (``config.dp_replicate``)
_HYBRID_SHARD = ("torchtitan", "megatron", "torchtune", "maxtext")


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------------------------
# Shared readings of a config
# --------------------------------------------------------------------------------------------
def _global_batch(c: Config) -> int:
    return c.micro_batch * c.grad_accum * c.replicas


def _stage_layers(c: Config, sc: Scenario) -> int:
    layers = sc.model.num_hidden_layers
    if layers % c.pp:
        raise _Unexpressible("config.pp", c.pp, f"{layers} layers do not split evenly into "
                             f"{c.pp} stages")
    return layers // c.pp


def _chunk_layers(c: Config, sc: Scenario, whose: str) -> int:
    """Blocks in each of the pp x vpp interleaved chunks; refused where they do not split
    evenly (``whose``: the framework setting that needs it)."""
    layers = sc.model.num_hidden_layers
    if layers % (c.pp * c.vpp):
        raise _Unexpressible("config.vpp", c.vpp, f"{layers} layers do not split evenly into "
                             f"pp x vpp = {c.pp * c.vpp} stages ({whose})")
    return layers // (c.pp * c.vpp)


def _remat(c: Config, sc: Scenario) -> tuple[str, int]:
    """("none" | "selective" | "full", 0) or ("blocks", k): k of a stage's blocks fully
    recomputed, ``round(fraction x layers / pp)`` as `capopt._specs.remat_weights` counts them."""
    if isinstance(c.remat, str):
        return c.remat, 0
    per_stage = _stage_layers(c, sc)
    k = round(remat_weights(c.remat, per_stage)[2] * per_stage)
    if k == 0:
        return "none", 0
    if k == per_stage:
        return "full", 0
    return "blocks", k


def _every_nth(c: Config, layers: int, k: int) -> int:
    """The n whose every-n-th-block checkpointing (``count % n == 0``: torchtitan's and
    torchtune's selective layer option) recomputes ``k`` of ``layers`` blocks, ``layers // n``;
    refused where no n does."""
    every = next((n for n in range(2, layers + 1) if layers // n == k), None)
    if every is None:
        raise _Unexpressible("config.remat", c.remat, f"{k} of {layers} blocks is not every "
                             "n-th block")
    return every


def _lora_matrices(sc: Scenario) -> tuple[set, set]:
    """(the block's matrices, those of them LoRA wraps) of the scenario's card and adapters."""
    from .._inventory import inventory, lora_wrapped
    present = {t.matmul for t in inventory(sc.model) if t.where == "block" and t.matmul}
    return present, lora_wrapped(sc.workload.lora.targets) & present


def _nodes(c: Config, sc: Scenario) -> int:
    if c.devices <= sc.per_node:
        return 1
    if c.devices % sc.per_node:
        raise _Unexpressible("hardware.per_node", sc.per_node,
                             f"{c.devices} devices do not fill whole nodes")
    return c.devices // sc.per_node


def _no_lora(sc: Scenario, where: str) -> None:
    lora = sc.workload.lora
    if lora is not None:
        raise _Unexpressible("training.lora", f"rank {lora.rank} on {'+'.join(lora.targets)}",
                             f"{where}; adapters are set in the model code (peft LoraConfig)")


def _flash_by_default(c: Config) -> None:
    if not c.flash_attention:
        raise _Unexpressible("config.flash_attention", False, "PyTorch's attention picks a "
                             "fused kernel; materialised scores are a model-code choice")


# the runtime profile that prices a format's own rules, where capopt has one
_OWN_PROFILE = {"torchtitan": "torchtitan", "megatron": "megatron",
                "llm-foundry": "llm-foundry", "hf-trainer": "hf", "trl-sft": "hf",
                "torchtune": "torchtune", "maxtext": "maxtext"}


def _header(fmt: str, c: Config, sc: Scenario, mark: str = "#") -> list[str]:
    knobs = ", ".join(f"{k}={_show(v)}" for k, v in c.to_dict().items())
    lines = [f"{mark} {fmt} launch config for {sc.name!r}: {sc.model.name} on {c.devices} x "
             f"{sc.hardware.name}", f"{mark} capopt config: {knobs}"]
    own = _OWN_PROFILE.get(fmt)
    if own and sc.runtime.name != own:
        lines.append(f"{mark} priced with the {sc.runtime.name} runtime profile; "
                     f"--runtime {own} prices {fmt}'s own rules")
    return lines


# --------------------------------------------------------------------------------------------
# DeepSpeed: the ds_config JSON
# source: deepspeed/runtime/config.py, constants.py, precision_config.py, zero/config.py,
#   zero/offload_config.py at deepspeedai/DeepSpeed edaa7221 (version.txt 0.19.6)
# --------------------------------------------------------------------------------------------
# capopt optimizer -> DeepSpeed "optimizer.type" (+ params). Names not in DeepSpeed's own list
# are looked up in torch.optim, which needs zero_allow_untested_optimizer under ZeRO.
_DS_OPTIMIZERS = {"adamw": ("AdamW", {}), "adam": ("Adam", {"adam_w_mode": False}),
                  "lion": ("Lion", {}), "sgd": ("SGD", {}),
                  "sgd-momentum": ("SGD", {"momentum": 0.9}),     # capopt's momentum SGD: 0.9
                  "adafactor": ("Adafactor", {})}                # torch.optim.Adafactor
_DS_OWN = ("AdamW", "Adam", "Lion")
# ZeRO-Offload steps the optimizer on the host with DeepSpeed's CPU optimizers only.
_DS_OFFLOADABLE = ("adamw", "adam", "lion")


def _deepspeed_core(c: Config, sc: Scenario) -> dict:
    """The zero_optimization and precision sections (shared with hf-trainer's inline config)."""
    w = sc.workload
    if c.offload_optimizer and c.zero_stage == 0:
        raise _Unexpressible("config.offload_optimizer", True, "DeepSpeed offloads the "
                             "optimizer under ZeRO stage 1, 2 or 3 only")
    offloads = c.offload_optimizer or c.offload_params
    if offloads and w.optimizer not in _DS_OFFLOADABLE:
        raise _Unexpressible("training.optimizer", w.optimizer, "ZeRO-Offload has CPU "
                             "optimizers for Adam, AdamW and Lion only")
    zero: dict = {"stage": c.zero_stage}
    if offloads:
        zero["offload_optimizer"] = {"device": "cpu"}
    if c.offload_params:
        # (stage 3 only, DeepSpeed 0.19.8 runtime/zero/offload_config.py; with the optimizer
        # offloaded too, as capopt prices parameter offload: the step on the host)
        zero["offload_param"] = {"device": "cpu"}
    out: dict = {"zero_optimization": zero}
    if w.precision == "bf16-mixed":
        out["bf16"] = {"enabled": True}
    elif w.precision == "fp16-mixed":
        out["fp16"] = {"enabled": True}
    elif w.precision == "bf16":
        # no fp32 master copy: DeepSpeed keeps master weights, grads and states in bf16
        if c.zero_stage == 0:
            raise _Unexpressible("training.precision", "bf16", "bf16 master weights need "
                                 "ZeRO stage 1, 2 or 3 in DeepSpeed")
        out["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True,
                       "bf16_optimizer_states": True}
    elif w.precision == "fp8-mixed":
        raise _Unexpressible("training.precision", "fp8-mixed", "DeepSpeed's JSON has no "
                             "fp8 switch (Transformer Engine layers are model code)")
    return out


def _data_parallel_only(c: Config, why: str) -> None:
    """Refuse tensor, pipeline and expert degrees above 1 (a format with data parallelism
    alone), naming the first one set."""
    for knob, value in (("config.tp", c.tp), ("config.pp", c.pp), ("config.ep", c.ep)):
        if value > 1:
            raise _Unexpressible(knob, value, why)


def _deepspeed_parallel(c: Config) -> None:
    # (tensor parallelism is AutoTP's, tensor_parallel.autotp_size: its row-parallel layers
    # all-reduce their outputs, deepspeed/module_inject/layers.py LinearAllreduce)
    if c.sequence_parallel:
        raise _Unexpressible("config.sequence_parallel", True, "DeepSpeed's AutoTP all-reduces "
                             "the row-parallel outputs: no Megatron sequence parallelism")
    if c.pp > 1:
        raise _Unexpressible("config.pp", c.pp, "DeepSpeed's pipeline stages are set in code "
                             "(PipelineModule(num_stages=...)), not in its JSON")
    if c.ep > 1:
        raise _Unexpressible("config.ep", c.ep, "DeepSpeed's expert parallelism is set in code "
                             "(deepspeed.moe.layer.MoE(ep_size=...))")


def _emit_deepspeed(c: Config, sc: Scenario) -> str:
    w = sc.workload
    _deepspeed_parallel(c)
    _no_lora(sc, "DeepSpeed's JSON has no LoRA setting")
    _flash_by_default(c)
    kind, _ = _remat(c, sc)
    if kind != "none":
        raise _Unexpressible("config.remat", c.remat, "DeepSpeed's JSON does not switch "
                             "recomputation on (activation_checkpointing only tunes the "
                             "checkpoints model code makes)")
    if w.optimizer not in _DS_OPTIMIZERS:
        raise _Unexpressible("training.optimizer", w.optimizer, "DeepSpeed has no 8-bit AdamW "
                             "(a bitsandbytes optimizer is passed in from code)")
    name, params = _DS_OPTIMIZERS[w.optimizer]
    out: dict = {
        # DeepSpeed checks train_batch_size = micro x accumulation x data-parallel ranks
        "train_batch_size": _global_batch(c),
        "train_micro_batch_size_per_gpu": c.micro_batch,
        "gradient_accumulation_steps": c.grad_accum,
        "gradient_clipping": 1.0 if w.grad_clip else 0.0,      # 0.0: DeepSpeed does not clip
        "optimizer": {"type": name, "params": dict(params)},
    }
    if name not in _DS_OWN and c.zero_stage > 0:
        out["zero_allow_untested_optimizer"] = True
    if c.tp > 1:
        # AutoTP training (deepspeed/runtime/tensor_parallel/config.py TPTrainingConfig;
        # engine.py _apply_autotp_partitioning: a custom partition_config, else the model's
        # Hugging Face tp_plan, else AutoTP's parser; with ZeRO stages 0-3)
        out["tensor_parallel"] = {"autotp_size": c.tp}
    out.update(_deepspeed_core(c, sc))
    return json.dumps(out, indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------------------------
# Megatron-LM: pretrain_gpt.py arguments, as a bash array
# source: megatron/training/arguments.py (+ argument_utils.py, which derives flags from
#   TransformerConfig / ModelParallelConfig / TrainingConfig fields) and
#   megatron/core/transformer/enums.py (AttnBackend) at NVIDIA/Megatron-LM d98e8a64
#   (megatron core 0.20.0)
# --------------------------------------------------------------------------------------------
_MEGATRON_ZERO = {
    0: [],
    1: ["--use-distributed-optimizer"],     # Megatron's distributed optimizer is ZeRO-1
    # Megatron-FSDP's sharding strategies: optim_grads is ZeRO-2, optim_grads_params ZeRO-3
    2: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads"],
    3: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params"],
}
_MEGATRON_OPTIMIZERS = {
    "adamw": ["--optimizer adam"],                      # Megatron's adam decays decoupled
    "adam": ["--optimizer adam", "--weight-decay 0.0"],  # Adam = AdamW without decay
    "sgd": ["--optimizer sgd", "--sgd-momentum 0.0"],   # Megatron's SGD momentum defaults 0.9
    "sgd-momentum": ["--optimizer sgd", "--sgd-momentum 0.9"],
    "lion": ["--optimizer lion"],
}


def _megatron_args(c: Config, sc: Scenario) -> list[str]:
    w = sc.workload
    _no_lora(sc, "Megatron-LM's training arguments have no LoRA")
    if w.optimizer not in _MEGATRON_OPTIMIZERS:
        raise _Unexpressible("training.optimizer", w.optimizer,
                             "Megatron-LM offers adam, sgd, lion, muon and soap")
    if w.precision == "bf16":
        raise _Unexpressible("training.precision", "bf16", "Megatron keeps fp32 (or fp16) main "
                             "params; it has no pure-bf16 training")
    if c.offload_optimizer and c.zero_stage == 0:
        raise _Unexpressible("config.offload_optimizer", True, "--optimizer-cpu-offload needs "
                             "the distributed optimizer or Megatron-FSDP (ZeRO 1-3)")
    if c.offload_params:
        raise _Unexpressible("config.offload_params", True, "Megatron-LM offloads the "
                             "optimizer state (--optimizer-cpu-offload), not the parameters")
    if c.sequence_parallel and c.tp == 1:
        raise _Unexpressible("config.sequence_parallel", True, "Megatron turns sequence "
                             "parallelism off when tensor parallelism is 1")
    if c.pp > 1 and c.zero_stage >= 2:
        raise _Unexpressible("config.zero_stage", c.zero_stage, "the megatron runtime shards "
                             "gradients and parameters (Megatron-FSDP) without pipeline "
                             "parallelism only; use ZeRO 0 or 1 (the distributed optimizer)")
    args = [f"--tensor-model-parallel-size {c.tp}", f"--pipeline-model-parallel-size {c.pp}"]
    if c.vpp > 1:
        # arguments.py's validate_args makes it virtual_pipeline_model_parallel_size; the
        # blocks split evenly over pp x vpp chunks (the megatron runtime's rule)
        _chunk_layers(c, sc, "Megatron-Core's get_num_layers_to_build asserts it")
        args.append(f"--num-virtual-stages-per-pipeline-rank {c.vpp}")
    if c.ep > 1:
        args.append(f"--expert-model-parallel-size {c.ep}")
    if c.cp > 1:
        # Megatron's data-parallel size is world / (tp x pp x cp); its distributed optimizer
        # shards over data x context parallel ranks (parallel_state.py), capopt's dp
        args.append(f"--context-parallel-size {c.cp}")
    if c.dp_replicate > 1:
        # the distributed optimizer (or Megatron-FSDP) sharded over dp / N ranks, its
        # gradient reduce-scatter followed by an all-reduce across the N instances
        # (param_and_grad_buffer.py start_grad_sync; megatron-core 0.16.1)
        args.append(f"--num-distributed-optimizer-instances {c.dp_replicate}")
    if c.sequence_parallel:
        args.append("--sequence-parallel")
    # Megatron derives accumulation: global / (micro x data-parallel size)
    args += [f"--micro-batch-size {c.micro_batch}", f"--global-batch-size {_global_batch(c)}",
             f"--seq-length {w.seq_len}"]
    args += _MEGATRON_ZERO[c.zero_stage]
    kind, k = _remat(c, sc)
    if kind == "selective":
        args.append("--recompute-granularity selective")
    elif kind == "full":
        # uniform with 1 layer per checkpoint: every block recomputed from its own input
        args += ["--recompute-granularity full", "--recompute-method uniform",
                 "--recompute-num-layers 1"]
    elif kind == "blocks":
        # block: the first k blocks of each stage recomputed, the rest kept; Megatron-Core
        # counts them per model chunk (each chunk its own TransformerBlock), so interleaved
        # the rank's k blocks are k / vpp in each of its vpp chunks
        if k % c.vpp:
            raise _Unexpressible("config.remat", c.remat, f"{k} recomputed blocks of a stage "
                                 f"do not split evenly over its {c.vpp} model chunks "
                                 "(--recompute-num-layers counts per chunk)")
        args += ["--recompute-granularity full", "--recompute-method block",
                 f"--recompute-num-layers {k // c.vpp}"]
    prec = {"bf16-mixed": ["--bf16"], "fp16-mixed": ["--fp16"], "fp32": [],
            "fp8-mixed": ["--bf16", "--fp8-format hybrid"]}     # fp8 GEMMs, bf16 elsewhere
    args += prec[w.precision]
    args.append(f"--clip-grad {1.0 if w.grad_clip else 0.0}")    # 0.0: Megatron does not clip
    args += _MEGATRON_OPTIMIZERS[w.optimizer]
    if c.offload_optimizer:
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0"]
    args.append(f"--attention-backend {'flash' if c.flash_attention else 'unfused'}")
    if sc.runtime.name == "megatron":
        # the overlap the megatron profile prices, as arguments.py at d98e8a64 allows it
        # (:1024-1029: --overlap-param-gather needs --overlap-grad-reduce and the distributed
        # optimizer or Megatron-FSDP, i.e. ZeRO 1-3; :1441-1442: --tp-comm-overlap needs
        # --sequence-parallel)
        if c.dp > 1:
            args.append("--overlap-grad-reduce")
        if c.dp > 1 and c.zero_stage >= 1:
            args.append("--overlap-param-gather")
        if c.tp > 1 and c.sequence_parallel:
            args.append("--tp-comm-overlap")
    return args


def _emit_megatron(c: Config, sc: Scenario) -> str:
    args = _megatron_args(c, sc)
    lines = ["#!/usr/bin/env bash", *_header("megatron", c, sc),
             f"# use: torchrun --nproc-per-node {min(c.devices, sc.per_node)} "
             f"--nnodes {_nodes(c, sc)} pretrain_gpt.py \"${{MEGATRON_ARGS[@]}}\" <model, data>",
             "MEGATRON_ARGS=("]
    lines += [f"  {a}" for a in args]
    lines.append(")")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# torchtitan: the job TOML (--job.config_file)
# source: torchtitan/config/job_config.py and torchtitan/distributed/activation_checkpoint.py
#   at pytorch/torchtitan v0.2.2 (73a0e697), its last release with TOML job files; main
#   (b5bcd76c) configures runs in Python instead
# --------------------------------------------------------------------------------------------
_TITAN_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def _emit_torchtitan(c: Config, sc: Scenario) -> str:
    w = sc.workload
    _no_lora(sc, "torchtitan has no LoRA")
    _flash_by_default(c)
    if c.zero_stage == 1:
        raise _Unexpressible("config.zero_stage", 1, "torchtitan shards with FSDP2 (ZeRO-3, "
                             "or ZeRO-2 without resharding) or replicates (DDP); no ZeRO-1")
    if c.offload_optimizer and not c.offload_params:
        raise _Unexpressible("config.offload_optimizer", True, "training.enable_cpu_offload "
                             "offloads parameters and gradients too (offload_params)")
    if c.tp > 1 and not c.sequence_parallel:
        raise _Unexpressible("config.sequence_parallel", False, "torchtitan's tensor "
                             "parallelism always shards norms over the sequence")
    if c.sequence_parallel and c.tp == 1:
        raise _Unexpressible("config.sequence_parallel", True, "sequence parallelism rides "
                             "on tensor parallelism in torchtitan")
    if c.zero_stage == 0 and c.dp > 1 and (c.tp > 1 or c.pp > 1):
        raise _Unexpressible("config.zero_stage", 0, "torchtitan's DDP does not compose with "
                             "tensor or pipeline parallelism")
    # (stepped in the backward pass, every gradient is gone by the clipping torchtitan always
    # calls: its max_norm has nothing to clip, as capopt's unclipped step)
    if not w.grad_clip and not w.optimizer_in_backward:
        raise _Unexpressible("training.grad_clip", False, "torchtitan always clips by global "
                             "norm (training.max_norm; 0 would zero the gradients)")
    if w.optimizer not in _TITAN_OPTIMIZERS:
        raise _Unexpressible("training.optimizer", w.optimizer,
                             "torchtitan builds Adam and AdamW")
    if w.precision in ("fp16-mixed", "fp8-mixed"):
        raise _Unexpressible("training.precision", w.precision, "torchtitan's training dtypes "
                             "are bfloat16 and float32 (fp8 is a model converter)")
    if c.cp > 1 and c.zero_stage not in (2, 3):
        raise _Unexpressible("config.zero_stage", c.zero_stage, "torchtitan shards the state "
                             "over the context-parallel ranks with FSDP2 whenever cp > 1 "
                             "(ParallelDims: fsdp = dp_shard x cp)")
    # FSDP2 shards over dp_shard x cp (torchtitan/distributed/parallel_dims.py): capopt's dp
    # counts both, so the shard degree written is dp / cp; hybrid sharding (HSDP) replicates
    # that group dp_replicate times
    shard = c.shard_group if c.zero_stage in (2, 3) else 1
    parallelism = {"data_parallel_replicate_degree": c.dp // shard,
                   "data_parallel_shard_degree": shard // c.cp,
                   "tensor_parallel_degree": c.tp, "pipeline_parallel_degree": c.pp,
                   "context_parallel_degree": c.cp, "expert_parallel_degree": c.ep}
    if w.async_tp and c.tp > 1:
        # torchtitan 0.2.2 config/job_config.py Parallelism.enable_async_tensor_parallel (it
        # needs "model" among [compile] components, which training.async_tp's compile writes)
        parallelism["enable_async_tensor_parallel"] = True
    if c.zero_stage == 2:
        # FSDP2 keeping parameters gathered from forward to backward: ZeRO-2's live set
        parallelism["fsdp_reshard_after_forward"] = "never"
    if c.pp > 1:
        # capopt's micro-batches are the pipeline's; torchtitan splits the local batch into them
        parallelism["pipeline_parallel_microbatch_size"] = c.micro_batch
    if c.vpp > 1:
        # torchtitan 0.2.2 (distributed/pipeline_parallel.py): ceil((L + first_less +
        # last_less) / layers_per_stage) virtual stages, a multiple of pp; with the end
        # stages' allowances at 0, L / (pp x vpp) blocks a stage gives pp x vpp of them
        per_chunk = _chunk_layers(c, sc, "torchtitan's pipeline_parallel_layers_per_stage")
        parallelism.update({"pipeline_parallel_schedule": "Interleaved1F1B",
                            "pipeline_parallel_layers_per_stage": per_chunk,
                            "pipeline_parallel_first_stage_less_layers": 0,
                            "pipeline_parallel_last_stage_less_layers": 0})
    training = {
        # with pp, the local batch is one step's pipeline micro-batches together
        "local_batch_size": c.micro_batch * (c.grad_accum if c.pp > 1 else 1),
        # torchtitan accumulates global / (local x data-parallel degree) times
        "global_batch_size": _global_batch(c),
        "seq_len": w.seq_len,
        "max_norm": 1.0,
        "dtype": "bfloat16" if w.precision == "bf16" else "float32",
        "mixed_precision_param": "bfloat16" if w.precision == "bf16-mixed" else "float32",
    }
    if c.offload_params:
        # torchtitan 0.2.2 config/job_config.py Training.enable_cpu_offload: FSDP2's
        # CPUOffloadPolicy on every fully_shard (parameters, gradients, optimizer state)
        training["enable_cpu_offload"] = True
    kind, k = _remat(c, sc)
    if kind == "blocks":
        # selective_ac_option n checkpoints every n-th block: per_stage // n blocks
        every = _every_nth(c, _stage_layers(c, sc), k)
        ac = {"mode": "selective", "selective_ac_option": str(every)}
    elif kind == "selective":
        ac = {"mode": "selective", "selective_ac_option": "op"}     # per-op selective AC
    else:
        ac = {"mode": kind}
    optimizer = {"name": _TITAN_OPTIMIZERS[w.optimizer]}
    if w.optimizer_in_backward:
        # torchtitan 0.2.2 config/job_config.py Optimizer.early_step_in_backward
        optimizer["early_step_in_backward"] = True
    sections = {"optimizer": optimizer, "training": training,
                "parallelism": parallelism, "activation_checkpoint": ac}
    # torch.compile per block (components "model": torchtitan's apply_compile) and of the
    # cross-entropy ("loss": components/loss.py build_cross_entropy_loss); torchtitan 0.2.2
    # config/job_config.py Compile, whose default components are both
    components = (["model"] if w.compile else []) + (["loss"] if w.loss == "fused" else [])
    if components:
        sections["compile"] = {"enable": True, "components": components}
    lines = _header("torchtitan", c, sc)
    lines.append(f"# [model] name and flavor: set them to torchtitan's for {sc.model.name}")
    for name, body in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Accelerate: the `accelerate launch --config_file` YAML
# source: src/accelerate/commands/config/config_args.py (ClusterConfig),
#   src/accelerate/commands/launch.py, src/accelerate/utils/constants.py at
#   huggingface/accelerate 16cb6eb8 (1.15.0 dev)
# --------------------------------------------------------------------------------------------
def _yaml_scalar(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_yaml_scalar(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v) if v in ("", "no", "yes", "true", "false", "null") else v
    return str(v)


def _yaml(d: dict, indent: int = 0) -> list[str]:
    out = []
    for k in sorted(d):
        v = d[k]
        if isinstance(v, dict):
            out.append(" " * indent + f"{k}:")
            out += _yaml(v, indent + 2)
        else:
            out.append(" " * indent + f"{k}: {_yaml_scalar(v)}")
    return out


_ACCEL_PRECISION = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8-mixed": "fp8"}


def _emit_accelerate(c: Config, sc: Scenario) -> str:
    w = sc.workload
    _data_parallel_only(c, "capopt writes Accelerate configs for data parallelism (DDP, "
                           "FSDP, DeepSpeed ZeRO) only")
    _no_lora(sc, "Accelerate's config has no LoRA")
    _flash_by_default(c)
    if w.precision == "bf16":
        raise _Unexpressible("training.precision", "bf16", "Accelerate's mixed_precision keeps "
                             "fp32 weights; pure bf16 is the model's dtype, set in code")
    kind, _ = _remat(c, sc)
    # (FSDP has no ZeRO-1, and its offload moves parameters too: the optimizer state alone
    # goes through DeepSpeed)
    use_ds = c.zero_stage == 1 or (c.offload_optimizer and not c.offload_params)
    use_fsdp = c.zero_stage in (2, 3) and not use_ds
    if kind in ("selective", "blocks"):
        raise _Unexpressible("config.remat", c.remat, "Accelerate checkpoints whole layers, "
                             "all or none")
    if kind == "full" and not use_fsdp:
        raise _Unexpressible("config.remat", c.remat, "Accelerate's config switches "
                             "recomputation on under FSDP only (fsdp_activation_checkpointing)")
    nodes = _nodes(c, sc)
    cfg: dict = {"compute_environment": "LOCAL_MACHINE", "num_processes": c.devices,
                 "num_machines": nodes, "machine_rank": 0,
                 "mixed_precision": _ACCEL_PRECISION[w.precision], "use_cpu": False}
    script = [f"DataLoader(batch_size={c.micro_batch}) per process"]
    if use_ds:
        _deepspeed_core(c, sc)             # the same limits as DeepSpeed's own JSON
        ds = {"zero_stage": c.zero_stage, "gradient_accumulation_steps": c.grad_accum,
              "gradient_clipping": 1.0 if w.grad_clip else 0.0}
        if c.offload_optimizer or c.offload_params:
            ds["offload_optimizer_device"] = "cpu"
            ds["offload_param_device"] = "cpu" if c.offload_params else "none"
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = ds
    else:
        if c.devices == 1:
            cfg["distributed_type"] = "NO"
        elif use_fsdp:
            cfg["distributed_type"] = "FSDP"
            cfg["fsdp_config"] = {
                "fsdp_version": 2,
                # FSDP2's spelling of FULL_SHARD (true, ZeRO-3) and SHARD_GRAD_OP (false, ZeRO-2)
                "fsdp_reshard_after_forward": c.zero_stage == 3,
                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                # (FSDP2's CPUOffloadPolicy: parameters, gradients, optimizer state)
                "fsdp_offload_params": c.offload_params,
                "fsdp_activation_checkpointing": kind == "full",
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            }
        else:
            cfg["distributed_type"] = "MULTI_GPU"
        script.append(f"Accelerator(gradient_accumulation_steps={c.grad_accum})")
        if w.grad_clip:
            script.append("accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)")
    if w.compile:
        # accelerate 1.16 commands/config/config_args.py ClusterConfig.dynamo_config:
        # accelerator.prepare(model) wraps it in torch.compile with this backend
        cfg["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    lines = _header("accelerate", c, sc)
    lines.append("# set in the training script (Accelerate takes these in code):")
    lines += [f"#   {s}" for s in script]
    lines.append(f"#   optimizer: {w.optimizer}")
    return "\n".join(lines + _yaml(cfg)) + "\n"


# --------------------------------------------------------------------------------------------
# Hugging Face Trainer: TrainingArguments fields as JSON (HfArgumentParser.parse_json_file)
# source: src/transformers/training_args.py (TrainingArguments, OptimizerNames) and
#   src/transformers/trainer_optimizer.py, modeling_utils.py of transformers 5.24.0 (PyPI wheel)
# --------------------------------------------------------------------------------------------
_HF_OPTIM = {"adamw": ("adamw_torch", {}),
             "adam": ("adamw_torch", {"weight_decay": 0.0}),     # Adam = AdamW without decay
             "sgd": ("sgd", {}), "sgd-momentum": ("sgd", {"optim_args": "momentum=0.9"}),
             "adafactor": ("adafactor", {}), "lion": ("lion_32bit", {}),
             "adamw-8bit": ("adamw_bnb_8bit", {})}
# bitsandbytes' paged optimizers by OptimizerNames (transformers 5.25 training_args.py:
# PAGED_ADAMW "paged_adamw_32bit", PAGED_ADAMW_8BIT "paged_adamw_8bit", PAGED_LION
# "paged_lion_32bit"); Adam as AdamW without decay
_HF_PAGED = {"adamw": ("paged_adamw_32bit", {}),
             "adam": ("paged_adamw_32bit", {"weight_decay": 0.0}),
             "lion": ("paged_lion_32bit", {}), "adamw-8bit": ("paged_adamw_8bit", {})}


def _emit_hf_trainer(c: Config, sc: Scenario) -> str:
    _no_lora(sc, "TrainingArguments has no LoRA field (trl-sft writes TRL's, which has)")
    return json.dumps(_training_args(c, sc), indent=2, sort_keys=True) + "\n"


def _training_args(c: Config, sc: Scenario) -> dict:
    """The TrainingArguments fields of ``c`` (hf-trainer's file; TRL's SFTConfig extends
    them)."""
    w = sc.workload
    _data_parallel_only(c, "the Trainer takes a tensor or expert degree from a model sharded "
                           "when it is loaded (from_pretrained's distributed_config), which "
                           "this file does not set, and has no pipeline stages")
    _flash_by_default(c)
    if w.precision in ("bf16", "fp8-mixed"):
        raise _Unexpressible("training.precision", w.precision, "TrainingArguments offers "
                             "fp32, bf16 and fp16 mixed precision")
    kind, k = _remat(c, sc)
    if kind == "selective":
        raise _Unexpressible("config.remat", c.remat, "activation_checkpointing recomputes "
                             "whole layers")
    every = 1
    if kind == "blocks":
        layers = sc.model.num_hidden_layers
        # every_n_layers n checkpoints the layers whose index % n == 0: ceil(layers / n)
        every = next((n for n in range(2, layers + 1) if -(-layers // n) == k), 0)
        if not every:
            raise _Unexpressible("config.remat", c.remat, f"{k} of {layers} layers is not "
                                 "every n-th layer")
    optim, extra = (_HF_PAGED if w.paged_optimizer else _HF_OPTIM)[w.optimizer]
    out: dict = {"per_device_train_batch_size": c.micro_batch,
                 "gradient_accumulation_steps": c.grad_accum,
                 "bf16": w.precision == "bf16-mixed", "fp16": w.precision == "fp16-mixed",
                 # the name since transformers 5 (gradient_checkpointing is its old alias)
                 "activation_checkpointing": kind in ("full", "blocks"),
                 "max_grad_norm": 1.0 if w.grad_clip else 0.0,     # 0.0: the Trainer skips it
                 "optim": optim, **extra}
    if every > 1:
        out["activation_checkpointing_kwargs"] = {"every_n_layers": every}
    if w.compile:
        out["torch_compile"] = True             # the Trainer compiles the model (inductor)
    if w.loss == "fused-linear":
        # Liger's fused linear cross-entropy and none of its other kernels (which change
        # activations capopt prices as the model's own)
        out.update(use_liger_kernel=True, liger_kernel_config=dict(_LIGER_FLCE_ONLY))
    if c.zero_stage == 1 or (c.offload_optimizer and not c.offload_params):
        # ZeRO-1 and optimizer offload go through DeepSpeed; "auto" takes the Trainer's values
        if w.optimizer not in _DS_OPTIMIZERS:
            raise _Unexpressible("training.optimizer", w.optimizer, "DeepSpeed has no 8-bit "
                                 "AdamW")
        ds = _deepspeed_core(c, sc)
        ds.update({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
        for key in ("bf16", "fp16"):
            if key in ds:
                ds[key]["enabled"] = "auto"
        out["deepspeed"] = ds
    elif c.zero_stage in (2, 3):
        # FSDP's FULL_SHARD is ZeRO-3, SHARD_GRAD_OP ZeRO-2
        out["fsdp"] = ("full_shard" if c.zero_stage == 3 else "shard_grad_op") + " auto_wrap"
        if c.offload_params:
            # TrainingArguments.fsdp's "offload": FSDP's CPU offload of parameters and
            # gradients (the optimizer then steps on the host)
            out["fsdp"] += " offload"
    return out


# --------------------------------------------------------------------------------------------
# TRL: the YAML of `trl sft --config FILE`: SFTConfig (TrainingArguments and SFT's own fields)
# and ModelConfig (PEFT's LoRA, bitsandbytes' quantisation) keys
# source: trl/trainer/sft_config.py, trl/trainer/model_config.py and trl/trainer/utils.py
#   (get_quantization_config, get_peft_config) of trl 1.16.0 (PyPI wheel); PEFT 0.21.2's
#   LoraConfig ("all-linear": every linear layer but the output head)
# --------------------------------------------------------------------------------------------
# capopt's matrices -> Hugging Face Llama-family module names (LlamaAttention, LlamaMLP)
_PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                 "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# the frozen model's dtype under LoRA (ModelConfig.dtype; a 4-bit base computes in it too);
# full fine-tuning loads float32 weights, the master copy mixed precision keeps under autocast
_TRL_DTYPE = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}


def _emit_trl_sft(c: Config, sc: Scenario) -> str:
    w, m = sc.workload, sc.model
    if m.family != "decoder":
        raise _Unexpressible("model.family", m.family, "trl sft trains causal language models")
    out = _training_args(c, sc)
    # every sequence seq_len tokens (packed), the loss as capopt prices it (nll: the model's
    # own cross-entropy, logits upcast, or Liger's under use_liger_kernel; TRL's chunked_nll,
    # which never holds them either, keeps other buffers)
    out.update(max_length=sc.seq_len, packing=True, loss_type="nll",
               dtype=_TRL_DTYPE[w.precision] if w.lora is not None else "float32")
    if w.activation_offload:
        # SFTConfig.activation_offloading (trl 1.16): OffloadActivations over each
        # training step
        out["activation_offloading"] = True
    lora, notes = w.lora, []
    if lora is not None:
        if c.zero_stage or c.offload_optimizer or c.offload_params:
            raise _Unexpressible("config.zero_stage", c.zero_stage, "capopt prices LoRA on "
                                 "whole model copies (DDP), not FSDP or DeepSpeed shards")
        if m.is_moe or m.is_mla:
            raise _Unexpressible("training.lora", f"rank {lora.rank} on "
                                 f"{'+'.join(lora.targets)}", "capopt names LoRA's modules "
                                 "for dense Llama-family attention and MLPs only")
        present, wrapped = _lora_matrices(sc)
        if wrapped == present & set(_PEFT_MODULES):
            modules: str | list = "all-linear"
        else:
            modules = [_PEFT_MODULES[x] for x in _PEFT_MODULES if x in wrapped]
            notes.append("# lora_target_modules: Hugging Face Llama-family names (Llama, "
                         "Mistral, Qwen2, Gemma); other models name them otherwise")
        # (the adapters' dropout as priced: PEFT keeps a dropped copy of each wrapped input
        # and its mask; TRL's own default, 0.05, is written out when capopt's is 0)
        out.update(use_peft=True, lora_r=lora.rank, lora_dropout=float(lora.dropout),
                   lora_target_modules=modules)
        if lora.base_bits == 4:
            # NF4, its block scales quantised again or not (TRL's use_bnb_nested_quant, passed
            # to BitsAndBytesConfig's bnb_4bit_use_double_quant), as capopt counts NF4's bytes
            out.update(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                       use_bnb_nested_quant=lora.double_quant)
        elif lora.base_bits == 8:
            out["load_in_8bit"] = True
    launch = ("# trl sft --config FILE --model_name_or_path <the model's Hub id> "
              "--dataset_name <dataset>")
    if c.dp > 1:
        launch += f" --num_processes {c.dp}"
    return "\n".join(_header("trl-sft", c, sc) + [launch] + notes + _yaml(out)) + "\n"


# --------------------------------------------------------------------------------------------
# MaxText: key=value overrides for `python3 -m maxtext.train <base.yml> key=value ...`
# source: src/maxtext/configs/base.yml, src/maxtext/configs/types.py and
#   src/maxtext/layers/decoders.py (get_remat_policy) at AI-Hypercomputer/maxtext e591f30c
#   (maxtext 0.2.5)
# --------------------------------------------------------------------------------------------
_MAXTEXT_REMAT = {
    # MaxText wraps every block in jax.checkpoint under remat_policy (decoders.py:541-566;
    # its "none" is policy None, the block recomputed whole, decoders.py:348-350) and no
    # policy saves everything: the nearest to none is minimal_with_context, every named
    # tensor saved (the projections and the attention's output), the element-wise ops
    # recomputed (the maxtext runtime refuses remat none: it prices what MaxText runs)
    "none": "minimal_with_context",
    # minimal saves the named projections (q, k, v, out_proj, mlpwi_0/1, mlpwo) and
    # recomputes the rest: the maxtext runtime's selective
    "selective": "minimal",
    "full": "full",
}
_MAXTEXT_PRECISION = {"fp32": ("float32", "float32", ""), "bf16-mixed": ("bfloat16", "float32", ""),
                      "bf16": ("bfloat16", "bfloat16", ""),
                      "fp8-mixed": ("bfloat16", "float32", "fp8")}


def _emit_maxtext(c: Config, sc: Scenario) -> str:
    w = sc.workload
    _no_lora(sc, "MaxText's train.py has no LoRA training")
    if c.zero_stage == 2:
        raise _Unexpressible("config.zero_stage", 2, "MaxText shards over fsdp (ZeRO-3) or "
                             "the optimizer over data (ZeRO-1), not gradients alone")
    if c.offload_params:
        raise _Unexpressible("config.offload_params", True, "capopt does not price MaxText's "
                             "parameter_memory_host_offload")
    if c.sequence_parallel:
        raise _Unexpressible("config.sequence_parallel", True, "MaxText's tensor_sequence axis "
                             "is its own layout, not Megatron's sequence parallelism")
    if w.precision == "fp16-mixed":
        raise _Unexpressible("training.precision", "fp16-mixed", "MaxText has no loss scaling")
    opt = {"adamw": ["opt_type=adamw"], "adam": ["opt_type=adamw", "adam_weight_decay=0.0"],
           "sgd": ["opt_type=sgd"]}.get(w.optimizer)
    if opt is None:
        raise _Unexpressible("training.optimizer", w.optimizer,
                             "MaxText offers adamw, adam_pax, sgd and muon")
    kind, _ = _remat(c, sc)
    if kind == "blocks":
        raise _Unexpressible("config.remat", c.remat, "MaxText applies one remat_policy to "
                             "every block")

    if c.pp > 1 and c.grad_accum % c.pp:
        raise _Unexpressible("config.grad_accum", c.grad_accum, "num_pipeline_microbatches "
                             "must be a multiple of the pipeline stages")
    nodes = _nodes(c, sc)
    data_axis = "fsdp" if c.zero_stage == 3 else "data"
    replicas = c.dp // c.ep          # the expert axis also splits the batch in MaxText
    axes = {"data": 1, "fsdp": 1, "tensor": c.tp, "pipeline": c.pp, "expert": c.ep}
    axes[data_axis] = replicas
    if c.dp_replicate > 1:
        # hybrid sharding: the state over the fsdp axis, replicated over the data axis
        # (configs/base.yml logical_axis_rules: the weights' 'embed' over fsdp only)
        axes["fsdp"], axes["data"] = replicas // c.dp_replicate, c.dp_replicate
    dcn = {k: 1 for k in axes}
    # across nodes: the data-parallel axis first (the replicas' one under hybrid sharding),
    # else the pipeline
    outer = "data" if c.dp_replicate > 1 else data_axis
    split = (outer if axes[outer] % nodes == 0 else "pipeline" if c.pp % nodes == 0
             else None)
    if split is None:
        raise _Unexpressible("hardware.per_node", sc.per_node, "no data or pipeline axis "
                             f"splits over {nodes} nodes")
    axes[split] //= nodes
    dcn[split] = nodes
    # per_device_batch_size counts every device (tensor and pipeline ranks too)
    if c.pp > 1:
        # pipeline micro-batches are MaxText's, drawn from one step's batch (no accumulation)
        per_device, accum = c.micro_batch * c.grad_accum / (c.tp * c.pp), 1
    else:
        per_device, accum = c.micro_batch / c.tp, c.grad_accum
    dtype, weight_dtype, quant = _MAXTEXT_PRECISION[w.precision]
    attention = ("dot_product" if not c.flash_attention
                 else "flash" if sc.hardware.name.startswith("tpu") else "cudnn_flash_te")
    kv = [f"ici_{k}_parallelism={v}" for k, v in axes.items()]
    kv += [f"dcn_{k}_parallelism={v}" for k, v in dcn.items()]
    kv.append(f"shard_optimizer_over_data={'true' if c.zero_stage == 1 else 'false'}")
    kv += [f"per_device_batch_size={per_device:g}", f"gradient_accumulation_steps={accum}",
           f"max_target_length={w.seq_len}"]
    if c.pp > 1:
        kv += [f"num_pipeline_microbatches={c.grad_accum}",
               f"num_layers_per_pipeline_stage={_stage_layers(c, sc)}"]
    kv += [f"remat_policy={_MAXTEXT_REMAT[kind]}", f"dtype={dtype}",
           f"weight_dtype={weight_dtype}", f"attention={attention}",
           f"gradient_clipping_threshold={1.0 if w.grad_clip else 0.0}",   # 0 disables
           f"optimizer_memory_host_offload={'true' if c.offload_optimizer else 'false'}"]
    if quant:
        kv.append(f"quantization={quant}")
    kv += opt
    lines = _header("maxtext", c, sc)
    lines.append("# use: python3 -m maxtext.train src/maxtext/configs/base.yml "
                 "$(grep -v '^#' this-file) model_name=<MaxText's name for the model>")
    return "\n".join(lines + kv) + "\n"


# --------------------------------------------------------------------------------------------
# llm-foundry: the train.py YAML (composer train.py <file>)
# source: scripts/train/yamls/pretrain/mpt-*.yaml and llmfoundry/models/mpt/configuration_mpt.py
#   at mosaicml/llm-foundry 5e85bd62d; Composer v0.17.2 composer/trainer/dist_strategy.py
#   (fsdp_config keys), composer/core/precision.py (precision names)
# --------------------------------------------------------------------------------------------
_FOUNDRY_PRECISION = {"bf16-mixed": "amp_bf16", "fp16-mixed": "amp_fp16", "fp8-mixed": "amp_fp8",
                      "fp32": "fp32"}
_FOUNDRY_OPTIMIZERS = {"adamw": "decoupled_adamw", "lion": "decoupled_lionw"}
_FOUNDRY_SHARDING = {2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}


def _emit_llm_foundry(c: Config, sc: Scenario) -> str:
    w = sc.workload
    _data_parallel_only(c, "llm-foundry's MPT trains with Composer's FSDP or DDP: data "
                           "parallelism only")
    _no_lora(sc, "capopt writes llm-foundry's MPT pretraining files")
    if c.zero_stage == 1:
        raise _Unexpressible("config.zero_stage", 1, "Composer's FSDP shards gradients with "
                             "the optimizer state (SHARD_GRAD_OP, ZeRO-2); no ZeRO-1")
    if c.offload_optimizer or c.offload_params:
        raise _Unexpressible("config.offload_params" if c.offload_params else
                             "config.offload_optimizer", True, "Composer's FSDP has no "
                             "host offload (cpu_offload raises 'not supported yet')")
    kind, _ = _remat(c, sc)
    if kind not in ("none", "full"):
        raise _Unexpressible("config.remat", c.remat, "fsdp_config.activation_checkpointing "
                             "recomputes every block or none")
    if w.precision not in _FOUNDRY_PRECISION:
        raise _Unexpressible("training.precision", w.precision, "Composer's precisions are "
                             "fp32 and amp_* (autocast over float32 parameters)")
    if w.optimizer not in _FOUNDRY_OPTIMIZERS:
        raise _Unexpressible("training.optimizer", w.optimizer, "llm-foundry's pretraining "
                             "optimizers are decoupled_adamw and decoupled_lionw")
    model = {"attn_config": {"attn_impl": "flash" if c.flash_attention else "torch"},
             "loss_fn": "fused_crossentropy" if w.loss == "fused" else "torch_crossentropy"}
    if w.precision == "fp8-mixed":
        model["fc_type"] = "te"                 # Transformer Engine linear layers, fp8 GEMMs
    doc = {"max_seq_len": w.seq_len, "global_train_batch_size": _global_batch(c),
           "device_train_microbatch_size": c.micro_batch,
           "precision": _FOUNDRY_PRECISION[w.precision], "model": model,
           "optimizer": {"name": _FOUNDRY_OPTIMIZERS[w.optimizer]}}
    if w.grad_clip:
        doc["algorithms"] = {"gradient_clipping": {"clipping_type": "norm",
                                                   "clipping_threshold": 1.0}}
    if c.zero_stage in _FOUNDRY_SHARDING:
        # DEFAULT: bf16 gathers, float32 reductions (the llm-foundry profile's pricing)
        doc["fsdp_config"] = {"sharding_strategy": _FOUNDRY_SHARDING[c.zero_stage],
                              "mixed_precision": "DEFAULT",
                              "activation_checkpointing": kind == "full",
                              "activation_checkpointing_reentrant": False,
                              "limit_all_gathers": True}
    elif kind == "full":
        raise _Unexpressible("config.remat", "full", "Composer checkpoints activations "
                             "through fsdp_config only (ZeRO-2/3)")
    lines = _header("llm-foundry", c, sc)
    lines.append(f"# use: composer -n {min(c.devices, sc.per_node)} scripts/train/train.py "
                 f"this-file  (on {_nodes(c, sc)} node(s); Composer accumulates "
                 "global / (micro x world size) times)")
    lines.append("# merge into a pretrain YAML (scripts/train/yamls/pretrain/): these keys "
                 "override its own, its model: section")
    lines.append(f"#   gains the two below beside MPT's shape of {sc.model.name} (name, d_model, "
                 "n_heads, n_layers, ...); train.py")
    lines.append("#   also needs seed, tokenizer, scheduler, train_loader, max_duration, "
                 "eval_interval and device_eval_batch_size")
    if c.zero_stage == 0 and c.dp > 1:
        lines.append("# no fsdp_config: Composer wraps the model in DDP")
    return "\n".join(lines + _yaml(doc)) + "\n"


# --------------------------------------------------------------------------------------------
# torchtune: a `tune run` command, the recipe and key=value overrides of its config
# source: recipes/full_finetune_single_device.py, full_finetune_distributed.py,
#   lora_finetune_single_device.py, lora_finetune_distributed.py, recipes/configs/ and
#   torchtune/training/activations.py (selective layer checkpointing) at pytorch/torchtune
#   bd2a0fc
# --------------------------------------------------------------------------------------------
# (capopt optimizer, paged) -> the optimizer component and its keyword arguments
_TUNE_OPTIMIZERS = {
    ("adamw", False): ("torch.optim.AdamW", {"fused": True}),
    ("adam", False): ("torch.optim.Adam", {"fused": True}),
    ("sgd", False): ("torch.optim.SGD", {}),
    ("sgd-momentum", False): ("torch.optim.SGD", {"momentum": 0.9}),
    ("adamw-8bit", False): ("bitsandbytes.optim.AdamW8bit", {}),
    ("adamw", True): ("bitsandbytes.optim.PagedAdamW", {}),
    ("adam", True): ("bitsandbytes.optim.PagedAdamW", {"weight_decay": 0.0}),
    ("lion", True): ("bitsandbytes.optim.PagedLion", {}),
    ("adamw-8bit", True): ("bitsandbytes.optim.PagedAdamW8bit", {}),
}
# capopt's loss -> the loss component (the float32 loss: torch's cross-entropy on the logits
# TransformerDecoder.unembed returns as float32)
_TUNE_LOSSES = {"chunked": "torchtune.modules.loss.LinearCrossEntropyLoss",
                "float32": "torch.nn.CrossEntropyLoss"}
# capopt's attention matrices -> torchtune's lora_attn_modules names (the MLP's three are one
# switch, apply_lora_to_mlp)
_TUNE_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "output_proj"}


def _tune_value(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, list):
        return "[" + ",".join(_tune_value(x) for x in v) + "]"
    return str(v)


def _emit_torchtune(c: Config, sc: Scenario) -> str:
    from .._runtime import get_profile
    from .._specs import RUNTIME_KNOB_RULES, runtime_refusal
    w, m = sc.workload, sc.model
    if m.family != "decoder":
        raise _Unexpressible("model.family", m.family, "torchtune's recipes fine-tune decoders")
    _flash_by_default(c)
    if w.precision not in ("bf16", "fp32"):
        raise _Unexpressible("training.precision", w.precision, "torchtune trains the whole "
                             "model in one dtype (dtype: bf16 or fp32), without autocast")
    if w.loss not in _TUNE_LOSSES:
        raise _Unexpressible("training.loss", w.loss, "torchtune's recipes take "
                             "LinearCrossEntropyLoss (loss = chunked) or "
                             "torch.nn.CrossEntropyLoss on the float32 logits the model returns "
                             "(loss = float32)")
    # (what the torchtune runtime does not run: its profile's rules, sourced there)
    tune = get_profile("torchtune")
    for knob in dict.fromkeys(rule[0] for rule in RUNTIME_KNOB_RULES):
        why = runtime_refusal(tune, knob, getattr(c, knob))
        if why is not None:
            raise _Unexpressible(f"config.{knob}", getattr(c, knob), why)
    if c.dp > 1 and c.zero_stage not in (2, 3):
        raise _Unexpressible("config.zero_stage", c.zero_stage, "torchtune shards every "
                             "data-parallel group with FSDP2 (ZeRO-3, or ZeRO-2 with "
                             "fsdp_reshard_after_forward = False)")
    optimizer = _TUNE_OPTIMIZERS.get((w.optimizer, bool(w.paged_optimizer)))
    if optimizer is None:
        raise _Unexpressible("training.optimizer", w.optimizer, "capopt writes torch.optim's "
                             "AdamW, Adam and SGD and bitsandbytes' AdamW8bit and paged "
                             "optimizers into torchtune's config")
    kind, k = _remat(c, sc)
    lora = w.lora
    recipe = (f"{'lora' if lora is not None else 'full'}_finetune_"
              f"{'distributed' if c.devices > 1 else 'single_device'}")
    if lora is not None and w.optimizer_in_backward:
        raise _Unexpressible("training.optimizer_in_backward", True, "torchtune's LoRA "
                             "recipes step after the backward pass (optimizer_in_bwd is the "
                             "full fine-tuning recipes')")
    if kind == "blocks" and recipe != "full_finetune_distributed":
        raise _Unexpressible("config.remat", c.remat, "checkpointing every n-th layer "
                             "(ac_mode = selective) is full_finetune_distributed's; "
                             f"{recipe} checkpoints all layers or none")
    kv: list[tuple[str, object]] = [
        ("batch_size", c.micro_batch), ("gradient_accumulation_steps", c.grad_accum),
        ("dtype", w.precision),
        # every sequence seq_len tokens, as capopt prices it
        ("dataset.packed", True), ("tokenizer.max_seq_len", w.seq_len),
        ("loss._component_", _TUNE_LOSSES[w.loss]),
        ("compile", False),
        ("optimizer._component_", optimizer[0]),
        *((f"optimizer.{key}", v) for key, v in optimizer[1].items()),
        *((("optimizer_in_bwd", bool(w.optimizer_in_backward)),) if lora is None else ()),
        ("clip_grad_norm", 1.0 if w.grad_clip and not w.optimizer_in_backward else "None"),
        ("enable_activation_checkpointing", kind == "full"),
        ("enable_activation_offloading", False),
    ]
    if kind == "blocks":
        # selective layer checkpointing wraps every n-th block: L // n of them
        kv += [("ac_mode", "selective"), ("ac_option", _every_nth(c, m.num_hidden_layers, k))]
    if c.devices > 1:
        # FSDP2 over dp_replicate x dp_shard x cp x tp (training.ParallelDims, as torchtitan's)
        shard = c.shard_group if c.zero_stage in (2, 3) else 1
        kv += [("data_parallel_replicate_dim", c.dp // shard),
               ("data_parallel_shard_dim", shard),
               ("fsdp_reshard_after_forward", c.zero_stage != 2),
               # (FSDP2's CPUOffloadPolicy: parameters, gradients, optimizer state)
               ("fsdp_cpu_offload", bool(c.offload_params)),
               # the embeddings and head in the root FSDP group, as capopt prices them
               ("custom_sharded_layers", [])]
    notes = []
    if lora is not None:
        if m.is_moe or m.is_mla:
            raise _Unexpressible("training.lora", f"rank {lora.rank} on "
                                 f"{'+'.join(lora.targets)}", "capopt names torchtune's LoRA "
                                 "modules for dense attention and MLPs only")
        if lora.base_bits == 8:
            raise _Unexpressible("training.lora.base_bits", 8, "torchtune's QLoRA base is "
                                 "NF4 (4-bit)")
        if not lora.double_quant:
            raise _Unexpressible("training.lora.double_quant", False, "torchtune's NF4 base "
                                 "(torchao's NF4Tensor) always quantises its block scales "
                                 "again (double_quantize_scalers)")
        present, wrapped = _lora_matrices(sc)
        mlp = wrapped & {"gate", "up", "down"}
        if mlp and mlp != present & {"gate", "up", "down"}:
            raise _Unexpressible("training.lora.targets", "+".join(lora.targets),
                                 "torchtune wraps the MLP's matrices all or none "
                                 "(apply_lora_to_mlp)")
        attn = [_TUNE_ATTN[x] for x in _TUNE_ATTN if x in wrapped]
        if not attn:
            raise _Unexpressible("training.lora.targets", "+".join(lora.targets),
                                 "torchtune's LoRA builders need one attention projection "
                                 "or more (lora_attn_modules)")
        # quantize_base: every block matrix in NF4 (the builders' FrozenNF4Linear beside the
        # LoRA layers), as capopt prices a 4-bit base
        kv += [("model.lora_attn_modules", attn), ("model.apply_lora_to_mlp", bool(mlp)),
               ("model.apply_lora_to_output", False), ("model.lora_rank", lora.rank),
               ("model.lora_dropout", float(lora.dropout)),
               ("model.quantize_base", lora.base_bits == 4)]
    if optimizer[0].startswith("bitsandbytes"):
        notes.append("# bitsandbytes' optimizers take no fused argument: add ~optimizer.fused "
                     "if the config's optimizer has one")
    launch = "tune run"
    if c.devices > 1:
        nodes = _nodes(c, sc)
        launch += f" --nnodes {nodes} --nproc_per_node {min(c.devices, sc.per_node)}"
        if nodes > 1:
            notes.append("# on each node, with torchrun's rendezvous: --rdzv_backend c10d "
                         "--rdzv_endpoint <host>:<port> after --nproc_per_node")
    lines = _header("torchtune", c, sc)
    lines += notes
    # the recipe's config for the model (tune ls lists them); the keys below override its own
    lines.append(f'CONFIG="${{CONFIG:?set CONFIG to torchtune\'s {recipe} config for '
                 f'{m.name} (tune ls lists them)}}"')
    body = " \\\n  ".join(f"'{key}={_tune_value(v)}'" if isinstance(v, list) else
                         f"{key}={_tune_value(v)}" for key, v in kv)
    lines.append(f'{launch} {recipe} --config "$CONFIG" \\\n  {body}')
    return "\n".join(lines) + "\n"


_EMITTERS: dict[str, Callable[[Config, Scenario], str]] = {
    "deepspeed": _emit_deepspeed, "megatron": _emit_megatron, "torchtitan": _emit_torchtitan,
    "accelerate": _emit_accelerate, "hf-trainer": _emit_hf_trainer, "trl-sft": _emit_trl_sft,
    "maxtext": _emit_maxtext,
    "llm-foundry": _emit_llm_foundry, "torchtune": _emit_torchtune,
}

__all__ = ["FORMATS", "SUFFIX", "emit", "expresses"]
