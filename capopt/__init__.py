"""capopt: the fastest training configuration that fits your GPU memory budget.

``import capopt`` is light: it loads the specs and catalogs; the cost model (and JAX with it)
loads on first use of `plan`, `estimate` or `optimize`, and the CLI, plotting, validation and
GPU tools when they are used.
"""

from ._cards import list_cards, load_card
from ._errors import CapoptError, InfeasibleError
from ._hardware import Hardware, get_hardware, list_hardware
from ._model import ModelSpec
from ._runtime import RuntimeProfile, get_profile, list_profiles
from ._scenario import list_scenarios, load_scenario
from ._specs import Budget, Config, LoRA, Scenario, Workload

# Names whose modules import JAX: loaded when first asked for.
_LAZY = {"Plan": "._plan", "plan": "._plan", "Estimate": ".cost", "estimate": ".cost"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'capopt' has no attribute {name!r}")

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
