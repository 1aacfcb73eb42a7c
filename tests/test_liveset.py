"""Reading XLA's own live set at a compiled step's peak (the source of the xla-gpu rules)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capopt._specs import Config
from capopt.validation.liveset import read_peak, read_temp_heap, summarize
from capopt.validation.tiers import environment, xla_gpu_available

_OK, _WHY = xla_gpu_available()

SCRIPT = textwrap.dedent("""
    import sys
    from capopt.validation.tiers import configure_jax_for, run_xla_gpu
    from capopt._model import ModelSpec
    from capopt._specs import Budget, Config, Scenario, Workload
    from capopt._hardware import get_hardware
    from capopt._runtime import get_profile
    configure_jax_for("xla-gpu")
    remat, flash, layers, seq = sys.argv[1], sys.argv[2] == "flash", *map(int, sys.argv[3:5])
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    m = ModelSpec(name="t", family="decoder", hidden_size=128, num_hidden_layers=layers,
                  num_attention_heads=2, intermediate_size=256, vocab_size=500,
                  max_position_embeddings=seq)
    hw = get_hardware("h100-sxm-80gb")
    sc = Scenario(name="t", model=m, hardware=hw, count=1, per_node=1,
                  workload=Workload(seq_len=seq, global_batch=batch, precision="bf16-mixed",
                                    grad_clip=False),
                  budget=Budget(vram_bytes=hw.memory_bytes), runtime=get_profile("xla-gpu"))
    out = run_xla_gpu(sc, Config(micro_batch=2, grad_accum=batch // 2, remat=remat,
                                 flash_attention=flash))
    print(out["measured"]["peak_bytes"], out["measured"]["temp_bytes"],
          out["measured"]["argument_bytes"])
""")


def _compile(tmp_path, remat, flash=False, layers=2, seq=128, batch=2):
    """(peak, temp, argument bytes) of the step compiled with a dump in ``tmp_path``."""
    env = environment("xla-gpu", Config(micro_batch=2))
    env["XLA_FLAGS"] += f" --xla_dump_to={tmp_path} --xla_dump_hlo_module_re=jit_step"
    done = subprocess.run([sys.executable, "-c", SCRIPT, remat, "flash" if flash else "mat",
                           str(layers), str(seq), str(batch)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return tuple(map(int, done.stdout.split()[-3:]))


def _compile_and_read(tmp_path, remat, flash=False, layers=2, seq=128):
    peak, temp, arg = _compile(tmp_path, remat, flash, layers, seq)
    return peak, read_peak(tmp_path)


@pytest.mark.xla_gpu
@pytest.mark.skipif(not _OK, reason=_WHY or "xla-gpu plugin absent")
@pytest.mark.parametrize("remat", ["none", "full"])
def test_peak_live_set_is_read_block_by_block(tmp_path, remat):
    peak, p = _compile_and_read(tmp_path, remat)
    assert 0 <= p.index < p.length and p.values
    # the live values, each memory slot once, are what the buffer assignment packs: no more
    # than its peak (the heap's packing can only add)
    assert 0.5 * peak < p.total_bytes <= peak
    groups = summarize(p)
    assert any(k.startswith("argument") for k in groups)
    blocks = {v.block for v in p.values if v.block is not None}
    assert blocks <= {0, 1} and blocks           # the named scopes reach the metadata
    if remat == "full":
        # a fully recomputed block keeps its input only: no forward MLP tensor of block 0
        # survives to the peak (block 0 is rebuilt last)
        assert not any(v.block == 0 and v.phase == "forward" and v.module == "mlp"
                       for v in p.unique())


@pytest.mark.xla_gpu
@pytest.mark.skipif(not _OK, reason=_WHY or "xla-gpu plugin absent")
def test_a_loop_holds_its_bodys_peak_and_the_temp_allocation_is_that(tmp_path):
    """Two micro-batches a step: the step is a while loop over them. The dump's flattened
    live ranges place the loop body before the while instruction, where the values held
    across the loop (the gradient accumulators) are not live, so their most bytes at once
    fall short of XLA's temporary allocation; held as XLA's heap simulator holds a loop (the
    body's own peak at the while, beside what is live across it) they are that allocation.
    Within 1%: what the heap adds over XLA's own buffers, its packing, a median 0.1% of the
    peak on the 92 fitting configs of `benchmarks/xla_liveness.py` (p90 5.2%, on steps with
    many buffers of unequal lifetimes; this one has few)."""
    peak, temp, _ = _compile(tmp_path, "none", batch=4)
    h = read_temp_heap(tmp_path)
    assert h.temp_bytes == temp and h.loops >= 1
    assert h.flat_live_bytes < 0.95 * temp
    assert h.nested_live_bytes == pytest.approx(temp, rel=0.01)
    assert 0 <= h.packing_bytes
    # the nested peak is inside the loop over micro-batches, and its values are its bytes
    assert "while/body" in h.peak_op_name
    assert sum(v.bytes for v in h.peak_values) == h.nested_live_bytes


@pytest.mark.xla_gpu
@pytest.mark.skipif(not _OK, reason=_WHY or "xla-gpu plugin absent")
def test_flash_stand_in_allocates_its_buffers_with_its_block(tmp_path):
    """The chunked stand-in for a flash kernel allocates its output and its dq/dk/dv where its
    block runs, as a kernel does: at the peak of a six-block full-recompute step no buffer
    outside every named scope holds more than two (b, s, heads, head_dim) tensors. (Written as
    a scan, XLA fused every block's zero-initialised buffers into one fusion scheduled at the
    step's start: five or six blocks' worth at the peak.)"""
    layers, seq = 6, 512
    _, p = _compile_and_read(tmp_path, "full", flash=True, layers=layers, seq=seq)
    qkv = 2 * seq * 128 * 2                     # batch 2, 128 wide, bf16
    unscoped = sum(v.bytes for v in p.unique() if v.phase == "other")
    assert unscoped <= 2 * qkv, (unscoped, qkv)


def test_the_schedulers_peaks_are_read_from_xlas_log():
    """The xla-gpu tier reads the order XLA's memory scheduler kept (the lowest of its list,
    depth-first and post-order heap simulations, VLOG(2) lines) and the latency-hiding
    scheduler's memory use and limit from the compile's log; the last compile's lines win
    (a compile retried with Triton GEMMs off logs twice)."""
    from capopt.validation.xla_log import schedule_report
    first = "I1202 hlo_memory_scheduler.cc:619] Chose min-memory list sequence: 99.00GiB\n"
    log = ("I1202 hlo_memory_scheduler.cc:591] Min-memory list sequence: 16.75GiB\n"
           "I1202 hlo_memory_scheduler.cc:598] Min-memory dfs sequence: 14.97GiB\n"
           "I1202 hlo_memory_scheduler.cc:605] Min-memory post order sequence: 512.00MiB\n"
           "I1202 hlo_memory_scheduler.cc:619] Chose min-memory dfs sequence: 14.97GiB\n"
           "I1202 latency_hiding_scheduler.cc:4325] [latency-hiding-scheduler] "
           "LatencyHidingScheduler current memory usage: 184168124 bytes. "
           "Current limit: 65268994195\n")
    r = schedule_report(first + log)
    assert r["order"] == "dfs"
    assert r["scheduled_bytes"] == round(14.97 * 2 ** 30)
    assert r["sequences_bytes"] == {"list": round(16.75 * 2 ** 30), "dfs": round(14.97 * 2 ** 30),
                                    "post_order": 512 * 2 ** 20}
    assert r["resolution_bytes"] == int(0.005 * 2 ** 30)
    assert (r["lhs_bytes"], r["lhs_limit_bytes"]) == (184168124, 65268994195)
    no_lhs = schedule_report(log.split("I1202 latency")[0])
    assert no_lhs["lhs_bytes"] is None and no_lhs["scheduled_bytes"] == r["scheduled_bytes"]
    assert schedule_report("no scheduler lines") is None


def test_a_loop_is_held_at_its_while_at_its_own_peak_innermost_first():
    """`_nested_peak` on spans by hand: a loop whose condition and body sit at positions
    [2, 5] and run at 6, with a loop inside it at [3, 3] run at 4. The flat sweep sees the
    body's buffers beside only what is live at positions 2-5 (A); held at the while they sit
    beside what lives across the loop (A and the carried D, defined at 6)."""
    from capopt.validation.liveset import _max_live, _nested_peak, _Span
    spans = [_Span(5, 0, 10, (("A", ""),)), _Span(7, 6, 10, (("D", ""),)),
             _Span(10, 2, 4, (("B", ""),)), _Span(4, 4, 5, (("C", ""),)),
             _Span(6, 3, 3, (("E", ""),))]       # E: inside the inner loop, beside B
    assert _max_live(spans)[0] == 5 + 10 + 6     # flat: A, B and E at position 3
    best, at, live = _nested_peak(spans, [(2, 6), (3, 4)])
    # the inner loop holds E (6) at 4, beside B (10) and C (4) there: the body's peak 20,
    # held at 6 beside A and D
    assert (best, at) == (5 + 7 + 20, 6)
    assert sorted(sp.size for sp in live) == [5, 7, 20]
