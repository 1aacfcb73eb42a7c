"""What XLA's GPU schedulers say, in the compile's log, about a step's memory.

XLA orders a GPU module twice (``ScheduleGpuModule``, ``xla/service/gpu/gpu_hlo_schedule.cc``,
the XLA of jaxlib 0.10.2). Its memory scheduler (``DefaultMemoryScheduler``) builds a list, a
depth-first and a post-order sequence and keeps the one whose heap simulation peaks lowest;
its ``VLOG(2)`` lines name the three simulated peaks and the choice (an estimate made before
buffer assignment: from 5% below to 18% above the assigned peak on ten one-device steps).
Where the step has collectives and the target is a Hopper or Blackwell GPU, the
latency-hiding scheduler then reorders it to overlap them with compute and spends memory on
that up to its limit, (80% of the card's memory - the step's arguments and outputs not
aliased) x ``xla_gpu_memory_limit_slop_factor`` (95%) (``GetSchedulerMemoryLimit``); it logs
the memory its schedule uses and that limit. On a card with room to spare the compiled peak
is therefore the latency-hiding scheduler's and can sit well above what the step needs; the
xla-gpu tier can compile without it
(`capopt.validation.compiler_options.NO_LATENCY_HIDING_OPTIONS`), and
`benchmarks/xla_headroom.py` measures the peak on cards of several sizes.

The xla-gpu tier turns the lines on (`log_environment`), captures the compile's log
(`capture`) and records `schedule_report` of it beside XLA's buffer assignment.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from contextlib import contextmanager

# the memory scheduler's lines are VLOG(2); INFO lines must not be filtered out
LOG_ENV = {"TF_CPP_VMODULE": "hlo_memory_scheduler=2", "TF_CPP_MIN_LOG_LEVEL": "0"}

_SCHED = re.compile(r"(Chose )?[Mm]in-memory (list|dfs|post order|post_order) sequence: "
                    r"([\d.]+)([KMGT]?i?B)")
_LHS = re.compile(r"LatencyHidingScheduler current memory usage: (\d+) bytes\. "
                  r"Current limit: (\d+)")
_BYTES = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}


def log_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the scheduler's lines turned on (a ``TF_CPP_VMODULE`` already there is
    kept and added to)."""
    out = dict(env)
    vmodule = out.get("TF_CPP_VMODULE", "")
    if "hlo_memory_scheduler=" not in vmodule:
        out["TF_CPP_VMODULE"] = ",".join(x for x in (vmodule, LOG_ENV["TF_CPP_VMODULE"]) if x)
    out["TF_CPP_MIN_LOG_LEVEL"] = LOG_ENV["TF_CPP_MIN_LOG_LEVEL"]
    return out


def schedule_report(log: str) -> dict | None:
    """What the log says of the step's memory, or None when it has no scheduler line:

    ``order``            the memory scheduler's choice (list | dfs | post_order);
    ``sequences_bytes``  the simulated peak of each of its three sequences;
    ``scheduled_bytes``  its simulated peak (arguments + outputs + temporaries), printed to
                         two decimals of its unit (``111.63MiB``): within 0.005 MiB, or
                         0.005 GiB above 1 GiB;
    ``resolution_bytes`` that rounding, in bytes;
    ``lhs_bytes``, ``lhs_limit_bytes``  the latency-hiding scheduler's memory use and its
                         limit, where it ran (None where the step has no collective)."""
    last, sequences = None, {}
    for m in _SCHED.finditer(log):      # a compile retried: the last one's lines win
        name, unit = m.group(2).replace(" ", "_"), _BYTES.get(m.group(4), 0)
        size = int(round(float(m.group(3)) * unit))
        if m.group(1):
            last = (name, size, unit)
        else:
            sequences[name] = size
    if last is None or not last[2]:
        return None
    lhs = list(_LHS.finditer(log))
    return {"order": last[0], "scheduled_bytes": last[1], "sequences_bytes": sequences,
            "resolution_bytes": int(0.005 * last[2]),
            "lhs_bytes": int(lhs[-1].group(1)) if lhs else None,
            "lhs_limit_bytes": int(lhs[-1].group(2)) if lhs else None}


class _Captured:
    text = ""


@contextmanager
def capture():
    """Capture what this process writes to file descriptor 2 (XLA's C++ log) inside the
    block; ``.text`` holds it after. Lines other than INFO ones (warnings, errors) are written
    back to the real stderr, so nothing the user would have seen is hidden."""
    box = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            box.text = f.read().decode(errors="replace")
            rest = [ln for ln in box.text.splitlines(keepends=True)
                    if not re.match(r"I\d{4} ", ln)]
            if rest:
                sys.stderr.write("".join(rest))
                sys.stderr.flush()


__all__ = ["LOG_ENV", "capture", "log_environment", "schedule_report"]
