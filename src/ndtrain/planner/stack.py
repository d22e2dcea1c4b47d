"""The software stack a layout runs on, as far as cost goes, and the bytes of each precision.
(The layout itself, its syntax and its rules are ndtrain.layout's.)"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = {"bf16": 2, "fp8": 2, "fp32": 4}  # bytes per activation / parameter copy
# Activation checkpointing policies the planner models (every_n is the runtime's, not searched).
PLANNED_AC = ("none", "selective", "full")


@dataclass(frozen=True)
class Stack:
    """What the training software does, as far as cost goes. Not fitted: each flag is a fact
    about the code base (documented in docs/planner.md)."""

    name: str
    flash_attention: bool  # no s x s scores stored; causal kernels skip the masked half
    dropout: bool  # 1-byte masks after attention and MLP (GPT-era models)
    dp_overlap: bool  # gradient reduction overlaps the backward pass
    grad_reduce_bytes: int  # bytes per gradient element on the wire
    selective_mlp: bool  # selective recompute also recomputes the MLP activation function


STACKS = {
    # ndtrain: SDPA flash kernels, no dropout, FSDP2/DDP with overlapped fp32 gradient reduction
    # (parallel.mixed_precision=bf16 reduces in fp32).
    "ndtrain": Stack("ndtrain", flash_attention=True, dropout=False, dp_overlap=True, grad_reduce_bytes=4,
                     selective_mlp=True),
    # Megatron-LM as of Narayanan et al. 2021: unfused softmax over s x s with dropout, fp16
    # gradients all-reduced after the backward pass (the local DDP of that release).
    "megatron-2021": Stack("megatron-2021", flash_attention=False, dropout=True, dp_overlap=False,
                           grad_reduce_bytes=2, selective_mlp=False),
}
