"""Hybrid sharding (HSDP, ``config.dp_replicate``): the state split over a shard group of
dp / dp_replicate ranks, replicated across dp_replicate such groups, each reduce-scattered
gradient shard then all-reduced across the replicas (FSDP2's foreach_reduce; Megatron-Core's
--num-distributed-optimizer-instances)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import llama_like, make_scenario

from capopt._errors import CapoptError
from capopt._specs import Config
from capopt._validity import config_problems, mend
from capopt.cost import estimate, estimate_numbers, knobs_from_config, numbers_pytree
from capopt.cost import comm
from capopt.report.launch import emit
from capopt.search import optimize
from capopt.search._space import Space, build_lattice


def _run(cfg, sc):
    out = estimate_numbers(knobs_from_config(cfg), numbers_pytree(sc))
    return ({k: float(v) for k, v in out.memory.items()},
            {k: float(v) for k, v in out.time.items()})


def _pair(zero, mb=1, ga=2):
    """(HSDP: 16 ranks as 4 replicas of a 4-rank shard group, one node each; FSDP over the
    one 4-rank node): the same shard group, the same sequences per replica."""
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    kw = dict(runtime="torchtitan", seq_len=1024)
    hsdp_sc = make_scenario(m, count=16, global_batch=16 * mb * ga, **kw)
    hsdp_sc = hsdp_sc.replace(per_node=4)
    one_sc = make_scenario(m, count=4, global_batch=4 * mb * ga, **kw).replace(per_node=4)
    hsdp = Config(micro_batch=mb, grad_accum=ga, dp=16, zero_stage=zero, dp_replicate=4)
    one = Config(micro_batch=mb, grad_accum=ga, dp=4, zero_stage=zero)
    assert not config_problems(hsdp, hsdp_sc) and not config_problems(one, one_sc)
    return (hsdp, hsdp_sc), (one, one_sc)


@pytest.mark.parametrize("zero", [2, 3])
def test_hybrid_sharding_holds_the_shard_groups_state_and_adds_one_all_reduce_of_its_shard(zero):
    """16 ranks as 4 replicas of a 4-rank group hold, per rank, exactly what FSDP over 4 ranks
    holds (parameters, gradients, optimizer state, activations: the state is split over the
    shard group only), compute the same, and communicate the same gathers and
    reduce-scatters inside the group, plus, after each group's reduce-scatter (every
    micro-batch: FSDP2 does not skip it under accumulation), one all-reduce of the group's
    gradient shard (1/4 of its gradients) across the 4 replicas, one rank a node apart."""
    (hc, hsc), (oc, osc) = _pair(zero)
    (hm, ht), (om, ot) = _run(hc, hsc), _run(oc, osc)
    for term in ("params_bytes", "grads_all_bytes", "optimizer_bytes", "activations_bytes",
                 "total_bytes"):
        assert hm[term] == pytest.approx(om[term], rel=1e-6), term
    assert ht["compute_s"] == pytest.approx(ot["compute_s"], rel=1e-6)
    assert ht["optimizer_s"] == pytest.approx(ot["optimizer_s"], rel=1e-6)
    # the all-reduce by hand: the stage's gradients (every trainable parameter here, one
    # stage, bf16 gradients under FSDP2's reduce dtype as the profile prices them) / 4,
    # over 4 ranks on 4 nodes, one collective per FSDP group (4 blocks + the root), each
    # micro-batch
    n = numbers_pytree(hsc)
    shard_bytes = om["trainable_params"] * float(n["grad_bytes"]) / 4
    groups = 4 + 1
    ar = float(comm.ring_collectives_s(shard_bytes, 4.0, 1.0, 4.0, n, count=groups,
                                       passes=2.0))
    assert ar > 0
    extra = (ht["comm_zero_s"] + ht["comm_hidden_s"]) - (ot["comm_zero_s"] + ot["comm_hidden_s"])
    assert extra == pytest.approx(hc.grad_accum * ar, rel=1e-4)


def test_a_replica_all_reduce_of_its_own_is_hidden_as_the_data_parallel_all_reduce():
    """Where the runtime issues the replicas' all-reduce as a data-parallel all-reduce of its
    own (``replica_ar_as_dp``: XLA's), ``overlap_dp`` hides it, not ``overlap_zero``: none of
    it hidden at overlap_dp 0 (the xla-gpu profile's), all of it (the compute allows) at 1;
    ZeRO's own collectives and everything but the communication stay as they were."""
    (hc, hsc), _ = _pair(3)

    def comm_of(**coeffs):
        sc = hsc.replace(runtime=hsc.runtime.with_coeffs(**coeffs))
        return _run(hc, sc)[1]

    base = dict(overlap_zero=0.7, overlap_pp=0.0)
    with_zero = comm_of(replica_ar_as_dp=0.0, overlap_dp=0.0, **base)
    exposed = comm_of(replica_ar_as_dp=1.0, overlap_dp=0.0, **base)
    hidden = comm_of(replica_ar_as_dp=1.0, overlap_dp=1.0, **base)
    total = {k: v["comm_zero_s"] + v["comm_hidden_s"] for k, v in
             (("z", with_zero), ("e", exposed), ("h", hidden))}
    # the same collectives, priced once each whichever way they hide
    assert total["z"] == pytest.approx(total["e"], rel=1e-6)
    assert total["e"] == pytest.approx(total["h"], rel=1e-6)
    assert exposed["comm_zero_s"] > with_zero["comm_zero_s"] > hidden["comm_zero_s"]
    # (the replicas' all-reduce alone moves between hidden and exposed: ZeRO-3's gathers and
    # reduce-scatters hide at overlap_zero in both)
    assert exposed["comm_zero_s"] - hidden["comm_zero_s"] == pytest.approx(
        hidden["comm_hidden_s"] - exposed["comm_hidden_s"], rel=1e-6)
    for term in ("compute_s", "memory_bound_s", "optimizer_s"):
        assert exposed[term] == pytest.approx(with_zero[term], rel=1e-6), term


def test_hybrid_sharding_keeps_more_state_per_rank_than_sharding_over_all_of_dp():
    """The same 16 ranks sharding over all of dp hold a quarter of the shard group's
    optimizer state and parameters (ZeRO-3)."""
    (hc, hsc), _ = _pair(3)
    full = hc.replace(dp_replicate=1)
    hm, fm = _run(hc, hsc)[0], _run(full, hsc)[0]
    assert hm["optimizer_bytes"] == pytest.approx(4 * fm["optimizer_bytes"], rel=1e-6)
    assert hm["params_bytes"] == pytest.approx(4 * fm["params_bytes"], rel=1e-6)
    assert hm["total_bytes"] > fm["total_bytes"]


def test_hybrid_sharding_rules_name_the_knob_and_mend_to_one():
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=16, global_batch=16)
    base = Config(dp=16, zero_stage=3, dp_replicate=4)
    assert not config_problems(base, sc)
    cases = {
        "needs zero_stage": base.replace(zero_stage=0),
        "must divide dp / cp": base.replace(dp_replicate=3),
        "shard group of at least 2": base.replace(dp_replicate=16),
    }
    for words, cfg in cases.items():
        probs = config_problems(cfg, sc)
        assert any(f == "config.dp_replicate" and words in why for f, why in probs), (words,
                                                                                    probs)
        assert mend(cfg.to_dict(), sc)["dp_replicate"] == 1
    xla = make_scenario(m, runtime="xla-gpu", count=16, global_batch=16)
    probs = config_problems(base, xla)
    assert any(f == "config.dp_replicate" and "not supported by the xla-gpu" in why
               for f, why in probs)
    # with cp, the shard group counts the context-parallel ranks: dp 16 = 4 x (2 x cp 2)
    long = make_scenario(m, runtime="torchtitan", count=16, global_batch=16, seq_len=1024)
    assert not config_problems(base.replace(cp=2, micro_batch=2), long)
    assert config_problems(base.replace(cp=8, dp_replicate=4, micro_batch=8), long)


def test_moe_with_expert_parallelism_refuses_hybrid_sharding():
    m = llama_like(num_local_experts=8, num_experts_per_tok=2)
    sc = make_scenario(m, runtime="torchtitan", count=8, global_batch=8)
    probs = config_problems(Config(dp=8, ep=2, zero_stage=3, dp_replicate=2), sc)
    assert any(f == "config.dp_replicate" and "expert parallelism" in why for f, why in probs)


def test_the_lattice_holds_hybrid_sharding_only_beside_a_zero_stage_and_counts_itself():
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=16, global_batch=32,
                       knobs={"dp_replicate": None, "tp": (1, 2), "pp": (1,)})
    lat = build_lattice(sc)
    dpr, zero, dp = lat.cols["dp_replicate"], lat.cols["zero_stage"], lat.cols["dp"]
    assert (dpr > 1).any() and (dpr == 1).any()
    assert (zero[dpr > 1] > 0).all()
    assert (dp[dpr > 1] % dpr[dpr > 1] == 0).all() and (dp[dpr > 1] // dpr[dpr > 1] >= 2).all()
    assert Space(sc).size() == len(lat)
    for i in np.flatnonzero(dpr > 1)[:50]:
        assert not config_problems(lat.config(int(i)), sc)


def test_auto_chooses_hybrid_sharding_where_ring_latency_over_every_rank_dominates():
    """A 1.5B-parameter model on 512 GPUs with one sequence per rank: every FSDP collective
    over 512 ranks pays 448 intra-node and 63 inter-node ring steps of latency a block; a
    shard group of a few nodes pays a fraction of them and adds one all-reduce of its shard
    across the replicas. With ``dp_replicate = "auto"`` the exhaustive search and the
    relaxed solve with its rounding both choose hybrid sharding, faster than the best
    config sharding over all ranks."""
    m = llama_like(layers=24, hidden=1536, heads=16, kv=16, vocab=50304)

    def sc(dpr):
        return make_scenario(m, runtime="torchtitan", count=512, seq_len=1024,
                             global_batch=512, knobs={"tp": (1,), "pp": (1,),
                                                      "dp_replicate": dpr})
    auto = sc(None)
    exhaustive = optimize(auto, method="exhaustive", remedies=False)
    relaxed = optimize(auto, method="gradient", exhaustive_below=0, remedies=False)
    flat = optimize(sc((1,)), method="exhaustive", remedies=False)
    assert exhaustive.best.config.dp_replicate > 1
    assert relaxed.best.config == exhaustive.best.config
    assert (exhaustive.best.throughput["tokens_per_s"] > flat.best.throughput["tokens_per_s"])


def test_launch_files_write_hybrid_sharding_or_refuse_it():
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=16, global_batch=16)
    cfg = Config(dp=16, zero_stage=3, dp_replicate=4)
    text = emit("torchtitan", cfg, sc)
    assert "data_parallel_replicate_degree = 4" in text
    assert "data_parallel_shard_degree = 4" in text
    meg = emit("megatron", cfg.replace(zero_stage=1),
               make_scenario(m, runtime="megatron", count=16, global_batch=16))
    assert "--num-distributed-optimizer-instances 4" in meg
    with pytest.raises(CapoptError, match="dp_replicate"):
        emit("deepspeed", cfg, sc)
    # without hybrid sharding nothing changes in the file
    assert "data_parallel_replicate_degree = 1" in emit("torchtitan", cfg.replace(
        dp_replicate=1), sc)


def test_plan_and_a_stored_key_leave_dp_replicate_out_at_its_default():
    cfg = Config(dp=16, zero_stage=3)
    assert "dp_replicate" not in cfg.key_dict()
    assert cfg.replace(dp_replicate=2).key_dict()["dp_replicate"] == 2
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=16, global_batch=16)
    # estimate of a real config: finite and the shard group printed in the one-line summary
    from capopt._format import config_line
    est = estimate(cfg.replace(dp_replicate=2), sc)
    assert np.isfinite(est.memory["total_bytes"])
    assert "hsdp=2" in config_line(cfg.replace(dp_replicate=2).to_dict())
    assert "hsdp" not in config_line(cfg.to_dict())


def test_a_published_torchtitan_row_with_replicas_is_priced_as_hybrid_sharding():
    """A torchtitan benchmark row written with dp_replicate > 1 (HSDP) converts to a config
    with that many replicas of the dp_shard x cp group, not to an unexpressed row."""
    import json
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    from published_runs import predict, torchtitan_runs
    doc = json.loads((root / "benchmarks/published/torchtitan.json").read_text())
    row = dict(doc["rows"][0], gpus=16, nodes=2, dp_shard=8, dp_replicate=2,
               global_batch=32)
    run = torchtitan_runs({**doc, "rows": [row]})[0]
    assert not run.unexpressed and "hsdp2" in run.label
    assert run.config.dp == 16 and run.config.dp_replicate == 2
    assert run.config.zero_stage == 3 and run.config.shard_group == 8
    out = predict(run)
    assert out["status"] == "ok" and out["tokens_per_gpu"] > 0


def test_under_a_pipeline_schedule_the_replicas_all_reduce_once_a_step():
    """FSDP2 under torch's pipeline schedules skips every micro-batch's reduce-scatter and
    reduces once a step (``zero_pp_nosync``); under hybrid sharding that once-a-step
    reduce-scatter is followed by the replicas' all-reduce too: 16 ranks as 2 replicas of
    an (8-rank, pp 2) group cost more than the 8-rank group alone, and hold the same."""
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    kw = dict(runtime="torchtitan", seq_len=512)
    hsdp_sc = make_scenario(m, count=16, global_batch=32, **kw).replace(per_node=8)
    one_sc = make_scenario(m, count=8, global_batch=16, **kw).replace(per_node=8)
    hsdp = Config(micro_batch=1, grad_accum=4, dp=8, pp=2, zero_stage=3, dp_replicate=2)
    one = Config(micro_batch=1, grad_accum=4, dp=4, pp=2, zero_stage=3)
    assert not config_problems(hsdp, hsdp_sc) and not config_problems(one, one_sc)
    (hm, ht), (om, ot) = _run(hsdp, hsdp_sc), _run(one, one_sc)
    assert hm["total_bytes"] == pytest.approx(om["total_bytes"], rel=1e-6)
    assert ht["comm_zero_s"] + ht["comm_hidden_s"] > ot["comm_zero_s"] + ot["comm_hidden_s"]


def test_a_pinned_replica_count_the_runtime_refuses_is_named_not_called_infeasible():
    from capopt.search._space import knob_refusal
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="xla-gpu", count=8, global_batch=16,
                       knobs={"dp_replicate": (2,)})
    field, why = knob_refusal(sc)
    assert field == "config.dp_replicate" and "not supported by the xla-gpu" in why


def test_the_validation_step_refuses_hybrid_sharding_rather_than_shard_over_all_of_dp():
    from capopt.validation.step import Unsupported, build_step
    m = llama_like(layers=4, hidden=512, heads=8, kv=4)
    sc = make_scenario(m, runtime="torchtitan", count=8, global_batch=16)
    with pytest.raises(Unsupported, match="hybrid sharding"):
        build_step(sc, Config(micro_batch=2, dp=8, zero_stage=3, dp_replicate=2), devices=[])
