"""The rules of a real config: one table, applied to one config and to columns of them."""

from __future__ import annotations

import random

import numpy as np

from capopt._specs import Config
from capopt._validity import RULES, broken, config_problems
from capopt.search._space import build_lattice
from conftest import llama_like, make_scenario

KNOBS = ("micro_batch", "grad_accum", "dp", "tp", "pp", "ep", "cp", "vpp", "zero_stage",
         "sequence_parallel", "dp_replicate", "offload_params")


def _random_configs(rng: random.Random, n: int) -> list[Config]:
    # (hybrid sharding drawn from a stream of its own, seeded by one draw of rng's; parameter
    # offload from another, of a fixed seed: the other knobs' draws as before)
    own = random.Random(rng.random())
    off = random.Random(n)
    return [Config(micro_batch=rng.choice([1, 2, 3, 4, 8]), grad_accum=rng.choice([1, 2, 4, 16]),
                   dp=rng.choice([1, 2, 3, 4, 8]), tp=rng.choice([1, 2, 3, 4, 8, 16]),
                   pp=rng.choice([1, 2, 3, 4]), ep=rng.choice([1, 2, 4, 8]),
                   zero_stage=rng.choice([0, 1, 2, 3]), sequence_parallel=rng.random() < 0.5,
                   cp=rng.choice([1, 1, 2, 4, 64]), vpp=rng.choice([1, 1, 2, 3, 4]),
                   dp_replicate=own.choice([1, 1, 1, 1, 2, 4]),
                   offload_params=off.random() < 0.1)
            for _ in range(n)]


def test_the_table_over_columns_agrees_with_it_config_by_config():
    rng = random.Random(0)
    for sc in (make_scenario(llama_like(layers=4, kv=2), count=8, global_batch=32),
               make_scenario(llama_like(layers=6, num_local_experts=4, num_experts_per_tok=2),
                             count=16, global_batch=64),
               make_scenario(llama_like(layers=4, kv=2), runtime="torchtitan", count=8,
                             seq_len=96, global_batch=32)):
        cfgs = _random_configs(rng, 2000)
        cols = {k: np.asarray([int(getattr(c, k)) for c in cfgs]) for k in KNOBS}
        mask = broken(cols, sc)
        one_by_one = np.asarray([bool(config_problems(c, sc)) for c in cfgs])
        assert mask.any() and (~mask).any()          # both kinds drawn: the check can fail
        np.testing.assert_array_equal(mask, one_by_one)


def test_every_rule_is_broken_by_some_config_and_only_reads_what_it_says():
    rng = random.Random(1)
    cfgs = _random_configs(rng, 4000)
    cols = {k: np.asarray([int(getattr(c, k)) for c in cfgs]) for k in KNOBS}
    # a runtime without context parallelism (or interleaving) breaks its rule; one with it,
    # at a sequence that 2 x cp does not divide, the load balancer's
    scenarios = (make_scenario(llama_like(layers=6, kv=2, num_local_experts=4,
                                          num_experts_per_tok=2), count=16, global_batch=64),
                 make_scenario(llama_like(layers=6, kv=2), runtime="torchtitan", count=16,
                               seq_len=96, global_batch=64),
                 # (an optimizer stepped in the backward pass breaks its own rules)
                 make_scenario(llama_like(layers=6, kv=2), runtime="torchtitan", count=16,
                               seq_len=96, global_batch=64, grad_clip=False,
                               optimizer_in_backward=True),
                 # (a runtime that shards every data-parallel group breaks ZeRO-0 at dp > 1)
                 make_scenario(llama_like(layers=6, kv=2), runtime="torchtune", count=16,
                               global_batch=64, precision="bf16", loss="chunked"))
    for rule in RULES:
        hit = [np.asarray(rule.broken({k: cols[k] for k in rule.reads}, sc)).any()
               for sc in scenarios]
        assert any(hit), rule.why(cfgs[0], scenarios[0])


def test_the_lattice_obeys_every_rule():
    sc = make_scenario(llama_like(layers=6, kv=2, num_local_experts=4, num_experts_per_tok=2),
                       count=16, global_batch=64)
    lat = build_lattice(sc)
    assert len(lat) > 100
    assert not broken({k: lat.cols[k] for k in KNOBS}, sc).any()
    # interleaved stages searched: rows with vpp > 1, none breaking a rule (the micro-batch
    # counts a multiple of pp)
    sc = make_scenario(llama_like(layers=8, kv=2), runtime="megatron", count=8, global_batch=32,
                       knobs={"vpp": None})
    lat = build_lattice(sc)
    assert (lat.cols["vpp"] > 1).any() and (lat.cols["vpp"] == 1).any()
    assert not broken({k: lat.cols[k] for k in KNOBS}, sc).any()


def test_mend_repairs_what_its_rules_can_and_leaves_the_held_knob():
    sc = make_scenario(llama_like(layers=6, kv=2, num_local_experts=4, num_experts_per_tok=2),
                       count=16, global_batch=64)
    from capopt._validity import mend
    rng = random.Random(2)
    repairable = {r.field.split(".", 1)[1] for r in RULES if r.repair is not None}
    mended = 0
    for cfg in _random_configs(rng, 3000):
        d = cfg.to_dict()
        m = mend(d, sc)
        if m != d:
            mended += 1
        fixed = Config(**m)
        # what is still broken is a rule without a repair (devices, batch, heads, layers, or
        # experts that ep cannot divide)
        left = {f.split(".", 1)[1] for f, _ in config_problems(fixed, sc)}
        assert not left & (repairable - {"ep"}), (d, m, left)
        kept = mend(d, sc, keep="zero_stage")
        assert kept["zero_stage"] == d["zero_stage"]
    assert mended > 100


def test_pipeline_rules_follow_the_runtime():
    """FSDP under PyTorch's pipeline schedules (pytorch-eager, torchtitan) runs ZeRO-2/3 with
    pp and stages of unequal blocks; Megatron-LM and XLA's layout refuse both, naming the
    runtime; pp above the block count is refused everywhere."""
    m = llama_like(layers=6, kv=2)
    zero3_pp = Config(micro_batch=1, grad_accum=8, dp=4, pp=2, zero_stage=3)
    pp4 = Config(micro_batch=1, grad_accum=16, dp=2, pp=4)         # 4 does not divide 6
    pp8 = Config(micro_batch=1, grad_accum=32, dp=1, pp=8)         # more stages than blocks
    for rt in ("pytorch-eager", "torchtitan"):
        sc = make_scenario(m, runtime=rt, count=8, global_batch=32)
        assert config_problems(zero3_pp, sc) == [], rt
        assert config_problems(pp4, sc) == [], rt
        assert any("must not exceed" in why for _, why in config_problems(pp8, sc)), rt
    for rt in ("megatron", "xla-gpu"):
        sc = make_scenario(m, runtime=rt, count=8, global_batch=32)
        assert [f for f, why in config_problems(zero3_pp, sc)
                if f"the {rt} runtime" in why and "ZeRO-2/3" in why] == ["config.zero_stage"], rt
        assert [f for f, why in config_problems(pp4, sc)
                if "must divide" in why and rt in why] == ["config.pp"], rt
        assert [f for f, _ in config_problems(pp8, sc)] == ["config.pp"], rt


def test_megatrons_distributed_optimizer_runs_on_one_data_parallel_rank():
    """ZeRO-1 at dp 1 is Megatron's --use-distributed-optimizer over a group of one (its
    guide: 6 + 12/d bytes a parameter, d = 1 the non-distributed 18): a real config where
    the scenario names the stage, priced as stage 0; searched it is left out (stage 0's
    twin); stages 2 and 3 at dp 1, and stage 1 under other runtimes, stay refused."""
    from capopt._plan import plan
    from capopt._specs import KnobDomain
    searched = make_scenario(llama_like(), runtime="megatron", count=2, global_batch=4)
    # (named by the scenario; searched, stage 1 at dp 1 is stage 0's twin and left out)
    sc = searched.replace(knobs=searched.knobs + (KnobDomain("zero_stage", (0, 1)),))
    one, zero = (Config(micro_batch=2, grad_accum=2, dp=1, tp=2, zero_stage=z) for z in (1, 0))
    assert not config_problems(one, sc)
    assert config_problems(one.replace(zero_stage=2), sc)
    a, b = plan(sc, one), plan(sc, zero)
    assert a.memory["total_bytes"] == b.memory["total_bytes"]
    assert a.time["step_s"] == b.time["step_s"]
    assert [f for f, _ in config_problems(one, searched)] == ["config.zero_stage"]
    other = make_scenario(llama_like(), runtime="torchtitan", count=2, global_batch=4)
    other = other.replace(knobs=other.knobs + (KnobDomain("zero_stage", (0, 1)),))
    assert [f for f, _ in config_problems(one, other)] == ["config.zero_stage"]
