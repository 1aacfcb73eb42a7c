"""``capopt doctor``: is this machine ready to train on its GPU with JAX?

The checklist, in order:

1. ``accelerator``: does the NVIDIA driver see a GPU (NVML, else ``nvidia-smi``)? Name,
   driver version, the CUDA version the driver supports, memory total / used, and the
   processes already holding memory.
2. ``jax-backend``: does JAX use it? ``jax.default_backend()``, the devices, and a *fail*
   when the driver sees a GPU but JAX silently fell back to the CPU.
3. ``cuda-versions``: the CUDA / cuDNN that jaxlib was built for against what the driver
   and the installed libraries provide, plus the version errors JAX and XLA log.
4. ``tiny-step``: a small jitted forward + backward step on the default device, timed
   (compile versus run), its outputs confirmed to live on that device, with
   ``device.memory_stats()`` when the device reports it.
5. ``memory-settings``: what ``XLA_PYTHON_CLIENT_PREALLOCATE``, ``*_MEM_FRACTION``,
   ``XLA_PYTHON_CLIENT_ALLOCATOR``, ``TF_GPU_ALLOCATOR`` and ``XLA_FLAGS`` mean for the
   numbers people see.
6. ``versions``: Python, jax, jaxlib, the CUDA plugin, flax, optax.

Each check is split in two: a *probe* (`capopt.gpu.probes`: `probe_driver`, `probe_jax`,
`probe_step`, `probe_versions`, plus the environment) gathers raw outputs from the machine
(`capopt.gpu.raw`), and a pure *judge* (`capopt.gpu.judges`: `judge_driver`, `judge_jax`,
`judge_cuda_versions`, `judge_step`, `judge_memory_settings`, `judge_versions`) turns them
into a `Check` of the report (`capopt.gpu.report`). Judges run as well on outputs recorded
elsewhere, e.g. a pasted ``jax.print_environment_info()`` (`parse_environment_info`). This
module runs them in order and re-exports their names.

A machine without an accelerator gets a clean report and exit code 0::

    >>> report = run_doctor(run_step=False)  # doctest: +SKIP
    >>> print(report.render())  # doctest: +SKIP
    >>> report.exit_code  # doctest: +SKIP
    0
"""


from __future__ import annotations

import os
from collections.abc import Mapping

from .judges import (_GPU_BACKENDS, judge_cuda_versions, judge_driver, judge_jax,
                     judge_memory_settings, judge_step, judge_versions)
from .probes import probe_driver, probe_jax, probe_step, probe_versions
from .raw import (MEMORY_ENV_VARS, DriverFacts, DriverRaw, JaxRaw, StepRaw, VersionsRaw,
                  parse_environment_info, read_driver)
from .report import Check, DoctorReport
from .smi import parse_query_apps_csv, parse_query_gpu_csv, parse_smi_table


__all__ = [
    "Check",
    "DoctorReport",
    "DriverFacts",
    "DriverRaw",
    "JaxRaw",
    "StepRaw",
    "VersionsRaw",
    "diagnose",
    "judge_cuda_versions",
    "judge_driver",
    "judge_jax",
    "judge_memory_settings",
    "judge_step",
    "judge_versions",
    "parse_environment_info",
    "parse_query_apps_csv",
    "parse_query_gpu_csv",
    "parse_smi_table",
    "probe_driver",
    "probe_jax",
    "probe_step",
    "probe_versions",
    "read_driver",
    "run_doctor",
]


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def diagnose(
    driver: DriverRaw,
    jax_raw: JaxRaw,
    step: StepRaw | None,
    env: Mapping[str, str],
    versions: VersionsRaw,
) -> DoctorReport:
    """Judge recorded inputs into a report. Pure: the same inputs give the same report."""
    jax_check = judge_jax(jax_raw, driver)
    # The step must land on the accelerator when JAX's backend is one; a CPU backend is
    # judged (and, if wrong, failed) by the jax-backend check alone.
    expect_accel = jax_raw.backend in _GPU_BACKENDS
    return DoctorReport(
        checks=[
            judge_driver(driver),
            jax_check,
            judge_cuda_versions(jax_raw, driver),
            judge_step(step, expect_accelerator=expect_accel),
            judge_memory_settings(env),
            judge_versions(versions),
        ]
    )


def run_doctor(*, run_step: bool = True) -> DoctorReport:
    """Run the checklist on this machine.

    The driver is asked first, before JAX initialises (and, with default settings,
    preallocates), so the memory it reports in use belongs to other processes.

    Args:
        run_step: also compile and run the tiny training step (about a second on a CPU).
    """
    driver = probe_driver()
    jax_raw = probe_jax()
    step = probe_step() if run_step and jax_raw.error is None else None
    env = {k: os.environ[k] for k in MEMORY_ENV_VARS if k in os.environ}
    return diagnose(driver, jax_raw, step, env, probe_versions())
