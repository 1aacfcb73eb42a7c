"""The micro-batches a pipeline rank holds, against the frameworks' own schedules.

`capopt.cost.memory.pipeline_in_flight` says how many micro-batches' worth of a rank's blocks
hold activations at its peak under 1F1B and interleaved 1F1B. Both frameworks that run
interleaving build their schedule from a warmup count; here their own code builds it, with a
stand-in for the process group, and the peak number of chunk forwards whose backward has not
run is counted: torch's ``ScheduleInterleaved1F1B`` action lists (torch.distributed.pipelining,
every rank's operations) and Megatron-Core's ``get_pp_rank_microbatches`` (the warmup count its
interleaved and non-interleaved schedules run, then one forward before each backward)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from capopt.cost.memory import first_chunk_in_flight, pipeline_in_flight

F32 = 1e-6       # the count is float32 (a count over v, times v here): its rounding, no more
CASES = [(p, v, m) for p in (2, 3, 4, 8) for v in (1, 2, 3, 4)
         for m in sorted({1, 2, p - 1, p, 2 * p, 3 * p, 4 * p} - {0})
         if v == 1 or m % p == 0]           # interleaving: micro-batches a multiple of pp


def capopt_chunks(p: int, v: int, m: int, rank: int) -> float:
    """capopt's count, in chunks (1/v of the rank's blocks) of one micro-batch."""
    k = SimpleNamespace(grad_accum=float(m), vpp=float(v))
    return float(pipeline_in_flight(k, float(p), float(rank))) * v


def torch_peak(p: int, v: int, m: int, rank: int, stage: int | None = None) -> int:
    """Most chunk forwards without their backward in torch's interleaved schedule of ``rank``
    (the schedule's own `_calculate_single_rank_operations`, its attributes set as its
    constructor sets them from the stages and ``n_microbatches``); with ``stage``, of that
    stage's forwards alone."""
    from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B,
                                                        _ComputationType)
    s = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = p, v, m
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    live = peak = 0
    for action in s._calculate_single_rank_operations(rank):
        if action is None or (stage is not None and action.stage_index != stage):
            continue
        if action.computation_type == _ComputationType.FORWARD:
            live += 1
        elif action.computation_type in (_ComputationType.FULL_BACKWARD,
                                         _ComputationType.BACKWARD_INPUT):
            live -= 1
        peak = max(peak, live)
    assert live == 0                        # every forward met its backward
    return peak


def megatron_peak(p: int, v: int, m: int, rank: int) -> int:
    """Chunk forwards in flight on ``rank`` under Megatron-Core: its warmup count, then one
    more forward before the first backward (all of them when the warmup takes every one)."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: p, rank=lambda: rank),
                           virtual_pipeline_model_parallel_size=v if v > 1 else None)
    total, all_warmup, warmup, _ = get_pp_rank_microbatches(m, v, p, p2p_communicator=comm)
    return total if all_warmup else warmup + 1


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _installed("torch"), reason="torch is not installed")
def test_interleaved_in_flight_is_torchs_schedule():
    checked = 0
    for p, v, m in CASES:
        if v == 1:
            continue
        for rank in range(p):
            assert capopt_chunks(p, v, m, rank) == pytest.approx(torch_peak(p, v, m, rank),
                                                                 rel=F32), (p, v, m, rank)
            checked += 1
    assert checked > 100


@pytest.mark.skipif(not _installed("torch"), reason="torch is not installed")
def test_first_chunk_edge_in_flight_is_torchs_schedule():
    """Rank 0's input edge (the embedding's output) is held for the micro-batches its first
    chunk (stage 0) has in flight: `first_chunk_in_flight`."""
    checked = 0
    for p, v, m in CASES:
        if v == 1:
            continue
        k = SimpleNamespace(grad_accum=float(m), vpp=float(v))
        assert float(first_chunk_in_flight(k, float(p))) == torch_peak(p, v, m, 0, stage=0), \
            (p, v, m)
        checked += 1
    assert checked > 30


@pytest.mark.skipif(not _installed("megatron.core"), reason="megatron-core is not installed")
def test_in_flight_is_megatron_cores_schedule_with_and_without_interleaving():
    import warnings
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "Transformer Engine and Apex are not installed"
        for p, v, m in CASES:
            for rank in range(p):
                assert capopt_chunks(p, v, m, rank) == pytest.approx(
                    megatron_peak(p, v, m, rank), rel=F32), (p, v, m, rank)
                checked += 1
    assert checked > 200
