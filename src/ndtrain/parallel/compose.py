"""The composer: one function that turns a pure torch.nn model into its parallel form.

Order matters, and is fixed:
1. float8 (mixed_precision = "fp8") - swaps the qualifying nn.Linear layers for torchao's
   Float8Linear (parallel/float8.py); torchao requires it before TP and FSDP wrap them, and
   FSDP's float8 all-gather needs the Float8Linear weight subclass in place.
2. tensor/sequence parallel - swaps Linear weights for DTensors sharded over `tp`; everything
   after must see the TP-sharded parameters, or FSDP would shard full weights.
3. context parallel - replaces the attention kernel; needs to know TP's local heads.
4. expert parallel - partitions expert weights over `ep` before FSDP takes ownership of them.
5. activation checkpointing - wraps whole (already TP-ed) blocks so recompute replays the TP
   collectives too.
6. torch.compile per block - compiles the wrapped block, AC included, and keeps FSDP's hooks
   outside the graph so parameter all-gathers stay eager and overlappable. Full and every-n
   checkpointing swap 5 and 6: the compiled block is checkpointed, so its recompute replays the
   compiled forward. Compiling a fully checkpointed TP block fails in torch 2.13 (AOTAutograd
   saves the region's DeviceMesh among the backward's tensors;
   tests/parallel/test_tp_compile.py keeps the failure in view), and recomputing everything needs
   no look inside the graph. Selective checkpointing stays inside: its policy picks ops.
7. FSDP/HSDP/DDP - last, over the outer data-parallel mesh: it shards whatever the steps above
   produced (DTensors become 2-D sharded) and owns gradient reduction. Plain replication gets
   torch's DDP reducer instead (Layout.on_ddp_reducer, parallel/data_parallel.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ndtrain.layout import Layout
from ndtrain.model.linear import set_cpu_kernel
from ndtrain.parallel.activation import apply_activation_checkpointing


def parallelize(model: nn.Module, dims: Layout, mesh=None) -> nn.Module:
    """`dims` is the resolved layout (ndtrain.layout.Layout): degrees and every knob."""
    set_cpu_kernel(model, dims.cpu_matmul)  # kernel choices, not transforms: before them all
    set_fp32_matmul_precision(dims.fp32_matmul_precision)
    if dims.mixed_precision == "fp8":
        from ndtrain.parallel.float8 import apply_float8

        apply_float8(model, dims)
    if dims.tp > 1:
        from ndtrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], dims.sequence_parallel)
    if dims.cp > 1:
        from ndtrain.parallel.context import apply_context_parallel

        apply_context_parallel(model, mesh, dims)
    if dims.ep > 1:
        from ndtrain.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, mesh, dims)
    if dims.cp > 1 and model.cfg.is_moe:
        from ndtrain.parallel.expert import moe_context_parallel

        moe_context_parallel(model, mesh["cp"])
    checkpoint_and_compile(model, dims.activation_checkpoint, dims.ac_every, dims.compile)
    if dims.world // (dims.tp * dims.pp) > 1:
        from ndtrain.parallel.data_parallel import apply_ddp, apply_fsdp

        if dims.on_ddp_reducer(model.cfg.is_moe):
            apply_ddp(model, mesh["dp_replicate"].get_group())
            return model

        # DiLoCo: FSDP shards and reduces inside each replica only, at any ZeRO stage
        # (parallel/diloco.py syncs the replicas).
        dp_mesh = mesh.fsdp_mesh(dims, across_replicas=dims.replicate_sync != "diloco")
        apply_fsdp(model, dp_mesh, dims.reshards_after_forward, dims.mixed_precision, dims.cpu_offload,
                   mesh["ep_fsdp"] if dims.ep > 1 else None)
    return model


def checkpoint_and_compile(model: nn.Module, ac: str, every: int, compile: bool, backend: str | None = None) -> None:
    """Steps 5 and 6: selective checkpointing inside the compiled block, full and every-n around
    it (see above). `backend`: torch.compile's (None: inductor)."""
    checkpoint_compiled = ac in ("full", "every_n")
    if not checkpoint_compiled:
        apply_activation_checkpointing(model, ac, every)
    if compile:
        for block in model.layers.values():
            block.compile(**({"backend": backend} if backend else {}))
    if checkpoint_compiled:
        apply_activation_checkpointing(model, ac, every)


def set_fp32_matmul_precision(precision: str) -> None:
    """CUDA's fp32 matmuls on the TF32 tensor cores or IEEE (`[parallel] fp32_matmul_precision`).

    cuBLAS reads one process-wide flag, so this sets torch's global state, to the run's value
    (every pipeline part sets the same). It uses the non-deprecated per-backend API and leaves
    every other backend alone: `torch.set_float32_matmul_precision("high")` would also switch
    oneDNN's CPU matmuls. Nothing is set where CUDA is absent: CPU ranks have no TF32, and in
    torch 2.13 a "tf32" here makes the legacy getters (`torch.get_float32_matmul_precision()`,
    `torch.backends.cuda.matmul.allow_tf32`) raise, which a CPU run has no reason to risk."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.fp32_precision = precision
