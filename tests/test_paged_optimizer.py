"""``training.paged_optimizer``: bitsandbytes' paged optimizers (the Trainer's
``optim="paged_adamw_8bit"``). The state of every parameter of 1e5 elements or more lives in
CUDA managed memory (bitsandbytes 95f9af3, optim/optimizer.py get_state_buffer), outside the
caching allocator: the driver moves it to the host when the device is short and back for each
parameter's update. So it is in no phase's live set, and where it does not fit beside what
the step holds the excess crosses the host link twice a step."""

from __future__ import annotations

import json
import math

import pytest

import capopt
from capopt._errors import CapoptError
from capopt._inventory import inventory, trainable
from capopt._runtime import PAGED_STATE_MIN_SIZE
from capopt._scenario import one_line_scenario
from capopt._specs import Config, LoRA
from capopt.cli import main
from capopt.cost import estimate, scenario_numbers
from conftest import llama_like, make_scenario

# float32 arithmetic on byte counts up to ~1e11 carries ~1e-7 relative error.
F32_RTOL = 1e-6


def _sc(paged, **kw):
    kw = {"optimizer": "adamw", "runtime": "hf", "count": 1, "global_batch": 4,
          "seq_len": 256, **kw}
    return make_scenario(kw.pop("model", llama_like(hidden=512, heads=8, kv=2)),
                         paged_optimizer=paged, **kw)


def _paged_elements(sc) -> tuple[int, int]:
    """(elements of the trainable tensors bitsandbytes pages, all trainable elements)."""
    ts = trainable(inventory(sc.model, sc.workload.lora))
    big = sum(t.elements for t in ts if math.prod(t.shape) >= PAGED_STATE_MIN_SIZE)
    return big, sum(t.elements for t in ts)


def test_the_paged_state_leaves_every_phase_and_nothing_else_changes():
    """AdamW's float32 moments of the 512-wide matrices and the tables are paged (>= 1e5
    elements), the norms' are not; the device total drops by exactly the paged state, and
    parameters, gradients and activations are unchanged."""
    cfg = Config(micro_batch=2, grad_accum=2)
    off, on = (estimate(cfg, _sc(p)).memory for p in (False, True))
    big, total = _paged_elements(_sc(True))
    assert 0 < big < total                      # (norm scales keep their state on the device)
    n = scenario_numbers(_sc(True))
    state = total * n["opt_bytes"]              # one device, no ZeRO: every state byte
    paged = state * big / total
    assert float(on["paged_optimizer_bytes"]) == pytest.approx(paged, rel=F32_RTOL)
    assert float(off["paged_optimizer_bytes"]) == 0.0
    assert float(off["optimizer_bytes"]) - float(on["optimizer_bytes"]) == pytest.approx(
        paged, rel=1e-5)
    for key in ("params_bytes", "grads_bytes", "activations_bytes", "logits_bytes"):
        assert float(on[key]) == pytest.approx(float(off[key]), rel=F32_RTOL), key
    # (the state is a fixed term: the allocator's fragmentation is counted on the dynamic
    # tensors only, so the total drops by the state itself)
    assert float(off["total_bytes"]) - float(on["total_bytes"]) == pytest.approx(
        paged, rel=1e-5)


def test_8bit_adam_pages_its_codes_and_small_adapters_stay_on_the_device():
    """8-bit AdamW: the codes of tensors of 1e5 elements or more are paged (two bytes a
    parameter), the per-block absmax is not. LoRA rank 16 on a 4096-wide model's attention:
    every adapter matrix has at most 65,536 elements, below bitsandbytes' threshold, so
    nothing is paged; rank 64 pages q's and o's (262,144)."""
    sc = _sc(True, optimizer="adamw-8bit")
    big, total = _paged_elements(sc)
    n = scenario_numbers(sc)
    state = total * n["opt_bytes"]
    mem = estimate(Config(micro_batch=2, grad_accum=2), sc).memory
    assert float(mem["paged_optimizer_bytes"]) == pytest.approx(2.0 * big, rel=F32_RTOL)
    assert float(mem["paged_optimizer_bytes"]) < state
    wide = llama_like(hidden=4096, heads=32, kv=8, intermediate_size=11008, vocab=32000)
    for rank, paged in ((16, False), (64, True)):
        lo = _sc(True, model=wide, lora=LoRA(rank, targets=("attn",)),
                 precision="bf16-mixed")
        got = float(estimate(Config(micro_batch=1, grad_accum=4), lo).memory[
            "paged_optimizer_bytes"])
        assert (got > 0) is paged, rank


def test_paging_costs_time_only_where_the_state_does_not_fit_beside_the_step():
    """Where the device has room for the state beside what the step holds (its reserved
    memory, context and workspaces), nothing crosses the host link; on a smaller card the
    excess crosses it twice a step: 2 x excess / (host_bw x host_eff)."""
    cfg = Config(micro_batch=2, grad_accum=2)
    roomy = estimate(cfg, _sc(True))
    assert float(roomy.time["paging_s"]) == 0.0
    # (a card with just the room the step itself holds: all of the state on the host)
    used = float(roomy.memory["device_used_bytes"])
    tight = _sc(True, vram_gib=used / 2**30, headroom=0.0)
    est = estimate(cfg, tight)
    n = scenario_numbers(tight)
    paged = float(est.memory["paged_optimizer_bytes"])
    excess = paged - (float(est.memory["vram_bytes"]) - float(est.memory["device_used_bytes"]))
    assert 0 < excess <= paged
    want = 2.0 * excess / (n["host_bw"] * tight.runtime.coeff("host_eff"))
    assert float(est.time["paging_s"]) == pytest.approx(want, rel=1e-5)
    assert float(est.time["offload_s"]) == pytest.approx(want, rel=1e-5)
    unpaged = estimate(cfg, _sc(False, vram_gib=used / 2**30, headroom=0.0))
    assert float(est.time["step_s"]) - float(unpaged.time["step_s"]) == pytest.approx(
        want, rel=1e-4)


@pytest.mark.parametrize("change, field", [
    ({"optimizer": "sgd"}, "training.paged_optimizer"),
    ({"optimizer": "adafactor"}, "training.paged_optimizer"),
    ({"runtime": "torchtitan"}, "training.paged_optimizer"),
    ({"runtime": "xla-gpu"}, "training.paged_optimizer"),
    ({"runtime": "deepspeed"}, "training.paged_optimizer"),
    ({"knobs": {"zero_stage": (3,)}}, "config.zero_stage"),
    ({"knobs": {"tp": (2,)}}, "config.tp"),
])
def test_what_bitsandbytes_does_not_page_is_refused_naming_the_field(change, field):
    kw = {"model": llama_like(hidden=512, heads=8, kv=2), "runtime": "hf", "count": 2,
          "global_batch": 4, "seq_len": 256, "paged_optimizer": True, **change}
    with pytest.raises(CapoptError) as e:
        make_scenario(kw.pop("model"), **kw)
    assert e.value.field == field


def test_left_to_the_search_zero_and_tp_are_narrowed():
    """ZeRO sharding and tensor parallelism are not searched with a paged optimizer: the
    scenario narrows them to 0 and 1 (bitsandbytes steps plain device tensors)."""
    sc = _sc(True, count=2)
    assert sc.knob("zero_stage").values == (0,) and sc.knob("tp").values == (1,)


def _small_card(paged):
    return one_line_scenario({
        "model.card": ("llama-3.2-3b", "t"), "hardware.gpu": ("rtx-4090-24gb", "t"),
        "hardware.count": (1, "t"), "training.seq_len": (2048, "t"),
        "training.global_batch": (16, "t"), "training.precision": ("bf16", "t"),
        "training.runtime": ("hf", "t"), "training.paged_optimizer": (paged, "t")}, {})


def test_auto_pages_where_nothing_fits_otherwise_and_remedies_offer_it():
    """Llama-3.2-3B in pure bf16 on one RTX 4090: parameters, gradients and AdamW's moments
    do not fit at any config; with the state paged they do, and "auto" takes it. Without a
    choice the remedies list paging as a change that fits."""
    plain = capopt.optimize(_small_card(False), method="exhaustive", top_k=1)
    assert plain.status == "infeasible"
    assert any(r.fits and r.scenario.workload.paged_optimizer for r in plain.remedies)
    res = capopt.optimize(_small_card("auto"), method="exhaustive", top_k=3, remedies=False)
    assert res.status == "ok"
    assert all(c.scenario.workload.paged_optimizer for c in res.candidates)
    assert res.best.config.zero_stage == 0 and res.best.config.tp == 1


def test_command_line_flag_table_and_launch_file(capsys):
    """``--paged-optimizer`` sets the field; plan says where the state is; the Trainer's file
    names bitsandbytes' optimizer; a format that cannot write it exits 2 naming the field."""
    args = ["--model", "llama-3.2-1b", "--gpu", "rtx-4090-24gb", "--count", "1",
            "--seq-len", "2048", "--global-batch", "16", "--runtime", "hf",
            "--optimizer", "adamw-8bit", "--paged-optimizer", "--set", "micro_batch=1"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "paged optimizer state:" in out and "CUDA managed memory" in out
    assert main(["plan", *args, "--emit", "hf-trainer"]) == 0
    assert json.loads(capsys.readouterr().out)["optim"] == "paged_adamw_8bit"
    assert main(["plan", *args, "--emit", "torchtitan"]) == 2
    assert "training.paged_optimizer" in capsys.readouterr().err
    assert main(["plan", *args[:-3], "--optimizer", "sgd", "--paged-optimizer",
                 "--set", "micro_batch=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # (given by its flag, the error names the flag)
    assert len(err) == 1 and "--paged-optimizer" in err[0] and "adamw-8bit" in err[0]


def test_the_torch_tier_refuses_a_paged_optimizer():
    """The torch tier steps torch's optimizers on fake tensors: it cannot hold managed memory,
    so a paged scenario is refused rather than measured as something else."""
    from capopt.validation.step import Unsupported
    from capopt.validation.torch_step import check_supported
    with pytest.raises(Unsupported, match="paged"):
        check_supported(_sc(True), Config(micro_batch=2, grad_accum=2))
    check_supported(_sc(False), Config(micro_batch=2, grad_accum=2))


def test_the_32bit_paged_optimizers_keep_float32_state_whatever_the_parameters():
    """bitsandbytes' 32-bit optimizers allocate float32 moments (Optimizer2State.init_state,
    optim_bits 32): under pure bf16, where torch's AdamW keeps bf16 moments, the paged one
    keeps twice the bytes; 8-bit AdamW's are its own either way."""
    for opt, ratio in (("adamw", 2.0), ("lion", 2.0), ("adamw-8bit", 1.0)):
        on, off = (scenario_numbers(_sc(p, precision="bf16", optimizer=opt))["opt_bytes"]
                   for p in (True, False))
        assert on == pytest.approx(ratio * off), opt
