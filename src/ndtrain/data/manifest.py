"""The manifest that describes a prepared corpus, its field-by-field validation, and its fingerprint.

A corpus directory holds numbered token shards (`tokens-00000.bin`, ...) and one `manifest.json`.
The shards concatenated in order are one token stream; prepare appends to it in *parts* (one per
invocation that added sources), each one training range followed by one validation range, so
appending never moves an old token between train and val. Since the split draws documents
(data/split.py), a part's val range holds its drawn documents and `val_split` says what they
are; parts prepared before hold the tail of their stream, and read the same. Format 1 (one
`tokens.bin`, documents joined by a newline) is still read, as one shard and one part.

Kept apart from prepare/loader/tokenizer so all of them can read it without importing each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ndtrain.errors import NdtrainError

FORMAT = "ndtrain-tokens"
# Bump when the on-disk layout or the meaning of a field changes; readers refuse other versions
# rather than misreading new data.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
TOKENS_NAME = "tokens.bin"  # format 1's single token file
TOKENIZER_NAME = "tokenizer.json"
SHARD_RE = re.compile(r"tokens-\d{5,}\.bin")  # plain names only: a manifest can never point outside its directory
_HEX64 = re.compile(r"[0-9a-f]{64}")


def shard_name(index: int) -> str:
    return f"tokens-{index:05d}.bin"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write via a temp name + fsync + rename so a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(obj, indent=1, sort_keys=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---- typed field checks ---------------------------------------------------------------------
class _Fields:
    """Each check names the file and the field, so a hand-edited or truncated manifest fails
    with one line that says what to fix."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, what: str, value) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise NdtrainError(f"{self.path}: field '{field}' must be {what}, got {shown}")

    def get(self, obj: dict, key: str, field: str):
        if key not in obj:
            raise NdtrainError(f"{self.path}: field '{field}' is missing")
        return obj[key]

    def int(self, obj: dict, key: str, field: str, lo: int = 0, hi: int | None = None) -> int:
        v = self.get(obj, key, field)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            self.fail(field, f"an integer in [{lo}, {hi if hi is not None else 'inf'}]", v)
        return v

    def str(self, obj: dict, key: str, field: str, pattern: re.Pattern | None = None, choices=None) -> str:
        v = self.get(obj, key, field)
        if not isinstance(v, str) or (pattern is not None and not pattern.fullmatch(v)) or \
                (choices is not None and v not in choices):
            what = f"one of {', '.join(choices)}" if choices else (f"a string matching {pattern.pattern}" if pattern else "a string")
            self.fail(field, what, v)
        return v

    def number(self, obj: dict, key: str, field: str, lo: float, hi: float) -> float:
        v = self.get(obj, key, field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v < hi:
            self.fail(field, f"a number in [{lo}, {hi})", v)
        return v

    def bool(self, obj: dict, key: str, field: str) -> bool:
        v = self.get(obj, key, field)
        if not isinstance(v, bool):
            self.fail(field, "true or false", v)
        return v

    def list(self, obj: dict, key: str, field: str) -> list:
        v = self.get(obj, key, field)
        if not isinstance(v, list):
            self.fail(field, "a list", v)
        return v

    def dict(self, obj, field: str) -> dict:
        if not isinstance(obj, dict):
            self.fail(field, "an object", obj)
        return obj

    def range(self, obj: dict, key: str, field: str, lo: int, hi: int) -> list[int]:
        v = self.get(obj, key, field)
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                and lo <= v[0] <= v[1] <= hi):
            self.fail(field, f"a range [a, b] with {lo} <= a <= b <= {hi}", v)
        return v


def _check_v2(m: dict, f: _Fields) -> None:
    vocab = f.int(m, "vocab_size", "vocab_size", 1, 1 << 32)
    f.str(m, "tokenizer", "tokenizer")
    f.str(m, "dtype", "dtype", choices=("uint16", "uint32"))
    if np.dtype(m["dtype"]) != dtype_for_vocab(vocab):
        f.fail("dtype", f"{dtype_for_vocab(vocab).name} for vocab_size {vocab}", m["dtype"])
    f.int(m, "eos_id", "eos_id", 0, vocab - 1)
    if m.get("tokenizer_sha256") is not None:
        f.str(m, "tokenizer_sha256", "tokenizer_sha256", _HEX64)
    f.str(m, "stream_sha256", "stream_sha256", _HEX64)
    for key in ("num_documents", "num_bytes"):
        f.int(m, key, key)
    total = 0
    for i, s in enumerate(f.list(m, "shards", "shards")):
        where = f"shards[{i}]"
        f.dict(s, where)
        f.str(s, "file", f"{where}.file", SHARD_RE)
        total += f.int(s, "num_tokens", f"{where}.num_tokens")
        f.int(s, "num_documents", f"{where}.num_documents")
        f.str(s, "sha256", f"{where}.sha256", _HEX64)
    num_tokens = f.int(m, "num_tokens", "num_tokens")
    if num_tokens != total:
        f.fail("num_tokens", f"the sum of the shards' num_tokens ({total:,})", num_tokens)
    end = 0
    parts = f.list(m, "parts", "parts")
    if not parts:
        f.fail("parts", "a non-empty list", parts)
    for i, p in enumerate(parts):
        where = f"parts[{i}]"
        f.dict(p, where)
        train = f.range(p, "train", f"{where}.train", end, num_tokens)
        if train[0] != end:
            f.fail(f"{where}.train", f"a range starting where the previous part ends ({end})", train)
        val = f.range(p, "val", f"{where}.val", train[1], num_tokens)
        if val[0] != train[1]:
            f.fail(f"{where}.val", f"a range starting at train's end ({train[1]})", val)
        f.str(p, "sha256", f"{where}.sha256", _HEX64)
        if p.get("max_bytes") is not None:
            f.int(p, "max_bytes", f"{where}.max_bytes", 1)
        if "val_split" in p:  # how the val range was drawn (parts prepared before it held the tail)
            vs = f.dict(p["val_split"], f"{where}.val_split")
            f.str(vs, "method", f"{where}.val_split.method")
            for key in ("documents", "drawn_tokens", "tail_tokens"):
                f.int(vs, key, f"{where}.val_split.{key}")
        end = val[1]
    if end != num_tokens:
        f.fail(f"parts[{len(parts) - 1}].val", f"a range ending at num_tokens ({num_tokens:,})", parts[-1]["val"])
    for i, s in enumerate(f.list(m, "sources", "sources")):
        where = f"sources[{i}]"
        f.dict(s, where)
        f.str(s, "path", f"{where}.path")
        for key in ("size", "mtime_ns", "num_documents", "num_bytes", "num_tokens"):
            f.int(s, key, f"{where}.{key}")
        f.int(s, "part", f"{where}.part", 0, len(parts) - 1)
    settings = f.dict(f.get(m, "settings", "settings"), "settings")
    for key in ("tokenizer", "text_field"):
        f.str(settings, key, f"settings.{key}")
    f.int(settings, "vocab_size", "settings.vocab_size", 1)
    f.number(settings, "val_fraction", "settings.val_fraction", 0.0, 1.0)
    f.bool(settings, "default_corpus", "settings.default_corpus")
    f.bool(m, "default_corpus", "default_corpus")
    for i, r in enumerate(f.list(m, "roots", "roots")):
        if not isinstance(r, str):
            f.fail(f"roots[{i}]", "a string", r)
    f.str(m, "python_version", "python_version")
    f.dict(f.get(m, "args", "args"), "args")


def _check_v1(m: dict, f: _Fields) -> None:
    """Format 1, normalised in memory to one shard and one part (nothing is written back)."""
    f.str(m, "tokenizer", "tokenizer")
    vocab = f.int(m, "vocab_size", "vocab_size", 1, 1 << 32)
    f.str(m, "dtype", "dtype", choices=("uint16", "uint32"))
    n = f.int(m, "num_tokens", "num_tokens")
    splits = f.dict(f.get(m, "splits", "splits"), "splits")
    train = f.range(splits, "train", "splits.train", 0, n)
    val = f.range(splits, "val", "splits.val", 0, n)
    if train[0] != 0 or val[0] != train[1] or val[1] != n:
        f.fail("splits", "train [0, a] and val [a, num_tokens]", splits)
    del vocab
    m["shards"] = [{"file": TOKENS_NAME, "num_tokens": n}]
    m["parts"] = [{"train": train, "val": val}]
    m["eos_id"] = None  # documents were joined by a newline: no boundary token


def read_manifest(data_dir: str | os.PathLike, check_tokens: bool = True) -> dict:
    """Load and validate `data_dir/manifest.json`; with check_tokens also check every shard's size.

    Every problem becomes one NdtrainError naming the file and field, since a wrong --data path,
    an interrupted copy or a hand edit are the usual causes and the user needs to know what to fix.
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
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        raise NdtrainError(
            f"{path}: format version {version!r} is not supported "
            f"(this ndtrain reads versions {', '.join(map(str, READABLE_VERSIONS))}); prepare the data again"
        )
    f = _Fields(path)
    (_check_v1 if version == 1 else _check_v2)(manifest, f)
    if check_tokens:
        check_shards(data_dir, manifest)
    return manifest


def check_shards(data_dir: Path, manifest: dict) -> list[Path]:
    """Every shard exists with exactly the size the manifest gives it (a cheap check at every load;
    the sha256s are for `verify_shards`, which reads everything)."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    paths = []
    for s in manifest["shards"]:
        p = Path(data_dir) / s["file"]
        if not p.is_file():
            raise NdtrainError(f"{p}: token shard missing (the manifest expects {s['num_tokens']:,} tokens)")
        expected, actual = s["num_tokens"] * itemsize, p.stat().st_size
        if actual != expected:
            raise NdtrainError(
                f"{p}: size is {actual:,} bytes but the manifest expects {expected:,} "
                f"({s['num_tokens']:,} {manifest['dtype']} tokens); the file is truncated or stale, prepare again")
        paths.append(p)
    return paths


def verify_shards(data_dir: str | os.PathLike) -> None:
    """Re-hash every shard against the manifest (reads the whole corpus)."""
    manifest = read_manifest(data_dir)
    for s in manifest["shards"]:
        if "sha256" in s and sha256_file(Path(data_dir) / s["file"]) != s["sha256"]:
            raise NdtrainError(f"{Path(data_dir) / s['file']}: sha256 differs from the manifest; the shard is corrupt")


def split_ranges(manifest: dict, split: str) -> list[tuple[int, int]]:
    """The global token ranges of a split, in stream order (empty ranges dropped)."""
    return [tuple(p[split]) for p in manifest["parts"] if p[split][1] > p[split][0]]


def fingerprint(manifest: dict) -> dict:
    """What a checkpoint records to refuse resuming on other data. It names the token stream, not
    its files, so the same corpus cut into a different number of shards resumes; a mixture
    (`{"mix": ...}`, built by the mixture dataset) lists its components' fingerprints."""
    if "mix" in manifest:
        return {"mix": manifest["mix"]}
    if manifest.get("format_version", 1) == 1:  # what checkpoints of format-1 corpora recorded
        return {k: manifest.get(k) for k in ("source_sha256", "num_tokens", "tokenizer", "vocab_size", "splits")}
    return {"stream_sha256": manifest["stream_sha256"], "num_tokens": manifest["num_tokens"],
            "tokenizer": manifest["tokenizer"], "vocab_size": manifest["vocab_size"],
            "parts": [[*p["train"], p["val"][1]] for p in manifest["parts"]]}
