"""Compile MaxText's own training step for a GPU that is not here; write XLA's memory analysis.

    <maxtext venv>/bin/python maxtext_driver.py SPEC.json OUT.json

Run by the maxtext tier (`capopt.validation.maxtext_tier`) with the interpreter of the
environment ``capopt setup maxtext`` builds (MaxText needs Python 3.12 or later): this file
imports JAX and MaxText only, never capopt. ``SPEC.json`` holds ``target`` (XLA's
``GpuTargetConfigProto`` text of the GPU), ``n`` (devices) and ``overrides`` (MaxText's
``key=value`` arguments, as ``--emit maxtext`` writes them plus the model's sizes).

What runs is MaxText's ``train_compile`` (maxtext 0.2.5, src/maxtext/trainers/pre_train/
train_compile.py: its config, its model, its train_step, its shardings, jitted, lowered and
compiled as ``train_compile.main`` does), with two changes: the mesh is built over a deviceless
CUDA topology of ``n`` GPUs (`jax.experimental.topologies.get_topology_desc`, the xla-gpu tier's
way) where its own ``a3`` target would ask JAX for GPUs, and the compiled step is kept to read
``memory_analysis()``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> int:
    spec = json.load(open(spec_path))
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh
    topo = topologies.get_topology_desc(platform="cuda", target_config=spec["target"],
                                        topology=f"1x1x{spec['n']}")
    devices = topo.devices
    import maxtext
    from maxtext.trainers.pre_train import train_compile as tc
    from maxtext.utils import maxtext_utils

    def mesh_for(config):
        grid = maxtext_utils.create_device_mesh(config, devices)
        return Mesh(grid, config.mesh_axes, axis_types=(AxisType.Auto,) * len(config.mesh_axes))

    kept = {}
    compile_step = tc.jit_and_compile

    def keep(*args, **kwargs):
        t0 = time.perf_counter()
        kept["compiled"] = compile_step(*args, **kwargs)
        kept["compile_s"] = time.perf_counter() - t0
        return kept["compiled"]

    tc.get_topology_mesh = mesh_for
    tc.jit_and_compile = keep
    tc.validate_config = lambda config: None        # (its check asks for compile_topology)
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    tc.main(["train_compile", base, *spec["overrides"]])
    stats = kept["compiled"].memory_analysis()
    out = {k: int(getattr(stats, f"{k}_size_in_bytes"))
           for k in ("argument", "output", "alias", "temp")}
    out = {f"{k}_bytes": v for k, v in out.items()}
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                         - out["alias_bytes"])
    out["compile_s"] = kept["compile_s"]
    from importlib.metadata import version
    out["maxtext"], out["jax"] = version("maxtext"), version("jax")
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
