"""Expert parallel: the routed experts of every MoE layer are split over an `ep` group of
data-parallel ranks, and tokens travel to their experts and back with all-to-all.

Mesh. The dp_shard x cp ranks (the FSDP shard group) are viewed as (dp_shard_cp / ep) x ep
(parallel/dims.py builds both views from one root). Expert weights are DTensors Shard(0) over
`ep` (rank r owns experts [r E/ep, (r+1) E/ep)); FSDP then shards them over the complementary
(dp_replicate, dp_shard_cp / ep) mesh, along the expert dimension or, where the local experts do
not divide over it, their input dimension (expert_shard_dim). Everything else keeps its FSDP/TP treatment.

Gradients. Each rank's loss is normalised by its own tokens and FSDP averages dense gradients
over all N = dp_replicate x dp_shard x cp ranks. A local expert's gradient already *sums* the
contributions of the tokens of all ep ranks (the backward all-to-all brings them home), and the
expert FSDP group averages over only N / ep ranks, so expert weight gradients need one more
1/ep. It is applied inside backward (gradient x 1/ep at the experts' output, x ep at their input,
so token gradients are unchanged): exact for every backend and every size of the expert FSDP
mesh, with no reliance on FSDP's divide-factor paths (which need PREMUL_SUM, absent on Gloo).

Per layer and micro-batch: one small all-to-all of token counts (so every rank knows its uneven
split sizes), one all-to-all of the token rows to the experts, one back; backward mirrors both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ndtrain.model.moe import GroupedExperts, MoE


class TrafficMeter:
    """Bytes of token rows this rank sent to *other* ranks through the expert all-to-alls
    (forward, backward and recompute), for benchmarks; no effect on training."""

    def __init__(self):
        self.bytes_sent = 0
        self.calls = 0

    def add(self, splits: list[int], row_bytes: int, me: int) -> None:
        self.bytes_sent += sum(n for r, n in enumerate(splits) if r != me) * row_bytes
        self.calls += 1


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 with uneven splits; backward sends the gradients back along
    the reversed splits. (torch.distributed.nn.functional's version is deprecated in 2.13.)"""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, meter):
        ctx.splits, ctx.group, ctx.meter = (out_splits, in_splits), group, meter
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        x = x.contiguous()
        if meter is not None:
            meter.add(in_splits, x[0].numel() * x.element_size() if x.numel() else 0, dist.get_rank(group))
        dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group, ctx.meter), None, None, None, None


def regroup_index(recv: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """recv [sources, local experts] row counts of a buffer laid out source-major; returns the
    gather index that lays the rows out expert-major (each local expert's rows contiguous).
    `total` (the rows received, when the caller knows it) saves a host read of recv's sum."""
    flat = recv.flatten()
    starts = flat.cumsum(0) - flat
    by_expert = torch.arange(flat.numel(), device=recv.device).view(recv.shape).t().flatten()
    sizes, src_starts = flat[by_expert], starts[by_expert]
    dst_starts = sizes.cumsum(0) - sizes
    total = int(flat.sum()) if total is None else total
    return torch.repeat_interleave(src_starts - dst_starts, sizes, output_size=total) + \
        torch.arange(total, device=recv.device)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class ExpertExchange:
    """`MoE.exchange`: runs the experts on the ranks that own them."""

    def __init__(self, group, size: int, meter: TrafficMeter | None = None):
        self.group, self.size, self.meter = group, size, meter

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        n_local = counts.numel() // self.size
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)
        recv = recv.view(self.size, n_local)  # [source rank, local expert]
        # The all-to-all needs its split sizes on the host: one read for both (a sync per layer
        # and micro-batch that uneven splits cannot avoid).
        send_splits, recv_splits = torch.stack([counts.view(self.size, n_local).sum(1), recv.sum(1)]).tolist()
        rows = _AllToAll.apply(xs, recv_splits, send_splits, self.group, self.meter)
        index = regroup_index(recv, sum(recv_splits))
        ys = experts(_ScaleGrad.apply(rows[index], float(self.size)), recv.sum(0))
        ys = _ScaleGrad.apply(ys, 1.0 / self.size)
        back = torch.empty_like(index)
        back[index] = torch.arange(index.numel(), device=index.device)
        return _AllToAll.apply(ys[back], send_splits, recv_splits, self.group, self.meter)


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) whose backward is again an all_reduce(SUM): every rank's loss depends on
    the sum, so each input's gradient is the sum of all ranks' upstream gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def moe_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Under context parallel a rank holds part of each sequence; the sequence-wise aux-loss
    statistics are summed over the cp group so the loss is that of the whole sequence."""
    group = cp_mesh.get_group()
    for module in model.modules():
        if isinstance(module, MoE):
            module.sequence_reduce = lambda t, g=group: _SumOverGroup.apply(t, g)


def moe_tensor_parallel(moe: MoE, tp_mesh, seq_layout) -> None:
    """MoE layers under tensor parallel: weights replicated over tp (Replicate DTensors, so they
    sit with the TP weights in one optimizer), and every tp rank routes the whole sequence -
    gathered first under sequence parallel - so routing, outputs and weight gradients are the
    same on all tp ranks and need no reduction. Costs tp x the expert compute; splitting the
    expert FFN over tp is not implemented."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    for module in moe.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(param.data, tp_mesh, [Replicate()]), param.requires_grad))
    parallelize_module(moe, tp_mesh, PrepareModuleInputOutput(
        input_layouts=(seq_layout,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(seq_layout,), use_local_output=True))


def apply_expert_parallel(model: nn.Module, mesh, dims) -> None:
    ep_mesh = mesh["ep"]
    exchange = ExpertExchange(ep_mesh.get_group(), dims.ep, TrafficMeter())
    for block in model.layers.values():
        moe = getattr(block, "feed_forward", None)
        if not isinstance(moe, MoE):
            continue
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            full = param.data.to_local() if hasattr(param.data, "to_local") else param.data  # tp-replicated
            experts.register_parameter(
                name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)]), param.requires_grad))
        moe.exchange = exchange


def expert_shard_dim(local_shape: tuple[int, ...], degree: int) -> int:
    """The dimension FSDP shards a rank's expert weights [local experts, in, out] along over
    `degree` ranks. Dim 0 when the local experts divide evenly; otherwise dim 1, when it divides:
    FSDP pads dim 0 to a multiple of `degree`, so one local expert over 8 ranks would leave the
    whole expert on one rank and padding on the other seven."""
    if local_shape[0] % degree == 0 or len(local_shape) < 2 or local_shape[1] % degree:
        return 0
    return 1


def shard_experts(block: nn.Module, ep_fsdp_mesh, fsdp_kwargs: dict, reshard_after_forward: bool) -> None:
    """FSDP for expert-parallel weights over their own mesh (Meshes['ep_fsdp']: shard, or replicate x
    shard); call before sharding `block`. Checkpoints hold global tensors (DCP), so the
    dimension each shards along does not change what is saved."""
    from torch.distributed.fsdp import fully_shard

    degree = ep_fsdp_mesh.size(ep_fsdp_mesh.ndim - 1)

    def placement(param):
        local = param.to_local() if hasattr(param, "to_local") else param
        return Shard(expert_shard_dim(tuple(local.shape), degree))

    for module in block.modules():
        if isinstance(module, GroupedExperts):
            fully_shard(module, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement,
                        **{**fsdp_kwargs, "mesh": ep_fsdp_mesh})


def traffic_meter(model: nn.Module) -> TrafficMeter | None:
    for module in model.modules():
        if isinstance(module, MoE) and isinstance(module.exchange, ExpertExchange):
            return module.exchange.meter
    return None
