"""Validation: compile and run the cost model's candidates as real Flax training steps.

`validate(scenario, tier=...)` measures each candidate in its own process and reports the
cost model's prediction next to XLA's numbers, term by term (see `predict` for the mapping):

- ``exact``: XLA's memory analysis on virtual CPU devices (parameters and optimizer state to
  the byte, sharded ones included);
- ``xla-gpu``: the same step compiled for the scenario's GPU without one (needs the CUDA PJRT
  plugin; see `tiers`);
- ``device``: a real accelerator: allocator peak, step time, NVML samples.

`calibrate` fits a runtime profile's coefficients to such measurements through the same JAX
cost model. The Flax models (`build_model`) and the training step (`build_step`) are public
for notebooks and benchmarks.
"""

from .calibrate import CalibrationResult, calibrate
from .models import Policy, abstract_model, build_model, count_params
from .predict import measured_terms, predicted_terms, relative_error
from .runner import ValidationReport, load_results, tier_scenario, validate
from .step import TrainStep, Unsupported, build_step
from .tiers import TIERS, xla_gpu_available

__all__ = sorted([
    "CalibrationResult", "Policy", "TIERS", "TrainStep", "Unsupported", "ValidationReport",
    "abstract_model", "build_model", "build_step", "calibrate", "count_params", "load_results",
    "measured_terms", "predicted_terms", "relative_error", "tier_scenario", "validate",
    "xla_gpu_available",
])
