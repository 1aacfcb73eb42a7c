"""The package as a user installs it: a wheel built from this tree, in a fresh environment,
runs `capopt catalog models` and `capopt optimize` with the cards and scenarios it ships."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                            str(wheels), str(ROOT)], capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("capopt-*.whl")
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True,
                   timeout=300)
    py = env_dir / "bin" / "python"
    # the dependencies (JAX, flax, optax) from this test's environment, not capopt itself:
    # a .pth line adds the folder without running the editable install's finder
    own_site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(own_site, "deps.pth").write_text("\n".join(deps) + "\n")
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--target", own_site, str(wheel)], capture_output=True, text=True,
                          timeout=600)
    assert inst.returncode == 0, inst.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPOPT_MODELS")
           and k != "CAPOPT_SCENARIOS_DIR" and k != "PYTHONPATH"}
    run = lambda *a: subprocess.run([str(py), "-m", "capopt.cli", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=tmp_path, env=env, timeout=600)
    where = subprocess.run([str(py), "-c", "import capopt; print(capopt.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert str(ROOT) not in where.stdout and own_site in where.stdout, where.stdout
    cat = run("catalog", "models")
    assert cat.returncode == 0 and "llama-3-8b" in cat.stdout, cat.stderr[-2000:]
    opt = run("optimize", "--top", "1")
    assert opt.returncode == 0, opt.stderr[-2000:]
    assert "Llama-3-8B" in opt.stdout or "llama" in opt.stdout.lower()
    scen = run("catalog", "scenarios")
    assert "llama3-8b-8xh100" in scen.stdout
