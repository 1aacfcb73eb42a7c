"""What capopt shows: text tables (`text`) and figures (`figures`, which needs matplotlib).

The command line and the notebooks call these; nothing below them does. `render` picks the
table for any result:

    >>> import capopt
    >>> from capopt.report import render
    >>> print(render(capopt.optimize("gpt2-124m-rtx4090")))             # doctest: +SKIP
"""

from __future__ import annotations

from .text import (calibration_table, optimize_table, plan_table, time_rows, trust_lines,
                   validation_table, why_lost)


def render(result, title: str | None = None) -> str:
    """The text table of an `OptimizeResult`, a `ValidationReport`, a `CalibrationResult`, a
    `Plan` or a plan's ``to_dict()`` (``title`` heads a plan's table); under an answer, how
    far to trust it (`trust_lines`), as the CLI prints it."""
    kind = type(result).__name__
    if kind == "OptimizeResult":
        text = optimize_table(result)
        return text + "\n" + trust_lines(result.best.trust()) if result.best else text
    if kind == "ValidationReport":
        return validation_table(result)
    if kind == "CalibrationResult":
        return calibration_table(result)
    if any(c.__name__ == "Plan" for c in type(result).__mro__):      # a LayoutPlan too
        d = result.to_dict()
        return plan_table(d, title) + "\n" + trust_lines(d["trust"])
    if isinstance(result, dict) and {"memory", "time", "throughput"} <= set(result):
        text = plan_table(result, title)
        return text + "\n" + trust_lines(result["trust"]) if "trust" in result else text
    raise TypeError(f"no table for a {kind}: render takes an OptimizeResult, a "
                    "ValidationReport, a CalibrationResult, a Plan or a plan's to_dict()")


__all__ = ["calibration_table", "optimize_table", "plan_table", "render", "time_rows",
           "trust_lines", "validation_table", "why_lost"]
