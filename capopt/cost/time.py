"""Step time and throughput (to be replaced by the full model: compute, memory-bound ops,
communication, pipeline bubble, offload, input pipeline)."""

from __future__ import annotations

from ._inputs import Knobs


def time_terms(k: Knobs, n, mem: dict) -> tuple[dict, dict]:
    """Return (time, throughput) dicts of scalars for one step."""
    tokens = n["B"] * n["s"]
    flops = 6.0 * n["P_active"] * tokens
    devices = k.dp * k.tp * k.pp
    compute_s = flops / (devices * n["matmul_peak"] * 0.5)
    step_s = compute_s
    tps = tokens / step_s
    return ({"compute_s": compute_s, "step_s": step_s},
            {"tokens_per_s": tps, "tokens_per_s_per_device": tps / devices,
             "mfu": flops / step_s / (devices * n["matmul_peak"])})
