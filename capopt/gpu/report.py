"""The doctor's report: one `Check` per item of the checklist, and the `DoctorReport` that
renders them (text or JSON) and gives the exit code."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


Status = Literal["ok", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "skip")
_SEVERITY = {"skip": 0, "ok": 1, "warn": 2, "fail": 3}


# ---------------------------------------------------------------------------------------------
# Report types
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One line of the checklist.

    Attributes:
        name: stable identifier (``accelerator``, ``jax-backend``, ...).
        status: ``ok`` | ``warn`` | ``fail`` | ``skip``.
        saw: what was found, one or two sentences a person can read.
        fix: what to do about it, or ``None``.
        data: the facts behind ``saw`` as JSON-able values.
    """

    name: str
    status: Status
    saw: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "saw": self.saw, "fix": self.fix,
                "data": _jsonable(self.data)}


@dataclass
class DoctorReport:
    """The checklist's result; `to_dict` is the ``--json`` output, `render` the terminal table."""

    checks: list[Check]

    @property
    def exit_code(self) -> int:
        """1 when any check failed, else 0 (a machine without an accelerator is not a failure)."""
        return 1 if any(c.status == "fail" for c in self.checks) else 0

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def summary(self) -> dict[str, Any]:
        counts: dict[str, Any] = {s: sum(1 for c in self.checks if c.status == s) for s in STATUSES}
        accelerator = None
        backend = None
        for c in self.checks:
            if c.name == "accelerator" and c.data.get("gpus"):
                accelerator = c.data["gpus"][0].get("name")
            if c.name == "jax-backend":
                backend = c.data.get("backend")
        return {**counts, "exit_code": self.exit_code, "accelerator": accelerator, "backend": backend}

    def to_dict(self) -> dict[str, Any]:
        return {"checks": [c.to_dict() for c in self.checks], "summary": _jsonable(self.summary())}

    def render(self, width: int = 100) -> str:
        """A plain-text table: status, check, what was seen, and the fix under failing rows."""
        s = self.summary()
        head = ", ".join(f"{s[k]} {k}" for k in ("fail", "warn", "ok", "skip") if s[k])
        lines = [f"capopt doctor: {head}", ""]
        name_w = max(len(c.name) for c in self.checks) if self.checks else 5
        saw_w = max(30, width - 8 - name_w - 4)
        lines.append(f"  {'STATUS':<6}  {'CHECK':<{name_w}}  SAW")
        for c in self.checks:
            tag = c.status.upper() if c.status in ("warn", "fail") else c.status
            wrapped = textwrap.wrap(c.saw, saw_w) or [""]
            lines.append(f"  {tag:<6}  {c.name:<{name_w}}  {wrapped[0]}")
            pad = " " * (2 + 6 + 2 + name_w + 2)
            lines.extend(pad + w for w in wrapped[1:])
            if c.fix and c.status in ("warn", "fail"):
                fix_lines = textwrap.wrap("fix: " + c.fix, saw_w)
                lines.extend(pad + w for w in fix_lines)
        lines.append("")
        lines.append(f"exit code {self.exit_code}")
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    """Plain JSON types only: dicts with str keys, lists, str, int, float, bool, None."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:  # numpy scalars and the like
        return value.item()
    except Exception:
        return str(value)


def _worst(statuses: Sequence[Status]) -> Status:
    return max(statuses, key=lambda s: _SEVERITY[s]) if statuses else "ok"
