"""What would make a scenario fit: each change re-optimised with the same cost model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .._errors import CapoptError
from .._specs import (OFFLOAD_PARAMS_STAGES, Config, KnobDomain, LoRA, Scenario, runtime_runs,
                      runtime_runs_config, training_choices)


def with_knob(sc: Scenario, name: str, values) -> Scenario:
    knobs = tuple(k for k in sc.knobs if k.name != name) + (KnobDomain(name, values),)
    return sc.replace(knobs=knobs)


def _workload(sc: Scenario, **changes) -> Scenario | None:
    """The scenario with ``changes`` to its workload, or None where its runtime refuses them
    (torchtune has no mixed precision: that remedy is not offered there)."""
    try:
        return sc.replace(workload=dataclasses.replace(sc.workload, **changes))
    except CapoptError:
        return None


FUSED_LOSS = "fused cross-entropy (loss = \"fused\": torch.compile'd loss, Liger, Apex)"
FUSED_LINEAR_LOSS = ("fused linear cross-entropy, logits never whole (loss = \"fused-linear\": "
                     "Liger's; tp 1)")


def _vocab_loss(sc: Scenario) -> bool:
    """A float32 cross-entropy over a vocabulary (decoders, masked-LM heads) in a PyTorch
    runtime, where a fused kernel would keep its logits in the compute dtype (the JAX
    validation step and the XLA profiles take optax's float32 loss)."""
    return (sc.workload.loss == "float32" and sc.workload.precision != "fp32"
            and not sc.runtime.xla_step and sc.model.has_vocab_head
            and sc.runtime.coeff("fused_loss") >= 0.5)


OFFLOAD_PARAMS = ("offload parameters, gradients and the optimizer step to host "
                  "(offload_params: FSDP's CPUOffloadPolicy, DeepSpeed's offload_param)")
OFFLOAD_ACTIVATIONS = ("offload activations to host memory (activation_offload: TRL's "
                       "activation_offloading)")


def _can_offload_activations(sc: Scenario) -> bool:
    """A runtime that offloads activations, not doing so yet (nor running the chunked loss,
    which is not priced with it)."""
    return (not sc.workload.activation_offload and sc.workload.loss != "chunked"
            and sc.runtime.coeff("activation_offload") >= 0.5)


DOUBLE_QUANT = "NF4 double quantisation (lora.double_quant: 8-bit block scales)"


def _double_quant(sc: Scenario) -> Scenario | None:
    """The scenario with its NF4 base's block scales quantised again."""
    return _workload(sc, lora=dataclasses.replace(sc.workload.lora, double_quant=True))


PAGED_OPTIMIZER = ("paged optimizer state (paged_optimizer: bitsandbytes' Paged*, the "
                   "Trainer's optim = \"paged_...\"; ZeRO 0, tp 1)")


def _can_page(sc: Scenario, cfg=None) -> bool:
    """A runtime that runs bitsandbytes' paged optimizers, an optimizer it pages, not paged
    yet, and a layout it steps (no ZeRO sharding, no tensor parallelism)."""
    from .._specs import PAGED_OPTIMIZERS
    w = sc.workload
    layout = (sc.knob("zero_stage").allows(0) and sc.knob("tp").allows(1) if cfg is None
              else cfg.zero_stage == 0 and cfg.tp == 1)
    return (not w.paged_optimizer and w.optimizer in PAGED_OPTIMIZERS
            and not w.optimizer_in_backward and layout
            and sc.runtime.coeff("paged_optimizer") >= 0.5)


def _head_loss(sc: Scenario) -> bool:
    """A loss over a vocabulary in a PyTorch runtime not yet fused with its head (the fused
    linear cross-entropy runs with the head whole: tp 1, which the changed scenario pins)."""
    return (sc.workload.loss != "fused-linear" and not sc.runtime.xla_step
            and sc.model.has_vocab_head and sc.knob("tp").allows(1)
            and sc.runtime.coeff("fused_linear_loss") >= 0.5)


def candidate_changes(sc: Scenario) -> list[tuple[str, Scenario]]:
    """(description, changed scenario) for every remedy that changes something."""
    w = sc.workload
    out: list[tuple[str, Scenario]] = []
    for factor in (2, 4):
        out.append((f"{factor}x the GPUs ({sc.count * factor})",
                    sc.replace(count=sc.count * factor,
                               knobs=tuple(k for k in sc.knobs if k.name not in ("dp",)))))
    if sc.knob("zero_stage").values not in (None,) and 3 not in sc.knob("zero_stage").values:
        out.append(("allow ZeRO-3 / FSDP", with_knob(sc, "zero_stage", None)))
    if sc.knob("remat").values is not None and "full" not in sc.knob("remat").values:
        out.append(("allow activation checkpointing", with_knob(sc, "remat", None)))
    for name in ("micro_batch", "grad_accum", "tp", "pp"):
        if sc.knob(name).values is not None and runtime_runs(sc.runtime, name, 2):
            out.append((f"let the optimiser choose {name}", with_knob(sc, name, None)))
    if (sc.knob("offload_optimizer").values != (False, True)
            and runtime_runs(sc.runtime, "offload_optimizer", True)):
        out.append(("offload optimizer state to host", with_knob(sc, "offload_optimizer",
                                                                 (False, True))))
    if (sc.knob("offload_params").values == (False,)
            and runtime_runs(sc.runtime, "offload_params", True)):
        out.append((OFFLOAD_PARAMS, with_knob(sc, "offload_params", (False, True))))
    if w.precision == "fp32":
        out.append(("bf16 mixed precision", _workload(sc, precision="bf16-mixed")))
    if w.precision in ("fp32", "bf16-mixed", "fp16-mixed"):
        out.append(("pure bf16 (no fp32 master weights)", _workload(sc, precision="bf16")))
    for opt in ("adamw-8bit", "adafactor", "sgd-momentum"):
        if w.optimizer in ("adamw", "adam", "lion") and opt != w.optimizer:
            out.append((f"lighter optimizer: {opt}", _workload(sc, optimizer=opt)))
    # (a [training] field the search chose already is not offered again)
    if _vocab_loss(sc) and "loss" not in sc.choices:
        out.append((FUSED_LOSS, _workload(sc, loss="fused")))
    if _head_loss(sc) and "loss" not in sc.choices:
        out.append((FUSED_LINEAR_LOSS, _workload(sc, loss="fused-linear")))
    if _can_offload_activations(sc) and "activation_offload" not in sc.choices:
        out.append((OFFLOAD_ACTIVATIONS, _workload(sc, activation_offload=True)))
    if _can_page(sc) and "paged_optimizer" not in sc.choices:
        out.append((PAGED_OPTIMIZER, _workload(sc, paged_optimizer=True)))
    if w.lora is None and sc.model.family != "mlp":
        out.append(("LoRA rank 16 on attention and MLP", _workload(sc, lora=LoRA(16))))
        out.append(("QLoRA: 4-bit base + LoRA rank 16", _workload(sc, lora=LoRA(16, base_bits=4))))
    elif w.lora is not None and w.lora.base_bits > 4:
        out.append(("QLoRA: 4-bit base", _workload(sc, lora=dataclasses.replace(w.lora,
                                                                                 base_bits=4))))
    elif w.lora is not None and not w.lora.double_quant:
        out.append((DOUBLE_QUANT, _double_quant(sc)))
    if sc.model.native_seq_len == 0 and w.seq_len >= 256:
        out.append((f"halve the sequence length ({w.seq_len // 2})",
                    _workload(sc, seq_len=w.seq_len // 2)))
    if w.global_batch % 2 == 0 and w.global_batch >= 2:
        out.append((f"halve the global batch ({w.global_batch // 2})",
                    _workload(sc, global_batch=w.global_batch // 2)))
    return [(desc, changed) for desc, changed in out if changed is not None]


@dataclass(frozen=True)
class Remedy:
    change: str
    scenario: Scenario               # the changed scenario
    fits: bool
    config: Config | None            # its best config (or its least-memory one)
    total_bytes: float | None
    tokens_per_s: float | None
    error: str | None = None
    training: dict | None = None     # the [training] values its best chose, where searched

    def to_dict(self) -> dict:
        return {"change": self.change, "fits": self.fits, "total_bytes": self.total_bytes,
                "tokens_per_s": self.tokens_per_s,
                "config": self.config.to_dict() if self.config else None,
                **({"training": self.training} if self.training else {}),
                **({"error": self.error} if self.error else {})}


def _changes_over_variants(sc: Scenario) -> list[tuple[str, Scenario]]:
    """`candidate_changes` of a scenario whose [training] fields are left to the optimiser:
    each change made to every workload variant of its first GPU and count, solved together
    (a change only another value of a searched field makes fit is found so). Without such
    variants, the scenario's own changes (a GPU fleet's first variant's)."""
    variants = [v for v in (sc.variants or (sc,))
                if (v.hardware, v.count) == (sc.hardware, sc.count)] or [sc]
    if not sc.choices or len(variants) < 2:
        return candidate_changes(variants[0])
    per = [dict(candidate_changes(v)) for v in variants]
    out = []
    for desc in per[0]:
        changed = [p[desc] for p in per if desc in p]
        out.append((desc, changed[0].replace(variants=tuple(changed))
                    if len(changed) > 1 else changed[0]))
    return out


def remedies(sc: Scenario, solve: Callable[..., Any], *, starts: int = 32) -> list[Remedy]:
    """Each change with whether it fits, its memory and its throughput; fitting ones first,
    fastest first. ``solve`` is `optimize` (passed in by it, so that this module does not
    import it back); ``starts`` is the main solve's (the same shapes: no second
    compilation)."""
    out = []
    for desc, changed in _changes_over_variants(sc):
        try:
            res = solve(changed, top_k=1, starts=starts, remedies=False)
        except CapoptError as e:   # a change the scenario cannot take is reported, not fatal
            out.append(Remedy(desc, changed, False, None, None, None, str(e)))
            continue
        plan = res.best or res.smallest
        out.append(Remedy(
            desc, changed, res.status == "ok", plan.config if plan else None,
            plan.memory["total_bytes"] if plan else None,
            plan.throughput["tokens_per_s"] if res.best else None,
            training=(training_choices(plan.scenario)
                      if plan is not None and plan.scenario.choices else None)))
    out.sort(key=lambda r: (not r.fits, -(r.tokens_per_s or 0.0),
                            r.total_bytes or float("inf")))
    return out


# --------------------------------------------------------------------------------------------
# Remedies for one pinned config (`capopt explain`)
# --------------------------------------------------------------------------------------------
def config_changes(sc: Scenario, cfg: Config) -> list[tuple[str, Scenario, Config]]:
    """Single changes to a concrete config: (description, scenario, config)."""
    w = sc.workload
    out: list[tuple[str, Scenario, Config]] = []
    if cfg.micro_batch > 1 and cfg.micro_batch % 2 == 0:
        out.append((f"micro_batch {cfg.micro_batch} -> {cfg.micro_batch // 2} with grad_accum "
                    f"{cfg.grad_accum} -> {cfg.grad_accum * 2}", sc,
                    cfg.replace(micro_batch=cfg.micro_batch // 2, grad_accum=cfg.grad_accum * 2)))
    for r in ("selective", "full"):
        if cfg.remat != r:
            out.append((f"activation checkpointing: {r}", sc, cfg.replace(remat=r)))
    if cfg.dp > 1:
        for z in range(cfg.zero_stage + 1, 4):
            if not (cfg.pp > 1 and z >= 2):
                out.append((f"ZeRO stage {z}" + (" (FSDP)" if z == 3 else ""), sc,
                            cfg.replace(zero_stage=z)))
    if not cfg.offload_optimizer:
        out.append(("offload optimizer state to host", sc, cfg.replace(offload_optimizer=True)))
    if not cfg.offload_params and cfg.zero_stage in OFFLOAD_PARAMS_STAGES:
        out.append((OFFLOAD_PARAMS, sc, cfg.replace(offload_params=True)))
    if cfg.tp > 1 and not cfg.sequence_parallel:
        out.append(("sequence parallelism", sc, cfg.replace(sequence_parallel=True)))
    if not cfg.flash_attention:
        out.append(("flash attention", sc, cfg.replace(flash_attention=True)))
    if w.precision == "fp32":
        out.append(("bf16 mixed precision", _workload(sc, precision="bf16-mixed"), cfg))
    if w.precision != "bf16":
        out.append(("pure bf16 (no fp32 master weights)", _workload(sc, precision="bf16"), cfg))
    for opt in ("adamw-8bit", "adafactor", "sgd-momentum"):
        if w.optimizer in ("adamw", "adam", "lion") and opt != w.optimizer:
            out.append((f"lighter optimizer: {opt}", _workload(sc, optimizer=opt), cfg))
    if _vocab_loss(sc):
        out.append((FUSED_LOSS, _workload(sc, loss="fused"), cfg))
    if _head_loss(sc) and cfg.tp == 1:
        out.append((FUSED_LINEAR_LOSS, _workload(sc, loss="fused-linear"), cfg))
    if _can_offload_activations(sc):
        out.append((OFFLOAD_ACTIVATIONS, _workload(sc, activation_offload=True), cfg))
    if _can_page(sc, cfg):
        out.append((PAGED_OPTIMIZER, _workload(sc, paged_optimizer=True), cfg))
    if w.lora is None and sc.model.family != "mlp":
        out.append(("LoRA rank 16", _workload(sc, lora=LoRA(16)), cfg))
        out.append(("QLoRA: 4-bit base + LoRA rank 16", _workload(sc, lora=LoRA(16, base_bits=4)),
                    cfg))
    elif w.lora is not None and not w.lora.double_quant:
        out.append((DOUBLE_QUANT, _double_quant(sc), cfg))
    if sc.model.native_seq_len == 0 and w.seq_len >= 256:
        out.append((f"sequence length {w.seq_len} -> {w.seq_len // 2}",
                    _workload(sc, seq_len=w.seq_len // 2), cfg))
    if cfg.micro_batch % 2 == 0 or cfg.grad_accum % 2 == 0:
        more = sc.replace(count=sc.count * 2)
        c2 = (cfg.replace(dp=cfg.dp * 2, micro_batch=cfg.micro_batch // 2)
              if cfg.micro_batch % 2 == 0 else
              cfg.replace(dp=cfg.dp * 2, grad_accum=cfg.grad_accum // 2))
        out.append((f"2x the GPUs ({sc.count * 2}), dp {cfg.dp} -> {cfg.dp * 2}", more, c2))
    # (not the changes the runtime refuses: torchtune's ZeRO-1, tensor parallelism, optimizer
    # offload, selective recomputation, mixed precision)
    return [(desc, s, c) for desc, s, c in out
            if s is not None and runtime_runs_config(s.runtime, c)]


def _real(cfg: Config, sc: Scenario) -> bool:
    """Whether ``cfg`` is a real config of ``sc`` whatever its knob domains say: explaining
    a config is exactly where changing a pinned knob is worth offering."""
    from .._validity import config_problems
    return not config_problems(cfg, sc.replace(knobs=()))


def _pinned_note(sc: Scenario, before: Config, after: Config) -> str:
    changed = [k for k, v in after.to_dict().items() if before.to_dict()[k] != v]
    pinned = [k for k in changed if sc.knob(k).values is not None
              and not sc.knob(k).allows(getattr(after, k))]
    return f" (changes {', '.join(pinned)}, pinned in the scenario)" if pinned else ""


def explain(sc: Scenario, cfg: Config) -> dict:
    """Why ``cfg`` does (not) fit, and the single changes that make it fit, each with the
    memory it saves and the throughput it costs; if none fits alone, a greedy combination."""
    from .._plan import plan as plan_one
    free = lambda s: s.replace(knobs=())  # noqa: E731
    base = plan_one(free(sc), cfg)
    b_mem, b_tps = base.memory["total_bytes"], base.throughput["tokens_per_s"]
    rows = []
    for desc, s2, c2 in config_changes(sc, cfg):
        if not _real(c2, s2):
            continue
        p = plan_one(free(s2), c2)
        rows.append({"change": desc + _pinned_note(sc, cfg, c2), "fits": p.fits,
                     "saves_bytes": b_mem - p.memory["total_bytes"],
                     "total_bytes": p.memory["total_bytes"],
                     "throughput_change": p.throughput["tokens_per_s"] / b_tps - 1.0,
                     "config": c2.to_dict(), "_scenario": free(s2), "_config": c2})
    rows.sort(key=lambda r: (not r["fits"], -r["throughput_change"], -r["saves_bytes"]))
    combo: list[str] = []
    combo_fits = None
    if not base.fits and not any(r["fits"] for r in rows):
        # first only changes to the config (the same training: layout, recomputation,
        # offload), then, if those cannot make it fit, changes to what is trained too
        for same_training in (True, False):
            combo, combo_fits = _greedy(sc, cfg, base, same_training, plan_one, free)
            if combo_fits:
                break
    return {"fits": base.fits, "total_bytes": b_mem, "budget_bytes": sc.budget.usable_bytes,
            "remedies": rows, "combination": combo, "combination_fits": combo_fits}


def _greedy(sc, cfg, base, same_training: bool, plan_one, free):
    """Changes taken one at a time, each the most memory saved per throughput lost."""
    combo: list[str] = []
    s_cur, c_cur, p_cur = sc, cfg, base
    for _ in range(6):
        opts = []
        for desc, s2, c2 in config_changes(s_cur, c_cur):
            if same_training and s2 is not s_cur:
                continue
            if not _real(c2, s2):
                continue
            p = plan_one(free(s2), c2)
            saved = p_cur.memory["total_bytes"] - p.memory["total_bytes"]
            cost = max(1e-6, 1 - p.throughput["tokens_per_s"] / p_cur.throughput["tokens_per_s"])
            if saved > 0:
                opts.append((saved / cost, desc, s2, c2, p))
        if not opts:
            break
        c_prev = c_cur
        _, desc, s_cur, c_cur, p_cur = max(opts, key=lambda o: o[0])
        combo.append(desc + _pinned_note(sc, c_prev, c_cur))
        if p_cur.fits:
            break
    return combo, p_cur.fits
