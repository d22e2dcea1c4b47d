"""One block of context-parallel attention: (output, log-sum-exp) forward and its backward, on
the fused kernel the device has, normalised so the ring's merge sees one form on every device.

The ring (ring_attention.py) needs two things a plain attention call hides: each block's
log-sum-exp (to merge blocks by online softmax) and a backward that takes the *global* output
and log-sum-exp (so per-block gradients sum to the exact one). torch's fused kernels expose both
through their aten ops; each has its own conventions, all read from torch 2.13's schemas and
meta registrations (torch/_meta_registrations.py) and the CUDA sources:

- `flash` (CUDA): `_scaled_dot_product_flash_attention` and its `_backward`; lse fp32
  [b, h, sq], natural log; the backward takes back the forward's cum_seq/max/philox outputs;
- `efficient` (CUDA): `_scaled_dot_product_efficient_attention` and its `_backward`; lse fp32
  [b, h, ceil(sq/32)*32], natural log, the alignment tail +inf; takes an additive bias;
- `cpu-flash`: `_scaled_dot_product_flash_attention_for_cpu` and its `_backward`; lse [b, h, sq]
  (a view of a [b, sq, h] buffer), natural log, fp32 (fp64 for fp64 inputs); takes a mask.

Normalised form, whatever ran: out [b, h, sq, d] in q's dtype; lse fp32 [b, h, sq]; a query row
that sees no key (document masking) has out 0 and lse -inf, so the merge gives it no weight
(CPU's kernel reports lse 0 for such a row; what the CUDA kernels report is not relied on).

Which kernel (`pick_kernel`): CUDA runs flash for fp16/bf16 without a mask (head_dim a multiple
of 8 up to 256, compute capability 8.0+), else the efficient kernel (fp32 too, and masks as an
additive bias: the one fused CUDA kernel here that takes a dense mask and returns the lse). CPU
runs its fused flash kernel (it takes masks). The portable path (fp32 score chunks, a backward
that materialises probabilities) is kept only for what no fused kernel takes, and says why.

Masks enter every fused kernel as one additive bias, built once per block by `_bias`: in q's
dtype, expanded (a view) to [b, h, sq, sk], its rows padded to 16 elements as the efficient
kernel's alignment check demands; CPU takes the same tensor, so the CPU suite runs that layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ndtrain.compat.torch import aten_op

def _op(key: str):
    """A private aten kernel (compat.torch names them all and refuses a missing one in a line)."""
    return aten_op(key)


FLASH, EFFICIENT, CPU_FLASH, PORTABLE = "flash", "efficient", "cpu-flash", "portable"
_LSE_ALIGN = 32  # the efficient kernel pads lse rows to this (kAlignLSE)
_BIAS_ALIGN = 16  # and wants the bias row stride a multiple of its 16-byte vector width


@dataclass(frozen=True)
class Kernel:
    name: str
    reason: str = ""  # why the portable path, when it is


def pick_kernel(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool,
                capability: tuple[int, int] | None = None) -> Kernel:
    """The fused kernel for this device/dtype/head size (and whether a mask must be applied)."""
    if device_type == "cpu":
        if dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            return Kernel(CPU_FLASH)
        return Kernel(PORTABLE, f"no fused CPU attention kernel for {dtype}")
    if device_type != "cuda":
        return Kernel(PORTABLE, f"no fused attention kernel wired for device {device_type!r}")
    half = dtype in (torch.float16, torch.bfloat16)
    sm80 = capability is None or capability >= (8, 0)
    if half and not masked and head_dim % 8 == 0 and head_dim <= 256 and sm80:
        return Kernel(FLASH)
    # The efficient kernel loads 16-byte vectors: head_dim a multiple of 8 halves or 4 floats.
    vector = head_dim % (8 if half else 4) == 0
    if vector and ((half and (dtype == torch.float16 or sm80)) or dtype == torch.float32):
        return Kernel(EFFICIENT)
    return Kernel(PORTABLE, f"no fused CUDA attention kernel for {dtype} with head_dim {head_dim}")


def kernel_for(q: torch.Tensor, masked: bool) -> Kernel:
    cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return pick_kernel(q.device.type, q.dtype, q.shape[-1], masked, cap)


def _bias(mask: torch.Tensor, dtype: torch.dtype, heads: int) -> torch.Tensor:
    """[b, 1|h, sq, sk] bool -> additive [b, h, sq, sk] (0 / -inf) in `dtype`."""
    b, _, sq, sk = mask.shape
    width = math.ceil(sk / _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.full((b, mask.shape[1], sq, width), float("-inf"), dtype=dtype, device=mask.device)[..., :sk]
    return bias.masked_fill_(mask, 0.0).expand(b, heads, sq, sk)


def _rows_dense(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] whose memory is [b, s, h, d] with dense rows: the efficient backward reads
    `out` with an implied row stride of h*d (o_strideM), whatever its real strides."""
    b, h, s, d = t.shape
    if t.stride(3) == 1 and t.stride(1) == d and t.stride(2) == h * d:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _empty_rows(out, lse, mask):
    """A row that sees no key weighs nothing: out 0, lse -inf (whatever the kernel reported)."""
    empty = ~mask.any(-1)
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))


def forward(kernel: Kernel, q, k, v, causal: bool, scale: float, mask=None, rows: int = 1024):
    """(out, lse, aux): the normalised block result and what the backward kernel needs from it."""
    if kernel.name == PORTABLE:
        return (*_portable_forward(q, k, v, causal, scale, rows, mask), ())
    bias = None if mask is None else _bias(mask, q.dtype, q.shape[1])
    causal = causal and mask is None  # a mask has causality folded in
    if kernel.name == CPU_FLASH:
        out, lse = _op("sdpa_cpu_flash")(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        aux = ()
    elif kernel.name == FLASH:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _op("sdpa_flash")(
            q, k, v, 0.0, causal, False, scale=scale)
        aux = (cum_q, cum_k, max_q, max_k, seed, offset)
    else:
        out, lse, seed, offset = _op("sdpa_efficient")(
            q, k, v, bias, True, 0.0, causal, scale=scale)
        aux = (seed, offset, lse.shape[-1])
        lse = lse[..., :q.shape[-2]]  # drop the alignment tail
    lse = lse.float()
    if mask is not None:
        out, lse = _empty_rows(out, lse, mask)
    return out, lse, aux


def backward(kernel: Kernel, go, q, k, v, out, lse, causal: bool, scale: float, mask=None, aux=None,
             rows: int = 1024):
    """(dq, dk, dv) of one block, given the *global* out and lse of q's rows; `aux` is what this
    block's forward returned (None: rebuilt, as a dropout-free forward returns it)."""
    if kernel.name == PORTABLE:
        return _portable_backward(go, q, k, v, out, lse, causal, scale, rows, mask)
    bias = None if mask is None else _bias(mask, q.dtype, q.shape[1])
    causal = causal and mask is None
    # The kernels index lse rows by their own count: a row-sliced view must be made contiguous
    # (torch's own ring attention notes the same).
    lse = lse.contiguous()
    if kernel.name == CPU_FLASH:
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        return _op("sdpa_cpu_flash_backward")(
            go, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    sq, sk = q.shape[-2], k.shape[-2]
    if kernel.name == FLASH:
        cum_q, cum_k, max_q, max_k, seed, offset = aux or (None, None, sq, sk, *_no_rng(q))
        return _op("sdpa_flash_backward")(
            go, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    seed, offset, width = aux or (*_no_rng(q), math.ceil(sq / _LSE_ALIGN) * _LSE_ALIGN)
    if width > sq:  # give back the padded layout the forward produced; +inf rows weigh nothing
        lse = torch.cat([lse, lse.new_full((*lse.shape[:-1], width - sq), float("inf"))], dim=-1)
    dq, dk, dv, _ = _op("sdpa_efficient_backward")(
        go, q, k, v, bias, _rows_dense(out), lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv


def _no_rng(q):
    # Without dropout the kernels never read the philox seed/offset; these stand in for them.
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


# ---- the portable path: only for what no fused kernel takes ----------------------------------
def _portable_forward(q, k, v, causal: bool, scale: float, rows: int, mask):
    # fp32 scores for `rows` queries at a time, so the transient stays O(rows x keys).
    outs, lses = [], []
    for r0 in range(0, q.shape[-2], rows):
        qc = q[..., r0:r0 + rows, :]
        kend = min(k.shape[-2], r0 + qc.shape[-2]) if causal and mask is None else k.shape[-2]
        m = None if mask is None else mask[..., r0:r0 + rows, :]
        sc = _scores(qc, k[..., :kend, :], causal and mask is None, scale, r0, m)
        lse = torch.logsumexp(sc, dim=-1)
        safe = lse.masked_fill(torch.isinf(lse), 0.0)  # a fully masked row: exp(-inf) = 0, not nan
        outs.append(torch.matmul(torch.exp(sc - safe.unsqueeze(-1)), v[..., :kend, :].float()))
        lses.append(lse)
    return torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)


def _portable_backward(go, q, k, v, out, lse, causal: bool, scale: float, rows: int, mask):
    if mask is not None:
        causal = False  # folded into the mask
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for r0 in range(0, q.shape[-2], rows):
        qc, gc = q[..., r0:r0 + rows, :].float(), go[..., r0:r0 + rows, :].float()
        kend = min(k.shape[-2], r0 + qc.shape[-2]) if causal else k.shape[-2]
        kc, vc = k[..., :kend, :].float(), v[..., :kend, :].float()
        m = None if mask is None else mask[..., r0:r0 + rows, :]
        p = torch.exp(_scores(qc, kc, causal, scale, r0, m) - lse[..., r0:r0 + rows].unsqueeze(-1))
        dv[..., :kend, :] += torch.matmul(p.transpose(-1, -2), gc)
        delta = (gc * out[..., r0:r0 + rows, :].float()).sum(-1, keepdim=True)
        ds = p * (torch.matmul(gc, vc.transpose(-1, -2)) - delta) * scale
        dq[..., r0:r0 + rows, :] = torch.matmul(ds, kc)
        dk[..., :kend, :] += torch.matmul(ds.transpose(-1, -2), qc)
    return dq, dk, dv


def _scores(q, k, causal: bool, scale: float, row0: int = 0, mask=None) -> torch.Tensor:
    """fp32 scores; `causal` masks keys after each query's own position (row0 + row), `mask`
    (bool, broadcastable) keeps only the keys it marks."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if causal:
        r = torch.arange(s.shape[-2], device=s.device)[:, None] + row0
        s = s.masked_fill(torch.arange(s.shape[-1], device=s.device)[None, :] > r, float("-inf"))
    return s
