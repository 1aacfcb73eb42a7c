"""Configs drawn at random, to judge the memory model on cases nobody fitted.

`draw_cases(n, seed)` draws ``n`` (scenario, config) cases from a fixed seed. Each case has a
model *shape* of its own (a card with random sizes in one of nine styles), and every shape
lands in the fitting or the held-out split by a hash of its sizes, so a held-out case never
shares its card with a fitting one. What is drawn:

- styles: GPT-2 (learned positions, LayerNorm, GELU MLP, biases, dropout or not), Llama
  (rotary, RMSNorm, SwiGLU; MHA, GQA or MQA; a head_dim other than hidden / heads), Gemma-2-like
  (four norms per block, tied), a Mixtral-like MoE, BERT (post-norm, token types, pooler, MLM
  head, classifier), ViT, and a plain MLP stack;
- odd vocabularies (primes and near-primes), tied and untied heads;
- every optimizer, with and without clipping; grad_accum 1, 2, 4; micro-batch 1-16;
  sequence length 64-4096 (ViT: its patches);
- every precision; remat none, selective, full or a fraction of the layers; flash on and off;
- 1-8 devices: dp, ZeRO-1/2/3, tp, sequence parallelism, expert parallelism; LoRA and QLoRA
  on some.

Pipeline parallelism and optimizer offload are left out: the validation step does not
implement them (`capopt.validation.step`), so no oracle can judge them.
"""

from __future__ import annotations

import dataclasses

import hashlib
from dataclasses import dataclass, field

import numpy as np

from .._hardware import Hardware
from .._model import ModelSpec
from .._runtime import RuntimeProfile, get_profile
from .._trust import answer_features
from .._specs import OPTIMIZERS, PRECISIONS, Budget, Config, LoRA, Scenario, Workload
from .._validity import config_problems

STYLES = ("gpt", "llama", "gqa-wide-head", "mqa", "gemma", "moe", "bert", "vit", "mlp")
# styles drawn only when asked for (their own draws, so the default draws stay as they were)
EXTRA_STYLES = ("deepseek",)
# odd vocabularies: primes, near-primes, and two real ones (GPT-2's, Llama-2's + 1)
VOCABS = (997, 1999, 3001, 5003, 7919, 8191, 10007, 12289, 16411, 20011, 32001, 50257)


@dataclass(frozen=True)
class Case:
    """One drawn (scenario, config) with the features it exercises."""

    name: str
    shape: str                  # the card's sizes: cases of one shape share a split
    split: str                  # "fit" or "heldout"
    scenario: Scenario
    config: Config
    features: dict = field(default_factory=dict, compare=False)


def shape_split(shape: str, heldout_share: float = 0.5) -> str:
    """The split of a card shape: a hash of its sizes (stable across runs and machines)."""
    h = int(hashlib.sha256(shape.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_share else "fit"


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def draw_model(rng: np.random.Generator, style: str) -> ModelSpec:
    """A card of ``style`` with random sizes (small enough to compile in seconds)."""
    hidden = int(_pick(rng, (128, 192, 256, 320, 384, 448, 512, 640, 768)))
    layers = int(rng.integers(2, 7))
    vocab = int(_pick(rng, VOCABS))
    tied = bool(rng.random() < 0.5)
    if style in ("gpt", "bert", "vit"):
        heads = int(_pick(rng, [a for a in (2, 4, 6, 8, 12) if hidden % a == 0 and
                                32 <= hidden // a <= 128] or [hidden // 64]))
    if style == "gpt":
        drop = 0.1 if rng.random() < 0.5 else 0.0
        return ModelSpec(name="rand-gpt", family="decoder", hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * hidden, vocab_size=vocab,
                         max_position_embeddings=4096, tie_word_embeddings=tied,
                         attention_bias=True, attention_out_bias=True, mlp_bias=True,
                         lm_head_bias=bool(rng.random() < 0.2),
                         hidden_dropout=drop, attention_dropout=drop)
    if style in ("llama", "gqa-wide-head", "mqa", "gemma", "moe"):
        head_dim = int(_pick(rng, (32, 64, 128)))
        heads = max(2, hidden // head_dim)
        if style == "gqa-wide-head":          # head_dim other than hidden / heads
            head_dim = int(_pick(rng, (48, 80, 96, 160)))
            heads = int(_pick(rng, (2, 4, 6, 8)))
        kv = {"mqa": 1}.get(style)
        if kv is None:
            kv = int(_pick(rng, [k for k in (1, 2, 4, heads) if heads % k == 0]))
        ffn = int(_pick(rng, (2, 8 / 3, 3, 3.5)) * hidden) // 16 * 16
        extra = {}
        if style == "moe":
            extra = dict(num_local_experts=int(_pick(rng, (4, 8))), num_experts_per_tok=2)
            ffn = ffn // 2 // 16 * 16
        if style == "gemma":
            extra = dict(norms_per_layer=4, hidden_act="gelu_pytorch_tanh")
            tied = True
        return ModelSpec(name=f"rand-{style}", family="decoder", hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=head_dim, intermediate_size=ffn,
                         vocab_size=vocab, position_embedding="rotary", norm_type="rmsnorm",
                         mlp_type="gated", hidden_act=extra.pop("hidden_act", "silu"),
                         tie_word_embeddings=tied, **extra)
    if style == "deepseek":                   # DeepSeek-V2/V3's block kinds (drawn on request)
        rope = int(_pick(rng, (16, 32)))
        nope = int(_pick(rng, (32, 64, 128)))
        heads = max(2, min(16, hidden // (nope + rope)))
        ffn = int(_pick(rng, (2, 3)) * hidden) // 16 * 16
        expert = max(32, ffn // 4 // 16 * 16)
        dense = 1 if layers > 2 and rng.random() < 0.7 else 0
        return ModelSpec(name="rand-deepseek", family="decoder", hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         head_dim=nope + rope, v_head_dim=int(_pick(rng, (nope, nope + rope))),
                         q_lora_rank=int(_pick(rng, (0, hidden // 2 // 16 * 16))),
                         kv_lora_rank=int(_pick(rng, (64, 128, 256))), qk_rope_head_dim=rope,
                         intermediate_size=expert, num_local_experts=int(_pick(rng, (4, 8))),
                         num_experts_per_tok=2, router_bias=bool(rng.random() < 0.5),
                         first_k_dense_replace=dense, dense_intermediate_size=ffn * dense,
                         shared_expert_intermediate_size=int(_pick(rng, (0, 1, 2))) * expert,
                         vocab_size=vocab, position_embedding="rotary", norm_type="rmsnorm",
                         mlp_type="gated", hidden_act="silu", tie_word_embeddings=tied)
    if style == "bert":
        drop = 0.1 if rng.random() < 0.5 else 0.0
        mlm = bool(rng.random() < 0.7)
        return ModelSpec(name="rand-bert", family="encoder", hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * hidden, vocab_size=vocab,
                         max_position_embeddings=4096, type_vocab_size=2, embedding_norm=True,
                         pooler=bool(rng.random() < 0.7), mlm_head=mlm,
                         num_labels=0 if (mlm and rng.random() < 0.5) else 2,
                         tie_word_embeddings=tied, attention_bias=True,
                         attention_out_bias=True, mlp_bias=True, hidden_dropout=drop,
                         attention_dropout=drop)
    if style == "vit":
        patch = int(_pick(rng, (8, 16)))
        image = patch * int(_pick(rng, (4, 8, 12, 16)))
        return ModelSpec(name="rand-vit", family="vit", hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * hidden, image_size=image, patch_size=patch,
                         num_labels=int(_pick(rng, (10, 100, 1000))),
                         pooler=bool(rng.random() < 0.3), attention_bias=True,
                         attention_out_bias=True, mlp_bias=True)
    if style == "mlp":
        return ModelSpec(name="rand-mlp", family="mlp", hidden_size=hidden * 2,
                         num_hidden_layers=layers + 2, hidden_act="relu")
    raise ValueError(f"unknown style {style!r}")


def model_shape(m: ModelSpec) -> str:
    """The sizes that make a card's shape (its name and provenance left out)."""
    keys = ("family", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "vocab_size", "num_key_value_heads", "head_dim",
            "norms_per_layer", "mlp_type", "tie_word_embeddings", "num_local_experts",
            "image_size", "patch_size", "num_labels", "mlm_head", "pooler")
    # (latent attention and DeepSeek's MoE sizes: only where a card has them, so that the
    # shapes, and the splits, of every other card stay what they were)
    deepseek = ("v_head_dim", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                "first_k_dense_replace", "dense_intermediate_size",
                "shared_expert_intermediate_size")
    keys += tuple(k for k in deepseek if getattr(m, k))
    return "-".join(str(getattr(m, k)) for k in keys)


def _layouts(m: ModelSpec, rng) -> list[dict]:
    out = []
    for dp in (1, 2, 4, 8):
        for tp in (1, 2, 4):
            if dp * tp > 8:
                continue
            if m.family != "mlp" and (m.num_attention_heads % tp or
                                      (m.kv_heads % tp and tp % m.kv_heads)):
                continue
            if m.family == "mlp" and m.hidden_size % tp:
                continue
            out.append({"dp": dp, "tp": tp})
    return out


def draw_config(rng: np.random.Generator, m: ModelSpec, *, single_device_share: float = 0.35
                ) -> tuple[dict, Config]:
    """Workload fields and a config for ``m`` (valid for the validation step)."""
    layouts = _layouts(m, rng)
    if rng.random() < single_device_share:
        lay = {"dp": 1, "tp": 1}
    else:
        lay = _pick(rng, [x for x in layouts if x["dp"] * x["tp"] > 1] or layouts)
    dp, tp = lay["dp"], lay["tp"]
    zero = int(_pick(rng, (0, 1, 2, 3))) if dp > 1 else 0
    sp = bool(tp > 1 and rng.random() < 0.5)
    ep = 1
    if m.is_moe and dp > 1 and rng.random() < 0.5:
        ep = int(_pick(rng, [e for e in (2, 4) if dp % e == 0 and m.num_local_experts % e == 0]
                       or [1]))
    mb = int(_pick(rng, (1, 2, 4, 8, 16)))
    ga = int(_pick(rng, (1, 2, 4)))
    seq = int(_pick(rng, (64, 128, 256, 512, 1024, 2048, 4096)))
    # keep the largest transient (materialised scores of one block) within reason
    heads = m.num_attention_heads if m.family != "mlp" else 1
    while mb > 1 and mb * heads * seq * seq * 4 / tp > 8 * 2 ** 30:
        mb //= 2
    while mb > 1 and mb * seq * max(m.vocab_size, 1) * 4 / tp > 4 * 2 ** 30:
        mb //= 2
    r = rng.random()
    remat: str | float = ("none" if r < 0.3 else "selective" if r < 0.55 else "full"
                          if r < 0.8 else float(_pick(rng, (0.25, 0.5, 0.75))))
    cfg = Config(micro_batch=mb, grad_accum=ga, dp=dp, zero_stage=zero, tp=tp, ep=ep,
                 sequence_parallel=sp, remat=remat, flash_attention=bool(rng.random() < 0.5))
    precision = _pick(rng, PRECISIONS)
    optimizer = _pick(rng, OPTIMIZERS)
    lora = None
    if m.family == "decoder" and not m.is_moe and rng.random() < 0.15:
        bits = int(_pick(rng, (16, 8, 4)))
        lora = LoRA(rank=int(_pick(rng, (4, 8, 16))),
                    targets=_pick(rng, (("attn",), ("attn", "mlp"))), base_bits=bits)
    wl = dict(seq_len=seq, global_batch=mb * ga * dp, precision=precision,
              optimizer=optimizer, grad_clip=bool(rng.random() < 0.5), lora=lora)
    return wl, cfg


# The LoRA target sets the torch tier's LoRA draw takes by default: the two groups
LORA_TARGET_SETS = (("attn",), ("attn", "mlp"))
# ... and the single-matrix sets people use: PEFT's default for Llama-family models (q_proj,
# v_proj), q/k/v without o, the MLP alone, and two mixed sets that leave each kind of kept
# input (the first norm's output, the attention's output, the second norm's output, the
# MLP's activation) without an adapter somewhere
LORA_SINGLE_SETS = (("q", "v"), ("q", "k", "v"), ("mlp",), ("v", "o", "down"), ("q", "v", "up"))


def _lora_ok(m: ModelSpec, lora: LoRA | None) -> bool:
    """QLoRA's packed 4-bit base needs even widths and whole 64-weight blocks, in every
    matrix it stores in NF4 (wrapped or not)."""
    if lora is None or lora.base_bits != 4:
        return True
    from .._inventory import inventory
    return all(t.shape[-1] % 2 == 0 and (t.shape[-2] * t.shape[-1]) % 64 == 0
               for t in inventory(m, lora) if t.lora in ("base", "quant"))


def features(sc: Scenario, cfg: Config, style: str) -> dict:
    """The feature groups a case belongs to (the benchmark's per-feature rows)."""
    w = sc.workload
    layout = ("1 device" if cfg.dp * cfg.tp == 1 else
              "tp" if cfg.dp == 1 else
              f"dp ZeRO-{cfg.zero_stage}" + (" + tp" if cfg.tp > 1 else ""))
    m = sc.model
    attn = ("mlp" if m.family == "mlp" else "MLA" if m.is_mla else
            "MQA" if m.kv_heads == 1 else "GQA" if m.kv_heads < m.num_attention_heads
            else "MHA")
    # (the workload's and config's own labels as `capopt._trust` looks them up for an answer)
    f = answer_features(w, cfg)
    return {
        "style": style, "family": m.family, "optimizer": f["optimizer"],
        "clipping": f["clipping"], "grad_accum": f["grad_accum"], "precision": f["precision"],
        "remat": f["remat"], "flash": f["flash"],
        "layout": layout, "sequence_parallel": "sp" if cfg.sequence_parallel else "no sp",
        "tied": "tied" if m.tie_word_embeddings else "untied", "attention": attn,
        "lora": f["lora"],
    }


def _draw_setup(hardware: Hardware | None, runtime: RuntimeProfile | str, seed: int):
    from .._hardware import get_hardware
    hw = hardware or get_hardware("h100-sxm-80gb")
    rt = get_profile(runtime) if isinstance(runtime, str) else runtime
    return hw, rt, np.random.default_rng(seed)


def _cards(rng: np.random.Generator, styles: tuple[str, ...]):
    """Cards of ``styles`` in turn, each with its shape and split, for as long as asked."""
    i = 0
    while True:
        style = styles[i % len(styles)]
        i += 1
        m = draw_model(rng, style)
        shape = model_shape(m)
        yield style, m, shape, shape_split(shape)


def _case(name: str, style: str, m: ModelSpec, shape: str, split: str, wl: dict,
          cfg: Config, hw: Hardware, rt: RuntimeProfile) -> Case | None:
    """The case of one drawn config, or None where the config is not valid for its card."""
    count = cfg.dp * cfg.tp
    sc = Scenario(name=name, model=m, hardware=hw, count=count, per_node=max(count, 1),
                  workload=Workload(**wl), budget=Budget(vram_bytes=hw.memory_bytes),
                  runtime=rt)
    if config_problems(cfg, sc):
        return None
    return Case(name=sc.name, shape=shape, split=split, scenario=sc, config=cfg,
                features=features(sc, cfg, style))


def draw_cases(n: int = 160, seed: int = 0, *, hardware: Hardware | None = None,
               runtime: RuntimeProfile | str = "xla-gpu", per_shape: int = 2,
               styles: tuple[str, ...] = STYLES) -> list[Case]:
    """``n`` cases from ``seed``: ``per_shape`` configs per card shape, ``styles`` in turn
    (`STYLES` by default; `EXTRA_STYLES` drawn on request)."""
    hw, rt, rng = _draw_setup(hardware, runtime, seed)
    cases: list[Case] = []
    for style, m, shape, split in _cards(rng, styles):
        if len(cases) >= n:
            break
        made = 0
        tries = 0
        while made < per_shape and len(cases) < n and tries < 50:
            tries += 1
            wl, cfg = draw_config(rng, m)
            if not _lora_ok(m, wl["lora"]):
                wl["lora"] = None
            case = _case(f"rand{seed}-{len(cases):03d}-{style}", style, m, shape, split, wl,
                         cfg, hw, rt)
            if case is not None:
                cases.append(case)
                made += 1
    return cases


# The torch tier's share of the draw: decoder styles it builds, the precisions and optimizers it
# runs (`capopt.validation.torch_step`); LoRA in a draw of its own.
TORCH_STYLES = ("gpt", "llama", "gqa-wide-head", "mqa", "gemma")


def draw_torch_cases(n: int = 60, seed: int = 0, *, hardware: Hardware | None = None,
                     runtime: RuntimeProfile | str = "pytorch-eager", per_shape: int = 2,
                     ranks: tuple[int, ...] = (1, 8), lora: bool = False,
                     tp: tuple[int, ...] = (), tp_dp: int = 1,
                     tp_sp: bool = False,
                     lora_targets: tuple[tuple[str, ...], ...] = LORA_TARGET_SETS,
                     lora_dropout: tuple[float, ...] = ()) -> list[Case]:
    """``n`` cases the torch tier runs, drawn as `draw_cases` draws (the same card styles and
    sizes, micro-batches, sequences, accumulation, remat, flash), with the torch tier's
    precisions and optimizers; a card's configs take the data-parallel degrees of ``ranks``
    in turn (more than one: FSDP2 as ZeRO-2 or ZeRO-3, drawn); split by card shape the same
    way. ``lora``: every case fine-tunes with LoRA or QLoRA (rank 4, 8 or 16; attention or
    attention and MLP, or one of ``lora_targets``; a 16-bit or NF4 base; the target set
    must wrap a matrix of the card; with ``lora_dropout``, PEFT's adapter dropout drawn from
    those probabilities), on one device, as the tier runs them. ``tp``:
    every case is tensor-parallel, its degree drawn from ``tp`` among those the card's heads
    and widths allow (a card none allows is skipped), and half the cards have their
    vocabulary padded to a multiple of 128 as Megatron-LM pads it (so that the embedding and
    head are split over the vocabulary; a prime vocabulary keeps them whole); with ``tp_dp``
    > 1 it is FSDP2 over that many data-parallel ranks too (ZeRO-2 or ZeRO-3, drawn); with
    ``tp_sp``, sequence-parallel on every card without learned positions."""
    from .torch_step import OPTIMIZERS as TORCH_OPTIMIZERS
    from .torch_step import PRECISIONS as TORCH_PRECISIONS
    hw, rt, rng = _draw_setup(hardware, runtime, seed)
    cases: list[Case] = []
    for style, m, shape, split in _cards(rng, TORCH_STYLES):
        if len(cases) >= n:
            break
        for j in range(per_shape):
            if len(cases) >= n:
                break
            wl, cfg = draw_config(rng, m, single_device_share=1.0)
            wl.update(precision=_pick(rng, TORCH_PRECISIONS),
                      optimizer=_pick(rng, TORCH_OPTIMIZERS), lora=None)
            dp = tp_dp if tp else 1 if lora else ranks[j % len(ranks)]
            if lora:
                wl["lora"] = LoRA(rank=int(_pick(rng, (4, 8, 16))),
                                  targets=_pick(rng, lora_targets),
                                  base_bits=int(_pick(rng, (16, 4))))
                if not _lora_ok(m, wl["lora"]):         # NF4 needs whole blocks: 16-bit
                    wl["lora"] = dataclasses.replace(wl["lora"], base_bits=16)
                if lora_dropout:                        # (no draw without: seeds unchanged)
                    wl["lora"] = dataclasses.replace(
                        wl["lora"], dropout=float(_pick(rng, lora_dropout)))
            zero = int(_pick(rng, (2, 3))) if dp > 1 else 0
            cfg = cfg.replace(dp=dp, zero_stage=zero, sequence_parallel=False, ep=1)
            if tp:
                if j == 0 and rng.random() < 0.5:      # Megatron's padded vocabulary
                    m = dataclasses.replace(m, vocab_size=-(-m.vocab_size // 128) * 128)
                heads, kv = m.num_attention_heads, m.kv_heads
                fits = [t for t in tp if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
                if not fits:
                    break
                cfg = cfg.replace(tp=_pick(rng, fits), sequence_parallel=bool(
                    tp_sp and m.position_embedding != "learned"))
            wl["global_batch"] = cfg.micro_batch * cfg.grad_accum * dp
            case = _case(f"torch{'lora' if lora else ''}{seed}-{len(cases):03d}-{style}", style,
                         m, shape, split, wl, cfg, hw, rt)
            if case is not None:
                cases.append(case)
    return cases


def draw_deepspeed_cases(n: int = 40, seed: int = 0, *, hardware: Hardware | None = None,
                          runtime: RuntimeProfile | str = "deepspeed",
                          per_shape: int = 2) -> list[Case]:
    """``n`` cases the deepspeed tier runs (real CPU tensors): the torch tier's card styles
    and sizes (materialised attention where a card has attention dropout, which the CPU's
    flash kernel does not run), the tier's precisions and DeepSpeed's Adam, 1, 2 or 4 data-parallel ranks with a ZeRO
    stage drawn (0-3; 0 on one rank), and the step kept small: sequences of 64-512 tokens,
    micro-batches of 1-4. Split by card shape as `draw_cases` splits."""
    from .deepspeed_step import OPTIMIZERS as DS_OPTIMIZERS
    from .deepspeed_step import PRECISIONS as DS_PRECISIONS
    hw, rt, rng = _draw_setup(hardware, runtime, seed)
    cases: list[Case] = []
    for style, m, shape, split in _cards(rng, TORCH_STYLES):
        if len(cases) >= n:
            break
        for _ in range(per_shape):
            if len(cases) >= n:
                break
            wl, cfg = draw_config(rng, m, single_device_share=1.0)
            dp = int(_pick(rng, (1, 2, 4)))
            zero = int(_pick(rng, (0, 1, 2, 3))) if dp > 1 else 0
            wl.update(precision=_pick(rng, DS_PRECISIONS), optimizer=_pick(rng, DS_OPTIMIZERS),
                      lora=None, seq_len=int(_pick(rng, (64, 128, 256, 512))))
            cfg = cfg.replace(dp=dp, zero_stage=zero, sequence_parallel=False, ep=1,
                              micro_batch=int(_pick(rng, (1, 2, 4))))
            if m.attention_dropout > 0:          # the CPU flash kernel runs no dropout
                cfg = cfg.replace(flash_attention=False)
            wl["global_batch"] = cfg.micro_batch * cfg.grad_accum * dp
            case = _case(f"ds{seed}-{len(cases):03d}-{style}", style, m, shape, split, wl,
                         cfg, hw, rt)
            if case is not None:
                cases.append(case)
    return cases


def describe(case: Case) -> str:
    """One line: the card's sizes and the config's knobs."""
    m, w, c = case.scenario.model, case.scenario.workload, case.config
    r = c.remat if isinstance(c.remat, str) else f"{c.remat:g}"
    size = (f"h{m.hidden_size} L{m.num_hidden_layers}" +
            ("" if m.family == "mlp" else f" a{m.num_attention_heads}/{m.kv_heads} "
             f"d{m.head_size} f{m.intermediate_size}") +
            (f" V{m.vocab_size}" if m.vocab_size else "") +
            (f" E{m.num_local_experts}" if m.is_moe else "") +
            (f" mla{m.q_lora_rank}/{m.kv_lora_rank}" if m.is_mla else ""))
    lora = "" if w.lora is None else f" lora{w.lora.rank}/{w.lora.base_bits}b"
    return (f"{case.features['style']:<13} {size:<34} s{case.scenario.seq_len} "
            f"{w.precision} {w.optimizer}{'+clip' if w.grad_clip else ''}{lora} "
            f"mb{c.micro_batch} ga{c.grad_accum} dp{c.dp} z{c.zero_stage} tp{c.tp}"
            f"{' sp' if c.sequence_parallel else ''}{f' ep{c.ep}' if c.ep > 1 else ''} "
            f"remat={r} {'flash' if c.flash_attention else 'mat'}")


__all__ = ["Case", "EXTRA_STYLES", "LORA_SINGLE_SETS", "LORA_TARGET_SETS", "STYLES",
           "TORCH_STYLES", "describe", "draw_cases", "draw_config", "draw_model",
           "draw_torch_cases",
           "features", "model_shape", "shape_split"]
