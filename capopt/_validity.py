"""Which integer configs are real: one table of rules, for one config (`config_problems`, what
`plan` and the optimiser's rounding check) and over whole columns of configs at once
(`broken`, what the search's lattice is filtered with).

Each rule reads a few knobs (its ``reads``), says where it is broken as a boolean array over
columns of knob values, and explains itself for one config. The search builds its lattice
knob by knob and filters each step with the rules that read only the knobs known by then, so
every row it builds obeys every rule; the tests check that on samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ._specs import (OFFLOAD_PARAMS_NEEDS, OFFLOAD_PARAMS_STAGES, Config, Scenario,
                     runtimes_running)

Columns = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Rule:
    field: str                                         # the knob a report names
    reads: frozenset                                   # the knobs the rule looks at
    broken: Callable[[Columns, Scenario], np.ndarray]  # True where the rule is broken
    why: Callable[[Config, Scenario], str]             # the explanation for one config
    # the change to ``field``'s knob that mends a broken config, where one is obvious
    repair: Callable[[dict], object] | None = None


def _rule(field: str, reads: str, broken, why, repair=None) -> Rule:
    return Rule(field, frozenset(reads.split()), broken, why, repair)


def _attention(sc: Scenario) -> bool:
    return sc.model.family != "mlp"


RULES: tuple[Rule, ...] = (
    _rule("config.dp", "dp tp pp",
          lambda c, sc: c["dp"] * c["tp"] * c["pp"] != sc.count,
          lambda cfg, sc: f"dp*tp*pp = {cfg.dp}*{cfg.tp}*{cfg.pp} = {cfg.devices} must equal "
                          f"hardware.count {sc.count}"),
    _rule("config.micro_batch", "micro_batch grad_accum dp cp",
          lambda c, sc: (c["micro_batch"] * c["grad_accum"] * c["dp"]
                         != sc.workload.global_batch * c["cp"]),
          lambda cfg, sc: (f"micro_batch*grad_accum*dp = {cfg.micro_batch}*{cfg.grad_accum}*"
                           f"{cfg.dp} must equal training.global_batch "
                           f"{sc.workload.global_batch}" if cfg.cp == 1 else
                           f"micro_batch*grad_accum*dp/cp = {cfg.micro_batch}*{cfg.grad_accum}*"
                           f"{cfg.dp}/{cfg.cp} must equal training.global_batch "
                           f"{sc.workload.global_batch} (context-parallel ranks share their "
                           "sequences)")),
    _rule("config.tp", "tp",
          lambda c, sc: _attention(sc) & (sc.model.num_attention_heads % c["tp"] != 0),
          lambda cfg, sc: f"tp {cfg.tp} must divide num_attention_heads "
                          f"{sc.model.num_attention_heads}"),
    _rule("config.tp", "tp",
          lambda c, sc: _attention(sc) & (sc.model.kv_heads % c["tp"] != 0)
          & (c["tp"] % sc.model.kv_heads != 0),
          lambda cfg, sc: f"tp {cfg.tp} and num_key_value_heads {sc.model.kv_heads} must "
                          "divide one another"),
    _rule("config.tp", "tp",
          lambda c, sc: c["tp"] > sc.per_node,
          lambda cfg, sc: f"tp {cfg.tp} must fit in a node ({sc.per_node} devices)"),
    _rule("config.pp", "pp",
          lambda c, sc: ((sc.model.num_hidden_layers % c["pp"] != 0)
                         & (sc.runtime.coeff("uneven_stages") == 0))
          | (c["pp"] > sc.model.num_hidden_layers),
          lambda cfg, sc: (f"pp {cfg.pp} must divide num_hidden_layers "
                           f"{sc.model.num_hidden_layers} (the {sc.runtime.name} runtime "
                           "splits blocks evenly)"
                           if sc.runtime.coeff("uneven_stages") == 0 else
                           f"pp {cfg.pp} must not exceed num_hidden_layers "
                           f"{sc.model.num_hidden_layers}")),
    _rule("config.ep", "ep dp",
          lambda c, sc: (c["ep"] > 1) & ((sc.model.num_local_experts % c["ep"] != 0)
                                         | (c["dp"] % c["ep"] != 0)),
          lambda cfg, sc: f"ep {cfg.ep} must divide num_local_experts "
                          f"{sc.model.num_local_experts} and dp {cfg.dp}",
          lambda d: math.gcd(d["ep"], d["dp"])),
    _rule("config.cp", "cp dp",
          lambda c, sc: (c["cp"] > 1) & (c["dp"] % c["cp"] != 0),
          lambda cfg, sc: f"cp {cfg.cp} must divide dp {cfg.dp} (dp counts the context-"
                          "parallel ranks: the group the state is sharded over)",
          lambda d: math.gcd(d["cp"], d["dp"])),
    _rule("config.cp", "cp",
          lambda c, sc: (c["cp"] > 1) & (sc.runtime.coeff("context_parallel") == 0),
          lambda cfg, sc: f"context parallelism is not supported by the {sc.runtime.name} "
                          f"runtime (--runtime {runtimes_running('context_parallel')} runs it)",
          lambda d: 1),
    _rule("config.cp", "cp",
          lambda c, sc: (c["cp"] > 1) & ((sc.model.family != "decoder")
                                         | (sc.workload.seq_len % (2 * c["cp"]) != 0)),
          lambda cfg, sc: (f"cp {cfg.cp} needs a decoder whose seq_len divides into 2 x cp "
                           f"chunks (the causal load balancer's head and tail; seq_len "
                           f"{sc.workload.seq_len}, family {sc.model.family})"),
          lambda d: 1),
    # hybrid sharding: dp = dp_replicate x (the shard group), the shard group counting the
    # context-parallel ranks (torchtitan's dp_replicate x dp_shard x cp); a shard group of one
    # rank is plain replication (DDP), ZeRO-0
    _rule("config.dp_replicate", "dp_replicate dp cp",
          lambda c, sc: (c["dp_replicate"] > 1) & ((c["dp"] % (c["dp_replicate"] * c["cp"]) != 0)
                                                   | (c["dp"] < 2 * c["dp_replicate"])),
          lambda cfg, sc: f"dp_replicate {cfg.dp_replicate} must divide dp / cp = "
                          f"{cfg.dp}/{cfg.cp} and leave a shard group of at least 2 ranks "
                          "(dp = dp_replicate x shard group, cp inside the group)",
          lambda d: 1),
    _rule("config.dp_replicate", "dp_replicate zero_stage",
          lambda c, sc: (c["dp_replicate"] > 1) & (c["zero_stage"] == 0),
          lambda cfg, sc: f"dp_replicate {cfg.dp_replicate} replicates a ZeRO-sharded group: "
                          "it needs zero_stage 1, 2 or 3 (without sharding every rank is a "
                          "replica already)",
          lambda d: 1),
    _rule("config.dp_replicate", "dp_replicate ep",
          lambda c, sc: (c["dp_replicate"] > 1) & (c["ep"] > 1),
          lambda cfg, sc: "hybrid sharding (dp_replicate > 1) with expert parallelism is not "
                          "priced: the experts' data-parallel group would span the replicas",
          lambda d: 1),
    _rule("config.dp_replicate", "dp_replicate",
          lambda c, sc: (c["dp_replicate"] > 1) & (sc.runtime.coeff("hybrid_shard") == 0),
          lambda cfg, sc: f"hybrid sharding (dp_replicate > 1) is not supported by the "
                          f"{sc.runtime.name} runtime (--runtime "
                          f"{runtimes_running('hybrid_shard')} runs it)",
          lambda d: 1),
    _rule("config.vpp", "vpp pp",
          lambda c, sc: (c["vpp"] > 1) & (c["pp"] == 1),
          lambda cfg, sc: f"vpp {cfg.vpp} needs pipeline parallelism (pp > 1)",
          lambda d: 1),
    _rule("config.vpp", "vpp",
          lambda c, sc: (c["vpp"] > 1) & (sc.runtime.coeff("interleaved_pipeline") == 0),
          lambda cfg, sc: f"interleaved pipeline stages (vpp > 1) are not supported by the "
                          f"{sc.runtime.name} runtime (--runtime "
                          f"{runtimes_running('interleaved_pipeline')} runs them)",
          lambda d: 1),
    # Megatron-Core's get_num_layers_to_build asserts an even split over pp x vpp chunks;
    # torchtitan's splitter (9dec370) splits unevenly, as its 405B run on 126 blocks did
    _rule("config.vpp", "vpp pp",
          lambda c, sc: (c["vpp"] > 1) & (
              ((sc.model.num_hidden_layers % (c["pp"] * c["vpp"]) != 0)
               & (sc.runtime.coeff("uneven_stages") == 0))
              | (c["pp"] * c["vpp"] > sc.model.num_hidden_layers)),
          lambda cfg, sc: (f"pp x vpp = {cfg.pp}*{cfg.vpp} must divide num_hidden_layers "
                           f"{sc.model.num_hidden_layers} (the {sc.runtime.name} runtime "
                           "splits blocks evenly over the virtual stages)"
                           if sc.runtime.coeff("uneven_stages") == 0 else
                           f"pp x vpp = {cfg.pp}*{cfg.vpp} must not exceed num_hidden_layers "
                           f"{sc.model.num_hidden_layers}"),
          lambda d: 1),
    # Megatron-Core's interleaved schedule runs micro-batches in groups of pp (its
    # microbatch_group_size_per_vp_stage defaults to pp) and refuses a remainder below pp;
    # torch's ScheduleInterleaved1F1B needs n_microbatches a multiple of max(1, m // pp):
    # a multiple of pp satisfies both
    _rule("config.vpp", "vpp pp grad_accum",
          lambda c, sc: (c["vpp"] > 1) & (c["grad_accum"] % c["pp"] != 0),
          lambda cfg, sc: f"vpp {cfg.vpp} needs grad_accum (micro-batches a step) a multiple "
                          f"of pp {cfg.pp}, got {cfg.grad_accum} (the interleaved schedule "
                          "runs micro-batches in groups of pp)",
          lambda d: 1),
    # an optimizer stepped in the backward pass (torchtitan's early_step_in_backward): it would
    # step every micro-batch, and torchtitan's build_optimizers refuses pp and ep with it
    _rule("config.grad_accum", "grad_accum",
          lambda c, sc: (c["grad_accum"] > 1) & sc.workload.optimizer_in_backward,
          lambda cfg, sc: f"grad_accum {cfg.grad_accum}: an optimizer stepped in the backward "
                          "pass would step every micro-batch (training.optimizer_in_backward "
                          "needs grad_accum 1)"),
    _rule("config.pp", "pp",
          lambda c, sc: (c["pp"] > 1) & sc.workload.optimizer_in_backward,
          lambda cfg, sc: "an optimizer stepped in the backward pass runs without pipeline "
                          "parallelism (torchtitan's build_optimizers refuses it)"),
    _rule("config.ep", "ep",
          lambda c, sc: (c["ep"] > 1) & sc.workload.optimizer_in_backward,
          lambda cfg, sc: "an optimizer stepped in the backward pass runs without expert "
                          "parallelism (torchtitan's build_optimizers refuses it)",
          lambda d: 1),
    _rule("config.sequence_parallel", "sequence_parallel tp",
          lambda c, sc: (c["sequence_parallel"] != 0) & (c["tp"] == 1),
          lambda cfg, sc: "sequence parallelism needs tp > 1",
          lambda d: False),
    # (Megatron's distributed optimizer runs over a group of one, ``zero1_single_rank``:
    # where the scenario names the stage; searched, it is stage 0's twin, left out)
    _rule("config.zero_stage", "zero_stage dp",
          lambda c, sc: ((c["zero_stage"] > 0) & (c["dp"] == 1)
                         & ~((c["zero_stage"] == 1)
                             & (sc.runtime.coeff("zero1_single_rank") >= 0.5)
                             & (sc.knob("zero_stage").values is not None))),
          lambda cfg, sc: "ZeRO sharding needs dp > 1" + (
              " (stage 1 at dp 1: " + runtimes_running("zero1_single_rank") + ")"
              if cfg.zero_stage == 1 else ""),
          lambda d: 0),
    # a runtime that shards every data-parallel group (torchtune's FSDP2): no replicas
    _rule("config.zero_stage", "zero_stage dp",
          lambda c, sc: ((c["zero_stage"] == 0) & (c["dp"] > 1)
                         & (sc.runtime.coeff("sharded_data_parallel_only") >= 0.5)),
          lambda cfg, sc: f"the {sc.runtime.name} runtime shards data parallelism with FSDP: "
                          f"dp {cfg.dp} needs zero_stage 2 or 3",
          lambda d: 3),
    _rule("config.zero_stage", "zero_stage pp",
          lambda c, sc: (c["pp"] > 1) & (c["zero_stage"] >= 2)
          & (sc.runtime.coeff("zero_pp_nosync") == 0),
          lambda cfg, sc: f"ZeRO-2/3 with pipeline parallelism is not supported by the "
                          f"{sc.runtime.name} runtime (Megatron-LM and DeepSpeed refuse it; "
                          "PyTorch's FSDP under a pipeline schedule, --runtime pytorch-eager "
                          "or torchtitan, runs it); use stage 0 or 1",
          lambda d: 1),
    # parameter offload (after the ZeRO rules, whose repairs move the stage), under the
    # stages `OFFLOAD_PARAMS_STAGES` names
    _rule("config.offload_params", "offload_params zero_stage",
          lambda c, sc: (c["offload_params"] != 0)
          & ~np.isin(c["zero_stage"], OFFLOAD_PARAMS_STAGES),
          lambda cfg, sc: f"offload_params needs {OFFLOAD_PARAMS_NEEDS} (got zero_stage "
                          f"{cfg.zero_stage}): "
                          "DeepSpeed offloads parameters with stage 3 only, and FSDP's "
                          "CPUOffloadPolicy is priced with full sharding",
          lambda d: False),
)

# the knobs of a config as integer columns (booleans as 0/1)
_INT_KNOBS = ("micro_batch", "grad_accum", "dp", "tp", "pp", "ep", "cp", "vpp", "zero_stage",
              "sequence_parallel", "dp_replicate", "offload_params")


def broken(cols: Columns, sc: Scenario, known: set[str] | frozenset | None = None
           ) -> np.ndarray:
    """True where a row of ``cols`` (equal-length integer arrays keyed by knob) breaks a rule;
    with ``known``, only the rules that read nothing but those knobs are applied (the
    search's lattice, filtered as it is built); without, a knob left out of ``cols`` holds
    its default (`Config`'s)."""
    arrays = {k: np.asarray(v, np.int64) for k, v in cols.items()}
    n = len(next(iter(arrays.values()))) if arrays else 0
    if known is None:
        default = Config()
        arrays.update({k: np.full(n, int(getattr(default, k)), np.int64)
                       for k in _INT_KNOBS if k not in arrays})
    out = np.zeros(n, bool)
    for rule in RULES:
        if rule.reads <= (known if known is not None else rule.reads):
            out |= np.broadcast_to(np.asarray(rule.broken(arrays, sc), bool), (n,))
    return out


def mend(knobs: dict, sc: Scenario, keep: str | None = None) -> dict:
    """``knobs`` (a `Config.to_dict()`) with every rule that has a repair mended, in the
    table's order, except the rules on ``keep`` (the knob a what-if holds): sequence
    parallelism off without tp, ZeRO off without dp, ZeRO-1 with pp, ep and cp down to what
    divides dp, cp off where the runtime or the model cannot run it. The rest (the device
    count, the batch) is the caller's to balance."""
    d = dict(knobs)
    for rule in RULES:
        knob = rule.field.split(".", 1)[1]
        if rule.repair is None or knob == keep:
            continue
        cols = {k: np.asarray([int(d[k])], np.int64) for k in rule.reads}
        if bool(np.asarray(rule.broken(cols, sc)).reshape(-1)[0]):
            d[knob] = rule.repair(d)
    return d


def config_problems(cfg: Config, sc: Scenario) -> list[tuple[str, str]]:
    """(field, why) for every rule ``cfg`` breaks in ``sc``, and every knob whose value the
    scenario does not allow; empty when the config is real."""
    cols = {k: np.asarray([int(getattr(cfg, k))], np.int64) for k in _INT_KNOBS}
    out = [(rule.field, rule.why(cfg, sc)) for rule in RULES
           if bool(np.asarray(rule.broken(cols, sc)).reshape(-1)[0])]
    for dom in sc.knobs:
        v = getattr(cfg, dom.name)
        if not dom.allows(v):
            out.append((f"config.{dom.name}", f"{v!r} is not among the scenario's allowed "
                                              f"values {list(dom.values)}"))
    return out


__all__ = ["RULES", "Rule", "broken", "config_problems", "mend"]
