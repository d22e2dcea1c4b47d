"""Document structure of packed sequences, for document masking (`[data] document_mask`).

A packed row holds the end of one document, whole documents and the start of another, each
ended by the EOS token. A token's document is the number of EOS tokens before it in its row
(so a document's EOS belongs to it, and the first token after an EOS starts the next one), and
its RoPE position counts from the start of its document (from the row start for the document
cut by the window's left edge: its beginning lies in an earlier window).
"""

from __future__ import annotations

import torch


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[b, s] int32 document index of each token within its row (0 for the first)."""
    is_eos = (inputs == eos_id).to(torch.int32)
    return torch.cumsum(is_eos, dim=1, dtype=torch.int32) - is_eos


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] int64 position of each token within its document."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - first
