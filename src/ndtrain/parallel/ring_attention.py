"""Causal attention over a sequence sharded across context-parallel (cp) ranks.

Layout (see context.py): the sequence is cut into 2*cp equal chunks and cp rank r holds chunks
r and 2*cp-1-r, concatenated. With that layout the causal structure between a rank's queries
and another rank j's keys/values is one of three shapes, each a dense rectangle:

- j == r: the rank's own block, plain causal (local order is global order);
- j <  r: every query sees j's first chunk (all earlier positions), none of its second chunk;
- j >  r: only the second query chunk sees anything, and it sees both of j's chunks.

So every rank does the same amount of work per block (load balance), and no block needs an
explicit mask. Blocks are combined with the online-softmax rule: a running output and
log-sum-exp per query row, rescaled as each block arrives.

Two ways to bring the other ranks' K/V:
- ring: each step sends the current K/V block to the next rank and receives the previous
  rank's, started before this step's compute so the transfer overlaps it; peak extra memory is
  one block;
- allgather: one all-gather of every rank's K/V (what Llama 3 did); simpler, cp blocks in memory.

Backward is our own: only the local q, k, v, output and log-sum-exp are saved (as a fused
attention kernel would), and the K/V blocks are brought round again. Each block's gradient uses
the *global* output and log-sum-exp, which makes the per-block terms sum to the exact gradient.
Key/value gradients travel back to their owner: in the ring they follow the K/V round and
arrive home after cp hops; with all-gather one reduce-scatter returns them.

Document masking: every rank knows all ranks' document ids (gathered once per forward), so each
block adds a mask `same document` (and causal for its own block). A query row can then see
nothing of a block; such a row gets log-sum-exp -inf and output 0, which the merge ignores.

Grouped-query attention: K/V travel with their own h_kv heads, not expanded to q's h heads, so
every transfer (K/V and their gradients) is h/h_kv times smaller. Each block is expanded only
locally, for its compute, and its dK/dV are summed over each head group before they are sent.

Block kernels (block_attention.py): one attention call picks the device's fused kernel once
(CUDA flash or efficient, CPU flash) and every block runs it; their outputs are normalised to one
(out, lse) form, so the merge and the backward below are the same code on every device, and the
CPU suite runs what a GPU runs. Each block's forward state goes back to its backward kernel.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ndtrain.model.llama import expand_kv
from ndtrain.parallel import block_attention as blocks
from ndtrain.parallel.block_attention import Kernel

_TAG_KV, _TAG_DKV = 11, 12


# ---- one block: (out, lse) and its gradient --------------------------------------------------
def block_forward(q, k, v, causal: bool, scale: float, fused: bool = True, rows: int = 1024, mask=None,
                  kernel: Kernel | None = None):
    """Attention of q over one K/V block; returns (out in q's dtype, log-sum-exp fp32 [b, h, s]).
    `mask` ([b, 1, sq, sk] bool, causal already folded in) selects the keys each query may see.
    The kernel is the device's fused one (block_attention.py), or the portable path if not `fused`."""
    out, lse, _ = blocks.forward(_kernel(q, mask, fused, kernel), q, k, v, causal, scale, mask, rows)
    return out, lse


def block_backward(go, q, k, v, out, lse, causal: bool, scale: float, fused: bool = True, rows: int = 1024,
                   mask=None, kernel: Kernel | None = None, aux=None):
    """Gradients (dq, dk, dv) of one block given the final output and log-sum-exp of q's rows."""
    return blocks.backward(_kernel(q, mask, fused, kernel), go, q, k, v, out, lse, causal, scale, mask, aux, rows)


_ASKED_PORTABLE = Kernel(blocks.PORTABLE, "fused=False was asked for")


def _kernel(q, mask, fused: bool, kernel: Kernel | None) -> Kernel:
    if kernel is not None:
        return kernel
    return blocks.kernel_for(q, mask is not None) if fused else _ASKED_PORTABLE


def block_plan(rank: int, src: int, local_len: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) that rank `rank` attends to in `src`'s K/V block."""
    c = local_len // 2
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor, rows: slice):
    """Online softmax: fold one block's (out, lse) into the running fp32 accumulators in place."""
    o, l = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(l, blk_lse)
    o.mul_(torch.exp(l - new).unsqueeze(-1)).add_(blk_out.float() * torch.exp(blk_lse - new).unsqueeze(-1))
    l.copy_(new)


# ---- communication ---------------------------------------------------------------------------
class CPComm:
    """K/V exchange over one cp process group, in ring or all-gather mode."""

    def __init__(self, group, mode: str):
        if mode not in ("ring", "allgather"):
            raise ValueError(f"cp attention mode must be 'ring' or 'allgather', got {mode!r}")
        self.group, self.mode = group, mode
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def order(self) -> list[int]:
        # Own block first (every row then has a finite log-sum-exp), then the ring's order; the
        # all-gather path uses the same order so both modes round identically.
        return [(self.rank - t) % self.size for t in range(self.size)]

    def shift(self, t: torch.Tensor, tag: int):
        """Start sending `t` to the next rank and receiving the previous rank's into a new buffer."""
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag),
               dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)]
        return buf, dist.batch_isend_irecv(ops)

    def blocks(self, kv: torch.Tensor):
        """Yields (source rank, its K/V block [2, b, h, s, d]) in `order()`."""
        if self.mode == "allgather":
            # Collectives concatenate along dim 0: gather flat, then view one block per rank.
            full = torch.empty((self.size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
            dist.all_gather_single(full, kv, group=self.group)
            full = full.view(self.size, *kv.shape)
            for src in self.order():
                yield src, full[src]
            return
        cur = kv
        for step, src in enumerate(self.order()):
            pending = self.shift(cur, _TAG_KV) if step < self.size - 1 else None
            yield src, cur  # the caller computes on `cur` while the next block is in flight
            if pending is not None:
                buf, works = pending
                for w in works:
                    w.wait()
                cur = buf


class _DKVReturn:
    """Brings each K/V block's gradient back to its owner.

    ring: the gradient of block j rides the ring behind K/V, each holder adding its share; the
    hop started after step t completes while step t+1 computes, and the last hop lands at home.
    allgather: collect all blocks' gradients, then one reduce-scatter (a sum)."""

    def __init__(self, comm: CPComm, like: torch.Tensor):
        self.comm = comm
        self.pending = None
        self.all = torch.zeros((comm.size, *like.shape), dtype=torch.float32, device=like.device) \
            if comm.mode == "allgather" else None

    def add(self, src: int, part: torch.Tensor) -> None:
        if self.all is not None:
            self.all[src] += part
            return
        if self.comm.size == 1:  # a group of one (a one-rank benchmark): the gradient is home
            self.pending = (part, [])
            return
        if self.pending is not None:
            buf, works = self.pending
            for w in works:
                w.wait()
            part += buf
        self.pending = self.comm.shift(part, _TAG_DKV)

    def result(self) -> torch.Tensor:
        if self.all is not None:
            out = torch.empty_like(self.all[0])
            dist.reduce_scatter_single(out, self.all.flatten(0, 1), group=self.comm.group)
            return out
        buf, works = self.pending
        for w in works:
            w.wait()
        return buf


# ---- the autograd function -------------------------------------------------------------------
def _group_sum(g: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Inverse of `expand_kv` for gradients: [b, h, s, d] -> [b, n_kv, s, d], summing each group."""
    b, h, s, d = g.shape
    return g if h == n_kv else g.view(b, n_kv, h // n_kv, s, d).sum(2)


def _block_mask(docs, rank: int, src: int, rows: slice, keys: slice, causal: bool):
    """[b, 1, rows, keys] bool: same document (and causal within the rank's own block)."""
    if docs is None:
        return None
    m = docs[rank][:, rows, None] == docs[src][:, None, keys]
    if causal:
        m = m & torch.ones(m.shape[-2:], dtype=torch.bool, device=m.device).tril()
    return m[:, None]


def _forward_blocks(q, kv, comm: CPComm, scale: float, kernel: Kernel, docs=None):
    """Merged fp32 (out, lse) of q over every rank's block, and each block's kernel state (what
    its backward kernel takes back: philox seed/offset, sequence lengths, the lse padding)."""
    b, h, n, d = q.shape
    out = torch.zeros((b, h, n, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
    aux = {}
    for src, blk in comm.blocks(kv):
        rows, keys, causal = block_plan(comm.rank, src, n)
        k, v = expand_kv(blk[0][:, :, keys], h), expand_kv(blk[1][:, :, keys], h)
        o, l, aux[src] = blocks.forward(kernel, q[:, :, rows], k, v, causal, scale,
                                        _block_mask(docs, comm.rank, src, rows, keys, causal))
        _merge(out, lse, o, l, rows)
    return out, lse, aux


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: CPComm, kernel: Kernel, docs):
        scale = 1.0 / math.sqrt(q.shape[-1])
        out32, lse, aux = _forward_blocks(q, torch.stack([k, v]), comm, scale, kernel, docs)
        # Laid out as [b, s, h, d] in memory: the model's transpose+reshape before wo is then a
        # view, so the tensor saved here and wo's saved input are one buffer, not two.
        b, h, n, d = q.shape
        out = torch.empty((b, n, h, d), dtype=q.dtype, device=q.device).transpose(1, 2).copy_(out32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.scale, ctx.kernel, ctx.docs, ctx.aux = comm, scale, kernel, docs, aux
        return out

    @staticmethod
    def backward(ctx, go):
        q, k, v, out, lse = ctx.saved_tensors
        comm, scale, kernel, docs = ctx.comm, ctx.scale, ctx.kernel, ctx.docs
        go = go.contiguous()
        h, n, n_kv = q.shape[1], q.shape[2], k.shape[1]
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = _DKVReturn(comm, kv)
        for src, blk in comm.blocks(kv):
            rows, keys, causal = block_plan(comm.rank, src, n)
            bk, bv = expand_kv(blk[0][:, :, keys], h), expand_kv(blk[1][:, :, keys], h)
            gq, gk, gv = blocks.backward(kernel, go[:, :, rows], q[:, :, rows], bk, bv, out[:, :, rows],
                                         lse[:, :, rows], causal, scale,
                                         _block_mask(docs, comm.rank, src, rows, keys, causal), ctx.aux[src])
            dq[:, :, rows] += gq
            part = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            part[0][:, :, keys] = _group_sum(gk, n_kv)
            part[1][:, :, keys] = _group_sum(gv, n_kv)
            dkv.add(src, part)
        own = dkv.result()
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None


def context_attention(q, k, v, comm: CPComm, fused: bool = True, docs=None, kernel: Kernel | None = None):
    """Causal attention of this rank's queries over the whole cp-sharded sequence.
    q: [b, h, s_local, d], k, v: [b, h_kv, s_local, d] (h_kv divides h; not expanded, so only
    h_kv heads travel), all in the load-balanced layout. `docs`: every cp rank's local document
    ids ([b, s_local] each, in cp-rank order) for document-masked attention. `kernel`: the block
    kernel (default: the device's fused one, `block_attention.kernel_for`; portable if not `fused`)."""
    if q.shape[2] % 2:
        raise ValueError(f"context-parallel attention needs an even local sequence (two chunks), got {q.shape[2]}")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"K/V heads {k.shape[1]}/{v.shape[1]} must be equal and divide q's {q.shape[1]} heads")
    if kernel is None:
        kernel = blocks.kernel_for(q, docs is not None) if fused else _ASKED_PORTABLE
    return _ContextAttention.apply(q, k, v, comm, kernel, docs)
