"""The optax optimizer a scenario names, and the one that optax does not ship (8-bit AdamW).

=================  =========================================================================
``adamw``          ``optax.adamw`` (weight decay 0.01), first moment in the state dtype
``adam``           ``optax.adam``
``sgd``            ``optax.sgd`` (no state)
``sgd-momentum``   ``optax.sgd(momentum=0.9)``, trace in the state dtype
``adafactor``      ``optax.adafactor`` with optax's defaults (factors tensors whose two
                   largest dimensions are >= 128; others keep a full second moment)
``lion``           ``optax.lion``, momentum in the state dtype
``adamw-8bit``     `adamw_8bit`: an approximation of bitsandbytes' blockwise 8-bit AdamW
=================  =========================================================================

``grad_clip`` prepends ``optax.clip_by_global_norm(1.0)``. The learning rate is a constant:
schedules change no buffer.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._runtime import ADAFACTOR_MIN_DIM, ADAM8BIT_BLOCK, ADAM8BIT_MIN_SIZE

LEARNING_RATE = 1e-4
# The layout constants are shared with the cost model (capopt._runtime), which counts them.
BLOCK = ADAM8BIT_BLOCK              # weights per float32 absmax
MIN_8BIT_SIZE = ADAM8BIT_MIN_SIZE   # bitsandbytes keeps 32-bit state for smaller tensors


class Quantized(NamedTuple):
    """One 8-bit state tensor: codes (blocks, BLOCK) and a float32 absmax per block."""

    codes: jax.Array       # int8 (signed state) or uint8 (second moment), (n_blocks, BLOCK)
    absmax: jax.Array      # float32 (n_blocks,)


class Adam8bitState(NamedTuple):
    count: jax.Array       # int32 []
    mu: Any                # per leaf: Quantized (int8) or float32 array (small leaves)
    nu: Any                # per leaf: Quantized (uint8) or float32 array


def _quantize(x, signed: bool) -> Quantized:
    n = x.size
    blocks = math.ceil(n / BLOCK)
    flat = jnp.pad(x.reshape(-1).astype(jnp.float32), (0, blocks * BLOCK - n))
    flat = flat.reshape(blocks, BLOCK)
    absmax = jnp.max(jnp.abs(flat), axis=1)
    scale = jnp.where(absmax > 0, absmax, 1.0)[:, None]
    if signed:
        codes = jnp.clip(jnp.round(flat / scale * 127), -127, 127).astype(jnp.int8)
    else:
        codes = jnp.clip(jnp.round(flat / scale * 255), 0, 255).astype(jnp.uint8)
    return Quantized(codes, absmax)


def _dequantize(q: Quantized, like, signed: bool):
    levels = 127.0 if signed else 255.0
    flat = q.codes.astype(jnp.float32) / levels * q.absmax[:, None]
    return flat.reshape(-1)[: like.size].reshape(like.shape)


def _zeros_state(p, signed: bool):
    if p.size < MIN_8BIT_SIZE:
        return jnp.zeros(p.shape, jnp.float32)
    blocks = math.ceil(p.size / BLOCK)
    return Quantized(jnp.zeros((blocks, BLOCK), jnp.int8 if signed else jnp.uint8),
                     jnp.zeros((blocks,), jnp.float32))


def adamw_8bit(learning_rate: float = LEARNING_RATE, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 0.01) -> optax.GradientTransformation:
    """AdamW with both moments stored in 8 bits, blockwise (Dettmers et al. 2022).

    An approximation of ``bitsandbytes.optim.AdamW8bit``: linear (not dynamic-tree) 8-bit
    codes, a float32 absmax per 2048 weights, float32 state for tensors under 4096 weights.
    Memory is what it models: 1 + 4/2048 bytes per moment per weight on large tensors.
    """
    is_q = lambda x: isinstance(x, Quantized)  # noqa: E731

    def init(params):
        return Adam8bitState(jnp.zeros([], jnp.int32),
                             jax.tree.map(lambda p: _zeros_state(p, True), params),
                             jax.tree.map(lambda p: _zeros_state(p, False), params))

    def update(grads, state, params=None):
        count = state.count + 1
        t = count.astype(jnp.float32)

        def one(g, m, v, p):
            g32 = g.astype(jnp.float32)
            m32 = _dequantize(m, g, True) if is_q(m) else m
            v32 = _dequantize(v, g, False) if is_q(v) else v
            m32 = b1 * m32 + (1 - b1) * g32
            v32 = b2 * v32 + (1 - b2) * g32 * g32
            mh, vh = m32 / (1 - b1 ** t), v32 / (1 - b2 ** t)
            u = -learning_rate * (mh / (jnp.sqrt(vh) + eps) + weight_decay * p.astype(jnp.float32))
            m_new = _quantize(m32, True) if is_q(m) else m32
            v_new = _quantize(v32, False) if is_q(v) else v32
            return u.astype(g.dtype), m_new, v_new

        out = jax.tree.map(one, grads, state.mu, state.nu, params, is_leaf=is_q)
        treedef = jax.tree.structure(grads)
        leaves = treedef.flatten_up_to(out)
        updates = treedef.unflatten([x[0] for x in leaves])
        mu = treedef.unflatten([x[1] for x in leaves])
        nu = treedef.unflatten([x[2] for x in leaves])
        return updates, Adam8bitState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def make_optimizer(name: str, *, state_dtype=jnp.float32, grad_clip: bool = True,
                   learning_rate: float = LEARNING_RATE) -> optax.GradientTransformation:
    """The optax transformation for a scenario's ``training.optimizer``."""
    lr = learning_rate
    if name == "adamw":
        tx = optax.adamw(lr, weight_decay=0.01, mu_dtype=state_dtype)
    elif name == "adam":
        tx = optax.adam(lr, mu_dtype=state_dtype)
    elif name == "sgd":
        tx = optax.sgd(lr)
    elif name == "sgd-momentum":
        tx = optax.sgd(lr, momentum=0.9, accumulator_dtype=state_dtype)
    elif name == "adafactor":
        tx = optax.adafactor(lr, min_dim_size_to_factor=ADAFACTOR_MIN_DIM)
    elif name == "lion":
        tx = optax.lion(lr, mu_dtype=state_dtype)
    elif name == "adamw-8bit":
        tx = adamw_8bit(lr)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    return optax.chain(optax.clip_by_global_norm(1.0), tx) if grad_clip else tx


__all__ = ["Adam8bitState", "Quantized", "adamw_8bit", "make_optimizer"]
