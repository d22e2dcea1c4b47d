"""FSDP2's gradient reduce-scatter on CPU ranks, through torch's `all_to_all_single`.

Gloo has no reduce-scatter of its own: torch's ProcessGroupGloo runs `reduce_scatter_single` as a
clone of the input, a full all-reduce of it (a ring all-reduce sends 2(k-1)/k of the bytes) and a
copy of this rank's chunk out. A reduce-scatter needs only (k-1)/k: every rank sends each peer the
chunk that peer owns, and sums the k chunks it receives for its own. torch's all-to-all does
exactly that exchange; the sum is one local op. At world 2 on the 2-core host of
docs/results/history.md (benchmarks/gloo_collectives.py) it took 1.0-3.4 ms where Gloo's took 2.0-6.2 ms
(1-3.4 MB, up to a decoder block's gradients) and 17.5-26.7 vs 30.6-35.0 ms at 25 MB.

It is installed through FSDP2's own hook (`FSDPModule.set_custom_reduce_scatter`), so the
reduction's placement, division (SUM or AVG, as FSDP2 asks), mixed precision, HSDP's all-reduce
after it and accumulation are FSDP2's, unchanged. NCCL has a real reduce-scatter: GPUs keep it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndtrain.compat.torch import fsdp_reduce_scatter_base


# FSDP2's interface for a custom reduce-scatter is private torch (compat.torch); this module is
# imported on the CPU path only (data_parallel.overlap_on_gloo, calibration), never on a GPU run.
class AllToAllReduceScatter(fsdp_reduce_scatter_base()):
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or async_op:
            # A pre-multiplied sum (a custom gradient divide factor) or an asynchronous call: Gloo's own.
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        # Row r of `received` is rank r's copy of this rank's chunk.
        torch.sum(received.view(world, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None
