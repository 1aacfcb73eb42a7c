"""`calibrate`: fit a runtime profile's coefficients to measurements, through the cost model.

The prediction is the same JAX cost model `estimate` evaluates (`capopt.cost.estimate_numbers`)
with the profile's ``rt_*`` numbers made variables, mapped onto the measured term as in
`predict` (``temp_bytes``: gradients + activations + logits + communication + weight copies;
``peak_bytes``: arguments + outputs + temp - aliases). Each coefficient is ``c0 * exp(theta)``
(positive, scale-free), fitted by Adam (optax) on the mean squared log-ratio of prediction to
measurement over a training split, plus ``prior_weight * sum(theta ** 2)`` (a log-normal prior
that keeps each coefficient near the physical count it starts from unless the data say
otherwise); a held-out split (``holdout``) reports how well the fit
carries over to configs it did not see.

Only measurements that constrain a coefficient move it: the XLA tiers' buffers say nothing
about the CUDA context, say, so fit ``context_bytes`` only to device-tier peaks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._runtime import RuntimeProfile
from .._specs import Config, Scenario
from ..cost import estimate_numbers, knobs_from_config, scenario_numbers

# What XLA's buffers can pin down (activation bytes per op, logits copies, weight casts).
DEFAULT_COEFFS = ("resid_saved", "logits_fp32_copies", "weight_copy_fraction")

# What `capopt calibrate` fits unless told otherwise, and what the calibration grid
# (`benchmarks/calibration_grid.py`) pins down: the per-op counts of the terms XLA's buffer
# assignment shows live at the peak (norm inputs, GELU and gated MLP internals, the GELU's
# 16-bit derivative residuals), the weight casts, the score-sized tensors a materialised softmax saves and the
# score gradients of one block's backward, the blockwise loop's gradient accumulators, and
# the logits copies (identifiable because the grid's second part varies the
# vocabulary-to-width ratio: with one ratio a logits copy and an h-wide per-token buffer look
# alike). No overall scale: it is degenerate with the per-op counts. Every count starts at
# the value read off the buffer assignment and is held near it by a log-normal prior
# (``PRIOR_WEIGHT``), so the fit moves a count only as far as the data insist.
FIT_COEFFS = ("weight_copy_fraction", "score_copies", "score_grad_copies",
              "logits_act_copies", "logits_fp32_copies", "resid_saved",
              "mlp_gelu_saved", "mlp_gelu_lowp_saved", "mlp_gated_saved")
PRIOR_WEIGHT = 1e-3
TARGETS = ("temp_bytes", "peak_bytes")


@dataclass(frozen=True)
class Sample:
    """One measurement: the scenario (with the profile to start from), the config, the term."""

    scenario: Scenario
    config: Config
    measured: float
    input_bytes: float = 0.0
    extra_output_bytes: float = 0.0       # loss + output tuple (peak target only)


@dataclass
class CalibrationResult:
    profile: RuntimeProfile
    coeffs: dict[str, float]
    initial: dict[str, float]
    target: str
    train_error: dict[str, float]          # mean |relative error| before / after
    holdout_error: dict[str, float]
    n_train: int
    n_holdout: int
    steps: int
    history: list[float] = field(default_factory=list)

    def to_toml(self) -> str:
        return self.profile.to_toml()

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.name, "coeffs": self.coeffs, "initial": self.initial,
                "target": self.target, "train_error": self.train_error,
                "holdout_error": self.holdout_error, "n_train": self.n_train,
                "n_holdout": self.n_holdout, "steps": self.steps}

def samples_from_results(results: Iterable[dict], scenario: Scenario, *,
                         target: str = "temp_bytes") -> list[Sample]:
    """`Sample`s from validation records (`ValidationReport.results` or a JSONL file's lines)
    of one scenario; failed ones are skipped."""
    out = []
    for r in results:
        if r.get("status") != "ok" or not r.get("measured", {}).get(target):
            continue
        m = r["measured"]
        extra = (m["output_bytes"] - m["alias_bytes"]) if target == "peak_bytes" else 0.0
        out.append(Sample(scenario, Config(**r["config"]), float(m[target]),
                          float(m.get("input_bytes") or 0.0), float(extra)))
    return out


def _predict(knobs, nums, input_bytes, extra_out, target: str):
    mem = estimate_numbers(knobs, nums).memory
    # the step's own buffers, as `capopt.validation.predict` maps them onto XLA's temp
    temp = (mem["activations_bytes"] + mem["logits_bytes"] + mem["grads_bytes"]
            + mem["comm_bytes"] + mem["weight_copy_bytes"])
    if target == "temp_bytes":
        return temp
    return mem["params_bytes"] + mem["optimizer_bytes"] + input_bytes + extra_out + temp


def _stack(samples: list[Sample]):
    knobs = [knobs_from_config(s.config, float(s.scenario.model.num_hidden_layers))
             for s in samples]
    nums = [scenario_numbers(s.scenario) for s in samples]
    keys = sorted(set.intersection(*(set(n) for n in nums)))
    k = jax.tree.map(lambda *xs: jnp.stack(xs), *knobs)
    n = {key: jnp.asarray([float(d[key]) for d in nums], jnp.float32) for key in keys}
    return k, n


def calibrate(samples: list[Sample], *, coeffs: Iterable[str] = DEFAULT_COEFFS,
              target: str = "temp_bytes", holdout: float = 0.25, steps: int = 800,
              learning_rate: float = 0.05, seed: int = 0, name: str | None = None,
              source: str | None = None, prior_weight: float = 0.0) -> CalibrationResult:
    """Fit ``coeffs`` of the samples' runtime profile to their measured ``target``.

    Args:
        samples: `Sample`s (see `samples_from_results`); all share one runtime profile.
        coeffs: profile coefficient names (without ``rt_``) to fit.
        target: ``"temp_bytes"`` or ``"peak_bytes"``.
        holdout: fraction of samples kept out of the fit to measure it (none under 4 samples).
        steps, learning_rate, seed: the Adam solve and the split.
        prior_weight: weight of the penalty ``sum(log(c / c0) ** 2)`` toward the starting
            values (0: a plain least-squares fit in log space).
        name, source: of the fitted profile (default ``<base>-calibrated``).

    Returns:
        A `CalibrationResult`; ``result.to_toml()`` is a profile file `get_profile` reads.

    Example::

        res = calibrate(samples_from_results(report.results, scenario))
        Path("my-profile.toml").write_text(res.to_toml())
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    samples = [s for s in samples if s.measured > 0]
    if not samples:
        raise ValueError("no usable measurements (status ok with a positive target)")
    base = samples[0].scenario.runtime
    if any(s.scenario.runtime.coeffs != base.coeffs for s in samples):
        raise ValueError("samples start from different runtime profiles")
    coeffs = tuple(coeffs)
    init = {c: base.coeff(c) for c in coeffs}
    for c, v in init.items():
        if not v > 0:
            raise ValueError(f"coefficient {c!r} is {v}: a multiplicative fit needs it > 0")

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(samples))
    n_hold = int(round(holdout * len(samples))) if len(samples) >= 4 else 0
    hold_idx, train_idx = order[:n_hold], order[n_hold:]
    k_all, n_all = _stack(samples)
    meas = jnp.asarray([s.measured for s in samples], jnp.float32)
    inp = jnp.asarray([s.input_bytes for s in samples], jnp.float32)
    extra = jnp.asarray([s.extra_output_bytes for s in samples], jnp.float32)
    init_vec = jnp.asarray([init[c] for c in coeffs], jnp.float32)

    def predict(theta, idx):
        vals = init_vec * jnp.exp(theta)
        nums = dict(n_all)
        for i, c in enumerate(coeffs):
            nums[f"rt_{c}"] = jnp.full_like(n_all[f"rt_{c}"], vals[i])
        sel = lambda t: jax.tree.map(lambda x: x[idx], t)  # noqa: E731
        return jax.vmap(lambda k, n, a, b: _predict(k, n, a, b, target))(
            sel(k_all), sel(nums), inp[idx], extra[idx])

    def loss(theta, idx):
        p = jnp.maximum(predict(theta, idx), 1.0)
        return (jnp.mean(jnp.square(jnp.log(p) - jnp.log(meas[idx])))
                + prior_weight * jnp.sum(jnp.square(theta)))

    tx = optax.adam(learning_rate)
    train = jnp.asarray(train_idx)

    @jax.jit
    def solve(theta):
        def body(carry, _):
            th, st = carry
            val, g = jax.value_and_grad(loss)(th, train)
            upd, st = tx.update(g, st, th)
            return (optax.apply_updates(th, upd), st), val
        (th, _), hist = jax.lax.scan(body, (theta, tx.init(theta)), None, length=steps)
        return th, hist

    theta0 = jnp.zeros(len(coeffs), jnp.float32)
    theta, hist = solve(theta0)

    @jax.jit
    def _mean_err(th, idx):
        return jnp.mean(jnp.abs(predict(th, idx) / meas[idx] - 1.0))

    def mean_err(th, idx):
        if len(idx) == 0:
            return float("nan")
        return float(_mean_err(th, jnp.asarray(idx)))

    fitted = {c: float(v) for c, v in zip(coeffs, np.asarray(init_vec * jnp.exp(theta)))}
    te = {"before": mean_err(theta0, train_idx), "after": mean_err(theta, train_idx)}
    he = {"before": mean_err(theta0, hold_idx), "after": mean_err(theta, hold_idx)}
    note = (f"fitted by capopt calibrate to {len(train_idx)} {target} measurements "
            f"(held-out mean |error| {100 * he['after']:.1f}%)" if n_hold else
            f"fitted by capopt calibrate to {len(train_idx)} {target} measurements")
    notes = dict(base.notes)
    notes.update({c: note for c in coeffs})
    prof = base.with_coeffs(**fitted)
    prof = dataclasses.replace(prof, name=name or f"{base.name}-calibrated",
                               source=source or f"{base.source}; calibrated: {note}",
                               notes=tuple(sorted(notes.items())))
    return CalibrationResult(profile=prof, coeffs=fitted, initial=init, target=target,
                             train_error=te, holdout_error=he, n_train=len(train_idx),
                             n_holdout=n_hold, steps=steps,
                             history=[float(x) for x in np.asarray(hist)[:: max(1, steps // 50)]])


__all__ = ["CalibrationResult", "DEFAULT_COEFFS", "Sample", "calibrate", "samples_from_results"]
