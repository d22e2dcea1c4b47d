"""The manifest that describes a prepared token file, and its validation.

Kept apart from prepare/loader/tokenizer so all three can read it without importing each other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ndtrain.errors import NdtrainError

FORMAT = "ndtrain-tokens"
# Bump when the on-disk layout or the meaning of a field changes; readers refuse other versions
# rather than misreading old data.
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENS_NAME = "tokens.bin"
TOKENIZER_NAME = "tokenizer.json"

_REQUIRED = ("tokenizer", "vocab_size", "dtype", "num_tokens", "splits")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write via a temp name + rename so a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_manifest(data_dir: str | os.PathLike, check_tokens: bool = True) -> dict:
    """Load and validate `data_dir/manifest.json`; with check_tokens also check tokens.bin's size.

    Every problem becomes an NdtrainError naming the file, since a wrong --data path or an
    interrupted copy are the usual causes and the user needs to know which file to fix.
    """
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        hint = "" if data_dir.is_dir() else " (the directory does not exist)"
        raise NdtrainError(f"{path}: no manifest found{hint}; run `ndtrain prepare --out {data_dir}` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NdtrainError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise NdtrainError(f"{path}: not an ndtrain token manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise NdtrainError(
            f"{path}: format version {manifest.get('format_version')!r} is not supported "
            f"(this ndtrain reads version {FORMAT_VERSION}); prepare the data again"
        )
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise NdtrainError(f"{path}: manifest lacks field(s) {', '.join(missing)}")
    num_tokens = manifest["num_tokens"]
    splits = manifest["splits"]
    try:
        train, val = splits["train"], splits["val"]
        ok = (
            isinstance(num_tokens, int)
            and 0 <= train[0] <= train[1] == val[0] <= val[1] == num_tokens
            and np.dtype(manifest["dtype"]) in (np.dtype(np.uint16), np.dtype(np.uint32))
        )
    except (KeyError, TypeError, IndexError):
        ok = False
    if not ok:
        raise NdtrainError(f"{path}: inconsistent num_tokens/splits/dtype fields")
    if check_tokens:
        check_tokens_file(data_dir, manifest)
    return manifest


def check_tokens_file(data_dir: Path, manifest: dict) -> Path:
    tokens = Path(data_dir) / TOKENS_NAME
    if not tokens.is_file():
        raise NdtrainError(f"{tokens}: token file missing (the manifest expects {manifest['num_tokens']:,} tokens)")
    expected = manifest["num_tokens"] * np.dtype(manifest["dtype"]).itemsize
    actual = tokens.stat().st_size
    if actual != expected:
        raise NdtrainError(
            f"{tokens}: size is {actual:,} bytes but the manifest expects {expected:,} "
            f"({manifest['num_tokens']:,} {manifest['dtype']} tokens); the file is truncated or stale, prepare again"
        )
    return tokens
