"""Predictions against published training runs of real frameworks: throughput and memory.

    python benchmarks/published_runs.py [--source NAME] [--out FILE]

Each source is a JSON file in ``benchmarks/published/`` holding the rows of one published table
as the authors wrote them (the repository, commit, file and line of every row, the raw cells
and the setup the document states):

- ``llmfoundry.json``: MosaicML llm-foundry, ``scripts/train/benchmarking/README.md`` (MPT
  125M-70B with FSDP on A100 40/80 GB and H100, bf16 and fp8; tokens/s per GPU, MFU);
- ``torchtitan.json``: PyTorch torchtitan, ``benchmarks/*.md`` (Llama 3 / 3.1 with FSDP2, TP,
  PP on H100 and H200; tokens/s per GPU, memory);
- ``megatron.json``: NVIDIA Megatron-LM, the README's GPT weak-scaling table (H100) and PR
  #482's theoretical against measured memory;
- ``maxtext.json``: MaxText, the A3 table of Llama2-7B (FSDP inside a VM, data parallelism
  across 1-16 VMs of 8 H100s; TFLOP/s per chip by MaxText's own count).

Every row becomes a scenario and a pinned config in capopt's terms (the card rebuilt from the
document's sizes and checked against its parameter count where it gives one; the GPU; the
parallel layout; precision; activation checkpointing) and is predicted with its framework's
runtime profile as it ships (``llm-foundry``, ``torchtitan``, ``megatron``, ``maxtext``). The rows check the model; nothing is fitted to them. A row whose
setup capopt cannot express (HSDP, a framework knob it has no word for) is
listed with the reason instead of a prediction, and a row predicted not to fit its GPU is
counted as such. Prints a table per source and writes ``benchmarks/results/published_runs.json``
and the printed table beside it (``published_runs.txt``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capopt._hardware import get_hardware  # noqa: E402
from capopt._model import ModelSpec  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import Budget, Config, Scenario, Workload  # noqa: E402
from capopt._validity import config_problems  # noqa: E402

DATA = ROOT / "benchmarks" / "published"
RESULTS = ROOT / "benchmarks" / "results" / "published_runs.json"
WITHIN = 0.15           # the bar: a row within 15% counts as close


@dataclass
class Run:
    """One published row in capopt's terms, or why it cannot be put in them."""

    source: str
    framework: str
    label: str
    where: str                            # repo@commit:file:line
    gpu: str = ""
    scenario: Scenario | None = None
    config: Config | None = None
    tokens_per_gpu: float | None = None   # published tokens/s per GPU
    memory_gib: float | None = None       # published memory per GPU
    memory_kind: str = ""
    mfu: float | None = None              # published MFU (the document's FLOP count)
    unexpressed: str = ""                 # why there is no prediction
    notes: list = field(default_factory=list)


# ---- llm-foundry ------------------------------------------------------------------------------
def mpt_card(sizes: dict, seq_len: int) -> ModelSpec:
    """An MPT model as llm-foundry's ``mpt-*.yaml`` builds it with MPTConfig's defaults: GELU
    MLP ``expansion_ratio`` wide, biases everywhere (``no_bias`` false), LayerNorm, learned
    positions as long as the run's sequence, the LM head tied to the embeddings."""
    h = sizes["d_model"]
    return ModelSpec(
        name=f"mpt-{h}x{sizes['n_layers']}", family="decoder", hidden_size=h,
        num_hidden_layers=sizes["n_layers"], num_attention_heads=sizes["n_heads"],
        intermediate_size=sizes["expansion_ratio"] * h, vocab_size=sizes["vocab_size"],
        max_position_embeddings=seq_len, position_embedding="learned", norm_type="layernorm",
        mlp_type="gelu", hidden_act="gelu", tie_word_embeddings=bool(sizes["tied"]),
        attention_bias=not sizes["no_bias"], attention_out_bias=not sizes["no_bias"],
        mlp_bias=not sizes["no_bias"])


# Composer's precision names: amp_* autocasts over float32 parameters (FSDP keeps float32 master
# shards; MP mode DEFAULT/PURE only changes the dtype of the reductions), amp_fp8 runs the
# linear layers through Transformer Engine in fp8; the A100 tables' "bf16" with MP mode PURE is
# the same float32-master setup under its older name.
MPT_PRECISION = {"amp_bf16": "bf16-mixed", "bf16": "bf16-mixed", "amp_fp8": "fp8-mixed"}
MPT_SHARDING = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}


def llmfoundry_runs(doc: dict) -> list[Run]:
    out = []
    for r in doc["rows"]:
        where = f"{doc['repo']}@{doc['commit'][:12]}:{doc['file']}:{r['line']}"
        label = (f"{r['model']} s{r['seq_len']} {r['gpus']}x{r['gpu']} mb{r['micro_batch']} "
                 f"{r['precision']}{' AC' if r['activation_checkpointing'] else ''}")
        run = Run("llm-foundry", "llm-foundry (Composer FSDP)", label, where, r["gpu"],
                  tokens_per_gpu=float(r["tokens_per_s_per_gpu"]),
                  mfu=None if r.get("mfu") is None else r["mfu"] / 100.0)
        out.append(run)
        if r.get("activation_cpu_offload"):
            run.unexpressed = "activation CPU offload"
            continue
        card = mpt_card(doc["models"][r["model"]], r["seq_len"])
        if card.num_params() != r["num_params"]:
            run.unexpressed = (f"rebuilt card counts {card.num_params():,} parameters, the "
                               f"table {r['num_params']:,}")
            continue
        gpus, mb, ga = r["gpus"], r["micro_batch"], r["grad_accum"]
        cfg = Config(micro_batch=mb, grad_accum=ga, dp=gpus,
                     zero_stage=MPT_SHARDING[r["sharding_strategy"]],
                     remat="full" if r["activation_checkpointing"] else "none",
                     flash_attention=True)
        if mb * ga * gpus != r["global_batch"]:
            run.notes.append(f"global batch {r['global_batch']} is not mb x accum x GPUs "
                             f"({mb * ga * gpus}): per-token throughput compared")
        # (MPT's loss_fn default "fused_crossentropy": flash_attn's CrossEntropyLoss on the
        # bf16 logits, llmfoundry/models/mpt/modeling_mpt.py:981 at 5e85bd62d)
        wl = Workload(seq_len=r["seq_len"], global_batch=mb * ga * gpus,
                      precision=MPT_PRECISION[r["precision"]], optimizer="adamw",
                      grad_clip=True, loss="fused")
        run.scenario, run.config = (_scenario(label, card, r["gpu"], gpus, wl,
                                              runtime="llm-foundry"), cfg)
    return out


# ---- torchtitan -------------------------------------------------------------------------------
TITAN_GPUS = {"h100-sxm-96gb-hbm2e": "h100-sxm-96gb", "h100-96gb-hbm2e": "h100-sxm-96gb",
              "h200": "h200-sxm-141gb"}
# torchtitan's FSDP2 mixed precision: float32 sharded parameters and optimizer state, bf16
# compute; "float8" converts nn.Linear to torchao float8 (attention stays bf16)
TITAN_PRECISION = {"bf16": "bf16-mixed", "float8": "fp8-mixed"}
# "selective" with selective_ac_option = "op" is the torchtitan profile's per-op policy
# (selective_saves_ops); a layer frequency of 2 would be half the blocks fully recomputed
TITAN_AC = {"selective": "selective", "selective op": "selective", "selective layer": 0.5,
            "full": "full", "none": "none", None: "none"}


# Whether the torchtitan a file's runs used compiles the loss under ``compile = true``
# (``loss = "fused"``): 9dec370 leaves it commented out (train.py:137-138); from bbb1b616e
# (2025-04-02) torchtitan/components/loss.py:29 compiles it (820504e, e7c0cae)
TITAN_LOSS_COMPILED = {"benchmarks/llama3_h100_202412_torchtitan.md": False,
                       "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md": True,
                       "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md": True}


def torchtitan_runs(doc: dict) -> list[Run]:
    from capopt._cards import load_card
    out = []
    for r in doc["rows"]:
        where = f"{doc['repo']}@{doc['commit'][:12]}:{r['file']}:{r['line']}"
        seq = r.get("seq_len") or r.get("seq_len_inferred")
        tp, pp, cp = r.get("tp") or 1, r.get("pp") or 1, r.get("cp") or 1
        shard, rep = r.get("dp_shard") or 1, r.get("dp_replicate") or 1
        dp = shard * rep
        gpu = TITAN_GPUS.get(r["gpu"], r["gpu"])
        recipe = r.get("float8_recipe") or ""
        recipe = ("" if r["precision"] != "float8" or not recipe or recipe.startswith("tensorwise")
                  else f" {recipe.split()[0]}")
        label = (f"{r['model']} s{seq} {r['gpus']}x{gpu} mb{r['local_batch']} "
                 f"fsdp{shard}{f' hsdp{rep}' if rep > 1 else ''}{f' tp{tp}' if tp > 1 else ''}"
                 f"{f' pp{pp}' if pp > 1 else ''}{f' cp{cp}' if cp > 1 else ''} "
                 f"{r['precision']}{recipe}{' compile' if r.get('compile') else ''}"
                 f"{' asyncTP' if r.get('async_tp') else ''}")
        run = Run("torchtitan", "torchtitan (FSDP2)", label, where, gpu,
                  tokens_per_gpu=r.get("tokens_per_s_per_gpu"), memory_gib=r.get("memory_gib"),
                  memory_kind="reserved" if r.get("memory_gib") else "")
        out.append(run)
        if not r.get("seq_len"):
            run.notes.append(f"sequence length {seq} from the torchtitan config the run used")
        if r.get("compile"):
            run.notes.append("torch.compile (compile = true): element-wise ops fused; "
                             "activation memory as eager")
        if r.get("precision") == "float8" and recipe:
            run.notes.append(f"float8 {recipe.strip()} scaling: priced as tensorwise fp8-mixed")
        if r.get("async_tp"):
            run.notes.append("async TP (training.async_tp)")
        # a pipeline splits the local batch into micro-batches: pipeline_parallel_microbatches,
        # by default as many as pipeline ranks (pipeline_llama.py / pipelining_utils.py at
        # 9dec370); an interleaved schedule runs two stages per rank (generate_split_points)
        micro = pp if pp > 1 else 1
        if r["local_batch"] % micro:
            raise KeyError(f"{r['file']}:{r['line']}: local batch {r['local_batch']} is not a "
                           f"multiple of its {micro} pipeline micro-batches")
        chunks = 2 if pp > 1 and "interleaved" in (r.get("pp_schedule") or "").lower() else 1
        # context parallelism: FSDP2 shards over dp_shard x cp (ParallelDims' fsdp mesh),
        # capopt's dp; the batch is split over the dp_shard replicas
        # hybrid sharding: FSDP2 over dp_shard x cp, replicated dp_replicate times (DDP when
        # the shard group is one rank)
        sharded = shard * cp > 1
        cfg = Config(micro_batch=r["local_batch"] // micro, grad_accum=micro, dp=dp * cp,
                     tp=tp, pp=pp, cp=cp, vpp=chunks, zero_stage=3 if sharded else 0,
                     dp_replicate=rep if sharded else 1,
                     sequence_parallel=tp > 1, remat=TITAN_AC[r.get("activation_checkpoint")],
                     flash_attention=True)
        if cp > 1:
            run.notes.append(f"context parallelism {cp}: FSDP over dp_shard x cp = "
                             f"{shard * cp}")
        if rep > 1 and sharded:
            run.notes.append(f"HSDP: {rep} replicas of the FSDP group (dp_replicate)")
        if pp > 1:
            run.notes.append(f"{micro} pipeline micro-batches of {cfg.micro_batch}, "
                             f"{chunks} stage(s) per rank")
        if r.get("compile") and r["file"] not in TITAN_LOSS_COMPILED:
            raise KeyError(f"{r['file']}: say in TITAN_LOSS_COMPILED whether the torchtitan "
                           "its runs used compiles the loss")
        fused = bool(r.get("compile")) and TITAN_LOSS_COMPILED[r["file"]]
        if fused:
            run.notes.append("compile: the loss compiled (loss = fused)")
        wl = Workload(seq_len=seq, global_batch=r["local_batch"] * dp,
                      precision=TITAN_PRECISION[r["precision"]], optimizer="adamw",
                      grad_clip=True, loss="fused" if fused else "float32",
                      compile=bool(r.get("compile")), async_tp=bool(r.get("async_tp")))
        card = load_card(r["model"])
        run.scenario = _scenario(label, card, gpu, r["gpus"], wl, runtime="torchtitan")
        run.config = cfg
    return out


# ---- Megatron-LM ------------------------------------------------------------------------------
def megatron_gpt(row: dict, vocab: int, seq: int) -> ModelSpec:
    """A GPT as Megatron-LM's ``pretrain_gpt.py`` builds it by default: learned absolute
    positions, LayerNorm, GELU MLP 4h wide, biases on every linear layer, the output layer
    tied to the embeddings."""
    h = row["hidden"]
    return ModelSpec(name=f"megatron-gpt-{row['model_size_b']}b", family="decoder",
                     hidden_size=h, num_hidden_layers=row["layers"],
                     num_attention_heads=row["heads"], intermediate_size=4 * h,
                     vocab_size=vocab, max_position_embeddings=seq,
                     position_embedding="learned", norm_type="layernorm", mlp_type="gelu",
                     hidden_act="gelu", tie_word_embeddings=True, attention_bias=True,
                     attention_out_bias=True, mlp_bias=True)


def model_flops_per_token(m: ModelSpec, seq: int) -> float:
    """Korthikanti et al. 2022 eq. 7 per token (no recomputation): the model FLOPs a GPT step
    does, 72 l h^2 (1 + s / (6 h) + V / (12 l h)) per token, as Megatron-LM counts them."""
    h, l, V = m.hidden_size, m.num_hidden_layers, m.vocab_size
    return 72.0 * l * h * h * (1.0 + seq / (6.0 * h) + V / (12.0 * l * h))


MEGATRON_VOCAB = 131072        # the README's benchmark section: "vocabulary size of 131,072"


def megatron_runs(doc: dict) -> list[Run]:
    out = []
    t = doc["readme_table"]
    for r in t["rows"]:
        where = f"{doc['repo']}@{doc['commit'][:12]}:README.md:{r['line']} (images/model_table.png)"
        seq = r["seq_len"]
        card = megatron_gpt(r, MEGATRON_VOCAB, seq)
        tokens = r["tflops_per_gpu"] * 1e12 / model_flops_per_token(card, seq)
        label = (f"GPT {r['model_size_b']}B {r['gpus']}xh100-sxm-80gb tp{r['tp']} pp{r['pp']} "
                 f"dp{r['dp']}")
        run = Run("megatron", "Megatron-Core r0.8", label, where, "h100-sxm-80gb",
                  tokens_per_gpu=tokens, mfu=r["mfu"])
        run.notes.append(f"published {r['tflops_per_gpu']} model TFLOP/s per GPU, as tokens/s "
                         "by Korthikanti eq. 7")
        run.notes.append("not stated, assumed: bf16, micro-batch 1, no recomputation, the "
                         "distributed optimizer and sequence parallelism (which the README's "
                         "overlap flags require), plain 1F1B")
        out.append(run)
        per_rank = r["global_batch"] // r["dp"]
        cfg = Config(micro_batch=1, grad_accum=per_rank, dp=r["dp"], tp=r["tp"], pp=r["pp"],
                     zero_stage=1, sequence_parallel=r["tp"] > 1, remat="none",
                     flash_attention=True)
        wl = Workload(seq_len=seq, global_batch=r["global_batch"], precision="bf16-mixed",
                      optimizer="adamw", grad_clip=True)
        run.scenario, run.config = (_scenario(label, card, "h100-sxm-80gb", r["gpus"], wl,
                                              runtime="megatron"), cfg)
    for i, r in enumerate(doc["pr482"]["rows"]):
        run = Run("megatron", "Megatron-LM (2023)", f"PR #482 Llama2-7B row {i + 1} "
                  f"tp{r['tp']} pp{r['pp']} dp{r['dp']} mb{r['micro_batch']}",
                  doc["pr482"]["url"], "h800-sxm-80gb", memory_gib=r["measured_gb"],
                  memory_kind="allocated")
        run.unexpressed = ("the sequence length is not stated" + (
            "; the row's cells are inconsistent (a placeholder cell)" if r.get("caveat") else ""))
        out.append(run)
    return out


# ---- MaxText ----------------------------------------------------------------------------------
# GCP's a3-highgpu-8g ("A3 High"): at most 1,000 Gbps of network a VM, GPUDirect-TCPX
# (cloud.google.com/compute/docs/gpus/gpu-network-bandwidth), 1000 / 8 Gb/s a GPU: the scale-out
# bandwidth of the A3 rows (capopt's h100-sxm-80gb assumes a DGX's 400 Gb/s InfiniBand a GPU)
A3_HIGH_INTER_NODE_BW = 1000e9 / 8 / 8          # bytes/s per GPU, one direction


def maxtext_tflops_per_token(doc: dict) -> float:
    """MaxText's FLOPs per token of a training step (calculate_tflops_training_per_device,
    MaxText/maxtext_utils.py:94-108 at efb6d9e4a): 6 x its parameter count (every leaf of the
    parameter tree, embedding and head included) + 12 x heads x layers x head_dim x seq / 2
    (causal attention)."""
    m, seq = doc["model"], doc["setup"]["seq_len"]
    return (6.0 * m["num_model_parameters"]
            + 12.0 * m["heads"] * m["layers"] * m["head_dim"] * seq / 2.0)


def maxtext_runs(doc: dict) -> list[Run]:
    import dataclasses
    from capopt._cards import load_card
    st = doc["setup"]
    card = load_card(doc["model"]["card"])
    per_token = maxtext_tflops_per_token(doc)
    # remat_policy minimal_flash (2024: the dots with no batch dimensions and the attention's
    # output, `context`) is priced as the runtime's selective, "minimal" (the dots): the
    # context's bytes are not counted (the rows publish no memory)
    remat = {"minimal_flash": "selective", "minimal": "selective", "full": "full"}[
        st["remat_policy"]]
    if (st["dtype"], st["weight_dtype"]) != ("bfloat16", "float32"):
        raise KeyError(f"{doc['file']}: dtype {st['dtype']} / weight_dtype "
                       f"{st['weight_dtype']} has no capopt precision here")
    out = []
    for r in doc["rows"]:
        vms, gpus = r["vms"], 8 * r["vms"]
        where = f"{doc['repo']}@{doc['commit'][:12]}:{doc['file']}:{r['line']}"
        label = (f"Llama2-7B s{st['seq_len']} {gpus}xh100-sxm-80gb mb{st['per_device_batch_size']} "
                 f"fsdp{st['ici_fsdp']}{f' data{vms}' if vms > 1 else ''}")
        run = Run("maxtext", "MaxText (JAX, 2024)", label, where, "h100-sxm-80gb",
                  tokens_per_gpu=r["tflops_per_chip"] * 1e12 / per_token)
        run.notes.append(f"published {r['tflops_per_chip']} TFLOP/s per chip, as tokens/s by "
                         f"MaxText's count ({per_token / 1e9:.2f} GFLOP a token)")
        run.notes.append(f"remat_policy {st['remat_policy']} priced as remat {remat}")
        run.notes.append("scan_layers=false: priced with the runtime's scan over the layers "
                         "(its gradient stacks), so the memory is an upper bound here")
        if vms > 1:
            run.notes.append(f"dcn_data_parallelism {vms}: {vms} replicas of the 8-GPU FSDP "
                             "group (dp_replicate); A3 High's network, 15.6 GB/s a GPU")
        out.append(run)
        cfg = Config(micro_batch=st["per_device_batch_size"], grad_accum=1, dp=gpus,
                     zero_stage=3, dp_replicate=vms, remat=remat, flash_attention=True)
        wl = Workload(seq_len=st["seq_len"], global_batch=st["per_device_batch_size"] * gpus,
                      precision="bf16-mixed", optimizer=st["optimizer"],
                      grad_clip=st["gradient_clipping_threshold"] > 0)
        sc = _scenario(label, card, "h100-sxm-80gb", gpus, wl, runtime="maxtext")
        run.scenario = sc.replace(hardware=dataclasses.replace(
            sc.hardware, inter_node_bw=A3_HIGH_INTER_NODE_BW))
        run.config = cfg
    return out


# ---- shared -----------------------------------------------------------------------------------
def _scenario(label: str, card: ModelSpec, gpu: str, count: int, wl: Workload,
              per_node: int = 8, runtime: str = "pytorch") -> Scenario:
    hw = get_hardware(gpu)
    # no headroom: a published run ran, so "fits" asks whether the predicted peak is within
    # the device's memory, not within the margin a planner keeps
    return Scenario(name=label, model=card, hardware=hw, count=count,
                    per_node=min(per_node, count), workload=wl,
                    budget=Budget(vram_bytes=hw.memory_bytes, headroom=0.0),
                    runtime=get_profile(runtime))


TIME_TERMS = ("compute_s", "memory_bound_s", "comm_dp_s", "comm_zero_s", "comm_tp_s",
              "comm_pp_s", "comm_moe_s", "comm_hidden_s", "bubble_s", "optimizer_s")

CONVERTERS = {"llmfoundry": llmfoundry_runs, "torchtitan": torchtitan_runs,
              "megatron": megatron_runs, "maxtext": maxtext_runs}


def predict(run: Run) -> dict:
    """The prediction of one expressible run (or the reason there is none)."""
    from capopt._errors import CapoptError
    from capopt.cost import estimate
    if run.unexpressed:
        return {"status": "unexpressed", "why": run.unexpressed}
    problems = config_problems(run.config, run.scenario)
    if problems:
        return {"status": "refused", "why": "; ".join(f"{f}: {w}" for f, w in problems)}
    try:
        est = estimate(run.config, run.scenario).to_dict()
    except CapoptError as e:              # one row's bad input, not the whole benchmark's
        return {"status": "refused", "why": str(e)}
    mem, thr = est["memory"], est["throughput"]
    out = {"status": "ok", "fits": mem["total_bytes"] <= mem["budget_bytes"],
           "tokens_per_gpu": thr["tokens_per_s_per_device"], "mfu": thr["mfu"],
           "total_gib": mem["total_bytes"] / 2**30,
           "allocated_gib": mem["allocated_bytes"] / 2**30,
           "reserved_gib": mem["reserved_bytes"] / 2**30, "step_s": est["time"]["step_s"],
           # where the step's seconds go (exposed communication by kind, hidden apart)
           "time": {k: est["time"][k] for k in TIME_TERMS}}
    if run.tokens_per_gpu:
        out["throughput_error"] = (out["tokens_per_gpu"] - run.tokens_per_gpu) / run.tokens_per_gpu
    if run.memory_gib:
        key = {"reserved": "reserved_gib", "allocated": "allocated_gib"}.get(run.memory_kind,
                                                                            "total_gib")
        out["memory_error"] = (out[key] - run.memory_gib) / run.memory_gib
    return out


def _summary(errors: list[float]) -> dict:
    if not errors:
        return {"n": 0}
    a = sorted(abs(e) for e in errors)
    worst = max(errors, key=abs)
    return {"n": len(a), "median_abs": statistics.median(a), "worst_signed": worst,
            "within_15": sum(x <= WITHIN for x in a), "mean_signed": statistics.fmean(errors)}


def _fmt(s: dict) -> str:
    if not s.get("n"):
        return "-"
    return (f"n {s['n']:3d}  median {100 * s['median_abs']:5.1f}%  worst "
            f"{100 * s['worst_signed']:+6.1f}%  within 15%: {s['within_15']}/{s['n']}  "
            f"mean {100 * s['mean_signed']:+5.1f}%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", choices=sorted(CONVERTERS),
                    help="only these sources (default: every file in benchmarks/published/)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--quiet", action="store_true", help="summaries only, no row table")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    sources = args.source or [s for s in CONVERTERS if (DATA / f"{s}.json").exists()]
    records, summaries = [], {}
    lines: list[str] = []          # the table as printed, written beside the JSON

    def say(text: str) -> None:
        print(text)
        lines.append(text)

    for src in sources:
        doc = json.loads((DATA / f"{src}.json").read_text())
        runs = CONVERTERS[src](doc)
        rows = []
        for run in runs:
            p = predict(run)
            rows.append({"source": run.source, "framework": run.framework, "row": run.label,
                         "where": run.where, "gpu": run.gpu, "published": {
                             "tokens_per_gpu": run.tokens_per_gpu, "mfu": run.mfu,
                             "memory_gib": run.memory_gib, "memory_kind": run.memory_kind},
                         "config": run.config.to_dict() if run.config else None,
                         "precision": run.scenario.workload.precision if run.scenario else None,
                         "runtime": run.scenario.runtime.name if run.scenario else None,
                         "notes": run.notes, **p})
        records += rows
        if not args.quiet:
            say(f"\n{src}: {len(rows)} rows")
            say(f"{'row':<62} {'published':>9} {'predicted':>9} {'error':>7}  note")
            for r in rows:
                pub = r["published"]["tokens_per_gpu"]
                if r["status"] != "ok":
                    say(f"{r['row']:<62} {pub or 0:>9.0f} {'':>9} {'':>7}  "
                          f"{r['status']}: {r['why']}")
                    continue
                err = r.get("throughput_error")
                kind = {"allocated": "allocated_gib"}.get(r["published"]["memory_kind"],
                                                          "reserved_gib")
                mem = ("" if "memory_error" not in r else
                       f"  memory {r['published']['memory_gib']:.1f} GiB, predicted "
                       f"{r[kind]:.1f} ({100 * r['memory_error']:+.0f}%)")
                say(f"{r['row']:<62} {pub or 0:>9.0f} {r['tokens_per_gpu']:>9.0f} "
                      f"{'' if err is None else f'{100 * err:+6.1f}%':>7}  "
                      f"{'' if r['fits'] else 'predicted not to fit'}{mem}")
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["source"], []).append(r)
    for r in records:
        groups.setdefault(f"gpu {r['gpu']}", []).append(r)
    from capopt._trust import generation     # (the grouping `capopt plan` looks the rows up by)
    for r in records:
        gen = generation(get_hardware(r["gpu"]).compute_capability) or "other"
        groups.setdefault(f"all {gen}", []).append(r)
    groups["all"] = records
    say("\nthroughput (tokens/s per GPU), predicted against published:")
    for name, rows in groups.items():
        ok = [r for r in rows if r["status"] == "ok" and "throughput_error" in r]
        s = _summary([r["throughput_error"] for r in ok])
        s.update(rows=len(rows), unexpressed=sum(r["status"] == "unexpressed" for r in rows),
                 refused=sum(r["status"] == "refused" for r in rows),
                 not_fitting=sum(r["status"] == "ok" and not r["fits"] for r in rows))
        summaries[name] = {"throughput": s}
        say(f"  {name:<28} {_fmt(s)}  (unexpressed {s['unexpressed']}, refused "
              f"{s['refused']}, predicted not to fit {s['not_fitting']})")
        mem = [r for r in rows if r["status"] == "ok" and "memory_error" in r]
        if mem:
            m = _summary([r["memory_error"] for r in mem])
            summaries[name]["memory"] = m
            say(f"  {'':<28} memory: {_fmt(m)}")
    out = {"sources": sources, "within": WITHIN, "summaries": summaries, "rows": records,
           "profiles": {src: sorted({r["runtime"] for r in records
                                     if r["source"] == src and r["runtime"]})
                        for src in dict.fromkeys(r["source"] for r in records)},
           "total_s": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    table = Path(args.out).with_suffix(".txt")
    table.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {args.out} and {table.name} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
