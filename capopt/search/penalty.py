"""The annealed-penalty solve both relaxations use: the config solve (`relax.make_solver`) and
the stage-layout solve (`stages`).

Each minimises ``loss(x) + penalty(memory excess)`` from a batch of starts with any optax
transformation, the penalty's weight raised geometrically from ``mu0`` to ``mu1`` over the
steps so that early steps explore and late ones hold the budget. The penalty on a relative
excess ``over = memory / usable - 1`` is ``mu * softplus(SHARP * over)^2 / SHARP^2``: smooth,
almost zero below the budget and quadratic above it. Its derivative at the final weight is the
constraint's multiplier (`multiplier`): the price of memory in the relaxation.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from ..cost._inputs import DTYPE

SHARP = 30.0     # sharpness of the smoothed memory excess (1/30 of the budget: the knee)


def memory_penalty(over, mu):
    """The penalty on relative memory excess ``over`` (a scalar, or one per stage: summed)."""
    return mu * jnp.sum((jax.nn.softplus(SHARP * over) / SHARP) ** 2)


def multiplier(over, mu):
    """d `memory_penalty` / d ``over``, elementwise: what one unit more of relative budget is
    worth to the loss at a point that is stationary for it."""
    return mu * 2.0 * (jax.nn.softplus(SHARP * over) / SHARP) * jax.nn.sigmoid(SHARP * over)


def penalty_solve(loss_terms: Callable, optimizer: optax.GradientTransformation, steps: int,
                  mu0: float = 1.0, mu1: float = 1e4) -> Callable:
    """``solve(x0, *args) -> (x, (loss, *aux))`` over a batch of starts ``x0`` (starts, dim).

    ``loss_terms(x, *args, mu) -> (loss, aux)`` is one start's loss under penalty weight
    ``mu``. ``steps`` updates of ``optimizer``, then one more pass that only evaluates: the
    loss and ``aux`` returned are the final point's, from the same traced evaluation of the
    model and its gradient (not a second copy of it). The starts are vectorised inside the
    loop (vmap of the loss and of the optimizer step, each start its own optimizer state), not
    by batching the whole loop: that traces in a fraction of the time.
    """
    def solve(x0, *args):
        in_axes = (0,) + (None,) * (len(args) + 1)
        value_and_grad = jax.vmap(jax.value_and_grad(loss_terms, has_aux=True),
                                  in_axes=in_axes)
        update = jax.vmap(optimizer.update)
        state = jax.vmap(optimizer.init)(x0)

        def body(carry, t):
            x, s, _ = carry
            mu = mu0 * (mu1 / mu0) ** (jnp.minimum(t, steps - 1) / (steps - 1))
            (loss, aux), g = value_and_grad(x, *args, mu)
            g = jnp.where(jnp.isfinite(g), g, 0.0)
            upd, s_new = update(g, s, x)
            last = t >= steps
            x = jnp.where(last, x, optax.apply_updates(x, upd))
            s = jax.tree.map(lambda new, old: jnp.where(last, old, new), s_new, s)
            return (x, s, (loss, aux)), None

        first = jax.eval_shape(lambda x: jax.vmap(loss_terms, in_axes=in_axes)(x, *args, mu0),
                               x0)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), first)
        (x, _, out), _ = jax.lax.scan(body, (x0, state, zeros),
                                      jnp.arange(steps + 1, dtype=DTYPE))
        return x, out

    return solve


__all__ = ["SHARP", "memory_penalty", "multiplier", "penalty_solve"]
