"""The deepspeed tier: DeepSpeed's own training step of a candidate, metered.

What runs is the torch tier's model (`capopt.validation.torch_models`, real CPU tensors) under
``deepspeed.initialize`` with the JSON capopt writes for the candidate (``--emit deepspeed``,
`capopt.report.launch`): DeepSpeed's engine casts the model to bf16 or fp16 (bf16-mixed,
fp16-mixed) and keeps its own fp32 master copy, its ZeRO optimizer (stage 0-3) flattens,
partitions and buckets as its code does, and its Adam is DeepSpeed's ``FusedAdam``. A step is
``grad_accum`` micro-batches of ``engine(ids)``, a float32 cross-entropy,
``engine.backward(loss)`` and ``engine.step()`` (the update at the last one); a first step
creates the optimizer state, the second is metered by
`capopt.validation.torch_memory.LiveBytes` (every storage an aten op returns, freed when the
last tensor on it dies). fp32 and bf16-mixed run (DeepSpeed's CPU accelerator refuses fp16;
its ZeRO layout is bf16's).

Data parallelism is PyTorch's fake process group: this process is rank 0 of ``dp``, DeepSpeed
partitions and buckets for ``dp`` ranks, the collectives move nothing. The tensors are real
(CPU), so the model must be small; one process runs one candidate (DeepSpeed's engine and the
process group are global state): the validation runner's worker
(`capopt.validation.runner.run_deepspeed`, or ``capopt validate --tier deepspeed``).

Limits (what a GPU would do differently): the CPU's attention kernels and no CUDA context,
NCCL or cuBLAS workspaces; the live tensor bytes are measured, not the caching allocator's.
Recomputation is the model's (``torch.utils.checkpoint`` per block, as Hugging Face's
gradient checkpointing), which DeepSpeed's JSON does not switch.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .._specs import Config, Scenario

# (fp16: DeepSpeed's CPU accelerator refuses it, engine._do_sanity_check)
PRECISIONS = ("fp32", "bf16-mixed")
OPTIMIZERS = ("adamw", "adam")
MAX_PARAMS = 200_000_000        # real CPU tensors: a few GB at most for the step


from .step import Unsupported as _StepUnsupported


class Unsupported(_StepUnsupported, ValueError):
    """A candidate this tier does not run."""


def check_supported(scenario: Scenario, config: Config) -> None:
    """Raise `Unsupported` for what the deepspeed tier does not run."""
    w = scenario.workload
    if w.precision not in PRECISIONS:
        raise Unsupported(f"the deepspeed tier runs precisions {', '.join(PRECISIONS)}, not "
                          f"{w.precision!r}")
    if w.optimizer not in OPTIMIZERS:
        raise Unsupported(f"the deepspeed tier runs DeepSpeed's Adam ({', '.join(OPTIMIZERS)}), "
                          f"not {w.optimizer!r}")
    if w.lora is not None:
        raise Unsupported("the deepspeed tier runs full fine-tuning (no LoRA)")
    if config.flash_attention and scenario.model.attention_dropout > 0:
        raise Unsupported("the CPU's flash attention kernel runs no attention dropout: "
                          "materialised attention on such a card")
    if w.loss == "fused":
        raise Unsupported("the deepspeed tier runs the plain cross-entropy")
    if w.compile:
        raise Unsupported("the deepspeed tier runs the step eagerly, not compiled")
    if config.tp > 1 or config.pp > 1 or config.ep > 1 or config.cp > 1 or config.vpp > 1:
        raise Unsupported("the deepspeed tier runs data parallelism only (tp = pp = ep = cp = "
                          "vpp = 1)")
    if config.offload_optimizer or config.offload_params:
        raise Unsupported("the deepspeed tier runs without offload")
    if config.dp_replicate > 1 or w.optimizer_in_backward:
        raise Unsupported("the deepspeed tier runs neither hybrid sharding nor an optimizer "
                          "stepped in the backward pass")
    if config.zero_stage and config.dp < 2:
        raise Unsupported("ZeRO needs dp > 1")
    if scenario.model.num_params() > MAX_PARAMS:
        raise Unsupported(f"the deepspeed tier allocates real tensors: at most {MAX_PARAMS:,} "
                          f"parameters, not {scenario.model.num_params():,}")
    from .torch_models import check_spec
    check_spec(scenario.model)


def deepspeed_config(scenario: Scenario, config: Config) -> dict:
    """The JSON capopt emits for the candidate (its recomputation and attention kernel are
    the model's, not the JSON's: the file is written for the same config without them)."""
    import dataclasses
    from ..report.launch import emit
    plain = dataclasses.replace(config, remat="none", flash_attention=True)
    out = json.loads(emit("deepspeed", plain, scenario))
    out.update(steps_per_print=10 ** 9, wall_clock_breakdown=False)
    return out


def measure_here(scenario: Scenario, config: Config, explain: bool = False) -> dict[str, Any]:
    """The metered step, in this process: one only per process (DeepSpeed's engine and the
    process group are global state: the runner's worker process runs it)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .step import remat_plan
    from .torch_memory import LiveBytes
    from .torch_models import build_torch_model

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(config.dp),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.dp)
    import deepspeed
    deepspeed.init_distributed(dist_backend="fake")

    spec = scenario.model
    t0 = time.perf_counter()
    torch.manual_seed(0)
    plan = remat_plan(config, spec.num_hidden_layers)
    model = build_torch_model(spec, flash=config.flash_attention, checkpoint=plan,
                              param_dtype=torch.float32)
    model.train()
    ds_config = deepspeed_config(scenario, config)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters()], config=ds_config)
    b, s, vocab = config.micro_batch, scenario.seq_len, spec.vocab_size

    def one_step(meter=None):
        for _ in range(config.grad_accum):
            if meter is not None:
                meter.set_phase("data")
            ids = torch.randint(0, vocab, (b, s))
            labels = torch.randint(0, vocab, (b, s))
            if meter is not None:
                meter.mark([ids, labels], "inputs")
                meter.set_phase("forward")
            logits = engine(ids)
            if meter is not None:
                meter.set_phase("loss")
            loss = F.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
            del logits
            if meter is not None:
                meter.set_phase("backward")
            engine.backward(loss)
            del loss
            if meter is not None:
                meter.set_phase("update")
            engine.step()

    one_step()                       # creates the optimizer state: the metered step is steady
    import gc
    gc.collect()
    meter = LiveBytes()
    meter.explain = explain
    with meter:
        params = [p for p in engine.module.parameters()]
        held = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        meter.register(params, "params")
        meter.register(held, "optimizer")     # the engine's flat buffers, partitions, state
        meter.reset_peak()
        one_step(meter)
        meter.set_phase("done")
    by_cat = meter.breakdown()
    measured = {"peak_bytes": int(meter.peak), "params_bytes": by_cat["params"],
                "optimizer_bytes": by_cat["optimizer"], "input_bytes": by_cat["inputs"],
                "rest_bytes": sum(v for k, v in by_cat.items()
                                  if k not in ("params", "optimizer", "inputs"))}
    details = {"peak_phase": meter.peak_phase, "phase_peaks": dict(meter.phase_peaks),
               "optimizer": type(optimizer).__name__, "deepspeed": deepspeed.__version__,
               "torch": torch.__version__, "step_s": time.perf_counter() - t0,
               "remat": list(plan), "config": ds_config}
    if explain:
        rows = [(meter.category(sid), *meter.origin.get(sid, ("(before the step)", "", ())),
                 nbytes) for sid, nbytes in meter.live_at_peak().items()]
        details["live_at_peak"] = sorted(rows, key=lambda r: -r[-1])
    return {"measured": measured, "details": details}


__all__ = ["OPTIMIZERS", "PRECISIONS", "Unsupported", "check_supported", "deepspeed_config",
           "measure_here"]
