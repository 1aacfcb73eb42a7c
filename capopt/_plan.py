"""`plan`: the cost model at one concrete config, as the output contract's plan object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._errors import CapoptError
from ._scenario import load_scenario, pinned_config
from ._specs import Config, Scenario, training_choices
from ._validity import config_problems
from .cost import Estimate, estimate


@dataclass(frozen=True)
class Plan:
    scenario: Scenario
    config: Config
    estimate: Estimate

    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits)

    @property
    def memory(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.estimate.memory.items()}

    @property
    def time(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.estimate.time.items()}

    @property
    def throughput(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.estimate.throughput.items()}

    def trust(self) -> dict[str, Any]:
        """How far to trust this answer: the held-out errors measured for its runtime, layout
        and GPU, and its peak were it short by them (`capopt._trust.answer_trust`)."""
        from ._trust import answer_trust
        return answer_trust(self.scenario, self.config, self.memory["total_bytes"])

    def to_dict(self) -> dict[str, Any]:
        d = {"scenario": self.scenario.name, "fits": self.fits,
             "config": self.config.to_dict(), "memory": self.memory, "time": self.time,
             "throughput": self.throughput, "trust": self.trust()}
        if self.scenario.choices:
            d["training"] = training_choices(self.scenario)
        return d


def plan(scenario: Scenario | str | dict, config: Config | None = None, **knobs) -> Plan:
    """Evaluate one config: ``config`` as given, else the scenario's pinned knobs + ``knobs``."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    cfg = config or pinned_config(sc, **knobs)
    problems = config_problems(cfg, sc)
    if problems:
        field, why = problems[0]
        raise CapoptError(why, file=sc.path, field=field)
    return Plan(sc, cfg, estimate(cfg, sc))
