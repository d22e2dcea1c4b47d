"""The manifest that describes a prepared corpus, its validation (pydantic models), and its fingerprint.

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
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ndtrain.errors import NdtrainError, pydantic_problem

FORMAT = "ndtrain-tokens"
# Bump when the on-disk layout or the meaning of a field changes; readers refuse other versions
# rather than misreading new data.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
TOKENS_NAME = "tokens.bin"  # format 1's single token file
TOKENIZER_NAME = "tokenizer.json"
SHARD_RE = r"^tokens-\d{5,}\.bin$"  # plain names only: a manifest can never point outside its directory


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


# ---- the fields, checked by pydantic -----------------------------------------------------------
_Count = Annotated[int, Field(ge=0)]
_Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
_Range = Annotated[list[_Count], Field(min_length=2, max_length=2)]  # [a, b); the checks across fields place it
_VocabSize = Annotated[int, Field(ge=1, le=1 << 32)]


class _CrossFieldError(Exception):
    """(field, what it must be, its value): a rule across fields is broken. Not a ValueError, so
    pydantic lets it through unwrapped, with the field path that its own errors could not give."""


def _fail(field: str, what: str, value) -> None:
    raise _CrossFieldError(field, what, value)


class _Fields(BaseModel):
    """Strict: an integer is an int (never a bool, a float or a string), a number is finite. Keys
    no model names are ignored, and read_manifest returns the file's own dict, so they stay."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class _Shard(_Fields):
    file: Annotated[str, Field(pattern=SHARD_RE)]
    num_tokens: _Count
    num_documents: _Count
    sha256: _Hex64


class _ValSplit(_Fields):
    method: str
    documents: _Count
    drawn_tokens: _Count
    tail_tokens: _Count


class _Part(_Fields):
    train: _Range
    val: _Range
    sha256: _Hex64
    max_bytes: Annotated[int, Field(ge=1)] | None = None
    val_split: _ValSplit = None  # how val was drawn; absent (never null) where a part holds its stream's tail


class _Source(_Fields):
    path: str
    size: _Count
    mtime_ns: _Count
    num_documents: _Count
    num_bytes: _Count
    num_tokens: _Count
    part: _Count


class _Settings(_Fields):
    tokenizer: str
    text_field: str
    vocab_size: Annotated[int, Field(ge=1)]
    val_fraction: Annotated[float, Field(ge=0, lt=1)]
    default_corpus: bool


class _V2(_Fields):
    vocab_size: _VocabSize
    tokenizer: str
    dtype: Literal["uint16", "uint32"]
    eos_id: int
    tokenizer_sha256: _Hex64 | None = None
    stream_sha256: _Hex64
    num_documents: _Count
    num_bytes: _Count
    shards: list[_Shard]
    num_tokens: _Count
    parts: Annotated[list[_Part], Field(min_length=1)]
    sources: list[_Source]
    settings: _Settings
    default_corpus: bool
    roots: list[str]
    python_version: str
    args: dict

    @model_validator(mode="after")
    def _one_stream(self):
        """The shards add up to num_tokens, which the parts cover in order, each a train range
        then a val range; every source names a part."""
        vocab, n = self.vocab_size, self.num_tokens
        if self.dtype != dtype_for_vocab(vocab).name:
            _fail("dtype", f"{dtype_for_vocab(vocab).name} for vocab_size {vocab}", self.dtype)
        if not 0 <= self.eos_id < vocab:
            _fail("eos_id", f"an integer in [0, {vocab - 1}]", self.eos_id)
        if n != (total := sum(s.num_tokens for s in self.shards)):
            _fail("num_tokens", f"the sum of the shards' num_tokens ({total:,})", n)
        end = 0
        for i, p in enumerate(self.parts):
            for name, (a, b), start, why in (("train", p.train, end, "where the previous part ends"),
                                             ("val", p.val, p.train[1], "at train's end")):
                if a != start or not a <= b <= n:
                    _fail(f"parts[{i}].{name}", f"a range [{start}, b] starting {why}, with b <= num_tokens ({n:,})", [a, b])
            end = p.val[1]
        if end != n:
            _fail(f"parts[{len(self.parts) - 1}].val", f"a range ending at num_tokens ({n:,})", self.parts[-1].val)
        for i, s in enumerate(self.sources):
            if s.part >= len(self.parts):
                _fail(f"sources[{i}].part", f"an integer in [0, {len(self.parts) - 1}]", s.part)
        return self


class _Splits(_Fields):
    train: _Range
    val: _Range


class _V1(_Fields):
    tokenizer: str
    vocab_size: _VocabSize
    dtype: Literal["uint16", "uint32"]
    num_tokens: _Count
    splits: _Splits

    @model_validator(mode="after")
    def _one_part(self):
        (t0, t1), n = self.splits.train, self.num_tokens
        if t0 != 0 or t1 > n:
            _fail("splits.train", f"a range [0, a] with a <= num_tokens ({n:,})", self.splits.train)
        if self.splits.val != [t1, n]:
            _fail("splits.val", f"[{t1}, {n}], from train's end to num_tokens", self.splits.val)
        return self


def _one_line(path: Path, field: str, what: str | None, value) -> NdtrainError:
    if what is None:
        return NdtrainError(f"{path}: field '{field}' is missing")
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return NdtrainError(f"{path}: field '{field}' must be {what}, got {shown}")


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
    try:
        (_V1 if version == 1 else _V2).model_validate(manifest)
    except ValidationError as exc:
        raise _one_line(path, *pydantic_problem(exc)) from None
    except _CrossFieldError as exc:
        raise _one_line(path, *exc.args) from None
    if version == 1:  # normalised in memory to one shard and one part (nothing is written back)
        manifest["shards"] = [{"file": TOKENS_NAME, "num_tokens": manifest["num_tokens"]}]
        manifest["parts"] = [{"train": manifest["splits"]["train"], "val": manifest["splits"]["val"]}]
        manifest["eos_id"] = None  # documents were joined by a newline: no boundary token
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
