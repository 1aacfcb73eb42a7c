"""Flax (nnx) implementations of every card family, built from a `ModelSpec`.

One module per family: `DecoderLM` (causal LM: learned or rotary positions, MHA/GQA/MQA, GELU or
gated MLP, LayerNorm or RMSNorm, tied or untied embeddings, optional biases, optional top-k
MoE), `Encoder` (BERT-like, post-norm, optional pooler / MLM head / classifier), `ViT` and
`MLPStack`. Parameter shapes follow `ModelSpec`'s groups one to one, so the parameter count
of `build_model(spec, ...)` equals ``spec.num_params()`` exactly (checked abstractly with
`nnx.eval_shape`; nothing is allocated).

Parameter names carry the tensor-parallel role the sharding rules read (`sharding.py`):
``q k v gate up`` are column-parallel, ``o down`` row-parallel, ``embed``/``lm_head``/
``mlm_decoder`` vocabulary-parallel, everything else replicated.

The precision policy is explicit: parameters are created in ``policy.param_dtype`` and cast
to ``policy.compute_dtype`` where they are used (Flax's ``param_dtype`` vs ``dtype``); norms and
softmaxes run in float32.

LoRA (``policy.lora``): the wrapped matrices (``attn``: q, k, v, o; ``mlp``: gate, up, down,
every expert) get adapters ``lora_a`` (in, r) and ``lora_b`` (r, out) of type `LoRAParam`
(trainable); every other parameter is frozen and stored in ``policy.frozen_dtype``. The
wrapped base matrices are stored per ``lora.base_bits``:

- 16: the frozen dtype;
- 8: int8 codes with one float32 scale per output column (an approximation of bitsandbytes'
  LLM.int8 rows);
- 4: QLoRA as a *documented approximation* of NF4 with double quantisation: two 4-bit codes
  packed per uint8 (out/2 columns), one uint8 absmax code per 64 weights and one float32
  second-level scale per 256 absmax blocks, dequantised through the 16-entry NF4 table.
  Bytes per weight: 1/2 + 1/64 + 4/16384 (`capopt._runtime.NF4_BYTES_PER_WEIGHT`). Without
  double quantisation (``lora.double_quant`` false) one float32 absmax per 64 weights:
  1/2 + 4/64 (`capopt._runtime.NF4_PLAIN_BYTES_PER_WEIGHT`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .._inventory import lora_wrapped
from .._model import ModelSpec
from .._runtime import NF4_BLOCK, NF4_BLOCK2
from .._specs import LoRA

# A list of submodules: `nnx.List` where this flax has it (>= 0.12), a plain list before.
_List = getattr(nnx, "List", list)

INIT_STD = 0.02
# The 16 NF4 levels (Dettmers et al. 2023, appendix E).
NF4_TABLE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230731010437, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)


class LoRAParam(nnx.Param):
    """A trainable low-rank adapter; under LoRA everything else is frozen."""


class QuantCodes(nnx.Param):
    """Integer codes of a quantised frozen base (int8: one weight each; uint8: two 4-bit)."""


class QuantScale(nnx.Param):
    """Scales of a quantised base (they encode no weight of their own)."""


@dataclass(frozen=True)
class Policy:
    """Dtypes and model-level switches for one build.

    param_dtype: trainable parameters (and, without LoRA, every parameter).
    compute_dtype: activations and matmul inputs.
    frozen_dtype: LoRA's frozen parameters (the compute dtype, as the cost model assumes).
    attention: "xla" (materialised scores), "chunked" (blocks of ``attention_chunk`` queries
        under `jax.checkpoint`: no s x s matrix is saved, the stand-in for flash attention
        where no fused kernel exists; a sequence of at most one block is computed whole), or
        "cudnn" (`jax.nn.dot_product_attention`, real GPU only; no attention dropout).
    remat: one entry per block: "none" | "selective" | "full".
    moe_capacity_factor: tokens each expert takes, relative to an even split of top-k.
    moe_groups: token groups routed independently, each with its own expert capacity (GShard,
        Lepikhin et al. 2020, section 3.2: one group per data-parallel shard), so that a
        device dispatches its own tokens and expert parallelism moves them by all-to-all.
    """

    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    frozen_dtype: jnp.dtype = jnp.float32
    lora: LoRA | None = None
    attention: str = "xla"
    attention_chunk: int = 128
    remat: tuple[str, ...] = ()
    moe_capacity_factor: float = 1.25
    moe_groups: int = 1
    # Set by the step: a function constraining the residual stream's sharding (or None), and
    # one constraining the MoE's grouped tensors, ``moe_constrain(x, "groups" | "experts")``:
    # (G, ...) split over the data-parallel group, (E, G, C, h) over the experts.
    constrain: object = None
    moe_constrain: object = None
    # Set by the step under sequence parallelism (or None): ``layout(x, kind)`` constrains a
    # tensor inside a block to Megatron-LM's tensor-parallel layout (Korthikanti et al. 2022,
    # sec. 4.2.2): "whole", a sublayer's normed input, the whole sequence (all-gathered from
    # the stream's slices); "heads", q, k, v and the attention's output (b, s, heads, d),
    # split over heads; "hidden", the MLP's f-wide tensors, split over f. The row-parallel
    # output is reduce-scattered back to the sequence slice by the stream's own constraint.
    # With only the stream constrained, XLA's sharding propagation picks other layouts
    # inside the block (the scores split over the sequence and turned over by all-to-alls,
    # all-reduces of activations over the tensor axis), which are not tensor parallelism.
    layout: object = None


# Bumped whenever what a step under sequence parallelism constrains changes: a stored
# measurement of a config with tp > 1 and sequence parallelism names the revision it was
# compiled with (benchmarks' measurement keys). Revision 1 constrained the stream alone;
# revision 2 lays the block out as Megatron-LM does (`Policy.layout`).
SP_LAYOUT_REVISION = 2


def _act(name: str):
    name = (name or "gelu").lower()
    if name in ("silu", "swish"):
        return jax.nn.silu
    if name in ("relu",):
        return jax.nn.relu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_approx", "quick_gelu"):
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


class KeyGen:
    """Fresh PRNG keys by counter (``nnx.Rngs`` state updates are slow to trace for thousands
    of parameters, and the model keeps no random state: dropout keys are step arguments)."""

    def __init__(self, seed: int = 0, *, shapes_only: bool = False):
        self.key, self.count = jax.random.key(seed), 0
        self.shapes_only = shapes_only     # under eval_shape: skip tracing the random ops

    def __call__(self):
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


def _normal(rngs: KeyGen, shape, dtype, std=INIT_STD):
    if rngs.shapes_only:
        return jnp.zeros(shape, dtype)
    return (std * jax.random.normal(rngs(), shape, jnp.float32)).astype(dtype)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------
def _wraps(policy, name: str) -> bool:
    """Whether LoRA wraps the block matrix ``name`` under ``policy``."""
    return policy.lora is not None and name in lora_wrapped(policy.lora.targets)


class Linear(nnx.Module):
    """``y = x @ kernel + bias`` with kernel (in, out); LoRA adapters and a quantised base.

    ``matrix``: the block matmul it is, as the inventory names it (q, k, ..., down; "" for
    any other): under LoRA it has adapters where the targets wrap it, and an 8- or 4-bit
    base quantises every block matmul, wrapped or not (`capopt._inventory.inventory`)."""

    def __init__(self, din: int, dout: int, *, bias: bool, policy: Policy, rngs: KeyGen,
                 matrix: str = ""):
        self.din, self.dout = din, dout
        self.compute_dtype = policy.compute_dtype
        frozen = policy.lora is not None
        dtype = policy.frozen_dtype if frozen else policy.param_dtype
        lora = bool(matrix) and _wraps(policy, matrix)
        self.bits = policy.lora.base_bits if (frozen and matrix) else 16
        if self.bits == 16:
            self.kernel = nnx.Param(_normal(rngs, (din, dout), dtype))
        elif self.bits == 8:
            self.codes = QuantCodes(jax.random.randint(rngs(), (din, dout), -127, 128,
                                                       jnp.int32).astype(jnp.int8))
            self.scale = QuantScale(jnp.full((dout,), INIT_STD / 127, jnp.float32))
        else:
            n = din * dout
            if dout % 2 or n % NF4_BLOCK:
                raise ValueError(f"4-bit base needs an even width and a multiple of {NF4_BLOCK} "
                                 f"weights, got ({din}, {dout})")
            self.codes = QuantCodes(jax.random.randint(rngs(), (din, dout // 2), 0, 256,
                                                       jnp.int32).astype(jnp.uint8))
            if policy.lora.double_quant:
                self.absmax = QuantScale(jax.random.randint(
                    rngs(), (n // NF4_BLOCK,), 0, 256, jnp.int32).astype(jnp.uint8))
                self.absmax_scale = QuantScale(jnp.full(
                    (math.ceil(n / NF4_BLOCK / NF4_BLOCK2),), INIT_STD / 255, jnp.float32))
            else:
                self.absmax = QuantScale(jnp.full((n // NF4_BLOCK,), INIT_STD, jnp.float32))
                self.absmax_scale = None
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None
        if lora and frozen:
            r = policy.lora.rank
            self.lora_a = LoRAParam(_normal(rngs, (din, r), policy.param_dtype))
            self.lora_b = LoRAParam(jnp.zeros((r, dout), policy.param_dtype))
        else:
            self.lora_a = self.lora_b = None

    def weight(self):
        """The base kernel in the compute dtype (dequantised when stored in 8 or 4 bits)."""
        cd = self.compute_dtype
        if self.bits == 16:
            return self.kernel[...].astype(cd)
        if self.bits == 8:
            return (self.codes[...].astype(jnp.float32) * self.scale[...]).astype(cd)
        packed = self.codes[...]
        lo, hi = packed & 0xF, packed >> 4
        idx = jnp.stack([lo, hi], axis=-1).reshape(self.din, self.dout)
        vals = jnp.asarray(NF4_TABLE)[idx.astype(jnp.int32)]
        absmax = self.absmax[...].astype(jnp.float32)
        if self.absmax_scale is not None:        # double quantisation: 8-bit absmax codes
            absmax = absmax * jnp.repeat(self.absmax_scale[...], NF4_BLOCK2)[: absmax.shape[0]]
        w = vals.reshape(-1, NF4_BLOCK) * absmax[:, None]
        return w.reshape(self.din, self.dout).astype(cd)

    def __call__(self, x):
        cd = self.compute_dtype
        x = x.astype(cd)
        y = x @ self.weight()
        if self.lora_a is not None:
            y = y + (x @ self.lora_a[...].astype(cd)) @ self.lora_b[...].astype(cd)
        if self.bias is not None:
            y = y + self.bias[...].astype(cd)
        return y


class Norm(nnx.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale), computed in float32."""

    def __init__(self, dim: int, kind: str, *, policy: Policy, eps: float = 1e-6):
        dtype = policy.frozen_dtype if policy.lora is not None else policy.param_dtype
        self.kind, self.eps, self.compute_dtype = kind, eps, policy.compute_dtype
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype)) if kind == "layernorm" else None

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        if self.kind == "layernorm":
            x32 = x32 - x32.mean(-1, keepdims=True)
        y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + self.eps)
        y = y * self.scale[...].astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(self.compute_dtype)


class Embed(nnx.Module):
    def __init__(self, num: int, dim: int, *, policy: Policy, rngs: KeyGen):
        dtype = policy.frozen_dtype if policy.lora is not None else policy.param_dtype
        self.compute_dtype = policy.compute_dtype
        self.embedding = nnx.Param(_normal(rngs, (num, dim), dtype))

    def __call__(self, ids):
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.compute_dtype)

    def attend(self, x):
        """Logits against the (tied) table: x @ embedding.T."""
        return x.astype(self.compute_dtype) @ self.embedding[...].astype(self.compute_dtype).T


def _laid(layout, kind: str, x):
    """``x`` constrained by the policy's tensor-parallel ``layout`` (`Policy`), or as it is."""
    return x if layout is None else layout(x, kind)


def dropout(x, rate: float, key):
    if rate <= 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def rotary(x, positions, theta: float = 10000.0):
    """Rotary position embedding (Su et al. 2021) on (b, s, heads, d), in float32."""
    d = x.shape[-1]
    half = d // 2
    freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions[:, None].astype(jnp.float32) * freq[None, :]          # (s, half)
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half: 2 * half]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., 2 * half:]], -1)
    return out.astype(x.dtype)


def _scores_attention(q, k, v, *, causal, q_offset, rate, key):
    """Softmax attention with the score matrix materialised; q (b, sq, kv, g, d)."""
    d = q.shape[-1]
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(d)
    s = s.astype(jnp.float32)
    if causal:
        qi = jnp.arange(q.shape[1])[:, None] + q_offset
        ki = jnp.arange(k.shape[1])[None, :]
        s = jnp.where(qi >= ki, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    p = dropout(p, rate, key)
    return jnp.einsum("bkgqs,bskd->bqkgd", p, v)


def attention(q, k, v, *, causal: bool, impl: str, chunk: int, rate: float, key):
    """q and k (b, s, a | kv, d), v (b, s, kv, dv) -> (b, s, a, dv); grouped queries share kv
    heads (latent attention: dv may differ from d)."""
    b, s, a, d = q.shape
    kvh, dv = k.shape[2], v.shape[-1]
    if impl == "cudnn":
        # cuDNN's kernel takes v as wide as k: a narrower v (latent attention) is zero-padded
        # and the padded columns of the output dropped
        if dv > d:
            raise ValueError(f"the cudnn attention path needs v heads ({dv}) no wider than "
                             f"q/k heads ({d})")
        out = jax.nn.dot_product_attention(q, k, _fit(v, k.shape[-1]), is_causal=causal,
                                           implementation="cudnn")
        return out[..., :dv]
    qg = q.reshape(b, s, kvh, a // kvh, d)
    if impl == "xla" or s <= chunk or s % chunk:
        out = _scores_attention(qg, k, v, causal=causal, q_offset=0, rate=rate, key=key)
        return out.reshape(b, s, a, dv)
    # "chunked": query blocks, each recomputed in the backward pass (nothing s x s is saved).
    keys = jax.random.split(key, s // chunk) if (key is not None and rate > 0) else None
    out = _chunked_attention(qg, k, v, keys, causal, chunk, rate)
    return out.reshape(b, s, a, dv)


# Bumped whenever the stand-in's memory behaviour changes: a stored measurement of a config
# with flash attention names the revision it was compiled with (benchmarks' measurement keys).
CHUNKED_REVISION = 2

# The stand-in for a fused attention kernel. Written with `jax.lax.map` (a scan), its forward
# output and its backward's dq/dk/dv accumulators start as zero broadcasts with no operands;
# XLA fuses the broadcasts of every block into one multi-output fusion scheduled before the
# first block, so every block's buffers would be allocated from the step's start (seen in the
# buffer assignment of a 32-block full-recompute step: 7 GB of them live at its peak), which
# no kernel does. Here each buffer starts from a value of its own block -- the forward writes
# over its own copy of q, the backward over the cotangent's, dk/dv from k and v once the
# cotangent exists -- so it is allocated where the kernel would allocate its output.
def _chunk(x, i, chunk):
    return jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)


def _fit(x, width):
    """``x`` cut or zero-padded to ``width`` in its last dimension (itself when it is that
    wide): a buffer of the output's shape computed from ``x``, allocated where ``x`` is."""
    d = x.shape[-1]
    if d >= width:
        return x[..., :width] if d > width else x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - d)])


def _chunk_fn(i, keys, causal, chunk, rate):
    ki = None if keys is None else keys[i]
    return lambda qi, kk, vv: _scores_attention(qi, kk, vv, causal=causal, q_offset=i * chunk,
                                                rate=rate, key=ki)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked_attention(qg, k, v, keys, causal, chunk, rate):
    def body(i, buf):
        # block i of buf is still q (blocks are written in turn), unless v's width differs
        qi = _chunk(buf if same else qg, i, chunk)
        out = _chunk_fn(i, keys, causal, chunk, rate)(qi, k, v)
        return jax.lax.dynamic_update_slice_in_dim(buf, out.astype(buf.dtype), i * chunk, 1)
    # the output starts as q's own copy (v's width: q cut or padded), written block by block
    same = v.shape[-1] == qg.shape[-1]
    return jax.lax.fori_loop(0, qg.shape[1] // chunk, body, _fit(qg, v.shape[-1]))


def _chunked_fwd(qg, k, v, keys, causal, chunk, rate):
    return _chunked_attention(qg, k, v, keys, causal, chunk, rate), (qg, k, v, keys)


def _chunked_bwd(causal, chunk, rate, res, ct):
    qg, k, v, keys = res
    qg, k, v, ct = jax.lax.optimization_barrier((qg, k, v, ct))   # nothing before the cotangent

    def body(i, carry):
        dq, dk, dv = carry
        f = _chunk_fn(i, keys, causal, chunk, rate)
        _, vjp = jax.vjp(f, _chunk(qg, i, chunk), k, v)
        dqi, dki, dvi = vjp(_chunk(ct, i, chunk))
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dqi.astype(dq.dtype), i * chunk, 1)
        return dq, dk + dki.astype(dk.dtype), dv + dvi.astype(dv.dtype)

    dq, dk, dv = jax.lax.fori_loop(0, qg.shape[1] // chunk, body,
                                   (_fit(ct.astype(qg.dtype), qg.shape[-1]), k * 0, v * 0))
    return dq, dk, dv, None


_chunked_attention.defvjp(_chunked_fwd, _chunked_bwd)


class Attention(nnx.Module):
    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen, causal: bool):
        h, hd = spec.hidden_size, spec.head_size
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.kv_heads, hd
        self.causal, self.rotary = causal, spec.position_embedding == "rotary"
        self.rate = float(spec.attention_dropout)
        self.impl, self.chunk = policy.attention, policy.attention_chunk
        kw = dict(policy=policy, rngs=rngs)
        self.q = Linear(h, self.heads * hd, bias=spec.attention_bias, matrix="q", **kw)
        self.k = Linear(h, self.kv_heads * hd, bias=spec.attention_bias, matrix="k", **kw)
        self.v = Linear(h, self.kv_heads * hd, bias=spec.attention_bias, matrix="v", **kw)
        self.o = Linear(self.heads * hd, h, bias=spec.attention_out_bias, matrix="o", **kw)
        # a norm over each head's q and k (Qwen3, Gemma 3), before the rotary embedding
        self.q_norm = Norm(hd, spec.norm_type, policy=policy) if spec.qk_norm else None
        self.k_norm = Norm(hd, spec.norm_type, policy=policy) if spec.qk_norm else None
        self.layout = policy.layout

    def __call__(self, x, key):
        b, s, _ = x.shape
        heads = partial(_laid, self.layout, "heads")
        q = heads(self.q(x).reshape(b, s, self.heads, self.head_dim))
        k = heads(self.k(x).reshape(b, s, self.kv_heads, self.head_dim))
        v = heads(self.v(x).reshape(b, s, self.kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            pos = jnp.arange(s)
            q, k = rotary(q, pos), rotary(k, pos)
        out = heads(attention(q, k, v, causal=self.causal, impl=self.impl, chunk=self.chunk,
                              rate=self.rate, key=key))
        return self.o(out.reshape(b, s, self.heads * self.head_dim))


class LatentAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, as Hugging Face's
    ``DeepseekV2Attention`` computes it for training): q from a normalised q_a latent (or the
    hidden state), k and v from one normalised kv latent expanded per head by kv_b, each head's
    k completed by one rotary key shared by the heads."""

    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen, causal: bool):
        h, a, hd = spec.hidden_size, spec.num_attention_heads, spec.head_size
        qr, kvr, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
        self.heads, self.head_dim, self.v_dim, self.rope = a, hd, spec.v_head_size, rope
        self.kv_rank, self.causal = kvr, causal
        self.rate = float(spec.attention_dropout)
        self.impl, self.chunk = policy.attention, policy.attention_chunk
        kw = dict(policy=policy, rngs=rngs)
        self.q_a = Linear(h, qr, bias=False, matrix="q_a", **kw) if qr else None
        self.q_a_norm = Norm(qr, spec.norm_type, policy=policy) if qr else None
        self.q = Linear(qr or h, a * hd, bias=False, matrix="q", **kw)
        self.kv_a = Linear(h, kvr + rope, bias=False, matrix="kv_a", **kw)
        self.kv_a_norm = Norm(kvr, spec.norm_type, policy=policy)
        self.kv_b = Linear(kvr, a * (hd - rope + self.v_dim), bias=False, matrix="kv_b", **kw)
        self.o = Linear(a * self.v_dim, h, bias=spec.attention_out_bias, matrix="o", **kw)
        self.layout = policy.layout

    def __call__(self, x, key):
        b, s, _ = x.shape
        a, hd, dv, rope = self.heads, self.head_dim, self.v_dim, self.rope
        heads = partial(_laid, self.layout, "heads")
        nope = hd - rope
        pos = jnp.arange(s)
        q = self.q(self.q_a_norm(self.q_a(x)) if self.q_a is not None else x)
        q = heads(q.reshape(b, s, a, hd))
        ckv = self.kv_a(x)
        kv = heads(self.kv_b(self.kv_a_norm(ckv[..., :self.kv_rank])).reshape(b, s, a,
                                                                             nope + dv))
        k_pe = rotary(ckv[..., None, self.kv_rank:], pos)                 # (b, s, 1, rope)
        q = jnp.concatenate([q[..., :nope], rotary(q[..., nope:], pos)], -1)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_pe, (b, s, a, rope))], -1)
        out = heads(attention(q, k, kv[..., nope:], causal=self.causal, impl=self.impl,
                              chunk=self.chunk, rate=self.rate, key=key))
        return self.o(out.reshape(b, s, a * dv))


class MLP(nnx.Module):
    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen, width: int = 0):
        h, f = spec.hidden_size, width or spec.intermediate_size
        kw = dict(policy=policy, rngs=rngs)
        self.gated = spec.mlp_type == "gated"
        self.act = _act(spec.hidden_act)
        self.gate = Linear(h, f, bias=spec.mlp_bias, matrix="gate", **kw) if self.gated else None
        self.up = Linear(h, f, bias=spec.mlp_bias, matrix="up", **kw)
        self.down = Linear(f, h, bias=spec.mlp_bias, matrix="down", **kw)
        self.layout = policy.layout

    def __call__(self, x):
        hidden = partial(_laid, self.layout, "hidden")
        u = hidden(self.up(x))
        u = hidden(self.act(hidden(self.gate(x))) * u) if self.gated else self.act(u)
        return self.down(u)


class Experts(nnx.Module):
    """``E`` MLPs stacked on a leading axis: gate/up (E, h, f), down (E, f, h), biases."""

    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen):
        E, h, f = spec.num_local_experts, spec.hidden_size, spec.intermediate_size
        lora = any(_wraps(policy, name) for name in ("gate", "up", "down"))
        if lora and policy.lora.base_bits != 16:
            raise ValueError("quantised (8/4-bit) LoRA bases on MoE experts are not implemented")
        dtype = policy.frozen_dtype if policy.lora is not None else policy.param_dtype
        self.gated, self.act, self.cd = spec.mlp_type == "gated", _act(spec.hidden_act), \
            policy.compute_dtype
        self.gate = nnx.Param(_normal(rngs, (E, h, f), dtype)) if self.gated else None
        self.up = nnx.Param(_normal(rngs, (E, h, f), dtype))
        self.down = nnx.Param(_normal(rngs, (E, f, h), dtype))
        bias = spec.mlp_bias
        self.gate_bias = nnx.Param(jnp.zeros((E, f), dtype)) if bias and self.gated else None
        self.up_bias = nnx.Param(jnp.zeros((E, f), dtype)) if bias else None
        self.down_bias = nnx.Param(jnp.zeros((E, h), dtype)) if bias else None
        r = policy.lora.rank if lora else 0
        pd = policy.param_dtype
        mk = lambda shape: LoRAParam(_normal(rngs, shape, pd))  # noqa: E731
        zero = lambda shape: LoRAParam(jnp.zeros(shape, pd))     # noqa: E731
        gate = self.gated and _wraps(policy, "gate")
        up, down = _wraps(policy, "up"), _wraps(policy, "down")
        self.gate_lora_a = mk((E, h, r)) if gate else None
        self.gate_lora_b = zero((E, r, f)) if gate else None
        self.up_lora_a = mk((E, h, r)) if up else None
        self.up_lora_b = zero((E, r, f)) if up else None
        self.down_lora_a = mk((E, f, r)) if down else None
        self.down_lora_b = zero((E, r, h)) if down else None

    def _mm(self, x, w, b, la, lb):
        cd = self.cd
        y = jnp.einsum("ech,ehf->ecf", x, w[...].astype(cd))
        if la is not None:
            y = y + jnp.einsum("ecr,erf->ecf", jnp.einsum("ech,ehr->ecr", x, la[...].astype(cd)),
                               lb[...].astype(cd))
        if b is not None:
            y = y + b[...].astype(cd)[:, None, :]
        return y

    def __call__(self, x):                                  # x (E, C, h)
        x = x.astype(self.cd)
        u = self._mm(x, self.up, self.up_bias, self.up_lora_a, self.up_lora_b)
        if self.gated:
            g = self._mm(x, self.gate, self.gate_bias, self.gate_lora_a, self.gate_lora_b)
            u = self.act(g) * u
        else:
            u = self.act(u)
        return self._mm(u, self.down, self.down_bias, self.down_lora_a, self.down_lora_b)


class MoE(nnx.Module):
    """Top-k routing with a static per-expert capacity (tokens over capacity are dropped),
    within each of ``policy.moe_groups`` token groups (GShard's grouped dispatch)."""

    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen):
        E, h = spec.num_local_experts, spec.hidden_size
        dtype = policy.frozen_dtype if policy.lora is not None else policy.param_dtype
        self.E, self.k, self.cf = E, spec.num_experts_per_tok, policy.moe_capacity_factor
        self.groups, self.constrain = policy.moe_groups, policy.moe_constrain
        self.router = nnx.Param(_normal(rngs, (h, E), dtype))
        self.router_bias = nnx.Param(jnp.zeros((E,), dtype)) if spec.router_bias else None
        self.experts = Experts(spec, policy=policy, rngs=rngs)
        # shared experts (DeepSeek): one always-active MLP beside the routed ones
        shared = spec.shared_expert_intermediate_size
        self.shared = MLP(spec, policy=policy, rngs=rngs, width=shared) if shared else None

    def __call__(self, x):
        b, s, h = x.shape
        E, k = self.E, self.k
        G = self.groups if self.groups > 1 and b % self.groups == 0 else 1
        T = b * s // G                                                       # tokens per group
        C = max(1, math.ceil(self.cf * T * k / E))                           # per group
        con = self.constrain or (lambda y, kind: y)
        xg = con(x.reshape(G, T, h), "groups")
        logits = jnp.einsum("gth,he->gte", xg.astype(jnp.float32),
                            self.router[...].astype(jnp.float32))
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        gates, idx = jax.lax.top_k(probs, k)                                 # (G, T, k)
        gates = gates / gates.sum(-1, keepdims=True)

        def dispatch(xf, idx):                                               # one group
            flat_e = idx.reshape(T * k)
            onehot = jax.nn.one_hot(flat_e, E, dtype=jnp.int32)              # (T k, E)
            pos = ((jnp.cumsum(onehot, axis=0) - 1) * onehot).sum(-1)       # queue position
            keep = pos < C
            slot = jnp.where(keep, flat_e * C + pos, E * C)                  # E*C: dropped
            token = jnp.repeat(jnp.arange(T), k)
            table = jnp.full((E * C + 1,), T, jnp.int32).at[slot].set(token)[: E * C]
            xpad = jnp.concatenate([xf, jnp.zeros((1, h), xf.dtype)], axis=0)
            return xpad[table].reshape(E, C, h), slot, keep

        def combine(ye, slot, keep, gates):                                  # one group
            ye = jnp.concatenate([ye.reshape(E * C, h), jnp.zeros((1, h), ye.dtype)], axis=0)
            w = (gates.reshape(T * k) * keep).astype(ye.dtype)
            return (ye[slot] * w[:, None]).reshape(T, k, h).sum(1)

        xe, slot, keep = jax.vmap(dispatch)(xg, idx)                         # (G, E, C, h)
        # to the experts' layout (expert parallelism: an all-to-all), through them, and back
        xe = con(xe.transpose(1, 0, 2, 3), "experts")                        # (E, G, C, h)
        ye = self.experts(xe.reshape(E, G * C, h)).reshape(E, G, C, h)
        ye = con(con(ye, "experts").transpose(1, 0, 2, 3), "groups")        # (G, E, C, h)
        out = jax.vmap(combine)(ye, slot, keep, gates).reshape(b, s, h)
        return out if self.shared is None else out + self.shared(x)


# Bumped whenever the MoE's memory behaviour changes: a stored measurement of an MoE config
# names the revision it was compiled with (benchmarks' measurement keys). 2: grouped dispatch
# (revision 1 routed the whole global batch on every device).
MOE_REVISION = 2


class Block(nnx.Module):
    """Pre-norm (decoder, ViT) or post-norm (BERT) transformer block."""

    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen, causal: bool,
                 post_norm: bool, index: int = 0):
        h = spec.hidden_size
        self.post_norm = post_norm
        self.layout = policy.layout
        self.rate = float(spec.hidden_dropout)
        self.norm1 = Norm(h, spec.norm_type, policy=policy)
        attn = LatentAttention if spec.is_mla else Attention
        self.attn = attn(spec, policy=policy, rngs=rngs, causal=causal)
        self.norm2 = Norm(h, spec.norm_type, policy=policy)
        dense = index < spec.first_k_dense_replace       # an MoE's dense first blocks
        self.mlp = (MoE(spec, policy=policy, rngs=rngs) if spec.is_moe and not dense
                    else MLP(spec, policy=policy, rngs=rngs,
                             width=spec.dense_intermediate_size if dense else 0))
        four = spec.norms_per_layer == 4
        self.norm3 = Norm(h, spec.norm_type, policy=policy) if four else None
        self.norm4 = Norm(h, spec.norm_type, policy=policy) if four else None
        if spec.norms_per_layer not in (2, 4):
            raise ValueError(f"norms_per_layer {spec.norms_per_layer} is not implemented "
                             "(2 or 4)")

    def __call__(self, x, key):
        k1 = k2 = k3 = None
        if key is not None:
            k1, k2, k3 = jax.random.split(key, 3)
        scope = jax.named_scope
        whole = partial(_laid, self.layout, "whole")
        if self.post_norm:
            with scope("attn"):
                a = self.attn(whole(x), k1)
            with scope("norm1"):
                x = self.norm1(x + dropout(a, self.rate, k2))
            with scope("mlp"):
                m = self.mlp(whole(x))
            with scope("norm2"):
                return self.norm2(x + dropout(m, self.rate, k3))
        with scope("norm1"):
            y = whole(self.norm1(x))
        with scope("attn"):
            a = self.attn(y, k1)
        if self.norm3 is not None:
            with scope("norm3"):
                a = self.norm3(a)
        x = x + dropout(a, self.rate, k2)
        with scope("norm2"):
            y = whole(self.norm2(x))
        with scope("mlp"):
            m = self.mlp(y)
        if self.norm4 is not None:
            with scope("norm4"):
                m = self.norm4(m)
        return x + dropout(m, self.rate, k3)


REMAT_POLICIES = {
    # Korthikanti et al. 2022's selective recomputation: keep the projections' outputs (matmuls
    # without batch dimensions), recompute the attention core (QK^T, softmax, dropout, AV).
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Full recomputation: keep only the block's input.
    "full": jax.checkpoint_policies.nothing_saveable,
}


def remat_at_backward(fn, policy):
    """``jax.checkpoint(fn, policy=policy)`` whose recomputation waits for its cotangent.

    A plain `jax.checkpoint` in an unrolled loop of blocks leaves XLA's scheduler free to run
    every block's recomputation as soon as its saved input exists, and it does: compiled for
    a GPU, the recomputed blocks are rebuilt together before the loss's backward pass (seen in
    XLA's buffer assignment of full-recompute steps: every block's rebuilt MLP live at the
    loss), which keeps more than no recomputation saves. Here the saved residuals pass one
    optimization barrier with the incoming cotangent, so a block is rebuilt when its backward
    pass begins, as a scan over layers (MaxText) or PyTorch's checkpoint does.
    """
    ck = jax.checkpoint(fn, policy=policy)

    @jax.custom_vjp
    def run(*args):
        return ck(*args)

    def fwd(*args):
        return jax.vjp(ck, *args)

    def bwd(vjp, ct):
        leaves, treedef = jax.tree.flatten(vjp)
        tied = [i for i, v in enumerate(leaves) if jnp.issubdtype(v.dtype, jnp.inexact)]
        held, ct = jax.lax.optimization_barrier(([leaves[i] for i in tied], ct))
        for i, v in zip(tied, held):
            leaves[i] = v
        return jax.tree.unflatten(treedef, leaves)(ct)

    run.defvjp(fwd, bwd)
    return run


def run_blocks(blocks, x, key, policy: Policy):
    """Apply the blocks in order, each under its remat policy; constrain the residual stream."""
    constrain = policy.constrain or (lambda y: y)
    x = constrain(x)
    for i, blk in enumerate(blocks):
        bkey = jax.random.fold_in(key, i) if key is not None else None
        mode = policy.remat[i] if i < len(policy.remat) else "none"
        # a named scope per block: XLA's buffers carry it in their metadata, so a peak's
        # live set can be read block by block (`capopt.validation.liveset`)
        with jax.named_scope(f"block{i}"):
            if mode == "none":
                x = blk(x, bkey)
            else:
                gd, st = nnx.split(blk)

                def f(st, x, k, gd=gd):
                    return nnx.merge(gd, st)(x, k)

                x = remat_at_backward(f, REMAT_POLICIES[mode])(st, x, bkey)
            x = constrain(x)
    return x


# --------------------------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------------------------
class DecoderLM(nnx.Module):
    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen):
        h = spec.hidden_size
        self.policy, self.rate = policy, float(spec.hidden_dropout)
        self.embed = Embed(spec.vocab_size, h, policy=policy, rngs=rngs)
        self.pos_embed = (Embed(spec.max_position_embeddings, h, policy=policy, rngs=rngs)
                          if spec.position_embedding == "learned" else None)
        self.blocks = _List([Block(spec, policy=policy, rngs=rngs, causal=True,
                                   post_norm=False, index=i)
                             for i in range(spec.num_hidden_layers)])
        self.final_norm = Norm(h, spec.norm_type, policy=policy)
        self.tied = spec.tie_word_embeddings
        self.lm_head = (None if self.tied else
                        Linear(h, spec.vocab_size, bias=spec.lm_head_bias, policy=policy,
                               rngs=rngs))
        self.lm_head_bias = (nnx.Param(jnp.zeros((spec.vocab_size,), policy.frozen_dtype
                                                 if policy.lora else policy.param_dtype))
                             if (self.tied and spec.lm_head_bias) else None)

    def __call__(self, ids, key=None):
        """Token ids (b, s) -> logits (b, s, V) in the compute dtype."""
        x = self.embed(ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(jnp.arange(ids.shape[1]))[None]
        x = dropout(x, self.rate, jax.random.fold_in(key, 10**6) if key is not None else None)
        x = run_blocks(self.blocks, x, key, self.policy)
        with jax.named_scope("head"):
            x = self.final_norm(x)
            logits = self.embed.attend(x) if self.tied else self.lm_head(x)
            if self.lm_head_bias is not None:
                logits = logits + self.lm_head_bias[...].astype(logits.dtype)
        return logits


class Encoder(nnx.Module):
    """BERT: embeddings (+ token types, + norm), post-norm blocks, pooler / MLM / classifier."""

    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen):
        h, V = spec.hidden_size, spec.vocab_size
        fd = policy.frozen_dtype if policy.lora else policy.param_dtype
        self.policy, self.rate = policy, float(spec.hidden_dropout)
        self.embed = Embed(V, h, policy=policy, rngs=rngs)
        self.pos_embed = (Embed(spec.max_position_embeddings, h, policy=policy, rngs=rngs)
                          if spec.position_embedding == "learned" else None)
        self.type_embed = (Embed(spec.type_vocab_size, h, policy=policy, rngs=rngs)
                           if spec.type_vocab_size else None)
        self.embed_norm = Norm(h, spec.norm_type, policy=policy) if spec.embedding_norm else None
        self.blocks = _List([Block(spec, policy=policy, rngs=rngs, causal=False,
                                   post_norm=True, index=i)
                             for i in range(spec.num_hidden_layers)])
        self.pooler = Linear(h, h, bias=True, policy=policy, rngs=rngs) if spec.pooler else None
        self.tied = spec.tie_word_embeddings
        if spec.mlm_head:
            self.mlm_transform = Linear(h, h, bias=True, policy=policy, rngs=rngs)
            self.mlm_norm = Norm(h, spec.norm_type, policy=policy)
            self.mlm_decoder = (None if self.tied else
                                Linear(h, V, bias=False, policy=policy, rngs=rngs))
            self.mlm_bias = nnx.Param(jnp.zeros((V,), fd))
        else:
            self.mlm_transform = self.mlm_norm = self.mlm_decoder = self.mlm_bias = None
        self.classifier = (Linear(h, spec.num_labels, bias=True, policy=policy, rngs=rngs)
                           if spec.num_labels else None)
        self.act = _act(spec.hidden_act)

    def __call__(self, ids, key=None):
        """Token ids (b, s) -> (hidden (b, s, h), mlm logits or None, pooled (b, h))."""
        x = self.embed(ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(jnp.arange(ids.shape[1]))[None]
        if self.type_embed is not None:
            x = x + self.type_embed(jnp.zeros_like(ids))
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = dropout(x, self.rate, jax.random.fold_in(key, 10**6) if key is not None else None)
        x = run_blocks(self.blocks, x, key, self.policy)
        with jax.named_scope("head"):
            pooled = jnp.tanh(self.pooler(x[:, 0])) if self.pooler is not None else x[:, 0]
            logits = None
            if self.mlm_transform is not None:
                t = self.mlm_norm(self.act(self.mlm_transform(x)))
                logits = self.embed.attend(t) if self.tied else self.mlm_decoder(t)
                logits = logits + self.mlm_bias[...].astype(logits.dtype)
        return x, logits, pooled


class ViT(nnx.Module):
    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen):
        h, p, c = spec.hidden_size, spec.patch_size, spec.num_channels
        fd = policy.frozen_dtype if policy.lora else policy.param_dtype
        self.policy, self.rate, self.p = policy, float(spec.hidden_dropout), p
        self.patch = Linear(c * p * p, h, bias=True, policy=policy, rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((h,), fd))
        self.pos = nnx.Param(_normal(rngs, (spec.num_patches + 1, h), fd))
        self.blocks = _List([Block(spec, policy=policy, rngs=rngs, causal=False,
                                   post_norm=False, index=i)
                             for i in range(spec.num_hidden_layers)])
        self.final_norm = Norm(h, spec.norm_type, policy=policy)
        self.pooler = Linear(h, h, bias=True, policy=policy, rngs=rngs) if spec.pooler else None
        self.classifier = (Linear(h, spec.num_labels, bias=True, policy=policy, rngs=rngs)
                           if spec.num_labels else None)

    def __call__(self, images, key=None):
        """Images (b, c, H, W) -> (tokens (b, n+1, h), pooled (b, h))."""
        b, c, H, W = images.shape
        p = self.p
        x = images.reshape(b, c, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)
        x = self.patch(x.reshape(b, (H // p) * (W // p), c * p * p))
        cd = self.policy.compute_dtype
        cls = jnp.broadcast_to(self.cls[...].astype(cd), (b, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos[...].astype(cd)[None]
        x = dropout(x, self.rate, jax.random.fold_in(key, 10**6) if key is not None else None)
        x = run_blocks(self.blocks, x, key, self.policy)
        with jax.named_scope("head"):
            x = self.final_norm(x)
            pooled = jnp.tanh(self.pooler(x[:, 0])) if self.pooler is not None else x[:, 0]
        return x, pooled


class MLPStack(nnx.Module):
    """``num_hidden_layers`` dense layers ``hidden_size`` wide with biases."""

    def __init__(self, spec: ModelSpec, *, policy: Policy, rngs: KeyGen):
        h = spec.hidden_size
        self.policy = policy
        self.act = _act(spec.hidden_act)
        self.layers = _List([Linear(h, h, bias=True, policy=policy, rngs=rngs)
                                for _ in range(spec.num_hidden_layers)])

    def __call__(self, x, key=None):
        constrain = self.policy.constrain or (lambda y: y)
        x = constrain(x.astype(self.policy.compute_dtype))
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            mode = self.policy.remat[i] if i < len(self.policy.remat) else "none"

            def f(layer, x, last=(i == n - 1)):
                y = layer(x)
                return y if last else self.act(y)

            with jax.named_scope(f"block{i}"):
                if mode == "none":
                    x = f(layer, x)
                else:
                    gd, st = nnx.split(layer)
                    g = lambda st, x, gd=gd, f=f: f(nnx.merge(gd, st), x)  # noqa: E731
                    x = remat_at_backward(g, REMAT_POLICIES[mode])(st, x)
                x = constrain(x)
        return x


FAMILY_MODULES = {"decoder": DecoderLM, "encoder": Encoder, "vit": ViT, "mlp": MLPStack}


def build_model(spec: ModelSpec, policy: Policy | None = None, *, seed: int = 0,
                shapes_only: bool = False) -> nnx.Module:
    """The Flax module for ``spec`` (allocates; wrap in `nnx.eval_shape` to stay abstract)."""
    return FAMILY_MODULES[spec.family](spec, policy=policy or Policy(),
                                       rngs=KeyGen(seed, shapes_only=shapes_only))


def abstract_model(spec: ModelSpec, policy: Policy | None = None) -> nnx.Module:
    """`build_model` under `nnx.eval_shape`: every array is a `jax.ShapeDtypeStruct`."""
    return nnx.eval_shape(lambda: build_model(spec, policy, shapes_only=True))


def _size(state) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


def count_params(model: nnx.Module) -> int:
    """Weights of the architecture: every `nnx.Param` except LoRA adapters and quantisation
    scales, a packed uint8 code counting as two 4-bit weights."""
    codes = nnx.state(model, QuantCodes)
    encoded = sum(int(np.prod(x.shape)) * (2 if x.dtype == jnp.uint8 else 1)
                  for x in jax.tree.leaves(codes))
    return (_size(nnx.state(model, nnx.Param)) - _size(nnx.state(model, LoRAParam))
            - _size(nnx.state(model, QuantScale)) - _size(codes) + encoded)


def count_lora_params(model: nnx.Module) -> int:
    return _size(nnx.state(model, LoRAParam))


__all__ = ["DecoderLM", "Encoder", "FAMILY_MODULES", "LoRAParam", "MLPStack", "Policy",
           "QuantCodes", "QuantScale", "ViT", "abstract_model", "build_model", "count_lora_params",
           "count_params"]
