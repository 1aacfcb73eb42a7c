"""A question on one line: scenario fields as flags, Hugging Face repo ids as model cards."""

from __future__ import annotations

import http.server
import importlib.util
import json
import subprocess
import sys
import textwrap
import threading

import pytest

from capopt.cli import main

needs_hub = pytest.mark.skipif(importlib.util.find_spec("huggingface_hub") is None,
                               reason="huggingface_hub (the hf extra) is not installed")

CARD_JSON = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 2048,
             "tie_word_embeddings": False}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_one_line_plan_equals_its_toml(tmp_path, capsys):
    flags = ["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--count", "8",
             "--per-node", "8", "--seq-len", "4096", "--global-batch", "64",
             "--precision", "bf16-mixed", "--optimizer", "adamw-8bit", "--runtime", "pytorch",
             "--vram-gib", "70", "--lora", "16:4"]
    pins = ["--set", "micro_batch=2", "--set", "zero_stage=1", "--set", "remat=full"]
    code, one_line, err = run(capsys, "plan", *flags, *pins, "--json")
    assert code == 0, err
    f = tmp_path / "same.toml"
    f.write_text(textwrap.dedent("""
        name = "command line"
        [model]
        card = "llama-3-8b"
        [hardware]
        gpu = "h100-sxm-80gb"
        count = 8
        per_node = 8
        [training]
        seq_len = 4096
        global_batch = 64
        precision = "bf16-mixed"
        optimizer = "adamw-8bit"
        runtime = "pytorch"
        lora = { rank = 16, base_bits = 4 }
        [budget]
        vram_gib = 70
    """))
    code, from_file, err = run(capsys, "plan", str(f), *pins, "--json")
    assert code == 0, err
    assert json.loads(one_line) == json.loads(from_file)
    assert json.loads(one_line)["config"]["grad_accum"] == 64 // (2 * 8)


def test_one_line_optimize_equals_its_toml(tmp_path, capsys):
    flags = ["--model", "tiny-llama", "--gpu", "a100-sxm-80gb", "--count", "2",
             "--seq-len", "128", "--global-batch", "16"]
    code, one_line, err = run(capsys, "optimize", *flags, "--top", "3", "--json")
    assert code == 0, err
    f = tmp_path / "same.toml"
    f.write_text('name = "command line"\n[model]\ncard = "tiny-llama"\n[hardware]\n'
                 'gpu = "a100-sxm-80gb"\ncount = 2\n[training]\nseq_len = 128\n'
                 'global_batch = 16\n')
    code, from_file, err = run(capsys, "optimize", str(f), "--top", "3", "--json")
    assert code == 0, err
    a, b = json.loads(one_line), json.loads(from_file)
    for d in (a, b):          # wall-clock fields differ between two runs
        d.pop("search", None)
        d.pop("elapsed_s", None)
    assert [c["config"] for c in a["candidates"]] == [c["config"] for c in b["candidates"]]
    assert a["candidates"] == b["candidates"]


def test_flags_override_a_files_values(capsys):
    pins = ["--set", "micro_batch=1", "--set", "tp=2", "--set", "zero_stage=1",
            "--set", "remat=full", "--json"]
    code, base, _ = run(capsys, "plan", "llama3-8b-8xh100", *pins)
    code2, shorter, _ = run(capsys, "plan", "llama3-8b-8xh100", "--seq-len", "2048",
                            "--count", "4", *pins)
    assert code == code2 == 0
    a, b = json.loads(base), json.loads(shorter)
    assert a["config"]["dp"] == 4 and b["config"]["dp"] == 2           # count 8 -> 4, tp 2
    assert b["memory"]["activations_bytes"] < a["memory"]["activations_bytes"]


@pytest.mark.parametrize("argv, names", [
    (["--model", "llama-3-8b", "--count", "8", "--global-batch", "64"], "--gpu"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--global-batch", "8"], "--seq-len"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "0"], "--seq-len"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "128",
      "--global-batch", "8", "--precision", "bf17"], "--precision"),
    (["--model", "llama-3-8b", "--gpu", "h100-nope", "--seq-len", "128",
      "--global-batch", "8"], "--gpu"),
    (["--model", "no-such-card", "--gpu", "h100-sxm-80gb"], "--model"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "128",
      "--global-batch", "8", "--lora", "16:3"], "--lora"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--lora", "x"], "--lora"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "128",
      "--global-batch", "8", "--lora", "16:4:qv"], "--lora"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--lora", "16:4:q,v:k"], "--lora"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "128",
      "--global-batch", "8", "--runtime", "hf", "--lora", "16:4:q,v:1.5"], "--lora"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--lora", "16:4:q,v:0.1:2"], "--lora"),
    # (GPT-2's MLP has no gate: a target set that wraps nothing, as PEFT refuses it)
    (["--model", "gpt2-124m", "--gpu", "h100-sxm-80gb", "--seq-len", "128",
      "--global-batch", "8", "--lora", "16:16:gate"], "--lora"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--vram-gib", "nan"], "--vram-gib"),
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--vram-gib", "500",
      "--seq-len", "128", "--global-batch", "8"], "--vram-gib"),
    # (XLA compiles every step: the flag has nothing to fuse there)
    (["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "128",
      "--global-batch", "8", "--compile"], "--compile"),
    (["llama3-8b-8xh100", "--set", "seq_len=4"], "--seq-len"),
    (["llama3-8b-8xh100", "--count", "0"], "--count"),
])
def test_bad_flag_exits_2_naming_it(capsys, argv, names):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], err
    assert "Traceback" not in err


def test_set_one_of_the_batch_pair_rederives_the_other(tmp_path, capsys):
    f = tmp_path / "pinned.toml"
    f.write_text('[model]\ncard = "tiny-llama"\n[hardware]\ngpu = "a100-sxm-80gb"\ncount = 2\n'
                 '[training]\nseq_len = 128\nglobal_batch = 32\n'
                 '[config]\nmicro_batch = 4\ngrad_accum = 4\n')
    code, out, err = run(capsys, "plan", str(f), "--set", "micro_batch=2", "--json")
    assert code == 0, err
    cfg = json.loads(out)["config"]
    assert (cfg["micro_batch"], cfg["grad_accum"], cfg["dp"]) == (2, 8, 2)
    assert "grad_accum" in err and "derived" in err and len(err.strip().splitlines()) == 1
    # both on the command line: taken as given (and checked against the batch)
    code, out, err = run(capsys, "plan", str(f), "--set", "micro_batch=2",
                         "--set", "grad_accum=8", "--json")
    assert code == 0 and err == ""
    code, out, err = run(capsys, "plan", str(f), "--set", "micro_batch=2",
                         "--set", "grad_accum=3")
    assert code == 2 and "grad_accum" in err and len(err.strip().splitlines()) == 1


# --- Hugging Face repo ids -------------------------------------------------------------------
def hub_cache(root, repo="acme/Tiny-Llama", commit="0123abcd"):
    """A local Hugging Face cache holding ``repo``'s config.json, as the Hub client lays it
    out (models--owner--name/refs/main and snapshots/COMMIT/)."""
    d = root / f"models--{repo.replace('/', '--')}"
    (d / "snapshots" / commit).mkdir(parents=True)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(commit)
    (d / "snapshots" / commit / "config.json").write_text(json.dumps(CARD_JSON))
    return root


LOAD = "import sys; from capopt._cards import load_card; m = load_card(sys.argv[1]); " \
       "print(m.name, m.num_params(), m.hidden_size, m.kv_heads)"


def _load(card, env):
    return subprocess.run([sys.executable, "-c", LOAD, card], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HUB_CACHE"] = str(hub_cache(tmp_path / "hub"))
    env["HF_HUB_OFFLINE"] = "1"
    return env


@needs_hub
def test_repo_id_reads_the_hub_cache_offline(hub_env, tmp_path):
    done = _load("acme/Tiny-Llama", hub_env)
    assert done.returncode == 0, done.stderr
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text(json.dumps(CARD_JSON))
    local = _load(str(tmp_path / "tiny-llama" / "config.json"), hub_env)
    assert done.stdout.split() == local.stdout.split()       # the same card as the file
    assert done.stdout.split()[0] == "tiny-llama"


@needs_hub
def test_repo_id_in_a_scenario_and_on_the_command_line(hub_env, tmp_path):
    f = tmp_path / "s.toml"
    f.write_text('[model]\ncard = "acme/Tiny-Llama"\n[hardware]\ngpu = "a100-sxm-80gb"\n'
                 '[training]\nseq_len = 256\nglobal_batch = 4\n[config]\nmicro_batch = 4\n')
    for argv in (["plan", str(f), "--json"],
                 ["plan", "--model", "acme/Tiny-Llama", "--gpu", "a100-sxm-80gb",
                  "--seq-len", "256", "--global-batch", "4", "--set", "micro_batch=4",
                  "--json"]):
        done = subprocess.run([sys.executable, "-m", "capopt", *argv], env=hub_env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["config"]["micro_batch"] == 4


@needs_hub
def test_repo_id_not_cached_offline_is_one_line(hub_env):
    done = _load("acme/Other-Model", hub_env)
    assert done.returncode == 1              # (the python -c above raises; the message:)
    last = done.stderr.strip().splitlines()[-1]
    assert "acme/Other-Model" in last and "HF_HUB_OFFLINE" in last and "cache" in last
    done = subprocess.run([sys.executable, "-m", "capopt", "plan", "--model", "acme/Other-Model",
                           "--gpu", "a100-sxm-80gb"], env=hub_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("capopt: error: --model: acme/Other-Model")


class _Hub(http.server.BaseHTTPRequestHandler):
    """A stand-in for the Hub's HTTP answers (its ``X-Error-Code`` header says why)."""

    CODES = {"gated": (401, "GatedRepo"), "missing": (404, "RepoNotFound"),
             "noconfig": (404, "EntryNotFound")}

    def _answer(self):
        for key, (status, code) in self.CODES.items():
            if f"/{key}/" in self.path:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", "refused")
                self.end_headers()
                return
        self.send_response(404)
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args):
        pass


@needs_hub
@pytest.mark.parametrize("repo, says", [
    ("acme/gated", "gated repo"), ("acme/missing", "no such repo"),
    ("acme/noconfig", "no config.json")])
def test_hub_refusals_are_one_line(hub_env, repo, says):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = dict(hub_env, HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}")
        env.pop("HF_HUB_OFFLINE")
        done = subprocess.run([sys.executable, "-m", "capopt", "plan", "--model", repo,
                               "--gpu", "a100-sxm-80gb"], env=env, capture_output=True,
                              text=True, timeout=120)
    finally:
        server.shutdown()
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"capopt: error: --model: {repo}: ") and says in lines[-1]
    assert "Traceback" not in done.stderr
    assert len(lines) <= 2          # the fetch notice, then the error


def test_lora_targets_on_the_command_line(capsys):
    """``--lora RANK:BITS:TARGETS``: QLoRA on q and v of Llama-3-8B trains r (h + q_w) +
    r (h + v_w) weights a block (PEFT prints 6,815,744 for r = 16) and stores the same NF4
    base as adapters on every matrix would."""
    args = ["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "2048",
            "--global-batch", "8", "--set", "micro_batch=1", "--json"]
    code, out, err = run(capsys, "plan", *args, "--lora", "16:4:q,v")
    assert code == 0, err
    qv = json.loads(out)["memory"]
    code, out, err = run(capsys, "plan", *args, "--lora", "16:4")
    assert code == 0, err
    every = json.loads(out)["memory"]
    assert qv["trainable_params"] == 32 * 16 * (4096 + 4096 + 4096 + 1024) == 6_815_744
    adapters = every["trainable_params"] - qv["trainable_params"]
    # (the adapters' weights are float32 under bf16-mixed: 4 bytes each)
    assert every["params_bytes"] - qv["params_bytes"] == pytest.approx(4 * adapters, rel=1e-6)
    code, out, err = run(capsys, "plan", *args[:-1], "--lora", "16:4:q,v")
    assert code == 0 and "llama-3-8b (QLoRA r16 on q+v) on 1x" in out.splitlines()[0]


def test_compile_on_the_command_line(capsys):
    """``--compile`` on a runtime that runs element-wise ops eagerly: the header says so, the
    step is faster and the memory the same (the model prices compile's time only)."""
    args = ["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "2048",
            "--global-batch", "8", "--runtime", "torchtitan", "--set", "micro_batch=1"]
    code, out, err = run(capsys, "plan", *args, "--json")
    assert code == 0, err
    eager = json.loads(out)
    code, out, err = run(capsys, "plan", *args, "--compile", "--json")
    assert code == 0, err
    compiled = json.loads(out)
    assert compiled["memory"] == eager["memory"]
    assert compiled["time"]["step_s"] < eager["time"]["step_s"]
    code, out, err = run(capsys, "plan", *args, "--compile")
    assert code == 0 and "llama-3-8b (torch.compile) on 1x" in out.splitlines()[0]


def test_adapter_dropout_on_the_command_line(capsys):
    """``--lora RANK:BITS:TARGETS:DROPOUT``: PEFT's lora_dropout, shown in the header and
    adding to the activations (a mask and a copy per wrapped input), nothing to the rest."""
    args = ["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--seq-len", "2048",
            "--global-batch", "8", "--runtime", "hf", "--set", "micro_batch=1"]
    code, out, err = run(capsys, "plan", *args, "--lora", "16:4:q,v", "--json")
    assert code == 0, err
    plain = json.loads(out)["memory"]
    code, out, err = run(capsys, "plan", *args, "--lora", "16:4:q,v:0.05", "--json")
    assert code == 0, err
    dropped = json.loads(out)["memory"]
    assert dropped["activations_bytes"] > plain["activations_bytes"]
    assert dropped["params_bytes"] == plain["params_bytes"]
    code, out, err = run(capsys, "plan", *args, "--lora", "16:4:q,v:0.05")
    assert code == 0 and "(QLoRA r16 on q+v, dropout 0.05)" in out.splitlines()[0]
