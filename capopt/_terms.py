"""The names of the cost model's memory and time terms and the words the reports use for them.

One home for both: the cost model's `Plan.memory` and `time_terms` are keyed by these names,
the command line's tables and the figures print these labels, and a test checks that every
term the model returns has one.
"""

from __future__ import annotations

# (term, label), in the order a breakdown lists them; they add up to the per-device total
MEMORY_LABELS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"),
                 ("optimizer_bytes", "optimizer state"), ("activations_bytes", "activations"),
                 ("logits_bytes", "logits / loss"), ("comm_bytes", "communication buffers"),
                 ("overhead_bytes", "runtime overhead"))
MEMORY_TERMS = tuple(term for term, _ in MEMORY_LABELS)

# (kind, label) of each collective the time model prices
COMM_LABELS = (("dp", "data-parallel gradients"), ("zero", "ZeRO collectives"),
               ("tp", "tensor-parallel"), ("pp", "pipeline sends"), ("moe", "MoE all-to-all"),
               ("cp", "context-parallel keys / values"))
COMM_KINDS = tuple(kind for kind, _ in COMM_LABELS)

# the terms whose sum (less what overlaps) is the step
STEP_TERMS = ("compute_s", "memory_bound_s", *(f"comm_{k}_s" for k in COMM_KINDS),
              "bubble_s", "optimizer_s", "offload_s")

# (term, label, indent): the terms that add up to the step, each followed by its named parts
TIME_LABELS = (("compute_s", "compute (matmuls, attention)", 0),
               ("memory_bound_s", "memory-bound ops", 0),
               ("grad_accum_s", "of which gradient accumulation", 1),
               ("dequant_s", "of which 4-bit weight dequantisation", 1),
               ("comm_exposed_s", "communication, exposed", 0),
               *((f"comm_{k}_s", label, 1) for k, label in COMM_LABELS),
               ("bubble_s", "pipeline bubble", 0),
               ("optimizer_s", "optimizer update", 0),
               ("offload_s", "offload (host link)", 0),
               ("paging_s", "of which paged optimizer state", 1))

__all__ = ["COMM_KINDS", "COMM_LABELS", "MEMORY_LABELS", "MEMORY_TERMS", "STEP_TERMS",
           "TIME_LABELS"]
