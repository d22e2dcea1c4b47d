"""Activation checkpointing policies: none, full (every block), every_n (every N-th block) and
selective (keep matmul and attention outputs, recompute the cheap elementwise ops)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


# FSDP marks its work with profiler ranges. Inside a checkpointed block that holds its own FSDP
# unit (expert-parallel weights), the recompute opens more of them than the forward did, and
# selective checkpointing (torch 2.13) then refuses the recompute as a different op sequence.
# They are markers, not computation: let them run without being counted (torch's own list of
# such ops, SAC_IGNORED_OPS, is the documented place for them).
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> None:
    if mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "every_n" and i % every:
            continue
        if mode == "selective":
            wrapped = checkpoint_wrapper(block, context_fn=partial(create_selective_checkpoint_contexts, _policy),
                                         preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers[name] = wrapped
