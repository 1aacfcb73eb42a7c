"""The maxtext tier: MaxText's own training step, compiled for the scenario's GPU without one.

The oracle of the ``maxtext`` runtime profile. A candidate becomes the ``key=value`` overrides
``--emit maxtext`` writes for it (`capopt.report.launch`), plus the card's sizes as MaxText's
``base_*`` keys and what a compile-only run needs (synthetic data, no checkpoints); MaxText's
``train_compile`` builds its model, train step and shardings from them and XLA compiles the
step for a deviceless CUDA topology of the scenario's GPU, as the xla-gpu tier does for the
plain step (`maxtext_driver`). XLA's memory analysis of that compile (argument + output + temp
- alias, per device) is the measurement.

MaxText needs Python 3.12 or later and its own JAX (0.12), so it lives in an environment of
its own, ``<prefix>/capopt-maxtext`` beside capopt's: ``capopt setup maxtext`` builds it with a
Python 3.12+ interpreter found on the machine (``CAPOPT_MAXTEXT_PYTHON`` names an interpreter
of a ready environment instead), and each compile runs there in a subprocess.

What the tier compiles: decoders of MaxText's ``llama2`` block (RMSNorm, rotary, SwiGLU, no
biases, an untied head; MHA or GQA, any head_dim), fsdp / data / tensor axes as the emitter
writes them, remat ``minimal`` or ``full``, bf16-mixed, bf16 or fp32, AdamW, Adam or SGD,
clipping on or off, accumulation. Attention is ``dot_product``, materialised (MaxText's GPU
flash kernel is Transformer Engine's, not installed here): a candidate with flash attention is
refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .._errors import CapoptError
from .step import Unsupported

PYTHON_ENV = "CAPOPT_MAXTEXT_PYTHON"
# what `capopt setup maxtext` installs: maxtext 0.2.5 and the modules its train_compile
# imports (its own requirements pin a 1,000-package GPU training environment), with the CUDA
# compiler plugin of the same JAX for the deviceless compile
REQUIREMENTS = (
    "maxtext==0.2.5", "jax==0.12.0.1", "jaxlib==0.12.0.1", "jax-cuda12-plugin==0.12.0.1",
    "jax-cuda12-pjrt==0.12.0.1", "flax==0.12.12", "optax==0.2.8", "orbax-checkpoint==0.12.8",
    "grain==0.2.18", "aqtp==0.9.0", "qwix==0.1.8", "drjax==0.2.1", "tokamax==0.0.17",
    "pathwaysutils==0.1.13", "pydantic==2.14.4", "omegaconf==2.4.0", "jaxtyping==0.3.11",
    "absl-py==2.5.1", "packaging", "jinja2", "huggingface_hub", "transformers==5.25.0",
    "pillow", "sympy", "sentencepiece", "tiktoken")
DRIVER = Path(__file__).with_name("maxtext_driver.py")
TIMEOUT_S = 1800.0


def venv_dir() -> Path:
    return Path(sys.prefix) / "capopt-maxtext"


def interpreter() -> str | None:
    """The Python of the environment MaxText is installed in, or None."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        return named
    py = venv_dir() / "bin" / "python"
    return str(py) if py.exists() else None


def maxtext_available() -> tuple[bool, str]:
    """Whether the maxtext tier can run here (an interpreter that imports maxtext), and why
    not."""
    py = interpreter()
    why = ("the maxtext tier needs MaxText in an environment of its own: run `capopt setup "
           f"maxtext` (or set {PYTHON_ENV} to a Python that has it)")
    if py is None:
        return False, why
    try:
        found = subprocess.run([py, "-c", "import importlib.util as u, sys; "
                                "sys.exit(u.find_spec('maxtext') is None)"],
                               capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    return (True, "") if found else (False, f"{py} has no maxtext: " + why)


def _runs(python: str) -> bool:
    """Whether ``python`` starts (a pyenv shim of a version that is installed but not
    selected is on the path and exits with an error)."""
    try:
        return subprocess.run([python, "-c", "import sys"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_python() -> str | None:
    """A Python 3.12 or later on this machine that starts: on the path, or a pyenv
    version."""
    for name in ("python3.13", "python3.12"):
        found = shutil.which(name)
        if found and _runs(found):
            return found
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if root.is_dir():
        for d in sorted(root.iterdir(), reverse=True):
            parts = d.name.split(".")
            if (len(parts) >= 2 and parts[0] == "3" and parts[1].isdigit()
                    and int(parts[1]) >= 12 and (d / "bin" / "python").exists()
                    and _runs(str(d / "bin" / "python"))):
                return str(d / "bin" / "python")
    return None


def install(*, quiet: bool = False) -> Path:
    """Build the environment (`venv_dir`) with a Python 3.12+ found here; an environment that
    has MaxText already is left as it is."""
    folder = venv_dir()
    py = folder / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import maxtext"],
                                      capture_output=True).returncode == 0:
        return folder
    base = find_python()
    if base is None:
        raise CapoptError("MaxText needs Python 3.12 or later and none was found (python3.12 "
                          "or python3.13 on the path, or a pyenv version)", field="setup",
                          allowed=f"install one, or set {PYTHON_ENV} to a Python with maxtext")
    steps = [[base, "-m", "venv", str(folder)],
             [str(py), "-m", "pip", "install", *(["-q"] if quiet else []), *REQUIREMENTS]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=quiet, text=True)
        if done.returncode != 0:
            tail = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
            raise CapoptError(f"could not build the MaxText environment in {folder}"
                              + (f": {tail[0]}" if tail else ""), field="setup")
    return folder


# --------------------------------------------------------------------------------------------
def check(scenario, config) -> None:
    """Raise `Unsupported` for what the tier does not compile (see the module docstring)."""
    m, w = scenario.model, scenario.workload
    llama = (m.family == "decoder" and m.norm_type == "rmsnorm" and m.mlp_type == "gated"
             and m.hidden_act == "silu" and m.position_embedding == "rotary"
             and m.norms_per_layer == 2 and not m.qk_norm and not m.tie_word_embeddings
             and not (m.attention_bias or m.attention_out_bias or m.mlp_bias
                      or m.lm_head_bias) and not m.is_moe and not m.kv_lora_rank)
    if not llama:
        raise Unsupported("the maxtext tier compiles MaxText's llama2 block: a decoder with "
                          "RMSNorm, rotary positions, SwiGLU, no biases and an untied head")
    if config.flash_attention:
        raise Unsupported("the maxtext tier compiles dot_product attention (MaxText's GPU "
                          "flash kernel is Transformer Engine's): flash_attention = false")
    if w.precision == "fp8-mixed":
        raise Unsupported("the maxtext tier does not compile MaxText's fp8 quantization")
    if config.pp > 1 or config.cp > 1 or config.ep > 1:
        raise Unsupported("the maxtext tier compiles data, fsdp and tensor axes only")
    if config.offload_optimizer or config.offload_params:
        raise Unsupported("the maxtext tier compiles no host offload")
    if m.hidden_dropout or m.attention_dropout:
        raise Unsupported("the maxtext tier compiles no dropout")
    # (a candidate searched under another runtime: what the maxtext runtime does not price,
    # ZeRO-1 and -2, remat none or a fraction, Megatron's sequence parallelism, is not
    # compiled to be judged by it)
    from .._runtime import get_profile
    from .._specs import config_refusal
    own = scenario.runtime if scenario.runtime.name.startswith("maxtext") else \
        get_profile("maxtext")
    why = config_refusal(own, config)
    if why:
        raise Unsupported(why)


def overrides(scenario, config) -> list[str]:
    """MaxText's arguments for the candidate: ``--emit maxtext``'s, the card's sizes, and a
    compile-only run's (synthetic data, no checkpoint)."""
    from ..report.launch import emit
    check(scenario, config)
    m = scenario.model
    lines = [ln for ln in emit("maxtext", config, scenario).splitlines()
             if ln and not ln.startswith("#")]
    lines = [ln for ln in lines if not ln.startswith("attention=")]
    # one slice of n devices: each axis MaxText spreads across nodes (dcn_*) is folded into
    # its axis inside the slice (the same mesh shape; XLA's buffers do not depend on which
    # link an axis crosses)
    kv = dict(ln.split("=", 1) for ln in lines)
    for key in [k for k in kv if k.startswith("dcn_") and k.endswith("_parallelism")]:
        inner = "ici_" + key[4:]
        kv[inner] = str(int(kv[inner]) * int(kv[key]))
        kv[key] = "1"
    lines = [f"{k}={v}" for k, v in kv.items()]
    return lines + [
        # the device count from the compile's own topology, not from this machine's JAX
        "internal_compile=true", f"internal_compile_num_devices={config.devices}",
        "compile_topology_num_slices=1",
        "attention=dot_product", "model_name=default", "decoder_block=llama2",
        f"base_emb_dim={m.hidden_size}", f"base_num_query_heads={m.num_attention_heads}",
        f"base_num_kv_heads={m.num_key_value_heads or m.num_attention_heads}",
        f"head_dim={m.head_dim or m.hidden_size // m.num_attention_heads}",
        f"base_mlp_dim={m.intermediate_size}", f"base_num_decoder_layers={m.num_hidden_layers}",
        f"vocab_size={m.vocab_size}", "logits_via_embedding=false",
        "dataset_type=synthetic", "enable_checkpointing=false", "hardware=gpu",
        "run_name=capopt", "steps=1", "enable_goodput_recording=false",
        "monitor_goodput=false"]


def run_maxtext(scenario, config, *, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Compile the candidate's MaxText step; the measured terms per device (bytes)."""
    from .targets import gpu_target_text
    ok, why = maxtext_available()
    if not ok:
        raise Unsupported(why)
    args = overrides(scenario, config)
    n = config.dp * config.tp                  # (no pipeline: `check`)
    try:
        text = gpu_target_text(scenario.hardware)
    except ValueError as e:          # (XLA's GPU cost model would divide by zero: SIGFPE)
        raise Unsupported(str(e)) from None
    tmp = tempfile.mkdtemp(prefix="capopt-maxtext-")
    try:
        spec, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec, "w") as f:
            json.dump({"target": text, "n": n,
                       "overrides": args + [f"base_output_directory={tmp}/run",
                                            f"jax_cache_dir={tmp}/cache"]}, f)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
                   XLA_FLAGS="--xla_gpu_autotune_level=0", TF_CPP_MIN_LOG_LEVEL="2")
        t0 = time.perf_counter()
        done = subprocess.run([interpreter(), str(DRIVER), spec, out], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode or not os.path.exists(out):
            # (the exception's line: JAX's notes about filtered frames follow it)
            tail = [ln for ln in (done.stderr or "").strip().splitlines()
                    if ln.strip() and not ln.startswith(("For simplicity", "---", " "))]
            raise RuntimeError(tail[-1] if tail else f"exit {done.returncode}")
        res = json.load(open(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    measured = {k: res[k] for k in ("argument_bytes", "output_bytes", "alias_bytes",
                                    "temp_bytes", "peak_bytes")}
    # the batch (ids, positions, segments, targets): what the step takes beside its state
    measured["input_bytes"] = res["argument_bytes"] - res["alias_bytes"]
    return {"measured": measured,
            "details": {"compile_s": res["compile_s"], "wall_s": time.perf_counter() - t0,
                        "maxtext": res["maxtext"], "jax": res["jax"],
                        "target": scenario.hardware.name, "overrides": args}}


__all__ = ["PYTHON_ENV", "REQUIREMENTS", "check", "find_python", "install", "interpreter",
           "maxtext_available", "overrides", "run_maxtext", "venv_dir"]
