"""Context parallel: the sequence dimension sharded over the `cp` mesh dim.

Load-balanced causal chunking: the sequence is cut into 2*cp equal chunks and cp rank r holds
chunks r and 2*cp-1-r. Under a causal mask an early chunk attends to little and a late one to
a lot, so pairing them gives every rank the same attention work (a contiguous split would leave
rank 0 idle while the last rank does ~2x the average).

Everything outside attention is per-token, so it runs unchanged on the local tokens; three
things know about the split:
- the trainer shards inputs/targets with `shard_sequence` and passes `cp_positions` to the
  model, so RoPE rotates by true global positions;
- attention (`Attention.sdpa`) is replaced by ring or all-gather attention (ring_attention.py),
  which relies on exactly this layout, each block on the device's fused kernel
  (block_attention.py; the hook logs once if it must fall back to the portable one); with
  document masking the trainer shards the document ids and positions the same way, and the
  hook gathers all ranks' ids once per forward;
- the loss: each rank normalises by its own tokens, and FSDP's gradient average over the
  (dp_replicate, dp_shard x cp) mesh turns that into the exact global token mean.

With tensor parallel, tp shards heads and cp shards the sequence: the TP region (and its
sequence-parallel shards) sees the cp-local sequence, and each tp rank runs cp attention over
its own heads with its cp peers.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ndtrain.parallel.block_attention import PORTABLE, kernel_for
from ndtrain.parallel.ring_attention import CPComm, context_attention

_log = logging.getLogger(__name__)


# ---- layout ----------------------------------------------------------------------------------
def cp_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds: chunks rank and 2*cp-1-rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} is not divisible by 2*cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of `x` along `dim` (a contiguous copy)."""
    if cp == 1:
        return x
    return x.index_select(dim, cp_positions(x.shape[dim], cp, rank, x.device))


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the per-rank shards (in cp-rank order) back in global order."""
    cp = len(parts)
    n = parts[0].shape[dim] * cp
    order = torch.cat([cp_positions(n, cp, r) for r in range(cp)])
    out = torch.cat(parts, dim=dim)
    return out.index_select(dim, torch.argsort(order).to(out.device))


# ---- the attention hook ----------------------------------------------------------------------
class ContextParallelSDPA:
    """Drop-in for `Attention.sdpa` (q: [b, h, s_local, d], k, v: [b, h_kv, s_local, d], K/V not
    expanded to q's heads, so they travel at their own size). A plain object, not a module,
    so it adds nothing to the state dict; the process group lives inside `CPComm`."""

    def __init__(self, group, mode: str = "ring"):
        self.comm = CPComm(group, mode)
        self._docs: tuple | None = None  # (local ids, all ranks' ids) of the forward in progress
        self._told: set[str] = set()  # portable-path reasons already logged (once per model, not per layer)

    def _gather_docs(self, doc_ids: torch.Tensor) -> list[torch.Tensor]:
        # Every layer is called with the same tensor: one all-gather per forward (and per
        # recompute under activation checkpointing), not one per layer.
        if self._docs is None or self._docs[0] is not doc_ids:
            parts = [torch.empty_like(doc_ids) for _ in range(self.comm.size)]
            torch.distributed.all_gather(parts, doc_ids.contiguous(), group=self.comm.group)
            self._docs = (doc_ids, parts)
        return self._docs[1]

    @torch.compiler.disable  # p2p collectives inside a custom autograd function: keep it eager
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        docs = None if doc_ids is None else self._gather_docs(doc_ids)
        kernel = kernel_for(q, docs is not None)
        if kernel.name == PORTABLE and kernel.reason not in self._told:
            self._told.add(kernel.reason)
            _log.warning("context-parallel attention runs the portable (unfused, several times slower) "
                         "block kernel: %s", kernel.reason)
        return context_attention(q, k, v, self.comm, docs=docs, kernel=kernel)

    def __repr__(self) -> str:
        return f"ContextParallelSDPA(cp={self.comm.size}, rank={self.comm.rank}, mode={self.comm.mode})"


def _require_positions(module, args, kwargs):
    positions = args[1] if len(args) > 1 else kwargs.get("positions")
    if positions is None:
        raise RuntimeError("this model is context-parallel: call it with positions=cp_positions(...) "
                           "(the default 0..s-1 would be the wrong RoPE positions for a sequence shard)")


def apply_context_parallel(model: nn.Module, mesh, par) -> None:
    """Swap every block's attention kernel for context-parallel attention over mesh['cp']."""
    group = mesh["cp"].get_group()
    sdpa = ContextParallelSDPA(group, par.cp_attention)
    for block in model.layers.values():
        block.attention.sdpa = sdpa
    model.register_forward_pre_hook(_require_positions, with_kwargs=True)
