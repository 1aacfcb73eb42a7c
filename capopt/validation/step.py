"""One training step that honours a `Config`, built abstractly and lowered for any tier.

The functional nnx pattern: ``graphdef, trainable, frozen = nnx.split(model, ...)``; a plain
`jax.jit` step merges them inside, computes the loss and gradients (over ``grad_accum``
micro-batches with `jax.lax.scan`), applies the optax update and returns the new trainable
state, the new optimizer state and the loss. The trainable parameters and the optimizer state
are donated, so XLA aliases them to the outputs. Everything is first built with
`nnx.eval_shape` / `jax.eval_shape`, so lowering the step for the exact and xla-gpu tiers
allocates nothing: inputs are `jax.ShapeDtypeStruct` with their `NamedSharding`.

What the config sets:

- precision: parameter, compute and optimizer-state dtypes come from the runtime profile's
  precision table (``param_bytes`` / ``act_bytes`` / ``state_bytes``: 4 -> float32, 2 ->
  bfloat16, or float16 for ``fp16-mixed``). ``fp8-mixed`` computes in bfloat16 (fp8 matmuls
  are not emulated); ``fp16-mixed`` uses no loss scaling. Under LoRA the frozen parameters
  are stored in the compute dtype and the adapters in the parameter dtype.
- optimizer and grad_clip: `optim.make_optimizer`.
- remat: ``none``; ``selective`` (per block, save the matmuls without batch dimensions);
  ``full`` (per block, save only the block input); a fraction ``r``: the first
  ``round(r * L)`` blocks full, the rest none.
- grad_accum: a scan over micro-batches accumulating gradients in the parameter dtype.
- dp, tp, ep, zero_stage, sequence_parallel: `sharding` (one mesh, XLA's SPMD partitioner).
- flash_attention: ``chunked`` attention (query blocks recomputed in the backward pass), or
  cuDNN's fused kernel on a real GPU in 16-bit (which applies no attention dropout); else
  materialised scores.

Not implemented (the step raises `Unsupported`): pipeline parallelism (pp > 1) and optimizer
offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._specs import Config, Scenario
from . import sharding as sh
from .models import LoRAParam, Policy, abstract_model
from .optim import make_optimizer


class Unsupported(Exception):
    """The config uses a feature the validation step does not implement."""


_DTYPES = {4: jnp.float32, 2: jnp.bfloat16}


def _dtype(nbytes: float, precision: str):
    if int(nbytes) == 2 and precision == "fp16-mixed":
        return jnp.float16
    if int(nbytes) not in _DTYPES:
        raise Unsupported(f"no {nbytes}-byte dtype for {precision}")
    return _DTYPES[int(nbytes)]


def precision_dtypes(scenario: Scenario) -> dict[str, Any]:
    """param / compute / state / frozen dtypes for the scenario's precision and runtime."""
    w = scenario.workload
    prec = scenario.runtime.precision(w.precision)
    if float(prec["master_bytes"]):
        raise Unsupported(f"runtime {scenario.runtime.name!r} keeps a separate master copy "
                          "(master_bytes > 0); the validation step follows XLA profiles")
    compute = _dtype(prec["act_bytes"], w.precision)
    return {"param": _dtype(prec["param_bytes"], w.precision), "compute": compute,
            "state": _dtype(prec["state_bytes"], w.precision), "frozen": compute}


def remat_plan(config: Config, layers: int) -> tuple[str, ...]:
    r = config.remat
    if isinstance(r, str):
        return (r,) * layers
    full = int(round(float(r) * layers))
    return ("full",) * full + ("none",) * (layers - full)


def attention_impl(config: Config, tier: str) -> str:
    if not config.flash_attention:
        return "xla"
    return "cudnn" if tier == "device-cudnn" else "chunked"


# --------------------------------------------------------------------------------------------
# Batches and losses
# --------------------------------------------------------------------------------------------
def batch_shapes(scenario: Scenario, config: Config, compute_dtype) -> dict[str, tuple]:
    """Global shapes and dtypes of one step's inputs: (grad_accum, dp * micro_batch, ...)."""
    m = scenario.model
    ga, b, s = config.grad_accum, config.dp * config.micro_batch, scenario.seq_len
    i32 = jnp.int32
    if m.family == "decoder":
        return {"inputs": ((ga, b, s), i32), "labels": ((ga, b, s), i32)}
    if m.family == "encoder":
        out = {"inputs": ((ga, b, s), i32)}
        if m.mlm_head:
            out["labels"] = ((ga, b, s), i32)
        if m.num_labels:
            out["class_labels"] = ((ga, b), i32)
        return out
    if m.family == "vit":
        out = {"inputs": ((ga, b, m.num_channels, m.image_size, m.image_size), compute_dtype)}
        if m.num_labels:
            out["class_labels"] = ((ga, b), i32)
        return out
    return {"inputs": ((ga, b, s, m.hidden_size), compute_dtype),
            "targets": ((ga, b, s, m.hidden_size), compute_dtype)}


def _xent(logits, labels):
    with jax.named_scope("loss"):
        logits = logits.astype(jnp.float32)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.mean(logz - picked)


def model_loss(model, family: str, batch: dict, key):
    """The training loss of one micro-batch (float32 scalar)."""
    if family == "decoder":
        return _xent(model(batch["inputs"], key), batch["labels"])
    if family == "encoder":
        x, logits, pooled = model(batch["inputs"], key)
        loss = jnp.zeros((), jnp.float32)
        if logits is not None:
            loss = loss + _xent(logits, batch["labels"])
        if model.classifier is not None:
            loss = loss + _xent(model.classifier(pooled), batch["class_labels"])
        if logits is None and model.classifier is None:
            loss = jnp.mean(jnp.square(pooled.astype(jnp.float32)))
        return loss
    if family == "vit":
        x, pooled = model(batch["inputs"], key)
        if model.classifier is not None:
            return _xent(model.classifier(pooled), batch["class_labels"])
        return jnp.mean(jnp.square(pooled.astype(jnp.float32)))
    y = model(batch["inputs"], key)
    return jnp.mean(jnp.square((y - batch["targets"]).astype(jnp.float32)))


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------
@dataclass
class TrainStep:
    """A jitted step and the abstract, sharded arguments to lower it with.

    ``fn(trainable, frozen, opt_state, batch, key) -> (trainable, opt_state, loss)``.
    Byte counts are per device, from the shard shapes.
    """

    fn: Any
    args: tuple
    scenario: Scenario
    config: Config
    mesh: Mesh
    graphdef: Any
    policy: Policy
    optimizer: optax.GradientTransformation
    shardings: tuple
    params_bytes: int
    trainable_bytes: int
    optimizer_bytes: int
    input_bytes: int
    unsharded: list

    def lower(self):
        return self.fn.lower(*self.args)


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def build_step(scenario: Scenario, config: Config, devices, *, tier: str = "exact",
               learning_rate: float = 1e-4) -> TrainStep:
    """Build the step for ``config`` on ``devices`` (real or a deviceless topology's)."""
    if config.pp > 1:
        raise Unsupported("pipeline parallelism (pp > 1) is not implemented by the "
                          "validation step")
    if config.offload_optimizer or config.offload_params:
        raise Unsupported("host offload (offload_optimizer, offload_params) is not "
                          "implemented by the validation step")
    if config.cp > 1:
        raise Unsupported("context parallelism (cp > 1) is not implemented by the validation "
                          "step")
    if config.dp_replicate > 1:
        raise Unsupported("hybrid sharding (dp_replicate > 1) is not implemented by the "
                          "validation step: it shards over all of dp")
    if scenario.workload.optimizer_in_backward:
        raise Unsupported("the validation step updates after the backward pass "
                          "(training.optimizer_in_backward is the torch tier's)")
    if config.ep > 1 and not scenario.model.is_moe:
        raise Unsupported("ep > 1 needs an MoE model")
    if scenario.workload.loss != "float32":
        raise Unsupported(f"loss {scenario.workload.loss!r}: the validation step takes optax's "
                          "cross-entropy of float32 logits")
    m, w = scenario.model, scenario.workload
    dt = precision_dtypes(scenario)
    mesh = sh.make_mesh(config, devices)
    data_spec = P(sh.DATA, "tensor" if config.sequence_parallel else None, None)
    stream = NamedSharding(mesh, data_spec)

    def constrain(x):
        if x.ndim != 3:
            return x
        return jax.lax.with_sharding_constraint(x, stream)

    def layout(x, kind):
        # Megatron-LM's layout inside a block under sequence parallelism (`Policy.layout`):
        # the batch over the data-parallel group and, but for a "whole" input, one dimension
        # over tp where tp divides it: the heads of (b, s, heads, d), f of (b, s, f) (k/v of
        # fewer KV heads stay whole, replicated as their weights are)
        spec = [sh.DATA] + [None] * (x.ndim - 1)
        dim = {"whole": None, "heads": 2, "hidden": x.ndim - 1}[kind]
        if dim is not None and x.shape[dim] % config.tp == 0:
            spec[dim] = "tensor"
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def moe_constrain(x, kind):
        # "groups": (G, ...) with G over the data-parallel group; "experts": (E, G, C, h)
        # with E over the expert axis and G over the rest of the data-parallel group
        if kind == "groups":
            spec = P(sh.DATA, *([None] * (x.ndim - 1)))
        elif config.ep > 1:
            spec = P("expert", "replica", None, None)
        else:
            spec = P(None, sh.DATA, None, None)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    policy = Policy(param_dtype=dt["param"], compute_dtype=dt["compute"],
                    frozen_dtype=dt["frozen"], lora=w.lora,
                    attention=attention_impl(config, tier),
                    remat=remat_plan(config, m.num_hidden_layers),
                    moe_capacity_factor=scenario.runtime.coeff("moe_capacity_factor"),
                    moe_groups=config.dp, constrain=constrain, moe_constrain=moe_constrain,
                    layout=layout if config.sequence_parallel and config.tp > 1 else None)
    model = abstract_model(m, policy)
    if w.lora is not None:
        graphdef, trainable, frozen = nnx.split(model, LoRAParam, ...)
    else:
        graphdef, trainable, frozen = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(w.optimizer, state_dtype=dt["state"], grad_clip=w.grad_clip,
                        learning_rate=learning_rate)
    opt_state = jax.eval_shape(tx.init, trainable)

    zero = config.zero_stage
    tr_sh = sh.tree_shardings(trainable, mesh, m, config, data_shard=zero >= 3)
    fr_sh = sh.tree_shardings(frozen, mesh, m, config, data_shard=zero >= 3)
    opt_sh = sh.opt_shardings(opt_state, trainable, mesh, m, config, data_shard=zero >= 1)
    grad_sh = sh.tree_shardings(trainable, mesh, m, config, data_shard=zero >= 2)

    shapes = batch_shapes(scenario, config, dt["compute"])
    batch_sh = {k: NamedSharding(mesh, P(None, sh.DATA, *([None] * (len(s) - 2))))
                for k, (s, _) in shapes.items()}
    batch = {k: jax.ShapeDtypeStruct(s, d, sharding=batch_sh[k]) for k, (s, d) in shapes.items()}
    rep = NamedSharding(mesh, P())
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
    dropout = m.hidden_dropout > 0 or m.attention_dropout > 0
    family, ga = m.family, config.grad_accum

    def loss_fn(tr, fr, mb, k):
        return model_loss(nnx.merge(graphdef, tr, fr), family, mb, k)

    grad_fn = jax.value_and_grad(loss_fn)

    def step(tr, fr, opt, batch, raw_key):
        base = jax.random.wrap_key_data(raw_key) if dropout else None

        def micro(i):
            mb = jax.tree.map(lambda x: x[i], batch)
            k = jax.random.fold_in(base, i) if base is not None else None
            return mb, k

        if ga == 1:
            mb, k = micro(0)
            loss, grads = grad_fn(tr, fr, mb, k)
        else:
            def body(carry, i):
                acc, total = carry
                mb, k = micro(i)
                loss, g = grad_fn(tr, fr, mb, k)
                acc = jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
                acc = jax.lax.with_sharding_constraint(acc, grad_sh)
                return (acc, total + loss), None

            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tr)
            zeros = jax.lax.with_sharding_constraint(zeros, grad_sh)
            (grads, loss), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)),
                                            jnp.arange(ga))
            grads = jax.tree.map(lambda g: g / ga, grads)
            loss = loss / ga
        if zero >= 2:
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)
        with jax.named_scope("optimizer"):
            updates, opt = tx.update(grads, opt, tr)
            tr = optax.apply_updates(tr, updates)
        return tr, opt, loss

    # keep_unused: the key stays an argument even without dropout, so argument bytes are the
    # same function of the inputs for every model.
    fn = jax.jit(step, in_shardings=(tr_sh, fr_sh, opt_sh, batch_sh, rep),
                 out_shardings=(tr_sh, opt_sh, rep), donate_argnums=(0, 2), keep_unused=True)
    args = (_abstract(trainable, tr_sh), _abstract(frozen, fr_sh), _abstract(opt_state, opt_sh),
            batch, key)
    tr_bytes = sh.tree_shard_bytes(trainable, tr_sh)
    return TrainStep(
        fn=fn, args=args, scenario=scenario, config=config, mesh=mesh, graphdef=graphdef,
        policy=policy, optimizer=tx,
        shardings=(tr_sh, fr_sh, opt_sh, batch_sh, rep),
        params_bytes=tr_bytes + sh.tree_shard_bytes(frozen, fr_sh),
        trainable_bytes=tr_bytes,
        optimizer_bytes=sh.tree_shard_bytes(opt_state, opt_sh),
        input_bytes=sum(sh.shard_bytes(x, batch_sh[k]) for k, x in batch.items()) + 8,
        unsharded=(sh.describe_unsharded(trainable, tr_sh) if zero >= 3 else []))


def output_leaves(step: TrainStep) -> int:
    """Arrays the step returns (each costs an address in the output tuple)."""
    tr, _, opt, _, _ = step.args
    return len(jax.tree.leaves(tr)) + len(jax.tree.leaves(opt)) + 1


def init_arguments(step: TrainStep, seed: int = 0) -> tuple:
    """Real, sharded arguments to run the step (the device tier): parameters from the model's
    initialisers, the optimizer's initial state, random token ids / features."""
    from .models import build_model
    tr_sh, fr_sh, opt_sh, batch_sh, rep = step.shardings
    sc = step.scenario
    lora = sc.workload.lora is not None

    def make_params():
        model = build_model(sc.model, step.policy, seed=seed)
        _, tr, fr = nnx.split(model, LoRAParam if lora else nnx.Param, ...)
        return tr, fr

    tr, fr = jax.jit(make_params, out_shardings=(tr_sh, fr_sh))()
    opt = jax.jit(step.optimizer.init, out_shardings=opt_sh)(tr)
    batch_abs = step.args[3]
    vocab = max(sc.model.vocab_size, 2)

    def make_batch(key):
        out = {}
        for i, (k, x) in enumerate(sorted(batch_abs.items())):
            kk = jax.random.fold_in(key, i)
            if jnp.issubdtype(x.dtype, jnp.integer):
                hi = sc.model.num_labels if k == "class_labels" else vocab
                out[k] = jax.random.randint(kk, x.shape, 0, max(hi, 1), x.dtype)
            else:
                out[k] = jax.random.normal(kk, x.shape, jnp.float32).astype(x.dtype)
        return out

    batch = jax.jit(make_batch, out_shardings=batch_sh)(jax.random.key(seed + 1))
    key = jax.device_put(jax.random.key_data(jax.random.key(seed + 2)), rep)
    return tr, fr, opt, batch, key


__all__ = ["TrainStep", "Unsupported", "batch_shapes", "build_step", "init_arguments",
           "model_loss", "output_leaves", "precision_dtypes", "remat_plan"]
