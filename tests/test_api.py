"""The public API: what ``import capopt`` offers is what the README lists, and the light
wrappers there take the same parameters as the functions they call."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import capopt

README = Path(__file__).resolve().parents[1] / "README.md"


def test_capopt_all_is_what_the_readme_documents():
    text = README.read_text()
    section = text.split("The public names of `capopt`:", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"`([A-Za-z_]+)`", section))
    assert documented == set(capopt.__all__)
    assert all(hasattr(capopt, name) for name in capopt.__all__)


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_optimize_and_validate_take_the_parameters_of_what_they_call():
    from capopt.search.optimize import optimize
    from capopt.validation.runner import validate
    assert _params(capopt.optimize) == _params(optimize)
    assert _params(capopt.validate) == _params(validate)
