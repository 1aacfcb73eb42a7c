"""Asynchronous tensor parallelism (``training.async_tp``, torchtitan's
enable_async_tensor_parallel): TorchInductor's micro-pipeline pass fuses each tensor-parallel
all-gather with the matmul that reads it and each reduce-scatter with the matmul that writes
it, so a collective hides behind that matmul, and DTensor's plain tensor parallelism hides
nothing (the pytorch-eager profiles' ``overlap_tp_bwd`` 0)."""

from __future__ import annotations

import pytest
from conftest import llama_like, make_scenario

from capopt._errors import CapoptError
from capopt._hardware import get_hardware
from capopt._specs import Config
from capopt.cost import estimate
from capopt.report.launch import emit


def _sc(model=None, async_tp=True, **kw):
    kw.setdefault("runtime", "torchtitan")
    kw.setdefault("count", 8)
    kw.setdefault("seq_len", 2048)
    kw.setdefault("global_batch", 8)
    kw.setdefault("compile", True)
    return make_scenario(model or llama_like(layers=4, hidden=4096, heads=32, kv=8,
                                             vocab=32000, intermediate_size=14336),
                         async_tp=async_tp, **kw)


def test_it_needs_torch_compile_and_a_runtime_that_runs_it():
    with pytest.raises(CapoptError, match="torch.compile pass") as err:
        _sc(compile=False)
    assert err.value.field == "training.async_tp"
    for runtime in ("xla-gpu", "pytorch-eager", "megatron", "deepspeed", "hf", "llm-foundry"):
        with pytest.raises(CapoptError, match="no asynchronous tensor parallelism") as err:
            _sc(runtime=runtime, compile=runtime != "xla-gpu" and runtime != "megatron")
        assert err.value.field == "training.async_tp"
        assert "torchtitan" in str(err.value)
    assert _sc().workload.async_tp


def _times(est) -> dict:
    return {k: float(v) for k, v in est.time.items()}


def _pair(cfg, **kw):
    return (_times(estimate(cfg, _sc(async_tp=False, **kw))), _times(estimate(cfg, _sc(**kw))),
            estimate(cfg, _sc(async_tp=False, **kw)).memory["total_bytes"],
            estimate(cfg, _sc(**kw)).memory["total_bytes"])


def test_it_moves_tensor_parallel_seconds_from_exposed_to_hidden_and_nothing_else():
    """One data-parallel rank (no other communication): plain DTensor tensor parallelism
    hides none of its collectives; asynchronous, part of them hide, the sum stays, and
    memory, compute and the memory-bound seconds are the same."""
    cfg = Config(micro_batch=1, grad_accum=8, dp=1, tp=8, sequence_parallel=True)
    plain, fused, plain_mem, fused_mem = _pair(cfg)
    assert plain["comm_hidden_s"] == 0.0
    assert fused["comm_hidden_s"] > 0.0
    assert fused["comm_tp_s"] < plain["comm_tp_s"]
    # float32 sums of a few dozen terms
    assert (fused["comm_tp_s"] + fused["comm_hidden_s"]
            == pytest.approx(plain["comm_tp_s"], rel=1e-5))
    for key in ("compute_s", "memory_bound_s", "optimizer_s"):
        assert fused[key] == pytest.approx(plain[key], rel=1e-6)
    assert fused_mem == plain_mem


def test_a_collective_hides_behind_its_own_matmul_only():
    """The MLP's matmuls (14336 wide, split 8 ways) are longer than their collectives, the
    attention's output projection (4096 x 4096 / 8) is not: on 8 ranks each block keeps part
    of its tensor-parallel time exposed (the exposed seconds grow with the blocks); on 2 ranks
    every matmul outlasts its collective, and what stays exposed is the embedding's and the
    head's all-reduces, whatever the number of blocks."""
    def exposed(layers, tp):
        m = llama_like(layers=layers, hidden=4096, heads=32, kv=8, vocab=32000,
                       intermediate_size=14336)
        cfg = Config(micro_batch=1, grad_accum=8 // (8 // tp), dp=8 // tp, tp=tp,
                     sequence_parallel=True)
        return _times(estimate(cfg, _sc(m)))["comm_tp_s"]
    assert exposed(8, 8) > exposed(4, 8) > 0.0
    assert exposed(8, 2) == pytest.approx(exposed(4, 2), rel=1e-5)


def test_without_tensor_parallelism_it_changes_nothing():
    cfg = Config(micro_batch=1, dp=8, zero_stage=3)
    plain, fused, _, _ = _pair(cfg)
    assert fused["step_s"] == plain["step_s"]


def test_it_is_written_into_torchtitans_file_and_refused_elsewhere():
    cfg = Config(micro_batch=1, grad_accum=2, dp=4, tp=2, sequence_parallel=True,
                 zero_stage=3)
    text = emit("torchtitan", cfg, _sc())
    assert "enable_async_tensor_parallel = true" in text
    assert "enable_async_tensor_parallel" not in emit("torchtitan", cfg, _sc(async_tp=False))
    with pytest.raises(CapoptError, match="asynchronous tensor parallelism") as err:
        emit("accelerate", cfg, _sc())
    assert err.value.field == "--emit" and "training.async_tp" in str(err.value)


def test_torchao_float8_tensor_parallelism_all_gathers_8_bit_inputs_forward_only():
    """Under float8 with sequence parallelism torchtitan's tensor parallelism (torchao's
    Float8ColwiseParallel) all-gathers the blocks' matrix inputs in float8: a block's forward
    pair of all-gather and reduce-scatter takes 3/4 of the 16-bit pair's time and its backward
    pair all of it, so the per-block tensor-parallel seconds are 7/8 (no recomputation);
    without sequence parallelism there is no all-gather to shrink."""
    def per_block(sp, on):
        out = []
        for layers in (4, 8):
            m = llama_like(layers=layers, hidden=4096, heads=32, kv=8, vocab=32000,
                           intermediate_size=14336)
            sc = _sc(m, async_tp=False, precision="fp8-mixed", hardware=get_hardware("h100"))
            sc = sc.replace(runtime=sc.runtime.with_coeffs(tp_fp8_allgather=on))
            cfg = Config(micro_batch=1, grad_accum=8, dp=1, tp=8, sequence_parallel=sp)
            out.append(_times(estimate(cfg, sc))["comm_tp_s"])
        return (out[1] - out[0]) / 4
    # float32 differences of sums over a few dozen terms
    assert per_block(True, 1.0) / per_block(True, 0.0) == pytest.approx(7 / 8, rel=1e-4)
    assert per_block(False, 1.0) == pytest.approx(per_block(False, 0.0), rel=1e-5)
