"""The torch tier: one PyTorch training step of a candidate on fake tensors, metered.

The step is what a PyTorch training loop does, from the same scenario and config as the
other tiers: the card's model (`capopt.validation.torch_models`), ``grad_accum``
micro-batches of ``micro_batch`` sequences, each a forward pass under autocast (bf16-mixed and
fp16-mixed: float32 parameters are the master weights; bf16: bfloat16 parameters and state;
fp32: none), a float32 cross-entropy and ``loss.backward()`` accumulating into ``.grad``;
then ``clip_grad_norm_`` when the workload clips, ``optimizer.step()`` and
``zero_grad(set_to_none=True)``. The optimizer is torch's (AdamW, Adam, SGD with or without
momentum) on its multi-tensor (``foreach``) path, which is PyTorch's default for CUDA
tensors, or Adam's fused kernel where the runtime's profile prices one (torchtune). Its
state is created by a first update before the metered step, so the step is a steady-state
one.

Everything runs under `FakeTensorMode` on CPU tensors: shapes, dtypes and the autograd graph
are real, no memory is allocated, and an 8B-parameter model fits this machine. What the step
measures is the live tensor bytes of `capopt.validation.torch_memory.LiveBytes`, not the
caching allocator's reserved memory.

Limits (what a GPU would do differently): CPU's autocast op lists; SDPA's CPU flash kernel
(the same saved tensors as CUDA's flash attention: output and log-sum-exp); no CUDA context,
cuBLAS or NCCL workspaces; pipeline parallelism is not run here.

Data parallelism (``dp > 1``) is FSDP2 (``fully_shard``, each block and the root a group)
over PyTorch's fake process group: this process is rank 0 of ``dp``, the collectives return
buffers of the right shape, and the meter sees rank 0's shards, its all-gather and
reduce-scatter buffers and the unsharded parameters FSDP2 resizes in place. ZeRO-3 reshards
after the forward pass, ZeRO-2 does not (nor, under torchtune's rules, does the root group);
ZeRO-1 and plain DDP are not run.

Tensor parallelism (``tp > 1``) is DTensor's Megatron-LM layout over the same fake group
(`capopt.validation.torch_tp`): rank 0's shards of every split matrix, replicated DTensors
for the rest, logits split over the vocabulary through ``loss_parallel``'s cross-entropy
where the head is; the meter counts what DTensor's handlers allocate on the local shards.
With ``dp > 1`` too, FSDP2 then shards over the data-parallel dimension of a dp x tp mesh,
as torchtitan's 2-D parallelism does; with ``sequence_parallel``, torchtitan's plan with
sequence parallelism (the residual stream split over the sequence).
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from typing import Any

from .._specs import Config, Scenario, lora_adapters_bf16

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
LEARNING_RATE = 1e-4
CLIP_NORM = 1.0


def _unsupported(msg: str):
    from .step import Unsupported
    return Unsupported(msg)


def check_supported(scenario: Scenario, config: Config) -> None:
    """Raise `Unsupported` for what the torch tier does not run."""
    w = scenario.workload
    if w.activation_offload and config.tp > 1:
        raise _unsupported("the torch tier offloads activations without tensor parallelism")
    if w.loss in ("fused-linear", "chunked") and config.tp > 1:
        raise _unsupported(f"the {w.loss} loss runs on the whole head: tp = 1")
    if w.loss == "fused" and config.tp > 1:
        raise _unsupported("the torch tier's fused cross-entropy runs on whole (not "
                           "vocabulary-parallel) logits: tp = 1")
    if w.paged_optimizer:
        raise _unsupported("the torch tier runs torch's optimizers: bitsandbytes' paged state "
                           "(CUDA managed memory) is not on fake tensors")
    if w.compile:
        raise _unsupported("the torch tier runs the step eagerly: a compiled step keeps what "
                           "TorchInductor's partitioner saves, which it does not replay")
    if w.precision not in PRECISIONS:
        raise _unsupported(f"the torch tier runs precisions {', '.join(PRECISIONS)}, "
                           f"not {w.precision!r}")
    if w.optimizer not in OPTIMIZERS:
        raise _unsupported(f"the torch tier runs optimizers {', '.join(OPTIMIZERS)}, "
                           f"not {w.optimizer!r}")
    if w.lora is not None and w.lora.base_bits == 8:
        raise _unsupported("the torch tier runs LoRA on a 16-bit or an NF4 (QLoRA) base, not "
                           "an 8-bit one")
    if w.lora is not None and config.dp > 1:
        raise _unsupported("the torch tier runs LoRA and QLoRA on one device (FSDP2 shards "
                           "one dtype per group; a frozen base and float32 adapters are two)")
    if config.offload_params:
        raise _unsupported("the torch tier runs on fake CPU tensors: it has no host memory "
                           "apart from the device's to offload parameters to")
    if config.pp > 1 or config.ep > 1 or config.cp > 1 or config.offload_optimizer:
        raise _unsupported("the torch tier runs data and tensor parallelism (pp = ep = cp = "
                           "1, no offload)")
    if config.tp > 1 and w.lora is not None:
        raise _unsupported("the torch tier runs tensor parallelism without LoRA")
    if config.sequence_parallel and scenario.model.position_embedding == "learned":
        raise _unsupported("the torch tier runs sequence parallelism on cards without "
                           "learned positions (rotary)")
    if config.dp > 1 and config.zero_stage not in (2, 3):
        raise _unsupported("the torch tier runs data parallelism as FSDP2 over a fake "
                           "process group: ZeRO-2 (reshard_after_forward=False) or ZeRO-3")
    if config.dp == 1 and config.zero_stage:
        raise _unsupported("ZeRO needs dp > 1")
    from .torch_models import check_spec
    check_spec(scenario.model)


def fused_cross_entropy(logits, labels):
    """Mean cross-entropy of ``logits`` (rows x vocabulary, the compute dtype) as one fused
    kernel holds it (``loss = "fused"``: torch.compile's loss): the forward pass keeps the
    logits and a float32 log-sum-exp per row, the backward pass writes the gradient in the
    logits' dtype. A kernel works row by row in registers; here rows go in chunks of at most
    2^18 elements of float32, whose transient buffers are what such a kernel never holds
    (2 MiB at most: about 1% of the peaks the tests compare)."""
    import torch

    class FusedCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            rows, vocab = x.shape
            step = max(1, 2 ** 18 // vocab)
            lse = torch.empty(rows, dtype=torch.float32, device=x.device)
            picked = torch.empty(rows, dtype=torch.float32, device=x.device)
            for i in range(0, rows, step):
                chunk = x[i:i + step].float()
                lse[i:i + step] = torch.logsumexp(chunk, dim=-1)
                picked[i:i + step] = chunk.gather(1, y[i:i + step, None])[:, 0]
                del chunk
            ctx.save_for_backward(x, y, lse)
            return (lse - picked).mean()

        @staticmethod
        def backward(ctx, g):
            x, y, lse = ctx.saved_tensors
            rows, vocab = x.shape
            step = max(1, 2 ** 18 // vocab)
            grad = torch.empty_like(x)
            for i in range(0, rows, step):
                p = (x[i:i + step].float() - lse[i:i + step, None]).exp()
                p.scatter_add_(1, y[i:i + step, None],
                               torch.full((p.shape[0], 1), -1.0, dtype=p.dtype,
                                          device=p.device))
                grad[i:i + step] = (p * (g / rows)).to(x.dtype)
                del p
            return grad, None

    return FusedCE.apply(logits, labels)


def fused_linear_cross_entropy(x, weight, bias, labels):
    """Mean cross-entropy of the head ``x @ weight.T + bias`` against ``labels`` as Liger's
    fused linear cross-entropy computes it (``loss = "fused-linear"``;
    liger_kernel/ops/fused_linear_cross_entropy.py at ead96b6): the tokens go in chunks of
    `capopt.cost.flops.fused_linear_chunk` rows; each chunk's logits (the compute dtype)
    are overwritten by their gradient, which is multiplied into the head's input gradient
    (allocated whole, ``zeros_like(x)``) and accumulated into its weight gradient
    (``zeros_like(weight)``, an addmm into it in float32 without a copy); the forward pass
    computes both and saves them, the backward pass scales them by the incoming gradient in
    place. The softmax over a chunk's rows runs in slices of at most 2^18 float32 elements
    (transients a kernel keeps in registers: 1 MiB at most)."""
    import math

    import torch

    class FusedLinearCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, y):
            rows, h = x.shape
            vocab = w.shape[0]
            parts = -(-vocab // h)
            chunk = min(rows, 2 ** math.ceil(math.log2(max(1, -(-rows // parts)))))
            grad_x = torch.zeros_like(x)
            grad_w = torch.zeros_like(w) if w.requires_grad else None
            grad_b = torch.zeros_like(b) if (b is not None and b.requires_grad) else None
            loss = torch.zeros(rows, dtype=torch.float32, device=x.device)
            step = max(1, 2 ** 18 // vocab)
            for i in range(0, rows, chunk):
                xc = x[i:i + chunk]
                logits = xc @ w.t()
                if b is not None:
                    logits = logits + b
                for r in range(0, logits.shape[0], step):
                    t = logits[r:r + step].float()
                    yr = y[i + r:i + r + t.shape[0], None]
                    lse = torch.logsumexp(t, dim=-1, keepdim=True)
                    loss[i + r:i + r + t.shape[0]] = (lse - t.gather(1, yr))[:, 0]
                    t.sub_(lse).exp_()
                    t.scatter_add_(1, yr, torch.full(yr.shape, -1.0, dtype=t.dtype,
                                                     device=t.device))
                    logits[r:r + step] = t.div_(rows)
                    del t, lse
                grad_x[i:i + chunk] = logits @ w
                with torch.autocast(x.device.type, enabled=False):
                    if grad_w is not None:
                        xl = xc.to(logits.dtype)
                        torch.addmm(grad_w, logits.t(), xl, out_dtype=grad_w.dtype,
                                    out=grad_w)
                        del xl
                    if grad_b is not None:
                        grad_b.add_(logits.sum(0))
                del logits, xc
            ctx.save_for_backward(grad_x, grad_w, grad_b)
            return loss.sum() / rows

        @staticmethod
        def backward(ctx, g):
            grad_x, grad_w, grad_b = ctx.saved_tensors
            for t in (grad_x, grad_w, grad_b):
                if t is not None:
                    t.mul_(g)
            return grad_x, grad_w, grad_b, None

    return FusedLinearCE.apply(x, weight, bias, labels)


def causal_lm_loss(x, weight, bias, labels, context=None):
    """The float32 loss as a Hugging Face causal LM computes it inside its forward pass given
    labels (``loss_in_forward``; transformers 5.25 LlamaForCausalLM.forward and
    loss/loss_utils.py ForCausalLMLoss): the head's logits, their float32 upcast, the mean
    cross-entropy; returned with the logits, the model's output beside its loss (the shifted
    labels, int64, left out: the tier's are random). ``context``: activation offloading's
    no-op context for the head (TRL's)."""
    import torch.nn.functional as F
    with context() if context is not None else contextlib.nullcontext():
        logits = F.linear(x, weight, bias)
    return F.cross_entropy(logits.float(), labels), logits


def chunked_linear_cross_entropy(x, weight, bias, labels):
    """Mean cross-entropy of the head ``x @ weight.T + bias`` as torchtune's
    LinearCrossEntropyLoss computes it eagerly (``loss = "chunked"``; torchtune bd2a0fc
    modules/loss/cross_entropy_loss.py, mask_ignored_tokens on): the rows of tokens that are
    not ignored selected (an index_select copy of ``x``), split into `CHUNKED_LOSS_CHUNKS`
    slices, and each slice's logits upcast to float32 for F.cross_entropy, summed; autograd
    keeps what those ops save (every slice's log_softmax output)."""
    import torch
    import torch.nn.functional as F

    from .._specs import CHUNKED_LOSS_CHUNKS
    # (torch.where(labels != -100)[0]: the tier's labels are drawn from the vocabulary, none
    # ignored, so every row; the fake tensors cannot run nonzero's data-dependent shape)
    keep = torch.arange(labels.shape[0], device=labels.device)
    x, labels = x.index_select(0, keep), labels.index_select(0, keep)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for xc, yc in zip(x.tensor_split(CHUNKED_LOSS_CHUNKS, dim=0),
                      labels.tensor_split(CHUNKED_LOSS_CHUNKS, dim=0)):
        logits = F.linear(xc, weight, bias)
        total = total + F.cross_entropy(logits.float(), yc, reduction="sum")
        del logits
    return total / keep.numel()


class OffloadActivations:
    """Activation offloading as TRL's and torchtune's ``OffloadActivations`` run it (torchtune
    bd2a0fc training/_activation_offloading.py, ported as trl/models/activation_offloading.py
    in TRL 1.16; ``training.activation_offload``), on the meter's terms: a saved-tensor hook
    that copies every saved tensor of ``min_bytes`` or more that is not a parameter to host
    memory (made while the meter is paused: pinned host memory, not the device's) and keeps
    the device tensor only while fewer than ``stash`` later tensors have been packed (its
    forward stash); in the backward pass a tensor still in the stash is used as it is, the
    rest are brought back as new device tensors, each kept until the backward node after the
    one that unpacked it has run (its bwd_tensor_stash); the forward stash is emptied once the
    backward pass's first node has run. `head` is the no-op context the output head's matmul
    runs under."""

    def __init__(self, meter, params, *, min_bytes: int = 1024, stash: int = 5):
        import torch

        from .torch_memory import local_shard
        self.meter, self.min_bytes, self.stash_size = meter, min_bytes, stash
        self.param_storages = {id(local_shard(p).untyped_storage()) for p in params}
        self.count = 0
        self.stash: dict[int, Any] = {}
        self.node = None
        self.current: list = []
        self.previous: list = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def head(self):
        import torch
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def _pack(self, t):
        import torch

        from .torch_memory import local_shard
        self.count += 1
        nbytes = t.element_size() * t.nelement()
        if (isinstance(t, torch.nn.Parameter) or nbytes < self.min_bytes
                or id(local_shard(t).untyped_storage()) in self.param_storages):
            return ("kept", t)
        for old in [k for k in self.stash if k <= self.count - self.stash_size]:
            del self.stash[old]
        was, self.meter.paused = self.meter.paused, True
        try:
            host = torch.empty_like(t)
        finally:
            self.meter.paused = was
        self.stash[self.count] = t
        return ("host", self.count, host)

    def _unpack(self, packed):
        import torch
        if packed[0] == "kept":
            return packed[1]
        _, tid, host = packed
        node = torch._C._current_autograd_node()
        if node is not self.node:
            if self.node is not None:     # (the first node has run: the stash is emptied)
                self.stash.clear()
            self.node = node
            self.previous, self.current = self.current, []
        if tid in self.stash:
            return self.stash.pop(tid)
        t = host.clone()
        self.current.append(t)
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.stash.clear()
        self.node, self.current, self.previous = None, [], []
        return self.hooks.__exit__(*exc)


def fsdp_mixed_precision(scenario: Scenario, config: Config) -> bool:
    """Whether the tier runs this step under FSDP's mixed precision in place of autocast: a
    runtime that mixes precision so (``fsdp_mixed_precision``), ZeRO-2/3 over more than one
    rank, a mixed precision (`_dtypes` has an autocast dtype)."""
    return (scenario.runtime.coeff("fsdp_mixed_precision") >= 0.5 and config.dp > 1
            and config.zero_stage in (2, 3) and scenario.workload.precision.endswith("-mixed"))


def _dtypes(precision: str):
    import torch
    return {"fp32": (torch.float32, None), "bf16-mixed": (torch.float32, torch.bfloat16),
            "fp16-mixed": (torch.float32, torch.float16),
            "bf16": (torch.bfloat16, None)}[precision]


def _optimizer(name: str, params, fused: bool = False):
    """torch's optimizer on its foreach path, or Adam's and AdamW's fused kernel (``fused``:
    a runtime whose profile has no update temporaries, ``adam_update_copies`` = 0, as
    torchtune's configs name ``fused: True``)."""
    import torch
    path = {"fused": True} if fused else {"foreach": True}
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATE, **path)
    if name == "adam":
        return torch.optim.Adam(params, lr=LEARNING_RATE, **path)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE, foreach=True)
    return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9, foreach=True)


def _state_tensors(opt):
    import torch
    for one in getattr(opt, "optimizers", [opt]):
        for st in one.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    yield v


class _InBackward:
    """One optimizer a parameter, stepped from the parameter's post-accumulate-grad hook and
    its gradient set to None there (torchtitan's OptimizersInBackwardContainer at v0.2.2:
    ``training.optimizer_in_backward``); `step` and `zero_grad` after the backward pass do
    nothing."""

    def __init__(self, name: str, params, fused: bool = False):
        self.optimizers = [_optimizer(name, [p], fused) for p in params]
        self._by_param = {id(p): o for p, o in zip(params, self.optimizers)}
        self._params = list(params)
        self._hooks = []

    def _hook(self, p) -> None:
        opt = self._by_param[id(p)]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def first_step(self) -> None:
        """Create every state (a first update with zero gradients), then arm the hooks."""
        import torch
        for p, opt in zip(self._params, self.optimizers):
            p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self._params]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _fake_mesh(dp: int, tp: int, replicate: int = 1):
    """A ``(dp, tp)`` device mesh of CPU ranks (dimensions "dp" and "tp") over PyTorch's fake
    process group (this process is rank 0; collectives return tensors of the right shape
    and move nothing); with hybrid sharding (``replicate`` > 1) dp is two dimensions,
    "replicate" and "shard", and "dp" names the pair (what `fully_shard` takes for HSDP).
    Built outside `FakeTensorMode`: the mesh reads its rank table."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    world = dp * tp
    if dist.is_initialized() and (dist.get_world_size() != world
                                  or dist.get_backend() != "fake"):
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if replicate == 1:
        return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    mesh = init_device_mesh("cpu", (replicate, dp // replicate, tp),
                            mesh_dim_names=("replicate", "shard", "tp"))
    return {"dp": mesh["replicate", "shard"], "tp": mesh["tp"]}


class _TrackResize:
    """Route ``UntypedStorage.resize_`` (FSDP2's free and refill of unsharded parameters) to
    the meter while the step runs."""

    def __init__(self, meter):
        self.meter = meter

    def __enter__(self):
        import torch
        self.orig = orig = torch.UntypedStorage.resize_
        meter = self.meter

        def resize_(storage, nbytes):
            out = orig(storage, nbytes)
            meter.resized(storage, int(nbytes))
            return out
        torch.UntypedStorage.resize_ = resize_
        return self

    def __exit__(self, *exc):
        import torch
        torch.UntypedStorage.resize_ = self.orig
        return False


class _RealMeshes:
    """FSDP2 over tensor-parallel parameters joins the dp and tp meshes into one
    (`DeviceMesh._concatenate`), reading the real rank table: outside the fake mode."""

    def __enter__(self):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import DeviceMesh
        self.orig = orig = DeviceMesh._concatenate

        def concatenate(meshes):
            with unset_fake_temporarily():
                return orig(meshes)
        DeviceMesh._concatenate = staticmethod(concatenate)
        return self

    def __exit__(self, *exc):
        from torch.distributed.device_mesh import DeviceMesh
        DeviceMesh._concatenate = staticmethod(self.orig)
        return False


def _loss_context(model):
    if model.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()
    return contextlib.nullcontext()


def run_torch(scenario: Scenario, config: Config, *, explain: bool = False) -> dict[str, Any]:
    """Measure one steady-state step: ``{"measured": {...}, "details": {...}}``; with
    ``explain``, ``details["live_at_peak"]`` lists what was live at the peak (category, op,
    dtype, shape, bytes), largest first."""
    check_supported(scenario, config)
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .step import remat_plan
    from .torch_memory import LiveBytes, ShapesOnly, local_shard
    from .torch_models import build_torch_model, count_params

    spec, w = scenario.model, scenario.workload
    param_dtype, autocast = _dtypes(w.precision)
    plan = remat_plan(config, spec.num_hidden_layers)
    # a runtime whose selective policy is torchtitan's per-op one runs it
    if scenario.runtime.coeff("selective_saves_ops") >= 0.5:
        plan = tuple("selective-op" if m == "selective" else m for m in plan)
    # FSDP's mixed precision in place of autocast under ZeRO-2/3 where the runtime says so
    # (``fsdp_mixed_precision``, as the cost model's runtime_numbers applies it): torchtitan's
    # step exactly; Composer's (llm-foundry) and Accelerate's (hf) also keep autocast on, whose
    # casts of the bf16 gathered weights are no-ops, so the tier runs the same step for them
    # (Accelerate's float32 copy of the returned logits kept, below)
    fsdp_mp = fsdp_mixed_precision(scenario, config)
    t0 = time.perf_counter()
    mesh = (_fake_mesh(config.dp, config.tp, config.dp_replicate) if config.dp * config.tp > 1
            else None)
    with FakeTensorMode(allow_non_fake_inputs=False):
        # LoRA: the model in its compute dtype, frozen; the adapters in param_dtype
        model = build_torch_model(spec, flash=config.flash_attention, checkpoint=plan,
                                  param_dtype=param_dtype, lora=w.lora,
                                  frozen_dtype=autocast or param_dtype,
                                  # (bfloat16 on a quantised base where the runtime
                                  # keeps them so: `capopt._specs.lora_adapters_bf16`)
                                  adapter_dtype=(torch.bfloat16 if lora_adapters_bf16(scenario)
                                                 else param_dtype),
                                  peft_cast=scenario.runtime.coeff("lora_input_cast") >= 0.5)
        model.train()
        if w.loss == "fused-linear":
            model.head_loss = fused_linear_cross_entropy
        elif w.loss == "chunked":
            model.head_loss = chunked_linear_cross_entropy
        if config.tp > 1:
            from .torch_tp import parallelize
            parallelize(model, spec, mesh["tp"], sequence_parallel=config.sequence_parallel)
        if config.dp > 1:
            # FSDP2, torchtitan's wrapping: each block its own group, the root (embeddings,
            # final norm, head) another; ZeRO-3 frees a block's unsharded parameters after
            # its forward pass, ZeRO-2 keeps them to its backward pass (with tp: over the
            # data-parallel dimension, after tensor parallelism, as torchtitan's 2-D; hybrid
            # sharding: over a (replicate, shard) mesh, FSDP2's HSDP)
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            reshard = config.zero_stage == 3
            kw = {}
            if fsdp_mp:
                # a runtime that mixes precision by FSDP2's parameter dtype (torchtitan's
                # apply_fsdp): bf16 gathers and compute, float32 reductions, no autocast;
                # reductions in the compute dtype where the runtime's are (Accelerate's
                # MixedPrecision, ``fsdp_reduce_compute_dtype``)
                reduce = (autocast if scenario.runtime.coeff("fsdp_reduce_compute_dtype") >= 0.5
                          else torch.float32)
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=autocast, reduce_dtype=reduce)
            # (the root keeps its parameters gathered after the forward pass where the
            # runtime's root group is not gathered again, ``zero3_root_regather`` = 0:
            # torchtune's shard_model passes reshard_after_forward=False to the root)
            root_reshard = reshard and scenario.runtime.coeff("zero3_root_regather") >= 0.5
            with _RealMeshes():
                for blk in model.blocks:
                    fully_shard(blk, mesh=mesh["dp"], reshard_after_forward=reshard, **kw)
                fully_shard(model, mesh=mesh["dp"], reshard_after_forward=root_reshard, **kw)
        params = [p for p in model.parameters() if p.requires_grad]
        in_bwd = w.optimizer_in_backward
        fused = scenario.runtime.coeff("adam_update_copies") < 0.5
        opt = (_InBackward(w.optimizer, params, fused) if in_bwd
               else _optimizer(w.optimizer, params, fused))
        # fp16-mixed: dynamic loss scaling as torch.amp.GradScaler does it (the loss times the
        # scale, then _amp_foreach_non_finite_check_and_unscale_ on every gradient), with the
        # step taken unconditionally: GradScaler's skip reads found_inf on the host, which
        # fake tensors cannot answer, and a skipped step allocates nothing more
        scale = torch.full((), 2.0 ** 16) if w.precision == "fp16-mixed" else None
        # a first update creates the optimizer state: the metered step is a steady one
        if in_bwd:
            opt.first_step()
        else:
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        b, s = config.micro_batch, scenario.seq_len
        meter = LiveBytes()
        meter.explain = explain
        with meter, _TrackResize(meter), ShapesOnly(meter):
            # (the meter counts a DTensor by its local shard)
            meter.register(list(model.parameters()) + list(model.buffers()), "params")
            meter.register(list(_state_tensors(opt)), "optimizer")
            if scale is not None:
                meter.register([scale], "optimizer")
            meter.reset_peak()
            # (a block whose input needs no gradient, LoRA's first, still fires its hook;
            # torch warns that it does)
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            offload = (OffloadActivations(meter, model.parameters()) if w.activation_offload
                       else None)
            if offload is not None:
                model.head_context = offload.head
            # (a runtime whose models compute the float32 loss inside their forward pass,
            # ``loss_in_forward``: Hugging Face's, under Accelerate's autocast region; on the
            # whole head, as a Trainer runs it: tp 1)
            if (scenario.runtime.coeff("loss_in_forward") >= 0.5 and w.loss == "float32"
                    and config.tp == 1):
                model.head_loss = functools.partial(causal_lm_loss,
                                                    context=model.head_context)
            hooks = [blk.register_full_backward_pre_hook(
                lambda mod, g, i=i: meter.set_phase(f"backward:block{i}"))
                for i, blk in enumerate(model.blocks)]
            for _ in range(config.grad_accum):
                meter.set_phase("data")          # one micro-batch at a time, as a loader
                ids = torch.randint(0, spec.vocab_size, (b, s))
                labels = torch.randint(0, spec.vocab_size, (b, s))
                meter.mark([ids, labels], "inputs")
                # (activation offloading: over the forward pass, the loss and the backward pass,
                # as TRL's SFTTrainer.training_step opens it)
                with offload if offload is not None else contextlib.nullcontext():
                    meter.set_phase("forward")
                    ctx = (torch.autocast("cpu", dtype=autocast)
                           if autocast is not None and not fsdp_mp else contextlib.nullcontext())
                    if model.head_loss is not None:
                        # (the loss inside the model's forward pass, as the Trainer's Liger
                        # patch runs it: under FSDP the root's parameters are still gathered;
                        # torchtune's chunked loss takes the model's head too, after a
                        # forward pass that skips it)
                        with ctx:
                            loss = model(ids, labels)
                        if isinstance(loss, tuple):
                            # (the model's output, loss and logits: Accelerate's
                            # convert_outputs_to_fp32 returns 16-bit logits as a float32
                            # copy once the autocast region is left, held until
                            # Trainer.compute_loss returns, before the backward pass; under
                            # FSDP's mixed precision too, Accelerate's autocast wrapper stays)
                            loss, logits = loss
                            if autocast is not None:
                                logits = logits.float()
                            del logits
                        loss = loss / config.grad_accum
                        meter.set_phase("backward")
                        (loss * scale if scale is not None else loss).backward()
                        del loss
                        continue
                    with ctx:
                        logits = model(ids)
                    meter.set_phase("loss")
                    # (tensor parallelism: logits sharded over the vocabulary go through
                    # loss_parallel's cross-entropy, its backward too; replicated ones are
                    # local)
                    with _loss_context(model):
                        if not model.loss_parallel and hasattr(logits, "to_local"):
                            logits = logits.to_local()
                        if w.loss == "fused":
                            loss = fused_cross_entropy(logits.view(-1, logits.shape[-1]),
                                                       labels.view(-1)) / config.grad_accum
                        else:
                            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                                   labels.view(-1)) / config.grad_accum
                        del logits
                        meter.set_phase("backward")
                        (loss * scale if scale is not None else loss).backward()
                        # (the batch stays referenced, as a loader's loop keeps it)
                        del loss
            meter.set_phase("update")
            grads = [p.grad for p in params if p.grad is not None]
            meter.mark(grads, "grads")
            del grads
            if scale is not None:
                found_inf = torch.zeros(())
                torch._amp_foreach_non_finite_check_and_unscale_(
                    [local_shard(p.grad) for p in params if p.grad is not None], found_inf,
                    scale.reciprocal())
                del found_inf
            if w.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, CLIP_NORM, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            meter.set_phase("done")
            for hk in hooks:
                hk.remove()
            if in_bwd:
                opt.remove()
        n_params = count_params(model)
    by_cat = meter.breakdown()
    measured = {"peak_bytes": int(meter.peak), "params_bytes": by_cat["params"],
                "optimizer_bytes": by_cat["optimizer"], "grads_bytes": by_cat["grads"],
                "rest_bytes": (by_cat["weight_casts"] + by_cat["activations"]
                               + by_cat["temporaries"] + by_cat["gathered"]),
                "input_bytes": by_cat["inputs"], "weight_casts_bytes": by_cat["weight_casts"],
                "gathered_bytes": by_cat["gathered"],
                "activations_bytes": by_cat["activations"],
                "temporaries_bytes": by_cat["temporaries"]}
    details = {"peak_phase": meter.peak_phase, "phase_peaks": dict(meter.phase_peaks),
               "params": n_params, "param_tensors": len(params), "events": len(meter.events),
               "torch": torch.__version__, "step_s": time.perf_counter() - t0,
               "remat": list(plan), "attention": "sdpa" if config.flash_attention else "math"}
    # the caching allocator's view of the same sequence (`capopt.validation.caching_allocator`)
    from .caching_allocator import replay
    for expandable, tag in ((False, ""), (True, "_expandable")):
        r = replay(meter.events, start=meter.step_start, expandable_segments=expandable)
        measured[f"allocated_blocks{tag}_bytes"] = r["peak_allocated_bytes"]
        measured[f"reserved{tag}_bytes"] = r["reserved_after_pass2"]
        details[f"reserved{tag}_after_first_step_bytes"] = r["reserved_after_pass1"]
    if explain:
        rows = [(meter.category(sid), *meter.origin.get(sid, ("(before the step)", "", ())),
                 nbytes) for sid, nbytes in meter.live_at_peak().items()]
        details["live_at_peak"] = sorted(rows, key=lambda r: -r[-1])
    return {"measured": measured, "details": details}


__all__ = ["OPTIMIZERS", "PRECISIONS", "check_supported", "fsdp_mixed_precision", "run_torch"]
