"""Activation checkpointing policies: none, full (every block), every_n (every N-th block) and
selective (keep the outputs of matmuls, attention, fp8's amax and TP's reduce-scatter; recompute
the cheap elementwise ops and a row-parallel matmul's partial sums)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from ndtrain.compat.torch import present_ops, profiler_markers, require

# An op torch does not ship (a CPU build's missing namespace, a renamed private op) is simply
# not saved: present_ops leaves it out.
_ops = present_ops


# What selective checkpointing keeps: outputs that are expensive to recompute and small beside
# what they cost. torchtitan's save list is the reference for the GPU entries.
_SAVE_OPS = _ops(
    # Every matmul: aten's, oneDNN's fp32 linears on CPU (model/linear.py), fp8's scaled mm and
    # the experts' grouped GEMM (model/moe.py; recomputing it reran every expert's forward).
    "aten.mm", "aten.addmm", "aten.bmm", "mkldnn._linear_pointwise", "aten._scaled_mm", "aten._grouped_mm",
    # Attention: SDPA's fused kernels on CPU and CUDA, the math fallback, and flex attention (the
    # document-masked path on CUDA), whose recompute would be a second attention forward.
    "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_attention_math", "aten._scaled_dot_product_fused_attention_overrideable",
    # fp8's amax (tensorwise: max of |x|, rowwise: amax): a full read of the input for one number
    # per tensor or row, so keeping it costs next to no memory.
    "aten.max", "aten.amax",
    # TP + SP's reduce-scatter after each row-parallel matmul: a recompute would repeat the
    # collective (a network round per layer) for an output 1/tp of the sequence.
    "_c10d_functional.reduce_scatter_tensor",
)
if hasattr(torch.ops.higher_order, "flex_attention"):
    _SAVE_OPS.add(torch.ops.higher_order.flex_attention)


# FSDP marks its work with profiler ranges. Inside a checkpointed block that holds its own FSDP
# unit (expert-parallel weights), the recompute opens more of them than the forward did, and
# selective checkpointing (torch 2.13) then refuses the recompute as a different op sequence.
# They are markers, not computation: let them run without being counted (torch's own list of
# such ops, SAC_IGNORED_OPS, is the documented place for them).
SAC_IGNORED_OPS.update(profiler_markers())


# Matmuls by the position of their left operand (addmm's follows the bias).
_LEFT = {op: 0 for op in _ops("aten.mm", "aten.bmm", "aten._scaled_mm")} | {op: 1 for op in _ops("aten.addmm")}


def _partial_sums(op, args) -> bool:
    """A matmul whose contraction dimension is sharded (a row-parallel linear under TP, seen here
    as a DTensor op): its output is partial sums over the tp group at the whole local sequence,
    [s, b, h] on every tp rank. Kept, it would hold tp x what sequence parallel shards; its
    reduction's output (the reduce-scatter, kept) is what the block goes on with. The recompute
    runs the attention's output projection again; the MLP's down projection not (the recompute
    stops at its saved input, torch's early stop). llama3-70b, tp 8 with SP: 4 sbh less a layer
    (6.81 -> 2.81 sbh), 2% more FLOPs (tools/dryrun)."""
    i = _LEFT.get(op)
    if i is None or len(args) <= i:
        return False
    left = args[i]
    placements = getattr(left, "placements", ())
    return any(isinstance(p, Shard) and p.dim % left.ndim == left.ndim - 1 for p in placements)


def _policy(ctx, op, *args, **kwargs):
    if op in _SAVE_OPS and not _partial_sums(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> None:
    if mode == "none":
        return
    checkpoint_wrapper = require("checkpoint_wrapper")
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "every_n" and i % every:
            continue
        if mode == "selective":
            wrapped = checkpoint_wrapper(block, context_fn=partial(create_selective_checkpoint_contexts, _policy),
                                         preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers[name] = wrapped
