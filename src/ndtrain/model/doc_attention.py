"""Document-masked attention on GPUs: flex attention with a block mask built from document ids.

A dense [s, s] mask per row costs O(s^2) memory and makes SDPA fall back to its math kernel;
flex attention evaluates `mask_mod` per block and skips blocks that are fully masked, so packed
long sequences cost what their documents cost. On CPU, ndtrain uses SDPA with the dense mask
(llama.causal_sdpa): flex attention has no CPU backward in torch 2.13.

Only the forward of this path runs in the CPU test suite (eager, no compile); the compiled
CUDA path is exercised on a GPU.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # flex attention is only fast compiled; compiling the kernel once serves every shape.
    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
                            compiled: bool = True) -> torch.Tensor:
    """q, k, v: [b, h, s, d] (K/V already expanded); doc_ids: [b, s]. Block-causal attention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, _, s, _ = q.shape

    def mask_mod(batch, head, qi, ki):
        return (qi >= ki) & (doc_ids[batch, qi] == doc_ids[batch, ki])

    block_mask = create_block_mask(mask_mod, b, None, s, s, device=q.device)
    fn = _compiled_flex() if compiled else flex_attention
    return fn(q, k, v, block_mask=block_mask)
