"""Runtime profiles: how a framework lays out memory and how fast its kernels run.

A profile is data (``profiles/<name>.toml``): byte widths per precision, which buffers are live
together, bytes saved per op, logits copies, allocator and context overhead, kernel
efficiencies. The cost model reads only numbers from here; ``calibrate`` rewrites them.
"""

from __future__ import annotations

import functools
import json
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ._errors import CapoptError
from ._io import check_depth, parse_toml, path_exists, read_text

# --------------------------------------------------------------------------------------------
# Optimizer-state and quantised-weight layouts: the cost model (`capopt.cost`) counts these
# bytes and the validation step (`capopt.validation`) allocates them, from the constants below.
# --------------------------------------------------------------------------------------------
ADAM8BIT_BLOCK = 2048          # weights per float32 absmax in blockwise 8-bit Adam (bitsandbytes)
ADAM8BIT_MIN_SIZE = 4096       # smaller tensors keep float32 moments (bitsandbytes min_8bit_size)
ADAM8BIT_ABSMAX_BYTES = 4      # one float32 absmax per block
# a paged optimizer keeps the state of parameters of this many elements or more in CUDA
# managed memory, smaller ones' on the device (bitsandbytes 95f9af3, optim/optimizer.py
# Optimizer8bit.get_state_buffer: ``p.numel() < 1e5``)
PAGED_STATE_MIN_SIZE = 100_000
ADAFACTOR_MIN_DIM = 128        # optax.adafactor's min_dim_size_to_factor (its default)
# the optimizers capopt prices (training.optimizer); a profile may name the ones it runs
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "lion", "adamw-8bit")
INT8_SCALE_BYTES = 4           # 8-bit frozen base: one float32 scale per output column
# QLoRA's NF4 base (Dettmers et al. 2023): two 4-bit codes per byte and one absmax per block
# of NF4_BLOCK weights; with double quantisation (the paper's, ``training.lora.double_quant``)
# each absmax is an 8-bit code under one float32 second-level scale per NF4_BLOCK2 of them,
# without it a float32 (bitsandbytes functional.quantize_4bit, blocksize 64; its
# compress_statistics quantises the absmax with quantize_blockwise in blocks of 256)
NF4_BLOCK = 64
NF4_BLOCK2 = 256
NF4_CODE_BYTES = 0.5           # two 4-bit codes a byte


def nf4_scale_bytes(double_quant: bool) -> tuple[float, float]:
    """The bytes a weight of an NF4 base's block absmax takes (an 8-bit code, or a float32
    without double quantisation) and of the absmax codes' float32 scales (none without)."""
    if double_quant:
        return 1.0 / NF4_BLOCK, 4.0 / (NF4_BLOCK * NF4_BLOCK2)
    return 4.0 / NF4_BLOCK, 0.0


def nf4_bytes_per_weight(double_quant: bool) -> float:
    """Bytes a weight of an NF4 base takes, with or without double quantisation."""
    return NF4_CODE_BYTES + sum(nf4_scale_bytes(double_quant))


NF4_BYTES_PER_WEIGHT = nf4_bytes_per_weight(True)              # 0.51587...
NF4_PLAIN_BYTES_PER_WEIGHT = nf4_bytes_per_weight(False)       # 0.5625


def adam8bit_moment_bytes(size: int) -> int:
    """Bytes of one 8-bit Adam moment of a tensor with ``size`` elements: int8/uint8 codes
    padded to whole blocks plus a float32 absmax per block, or float32 below the threshold."""
    if size < ADAM8BIT_MIN_SIZE:
        return 4 * size
    blocks = -(-size // ADAM8BIT_BLOCK)
    return blocks * (ADAM8BIT_BLOCK + ADAM8BIT_ABSMAX_BYTES)


def adafactor_state_elems(shape: tuple[int, ...]) -> int:
    """Elements optax.adafactor keeps for one parameter (``scale_by_factored_rms``): a tensor
    whose second-largest dimension is >= ``ADAFACTOR_MIN_DIM`` keeps a row and a column
    accumulator (the shape without its largest, and without its second-largest, dimension)
    plus a 1-element placeholder for the full moment; any other tensor a full second moment
    plus two 1-element placeholders (row and column). The shared step counter is not counted."""
    size = 1
    for d in shape:
        size *= d
    if len(shape) >= 2:
        order = sorted(range(len(shape)), key=lambda i: shape[i])
        d1, d0 = order[-2], order[-1]
        if shape[d1] >= ADAFACTOR_MIN_DIM:
            return size // shape[d0] + size // shape[d1] + 1
    return size + 2


# Bytes per element of: working weights, gradients, fp32 master copy, saved activations,
# transient low-precision weight copy, optimizer-state elements; and the dtype matmuls run in.
PRECISION_FIELDS = ("param_bytes", "grad_bytes", "master_bytes", "act_bytes",
                    "weight_copy_bytes", "state_bytes", "matmul_dtype")
# and, optional, the dtype the attention core's two matmuls run in (its default: matmul_dtype):
# fp8 recipes quantise the linear layers and leave attention in 16 bits
OPTIONAL_PRECISION_FIELDS = ("attention_dtype",)


# --------------------------------------------------------------------------------------------
# The profile schema: every coefficient a profile may set, its default and what it means.
# A profile file lists only what differs from the defaults, each with its source; a key not
# listed here, a value that is not a finite number, or a negative one is an error naming the
# file and the key.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Coeff:
    default: float
    doc: str


def _c(default: float, doc: str) -> Coeff:
    return Coeff(float(default), doc)


SCHEMA: dict[str, Coeff] = {
    # --- memory outside the step's buffers ---
    "context_bytes": _c(0, "CUDA context, loaded kernels and runtime, bytes"),
    "workspace_bytes": _c(0, "library scratch (cuBLAS / cuDNN workspaces), bytes"),
    "fragmentation": _c(0, "allocator slack, as a share of the step's dynamic buffers"),
    "expandable_segments": _c(0, "1: the runtime launches PyTorch with "
                                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (its reserved "
                                 "figure is judged against the allocator replayed that way)"),
    "cached_slack": _c(0, "more slack the allocator holds while memory is not short, as a "
                          "share of the dynamic buffers: in its reserved figure, not in the "
                          "peak the budget counts (it gives cached blocks back before "
                          "failing)"),
    "comm_bucket_bytes": _c(0, "data-parallel gradient buckets in flight, bytes"),
    "update_flat_grad_copies": _c(0, "1: the optimizer step copies the device's gradient "
                                     "share into one flat buffer and casts it to float32 for "
                                     "the master weights (DeepSpeed's ZeRO and FP16 "
                                     "optimizers)"),
    "zero_fp32_partition": _c(0, "1: ZeRO-1/2/3 keep a float32 partition of the parameters "
                                 "as master weights even when the parameters are float32 "
                                 "(DeepSpeed's single_partition_of_fp32_groups)"),
    "allreduce_bucket_elements": _c(0, "without ZeRO, the gradients are copied into flat "
                                       "buckets of at most this many elements for their "
                                       "all-reduce at the end of the backward pass (DeepSpeed's "
                                       "allreduce_bucket_size; 0: no copy)"),
    "zero_bucket_elements": _c(0, "a ZeRO gradient bucket of this many elements in the "
                                  "gradient dtype (DeepSpeed's reduce_bucket_size): ZeRO-1/2 "
                                  "allocate it at a backward pass's first gradient, ZeRO-2 "
                                  "frees it at that pass's end, ZeRO-1 at the accumulation "
                                  "boundary's; ZeRO-3 allocates it once and keeps it"),
    "zero1_step_grad_partition": _c(0, "1: by the update ZeRO-1 holds only the device's "
                                       "partition of the gradients (DeepSpeed: reduced into "
                                       "grads_in_partition, every .grad cleared)"),
    "zero3_sub_group_elements": _c(0, "ZeRO-3 steps the optimizer one sub-group of at most "
                                      "this many elements at a time, its gradient copies with "
                                      "it (DeepSpeed's sub_group_size; 0: all at once)"),
    # --- ZeRO-3 / FSDP ---
    "zero3_prefetch_layers": _c(2, "blocks gathered at once: the one in use and the prefetched"),
    "zero3_max_live_params": _c(1e15, "gathered parameters resident at most, elements "
                                      "(DeepSpeed stage3_max_live_parameters)"),
    "zero3_root_group": _c(0, "1: the embeddings, final norm and head are one sharded group, "
                              "gathered from the forward pass to the end of the backward pass "
                              "(ZeRO-3), its unsharded gradient live from the head's backward "
                              "to the end (ZeRO-2/3)"),
    "zero3_root_regather": _c(0, "1: the root group is resharded after the forward pass and "
                                 "gathered again when the backward pass reaches the head "
                                 "(its flat all-gather output beside the parameters copied "
                                 "out of it)"),
    "zero_unsharded_grad_copies": _c(0, "unsharded copies of a block's gradients live while "
                                        "it is differentiated under ZeRO-2/3 (before the "
                                        "reduce-scatter)"),
    "zero_holds_reduce_input": _c(0, "1: a group's flat reduce-scatter input stays live "
                                     "until the next group's reduction starts (through the "
                                     "next block's backward, the last through the "
                                     "embedding's)"),
    "zero_holds_gather_output": _c(0, "1: a forward pass keeps the last group's flat "
                                      "all-gather output to its end (ZeRO-2/3 as FSDP2 runs "
                                      "them)"),
    "zero2_keeps_shards": _c(0, "1: under ZeRO-2 the parameters stay sharded and the "
                                "unsharded copy gathered for the forward pass is kept to the "
                                "backward pass beside them"),
    "dp_bucket_elems": _c(0, "gradient elements per data-parallel bucket, in place of "
                             "dp_bucket_bytes where > 0: the gradient reduction and the "
                             "updated parameters' all-gather then share one bucketing"),
    "dp_bucket_elems_per_rank": _c(0, "bucket elements per data-parallel rank: a bucket is "
                                      "the larger of this x dp and dp_bucket_elems"),
    "overlap_dp_buckets": _c(0, "1: every gradient bucket but the last is reduced during the "
                                "backward pass (in place of overlap_dp)"),
    "overlap_param_gather": _c(0, "1: ZeRO-1/2's all-gather of the updated parameters runs "
                                  "bucket by bucket behind the next forward pass (the first "
                                  "bucket exposed)"),
    "overlap_tp_fwd_needs_sp": _c(0, "1: overlap_tp_fwd applies only under sequence "
                                     "parallelism (the overlap pipelines its all-gathers and "
                                     "reduce-scatters)"),
    "zero3_regather_for_remat": _c(1, "1: under ZeRO-3 a fully recomputed block's parameters "
                                      "are gathered again for its recomputation (DeepSpeed's "
                                      "module hooks); 0: the recomputation runs inside the "
                                      "block's backward, on the backward's gather (FSDP)"),
    "zero2_per_group": _c(0, "1: ZeRO-2 communicates as FSDP's SHARD_GRAD_OP: each group "
                             "all-gathered once per micro-batch for its forward pass and its "
                             "gradients reduce-scattered in its backward pass, overlapped as "
                             "ZeRO-3's; 0: DeepSpeed stage 2 (bucketed reduce-scatter, the "
                             "updated parameters all-gathered after the step)"),
    "zero_pp_nosync": _c(0, "1: ZeRO-2/3 with pipeline parallelism as PyTorch's pipeline "
                            "schedules run FSDP: every micro-batch's backward pass skips the "
                            "reduce-scatter and the reshard, so a stage's parameters stay "
                            "gathered (in the all-gather's dtype) and its gradients accumulate "
                            "unsharded (in the gradient dtype) through the step, one all-gather "
                            "and one reduce-scatter a step; 0: ZeRO-2/3 with pp is refused"),
    "uneven_stages": _c(0, "1: pipeline stages may hold different numbers of blocks when pp "
                           "does not divide them (torchtitan's split: the first stage the "
                           "floor, the middle ones one more while the remainder lasts, the last "
                           "what is left); 0: pp must divide num_hidden_layers"),
    "context_parallel": _c(0, "1: context parallelism (cp > 1) as PyTorch's ring attention runs "
                              "it (torch.distributed.tensor.experimental context_parallel, "
                              "torchtitan's context_parallel_degree) or Megatron-Core's "
                              "--context-parallel-size: each rank holds 1/cp of every "
                              "sequence, keys and values are exchanged in the attention, the "
                              "state is sharded over dp x cp; 0: cp > 1 is refused"),
    "pipeline_parallel": _c(1, "1: pipeline parallelism (pp > 1) runs in this runtime; 0: "
                               "it has none, pp is 1"),
    "selective_remat": _c(1, "1: remat = selective (the profile's selective checkpointing "
                             "rules) runs in this runtime; 0: refused, whole blocks only"),
    "tensor_parallel": _c(1, "1: tensor parallelism (tp > 1) runs as priced in this runtime; 0: "
                             "tp is 1"),
    "expert_parallel": _c(1, "1: expert parallelism (ep > 1) runs in this runtime; 0: it "
                             "has none, ep is 1"),
    "torch_compile": _c(1, "1: training.compile runs as priced (the model's element-wise ops "
                           "fused, the loss as the profile prices it); 0: refused"),
    "sharded_data_parallel_only": _c(0, "1: data parallelism over more than one rank is "
                                        "always FSDP's (ZeRO-2 or ZeRO-3): no replicas (DDP), "
                                        "no ZeRO-1; 0: every stage the rules allow"),
    "fsdp_or_replicated_only": _c(0, "1: data parallelism is replicated (ZeRO-0) or fully "
                                     "sharded (ZeRO-3) only: ZeRO-1 and ZeRO-2 are refused; "
                                     "0: every stage the rules allow"),
    "remat_every_block_or_none": _c(0, "1: recomputation is every block or none (remat none "
                                       "or full): selective checkpointing and a fraction of "
                                       "the blocks are refused; 0: any"),
    "deepspeed_paths_priced": _c(1, "1: ZeRO-1 and optimizer offload run as this runtime "
                                    "prices them; 0: they run through DeepSpeed's engine, "
                                    "which --runtime deepspeed prices: refused here"),
    "zero1_sharding": _c(1, "1: ZeRO-1 (the optimizer state sharded over the data-parallel "
                            "ranks, the gradients whole) runs in this runtime; 0: refused"),
    "remat_policy_every_block": _c(0, "1: every block is rematerialised under one policy "
                                      "(remat selective or full): no recomputation (none) "
                                      "and a fraction of the blocks are refused; 0: any"),
    "megatron_sequence_parallel": _c(1, "1: config.sequence_parallel (Megatron's split of "
                                        "the tensor-parallel residual stream) runs in this "
                                        "runtime; 0: refused"),
    "lora_training": _c(1, "1: training.lora (LoRA / QLoRA adapters) runs in this runtime; "
                           "0: refused"),
    "optimizer_offload": _c(1, "1: config.offload_optimizer (the optimizer state and its "
                               "step on the host, parameters and gradients on the device) "
                               "runs in this runtime; 0: refused"),
    "param_offload": _c(0, "1: config.offload_params as FSDP2's CPUOffloadPolicy runs it "
                           "(torch v2.13: the sharded parameters, their gradients and the "
                           "optimizer state in pinned host memory, each shard copied to the "
                           "device before its all-gather, each gradient shard back after its "
                           "reduce-scatter, the optimizer step on the CPU), or DeepSpeed's "
                           "offload_param with offload_optimizer; 0: refused"),
    "optimizer_in_backward": _c(0, "1: training.optimizer_in_backward as torchtitan's "
                                   "early_step_in_backward runs it: one optimizer a "
                                   "parameter, stepped from the parameter's post-accumulate-"
                                   "grad hook (FSDP2: after its group's reduce-scatter), its "
                                   "gradient then freed; 0: refused"),
    "paged_optimizer": _c(0, "1: training.paged_optimizer as bitsandbytes' Paged* "
                             "optimizers run it (the state of every parameter of 1e5 "
                             "elements or more in CUDA managed memory); 0: refused"),
    "activation_offload": _c(0, "1: training.activation_offload as TRL's and torchtune's "
                                "OffloadActivations run it (saved tensors of 1 KiB or more "
                                "copied to pinned host memory in the forward pass, the "
                                "head's excepted, brought back in the backward pass); 0: "
                                "refused"),
    "loss_in_forward": _c(0, "1: the float32 loss runs inside the model's forward pass, "
                             "under its autocast region (Hugging Face models given labels), "
                             "and the logits come out converted to float32 (Accelerate's "
                             "convert_outputs_to_fp32); 0: after it, on the logits"),
    "zero1_single_rank": _c(0, "1: ZeRO-1 runs with a data-parallel group of one rank (the "
                               "shard is the whole state: as stage 0 in memory and time); "
                               "0: ZeRO needs dp > 1"),
    "fused_loss": _c(1, "1: training.loss = fused, one kernel on the compute-dtype logits "
                        "(torch.compile's loss, MPT's flash-attn cross-entropy, Megatron's "
                        "fusion); 0: refused (the runtime's own fused losses hold other "
                        "buffers)"),
    "fused_linear_loss": _c(1, "1: training.loss = fused-linear, Liger's fused linear "
                               "cross-entropy, runs in this runtime; 0: refused"),
    "chunked_loss": _c(0, "1: training.loss = chunked as torchtune's recipes run it "
                          "(LinearCrossEntropyLoss: the head and an upcast cross-entropy on "
                          "8 slices of the tokens, eagerly); 0: refused"),
    "async_tp": _c(0, "1: training.async_tp as torchtitan runs it (enable_async_tensor_"
                      "parallel: TorchInductor's micro-pipeline TP fuses each tensor-parallel "
                      "all-gather with the matmul after it and each reduce-scatter with the "
                      "matmul before it, forward and backward, hidden up to those matmuls' "
                      "time); 0: refused"),
    "hybrid_shard": _c(0, "1: hybrid sharding (dp_replicate > 1) as FSDP2 runs it over a 2-D "
                          "(replicate, shard) mesh (torchtitan's data_parallel_replicate_degree) "
                          "or Megatron-Core's --num-distributed-optimizer-instances: the state "
                          "split over the shard group, each reduce-scatter of gradients "
                          "followed by an in-place all-reduce of the shard across the replicas; "
                          "0: dp_replicate > 1 is refused"),
    "interleaved_pipeline": _c(0, "1: interleaved 1F1B (vpp > 1 virtual stages a pipeline "
                                  "rank, each a chunk of L / (pp x vpp) blocks) as torch's "
                                  "ScheduleInterleaved1F1B or Megatron-Core's "
                                  "--num-virtual-stages-per-pipeline-rank run it; 0: vpp > 1 "
                                  "is refused"),
    "zero3_keeps_stored_gathered": _c(0, "1: a block that is not recomputed keeps its gathered "
                                         "(compute-dtype) weights for its backward pass"),
    # --- which buffers are live together (the phase walk, capopt.cost.memory) ---
    "grads_fused": _c(0, "1: each update is applied as its gradient is produced, unless "
                         "clipping or accumulation needs every gradient"),
    "accum_buffer": _c(1, "gradient accumulation keeps one accumulator of every gradient"),
    "grads_compute_dtype": _c(0, "1: a weight's gradient is held as its weight-gradient "
                                 "matmul wrote it, in the compute dtype, and reduced over "
                                 "the data-parallel group in it; the cast to the "
                                 "parameter's dtype is fused into what reads it (clipping's "
                                 "norm, the update, the accumulator's add)"),
    "scan_grad_stacks": _c(0, "blocks' gradients held as whole stacks through the blocks' "
                              "backward pass (a scan over the layers carries every block's "
                              "gradient): that many stacks at least, beside the accumulator "
                              "and the block's own; 0: the phase walk's block by block"),
    "scan_grad_zero3_copies": _c(0, "more stacks of the blocks' gradients under ZeRO-3 "
                                    "(a layer's shard written in the stack's other layout)"),
    "zero3_loop_layout_copies": _c(0, "1: under ZeRO-3 and gradient accumulation, every "
                                      "weight shard split on its minor dimension has a "
                                      "transposed copy live through the micro-batch loop"),
    "embed_grad_early": _c(0, "1: the embedding gradient's dense buffer is created before the "
                              "backward pass and live through it"),
    "embed_grad_last": _c(0, "1: the embedding's dense gradient is written after every "
                             "block's, beside every kept gradient; a tied table's head gradient "
                             "waits to be summed with it, and an accumulated one is added to "
                             ".grad after"),
    "embed_grad_whole_tp": _c(0, "1: a table split over the vocabulary by tensor parallelism "
                                 "gets a gradient of the whole table (reduced only by the "
                                 "optimizer's step)"),
    "tied_head_grad_own": _c(0, "1: a tied head's weight gradient is a [V, h] buffer of its "
                                "own from the loss's backward (the head dot's output), summed "
                                "into the table's gradient at the embedding's backward"),
    "head_grad_at_loss": _c(1, "1: the head's weight gradient is live at the loss's backward "
                               "peak; 0: it is computed after the loss's backward has run"),
    "sp_gathered_inputs_saved": _c(0, "1: under sequence parallelism the projections save "
                                      "their gathered, whole-sequence inputs (not the "
                                      "device's slice)"),
    "kv_replicated_one_head": _c(0, "1: where k and v are replicated over tensor "
                                    "parallelism (tp exceeds the KV heads) a rank keeps the "
                                    "one KV head its query heads share; 0: every KV head"),
    "rebuild_fraction": _c(1, "share of a recomputed block's activations live while it is "
                              "rebuilt"),
    "selective_saves_dots": _c(0, "selective recomputation: 0 Korthikanti et al. (all but the "
                                  "attention core), 1 dots_with_no_batch_dims_saveable"),
    "fsdp_gathers_compute_dtype": _c(0, "1: ZeRO-2/3 (FSDP) gathers the parameters in the "
                                        "compute dtype (FSDP2 MixedPrecisionPolicy "
                                        "param_dtype), 0: in the parameters' own"),
    "fsdp_reduce_compute_dtype": _c(0, "1: under FSDP's mixed precision the gradients are "
                                       "reduce-scattered in the compute dtype (FSDP "
                                       "reduce_dtype = param_dtype); 0: in float32"),
    "fsdp_mixed_precision": _c(0, "1: under ZeRO-2/3 the runtime mixes precision by FSDP's "
                                  "parameter dtype, not autocast (no casts, a compute-dtype "
                                  "stream); below, by autocast as the profile says"),
    "selective_saves_ops": _c(0, "selective recomputation: 1 torchtitan's per-op policy "
                                 "(the block input, every other aten.mm output, the flash "
                                 "kernel's; at most 1 - selective_saves_dots)"),
    "selective_saves_down": _c(0, "1: selective recomputation also keeps the MLP's down "
                                  "projection output (a policy that saves every matmul)"),
    "expert_dots_batched": _c(0, "1: an MoE's routed experts run as one matmul batched over "
                                 "the experts (a dot_general with a batch dimension), which "
                                 "a selective policy saving only dots without batch "
                                 "dimensions does not keep"),
    "selective_saves_adapters": _c(0, "1: selective recomputation also keeps both matmul "
                                      "outputs of every LoRA adapter (x A and x A B)"),
    "gqa_expanded_saved": _c(0, "1: materialised attention expands grouped k and v heads to the "
                             "query heads before its matmuls and keeps the expanded copies"),
    "frozen_inputs_dropped": _c(0, "1: a frozen matmul keeps no input for the backward pass "
                                   "(no weight gradient to compute): under LoRA, the MLP's "
                                   "input and down projection's input when the MLP is not "
                                   "wrapped"),
    # --- one block's saved activations (capopt.cost.activations) ---
    "resid_saved": _c(4, "h-wide residual-stream tensors saved per block"),
    "norm_stats": _c(0, "float32 statistics saved per norm and token"),
    "layernorm_mean_saved": _c(0, "1: a LayerNorm also saves its float32 mean per token"),
    "autocast_casts": _c(0, "1: mixed precision by autocast: the residual stream and the norms "
                            "keep the parameter dtype, and every matmul saves its own "
                            "compute-dtype cast of its input"),
    "mlp_gelu_saved": _c(2, "f-wide tensors a GELU MLP saves"),
    "mlp_gelu_lowp_saved": _c(0, "extra f-wide tensors a GELU MLP saves in 16-bit"),
    "mlp_gated_saved": _c(4, "f-wide tensors a gated MLP saves"),
    "score_copies": _c(1, "score-sized tensors saved per materialised attention, compute dtype"),
    "score_cast_lowp_only": _c(0, "1: the compute-dtype score copies exist only in 16-bit (a "
                                  "cast to float32 of a float32 tensor is the tensor itself)"),
    "score_fp32_copies": _c(0, "score-sized tensors saved per materialised attention, float32"),
    "softmax_stats": _c(0, "float32 softmax statistics saved per head and token (materialised)"),
    "attn_dropout_out_saved": _c(1, "attention dropout's output kept for the backward pass"),
    "attn_dropout_replaces_probs": _c(0, "1: under attention dropout the probabilities' "
                                         "compute-dtype copy is not saved (dropout keeps its "
                                         "mask; its output feeds the matmul)"),
    "attn_lse_bytes": _c(4, "blockwise attention: bytes of softmax statistics per head and token"),
    "flash_out_copy": _c(0, "1: with rotary embeddings applied to heads-first q and k, a "
                            "flash kernel's output is kept for its backward beside the "
                            "sequence-first copy the output projection reads (both o wide)"),
    "flash_bwd_outputs": _c(0, "1: a flash kernel's backward holds dq, dk and dv (q, k and v "
                               "wide, compute dtype) at the attention core's point of a "
                               "block's backward"),
    "attn_chunk_queries": _c(0, "queries per block of the runtime's blockwise attention (0: a "
                                "fused kernel that tiles any sequence)"),
    "score_grad_copies": _c(0, "float32 score gradients live in one block's backward, per head"),
    "score_grad_after_release": _c(0, "1: materialised score gradients peak after the block's "
                                      "MLP tensors and the probabilities' later copies are "
                                      "released (an eager backward, op by op)"),
    "block_grads_in_order": _c(0, "1: a block's weight gradients appear node by node in its "
                                  "backward pass (the MLP's backward peaks with down's alone, "
                                  "the attention core's with the MLP's and the output "
                                  "projection's); 0: the whole block's beside its backward "
                                  "transients"),
    "mlp_grad_saved": _c(0, "compute-dtype MLP input gradients live in one block's backward, "
                            "per f-wide projection"),
    "frozen_down_grads": _c(0, "1: when LoRA leaves down frozen and its input unsaved "
                               "(frozen_inputs_dropped), one block's MLP backward holds the "
                               "product's gradient and the ones it becomes (gated: two, "
                               "GELU: one), f wide in the compute dtype, on top of what the "
                               "block saved"),
    # --- the loss ---
    "logits_act_copies": _c(1, "compute-dtype logits-sized buffers at the loss (16-bit)"),
    "logits_fp32_copies": _c(2, "float32 logits-sized buffers at the loss"),
    "logits_pad_copies": _c(0, "compute-dtype logits copies added when the vocabulary is not "
                               "a multiple of 16 (padded for the head's backward GEMM)"),
    "head_splitk_rows_per_sm": _c(0, "the padded copies exist only where the compiler splits "
                                     "the head's input-gradient GEMM over the vocabulary: "
                                     "when its output's rows x 128-wide column tiles are "
                                     "fewer than this x SMs x V / (V + head_splitk_half_k) "
                                     "(0: padded whenever the vocabulary is unaligned)"),
    "head_splitk_half_k": _c(0, "the vocabulary at which that limit is half its large-"
                                "vocabulary value"),
    "logits_parallel_extra_copies": _c(0, "float32 logits-sized buffers added at the loss "
                                          "when the head is split over the vocabulary "
                                          "(a vocabulary-parallel cross-entropy)"),
    "grad_combine_bytes": _c(0, "output bytes one combined data-parallel collective carries "
                                "(an all-reduce's gradients, a reduce-scatter's shards; its "
                                "gradients kept live until it runs)"),
    "grad_combine_copy": _c(0, "1: a combined all-reduce copies its gradients into one flat "
                               "buffer"),
    "logits_follow_sp": _c(0, "1: under sequence parallelism the head runs on the device's "
                              "slice of the sequence (logits split over tp)"),
    # --- weights ---
    "autocast_weight_cache": _c(0, "1: every weight's compute-dtype cast is cached to the end "
                                   "of the forward pass, recomputed blocks' too (autocast's "
                                   "cast cache)"),
    "weight_copy_fraction": _c(0, "share of the compute-dtype weight casts kept live"),
    "quant_moment_copies": _c(0, "bytes per element of the tensor being updated that a "
                                 "quantised (8-bit) Adam update copies: its moments' old "
                                 "codes, read again after the new ones take their buffers"),
    "adam_update_copies": _c(0, "parameter-sized optimizer-state-dtype temporaries of an Adam "
                                "update (on the device's share of the state)"),
    "moe_capacity_factor": _c(1, "expert slots per routed token (1: dropless)"),
    "moe_dispatch_saved": _c(0, "h-wide tensors per expert slot a block without recomputation "
                                "keeps for its backward beside the experts' own: the "
                                "dispatched inputs, the gathered outputs"),
    "base_bytes_8bit": _c(1, "bytes per weight of an 8-bit frozen base"),
    "lora_dequant": _c(0, "1: a 4-bit (NF4) frozen base weight is dequantised to the compute "
                          "dtype by kernels of its own before the matmul that reads it, once "
                          "per forward pass (again when the block is recomputed): memory-bound "
                          "time reading the codes and writing the weight"),
    "lora_dequant_in_backward": _c(0, "1: the backward pass dequantises the 4-bit base again "
                                      "for the input gradient; 0: it reads the forward pass's "
                                      "dequantised copy (recomputed with the block's other "
                                      "non-matmul values under a policy that saves matmul "
                                      "outputs only)"),
    "nf4_scales_whole_over_tp": _c(0, "1: a tensor-parallel 4-bit matrix keeps its block "
                                      "absmax whole on every rank beside column-split codes, "
                                      "and the absmax codes' scales whole whatever the split"),
    "lora_dequant_kernels": _c(0, "kernels per dequantisation of one wrapped 4-bit matrix"),
    "lora_dequant_nested_kernels": _c(0, "kernels a dequantisation of one 4-bit matrix adds "
                                         "under double quantisation (its absmax codes "
                                         "dequantised first)"),
    "lora_input_cast": _c(0, "1: a wrapped matrix of a 16-bit base casts its input to the "
                             "adapters' dtype before them (PEFT's lora.Linear): under "
                             "autocast with float32 adapters each keeps its own compute-dtype "
                             "copy of its input for the adapter's gradient"),
    "lora_quant_adapters_lowp": _c(0, "1: under a 4- or 8-bit base and mixed precision the "
                                      "adapters, their gradients and optimizer state are "
                                      "bfloat16 (2 bytes), not the precision's float32"),
    # --- time: kernels ---
    "gemm_eff_max": _c(0.8, "large GEMMs' share of the dtype's dense peak"),
    "gemm_half_scale": _c(1, "GEMM half-efficiency dimension, in roofline ridge points"),
    "flash_eff": _c(0.5, "fused attention's share of the dtype's peak, forward + backward"),
    "flash_eff_sm90": _c(0, "flash_eff on Hopper (compute capability 9.x) where the kernel's "
                            "share differs there, overriding flash_eff on those cards; "
                            "0: flash_eff"),
    "flash_half_seq_sm90": _c(0, "sequence length at which flash_eff_sm90 halves: the "
                                 "Hopper share is flash_eff_sm90 x s / (s + this) (with "
                                 "flash_eff_sm90 only)"),
    "flash_exp_flops_sm90": _c(0, "where the Hopper kernel computes its softmax between its "
                                  "matmuls, not beside them: the time of one exponential in "
                                  "tensor-core FLOPs (two a score element, forward and "
                                  "backward, beside 14 x head_dim matmul FLOPs), which makes "
                                  "the share depend on the head dim (flash_eff_sm90 is the "
                                  "share at flash_eff_head_dim_sm90); 0: no head-dim rule"),
    "flash_eff_head_dim_sm90": _c(128, "the head dim at which flash_eff_sm90 was read (with "
                                       "flash_exp_flops_sm90 only)"),
    "mem_eff": _c(0.8, "streaming element-wise kernels' share of HBM bandwidth"),
    "ew_h": _c(10, "h-wide elements read + written per token by a block's element-wise ops"),
    "ew_dropout_h": _c(1, "dropout masks per block, in activation-element units"),
    "ew_score": _c(2, "materialised softmax traffic per head and key"),
    "ew_score_dropout": _c(2.5, "attention dropout traffic per head and key"),
    "ew_bwd_factor": _c(2, "backward element-wise traffic per forward element"),
    "ew_rmsnorm_extra": _c(0, "element-wise traffic an RMSNorm adds per normalised element "
                              "beyond one fused kernel's read and write, in compute-dtype "
                              "elements: an eager RMSNorm runs op by op (0 under "
                              "training.compile)"),
    "ew_rope_extra": _c(0, "element-wise traffic rotary embedding adds per rotated q and k "
                           "element beyond one fused kernel's read and write (0 under "
                           "training.compile)"),
    "ew_glu_extra": _c(0, "element-wise traffic a gated MLP's activation adds per element of "
                          "its width beyond one fused kernel reading both inputs and writing "
                          "the product (0 under training.compile)"),
    "tp_fp8_allgather": _c(0, "1: with an 8-bit recipe under sequence parallelism the "
                              "forward all-gathers of the blocks' matrix inputs move the "
                              "8-bit tensors (the reduce-scatters and the backward's "
                              "collectives stay in the compute dtype)"),
    "fp8_cast_bytes": _c(0, "HBM bytes an 8-bit recipe moves per element of each linear "
                            "layer's input (forward) and output gradient (backward) to cast it "
                            "for the 8-bit GEMM (and its transposed copy for the weight "
                            "gradient); 0: no cast kernels priced"),
    # --- time: communication ---
    "nvlink_eff": _c(0.78, "NCCL bus bandwidth / NVLink bandwidth"),
    "net_eff": _c(0.9, "NCCL bus bandwidth / NIC line rate"),
    "alpha_base_s": _c(8.4e-6, "ring collective base latency, s"),
    "alpha_intra_s": _c(3.4e-6, "latency per ring step over NVLink, s"),
    "alpha_inter_s": _c(14e-6, "latency per ring step over the network, s"),
    "host_eff": _c(0.8, "host<->device copies' share of the PCIe link"),
    "host_update_bytes_s": _c(1.6e9, "bytes a second of the optimizer update's traffic "
                                     "(`capopt.cost.time`) where the step runs on the host "
                                     "(parameter offload): torch 2.13 AdamW(foreach=True) "
                                     "on 50M float32 parameters with one thread, as torchrun "
                                     "gives each process of a multi-GPU node "
                                     "(OMP_NUM_THREADS=1, torch/distributed/run.py), "
                                     "measured 0.88 s a step on an AMD EPYC at load 4.6 "
                                     "(benchmarks/host_update.py, results/host_update.json)"),
    "dp_bucket_bytes": _c(25 * 2**20, "bytes per data-parallel all-reduce"),
    "zero3_collectives_per_layer": _c(1, "ZeRO-3 gathers per block"),
    "zero3_fetch_s_per_gb": _c(0, "ZeRO-3 fetch path cost per GB received, s"),
    "overlap_dp": _c(0, "share of data-parallel communication hidden behind compute"),
    "overlap_zero": _c(0, "share of ZeRO-3 communication hidden behind compute"),
    "replica_ar_as_dp": _c(0, "1: under hybrid sharding the all-reduce of each gradient "
                              "shard across the replicas is a data-parallel all-reduce of "
                              "its own, hidden as overlap_dp says; 0: with ZeRO's "
                              "collectives (overlap_zero)"),
    "overlap_tp_fwd": _c(0, "share of forward tensor-parallel communication hidden"),
    "overlap_tp_bwd": _c(0, "share of backward tensor-parallel communication hidden"),
    "overlap_pp": _c(0, "share of pipeline sends hidden"),
    "overlap_moe": _c(0, "share of MoE all-to-all hidden"),
    "overlap_offload": _c(0, "share of host transfers hidden"),
    "pp_scatter_gather": _c(0, "1: inter-stage sends carry a tp-th of the activation"),
    # --- time: kernel launches ---
    "kernel_launch_s": _c(0, "host time to issue one kernel, s"),
    "kernel_gap_s": _c(0, "device-side cost per kernel that queueing cannot hide, s"),
    "kernels_per_layer": _c(0, "kernels of one block's forward + backward"),
    "kernels_per_attn_chunk": _c(0, "kernels per query chunk of blockwise attention, per block"),
    "kernels_per_micro_batch": _c(0, "embedding, head and loss kernels per micro-batch"),
    "accum_kernels_per_layer": _c(0, "accumulation kernels per block per micro-batch"),
    "optimizer_kernels_per_layer": _c(0, "optimizer kernels per block, once a step"),
    "accum_from_zero": _c(0, "1: accumulation starts from a zeroed buffer (a scan)"),
    "accum_bytes": _c(0, "bytes per accumulator element when wider than the gradient"),
}


# coefficients that are shares (a mixture's weight, or a 0/1 rule): at most 1
SHARES = frozenset({"expandable_segments", "zero3_regather_for_remat", "selective_saves_dots",
                    "selective_saves_ops", "fsdp_gathers_compute_dtype", "fsdp_mixed_precision",
                    "fsdp_reduce_compute_dtype",
                    "zero2_per_group", "zero_pp_nosync", "uneven_stages", "context_parallel",
                    "interleaved_pipeline", "lora_dequant", "lora_dequant_in_backward",
                    "update_flat_grad_copies", "zero_fp32_partition",
                    "zero1_step_grad_partition",
                    "overlap_dp_buckets",
                    "overlap_param_gather", "overlap_tp_fwd_needs_sp", "autocast_casts",
                    "autocast_weight_cache", "weight_copy_fraction"})


def _check_coeff(key: str, value, file: str | None) -> float:
    if key not in SCHEMA:
        raise CapoptError(f"unknown coefficient {key!r}", file=file, field=f"coeffs.{key}",
                          allowed="the keys of capopt._runtime.SCHEMA")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CapoptError(f"must be a number, got {value!r}", file=file, field=f"coeffs.{key}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise CapoptError(f"must be a finite number >= 0, got {value!r}", file=file,
                          field=f"coeffs.{key}")
    if key in SHARES and v > 1:
        raise CapoptError(f"a share: must be between 0 and 1, got {value!r}", file=file,
                          field=f"coeffs.{key}")
    return v


def _check_policy(coeffs: dict, file: str | None) -> dict:
    """The selective policy's shares (dots, torchtitan's per-op; Korthikanti's the rest) sum
    to at most 1."""
    if coeffs["selective_saves_dots"] + coeffs["selective_saves_ops"] > 1.0:
        raise CapoptError("selective_saves_dots + selective_saves_ops must be at most 1 "
                          "(each is a share of the selective policy)", file=file,
                          field="coeffs.selective_saves_ops")
    if coeffs["flash_exp_flops_sm90"] > 0.0 and not _matmul_time_left(coeffs) > 0.0:
        raise CapoptError("flash_eff_sm90 leaves no time for the matmuls beside "
                          "flash_exp_flops_sm90's exponentials: it must be below "
                          "7 x flash_eff_head_dim_sm90 / flash_exp_flops_sm90", file=file,
                          field="coeffs.flash_exp_flops_sm90")
    return coeffs


# The attention kernel's FLOPs and exponentials per score element (one query-key pair of one
# head) of head dim d: forward Q K^T and P V, 4 d; backward ATTN_BWD_FLOPS times that
# (FlashAttention's count, Dao 2023); one exponential each way (the softmax, and the
# backward's recomputed P)
ATTN_BWD_FLOPS = 2.5
ATTN_MATMUL_FLOPS_PER_HEAD_DIM = 4.0 * (1.0 + ATTN_BWD_FLOPS)
ATTN_EXPONENTIALS = 2.0


def _matmul_time_left(c: dict) -> float:
    """The time a score element takes at ``flash_eff_sm90`` (its reference head dim), less
    its exponentials', in FLOPs at the peak: the matmuls' share of it (must be above 0)."""
    d = c["flash_eff_head_dim_sm90"]
    return (ATTN_MATMUL_FLOPS_PER_HEAD_DIM * d / c["flash_eff_sm90"]
            - ATTN_EXPONENTIALS * c["flash_exp_flops_sm90"])


def flash_share_sm90(c: dict, head_dim: float) -> float:
    """The Hopper attention kernel's share of the peak at ``head_dim`` (long sequences):
    ``flash_eff_sm90``, or, where its exponentials run between its matmuls
    (``flash_exp_flops_sm90``), ``14 d / (14 d / m + 2 x)`` with ``m`` the share inside the
    matmuls that ``flash_eff_sm90`` gives at ``flash_eff_head_dim_sm90``."""
    if c.get("flash_exp_flops_sm90", 0.0) <= 0.0:
        return float(c["flash_eff_sm90"])
    work = ATTN_MATMUL_FLOPS_PER_HEAD_DIM
    inside = work * c["flash_eff_head_dim_sm90"] / _matmul_time_left(c)
    return work * head_dim / (work * head_dim / inside
                              + ATTN_EXPONENTIALS * c["flash_exp_flops_sm90"])


def complete_coeffs(given: dict, file: str | None = None) -> dict[str, float]:
    """Every schema coefficient: ``given`` (checked) over the defaults."""
    out = {k: c.default for k, c in SCHEMA.items()}
    for k, v in given.items():
        out[k] = _check_coeff(k, v, file)
    return out


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    source: str
    coeffs: tuple[tuple[str, float], ...]                 # flat name -> value
    precisions: tuple[tuple[str, tuple[tuple[str, object], ...]], ...]
    notes: tuple[tuple[str, str], ...] = ()               # coefficient -> where it came from
    lineage: tuple[str, ...] = ()                         # its base profile, that one's, ...
    optimizers: tuple[str, ...] = ()                      # the ones it runs; () every one

    @property
    def xla_step(self) -> bool:
        """Whether the runtime is a JAX program compiled by XLA (``xla-gpu``, ``xla-cpu`` or a
        profile built on one, such as ``maxtext``): a cross-entropy over whole logits as the
        profile's logits rules say, no adapter dropout, XLA's buffer rules."""
        return any(n.startswith("xla") for n in (self.name,) + self.lineage)

    def coeff(self, key: str) -> float:
        d = dict(self.coeffs)
        if key not in d:
            raise CapoptError(f"runtime profile {self.name!r} lacks coefficient {key!r}",
                              field=f"runtime.{key}")
        return float(d[key])

    def coeff_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.coeffs}

    @property
    def precision_names(self) -> tuple[str, ...]:
        """The precisions the profile has tables for, in its file's order."""
        return tuple(name for name, _ in self.precisions)

    def precision(self, name: str) -> dict:
        d = dict(self.precisions)
        if name not in d:
            raise CapoptError(f"runtime profile {self.name!r} has no precision {name!r}",
                              field="training.precision", allowed=", ".join(d))
        return dict(d[name])

    def with_coeffs(self, **updates: float) -> "RuntimeProfile":
        d = self.coeff_dict()
        d.update({k: _check_coeff(k, v, None) for k, v in updates.items()})
        _check_policy(d, None)
        return RuntimeProfile(self.name, self.source, tuple(sorted(d.items())),
                              self.precisions, self.notes, self.lineage, self.optimizers)

    def to_toml(self) -> str:
        """Serialise to the same TOML the loader reads."""
        lines = [f"name = {json.dumps(self.name)}", f"source = {json.dumps(self.source)}"]
        if self.lineage:      # (every coefficient and precision is written: the base adds none)
            lines.append(f"base = {json.dumps(self.lineage[0])}")
        if self.optimizers:
            lines.append(f"optimizers = {json.dumps(list(self.optimizers))}")
        lines += ["", "[coeffs]"]
        notes = dict(self.notes)
        for k, v in self.coeffs:
            note = notes.get(k)
            lines.append(f"{k} = {v!r}" + (f"   # {note}" if note else ""))
        for pname, fields in self.precisions:
            lines += ["", f'[precision."{pname}"]']
            for k, v in fields:
                lines.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v!r}")
        return "\n".join(lines) + "\n"


def _precision_rows(tables: dict, file: str) -> tuple:
    """A profile's ``[precision."name"]`` tables as `RuntimeProfile.precisions` rows."""
    precisions = []
    for pname, fields in tables.items():
        missing = set(PRECISION_FIELDS) - set(fields)
        if missing:
            raise CapoptError(f"missing {sorted(missing)}", file=file,
                              field=f"precision.{pname}")
        unknown = set(fields) - set(PRECISION_FIELDS) - set(OPTIONAL_PRECISION_FIELDS)
        if unknown:
            raise CapoptError(f"unknown key {sorted(unknown)[0]!r}", file=file,
                              field=f"precision.{pname}",
                              allowed=", ".join(PRECISION_FIELDS + OPTIONAL_PRECISION_FIELDS))
        row = [(k, fields[k]) for k in PRECISION_FIELDS]
        row.append(("attention_dtype", fields.get("attention_dtype", fields["matmul_dtype"])))
        precisions.append((pname, tuple(row)))
    return tuple(precisions)


def _parse(data: dict, file: str) -> RuntimeProfile:
    allowed = {"name", "source", "base", "coeffs", "precision", "notes", "optimizers"}
    unknown = set(data) - allowed
    if unknown:
        raise CapoptError(f"unknown key {sorted(unknown)[0]!r}", file=file, field="profile",
                          allowed=", ".join(sorted(allowed)))
    try:
        if not isinstance(data["coeffs"], dict):
            raise CapoptError("must be a table of numbers", file=file, field="coeffs")
        given = dict(data["coeffs"])
        base = data.get("base")
        lineage = ()
        if base is not None:
            if base not in list_profiles():
                raise CapoptError(f"unknown base profile {base!r}", file=file, field="base",
                                  allowed=", ".join(list_profiles()))
            lineage = (base,) + _load_builtin(base).lineage
            inherited = _load_builtin(base).coeff_dict()
            given = {**inherited, **given}
        coeffs = _check_policy(complete_coeffs(given, file), file)
        optimizers = _optimizer_list(data.get("optimizers"), file)
        if base is not None and "optimizers" not in data:
            optimizers = _load_builtin(base).optimizers
        if base is not None and "precision" not in data:
            precisions = _load_builtin(base).precisions     # none of its own: the base's
        else:
            precisions = _precision_rows(data["precision"], file)
    except KeyError as e:
        raise CapoptError(f"missing table {e.args[0]!r}", file=file, field=str(e.args[0]))
    except (TypeError, ValueError) as e:
        raise CapoptError(f"bad value: {e}", file=file, field="coeffs")
    return RuntimeProfile(
        name=str(data.get("name", Path(file).stem)), source=str(data.get("source", "")),
        coeffs=tuple(sorted(coeffs.items())), precisions=precisions,
        notes=tuple(sorted((k, str(v)) for k, v in data.get("notes", {}).items())),
        lineage=lineage, optimizers=optimizers)


def _optimizer_list(value, file: str) -> tuple[str, ...]:
    """A profile's ``optimizers``: the training.optimizer values it runs (absent: all)."""
    if value is None:
        return ()
    if (not isinstance(value, list) or not value
            or any(not isinstance(v, str) or v not in OPTIMIZERS for v in value)):
        raise CapoptError(f"got {value!r}", file=file, field="optimizers",
                          allowed="a non-empty list of " + ", ".join(OPTIMIZERS))
    return tuple(value)


def list_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("capopt.profiles").iterdir()
                  if p.name.endswith(".toml"))


@functools.lru_cache(maxsize=None)
def _load_builtin(name: str) -> RuntimeProfile:
    text = resources.files("capopt.profiles").joinpath(f"{name}.toml").read_text()
    return _parse(tomllib.loads(text), f"capopt/profiles/{name}.toml")


def get_profile(name_or_path: str) -> RuntimeProfile:
    """A built-in profile by name, or a profile TOML file by path."""
    if name_or_path in list_profiles():
        return _load_builtin(name_or_path)
    p = Path(name_or_path)
    if p.suffix == ".toml" and path_exists(p):
        data = parse_toml(read_text(p, field="training.runtime"), str(p))
        check_depth(data, str(p), limit=3)
        return _parse(data, str(p))
    raise CapoptError(f"unknown runtime profile {name_or_path!r}", field="training.runtime",
                      allowed=", ".join(list_profiles()) + ", or a path to a profile .toml")
