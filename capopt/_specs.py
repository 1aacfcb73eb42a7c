"""Specs: the workload, the budget, one concrete `Config`, the knob domains, the `Scenario`.

Plain frozen dataclasses: no numerics beyond validation, no I/O. Constructors raise
`CapoptError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ._errors import CapoptError
from ._hardware import Hardware
from ._inventory import LORA_MATRICES, LORA_SINGLE
from ._model import ModelSpec
from ._runtime import OPTIMIZERS, RuntimeProfile

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp8-mixed")
# the optimizers bitsandbytes pages (bitsandbytes/optim: PagedAdamW, PagedAdamW8bit,
# PagedLion; Adam as PagedAdamW without weight decay)
PAGED_OPTIMIZERS = ("adamw", "adam", "lion", "adamw-8bit")
# How the cross-entropy meets the logits: "float32", upcast and taken op by op (the runtime
# profile's logits rules); "fused", one kernel that reads the compute-dtype logits and writes
# their gradient in the compute dtype (torch.compile's loss, Liger / Apex / Transformer
# Engine cross-entropy), keeping float32 statistics per token only; "fused-linear", the
# head's matmul and the cross-entropy in one pass over chunks of tokens that also writes the
# head's input and weight gradients (Liger's LigerFusedLinearCrossEntropyLoss, the Trainer's
# use_liger_kernel): the logits are never whole (`capopt.cost.flops.fused_linear_chunk`);
# "chunked", the head and an upcast cross-entropy run eagerly on `CHUNKED_LOSS_CHUNKS`
# slices of the tokens, one after another (torchtune's LinearCrossEntropyLoss, its recipes'
# default, and CEWithChunkedOutputLoss): each slice's float32 log-probabilities are saved
# for the backward pass, its upcast copies are transient
LOSSES = ("float32", "fused", "fused-linear", "chunked")
# torchtune (bd2a0fc) modules/loss/cross_entropy_loss.py LinearCrossEntropyLoss and
# ce_chunked_output_loss.py CEWithChunkedOutputLoss: num_output_chunks: int = 8
CHUNKED_LOSS_CHUNKS = 8
REMAT_POLICIES = ("none", "selective", "full")
OBJECTIVES = ("throughput", "cost_efficiency")
# LoRA's targets: the groups ("attn": every attention projection, "mlp": the MLP's) and
# single block matrices (q, k, v, o, latent attention's q_a, kv_a, kv_b; gate, up, down)
LORA_TARGETS = (*LORA_MATRICES, *LORA_SINGLE)


# The runtime-profile coefficients that price element-wise ops run one kernel per op (an
# eager PyTorch step); `Workload.compile` fuses them (TorchInductor)
EAGER_EW_COEFFS = ("ew_rmsnorm_extra", "ew_rope_extra", "ew_glu_extra")


def eager_elementwise(runtime: RuntimeProfile) -> bool:
    """Whether the runtime runs element-wise ops one by one (what compiling would fuse)."""
    coeffs = runtime.coeff_dict()
    return any(coeffs.get(k, 0.0) > 0.0 for k in EAGER_EW_COEFFS)


def runtimes_where(test) -> list[str]:
    """The built-in runtimes whose profile passes ``test`` (for the words of a refusal)."""
    from ._runtime import get_profile, list_profiles
    return [name for name in list_profiles() if test(get_profile(name))]


def losses_run_by(rt) -> list[str]:
    """The `LOSSES` the runtime ``rt`` runs as capopt prices them (an XLA step takes its
    cross-entropy over whole logits, as its profile's logits rules price it; a PyTorch
    runtime each loss its profile switches on)."""
    xla = rt.xla_step
    gates = {"fused": "fused_loss", "fused-linear": "fused_linear_loss",
             "chunked": "chunked_loss"}
    return ["float32"] + [loss for loss, gate in gates.items()
                          if rt.coeff(gate) >= 0.5 and not xla]


def _loss_allowed(rt, loss: str) -> str:
    """The words of a refused loss: what ``rt`` runs, and the runtimes that run ``loss``."""
    others = runtimes_where(lambda r: loss in losses_run_by(r))
    ran = ", ".join(losses_run_by(rt)) + f" (the {rt.name} runtime's)"
    if not others:
        return ran
    return (ran + f", or a runtime that runs {loss} ("
            + " or ".join(filter(None, (", ".join(others[:-1]), others[-1]))) + ")")


def eager_runtimes() -> list[str]:
    """The built-in runtimes whose element-wise ops run eagerly (where compiling changes
    something)."""
    return runtimes_where(eager_elementwise)


def runtimes_running(coeff: str) -> str:
    """The built-in runtimes whose profile switches ``coeff`` on, as a refusal names them:
    ``hf, megatron or torchtitan``."""
    names = runtimes_where(lambda rt: rt.coeff(coeff) >= 0.5)
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1] if names else "")))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on the chosen matrices; ``base_bits`` 4 is QLoRA (NF4 base)."""

    rank: int = 16
    targets: tuple[str, ...] = ("attn", "mlp")
    base_bits: int = 16       # 16: base weights in the compute dtype; 8; 4: NF4 (QLoRA)
    dropout: float = 0.0      # PEFT's lora_dropout: on each wrapped matrix's adapter input
    # an NF4 base's block absmax in 8 bits under a second-level scale (the QLoRA paper's
    # double quantisation, bitsandbytes' compress_statistics) or in float32 (transformers'
    # BitsAndBytesConfig default, bnb_4bit_use_double_quant=False); 4-bit bases only
    double_quant: bool = True

    def __post_init__(self):
        if not _is_int(self.rank) or self.rank < 1:
            raise CapoptError(f"must be a positive integer, got {self.rank!r}",
                              field="training.lora.rank")
        if not isinstance(self.targets, tuple) or not all(isinstance(t, str)
                                                          for t in self.targets):
            raise CapoptError(f"must be a list of names, got {self.targets!r}",
                              field="training.lora.targets", allowed=", ".join(LORA_TARGETS))
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise CapoptError(f"unknown targets {bad or self.targets!r}",
                              field="training.lora.targets", allowed=", ".join(LORA_TARGETS))
        if self.base_bits not in (4, 8, 16):
            raise CapoptError(f"got {self.base_bits!r}", field="training.lora.base_bits",
                              allowed="4, 8, 16")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0.0 <= self.dropout < 1.0):
            raise CapoptError(f"got {self.dropout!r}", field="training.lora.dropout",
                              allowed="a probability from 0 (none) to below 1")
        if not isinstance(self.double_quant, bool):
            raise CapoptError(f"got {self.double_quant!r}", field="training.lora.double_quant",
                              allowed="true or false")
        if not self.double_quant and self.base_bits != 4:
            raise CapoptError(f"false with base_bits = {self.base_bits}",
                              field="training.lora.double_quant",
                              allowed="false only with a 4-bit (NF4) base, base_bits = 4")


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes, and how."""

    seq_len: int
    global_batch: int
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    grad_clip: bool = True
    lora: LoRA | None = None
    loss: str = "float32"                       # one of LOSSES
    compile: bool = False                       # torch.compile: element-wise ops fused
    # each parameter stepped by its own optimizer as soon as its gradient is accumulated, the
    # gradient freed at once (torchtitan's early_step_in_backward, torchtune's
    # optimizer_in_bwd): no step after the backward pass, so no clipping and no accumulation
    optimizer_in_backward: bool = False
    # asynchronous tensor parallelism (torchtitan's enable_async_tensor_parallel): each
    # tensor-parallel all-gather / reduce-scatter pipelined with the GEMM that consumes or
    # produces it, forward and backward (TorchInductor's micro-pipeline TP pass)
    async_tp: bool = False
    # activation offloading (TRL's SFTConfig.activation_offloading, torchtune's
    # enable_activation_offloading: OffloadActivations): every tensor the forward pass saves
    # for the backward pass (1 KiB or more, not a parameter; the output head's excepted) copied
    # to pinned host memory on a side stream and brought back as the backward pass needs it
    activation_offload: bool = False
    # a paged optimizer (bitsandbytes' Paged* optimizers, the Trainer's optim="paged_..."):
    # the state of every parameter of PAGED_STATE_MIN_SIZE elements or more in CUDA managed
    # memory, which the driver moves to host memory when the device is short and back for
    # each parameter's update (capopt.cost.memory, capopt.cost.time)
    paged_optimizer: bool = False
    input_samples_per_s: float | None = None    # data-loader rate (None: not a limit)
    train_tokens: float | None = None           # for time-to-train

    def __post_init__(self):
        if not _is_int(self.seq_len) or self.seq_len < 1:
            raise CapoptError(f"must be a positive integer, got {self.seq_len!r}",
                              field="training.seq_len")
        if not _is_int(self.global_batch) or self.global_batch < 1:
            raise CapoptError(f"must be a positive integer, got {self.global_batch!r}",
                              field="training.global_batch")
        if self.precision not in PRECISIONS:
            raise CapoptError(f"unknown precision {self.precision!r}",
                              field="training.precision", allowed=", ".join(PRECISIONS))
        if self.optimizer not in OPTIMIZERS:
            raise CapoptError(f"unknown optimizer {self.optimizer!r}",
                              field="training.optimizer", allowed=", ".join(OPTIMIZERS))
        if self.loss not in LOSSES:
            raise CapoptError(f"unknown loss {self.loss!r}", field="training.loss",
                              allowed=", ".join(LOSSES))
        for name in ("compile", "optimizer_in_backward", "async_tp", "activation_offload",
                     "paged_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise CapoptError(f"must be true or false, got {getattr(self, name)!r}",
                                  field=f"training.{name}")
        if self.optimizer_in_backward and self.grad_clip:
            raise CapoptError("an optimizer stepped in the backward pass updates each "
                              "parameter before the global gradient norm exists: it cannot "
                              "clip", field="training.optimizer_in_backward",
                              allowed="false, or true with training.grad_clip = false")
        if self.optimizer_in_backward and self.precision == "fp16-mixed":
            raise CapoptError("fp16's dynamic loss scaling skips a step when any gradient "
                              "overflows, which needs every gradient before the step",
                              field="training.optimizer_in_backward",
                              allowed="false, or another precision")
        if self.paged_optimizer and self.optimizer not in PAGED_OPTIMIZERS:
            raise CapoptError(f"bitsandbytes has no paged {self.optimizer}",
                              field="training.paged_optimizer",
                              allowed="false, or true with training.optimizer "
                                      + " / ".join(PAGED_OPTIMIZERS))
        if self.paged_optimizer and self.optimizer_in_backward:
            raise CapoptError("a paged optimizer is one bitsandbytes optimizer over every "
                              "parameter, stepped after the backward pass",
                              field="training.paged_optimizer",
                              allowed="false with training.optimizer_in_backward = true")
        if self.input_samples_per_s is not None and not self.input_samples_per_s > 0:
            raise CapoptError(f"must be > 0, got {self.input_samples_per_s!r}",
                              field="training.input_samples_per_s")
        if self.train_tokens is not None and not self.train_tokens > 0:
            raise CapoptError(f"must be > 0, got {self.train_tokens!r}",
                              field="training.train_tokens")


@dataclass(frozen=True)
class Budget:
    """Per-device memory budget; the model must fit in ``vram_bytes * (1 - headroom)``."""

    vram_bytes: int
    headroom: float = 0.10

    def __post_init__(self):
        if not self.vram_bytes > 0:
            raise CapoptError(f"must be > 0, got {self.vram_bytes!r}", field="budget.vram_gib")
        if not 0.0 <= self.headroom < 1.0:
            raise CapoptError(f"must be in [0, 1), got {self.headroom!r}",
                              field="budget.headroom")

    @property
    def usable_bytes(self) -> float:
        return self.vram_bytes * (1.0 - self.headroom)


# --------------------------------------------------------------------------------------------
# Knobs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KnobSpec:
    name: str
    kind: str              # "int" | "bool" | "choice" | "remat"
    default: Any
    help: str
    choices: tuple = ()


KNOBS: dict[str, KnobSpec] = {k.name: k for k in [
    KnobSpec("micro_batch", "int", "auto", "sequences per device per forward/backward"),
    KnobSpec("grad_accum", "int", "auto", "micro-batches per optimizer step"),
    KnobSpec("dp", "int", "auto", "data-parallel degree (replicas or ZeRO/FSDP shards)"),
    KnobSpec("zero_stage", "choice", "auto", "ZeRO stage (3 = FSDP)", (0, 1, 2, 3)),
    KnobSpec("tp", "int", "auto", "tensor-parallel degree"),
    KnobSpec("pp", "int", "auto", "pipeline-parallel degree"),
    KnobSpec("ep", "int", 1, "expert-parallel degree (MoE; divides dp)"),
    KnobSpec("cp", "int", 1, "context-parallel degree: each sequence split over cp ranks of "
             "the data-parallel group, attention exchanging keys and values (divides dp)"),
    KnobSpec("vpp", "int", 1, "virtual pipeline stages per pipeline rank (interleaved 1F1B): "
             "each rank runs vpp chunks of its blocks; 1 = plain 1F1B"),
    KnobSpec("dp_replicate", "int", 1, "hybrid sharding (HSDP): dp is split into dp_replicate "
             "replicas, each ZeRO-sharding the state over its dp / dp_replicate ranks and "
             "all-reducing its gradient shard across the replicas; 1 = shard over all of dp"),
    KnobSpec("sequence_parallel", "bool", "auto", "shard norms/dropout over tp"),
    KnobSpec("remat", "remat", "auto",
             "activation checkpointing: none | selective | full, or the fraction of layers "
             "fully recomputed"),
    KnobSpec("offload_optimizer", "bool", False, "optimizer state in host memory"),
    KnobSpec("offload_params", "bool", False, "parameters, gradients and the optimizer step "
             "in host memory (FSDP's CPUOffloadPolicy, DeepSpeed's offload_param; ZeRO-3)"),
    KnobSpec("flash_attention", "bool", True, "fused attention (no materialised scores)"),
]}


# the ZeRO stages parameter offload runs under: DeepSpeed's offload_param is valid only with
# stage 3 (runtime/zero/offload_config.py, v0.19.8); FSDP's CPUOffloadPolicy is priced on fully
# sharded groups (`capopt._validity`'s rule and the scenario's refusal both read it)
OFFLOAD_PARAMS_STAGES = (3,)
# (their name in messages: "ZeRO-3")
OFFLOAD_PARAMS_NEEDS = "ZeRO-" + " or ".join(map(str, OFFLOAD_PARAMS_STAGES))

# the knobs whose values are true or false
BOOL_KNOBS = tuple(name for name, spec in KNOBS.items() if spec.kind == "bool")

# Scenario-level layout knobs under [config] (not per-config values: `Config` stays uniform).
STAGE_KNOBS: dict[str, tuple[str, ...]] = {"pipeline_layers": ("even", "auto"),
                                          "stage_recompute": ("uniform", "auto")}


def remat_weights(remat, layers: float | None = None) -> tuple[float, float, float]:
    """Shares of a stage's blocks under (none, selective, full) recomputation. A fraction
    recomputes whole blocks, ``round(fraction x layers)`` of the stage's ``layers`` (as
    Megatron's ``--recompute-num-layers`` and the validation step's `remat_plan` do); with no
    ``layers`` (a relaxed knob), the fraction itself."""
    if remat == "none":
        return (1.0, 0.0, 0.0)
    if remat == "selective":
        return (0.0, 1.0, 0.0)
    if remat == "full":
        return (0.0, 0.0, 1.0)
    full = float(remat)
    if layers is not None and layers >= 1:
        full = round(full * layers) / layers
    return (1.0 - full, 0.0, full)


def data_replicas(dp: int, cp: int = 1) -> int:
    """Data-parallel replicas the batch is split over: ``dp / cp`` (context-parallel ranks
    share their sequences; ``dp`` counts them)."""
    return max(dp // cp, 1)


@dataclass(frozen=True)
class Config:
    """One concrete choice of every knob."""

    micro_batch: int = 1
    grad_accum: int = 1
    dp: int = 1
    zero_stage: int = 0
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    remat: str | float = "none"
    offload_optimizer: bool = False
    flash_attention: bool = True
    # parameter offload (FSDP2's CPUOffloadPolicy, torch v2.13 _fsdp_api.py: "offloads
    # parameters, gradients, and optimizer states to CPU ... the optimizer step runs on CPU";
    # DeepSpeed's zero_optimization.offload_param, valid only with stage 3): the sharded
    # parameters, their gradients and the optimizer state live in host memory
    offload_params: bool = False
    # context parallelism: a sub-group of dp, as torchtitan's ``fsdp`` mesh (dp_shard x cp)
    # and Megatron-Core's data-parallel-with-context group shard the state over dp x cp while
    # the batch is split over dp alone; here ``dp`` counts the whole group, so the batch is
    # split over ``dp / cp`` replicas (`replicas`)
    cp: int = 1
    # interleaved 1F1B: each pipeline rank runs ``vpp`` model chunks of L / (pp x vpp) blocks
    # (Narayanan et al. 2021; Megatron's virtual pipeline size, torch's ScheduleInterleaved1F1B)
    vpp: int = 1
    # hybrid sharding (HSDP: torchtitan's data_parallel_replicate_degree, FSDP's HYBRID_SHARD,
    # Megatron-Core's --num-distributed-optimizer-instances): dp is ``dp_replicate`` replicas
    # of a shard group of dp / dp_replicate ranks (cp included, as torchtitan's fsdp mesh is
    # dp_shard x cp) over which ZeRO splits the state (`shard_group`)
    dp_replicate: int = 1

    def __post_init__(self):
        for name in ("micro_batch", "grad_accum", "dp", "tp", "pp", "ep", "cp", "vpp",
                     "dp_replicate"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise CapoptError(f"must be a positive integer, got {v!r}", field=f"config.{name}")
        if not _is_int(self.zero_stage) or self.zero_stage not in (0, 1, 2, 3):
            raise CapoptError(f"got {self.zero_stage!r}", field="config.zero_stage",
                              allowed="0, 1, 2, 3")
        r = self.remat
        if isinstance(r, str):
            if r not in REMAT_POLICIES:
                raise CapoptError(f"got {r!r}", field="config.remat",
                                  allowed="none, selective, full, or a fraction in [0, 1]")
        elif isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise CapoptError(f"got {r!r}", field="config.remat",
                              allowed="none, selective, full, or a fraction in [0, 1]")
        for name in BOOL_KNOBS:
            if not isinstance(getattr(self, name), bool):
                raise CapoptError(f"must be true or false, got {getattr(self, name)!r}",
                                  field=f"config.{name}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO splits the state over: ``dp / dp_replicate`` (all of dp without HSDP)."""
        return max(self.dp // self.dp_replicate, 1)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas the batch is split over (`data_replicas`)."""
        return data_replicas(self.dp, self.cp)

    def remat_weights(self, layers: float | None = None) -> tuple[float, float, float]:
        """Shares of a stage's ``layers`` blocks under (none, selective, full)
        recomputation: `remat_weights`."""
        return remat_weights(self.remat, None if layers is None else layers / self.pp)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def key_dict(self) -> dict:
        """`to_dict` less the knobs added after stored measurement keys were first written,
        where they hold their default (``cp`` = ``vpp`` = ``dp_replicate`` = 1,
        ``offload_params`` false): a key built
        from it names the same config it always did."""
        return {k: v for k, v in self.to_dict().items() if not (k in _LATER_KNOBS
                                                                   and v == _LATER_KNOBS[k])}


# knobs added to `Config` after measurement keys were stored, with their defaults
_LATER_KNOBS = {"cp": 1, "vpp": 1, "dp_replicate": 1, "offload_params": False}


@dataclass(frozen=True)
class KnobDomain:
    """What the scenario allows for one knob: one value, a list of values, or ``auto``."""

    name: str
    values: tuple | None          # None means "auto"

    @property
    def pinned(self) -> bool:
        return self.values is not None and len(self.values) == 1

    @property
    def auto(self) -> bool:
        return self.values is None

    def allows(self, value) -> bool:
        return self.values is None or value in self.values


# Knob values a runtime has no way to run (torchtune: no pipeline or expert parallelism, tensor
# parallelism only with the model's own plan, which capopt does not write; no
# optimizer-only offload, FSDP over every data-parallel rank so never ZeRO-1, whole blocks
# checkpointed; ZeRO-0 at dp > 1 is `capopt._validity`'s rule). Each: the knob, the values kept
# when it is searched, the test of a named value, the profile coefficient and the value of it
# that sets the rule on, the allowed values' words, why.
RUNTIME_KNOB_RULES = (
    ("pp", (1,), lambda v: v == 1, "pipeline_parallel", 0, "1",
     "has no pipeline parallelism"),
    ("tp", (1,), lambda v: v == 1, "tensor_parallel", 0, "1",
     "runs no tensor parallelism capopt can launch"),
    ("ep", (1,), lambda v: v == 1, "expert_parallel", 0, "1",
     "runs no expert parallelism capopt can launch"),
    ("offload_optimizer", (False,), lambda v: v is False, "optimizer_offload", 0, "false",
     "does not offload the optimizer state alone"),
    ("zero_stage", (0, 2, 3), lambda v: v != 1, "sharded_data_parallel_only", 1, "0, 2 or 3",
     "shards data parallelism with FSDP (ZeRO-2 or ZeRO-3), never ZeRO-1"),
    ("remat", ("none", "full"), lambda v: v != "selective", "selective_remat", 0,
     "none, full or a fraction of the blocks",
     "checkpoints whole blocks (every one, or every n-th), not selected activations"),
    ("zero_stage", (0, 3), lambda v: v in (0, 3), "fsdp_or_replicated_only", 1, "0 or 3",
     "replicates (ZeRO-0) or fully shards (ZeRO-3) data parallelism; its other layouts are "
     "not priced"),
    ("remat", ("selective", "full"), lambda v: v in ("selective", "full"),
     "remat_policy_every_block", 1, "selective or full",
     "rematerialises every block under one policy (none recomputes it whole)"),
    ("sequence_parallel", (False,), lambda v: v is False, "megatron_sequence_parallel", 0,
     "false", "has no Megatron sequence parallelism"),
    ("zero_stage", (0, 2, 3), lambda v: v != 1, "deepspeed_paths_priced", 0, "0, 2 or 3",
     "runs ZeRO-1 through DeepSpeed's engine, which --runtime deepspeed prices"),
    ("offload_optimizer", (False,), lambda v: v is False, "deepspeed_paths_priced", 0, "false",
     "offloads the optimizer through DeepSpeed's engine, which --runtime deepspeed prices"),
    ("offload_params", (False,), lambda v: v is False, "param_offload", 0, "false",
     "does not offload parameters and gradients to the host"),
    ("zero_stage", (0, 2, 3), lambda v: v != 1, "zero1_sharding", 0, "0, 2 or 3",
     "has no ZeRO-1 (its sharded data parallelism shards the gradients with the optimizer "
     "state)"),
    ("remat", ("none", "full"), lambda v: v in ("none", "full"), "remat_every_block_or_none", 1,
     "none or full", "recomputes every block or none"),
)


def runtime_refusal(rt, knob: str, value) -> str | None:
    """Why the runtime profile ``rt`` does not run ``knob`` at ``value`` (``the torchtune
    runtime has no pipeline parallelism``), or None where it does (`RUNTIME_KNOB_RULES`)."""
    for name, _, ok, coeff, on, _, why in RUNTIME_KNOB_RULES:
        if name == knob and (rt.coeff(coeff) >= 0.5) == bool(on) and not ok(value):
            return f"the {rt.name} runtime {why}"
    return None


def runtime_runs(rt, knob: str, value) -> bool:
    """Whether the runtime profile ``rt`` runs ``knob`` at ``value`` (`runtime_refusal`)."""
    return runtime_refusal(rt, knob, value) is None


def config_refusal(rt, cfg) -> str | None:
    """Why the runtime profile ``rt`` does not run ``cfg`` (its first knob `runtime_refusal`
    refuses, and the value), or None where it runs every knob."""
    for name in dict.fromkeys(rule[0] for rule in RUNTIME_KNOB_RULES):
        why = runtime_refusal(rt, name, getattr(cfg, name))
        if why:
            return f"{why} (config.{name} = {getattr(cfg, name)!r})"
    return None


def runtime_runs_config(rt, cfg) -> bool:
    """Whether the runtime profile ``rt`` runs every knob of ``cfg`` (`config_refusal`)."""
    return config_refusal(rt, cfg) is None


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelSpec
    hardware: Hardware
    count: int
    per_node: int
    workload: Workload
    budget: Budget
    runtime: RuntimeProfile
    knobs: tuple[KnobDomain, ...] = ()
    objective: str = "throughput"
    price_per_gpu_hour: float | None = None
    deadline_s: float | None = None       # time_to_train must not exceed this (needs train_tokens)
    path: str | None = field(default=None, compare=False)
    # Other (gpu, count) choices the scenario allows; each a complete Scenario.
    variants: tuple["Scenario", ...] = field(default=(), compare=False, repr=False)
    # The [training] fields the optimiser chooses (`WORKLOAD_CHOICES`: a list or "auto" in the
    # file); every variant holds one value of each, the same names on all of them.
    choices: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # Uneven pipeline stages (pp >= 2): "even" (L / pp layers each) or "auto" (the optimiser
    # chooses each stage's layer count); "uniform" recomputation (the remat knob everywhere)
    # or "auto" (the optimiser chooses how many layers each stage recomputes).
    pipeline_layers: str = "even"
    stage_recompute: str = "uniform"

    def __post_init__(self):
        if not _is_int(self.count) or self.count < 1:
            raise CapoptError(f"must be a positive integer, got {self.count!r}",
                              file=self.path, field="hardware.count")
        if not _is_int(self.per_node) or self.per_node < 1:
            raise CapoptError(f"must be a positive integer, got {self.per_node!r}",
                              file=self.path, field="hardware.per_node")
        if self.objective not in OBJECTIVES:
            raise CapoptError(f"got {self.objective!r}", file=self.path,
                              field="objective.maximize", allowed=", ".join(OBJECTIVES))
        if self.deadline_s is not None and (not self.deadline_s > 0
                                            or not self.workload.train_tokens):
            raise CapoptError("a deadline needs deadline_hours > 0 and training.train_tokens",
                              file=self.path, field="objective.deadline_hours")
        for name, allowed in STAGE_KNOBS.items():
            if getattr(self, name) not in allowed:
                raise CapoptError(f"got {getattr(self, name)!r}", file=self.path,
                                  field=f"config.{name}", allowed=", ".join(allowed))
        if (self.stage_recompute == "auto"
                and self.runtime.coeff("remat_policy_every_block") >= 0.5):
            raise CapoptError(f"the {self.runtime.name} runtime rematerialises every block "
                              "under one policy: no per-stage recompute counts",
                              file=self.path, field="config.stage_recompute",
                              allowed="uniform")
        if self.workload.precision not in self.runtime.precision_names:
            raise CapoptError(f"the {self.runtime.name} runtime has no precision "
                              f"{self.workload.precision!r}", file=self.path,
                              field="training.precision",
                              allowed=", ".join(self.runtime.precision_names))
        if self.runtime.optimizers and self.workload.optimizer not in self.runtime.optimizers:
            raise CapoptError(f"the {self.runtime.name} runtime has no optimizer "
                              f"{self.workload.optimizer!r}", file=self.path,
                              field="training.optimizer",
                              allowed=", ".join(self.runtime.optimizers))
        lora = self.workload.lora
        if lora is not None and self.runtime.coeff("lora_training") < 0.5:
            raise CapoptError(f"the {self.runtime.name} runtime trains no LoRA adapters",
                              file=self.path, field="training.lora",
                              allowed="none, or a runtime that does ("
                                      + runtimes_running("lora_training") + ")")
        if lora is not None and lora.dropout > 0 and self.runtime.xla_step:
            raise CapoptError(f"the {self.runtime.name} step runs no adapter dropout",
                              file=self.path, field="training.lora.dropout",
                              allowed="0, or a PyTorch runtime (PEFT's lora_dropout)")
        if self.workload.compile and not eager_elementwise(self.runtime):
            raise CapoptError(f"the {self.runtime.name} runtime's element-wise ops are fused "
                              "kernels already: compiling changes nothing it prices",
                              file=self.path, field="training.compile",
                              allowed="a runtime whose ops run eagerly ("
                              + ", ".join(eager_runtimes()) + ")")
        if self.workload.compile and self.runtime.coeff("torch_compile") < 0.5:
            raise CapoptError(f"the {self.runtime.name} runtime compiles its loss with the "
                              "model, which capopt prices eager", file=self.path,
                              field="training.compile",
                              allowed="false, or a runtime whose compile it prices ("
                                      + runtimes_running("torch_compile") + ")")
        if (self.workload.optimizer_in_backward
                and self.runtime.coeff("optimizer_in_backward") < 0.5):
            raise CapoptError(f"the {self.runtime.name} runtime has no optimizer step in the "
                              "backward pass", file=self.path,
                              field="training.optimizer_in_backward",
                              allowed="false, or a runtime that runs it ("
                                      + runtimes_running("optimizer_in_backward") + ")")
        loss = self.workload.loss
        if loss == "fused-linear" and self.runtime.coeff("fused_linear_loss") < 0.5:
            raise CapoptError(f"the {self.runtime.name} runtime does not run Liger's fused "
                              "linear cross-entropy", file=self.path, field="training.loss",
                              allowed=_loss_allowed(self.runtime, "fused-linear"))
        if loss == "fused" and self.runtime.xla_step:
            raise CapoptError(f"the {self.runtime.name} step takes its cross-entropy over "
                              "whole logits (its rules are the profile's)",
                              file=self.path, field="training.loss",
                              allowed="float32, or fused under a PyTorch runtime")
        if loss == "fused" and self.runtime.coeff("fused_loss") < 0.5:
            raise CapoptError(f"the {self.runtime.name} runtime has no fused cross-entropy "
                              "as capopt prices it", file=self.path, field="training.loss",
                              allowed=_loss_allowed(self.runtime, "fused"))
        if loss in ("fused-linear", "chunked"):
            m = self.model
            if not m.has_vocab_head:
                raise CapoptError(f"a {m.family} model has no vocabulary head to "
                                  + ("fuse the loss with" if loss == "fused-linear" else
                                     "chunk the loss over"), file=self.path,
                                  field="training.loss",
                                  allowed="float32, fused (or a decoder / masked-LM card)")
            if self.runtime.xla_step:
                raise CapoptError(f"the {self.runtime.name} step takes its cross-entropy over "
                                  "whole logits", file=self.path, field="training.loss",
                                  allowed=f"float32, or {loss} under a PyTorch runtime")
            if loss == "chunked" and self.runtime.coeff("chunked_loss") < 0.5:
                raise CapoptError(f"the {self.runtime.name} runtime does not run the chunked "
                                  "loss", file=self.path, field="training.loss",
                                  allowed="float32, fused, fused-linear, or a runtime that "
                                          "runs it (" + runtimes_running("chunked_loss") + ")")
            if loss == "chunked" and self.workload.activation_offload:
                # (torchtune opens OffloadActivations over the model's forward pass only, TRL
                # over the loss too: which of the loss's tensors leave is the framework's)
                raise CapoptError("the chunked loss is not priced with activation offloading",
                                  file=self.path, field="training.activation_offload",
                                  allowed="false with training.loss = \"chunked\"")
            # both run on the whole head (Liger's kernel takes plain tensors; the chunked
            # loss is priced without loss_parallel's vocabulary split): tensor parallelism is
            # 1, chosen or not
            self._narrow("tp", (1,), lambda v: v == 1,
                         f"the {loss} loss runs on the whole head, not a vocabulary-parallel "
                         "one", f"1 (or auto) with training.loss = \"{loss}\"")
        if (self.workload.activation_offload
                and self.runtime.coeff("activation_offload") < 0.5):
            raise CapoptError(f"the {self.runtime.name} runtime does not offload activations",
                              file=self.path, field="training.activation_offload",
                              allowed="false, or a runtime that does ("
                                      + runtimes_running("activation_offload") + ")")
        if self.workload.paged_optimizer:
            if self.runtime.coeff("paged_optimizer") < 0.5:
                raise CapoptError(f"the {self.runtime.name} runtime does not run "
                                  "bitsandbytes' paged optimizers", file=self.path,
                                  field="training.paged_optimizer",
                                  allowed="false, or a runtime that does ("
                                          + runtimes_running("paged_optimizer") + ")")
            # (bitsandbytes steps plain device tensors: not FSDP's or DTensor's shards, so
            # no ZeRO sharding and no tensor parallelism, chosen or not)
            for knob, one in (("zero_stage", 0), ("tp", 1)):
                self._narrow(knob, (one,), lambda v, one=one: v == one,
                             "a paged optimizer (bitsandbytes) steps whole device tensors, "
                             "not ZeRO or tensor-parallel shards",
                             f"{one} (or auto) with training.paged_optimizer = true")
        if self.workload.async_tp and self.runtime.coeff("async_tp") < 0.5:
            raise CapoptError(f"the {self.runtime.name} runtime has no asynchronous tensor "
                              "parallelism", file=self.path, field="training.async_tp",
                              allowed="false, or a runtime that runs it ("
                                      + runtimes_running("async_tp") + ")")
        if self.workload.async_tp and not self.workload.compile:
            # torchtitan's parallelize_llama: "Async TP requires --training.compile" (the
            # overlap is an Inductor pass over the compiled graph)
            raise CapoptError("asynchronous tensor parallelism is a torch.compile pass",
                              file=self.path, field="training.async_tp",
                              allowed="false, or true with training.compile = true")
        # what the runtime has no way to run (`RUNTIME_KNOB_RULES`): narrowed where
        # searched, refused where named
        for knob, keep, ok, coeff, on, allowed, why in RUNTIME_KNOB_RULES:
            if (self.runtime.coeff(coeff) >= 0.5) == bool(on):
                self._narrow(knob, keep, ok, f"the {self.runtime.name} runtime {why}",
                             allowed + " (or auto)")
        # parameter offload runs on ZeRO-3 alone (`capopt._validity`): off where the stages
        # named leave none, refused where it is named on
        zeros = self.knob("zero_stage").values
        if zeros is not None and not set(zeros) & set(OFFLOAD_PARAMS_STAGES):
            self._narrow("offload_params", (False,), lambda v: v is False,
                         f"offload_params needs {OFFLOAD_PARAMS_NEEDS}; config.zero_stage "
                         f"allows {', '.join(map(str, zeros))}",
                         "false (or auto), or zero_stage "
                         + " or ".join(map(str, OFFLOAD_PARAMS_STAGES)))
        if self.objective == "cost_efficiency" and self.gpu_hour_price is None:
            raise CapoptError("cost_efficiency needs a price: set hardware.price_per_gpu_hour",
                              file=self.path, field="objective.maximize")

    @property
    def seq_len(self) -> int:
        return self.model.native_seq_len or self.workload.seq_len

    @property
    def gpu_hour_price(self) -> float | None:
        if self.price_per_gpu_hour is not None:
            return self.price_per_gpu_hour
        return self.hardware.price_per_hour

    def _narrow(self, knob: str, keep: tuple, ok, why: str, allowed: str) -> None:
        """Restrict ``knob`` to what the workload or the runtime runs: searched ("auto"), to
        ``keep``; a list, to its values that pass ``ok``; none left (a value named that
        fails), a `CapoptError` naming the knob. (Called from ``__post_init__``.)"""
        dom = self.knob(knob)
        left = keep if dom.values is None else tuple(v for v in dom.values if ok(v))
        if not left:
            raise CapoptError(why, file=self.path, field=f"config.{knob}", allowed=allowed)
        if dom.values != left:
            object.__setattr__(self, "knobs", tuple(k for k in self.knobs if k.name != knob)
                               + (KnobDomain(knob, left),))

    def knob(self, name: str) -> KnobDomain:
        for k in self.knobs:
            if k.name == name:
                return k
        d = KNOBS[name].default
        return KnobDomain(name, None if d == "auto" else (d,))

    def replace(self, **changes) -> "Scenario":
        return dataclasses.replace(self, **changes)


def training_choices(sc: Scenario) -> dict[str, Any]:
    """The values of the [training] fields the optimiser chose (`Scenario.choices`)."""
    return {name: getattr(sc.workload, name) for name in sc.choices}


def lora_adapters_bf16(sc: Scenario) -> bool:
    """Whether the runtime keeps a quantised base's LoRA adapters, their gradients and their
    optimizer state in bfloat16 under mixed precision (``lora_quant_adapters_lowp``: TRL's
    SFTTrainer casts a quantised model's trainable parameters so)."""
    lora, prec = sc.workload.lora, sc.runtime.precision(sc.workload.precision)
    return (lora is not None and lora.base_bits < 16
            and prec["param_bytes"] > prec["act_bytes"]
            and sc.runtime.coeff("lora_quant_adapters_lowp") >= 0.5)


def stable_text(x: Any) -> str:
    """A text of what ``x`` holds, for keys that must outlive the code: a dataclass as its
    class name and the fields that differ from their defaults (so a field added with a
    default leaves every earlier text as it was; fields outside equality are left out),
    tuples, lists and dicts element by element, anything else as `repr`."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        items = []
        for f in dataclasses.fields(x):
            if not f.compare:
                continue
            v = getattr(x, f.name)
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = dataclasses.MISSING
            if default is not dataclasses.MISSING and v == default:
                continue
            items.append(f"{f.name}={stable_text(v)}")
        return f"{type(x).__name__}({', '.join(items)})"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(stable_text(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {stable_text(v)}" for k, v in sorted(x.items())) + "}"
    return repr(x)
