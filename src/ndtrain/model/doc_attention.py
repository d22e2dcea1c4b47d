"""Attention paths that CUDA takes: flex attention for document masks, built once per micro-batch,
and whether SDPA's fused kernels take grouped-query K/V as they are.

A dense [s, s] mask per row costs O(s^2) memory and makes SDPA fall back to its math kernel;
flex attention evaluates `mask_mod` per block and skips blocks that are fully masked, so packed
long sequences cost what their documents cost. On CPU, ndtrain uses SDPA with the dense mask
(llama.causal_sdpa): flex attention has no CPU backward in torch 2.13.

The block mask depends only on the document ids, so `DocumentMask` builds it once where the ids
enter the model (Transformer.forward), outside the checkpointed blocks: every layer and every
recompute reuses it. Built inside a block instead, it was rebuilt per layer and again in the
recompute (8 builds per micro-batch for 4 layers), and its ops would have run under selective
checkpointing's op-by-op caching.

The CPU suite runs this path eagerly (tests/parallel/test_document_mask.py lifts torch's refusal
of flex backward on CPU and takes the `uses_flex` branch); the compiled kernel runs on a GPU.
"""

from __future__ import annotations

import functools

import torch


def uses_flex(device: torch.device) -> bool:
    """Document masks go through flex attention on CUDA, the dense mask and SDPA elsewhere."""
    return device.type == "cuda"


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # flex attention is only fast compiled; compiling the kernel once serves every shape.
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=1)
def _compiled_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    # Eager, create_block_mask evaluates mask_mod on the whole [b, s, s] grid, each lookup of the
    # ids an int64 tensor of that size: 236 MiB of transient host memory per row at s = 4096
    # (measured on CPU), growing with s^2 (~15 GiB at 32768). Compiled, the evaluation fuses into
    # the per-block reduction: no growth at all in the same measurement.
    return torch.compile(create_block_mask)


def document_block_mask(doc_ids: torch.Tensor, compiled: bool = True):
    """The flex BlockMask of block-causal attention within documents; doc_ids: [b, s]."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = doc_ids.shape

    def mask_mod(batch, head, qi, ki):
        return (qi >= ki) & (doc_ids[batch, qi] == doc_ids[batch, ki])

    build = _compiled_block_mask() if compiled else create_block_mask
    # H=None: one mask for every head, so it serves tensor parallel's local heads as well.
    return build(mask_mod, b, None, s, s, device=doc_ids.device)


class DocumentMask:
    """One micro-batch's document ids [b, s] with their flex block mask, built once. It travels
    where the ids did (the `doc_ids` argument of blocks and attention); a kernel that wants plain
    ids (context parallel's) gets `.doc_ids` from Block.forward. A plain object, not a tensor:
    FSDP's input casts and tensor parallel's input plans pass it through untouched."""

    __slots__ = ("doc_ids", "block_mask")

    def __init__(self, doc_ids: torch.Tensor):
        self.doc_ids = doc_ids
        self.block_mask = document_block_mask(doc_ids)

    def __repr__(self) -> str:
        return f"DocumentMask({tuple(self.doc_ids.shape)}, {self.doc_ids.device})"


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            doc_ids: torch.Tensor | DocumentMask, compiled: bool = True) -> torch.Tensor:
    """q: [b, h, s, d]; k, v: [b, h_kv, s, d] with h_kv dividing h (flex reads each K/V head for its
    query group: no expanded copy); doc_ids: [b, s] ids or their DocumentMask. Block-causal."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = doc_ids.block_mask if isinstance(doc_ids, DocumentMask) else document_block_mask(doc_ids, compiled)
    fn = _compiled_flex() if compiled else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def fused_gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether SDPA's fused kernel takes q [b, h, s, d] with k, v [b, h_kv, s, d] (causal, no
    mask) under enable_gqa. On CPU (torch 2.13) the flash kernel does, mask or not, in every
    dtype the model attends in (checked op by op). On CUDA flash does (fp16/bf16, sm80+), but
    the efficient kernel (fp32) has not in every torch release, and where no fused kernel takes
    GQA, enable_gqa lands on the math kernel, which materialises [b, h, s, s] scores: the caller
    expands K/V instead. torch's own checks, so the answer follows the installed torch (and
    torch.compile traces them)."""
    if not q.is_cuda:
        return True
    cuda = torch.backends.cuda
    params = cuda.SDPAParams(q, k, k, None, 0.0, True, True)
    return cuda.can_use_flash_attention(params) or cuda.can_use_efficient_attention(params) \
        or cuda.can_use_cudnn_attention(params)
