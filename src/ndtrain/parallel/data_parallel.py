"""Data parallelism through FSDP2 `fully_shard` for every flavour:

- dp_shard > 1: ZeRO-3 (zero=3, parameters resharded after forward) or ZeRO-2-like (zero=2,
  gathered parameters kept until backward; gradients and optimizer state stay sharded);
- dp_replicate > 1: the replicate dim of a 2-D (HSDP) mesh; with dp_shard = 1 this is DDP.

One mechanism for all of them keeps gradient reduction, mixed precision, accumulation without
sync and CPU offload identical across layouts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ndtrain.parallel.expert import shard_experts


def apply_fsdp(model: nn.Module, dp_mesh, zero: int, mixed_precision: str, cpu_offload: bool) -> None:
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
        reshard = zero == 3 and i < len(blocks) - 1
        # Expert-parallel weights first: they live on their own (smaller) mesh.
        shard_experts(block, kwargs, reshard)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
