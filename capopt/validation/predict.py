"""The one place where cost-model terms become XLA's memory-analysis terms.

XLA reports, per device, for a compiled step ``f(trainable, frozen, opt_state, batch, key) ->
(trainable, opt_state, loss)`` with the trainable state and optimizer state donated:

- ``argument_bytes``: every input buffer;
- ``output_bytes``: every output buffer, plus the output tuple's table of buffer addresses
  (8 bytes per output array, on CPU and GPU alike);
- ``alias_bytes``: outputs that reuse a donated input's buffer;
- ``temp_bytes``: everything else the step allocates (activations, gradients, logits,
  gathered weights, collectives' buffers, casts);
- ``peak_bytes``: ``argument + output + temp - alias`` (XLA's static buffer assignment: all
  of these are live at once in the worst case; the CPU backend's ``peak_memory_in_bytes``
  leaves temp out, so it is not used).

The cost model's per-device terms map onto them as follows (``Estimate.memory`` keys):

===================  ============================================================================
``argument_bytes``   ``params_bytes + optimizer_bytes + input_bytes``
``output_bytes``     ``trainable_bytes + optimizer_bytes + 4 (loss) + tuple_bytes``
``alias_bytes``      ``trainable_bytes + optimizer_bytes``
``temp_bytes``       ``grads_bytes + activations_bytes + logits_bytes + comm_bytes +
                     weight_copy_bytes``; the weight copies are the part of ``overhead_bytes``
                     that is not context, workspace or fragmentation (those live outside
                     XLA's buffers), + one cuBLAS workspace where the step's GEMMs run on
                     cuBLAS (`cublas_workspace_bytes`)
``peak_bytes``       ``argument + output + temp - alias``
``step_s``           ``time.step_s``
===================  ============================================================================

``trainable_bytes`` = ``trainable_params * param_bytes``, split ``dp`` ways under ZeRO-3
(expert tensors ``dp / ep`` ways).
``input_bytes`` (the step's batch and PRNG key) and ``tuple_bytes`` are not cost-model terms:
they are exact by construction and enter prediction and measurement alike, so that the sums
compare like with like. ``params_bytes``, ``optimizer_bytes`` and ``input_bytes`` are also
reported on their own: measured from the shard shapes of the step's arguments.
"""

from __future__ import annotations

from .._specs import Config, Scenario
from ..cost import estimate
from .compiler_options import GEMM_RETRY_OPTIONS

TERMS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")
PARTS = ("params_bytes", "optimizer_bytes", "input_bytes")
LOSS_BYTES = 4            # the float32 loss
TUPLE_ENTRY_BYTES = 8     # one address per output array in the output tuple


def cublas_workspace_bytes(scenario: Scenario, compiler_options: dict | None) -> float:
    """The part of the runtime's library scratch (``workspace_bytes``) that XLA allocates in
    its own buffers: compiled with Triton GEMMs off (``xla_gpu_enable_triton_gemm`` false, the
    xla-gpu tier's retry after a GEMM-tiling failure), every dot is a cuBLAS custom call whose
    output tuple carries its workspace (s8[33554432] on an H100 target: the optimized HLO of
    rand0-104 and rand0-194, jaxlib 0.10.2), a temporary of that call; the calls' workspaces
    share one slot, live at a peak that falls on a GEMM. With Triton GEMMs, none."""
    if not set(GEMM_RETRY_OPTIONS.items()) <= set((compiler_options or {}).items()):
        return 0.0
    return scenario.runtime.coeff("workspace_bytes")


def predicted_terms(config: Config, scenario: Scenario, *, input_bytes: int = 0,
                    output_leaves: int = 0,
                    compiler_options: dict | None = None) -> dict[str, float]:
    """The cost model's prediction of every measured term, per device (bytes; ``step_s``),
    for a step compiled with ``compiler_options`` (the tier's record of them)."""
    est = estimate(config, scenario)
    m = {k: float(v) for k, v in est.memory.items()}
    trainable_bytes = m["trainable_bytes"]
    weight_copy = m["weight_copy_bytes"]
    temp = (m["activations_bytes"] + m["logits_bytes"] + m["grads_bytes"] + m["comm_bytes"]
            + weight_copy + cublas_workspace_bytes(scenario, compiler_options))
    argument = m["params_bytes"] + m["optimizer_bytes"] + input_bytes
    alias = trainable_bytes + m["optimizer_bytes"]
    output = alias + LOSS_BYTES + TUPLE_ENTRY_BYTES * output_leaves
    return {
        "argument_bytes": argument, "output_bytes": output, "alias_bytes": alias,
        "temp_bytes": temp, "peak_bytes": argument + output + temp - alias,
        "step_s": float(est.time["step_s"]),
        "params_bytes": m["params_bytes"], "optimizer_bytes": m["optimizer_bytes"],
        "input_bytes": float(input_bytes),
        "grads_bytes": m["grads_bytes"], "activations_bytes": m["activations_bytes"],
        "logits_bytes": m["logits_bytes"], "comm_bytes": m["comm_bytes"],
        "weight_copy_bytes": weight_copy, "total_bytes": m["total_bytes"],
    }


# --------------------------------------------------------------------------------------------
# The torch tier measures live tensor bytes (`capopt.validation.torch_step`): the peak and what
# was live at it by category. The cost model's allocated figure is its peak with nothing the
# allocator or the CUDA runtime adds (context, workspaces, fragmentation set to 0), plus the
# batch the step holds: token ids and labels of one micro-batch as int64 (exact by
# construction, counted on both sides as with XLA's ``input_bytes``).
TORCH_TERMS = ("peak_bytes",)
TORCH_PARTS = ("params_bytes", "optimizer_bytes", "grads_bytes", "rest_bytes", "input_bytes",
               "reserved_bytes")
TORCH_ID_BYTES = 8
# the deepspeed tier's meter is the torch tier's (live tensor bytes, no allocator replay)
DEEPSPEED_PARTS = ("params_bytes", "optimizer_bytes", "rest_bytes", "input_bytes")


def torch_input_bytes(scenario: Scenario, config: Config) -> int:
    return 2 * TORCH_ID_BYTES * config.micro_batch * scenario.seq_len


def predicted_torch_terms(config: Config, scenario: Scenario) -> dict[str, float]:
    """The cost model's live-tensor peak and its parts, as the torch tier measures them, and
    the allocator's figures: ``reserved_bytes`` (the peak with the profile's fragmentation
    and cached slack, to compare with the caching allocator's replay) and ``device_bytes``
    (the budgeted total: live tensors, fragmentation, CUDA context and workspaces)."""
    inputs = float(torch_input_bytes(scenario, config))
    full = estimate(config, scenario).memory          # the device total, and its reserved
    layers = {"reserved": float(full["reserved_bytes"]) + inputs,
              "device": float(full["total_bytes"]) + inputs}
    rt = scenario.runtime.with_coeffs(context_bytes=0.0, workspace_bytes=0.0, fragmentation=0.0)
    est = estimate(config, scenario.replace(runtime=rt))
    m = {k: float(v) for k, v in est.memory.items()}
    rest = (m["activations_bytes"] + m["logits_bytes"] + m["comm_bytes"]
            + m["weight_copy_bytes"])
    return {"peak_bytes": m["total_bytes"] + inputs, "params_bytes": m["params_bytes"],
            "optimizer_bytes": m["optimizer_bytes"], "grads_bytes": m["grads_bytes"],
            "rest_bytes": rest, "input_bytes": inputs, "step_s": float(est.time["step_s"]),
            "activations_bytes": m["activations_bytes"], "logits_bytes": m["logits_bytes"],
            "weight_copy_bytes": m["weight_copy_bytes"], "comm_bytes": m["comm_bytes"],
            "peak_phase": m["peak_phase"], "reserved_bytes": layers["reserved"],
            "device_bytes": layers["device"]}


def measured_terms(memory_analysis, *, params_bytes: int, optimizer_bytes: int,
                   input_bytes: int) -> dict[str, float]:
    """XLA's `CompiledMemoryStats` as the contract's terms, with the argument breakdown."""
    ma = memory_analysis
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    alias, temp = int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes)
    return {"argument_bytes": arg, "output_bytes": out, "alias_bytes": alias,
            "temp_bytes": temp, "peak_bytes": arg + out + temp - alias,
            "params_bytes": params_bytes, "optimizer_bytes": optimizer_bytes,
            "input_bytes": input_bytes}


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or measured is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return (float(predicted) - float(measured)) / float(measured)


def judged_torch_measurement(measured: dict, runtime) -> dict:
    """The torch tier's measurement as the runtime's allocator would hold it: its
    ``reserved_bytes`` is the replay with expandable segments where the runtime launches with
    them (``expandable_segments``; the default allocator's replay is then kept as
    ``reserved_default_bytes``), the default allocator's otherwise."""
    out = dict(measured)
    if (runtime.coeff("expandable_segments") >= 0.5
            and out.get("reserved_expandable_bytes") is not None):
        out["reserved_default_bytes"] = out.get("reserved_bytes")
        out["reserved_bytes"] = out["reserved_expandable_bytes"]
    return out


def tier_terms(tier: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the terms a tier measures, the parts it breaks them into)."""
    if tier == "deepspeed":
        return TORCH_TERMS, DEEPSPEED_PARTS
    return (TORCH_TERMS, TORCH_PARTS) if tier == "torch" else (TERMS, PARTS)


__all__ = ["PARTS", "TERMS", "TORCH_PARTS", "TORCH_TERMS", "judged_torch_measurement",
           "measured_terms", "predicted_terms", "predicted_torch_terms", "relative_error",
           "tier_terms", "torch_input_bytes"]
