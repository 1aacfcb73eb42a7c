"""What would make a scenario fit: each change re-optimised with the same cost model."""

from __future__ import annotations

import dataclasses

from .._specs import KnobDomain, LoRA, Scenario


def with_knob(sc: Scenario, name: str, values) -> Scenario:
    knobs = tuple(k for k in sc.knobs if k.name != name) + (KnobDomain(name, values),)
    return sc.replace(knobs=knobs)


def _workload(sc: Scenario, **changes) -> Scenario:
    return sc.replace(workload=dataclasses.replace(sc.workload, **changes))


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
        if sc.knob(name).values is not None:
            out.append((f"let the optimiser choose {name}", with_knob(sc, name, None)))
    if sc.knob("offload_optimizer").values != (False, True):
        out.append(("offload optimizer state to host", with_knob(sc, "offload_optimizer",
                                                                 (False, True))))
    if w.precision == "fp32":
        out.append(("bf16 mixed precision", _workload(sc, precision="bf16-mixed")))
    if w.precision in ("fp32", "bf16-mixed", "fp16-mixed"):
        out.append(("pure bf16 (no fp32 master weights)", _workload(sc, precision="bf16")))
    for opt in ("adamw-8bit", "adafactor", "sgd-momentum"):
        if w.optimizer in ("adamw", "adam", "lion") and opt != w.optimizer:
            out.append((f"lighter optimizer: {opt}", _workload(sc, optimizer=opt)))
    if w.lora is None and sc.model.family != "mlp":
        out.append(("LoRA rank 16 on attention and MLP", _workload(sc, lora=LoRA(16))))
        out.append(("QLoRA: 4-bit base + LoRA rank 16", _workload(sc, lora=LoRA(16, base_bits=4))))
    elif w.lora is not None and w.lora.base_bits > 4:
        out.append(("QLoRA: 4-bit base", _workload(sc, lora=dataclasses.replace(w.lora,
                                                                                 base_bits=4))))
    if sc.model.native_seq_len == 0 and w.seq_len >= 256:
        out.append((f"halve the sequence length ({w.seq_len // 2})",
                    _workload(sc, seq_len=w.seq_len // 2)))
    if w.global_batch % 2 == 0 and w.global_batch >= 2:
        out.append((f"halve the global batch ({w.global_batch // 2})",
                    _workload(sc, global_batch=w.global_batch // 2)))
    return out


def remedies(sc: Scenario, *, starts: int = 8) -> list[dict]:
    """Each change with whether it fits, its memory and its throughput; fitting ones first,
    fastest first."""
    from .optimize import optimize
    out = []
    for desc, changed in candidate_changes(sc):
        try:
            res = optimize(changed, top_k=1, starts=starts, remedies=False)
        except Exception as e:   # noqa: BLE001 - a remedy that cannot be evaluated is reported
            out.append({"change": desc, "fits": False, "error": str(e), "total_bytes": None,
                        "tokens_per_s": None, "config": None})
            continue
        plan = res.best or res.smallest
        out.append({
            "change": desc, "fits": res.status == "ok",
            "total_bytes": plan.memory["total_bytes"] if plan else None,
            "tokens_per_s": plan.throughput["tokens_per_s"] if res.best else None,
            "config": plan.config.to_dict() if plan else None})
    out.sort(key=lambda r: (not r["fits"], -(r["tokens_per_s"] or 0.0),
                            r["total_bytes"] or float("inf")))
    return out
