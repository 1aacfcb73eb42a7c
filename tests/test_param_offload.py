"""Parameter offload (``config.offload_params``): FSDP2's CPUOffloadPolicy (torch v2.13
_fsdp_api.py: "offloads parameters, gradients, and optimizer states to CPU. Sharded parameters
are copied host-to-device before all-gather ... Sharded gradients are copied device-to-host in
backward, and the optimizer step runs on CPU"), DeepSpeed's offload_param (stage 3 only).
What it changes: the device's parameter shards, gradient shards and optimizer state go to the
host; the gathered weights, activations and logits stay; the step pays the copies and the
host's optimizer step."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import llama_like, make_scenario

from capopt._errors import CapoptError
from capopt._specs import Config
from capopt._validity import config_problems, mend
from capopt.cost import estimate_numbers, knobs_from_config, numbers_pytree
from capopt.report.launch import emit, expresses
from capopt.search import optimize
from capopt.search._space import Space, build_lattice
from capopt.search.explore import evaluate_all


def _run(cfg, sc):
    out = estimate_numbers(knobs_from_config(cfg), numbers_pytree(sc))
    return ({k: float(v) for k, v in out.memory.items()},
            {k: float(v) for k, v in out.time.items()})


def _sc(runtime="torchtitan", **kw):
    m = llama_like(layers=4, hidden=512, heads=8, kv=4, vocab=4096)
    return make_scenario(m, runtime=runtime, count=8, seq_len=1024, global_batch=32, **kw)


@pytest.mark.parametrize("runtime", ["torchtitan", "deepspeed", "pytorch-eager"])
@pytest.mark.parametrize("ga", [1, 4])
def test_offload_moves_the_shards_and_the_state_to_the_host_and_nothing_else(runtime, ga):
    """On the device: no parameter shard, no optimizer state, no gradient shard kept; on the
    host exactly what the device held of each. The gathered weights, the activations, the
    logits and the collectives' buffers are the same bytes (the peak's phase the same), and
    the total falls by no more than the three state terms."""
    sc = _sc(runtime)
    off = Config(micro_batch=4 // ga, grad_accum=ga, dp=8, zero_stage=3)
    on = off.replace(offload_params=True)
    assert not config_problems(on, sc)
    m0, _ = _run(off, sc)
    m1, _ = _run(on, sc)
    assert m0["params_bytes"] > 0 and m0["optimizer_bytes"] > 0 and m0["grads_all_bytes"] > 0
    for term in ("params_bytes", "optimizer_bytes", "grads_all_bytes", "trainable_bytes"):
        assert m1[term] == 0.0, term
    assert m1["offloaded_param_bytes"] == pytest.approx(m0["params_bytes"], rel=1e-6)
    assert m1["offloaded_grad_bytes"] == pytest.approx(m0["grads_all_bytes"], rel=1e-6)
    assert m1["host_optimizer_bytes"] == pytest.approx(m0["optimizer_bytes"], rel=1e-6)
    assert m0["offloaded_param_bytes"] == m0["offloaded_grad_bytes"] == 0.0
    assert m1["peak_phase"] == m0["peak_phase"]
    for term in ("activations_bytes", "logits_bytes", "comm_bytes", "weight_copy_bytes"):
        assert m1[term] == pytest.approx(m0[term], rel=1e-6), term
    # (the total's fall is the state's: the parameters, the optimizer state, the gradients
    # the peak's phase held, at most every shard, and the allocator's fragmentation on them)
    delta = {t: m0[t] - m1[t] for t in ("total_bytes", "params_bytes", "optimizer_bytes",
                                         "grads_bytes", "overhead_bytes")}
    assert 0.0 <= delta["grads_bytes"] <= m0["grads_all_bytes"] * (1 + 1e-6)
    assert delta["overhead_bytes"] >= 0.0
    assert delta["total_bytes"] == pytest.approx(
        delta["params_bytes"] + delta["optimizer_bytes"] + delta["grads_bytes"]
        + delta["overhead_bytes"], rel=1e-5)


def test_offload_off_is_the_model_without_the_knob():
    """offload_params = false prices exactly what a config without the knob priced: every
    memory and time term equal, and a stored measurement's key unchanged."""
    sc = _sc()
    cfg = Config(micro_batch=2, grad_accum=2, dp=8, zero_stage=3)
    assert "offload_params" not in cfg.key_dict()
    assert cfg.replace(offload_params=True).key_dict()["offload_params"] is True
    m0, t0 = _run(cfg, sc)
    assert m0["offloaded_param_bytes"] == 0.0 and t0["offload_s"] == 0.0


def test_offload_pays_the_copies_and_the_host_step():
    """Compute is unchanged; the step pays the shards' copies where they outlast the matmuls
    beside them (from the second micro-batch on the gradients' copies whole: FSDP2 copies a
    shard synchronously when it adds into an existing .grad) and the optimizer update at the
    host's rate (``host_update_bytes_s``): at the device's own rate the update costs what it
    did on the device, at half a host rate twice what it does at that rate."""
    sc = _sc()
    off = Config(micro_batch=1, grad_accum=4, dp=8, zero_stage=3)
    on = off.replace(offload_params=True)
    m1, t1 = _run(on, sc)
    _, t0 = _run(off, sc)
    assert t1["compute_s"] == pytest.approx(t0["compute_s"], rel=1e-6)
    n = numbers_pytree(sc)
    link = float(n["host_bw"]) * float(n["rt_host_eff"])
    d2h = m1["offloaded_grad_bytes"] / link
    assert t1["offload_s"] >= (on.grad_accum - 1) * d2h * (1 - 1e-6) > 0
    assert t0["offload_s"] == 0.0
    device_rate = float(n["mem_bw"]) * float(n["rt_mem_eff"])

    def optimizer_s(rate):
        s2 = sc.replace(runtime=sc.runtime.with_coeffs(host_update_bytes_s=rate))
        return _run(on, s2)[1]["optimizer_s"]
    assert optimizer_s(device_rate) == pytest.approx(t0["optimizer_s"], rel=1e-5)
    slow = 1e8                                  # (launches hidden behind so long an update)
    assert optimizer_s(slow / 2) == pytest.approx(2 * optimizer_s(slow), rel=1e-4)
    assert t1["step_s"] > t0["step_s"]


def test_offload_needs_zero3():
    """A config below ZeRO-3 with offload is not real (the rule names the knob and mends it
    off); a scenario that pins a stage below 3 and names offload on is refused at load, and
    one that leaves offload to the search searches it off."""
    sc = _sc()
    bad = Config(micro_batch=1, grad_accum=4, dp=8, zero_stage=2, offload_params=True)
    fields = [f for f, _ in config_problems(bad, sc)]
    assert fields == ["config.offload_params"]
    assert mend(bad.to_dict(), sc)["offload_params"] is False
    with pytest.raises(CapoptError) as err:
        _sc(knobs={"zero_stage": (2,), "offload_params": (True,)})
    assert err.value.field == "config.offload_params"
    assert _sc(knobs={"zero_stage": (2,), "offload_params": None}).knob(
        "offload_params").values == (False,)


@pytest.mark.parametrize("runtime", ["xla-gpu", "maxtext", "megatron", "llm-foundry"])
def test_runtimes_without_parameter_offload_refuse_it(runtime):
    with pytest.raises(CapoptError) as err:
        _sc(runtime, knobs={"offload_params": (True,)})
    assert err.value.field == "config.offload_params"
    assert _sc(runtime, knobs={"offload_params": None}).knob("offload_params").values == (
        False,)


def test_auto_searches_it_at_zero3_only_and_picks_it_where_nothing_else_fits():
    """Under "auto" the lattice holds both values beside ZeRO-3 and none beside another
    stage (its counted size agrees); on a budget only offload meets, the answer offloads."""
    layout = {"tp": (1,), "pp": (1,), "remat": ("none",), "sequence_parallel": (False,)}
    sc = _sc(knobs={"offload_params": None, **layout})
    lat = build_lattice(sc)
    z, op = lat.cols["zero_stage"], lat.cols["offload_params"]
    assert set(op[z == 3].tolist()) == {0, 1} and not op[z != 3].any()
    assert len(lat) == Space(sc).size()
    # the budget: between the least memory of any offloaded config and of any other
    _, res = evaluate_all(sc)
    least_on = float(res["total_bytes"][op == 1].min())
    least_off = float(res["total_bytes"][op == 0].min())
    assert least_on < least_off
    vram = (least_on + least_off) / 2 / 0.9 / 2 ** 30
    tight = _sc(knobs={"offload_params": None, **layout}, vram_gib=vram)
    res = optimize(tight, top_k=3)
    assert res.status == "ok"
    assert all(p.config.offload_params and p.config.zero_stage == 3 for p in res.candidates)


def test_launch_files_write_it_where_the_framework_has_it():
    sc = _sc()
    cfg = Config(micro_batch=1, grad_accum=4, dp=8, zero_stage=3, offload_params=True)
    assert "enable_cpu_offload = true" in emit("torchtitan", cfg, sc)
    ds = json.loads(emit("deepspeed", cfg, _sc("deepspeed")))
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu"}
    assert zero["offload_optimizer"] == {"device": "cpu"}
    assert "fsdp_offload_params: true" in emit("accelerate", cfg, _sc("hf"))
    assert json.loads(emit("hf-trainer", cfg, _sc("hf")))["fsdp"].endswith(" offload")
    assert "fsdp_cpu_offload=True" in emit("torchtune", cfg, _sc("torchtune", precision="bf16"))
    plain = cfg.replace(offload_params=False)
    assert "enable_cpu_offload" not in emit("torchtitan", plain, sc)
    assert "offload_param" not in json.loads(emit("deepspeed", plain, _sc("deepspeed")))[
        "zero_optimization"]
    for fmt in ("megatron", "maxtext", "llm-foundry"):
        assert not expresses(fmt, cfg, sc), fmt


def test_the_tiers_that_cannot_measure_it_say_so():
    from capopt.validation.step import Unsupported
    from capopt.validation.torch_step import check_supported
    sc = _sc()
    cfg = Config(micro_batch=1, grad_accum=4, dp=8, zero_stage=3, offload_params=True)
    with pytest.raises(Unsupported, match="host memory"):
        check_supported(sc, cfg)
