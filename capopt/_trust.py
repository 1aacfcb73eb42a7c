"""How far to trust one answer: the held-out errors measured for its runtime and layout.

``data/trust.json`` is written by ``benchmarks/trust_table.py`` from the committed results of
the random-config benchmarks (each runtime profile against its own oracle, which the table
names per runtime: ``ORACLES`` in that script) and of the published training runs
(``published_runs.py``). Nothing here is computed from the cost model:
it is what the benchmarks measured, looked up for the config at hand.

Memory figures are grouped by layout, the way the oracle draws were made: one device; data
parallelism with replicated state (ZeRO-0/1); data parallelism with sharded state (ZeRO-2/3,
FSDP); tensor parallelism (with or without data parallelism). No oracle draw has pipeline or
context parallelism: configs with either get the runtime's figures over every layout, said so.
Signed errors are predicted / measured - 1: a negative one is an under-prediction.

    >>> from capopt._specs import Config
    >>> config_group(Config(micro_batch=1, dp=8, zero_stage=3))
    'data parallel, sharded'
"""

from __future__ import annotations

import functools
import json
from importlib import resources

#: The layout groups, in the order tables list them.
GROUPS = ("one device", "data parallel, replicated", "data parallel, sharded",
          "tensor parallel")


def config_group(config) -> str | None:
    """The layout group of ``config``; None where no oracle draw has its layout (pipeline or
    context parallelism)."""
    if getattr(config, "pp", 1) > 1 or getattr(config, "cp", 1) > 1:
        return None
    if config.tp > 1:
        return "tensor parallel"
    if config.dp == 1:
        return "one device"
    return ("data parallel, sharded" if config.zero_stage >= 2
            else "data parallel, replicated")


#: The features of an answer the random-config benchmarks also file their points under, with
#: the same labels (`answer_features`; `capopt.validation.random_configs.features` writes
#: them with it): what the workload and the config decide, not the card's shape.
FEATURES = ("optimizer", "clipping", "grad_accum", "precision", "remat", "flash", "lora")
#: Fewer held-out points than this under a feature's label say too little to print.
MIN_FEATURE_POINTS = 5


def answer_features(workload, config) -> dict[str, str]:
    """The labels of `FEATURES` for ``workload`` and ``config``, as the benchmarks write them.

    >>> from capopt._specs import Config, Workload
    >>> answer_features(Workload(seq_len=512, global_batch=8, optimizer="lion"),
    ...                 Config(micro_batch=2, grad_accum=4, remat=0.5))["remat"]
    'fraction'
    """
    r = config.remat
    lora = workload.lora
    return {"optimizer": workload.optimizer,
            "clipping": "clip" if workload.grad_clip else "no clip",
            "grad_accum": f"accum {config.grad_accum}", "precision": workload.precision,
            "remat": r if isinstance(r, str) else "fraction",
            "flash": "flash" if config.flash_attention else "materialised",
            "lora": ("none" if lora is None else
                     {16: "LoRA", 8: "LoRA int8", 4: "QLoRA"}.get(lora.base_bits, "LoRA"))}


def generation(compute_capability: str | None) -> str | None:
    """The GPU generation the published runs are grouped by (CUDA compute capability)."""
    if not compute_capability or not compute_capability[0].isdigit():
        return None
    major = compute_capability.split(".")[0]
    return {"8": "Ampere" if compute_capability in ("8.0", "8.6", "8.7") else None,
            "9": "Hopper", "10": "Blackwell"}.get(major)


def table_path():
    return resources.files(__package__) / "data" / "trust.json"


@functools.lru_cache(maxsize=1)
def load_table() -> dict:
    """``data/trust.json`` (empty sections where the file is absent)."""
    path = table_path()
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {"memory": {}, "throughput": {}}


def grown(peak: float, shortfall: float) -> float | None:
    """The peak a prediction of ``peak`` stands for were it short by ``shortfall`` (predicted /
    measured - 1 = -shortfall): ``peak / (1 - shortfall)``; None from 100% on (nothing
    bounds it, and JSON has no infinity)."""
    return peak / (1.0 - shortfall) if shortfall < 1.0 else None


def feature_figures(mem: dict, labels: dict[str, str]) -> list[dict]:
    """The held-out figures of a runtime's memory section (``mem``) under each of ``labels``
    (`answer_features`) that has at least `MIN_FEATURE_POINTS` points, the feature whose
    points fell shortest first (the largest 90th-percentile shortfall, then the largest
    under-prediction)."""
    out = []
    for key, label in labels.items():
        s = mem.get("features", {}).get(key, {}).get(label)
        if s and s["n"] >= MIN_FEATURE_POINTS:
            out.append({"feature": key, "label": label, "stats": s})
    return sorted(out, key=lambda f: (-f["stats"].get("p90_under", 0.0),
                                      f["stats"].get("worst_under", 0.0)))


def trust_for(runtime: str, gpu: str, compute_capability: str | None, config,
              workload=None) -> dict:
    """The held-out figures for ``config`` under ``runtime`` on ``gpu``: ``memory`` (the
    oracle, the group and its figures; the runtime's figures over every layout beside them;
    with ``workload``, the figures of each of the answer's features, `feature_figures`) and
    ``throughput`` (the published runs of the runtime's framework, and of the GPU or its
    generation), and ``answers`` (the runtime's own answers to the shipped scenarios compiled
    on its oracle). A part is None where nothing was measured."""
    tab = load_table()
    out: dict = {"runtime": runtime, "memory": None, "throughput": None}
    mem = tab.get("memory", {}).get(runtime)
    if mem:
        group = config_group(config)
        stats = mem["groups"].get(group) if group else None
        out["memory"] = {"runtime": runtime, "oracle": mem["oracle"], "tier": mem["tier"],
                         "group": group, "stats": stats, "all": mem["all"],
                         "features": ([] if workload is None else
                                      feature_figures(mem, answer_features(workload, config)))}
    # the runtime's own answers compiled on its oracle (full size, near their budgets)
    out["answers"] = tab.get("answers", {}).get(runtime)
    thr = tab.get("throughput", {})
    if thr:
        fw = thr.get("frameworks", {}).get(runtime)
        gen = generation(compute_capability)
        on_gpu, on_gen = thr.get("gpus", {}).get(gpu), thr.get("generations", {}).get(gen)
        where, stats = None, None
        if on_gpu and on_gpu.get("n"):
            where, stats = f"on {gpu}", on_gpu
        elif gen and on_gen:
            where, stats = f"on {gen} GPUs", on_gen
        if fw or stats:
            out["throughput"] = {"framework": runtime if fw else None, "framework_stats": fw,
                                 "where": where, "stats": stats, "source": thr["source"]}
    return out


def answer_trust(scenario, config, total_bytes: float) -> dict:
    """`trust_for` the scenario's runtime and GPU, and what the predicted per-device peak
    ``total_bytes`` would be were it short by the group's 90th-percentile shortfall (in 9 of 10
    held-out points the prediction fell short of the measured peak by at most that share of
    it) and by its largest under-prediction (None where that is 100% or more), against the
    scenario's usable budget and the device's memory."""
    hw = scenario.hardware
    out = trust_for(scenario.runtime.name, hw.name, hw.compute_capability, config,
                    scenario.workload)
    mem = out["memory"]
    if mem:
        s = mem["stats"] or mem["all"]
        at_p90 = grown(total_bytes, s.get("p90_under", 0.0))
        at_worst = grown(total_bytes, -s.get("worst_under", 0.0))
        # (the compiling tiers target a CUDA GPU; the PyTorch and DeepSpeed ones any device)
        cuda = hw.vendor == "nvidia" and (hw.compute_capability or "")[:1].isdigit()
        mem.update(validate_tier=(mem["tier"] if cuda or mem["tier"] in ("torch", "deepspeed")
                                  else None),
                   predicted_bytes=float(total_bytes), at_p90_under_bytes=at_p90,
                   at_worst_under_bytes=at_worst,
                   budget_bytes=float(scenario.budget.usable_bytes),
                   device_bytes=float(hw.memory_bytes))
    return out


__all__ = ["FEATURES", "GROUPS", "MIN_FEATURE_POINTS", "answer_features", "answer_trust",
           "config_group", "feature_figures", "generation", "grown", "load_table", "table_path",
           "trust_for"]
