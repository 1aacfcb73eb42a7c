"""The cost model: pure `jax.numpy`, no I/O."""

from ._inputs import Knobs, knobs_from_config, numbers_pytree, scenario_numbers, stack_knobs
from .estimate import estimate
from .model import Estimate, estimate_numbers

__all__ = ["Estimate", "Knobs", "estimate", "estimate_numbers", "knobs_from_config",
           "numbers_pytree", "scenario_numbers", "stack_knobs"]
