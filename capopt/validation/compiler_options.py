"""The XLA compiler options the xla-gpu tier compiles a step with, beyond the defaults.

One place for them: the tier passes them to ``lowered.compile`` and records them with each
measurement, and the prediction of that measurement (`capopt.validation.predict`) reads the
record to price what they change.
"""

from __future__ import annotations

# XLA's GPU compiler with autotuning off can fail to tile a small float32 or pure-bf16 GEMM for
# its Triton emitter (``INTERNAL: Couldn't find output tile sizes that satisfy hlo``); the same
# step compiles with Triton GEMMs off (cuBLAS for every dot). The tier then retries once with
# these options and records them, so no measurement is lost.
GEMM_TILING_ERROR = "Couldn't find output tile sizes"
GEMM_RETRY_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


# XLA's latency-hiding scheduler reorders a step that has collectives to overlap them with
# compute, and spends the card's spare memory doing it (`capopt.validation.xla_log`). It runs
# for Hopper and Blackwell targets because its analytical ("speed of light") latency estimator
# supports them (``IsLHSEnabled``, xla/service/gpu/gpu_hlo_schedule.cc; the
# ``xla_gpu_enable_latency_hiding_scheduler`` flag is off already). With this option off the
# memory scheduler's order is compiled as it is: the step's peak without the overlap.
NO_LATENCY_HIDING_OPTIONS = {"xla_gpu_enable_analytical_sol_latency_estimator": False}
