"""PyTorch modules of the decoder family, built from a `ModelSpec` (the torch tier's models).

The same architecture as `capopt.validation.models.DecoderLM`, written the way PyTorch
training code writes it (Hugging Face Llama / GPT-2, torchtitan): ``nn.Linear`` (weight
(out, in)), ``nn.Embedding``, ``nn.LayerNorm`` or an RMSNorm, rotary embeddings applied to
q and k, ``F.scaled_dot_product_attention`` for fused attention (its flash kernel, grouped-query
heads read in place) or the softmax written out when flash attention is off (as Hugging Face's
eager attention: a float32 softmax cast back), GELU or gated SiLU MLPs, dropout where the
card has it, a tied or untied head.

Two ops are pinned to what a GPU runs, where the CPU's would save other tensors: the RMSNorm
is an autograd function that saves its input and float32 rstd, as CUDA's fused
``torch._fused_rms_norm`` does (the CPU's composite saves the normalised tensor too); dropout
is ``torch.native_dropout`` with its bool mask, which ``F.dropout`` calls on CUDA (on the CPU
it keeps a mask in the input's dtype). Parameter shapes follow
`ModelSpec`'s groups one to one, so ``count_params(build_torch_model(spec)) ==
spec.num_params()`` exactly.

Only ``import torch`` at call time: `capopt` and the other tiers never need torch.
"""

from __future__ import annotations

import contextlib
import functools
import math

from .._model import ModelSpec

SUPPORTED_FAMILIES = ("decoder",)


def _unsupported(msg: str):
    from .step import Unsupported
    return Unsupported(msg)


def check_spec(spec: ModelSpec) -> None:
    """Raise `Unsupported` for a card the torch tier does not build."""
    if spec.family not in SUPPORTED_FAMILIES:
        raise _unsupported(f"the torch tier implements the {', '.join(SUPPORTED_FAMILIES)} "
                           f"family, not {spec.family!r}")
    if spec.is_moe:
        raise _unsupported("the torch tier does not implement mixture-of-experts layers")
    if spec.is_mla:
        raise _unsupported("the torch tier does not implement multi-head latent attention")
    if spec.norms_per_layer not in (2, 4):
        raise _unsupported(f"norms_per_layer {spec.norms_per_layer} (2 or 4)")


def build_torch_model(spec: ModelSpec, *, flash: bool = True, checkpoint: tuple = (),
                      param_dtype=None, lora=None, frozen_dtype=None, adapter_dtype=None,
                      peft_cast: bool = False):
    """The ``nn.Module`` for ``spec``; ``checkpoint[i]`` is block i's recomputation ("none",
    "full" or "selective"); create it under a `FakeTensorMode` to allocate nothing.

    With ``lora`` (a `capopt.LoRA`), the matrices of its targets become `lora_linear` modules
    (a frozen base in ``frozen_dtype``, or NF4 for ``base_bits = 4``, and trainable adapters
    in ``param_dtype``, or ``adapter_dtype`` where given), and every other parameter is
    frozen in ``frozen_dtype``: a Hugging Face model loaded in its compute dtype with PEFT
    adapters kept in float32. ``peft_cast``: a 16-bit base's wrapped matrices cast their
    input to the adapters' dtype before them, as PEFT's ``lora.Linear`` does."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    check_spec(spec)
    dtype = param_dtype or torch.float32
    if lora is not None:
        from .._inventory import lora_wrapped
        wrapped = lora_wrapped(lora.targets)
        LoRALinear = lora_linear_module()
        base = frozen_dtype or dtype
        adapters = adapter_dtype or dtype

        def linear(name, i, o, b):
            if name in wrapped:
                return LoRALinear(i, o, b, rank=lora.rank, bits=lora.base_bits,
                                  base_dtype=base, adapter_dtype=adapters,
                                  cast_input=peft_cast, dropout=lora.dropout,
                                  double_quant=lora.double_quant)
            if lora.base_bits < 16:          # quantised at load, not wrapped
                return LoRALinear(i, o, b, rank=0, bits=lora.base_bits, base_dtype=base,
                                  adapter_dtype=adapters, double_quant=lora.double_quant)
            return nn.Linear(i, o, bias=b, dtype=base)
    else:
        def linear(name, i, o, b):
            return nn.Linear(i, o, bias=b, dtype=dtype)
    RMSNorm = _rms_norm_module()
    h, hd = spec.hidden_size, spec.head_size
    heads, kvh = spec.num_attention_heads, spec.kv_heads

    def norm(width: int = h):
        if spec.norm_type == "rmsnorm":
            return RMSNorm(width, dtype)
        return nn.LayerNorm(width, eps=1e-6, dtype=dtype)

    def dropout(x, rate: float, training: bool):
        if rate <= 0.0 or not training:
            return x
        return torch.native_dropout(x, rate, True)[0]

    def act(x):
        name = spec.hidden_act
        if name in ("silu", "swish"):
            return F.silu(x)
        if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_tanh"):
            return F.gelu(x, approximate="tanh")
        if name == "relu":
            return F.relu(x)
        return F.gelu(x)

    def rotary(x, s):
        # (b, heads, s, d), as Hugging Face's apply_rotary_pos_emb on the first 2*(d//2) dims
        d = x.shape[-1]
        half = d // 2
        freq = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float32) / half)
        ang = torch.arange(s, dtype=torch.float32)[:, None] * freq[None, :]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = linear("q", h, heads * hd, spec.attention_bias)
            self.k = linear("k", h, kvh * hd, spec.attention_bias)
            self.v = linear("v", h, kvh * hd, spec.attention_bias)
            self.o = linear("o", heads * hd, h, spec.attention_out_bias)
            self.rate = float(spec.attention_dropout)
            self.rotary = spec.position_embedding == "rotary"
            # a norm over each head's q and k (Qwen3, Gemma 3), before the rotary embedding
            self.q_norm = norm(hd) if spec.qk_norm else None
            self.k_norm = norm(hd) if spec.qk_norm else None
            self.kv_heads_local = kvh

        def forward(self, x):
            b, s, _ = x.shape
            # (heads counted from the projections' widths: under tensor parallelism each
            # rank's share; KV heads kept whole read the ``kv_heads_local`` ones this rank's
            # query heads share, `capopt.validation.torch_tp`)
            kvl = self.kv_heads_local
            q = self.q(x).view(b, s, -1, hd)
            k = self.k(x).view(b, s, -1, hd)[:, :, :kvl]
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = self.v(x).view(b, s, -1, hd)[:, :, :kvl].transpose(1, 2)
            if self.rotary:
                q, k = rotary(q, s), rotary(k, s)
            rate = self.rate if self.training else 0.0
            if flash:
                # the flash kernel called directly: SDPA's dispatcher on the CPU falls back to
                # the math path (scores saved) under dropout, where CUDA's flash kernel runs;
                # it saves what CUDA's does, the output and a float32 log-sum-exp per head
                out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, rate, True)[0]
            else:
                group = q.shape[1] // k.shape[1]
                if group > 1:
                    k = k.repeat_interleave(group, dim=1)
                    v = v.repeat_interleave(group, dim=1)
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
                mask = torch.ones(s, s, dtype=torch.bool).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
                p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
                p = dropout(p, rate, self.training)
                out = p @ v
            return self.o(out.transpose(1, 2).reshape(b, s, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            f, bias = spec.intermediate_size, spec.mlp_bias
            self.gated = spec.mlp_type == "gated"
            self.gate = linear("gate", h, f, bias) if self.gated else None
            self.up = linear("up", h, f, bias)
            self.down = linear("down", f, h, bias)

        def forward(self, x):
            if self.gated:
                return self.down(act(self.gate(x)) * self.up(x))
            return self.down(act(self.up(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn, self.norm2, self.mlp = norm(), Attention(), norm(), MLP()
            four = spec.norms_per_layer == 4
            self.norm3 = norm() if four else None
            self.norm4 = norm() if four else None
            self.rate = float(spec.hidden_dropout)

        def forward(self, x):
            a = self.attn(self.norm1(x))
            if self.norm3 is not None:
                a = self.norm3(a)
            x = x + dropout(a, self.rate, self.training)
            m = self.mlp(self.norm2(x))
            if self.norm4 is not None:
                m = self.norm4(m)
            return x + dropout(m, self.rate, self.training)

    class DecoderLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(spec.vocab_size, h, dtype=dtype)
            self.pos_embed = (nn.Embedding(spec.max_position_embeddings, h, dtype=dtype)
                              if spec.position_embedding == "learned" else None)
            self.rate = float(spec.hidden_dropout)
            self.blocks = nn.ModuleList([Block() for _ in range(spec.num_hidden_layers)])
            self.final_norm = norm()
            self.tied = spec.tie_word_embeddings
            self.lm_head = (None if self.tied else
                            nn.Linear(h, spec.vocab_size, bias=spec.lm_head_bias, dtype=dtype))
            self.lm_head_bias = (nn.Parameter(torch.zeros(spec.vocab_size, dtype=dtype))
                                 if (self.tied and spec.lm_head_bias) else None)
            self.plan = tuple(checkpoint) + ("none",) * spec.num_hidden_layers
            # set by tensor parallelism (`capopt.validation.torch_tp`): how the head's input
            # meets a sharded or replicated embedding, and whether the logits stay sharded
            self.head_input = None
            self.loss_parallel = False
            # set by a fused linear cross-entropy (``loss = "fused-linear"``):
            # ``head_loss(x, weight, bias, labels)`` in place of the logits
            self.head_loss = None
            # set by activation offloading: a context manager the head's matmul runs in
            self.head_context = None

        def forward(self, ids, labels=None):
            x = self.embed(ids)
            if self.pos_embed is not None:
                x = x + self.pos_embed(torch.arange(ids.shape[1]))[None]
            x = dropout(x, self.rate, self.training)
            for i, blk in enumerate(self.blocks):
                x = recompute(blk, x, self.plan[i])
            x = self.final_norm(x)
            if self.head_loss is not None:
                # (a loss fused with the head: the mean over the tokens)
                w, b = ((self.embed.weight, self.lm_head_bias) if self.tied
                        else (self.lm_head.weight, self.lm_head.bias))
                return self.head_loss(x.reshape(-1, x.shape[-1]), w, b, labels.reshape(-1))
            # (activation offloading runs the output head under a no-op context)
            with self.head_context() if self.head_context is not None else \
                    contextlib.nullcontext():
                if self.tied:
                    if self.head_input is not None:
                        x = self.head_input(x)
                    logits = F.linear(x, self.embed.weight, self.lm_head_bias)
                else:
                    logits = self.lm_head(x)
            return logits

    model = DecoderLM()
    if lora is not None:            # everything but the adapters is frozen, in the base dtype
        for name, p in model.named_parameters():
            if not name.endswith(("lora_a", "lora_b")):
                p.requires_grad_(False)
                if p.dtype != base:
                    p.data = p.data.to(base)
    return model


# --------------------------------------------------------------------------------------------
# LoRA and QLoRA
# --------------------------------------------------------------------------------------------
# NF4's 16 code values (Dettmers et al. 2023, bitsandbytes' `get_4bit_type("nf4")`)
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


@functools.cache
def nf4_dequantize_op():
    """``capopt::dequantize_nf4``: a weight stored as QLoRA stores it (two NF4 codes per
    byte; one 8-bit absmax per `NF4_BLOCK` weights, dequantised by one float32 scale per
    `NF4_BLOCK2` absmax codes, or without double quantisation a float32 absmax and no
    scales) back in the compute dtype. An operator of its own, as
    bitsandbytes registers ``dequantize_4bit``: its fake kernel allocates the output only, as
    the one CUDA kernel does (the CPU composite's temporaries are no GPU's)."""
    import torch

    from .._runtime import NF4_BLOCK, NF4_BLOCK2

    # (the schema written out: this module's annotations are strings)
    @torch.library.custom_op("capopt::dequantize_nf4", mutates_args=(), schema=(
        "(Tensor codes, Tensor absmax, Tensor scale2, int rows, int cols, ScalarType dtype)"
        " -> Tensor"))
    def dequantize_nf4(codes, absmax, scale2, rows, cols, dtype):
        code = torch.tensor(NF4_CODE, dtype=torch.float32, device=codes.device)
        idx = torch.stack([codes >> 4, codes & 0xF], dim=-1).reshape(-1).long()
        block_max = absmax.float()
        if absmax.dtype == torch.uint8:          # double quantisation: codes under scales
            block_max = block_max / 255.0 * scale2.repeat_interleave(NF4_BLOCK2)[
                :absmax.numel()]
        w = code[idx].view(-1, NF4_BLOCK) * block_max[:, None]
        return w.reshape(-1)[:rows * cols].view(rows, cols).to(dtype)

    @dequantize_nf4.register_fake
    def _(codes, absmax, scale2, rows, cols, dtype):
        return codes.new_empty((rows, cols), dtype=dtype)

    return dequantize_nf4


def lora_linear_module():
    """``LoRALinear(in, out, bias, rank, bits, base_dtype, adapter_dtype)``: y = x W^T + b +
    (x A^T) B^T with W and b frozen and A (rank x in), B (out x rank) trained, as PEFT's
    ``lora.Linear`` (alpha / rank = 1; ``dropout``: PEFT's lora_dropout on the adapter's
    input). ``bits`` 16: W a frozen parameter
    in ``base_dtype``; 4: W stored in NF4 (`nf4_dequantize_op`) and dequantised to the compute
    dtype at each use, forward and backward (bitsandbytes' ``Linear4bit``: the dequantised
    weight is a temporary; backward dequantises it again for the input's gradient)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from .._runtime import NF4_BLOCK, NF4_BLOCK2

    class _NF4Linear(torch.autograd.Function):
        """x W^T with W dequantised here and again in backward (nothing of W saved)."""

        @staticmethod
        def forward(ctx, x, codes, absmax, scale2, rows, cols):
            ctx.stored = (codes, absmax, scale2, rows, cols)
            w = nf4_dequantize_op()(codes, absmax, scale2, rows, cols, x.dtype)
            return x @ w.t()

        @staticmethod
        def backward(ctx, grad):
            codes, absmax, scale2, rows, cols = ctx.stored
            w = nf4_dequantize_op()(codes, absmax, scale2, rows, cols, grad.dtype)
            return grad @ w, None, None, None, None, None

    class LoRALinear(nn.Module):
        def __init__(self, din, dout, bias, *, rank, bits, base_dtype, adapter_dtype,
                     cast_input=False, dropout=0.0, double_quant=True):
            super().__init__()
            self.dropout = dropout              # PEFT's lora_dropout, on the adapter's input
            # PEFT's lora.Linear (16-bit base) casts x to the adapters' dtype before them
            self.cast_input = cast_input and bits == 16
            if bits not in (4, 16):
                raise _unsupported(f"the torch tier runs LoRA on a 16-bit or NF4 base, not "
                                   f"{bits}-bit")
            self.bits, self.rows, self.cols = bits, dout, din
            if bits == 16:
                self.weight = nn.Parameter(torch.empty(dout, din, dtype=base_dtype),
                                           requires_grad=False)
            else:
                n = dout * din
                blocks = -(-n // NF4_BLOCK)
                self.register_buffer("codes", torch.zeros(blocks * NF4_BLOCK // 2,
                                                          dtype=torch.uint8))
                if double_quant:
                    self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8))
                    self.register_buffer("scale2", torch.ones(-(-blocks // NF4_BLOCK2),
                                                              dtype=torch.float32))
                else:                           # a float32 absmax a block, no scales
                    self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.float32))
                    self.register_buffer("scale2", torch.ones(0, dtype=torch.float32))
            self.bias = (nn.Parameter(torch.zeros(dout, dtype=base_dtype), requires_grad=False)
                         if bias else None)
            # (rank 0: no adapters, a frozen quantised matmul: bitsandbytes' Linear4bit alone)
            self.lora_a = (nn.Parameter(torch.empty(rank, din, dtype=adapter_dtype))
                           if rank else None)
            self.lora_b = (nn.Parameter(torch.zeros(dout, rank, dtype=adapter_dtype))
                           if rank else None)

        def forward(self, x):
            if self.bits == 16:
                y = F.linear(x, self.weight, self.bias)
            else:
                dtype = (torch.get_autocast_dtype(x.device.type)
                         if torch.is_autocast_enabled(x.device.type) else x.dtype)
                with torch.autocast(x.device.type, enabled=False):
                    y = _NF4Linear.apply(x.to(dtype), self.codes, self.absmax, self.scale2,
                                         self.rows, self.cols)
                    if self.bias is not None:
                        y = y + self.bias.to(dtype)
            if self.lora_a is None:
                return y
            if self.cast_input:
                x = x.to(self.lora_a.dtype)
            if self.dropout > 0 and self.training:
                # (native_dropout: CUDA's bool mask, as F.dropout runs there)
                x = torch.native_dropout(x, self.dropout, True)[0]
            return y + F.linear(F.linear(x, self.lora_a), self.lora_b)

    return LoRALinear


RMS_EPS = 1e-6
#: Revisions of the tier's step whose measurements differ from the first's (the benchmarks'
#: measurement keys name it): 2, the RMSNorm backward is one fused op (its outputs only).
TORCH_TIER_REVISION = 2


def _rms_norm_function():
    import torch

    class RMSNormFunction(torch.autograd.Function):
        """y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) in float32; saves x and
        rstd (what CUDA's fused RMSNorm saves). The backward pass is
        ``aten._fused_rms_norm_backward``, the op whose CUDA kernel ``nn.RMSNorm`` runs on
        a GPU (torch 2.13 ships its CUDA dispatch; pytorch#153666): one kernel that allocates
        the input's and the weight's gradients and nothing else. (Written out in eager ops it
        held up to six float32 copies of the input at once, which no GPU run does.)"""

        @staticmethod
        def forward(ctx, x, weight):
            x32 = x.float()
            rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
            ctx.save_for_backward(x, weight, rstd)
            return (x32 * rstd).to(x.dtype) * weight

        @staticmethod
        def backward(ctx, grad):
            x, weight, rstd = ctx.saved_tensors
            try:
                return torch.ops.aten._fused_rms_norm_backward(
                    grad.contiguous(), x, [x.shape[-1]], rstd, weight,
                    [True, bool(ctx.needs_input_grad[1])])
            except NotImplementedError:
                # real CPU tensors (the op has CUDA and meta kernels only): the same
                # gradients in eager ops
                x32, g32 = x.float(), grad.float()
                xhat = x32 * rstd
                gw = (g32 * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
                gx = g32 * weight.float()
                gx = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
                return gx.to(x.dtype), gw

    return RMSNormFunction


def _rms_norm_module():
    import torch
    from torch import nn
    fn = _rms_norm_function()

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, dtype):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

        def forward(self, x):
            return fn.apply(x, self.weight)

    return RMSNorm


def selective_policy():
    """PyTorch's selective activation checkpointing that keeps the projections' outputs and
    recomputes everything else (`torch.utils.checkpoint.create_selective_checkpoint_contexts`
    with a policy on ``mm`` and ``addmm``: the matmuls without batch dimensions, as JAX's
    ``dots_with_no_batch_dims_saveable``; attention's batched matmuls are recomputed)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy
    save = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE)
    return policy


def op_policy_context():
    """torchtitan's per-op selective checkpointing (``selective_ac_option = "op"``,
    ``torchtitan/parallelisms/parallelize_llama.py`` at 9dec370): the outputs of ``aten.mm``,
    the flash / efficient SDPA kernels (here also the CPU flash kernel the tier calls in place
    of CUDA's), ``reduce_scatter_tensor``, ``abs`` and ``max`` are saved, except every second
    ``aten.mm`` of the block, counted separately in the forward pass and the recomputation;
    the rest is recomputed. One counter per checkpointed call, as torchtitan's context_fn."""
    import collections

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    ops = torch.ops.aten
    save = {ops.mm.default, ops._scaled_dot_product_efficient_attention.default,
            ops._scaled_dot_product_flash_attention.default,
            ops._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            ops.abs.default, ops.max.default}
    meta = collections.defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if op == ops.mm.default:
            meta[key] += 1
        keep = op in save and not (op == ops.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def recompute(block, x, mode: str):
    """``block(x)`` under the recomputation ``mode`` (non-reentrant `torch.utils.checkpoint`):
    ``none``, ``full``, ``selective`` (every matmul's output saved) or ``selective-op``
    (torchtitan's per-op policy, `op_policy_context`)."""
    if mode == "none":
        return block(x)
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    if mode == "full":
        return checkpoint(block, x, use_reentrant=False)
    if mode == "selective":
        ctx = functools.partial(create_selective_checkpoint_contexts, selective_policy())
        return checkpoint(block, x, use_reentrant=False, context_fn=ctx)
    if mode == "selective-op":
        return checkpoint(block, x, use_reentrant=False, context_fn=op_policy_context)
    raise ValueError(f"unknown recomputation {mode!r}")


def count_params(module) -> int:
    """Distinct parameters of ``module`` (a tied table counts once)."""
    return sum(p.numel() for p in module.parameters())


__all__ = ["NF4_CODE", "SUPPORTED_FAMILIES", "build_torch_model", "check_spec", "count_params",
           "lora_linear_module", "nf4_dequantize_op", "op_policy_context", "recompute",
           "selective_policy"]
