"""The CUDA PJRT plugin that the xla-gpu tier compiles with: where it is, and installing it.

The tier needs only the plugin and its PJRT library (about 180 MB of wheels), not CUDA itself:
nothing runs, XLA only compiles for the GPU. ``capopt setup xla-gpu`` installs the two wheels
that match the installed JAX into a folder beside the interpreter (``<prefix>/capopt-xla-gpu/
jax-<version>``), kept off ``sys.path`` so that ordinary JAX processes never try to start a
CUDA backend; workers of the xla-gpu tier put it on their path. ``CAPOPT_XLA_GPU_PLUGIN_PATH``
points elsewhere, e.g. at a shared folder.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from .._errors import CapoptError

PLUGIN_PATH_ENV = "CAPOPT_XLA_GPU_PLUGIN_PATH"
PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")


def jax_version() -> str:
    return importlib.metadata.version("jax")


def default_dir() -> Path:
    return Path(sys.prefix) / "capopt-xla-gpu" / f"jax-{jax_version()}"


def has_plugin(folder: Path) -> bool:
    return (folder / "jax_plugins").is_dir()


def plugin_path() -> str | None:
    """A folder holding the plugin to prepend to a worker's path; None when it is importable
    already or absent (`xla_gpu_available` tells which)."""
    extra = os.environ.get(PLUGIN_PATH_ENV)
    if extra:
        return extra
    d = default_dir()
    return str(d) if has_plugin(d) else None


def install(target: str | Path | None = None, *, quiet: bool = False) -> Path:
    """Install the plugin matching this JAX into ``target`` (default `default_dir`); a folder
    that already has it is left as it is."""
    folder = Path(target) if target else default_dir()
    if has_plugin(folder):
        return folder
    version = jax_version()
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(folder),
           *(f"{p}=={version}" for p in PACKAGES)]
    if quiet:
        cmd.insert(4, "-q")
    done = subprocess.run(cmd, capture_output=quiet, text=True)
    if done.returncode != 0 or not has_plugin(folder):
        tail = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise CapoptError(
            f"could not install {' and '.join(PACKAGES)} {version} into {folder}"
            + (f": {tail[0]}" if tail else "")
            + f" (install them yourself with pip --no-deps --target, and set {PLUGIN_PATH_ENV})")
    return folder


__all__ = ["PACKAGES", "PLUGIN_PATH_ENV", "default_dir", "has_plugin", "install",
           "jax_version", "plugin_path"]
