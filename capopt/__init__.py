"""capopt: the fastest training configuration that fits your GPU memory budget.

``import capopt`` is light: it loads the specs and the cost model (JAX on the CPU is enough);
the CLI, plotting, validation and GPU tools load on first use.
"""

from ._cards import list_cards, load_card
from ._errors import CapoptError, InfeasibleError
from ._hardware import Hardware, get_hardware, list_hardware
from ._model import ModelSpec
from ._plan import Plan, plan
from ._runtime import RuntimeProfile, get_profile, list_profiles
from ._scenario import list_scenarios, load_scenario
from ._specs import Budget, Config, LoRA, Scenario, Workload
from .cost import Estimate, estimate

__version__ = "0.1.0"


def optimize(scenario, **options):
    """Find the fastest config that fits; see `capopt.search.optimize`."""
    from .search import optimize as _optimize
    return _optimize(scenario, **options)


def validate(scenario, **options):
    """Compile (and on a GPU, run) candidates as real Flax steps; see `capopt.validate`."""
    from .validation import validate as _validate
    return _validate(scenario, **options)


__all__ = sorted([
    "Budget", "CapoptError", "Config", "Estimate", "Hardware", "InfeasibleError", "LoRA",
    "ModelSpec", "Plan", "RuntimeProfile", "Scenario", "Workload", "estimate", "get_hardware",
    "get_profile", "list_cards", "list_hardware", "list_profiles", "list_scenarios",
    "load_card", "load_scenario", "optimize", "plan", "validate",
])
