"""Tensor parallelism for the torch tier's models, as PyTorch's DTensor API applies it.

`parallelize(model, spec, mesh)` applies the Megatron-LM layout that torchtitan's Llama plan
writes with `torch.distributed.tensor.parallel` (torchtitan ``parallelize_llama.apply_tp``):
q, k, v, gate and up ``ColwiseParallel``; the attention's and the MLP's output projections
``RowwiseParallel`` (an all-reduce of their output, or with sequence parallelism a
reduce-scatter to the rank's slice of the sequence, the norms ``SequenceParallel`` on it and
the projections' inputs gathered whole by ``PrepareModuleInput``); the
token embedding ``RowwiseParallel`` over the vocabulary and the head ``ColwiseParallel`` with
its logits left sharded over the vocabulary for ``loss_parallel``'s cross-entropy. Everything
else (norms, learned positions, a head bias) is a replicated DTensor, so that the optimizer,
clipping and autocast see one kind of tensor, as under torchtitan.

Where the cost model's layout (`capopt.cost.memory.tp_replication`, Megatron-LM's) keeps a
tensor whole, so does this: k and v are replicated when ``tp`` exceeds the KV heads (each
rank then reads the KV head its query heads share), and the embedding and head are replicated
when ``tp`` does not divide the vocabulary (Megatron pads it instead; torchtitan's vocabularies
divide).

Run under PyTorch's fake process group (`capopt.validation.torch_step`): the collectives
return tensors of the right shape and move nothing; the meter counts a DTensor by its local
shard. Learned positions are not split over the sequence (the tier refuses them with
sequence parallelism).
"""

from __future__ import annotations

from .._model import ModelSpec


def _replicated_io(mesh, seq_input: bool = False, seq_output: bool = False):
    """``distribute_module`` input / output functions for a module whose parameters are
    replicated DTensors and whose neighbours hand it, and take back, local tensors: whole
    ones, or (sequence parallelism) this rank's slice of the sequence, gathered on the way in
    (``seq_input``) or split on the way out (``seq_output``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def to_replicate(mod, inputs, device_mesh):
        out = []
        for x in inputs:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1) if seq_input else Replicate()],
                                       run_check=False)
            out.append(x.redistribute(device_mesh, [Replicate()]))
        return tuple(out)

    def to_local(mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        if seq_output:
            outputs = outputs.redistribute(device_mesh, [Shard(1)])
        return outputs.to_local()
    return to_replicate, to_local


def replicate(module, mesh, *, seq_input: bool = False, seq_output: bool = False) -> None:
    """``module``'s parameters become replicated DTensors; it takes and returns local tensors
    (see `_replicated_io`)."""
    from torch.distributed.tensor import distribute_module
    to_replicate, to_local = _replicated_io(mesh, seq_input, seq_output)
    distribute_module(module, mesh, input_fn=to_replicate, output_fn=to_local)


def parallelize(model, spec: ModelSpec, mesh, *, sequence_parallel: bool = False) -> None:
    """Shard ``model`` (a `capopt.validation.torch_models` decoder) over the 1-D ``mesh``.

    ``sequence_parallel``: torchtitan's plan with it, as Megatron-LM's: the residual stream
    is each rank's slice of the sequence; the norms run on it (``SequenceParallel``), the
    attention's and the MLP's inputs are gathered whole (``PrepareModuleInput``) and their
    output projections reduce-scatter back to the slice; the head gathers its input."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    tp = mesh.size()
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()        # the residual stream's layout
    kv_split = spec.kv_heads % tp == 0
    vocab_split = spec.vocab_size % tp == 0
    for blk in model.blocks:
        plan = {"attn.q": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=stream),
                "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=stream)}
        if blk.mlp.gate is not None:
            plan["mlp.gate"] = ColwiseParallel()
        if kv_split:
            plan["attn.k"] = ColwiseParallel()
            plan["attn.v"] = ColwiseParallel()
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            plan["attn"] = gather
            plan["mlp"] = gather
            for name in ("norm1", "norm2", "norm3", "norm4"):
                if getattr(blk, name) is not None:
                    plan[name] = SequenceParallel(use_local_output=True)
        parallelize_module(blk, mesh, plan)
        if not kv_split:
            # every rank computes every KV head and reads the one its query heads share
            replicate(blk.attn.k, mesh)
            replicate(blk.attn.v, mesh)
            blk.attn.kv_heads_local = 1
        if not sp:
            for name in ("norm1", "norm2", "norm3", "norm4"):
                if getattr(blk, name) is not None:
                    replicate(getattr(blk, name), mesh)
        for name in ("q_norm", "k_norm"):
            if getattr(blk.attn, name) is not None:
                replicate(getattr(blk.attn, name), mesh)
    if sp:
        parallelize_module(model.final_norm, mesh, SequenceParallel(use_local_output=True))
    else:
        replicate(model.final_norm, mesh)
    if model.pos_embed is not None:
        replicate(model.pos_embed, mesh)
    if vocab_split:
        parallelize_module(model.embed, mesh, RowwiseParallel(input_layouts=Replicate(),
                                                              output_layouts=stream))
        if model.lm_head is not None:
            parallelize_module(model.lm_head, mesh, ColwiseParallel(
                input_layouts=stream, output_layouts=Shard(-1), use_local_output=False))
    else:
        replicate(model.embed, mesh, seq_output=sp)
        if model.lm_head is not None:
            replicate(model.lm_head, mesh, seq_input=sp)
    if model.lm_head_bias is not None:           # a tied head's bias: its logits' layout
        placement = [Shard(0)] if vocab_split else [Replicate()]
        model.lm_head_bias = nn.Parameter(
            distribute_tensor(model.lm_head_bias.data, mesh, placement))

    def head_input(x):
        # a tied head multiplies by the (sharded or replicated) embedding DTensor, on the
        # whole sequence
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [stream], run_check=False)
        return x.redistribute(mesh, [Replicate()])
    model.head_input = head_input
    model.loss_parallel = vocab_split


__all__ = ["parallelize", "replicate"]
