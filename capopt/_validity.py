"""Which integer configs are real: divisibility and device-count rules, shared by `plan`,
the optimiser's rounding and the exhaustive reference."""

from __future__ import annotations

from ._specs import Config, Scenario


def config_problems(cfg: Config, sc: Scenario) -> list[tuple[str, str]]:
    """(field, why) for every rule ``cfg`` breaks in ``sc``; empty when the config is real."""
    m, w = sc.model, sc.workload
    out: list[tuple[str, str]] = []
    if cfg.dp * cfg.tp * cfg.pp != sc.count:
        out.append(("config.dp", f"dp*tp*pp = {cfg.dp}*{cfg.tp}*{cfg.pp} = {cfg.devices} "
                                 f"must equal hardware.count {sc.count}"))
    if cfg.micro_batch * cfg.grad_accum * cfg.dp != w.global_batch:
        out.append(("config.micro_batch",
                    f"micro_batch*grad_accum*dp = {cfg.micro_batch}*{cfg.grad_accum}*{cfg.dp} "
                    f"must equal training.global_batch {w.global_batch}"))
    if m.family != "mlp" and m.num_attention_heads % cfg.tp:
        out.append(("config.tp", f"tp {cfg.tp} must divide num_attention_heads "
                                 f"{m.num_attention_heads}"))
    if m.family != "mlp" and m.kv_heads % cfg.tp and cfg.tp % m.kv_heads:
        out.append(("config.tp", f"tp {cfg.tp} and num_key_value_heads {m.kv_heads} must "
                                 f"divide one another"))
    if cfg.tp > sc.per_node:
        out.append(("config.tp", f"tp {cfg.tp} must fit in a node ({sc.per_node} devices)"))
    if m.num_hidden_layers % cfg.pp:
        out.append(("config.pp", f"pp {cfg.pp} must divide num_hidden_layers "
                                 f"{m.num_hidden_layers}"))
    if cfg.ep > 1 and (m.num_local_experts % cfg.ep or cfg.dp % cfg.ep):
        out.append(("config.ep", f"ep {cfg.ep} must divide num_local_experts "
                                 f"{m.num_local_experts} and dp {cfg.dp}"))
    if cfg.sequence_parallel and cfg.tp == 1:
        out.append(("config.sequence_parallel", "sequence parallelism needs tp > 1"))
    if cfg.zero_stage > 0 and cfg.dp == 1:
        out.append(("config.zero_stage", "ZeRO sharding needs dp > 1"))
    if cfg.pp > 1 and cfg.zero_stage >= 2:
        out.append(("config.zero_stage", "ZeRO-2/3 with pipeline parallelism is not supported "
                                         "by Megatron-LM or DeepSpeed; use stage 0 or 1"))
    for dom in sc.knobs:
        v = getattr(cfg, dom.name)
        if not dom.allows(v):
            out.append((f"config.{dom.name}", f"{v!r} is not among the scenario's allowed "
                                              f"values {list(dom.values)}"))
    return out
