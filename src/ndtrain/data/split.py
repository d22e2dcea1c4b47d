"""Which documents the validation split holds: the one definition, used by encode (per document)
and prepare (where a part's val range starts).

A document goes to validation when a salted hash of its text falls below `val_fraction`. The
draw depends on the document alone, never on its position, its neighbours or the order of the
sources, so a random sample of documents (not the alphabetical tail of the corpus) is held out,
the same document lands in the same split in every corpus and every append, and exact
duplicates never straddle train and val. The drawn documents are written after the part's
training documents, so a part is still one train range followed by one val range on disk and
manifests keep their shape.
"""

from __future__ import annotations

import hashlib

SALT_NAME = "ndtrain-val-1"  # changing it redraws every split: recorded in the manifest with each part
SALT = SALT_NAME.encode() + b"\0"
KEY_BYTES = 1 << 16  # a document's key covers its first 64 KiB: a huge document is drawn before it is read through
METHOD = "document-hash"


def doc_key(text: bytes) -> bytes:
    """The document's identity for the draw (sha256 of the salt and its first KEY_BYTES)."""
    return hashlib.sha256(SALT + text[:KEY_BYTES]).digest()


def is_val(key: bytes, val_fraction: float) -> bool:
    return int.from_bytes(key[:8], "big") < val_fraction * 2.0 ** 64


def val_length(num_tokens: int, drawn: int, val_fraction: float) -> int:
    """Tokens at the end of a part that validation holds. The `drawn` documents' tokens end the
    part; they are the split when they come near val_fraction of its tokens. A part of a few
    documents can draw none, or one that is most of it: then val is val_fraction of the tokens,
    topped up from the end of the training documents or cut from the start of the drawn ones
    (the manifest records how many tokens came from where)."""
    target = int(num_tokens * val_fraction)
    if target == 0:
        return 0
    return drawn if target / 2 <= drawn <= 2 * target else target
