"""Workload options at the scenario's level: ``training.loss = "fused-linear"`` (Liger's fused
linear cross-entropy runs on the whole head, so tensor parallelism is 1 whether the scenario
chose it or left it to the optimiser; the optimiser's answer keeps it) and
``training.activation_offload``, each offered as a remedy where the runtime runs it. (The
memory, time, torch-tier and launch-file checks are with their layers: tests/test_memory.py,
test_time.py, test_torch_tier.py, test_launch.py.)"""

from __future__ import annotations

import pytest

from capopt._errors import CapoptError
from capopt._scenario import load_scenario


def _sc(**values):
    v = {"training.runtime": ("hf", "test"), "training.loss": ("fused-linear", "test")}
    v.update({k: (x, "test") for k, x in values.items()})
    return load_scenario("llama3-8b-8xh100", values=v)


def test_tensor_parallelism_is_pinned_to_one_and_the_optimiser_keeps_it():
    """``tp`` left to the optimiser (the scenario's auto) is pinned to 1; a list holding 1 is
    narrowed to it; the optimiser's candidates all have tp 1 (exhaustive search, whose
    agreement with the gradient search benchmarks/optimizer.py measures)."""
    import capopt
    sc = _sc()
    assert sc.knob("tp").values == (1,)
    listed = load_scenario("llama3-8b-8xh100", overrides={"tp": [1, 2]},
                           values={"training.runtime": ("hf", "t"),
                                   "training.loss": ("fused-linear", "t")})
    assert listed.knob("tp").values == (1,)
    ex = capopt.optimize(sc, method="exhaustive", top_k=3, remedies=False)
    assert len(ex.candidates) == 3 and all(c.config.tp == 1 for c in ex.candidates)


def test_a_head_the_loss_cannot_fuse_with_is_refused():
    """Pinned tp > 1 names config.tp; the xla runtimes' step (optax's loss on whole logits)
    names training.loss."""
    with pytest.raises(CapoptError, match="config.tp"):
        load_scenario("llama3-8b-8xh100", overrides={"tp": 2},
                      values={"training.runtime": ("hf", "t"),
                              "training.loss": ("fused-linear", "t")})
    with pytest.raises(CapoptError, match="cross-entropy over whole logits") as err:
        load_scenario("llama3-8b-8xh100", values={"training.loss": ("fused-linear", "--loss")})
    assert err.value.field == "--loss"


def test_the_fused_head_is_a_remedy_where_the_loss_makes_the_peak():
    """The fused linear cross-entropy is among the changes tried for a PyTorch decoder's
    float32 loss, with tp pinned to 1 in the changed scenario."""
    from capopt.search.remedies import FUSED_LINEAR_LOSS, candidate_changes
    sc = load_scenario("llama3-8b-8xh100", values={"training.runtime": ("hf", "t")})
    changes = dict(candidate_changes(sc))
    assert FUSED_LINEAR_LOSS in changes
    assert changes[FUSED_LINEAR_LOSS].workload.loss == "fused-linear"
    assert changes[FUSED_LINEAR_LOSS].knob("tp").values == (1,)


def test_activation_offloading_is_a_remedy_where_the_runtime_runs_it():
    """Offloading activations is among the changes tried under a runtime that runs it (hf),
    and not under one that does not (xla-gpu)."""
    from capopt.search.remedies import OFFLOAD_ACTIVATIONS, candidate_changes
    hf = load_scenario("llama3-8b-8xh100", values={"training.runtime": ("hf", "t")})
    changes = dict(candidate_changes(hf))
    assert changes[OFFLOAD_ACTIVATIONS].workload.activation_offload is True
    assert OFFLOAD_ACTIVATIONS not in dict(candidate_changes(load_scenario("llama3-8b-8xh100")))


def test_double_quantisation_is_a_remedy_for_a_base_without_it():
    """An NF4 base without double quantisation is offered it (workload and explain changes,
    the rest of the LoRA as it was); a base with it, or none, is not."""
    import dataclasses

    from capopt._specs import Config
    from capopt.search.remedies import DOUBLE_QUANT, candidate_changes, config_changes
    sc = load_scenario("qlora-llama2-7b-24gb")
    plain = sc.replace(workload=dataclasses.replace(
        sc.workload, lora=dataclasses.replace(sc.workload.lora, double_quant=False)))
    changed = dict(candidate_changes(plain))[DOUBLE_QUANT].workload.lora
    assert changed == dataclasses.replace(plain.workload.lora, double_quant=True)
    cfg = Config(micro_batch=4, grad_accum=4, remat="full")
    assert DOUBLE_QUANT in [d for d, _, _ in config_changes(plain, cfg)]
    assert DOUBLE_QUANT not in dict(candidate_changes(sc))
    assert DOUBLE_QUANT not in [d for d, _, _ in config_changes(sc, cfg)]
