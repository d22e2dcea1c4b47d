"""Data pipeline: tokenizers, `ndtrain prepare`, and the resumable data-parallel loader.

Names are re-exported lazily so `ndtrain prepare` (and anything importing only tokenizers) does not
pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ByteTokenizer": "tokenizer",
    "BPETokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "prepare": "prepare",
    "ensure_prepared": "prepare",
    "read_manifest": "manifest",
    "TokenDataset": "loader",
    "StatefulLoader": "loader",
    "Batch": "loader",
    "validation_batches": "loader",
    "MixtureDataset": "mixture",
    "MixtureLoader": "mixture",
    "open_dataset": "mixture",
    "make_loader": "mixture",
    "document_ids": "packing",
    "document_positions": "packing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
