"""Mixture-of-experts feed-forward in plain torch.nn: a top-k router, grouped experts, shared
experts, load balancing (sequence-wise auxiliary loss or DeepSeek-V3's aux-loss-free bias) and
optional capacity dropping.

Every decision is a function of one token or one sequence, never of the batch a rank happens to
hold, so routing, dropping and the auxiliary loss are identical under any data/expert-parallel
layout or micro-batching:
- capacity is per (sequence, expert): ceil(capacity_factor * seq_len * k / n_experts) slots,
  filled in priority order (every token's first choice before any second choice, then by
  position);
- the auxiliary loss is DeepSeek-V3's sequence-wise balance loss, averaged over sequences.

The module knows nothing about parallelism. Expert parallelism plugs in through `exchange`
(parallel/expert.py), which moves the expert-sorted tokens to the ranks owning their experts and
back; with `exchange = None` all experts are local. Weights are read through `_local`, so a
parallel wrapper may turn them into DTensors (replicated over tp, sharded over ep).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.compat.torch import recomputing
from ndtrain.model.config import ModelConfig
from ndtrain.model.feed_forward import FeedForward

# Per-layer statistics accumulated over a step: selections per expert, then these columns.
_DROPPED, _ENTROPY, _TOKENS, _AUX, _SEQS = range(5)


def _local(w: torch.Tensor) -> torch.Tensor:
    """The locally held part of a (possibly DTensor) weight; the model never imports DTensor."""
    # On the type, not the instance: under torch.compile Dynamo answers hasattr(<DTensor
    # parameter>, "to_local") False, and the router's mm then mixed a DTensor with a Tensor.
    return w.to_local() if hasattr(type(w), "to_local") else w


def occurrences(idx: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in the int64 `idx`: torch.bincount without its host sync
    (on CUDA, bincount reads idx.max() to the host to size its output)."""
    return torch.zeros(n, dtype=torch.long, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))


def fused_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM (torch 2.13) runs these operands: on CUDA bf16 only (its
    kernel and its meta rule refuse other dtypes); the CPU kernel takes fp32 and bf16."""
    return device_type == "cpu" or dtype == torch.bfloat16


def cuda_group_rule(a: torch.Tensor, b: torch.Tensor) -> tuple[int, bool]:
    """What torch's CUDA grouped GEMM (2.11 to 2.13, GroupMMCommon.cuh) asks of the group sizes
    for operands a, b with offsets: (the multiple every size must be, whether a group may be
    empty). Each group's operand starts at an address offset along the grouped dimension, which
    TMA needs 16-byte aligned. Where that step is a row stride (itself checked to be 16 bytes) any
    size works; where it is one element it must be a multiple of 16 bytes' worth. The experts'
    forward (row-major tokens x [E, a, b]) and the two grouped GEMMs autograd runs for it need no
    multiple, and may meet an expert that got no token (tests/model/test_moe_grouped_alignment.py
    records all three)."""
    def row_major(t):
        return t.stride(-1) == 1

    def elements(t):
        return 16 // t.element_size()

    if a.dim() == 2 and b.dim() == 3:  # groups of rows (M)
        return (1 if row_major(a) else elements(a)), True
    if a.dim() == 3 and b.dim() == 2:  # groups of output columns (N); the output, a's dtype, is row-major
        return max(elements(a), elements(b) if row_major(b) else 1), True
    # 2D x 2D: groups along the contraction (K), a weight gradient; CUTLASS takes no empty group
    # there unless a is column-major and b row-major
    need = max(elements(a) if row_major(a) else 1, 1 if row_major(b) else elements(b))
    return need, (not row_major(a)) and row_major(b)


def fused_operands(device_type: str, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused kernel takes these operands at any group sizes: on CUDA every row stride
    and base address 16-byte aligned (a model width that is not a multiple of 8 bf16 elements
    fails torch's check inside the first step) and no multiple on the group sizes; otherwise
    the per-expert matmuls run it (correct, one host read per call)."""
    if device_type != "cuda":
        return True

    def leading(t):  # the stride between rows (row-major) or columns (column-major)
        return t.stride(-2) if t.stride(-1) == 1 else t.stride(-1)

    # The base address by the offset into its storage (allocations themselves are aligned far
    # beyond 16 bytes): readable from a fake tensor too, which has no data pointer.
    aligned = all((leading(t) * t.element_size() % 16 == 0 and t.storage_offset() * t.element_size() % 16 == 0)
                  for t in (x, w))
    return aligned and cuda_group_rule(x, w)[0] == 1


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, a] split into len(w) row groups ending at `offs`, each times its w[g] [a, b]."""
    if fused_grouped_mm(x.device.type, x.dtype) and fused_operands(x.device.type, x, w):
        return F.grouped_mm(x, w, offs=offs)
    # Other dtypes (fp32 training on CUDA) fall back to one matmul per group, which reads the
    # group sizes to the host: a sync per call. bf16 (autocast, FSDP's bf16 policy) avoids it.
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    return torch.cat([xg @ w[g] for g, xg in enumerate(torch.split(x, sizes))])


class GroupedExperts(nn.Module):
    """n SwiGLU experts stored as [n, in, out] tensors so that all experts run as one grouped
    matmul over expert-sorted tokens."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by (local) expert; counts [n_local] rows per expert."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        offs = counts.cumsum(0).to(torch.int32)
        # Autocast does not cast grouped_mm's operands, so fp32 master weights would keep the
        # experts in fp32 (on CUDA: the per-expert fallback). Cast them like autocast casts a
        # linear's; the gradients flow back to the fp32 weights through the cast.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w1.dtype
        x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        h = F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs)
        return grouped_mm(h.contiguous(), w2, offs)


class SharedExperts(FeedForward):
    """The always-active experts: one SwiGLU of n_shared x the expert width (exactly the same
    function and parameter count as n_shared separate experts summed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(lin.weight) for lin in (self.w1, self.w2, self.w3))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer output whose backward also seeds the auxiliary loss with
    `scale`. The loss then needs no plumbing through the model's return value, which keeps it
    working on every pipeline stage (only the last stage sees the training loss)."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def _recomputing() -> bool:
    # Activation checkpointing re-runs forward inside backward; its statistics were already counted.
    return recomputing()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _eager_methods()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.n_active_experts
        self.router_kind = cfg.router
        self.load_balance = cfg.load_balance
        self.aux_loss_coef = cfg.aux_loss_coef
        self.bias_update_rate = cfg.aux_free_update_rate
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared_experts = (SharedExperts(cfg.dim, cfg.n_shared_experts * cfg.expert_ffn_dim)
                               if cfg.n_shared_experts else None)
        # Aux-loss-free balancing: added to the scores for expert *selection* only. A buffer, so it
        # is checkpointed but never touched by the optimizer.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        self.exchange: Callable | None = None
        # Context parallel: sums per-sequence statistics over the ranks sharing a sequence.
        self.sequence_reduce: Callable | None = None
        # Gradient weight of this forward's summed per-sequence aux loss (the trainer sets
        # 1 / sequences-per-rank-per-step); None means the mean over this forward's sequences.
        self.aux_scale: float | None = None
        self.stats: torch.Tensor | None = None

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.expert_bias.zero_()
        self.stats = None

    # ---- routing --------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (probs [T, E] summing to 1 per token, top_idx [T, k], top_w [T, k])."""
        with torch.autocast(x.device.type, enabled=False):
            # fp32 even under bf16: rounding would reorder experts with close scores.
            logits = F.linear(x.float(), _local(self.router.weight).float())
        scores = logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()
        select = scores + self.expert_bias if self.load_balance == "aux_free" else scores
        top_idx = select.topk(self.top_k, dim=-1).indices
        top_w = scores.gather(-1, top_idx)
        if self.top_k > 1:  # Mixtral/DeepSeek-V3: the chosen experts' weights sum to 1
            top_w = top_w / top_w.sum(-1, keepdim=True)
        probs = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probs, top_idx, top_w

    def capacity(self, seq_len: int) -> int:
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)

    def keep_mask(self, top_idx: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
        """[T, k] bool: which assignments fit in their (sequence, expert) capacity."""
        k, n_exp = self.top_k, self.n_experts
        slot_major = top_idx.view(batch, seq_len, k).transpose(1, 2).reshape(batch, k * seq_len)
        key = (torch.arange(batch, device=top_idx.device)[:, None] * n_exp + slot_major).flatten()
        order = torch.sort(key, stable=True).indices
        counts = occurrences(key, batch * n_exp)
        starts = counts.cumsum(0) - counts
        rank = torch.empty_like(key)
        rank[order] = torch.arange(key.numel(), device=key.device) - starts[key[order]]
        keep = rank < self.capacity(seq_len)
        return keep.view(batch, k, seq_len).transpose(1, 2).reshape(batch * seq_len, k)

    # ---- experts --------------------------------------------------------------------------
    # Eager (_EAGER_METHODS): token counts are data-dependent, and grouped_mm's compile-time (meta)
    # rule accepts bf16 only.
    def routed(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
               keep: torch.Tensor | None) -> torch.Tensor:
        """Weighted sum of each token's kept experts' outputs, [T, dim]."""
        n_tok, k = top_idx.shape
        flat_idx = top_idx.flatten()
        assign = torch.arange(n_tok * k, device=x.device) if keep is None else keep.flatten().nonzero().squeeze(1)
        experts_of = flat_idx[assign]
        order = torch.sort(experts_of, stable=True).indices
        assign = assign[order]
        counts = occurrences(experts_of, self.n_experts)
        xs = x[assign // k]
        ys = self.exchange(xs, counts, self.experts) if self.exchange is not None else self.experts(xs, counts)
        # Back to (token, slot) order, dropped slots zero; summing over the k slots of a token in a
        # fixed order keeps the result independent of how tokens were grouped for the experts.
        slots = x.new_zeros(n_tok * k, x.shape[-1]).index_copy(0, assign, ys.to(x.dtype))
        return (slots.view(n_tok, k, -1) * top_w.unsqueeze(-1).to(x.dtype)).sum(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        flat = x.reshape(-1, dim)
        probs, top_idx, top_w = self.route(flat)
        keep = self.keep_mask(top_idx, batch, seq_len) if self.capacity_factor > 0 else None
        out = self.routed(flat, top_idx, top_w, keep).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        # Only training forwards count: validation (eval mode) routes its windows and the padded
        # rows filling its last batch, and must not feed the next step's bias update or metrics.
        record = self.training and not _recomputing()
        attach = self.load_balance == "aux_loss" and self.aux_loss_coef > 0 and torch.is_grad_enabled()
        aux = None
        if attach:
            aux = self.sequence_balance(probs, top_idx, batch, seq_len)
        elif record:
            # Outside autograd: a recompute (which skips this) must save the same tensors.
            with torch.no_grad():
                aux = self.sequence_balance(probs, top_idx, batch, seq_len)
        if record:
            self._record(probs, top_idx, keep, aux, batch)
        if attach:
            scale = self.aux_scale if self.aux_scale is not None else 1.0 / batch
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_coef * scale)
        return out

    def sequence_balance(self, probs, top_idx, batch: int, seq_len: int) -> torch.Tensor:
        """Sum over sequences of sum_e f_e P_e, where f_e = (E / (k S)) x selections of e and
        P_e = the mean router probability of e; 1.0 per sequence when perfectly balanced."""
        n_exp, k = self.n_experts, self.top_k
        sel = torch.zeros(batch, n_exp, device=probs.device, dtype=probs.dtype)
        picks = top_idx.view(batch, seq_len * k)
        sel.scatter_add_(1, picks, torch.ones_like(picks, dtype=probs.dtype))
        parts = torch.cat([sel, probs.view(batch, seq_len, n_exp).sum(1), sel.new_full((batch, 1), seq_len)], 1)
        if self.sequence_reduce is not None:  # this rank holds only part of each sequence
            parts = self.sequence_reduce(parts)
        sel, prob_sum, tokens = parts.split([n_exp, n_exp, 1], dim=1)
        return ((sel * n_exp / (k * tokens)) * (prob_sum / tokens)).sum()

    @torch.no_grad()  # and eager (_EAGER_METHODS)
    def _record(self, probs, top_idx, keep, aux, batch: int) -> None:
        row = torch.zeros(self.n_experts + 5, dtype=torch.float64, device=probs.device)
        row[: self.n_experts] = occurrences(top_idx.flatten(), self.n_experts).double()
        extra = row[self.n_experts:]
        if keep is not None:  # a tensor copy, not float(): no host sync per layer and micro-batch
            extra[_DROPPED] = (~keep).sum()
        extra[_ENTROPY] = -(probs * probs.clamp_min(1e-30).log()).sum().double()
        extra[_TOKENS] = float(top_idx.shape[0])
        extra[_AUX] = aux.detach().double()
        extra[_SEQS] = float(batch)
        self.stats = row if self.stats is None else self.stats + row


# Methods Dynamo must not trace: torch.compiler.disable is applied to them as the first MoE is
# built, not as this module is imported, since it imports torch._dynamo (about 3 s on a slow
# CPU) that a dense model, and so `generate` or `export` of one, never needs.
_EAGER_METHODS = ("routed", "_record")


@functools.cache
def _eager_methods() -> None:
    for name in _EAGER_METHODS:
        setattr(MoE, name, torch.compiler.disable(getattr(MoE, name)))


# ---- what the trainer calls ---------------------------------------------------------------


def moe_layers(model_parts) -> list[tuple[str, MoE]]:
    """(layer index, MoE) for every MoE layer held by this rank, in layer order."""
    out = []
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                parts = name.split(".")
                out.append((parts[parts.index("layers") + 1] if "layers" in parts else name, module))
    return sorted(out, key=lambda lm: int(lm[0]) if lm[0].isdigit() else -1)


def set_aux_scale(layers: list[tuple[str, MoE]], scale: float) -> None:
    for _, moe in layers:
        moe.aux_scale = scale


@torch.no_grad()
def step_statistics(layers: list[tuple[str, MoE]], all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    applied: torch.Tensor | float = 1.0) -> torch.Tensor | None:
    """After the step's backward: sum its routing statistics over the ranks that saw different
    tokens (`all_reduce`, in place), apply the aux-loss-free bias update from that global load
    times `applied` (the step's device flag, 0.0 for a skipped step), reset the counters, and
    return the statistics, one row per layer, still on the device: nothing is read here, so the
    trainer reads them with the step's other values (`step_metrics` turns the rows into metrics)."""
    if not layers:
        return None
    rows = []
    for _, moe in layers:
        rows.append(moe.stats if moe.stats is not None
                    else torch.zeros(moe.n_experts + 5, dtype=torch.float64, device=moe.expert_bias.device))
        moe.stats = None
    width = max(r.numel() for r in rows)
    stats = torch.stack([F.pad(r, (0, width - r.numel())) for r in rows])
    if all_reduce is not None:
        all_reduce(stats)
    for (_, moe), device_row in zip(layers, stats):
        if moe.load_balance == "aux_free":
            # DeepSeek-V3: push overloaded experts down and underloaded ones up by a fixed step,
            # on the device. A layer that saw no token has a zero load and so a zero sign: no move.
            load = device_row[:moe.n_experts]
            step = moe.bias_update_rate * torch.sign(load.mean() - load) * applied
            moe.expert_bias += step.to(moe.expert_bias)
    return stats


def step_metrics(layers: list[tuple[str, MoE]], flat: list[float]) -> dict:
    """The metrics row's MoE entries from `step_statistics`' rows, read to the host (flattened)."""
    width = len(flat) // len(layers)
    host = [flat[i * width:(i + 1) * width] for i in range(len(layers))]
    metrics: dict = {}
    worst, dropped, assigned, entropy, aux = 1.0, 0.0, 0.0, 0.0, 0.0
    for (layer, moe), row in zip(layers, host):
        n_exp = moe.n_experts
        load, extra = row[:n_exp], row[n_exp:]
        tokens = max(extra[_TOKENS], 1.0)
        imbalance = max(load) / max(sum(load) / n_exp, 1e-12)
        prefix = f"moe/layer{layer}"
        metrics[f"{prefix}/tokens_per_expert"] = [int(v) for v in load]
        metrics[f"{prefix}/imbalance"] = imbalance
        metrics[f"{prefix}/dropped_frac"] = extra[_DROPPED] / (tokens * moe.top_k)
        metrics[f"{prefix}/router_entropy"] = extra[_ENTROPY] / tokens
        worst = max(worst, imbalance)
        dropped += extra[_DROPPED]
        assigned += tokens * moe.top_k
        entropy += extra[_ENTROPY] / tokens
        if moe.load_balance == "aux_loss":
            aux += moe.aux_loss_coef * extra[_AUX] / max(extra[_SEQS], 1.0)
    metrics["moe/imbalance"] = worst
    metrics["moe/dropped_frac"] = dropped / max(assigned, 1.0)
    metrics["moe/router_entropy"] = entropy / len(layers)
    metrics["moe/aux_loss"] = aux
    return metrics


def end_step(layers: list[tuple[str, MoE]], all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
             update_bias: bool = True) -> dict:
    """`step_statistics` read at once, as metrics: for a caller outside the training step (the
    trainer reads them with the step's values instead)."""
    stats = step_statistics(layers, all_reduce, 1.0 if update_bias else 0.0)
    return {} if stats is None else step_metrics(layers, stats.flatten().tolist())
