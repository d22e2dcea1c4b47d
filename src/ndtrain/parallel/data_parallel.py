"""Data parallelism through FSDP2 `fully_shard` for every flavour, with the ZeRO stage in the
paper's sense (Rajbhandari et al. 2020) over the shard group dp_shard x cp:

- zero = 3: parameters, gradients and AdamW state sharded. A block's parameters are gathered for
  its forward and, with `reshard_after_forward` (the default), freed after it and gathered again
  for its backward; gradients are reduce-scattered after every micro-batch.
- zero = 2: parameters replicated while training (gathered at the step's first forward and kept
  until its last backward; no gather between micro-batches), gradients reduce-scattered after
  every micro-batch into their shard, AdamW state and the update on the shard, the updated
  parameters gathered before they are used again.
- zero = 1: as 2, but whole gradients accumulate over the micro-batches and are
  reduce-scattered once per step: fewer collectives, 2Ψ more memory.
- dp_replicate > 1: the replicate dim of a 2-D (HSDP) mesh: gradients are all-reduced across
  replicas.
- plain replication (`Layout.plain_replication`: dp_replicate alone, a shard group of one rank):
  DDP; `Layout.on_ddp_reducer` says when it runs as below. Here FSDP2 would still copy every block into and out of a one-rank "all-gather" and issue
  one blocking all-reduce per block after its backward (on CPU its streams are no-ops), so this
  layout uses torch's DDP reducer instead, through the composable `replicate` (no wrapper module:
  parameter names, checkpoints and HF export are unchanged): gradients land in 25 MB buckets
  whose all-reduces run while the backward goes on (docs/results/history.md, run F). fp32 only: DDP
  would run bf16 under autocast (bf16 matmuls, fp32 everywhere else), which cost more here than
  the reducer saves (4,060 vs 4,400 tokens/s), where FSDP2's policy runs whole blocks in bf16. fp8,
  CPU offload and MoE models (experts a step may leave without gradient) keep FSDP2 too.

FSDP2 is the torch component that does all of this: ZeRO-1/2 are its `reshard_after_forward=False`
with resharding after backward and gradient sync switched per micro-batch (the trainer's
`accumulation` below), so gradient reduction, mixed precision (bf16 compute, fp32 reduction and
master weights), accumulation without sync, CPU offload, exact gradient-norm clipping and
layout-independent (DCP) checkpoints are identical across stages. Between steps the parameters
rest sharded, which only saves memory. On CPU ranks two of FSDP2's own hooks change how its
collectives run, not what they compute (`overlap_on_gloo`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from ndtrain.compat.torch import find, require, set_unshard_async
from ndtrain.parallel.expert import shard_experts


def apply_fsdp(model: nn.Module, dp_mesh, reshard_after_forward: bool, mixed_precision: str,
               cpu_offload: bool, ep_fsdp_mesh=None) -> None:
    """`ep_fsdp_mesh`: with expert parallelism, the mesh that shards the experts' weights."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision in ("bf16", "fp8") else MixedPrecisionPolicy()
    # pin_memory needs an accelerator; on CPU-only hosts torch raises if it is requested.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else None
    kwargs = dict(mesh=dp_mesh, mp_policy=mp)
    if offload is not None:
        kwargs["offload_policy"] = offload
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first in backward: keep them gathered.
        reshard = reshard_after_forward and i < len(blocks) - 1
        # Expert-parallel weights first: they live on their own (smaller) mesh.
        if ep_fsdp_mesh is not None:
            shard_experts(block, ep_fsdp_mesh, kwargs, reshard)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    # Gloo's own: not on NCCL, nor on the dry run's fake group (it stands for a GPU job's).
    if dp_mesh.device_type == "cpu" and torch.distributed.get_backend() == "gloo":
        overlap_on_gloo(blocks, model)


def overlap_on_gloo(blocks: list[nn.Module], model: nn.Module) -> None:
    """FSDP2 on CPU ranks. Its streams are no-ops there, so its implicit prefetch issues each
    all-gather as a blocking call just before the block needs it. Asynchronous unshards with each
    block naming the next as its forward prefetch put the next block's all-gather on Gloo's thread
    while this block computes (the backward already prefetches the previous block, now also
    asynchronously); one block more stays gathered at a time. The gradient reduce-scatter goes
    through torch's all-to-all (gloo_reduce_scatter.py). GPUs keep FSDP2's stream-based defaults.
    Measured side by side on the peers' model (docs/results/history.md, run I)."""
    # Both hooks are private torch, looked up here, on the CPU path only (a GPU run never imports
    # them); where a torch lacks one, FSDP2's own blocking all-gather or Gloo's reduce-scatter stays.
    set_unshard_async(model)  # every FSDP module under it
    for module, nxt in zip([model, *blocks], blocks):
        module.set_modules_to_forward_prefetch([nxt])
    if find("fsdp_reduce_scatter") is None:
        return
    from ndtrain.parallel.gloo_reduce_scatter import AllToAllReduceScatter

    for module in model.modules():  # the root, the blocks, and experts sharded on their own mesh
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(AllToAllReduceScatter())


def apply_ddp(model: nn.Module, group) -> None:
    """DDP over `group` (every rank holds the whole model). It starts on the first forward, so the
    parameters may still be on the meta device here; it then broadcasts rank 0's values (the same
    values: every rank initialises from the same seed) and lays the gradients out as views of its
    buckets (no copy into and out of them)."""
    replicate = require("replicate")
    # Buffers (RoPE tables) are computed, not trained: no broadcast before every forward.
    replicate(model, process_group=group, gradient_as_bucket_view=True, forward_sync_buffers=False)


def accumulation(parts: list[nn.Module], lay, last: bool) -> None:
    """Before each micro-batch's backward (pp = 1): whether FSDP reduces gradients after it, and
    whether it frees the gathered parameters. ZeRO-2/3 reduce every micro-batch (gradients stay
    sharded); ZeRO-1 and plain replication once, on the last. ZeRO-1/2 keep parameters gathered
    until the step's last backward; ZeRO-3 reshards after each."""
    sync = last or lay.grads_sharded_per_microbatch
    reshard = last or lay.effective_zero == 3
    for part in parts:
        if hasattr(part, "set_requires_gradient_sync"):  # FSDP2 or DDP
            part.set_requires_gradient_sync(sync)
        if hasattr(part, "set_reshard_after_backward"):  # FSDP2
            part.set_reshard_after_backward(reshard)


def reshard(parts: list[nn.Module]) -> None:
    """Free parameters a forward left gathered (ZeRO-1/2 after a forward-only pass), so the next
    optimizer step and state dict see the sharded parameters alone."""
    for part in parts:
        if hasattr(part, "reshard"):
            for module in part.modules():
                if hasattr(module, "reshard"):
                    module.reshard()
