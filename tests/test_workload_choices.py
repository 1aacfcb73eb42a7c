"""[training] fields the optimiser chooses: ``loss``, ``compile``, ``optimizer_in_backward`` and
``activation_offload`` take a list or ``"auto"``. Each value the runtime and the model run is a
variant of the scenario, solved like a GPU of a fleet and ranked with the others; the answer
names its choice (table, JSON, launch file). What each value changes in memory and time is
tested with its layer (test_memory.py, test_time.py, test_workload_remedies.py)."""

from __future__ import annotations

import json

import pytest

import capopt
from capopt._errors import CapoptError
from capopt._scenario import load_scenario, one_line_scenario
from capopt.cli import main


def _llama(**values):
    v = {"training.runtime": ("hf", "training.runtime")}
    v.update({k: (x, k) for k, x in values.items()})      # (an error names the field)
    return load_scenario("llama3-8b-8xh100", values=v)


def _gemma_lora(loss):
    """Gemma-2-2B with LoRA rank 16 on one RTX 4090, 8192-token sequences: its 256k-entry
    vocabulary makes the float32 loss the peak."""
    return one_line_scenario({
        "model.card": ("gemma-2-2b", "t"), "hardware.gpu": ("rtx-4090-24gb", "t"),
        "hardware.count": (1, "t"), "training.seq_len": (8192, "t"),
        "training.global_batch": (8, "t"), "training.runtime": ("hf", "t"),
        "training.lora": ({"rank": 16}, "t"), "training.loss": (loss, "t")}, {})


def test_auto_offloading_is_taken_where_it_is_faster():
    """Llama-3-8B under the Trainer on 8 H100s with 48 GiB each: both values are solved,
    the answer is the better of the two, and here it is the offloaded one (the recomputed
    blocks' inputs on the host leave room for two sequences a micro-batch, which the 48 GiB
    cannot hold otherwise)."""
    sc = _llama(**{"training.activation_offload": "auto", "budget.vram_gib": 48})
    assert sc.choices == ("activation_offload",)
    assert [v.workload.activation_offload for v in sc.variants] == [False, True]
    res = capopt.optimize(sc, method="exhaustive", top_k=3, remedies=False)
    by = {v["training"]["activation_offload"]: v["best_tokens_per_s"]
          for v in res.per_variant}
    assert res.best.scenario.workload.activation_offload is True
    assert res.best.config.micro_batch == 2
    assert by[True] > by[False]
    assert res.best.throughput["tokens_per_s"] == pytest.approx(max(by.values()))
    # the same as solving the two scenarios apart
    alone = [capopt.optimize(v, method="exhaustive", top_k=1, remedies=False)
             for v in sc.variants]
    assert [a.best.throughput["tokens_per_s"] for a in alone] == [by[False], by[True]]


def test_a_listed_fused_linear_loss_is_taken_where_nothing_else_fits():
    """Gemma-2-2B's float32 loss does not fit the 4090 at any config; listing
    ``["float32", "fused-linear"]`` finds configs, all with the fused head (tp 1)."""
    assert capopt.optimize(_gemma_lora("float32"), method="exhaustive", top_k=1,
                           remedies=False).status == "infeasible"
    res = capopt.optimize(_gemma_lora(["float32", "fused-linear"]), method="exhaustive",
                          top_k=3, remedies=False)
    assert res.status == "ok"
    assert all(c.scenario.workload.loss == "fused-linear" and c.config.tp == 1
               for c in res.candidates)


def test_auto_takes_only_what_the_runtime_and_the_other_fields_allow():
    """The XLA step runs optax's float32 loss only; torchtitan does not offload activations;
    clipping rules out the optimizer in the backward pass; an XLA step has nothing to
    compile. Each "auto" left with one value is the field as before: no variants."""
    xla = load_scenario("llama3-8b-8xh100", values={"training.loss": ("auto", "t"),
                                                    "training.compile": ("auto", "t")})
    assert xla.choices == () and not xla.variants and xla.workload.loss == "float32"
    tt = _llama(**{"training.runtime": "torchtitan", "training.activation_offload": "auto"})
    assert tt.choices == () and not tt.variants
    oib = _llama(**{"training.optimizer_in_backward": "auto"})
    assert oib.choices == () and oib.workload.optimizer_in_backward is False
    both = _llama(**{"training.loss": "auto", "training.compile": "auto",
                     "hardware.gpu": ["h100-sxm-80gb", "a100-sxm-80gb"]})
    assert both.choices == ("loss", "compile")
    # 2 GPUs x 2 losses (the Trainer runs neither the fused nor the chunked one as priced)
    # x 2 compile settings; the fused head's variants have tp pinned to 1
    assert len(both.variants) == 8
    assert all(v.knob("tp").values == (1,) for v in both.variants
               if v.workload.loss == "fused-linear")
    eager = _llama(**{"training.runtime": "pytorch-eager", "training.loss": "auto"})
    assert [v.workload.loss for v in eager.variants] == ["float32", "fused", "fused-linear",
                                                         "chunked"]


def test_a_listed_value_the_runtime_does_not_run_is_refused():
    with pytest.raises(CapoptError, match="cross-entropy over whole logits") as err:
        load_scenario("llama3-8b-8xh100", values={"training.loss": (["float32", "fused"],
                                                                    "--loss")})
    assert err.value.field == "--loss"
    with pytest.raises(CapoptError) as err:
        _llama(**{"training.activation_offload": [False, True],
                  "training.runtime": "torchtitan"})
    assert err.value.field == "training.activation_offload"


def test_a_searched_field_is_not_offered_again_as_a_remedy():
    from capopt.search.remedies import (FUSED_LINEAR_LOSS, FUSED_LOSS, OFFLOAD_ACTIVATIONS,
                                        candidate_changes)
    sc = _llama(**{"training.loss": "auto", "training.activation_offload": "auto"})
    offered = dict(candidate_changes(sc.variants[0]))
    assert not {FUSED_LOSS, FUSED_LINEAR_LOSS, OFFLOAD_ACTIVATIONS} & set(offered)
    plain = dict(candidate_changes(_llama()))
    assert {FUSED_LINEAR_LOSS, OFFLOAD_ACTIVATIONS} <= set(plain)
    assert FUSED_LOSS not in plain              # (the Trainer runs no fused loss as priced)
    eager = dict(candidate_changes(_llama(**{"training.runtime": "pytorch-eager"})))
    assert {FUSED_LOSS, FUSED_LINEAR_LOSS, OFFLOAD_ACTIVATIONS} <= set(eager)


def test_the_answer_names_its_choice(tmp_path, capsys):
    """The table has a training column, the JSON a ``training`` entry per candidate and per
    variant, and ``--emit`` writes the chosen variant's launch file (TRL's
    activation_offloading where offloading won; tp and pp 1, which TrainingArguments runs)."""
    path = tmp_path / "s.toml"
    path.write_text('name = "t"\n[model]\ncard = "llama-3-8b"\n[hardware]\n'
                    'gpu = "h100-sxm-80gb"\ncount = 8\n[training]\nseq_len = 8192\n'
                    'global_batch = 256\nruntime = "hf"\nactivation_offload = "auto"\n'
                    '[budget]\nvram_gib = 64\n[config]\ntp = 1\npp = 1\n')
    assert main(["optimize", str(path), "--method", "exhaustive", "--top", "2"]) == 0
    table = capsys.readouterr().out
    assert "training" in table and "activations offloaded" in table
    assert main(["optimize", str(path), "--method", "exhaustive", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["best"]["training"] == {"activation_offload": True}
    assert sorted(v["training"]["activation_offload"] for v in d["per_variant"]) == [False,
                                                                                     True]
    pytest.importorskip("yaml")
    assert main(["optimize", str(path), "--method", "exhaustive", "--emit", "trl-sft"]) == 0
    assert "activation_offloading: true" in capsys.readouterr().out


def test_plan_prices_the_first_value_and_says_so(capsys):
    """``plan`` evaluates one config: the first value of a field left to the optimiser (the
    list's first), named in its header and in a note on stderr."""
    code = main(["plan", "--runtime", "hf", "--loss", "fused-linear,float32", "--set",
                 "micro_batch=2",
                 "--set", "dp=8", "--set", "zero_stage=3", "--set", "tp=1", "--set", "pp=1"])
    out = capsys.readouterr()
    assert code == 0
    assert "(fused-linear loss)" in out.out.splitlines()[0]
    assert "plan prices the first value" in out.err and "loss = fused-linear" in out.err


def test_choose_leaves_fields_to_the_optimiser_and_says_when_only_one_value_is_left(capsys):
    """``--choose FIELD[,FIELD]`` sets each field to "auto"; a field the runtime runs one way
    only is said so on one line (the XLA step: float32 loss, no offloading); an unknown field
    is exit 2 naming --choose and the fields."""
    assert main(["optimize", "--runtime", "hf", "--choose", "activation-offload", "--top", "1",
                 "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["best"]["training"].keys() == {"activation_offload"}
    assert main(["optimize", "--choose", "loss", "--top", "1", "--json"]) == 0
    err = capsys.readouterr().err
    assert 'training.loss = "auto": "float32" is the only value' in err
    assert main(["optimize", "--choose", "warp"]) == 2
    err = capsys.readouterr().err
    assert "--choose" in err and "activation_offload" in err and "Traceback" not in err


def test_remedies_are_solved_over_the_searched_values():
    """Nothing fits Llama-3-8B under the Trainer on one RTX 4090 (4 x 4096 tokens), the loss
    and offloading left to the optimiser: each change is solved over every variant, so LoRA
    rank 16 is found to fit with Liger's fused head and offloading (it does not with the
    float32 loss alone), and the change names the values it took."""
    sc = one_line_scenario({
        "model.card": ("llama-3-8b", "t"), "hardware.gpu": ("rtx-4090-24gb", "t"),
        "hardware.count": (1, "t"), "training.seq_len": (4096, "t"),
        "training.global_batch": (4, "t"), "training.runtime": ("hf", "t"),
        "training.loss": ("auto", "t"), "training.activation_offload": ("auto", "t")}, {})
    res = capopt.optimize(sc, top_k=1)
    assert res.status == "infeasible"
    lora = next(r for r in res.remedies if r.change.startswith("LoRA rank 16"))
    assert lora.fits and lora.training is not None
    assert lora.training != {"loss": "float32", "activation_offload": False}


def test_explain_takes_a_chunked_loss_without_offering_offloading():
    """The chunked loss is not priced with offloading: ``explain`` offers the other changes
    and does not stop on that one."""
    from capopt._specs import Config
    from capopt.search.remedies import OFFLOAD_ACTIVATIONS, explain
    sc = _llama(**{"training.runtime": "pytorch-eager", "training.loss": "chunked"})
    rep = explain(sc, Config(micro_batch=1, grad_accum=32, dp=8, zero_stage=3, tp=1))
    assert rep["remedies"] and not any(r["change"].startswith(OFFLOAD_ACTIVATIONS)
                                       for r in rep["remedies"])
