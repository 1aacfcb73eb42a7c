"""capopt: the fastest training configuration that fits your GPU memory budget.

``import capopt`` is light: it loads the specs and catalogs; the cost model (and JAX with it)
loads on first use of `plan`, `estimate` or `optimize`, and the CLI, plotting, validation and
GPU tools when they are used. `render` turns any result into the table the CLI prints.
"""

from ._cards import list_cards, load_card
from ._errors import CapoptError
from ._hardware import Hardware, get_hardware, list_hardware
from ._model import ModelSpec
from ._runtime import RuntimeProfile, get_profile, list_profiles
from ._scenario import list_scenarios, load_scenario
from ._specs import Budget, Config, LoRA, Scenario, Workload
from .report import render

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


# `optimize` and `validate` take the parameters of the functions they call, written out (a
# test checks that they are the same), so that help() shows them without importing JAX.
def optimize(scenario=None, *, top_k=5, method="gradient", seed=0, starts=32, steps=300,
             optimizer=None, polish=True, remedies=True, exhaustive_below=None):
    """The fastest configs that fit: `capopt.search.optimize.optimize`, which says more."""
    from .search.optimize import optimize as _optimize
    return _optimize(scenario, top_k=top_k, method=method, seed=seed, starts=starts,
                     steps=steps, optimizer=optimizer, polish=polish, remedies=remedies,
                     exhaustive_below=exhaustive_below)


def validate(scenario, *, top_k=3, tier="exact", configs=None, out=None, timeout_s=900.0,
             progress=True, profile=None, retry=False, jobs=1, options=None, ray=None):
    """Compile (and on a GPU, run) candidates as real Flax training steps and compare XLA's
    memory with the prediction: `capopt.validation.runner.validate`, which says more."""
    from .validation.runner import validate as _validate
    return _validate(scenario, top_k=top_k, tier=tier, configs=configs, out=out,
                     timeout_s=timeout_s, progress=progress, profile=profile, retry=retry,
                     jobs=jobs, options=options, ray=ray)


__all__ = sorted([
    "Budget", "CapoptError", "Config", "Estimate", "Hardware", "LoRA", "ModelSpec", "Plan",
    "RuntimeProfile", "Scenario", "Workload", "estimate", "get_hardware", "get_profile",
    "list_cards", "list_hardware", "list_profiles", "list_scenarios", "load_card",
    "load_scenario", "optimize", "plan", "render", "validate",
])
