"""How a config places parameters, optimizer state and batches on a `jax.sharding.Mesh`.

The mesh has three axes, ``("replica", "expert", "tensor")`` of sizes ``(dp // ep, ep, tp)``;
the data-parallel group is ``replica x expert`` (size ``dp``), so expert parallelism splits the
data-parallel group as in DeepSpeed-MoE. Batches are split over the data-parallel group.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019): column-parallel ``q k v gate up``
(output dimension and bias split), row-parallel ``o down`` (input dimension split, bias
replicated), vocabulary-parallel ``embed``/``lm_head``/``mlm_decoder``, and the plain MLP
stack's layers column-parallel; with sequence parallelism (Korthikanti et al. 2022) the
residual stream is split over the sequence between sublayers and each block's inside laid
out as Megatron-LM's (`capopt.validation.models.Policy.layout`); LoRA adapters as NeMo's
``ParallelLinearAdapter`` (split on the rank where the base layer's split dimension is not
theirs). ``k``/``v`` are replicated when ``tp`` does not divide the KV heads; a vocabulary
``tp`` does not divide is replicated (Megatron-LM pads it instead, which changes the parameter
count). Norms, routers, positions and small heads are replicated. MoE experts are split over
the ``expert`` axis (their leading dimension).

ZeRO (Rajbhandari et al. 2020): stage 1 and 2 split the optimizer state over the data-parallel
group (stage 2 also constrains the gradients so), stage 3 (FSDP) also the parameters. A leaf
is split on its largest dimension that the group divides after tensor parallelism (expert
weights over ``replica`` only: their ``expert`` share is already theirs); a leaf nothing
divides stays replicated, and `describe_unsharded` lists such leaves.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._model import ModelSpec
from .._specs import Config

AXES = ("replica", "expert", "tensor")
DATA = ("replica", "expert")

COLUMN = {"q", "kv_b", "gate", "up", "lm_head", "mlm_decoder"}
KV = {"k", "v"}
ROW = {"o", "down"}
EXPERT_LEAVES = {
    # leaf -> tensor-parallel dimension (None: replicated over "tensor")
    "gate": 2, "up": 2, "down": 1, "gate_bias": 1, "up_bias": 1, "down_bias": None,
    "gate_lora_a": 2, "gate_lora_b": 2, "up_lora_a": 2, "up_lora_b": 2,
    "down_lora_a": 1, "down_lora_b": 1,
}


def make_mesh(config: Config, devices) -> Mesh:
    """The ``(dp // ep, ep, tp)`` mesh over the first ``dp * tp`` of ``devices``."""
    n = config.dp * config.tp
    devs = list(devices)
    if len(devs) < n:
        raise RuntimeError(f"config needs {n} devices (dp {config.dp} x tp {config.tp}), "
                           f"found {len(devs)}")
    arr = np.array(devs[:n], dtype=object).reshape(config.dp // config.ep, config.ep, config.tp)
    return Mesh(arr, AXES)


def path_names(path) -> tuple:
    """Key names of a pytree path, without nnx's trailing ``value``."""
    out = []
    for p in path:
        k = getattr(p, "key", getattr(p, "name", getattr(p, "idx", None)))
        if k == "value":
            continue
        out.append(k)
    return tuple(out)


def _tensor_dim(names: tuple, shape: tuple, spec: ModelSpec, tp: int) -> int | None:
    """Which dimension of a parameter tensor parallelism splits (None: replicated)."""
    if tp == 1 or not names:
        return None
    leaf = names[-1]
    parent = names[-2] if len(names) >= 2 else None
    if parent == "experts":
        d = EXPERT_LEAVES.get(leaf)
    elif leaf == "embedding":
        d = 0 if parent == "embed" else None
    elif leaf in ("lm_head_bias", "mlm_bias"):
        d = 0
    else:
        layers = len(names) >= 3 and names[-3] == "layers"      # the MLP family's stack
        role = ("col" if (parent in COLUMN or layers or (parent in KV and spec.kv_heads % tp == 0))
                else "row" if parent in ROW else None)
        d = _linear_dim(leaf, role, len(shape))
    if d is None or d >= len(shape) or shape[d] % tp:
        return None
    return d


def _linear_dim(leaf: str, role: str | None, ndim: int) -> int | None:
    if role is None:
        return None
    col = role == "col"
    if leaf in ("kernel", "codes"):
        return 1 if col else 0
    if leaf in ("bias", "scale"):              # 8-bit scale is per output column
        return 0 if col else None
    if leaf == "absmax":                       # flattened (in, out) blocks: rows are contiguous
        return None if col else 0
    # LoRA as NeMo's ParallelLinearAdapter: a column-parallel layer's A is split on the rank,
    # its B on the output; a row-parallel layer's A on the input, its B on the rank.
    if leaf == "lora_a":
        return 1 if col else 0
    if leaf == "lora_b":
        return 1 if col else 0
    return None


def param_spec(names: tuple, shape: tuple, spec: ModelSpec, config: Config, *,
               data_shard: bool) -> P:
    """Where one parameter (or a same-shaped optimizer-state leaf) lives."""
    entries: list = [None] * len(shape)
    divisor = [1] * len(shape)
    td = _tensor_dim(names, shape, spec, config.tp)
    if td is not None:
        entries[td] = "tensor"
        divisor[td] = config.tp
    expert = len(names) >= 2 and names[-2] == "experts" and len(shape) == 3
    if expert and config.ep > 1 and shape[0] % config.ep == 0:
        entries[0] = "expert"
        divisor[0] = config.ep
    if data_shard:
        axes = ("replica",) if (expert and config.ep > 1) else DATA
        size = math.prod({"replica": config.dp // config.ep, "expert": config.ep}[a]
                         for a in axes)
        if size > 1:
            _add_data_axes(entries, divisor, shape, axes, size)
    return P(*entries)


def _add_data_axes(entries, divisor, shape, axes, size):
    best = None
    for d in range(len(shape)):
        if (shape[d] // divisor[d]) % size == 0 and shape[d] // divisor[d] >= size:
            key = (entries[d] is None, shape[d] // divisor[d])
            if best is None or key > best[0]:
                best = (key, d)
    if best is None:
        return
    d = best[1]
    entries[d] = tuple(axes) if entries[d] is None else (
        (entries[d],) if isinstance(entries[d], str) else tuple(entries[d])) + tuple(axes)
    divisor[d] *= size


def _flat_spec(shape: tuple, like: P, config: Config) -> P:
    """A state leaf shaped unlike its parameter (factored or quantised state): split its
    first dimension over every axis that splits the parameter's state, when it divides."""
    used: list[str] = []
    for e in like:
        if e is None:
            continue
        used += [e] if isinstance(e, str) else list(e)
    if not used or not shape:
        return P(*([None] * len(shape)))
    size = math.prod({"replica": config.dp // config.ep, "expert": config.ep,
                      "tensor": config.tp}[a] for a in used)
    if shape[0] % size:
        return P(*([None] * len(shape)))
    return P(tuple(used), *([None] * (len(shape) - 1)))


def tree_shardings(state, mesh: Mesh, spec: ModelSpec, config: Config, *, data_shard: bool):
    """`param_spec` for every leaf of a parameter state (a pytree of arrays or shapes), as
    `NamedSharding` leaves."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path_names(path), tuple(x.shape), spec,
                                                       config, data_shard=data_shard)), state)


def opt_shardings(opt_state, params, mesh: Mesh, spec: ModelSpec, config: Config, *,
                  data_shard: bool):
    """Specs for an optimizer state: a leaf under a parameter's path (``mu``, ``nu``, ...)
    takes that parameter's placement (split over the data group when ``data_shard``); a leaf
    of another shape the `_flat_spec` rule; scalars (step counts) are replicated."""
    table = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = path_names(path)
        table[names] = (tuple(x.shape), param_spec(names, tuple(x.shape), spec, config,
                                                   data_shard=data_shard))
    lengths = sorted({len(k) for k in table}, reverse=True)

    def one(path, x):
        return NamedSharding(mesh, _opt_spec(path, x))

    def _opt_spec(path, x):
        names = path_names(path)
        shape = tuple(x.shape)
        if not shape:
            return P()
        for n in lengths:
            for start in range(0, len(names) - n + 1):
                hit = table.get(names[start:start + n])
                if hit is None:
                    continue
                pshape, pspec = hit
                if pshape == shape:
                    return pspec
                return _flat_spec(shape, pspec, config)
        return P(*([None] * len(shape)))

    return jax.tree_util.tree_map_with_path(one, opt_state)


def shard_bytes(x, sharding: NamedSharding) -> int:
    """Bytes of one device's shard of ``x`` (a shape-dtype struct or an array)."""
    shard = sharding.shard_shape(tuple(x.shape))
    return int(math.prod(shard)) * np.dtype(x.dtype).itemsize


def tree_shard_bytes(tree, shardings) -> int:
    return sum(shard_bytes(x, s) for x, s in zip(jax.tree.leaves(tree),
                                                  jax.tree.leaves(shardings)))


def describe_unsharded(tree, shardings, *, min_elems: int = 1) -> list[str]:
    """Leaves that stay whole on every device (for reports)."""
    out = []
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(
            shardings)):
        if all(e is None for e in s.spec) and math.prod(x.shape) >= min_elems:
            out.append("/".join(str(n) for n in path_names(path)))
    return out


__all__ = ["AXES", "DATA", "describe_unsharded", "make_mesh", "opt_shardings", "param_spec",
           "path_names", "shard_bytes", "tree_shard_bytes", "tree_shardings"]
