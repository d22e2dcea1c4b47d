"""`ndtrain prepare`: turn text files into one flat token file plus a manifest.

The output is a single `tokens.bin` (documents joined by the tokenizer's separator) because the
loader only ever needs random fixed-length windows of one long stream; a flat memmap makes that a
single fancy-index read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import struct
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ndtrain.data.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    TOKENIZER_NAME,
    TOKENS_NAME,
    dtype_for_vocab,
    read_manifest,
    write_json_atomic,
)
from ndtrain.data.tokenizer import BPETokenizer, check_bpe_vocab_size, make_tokenizer
from ndtrain.errors import NdtrainError

FOLDER_SUFFIXES = (".txt", ".jsonl", ".py", ".md")
# A sensible cap for the default corpus in quick runs (`make train`): ~20 MB keeps prepare to a
# few seconds with the byte tokenizer while still being far more text than a small model can memorise.
DEFAULT_CORPUS_MAX_MB = 20
_PIECE_BYTES = 8 << 20  # files are read in pieces of this size so one huge file cannot exhaust memory
_ENCODE_BATCH_BYTES = 4 << 20  # text handed to the tokenizer at once (BPE encodes a batch in parallel)
_FLUSH_TOKENS = 4 << 20  # tokens buffered before a write to disk


@dataclass(frozen=True)
class _File:
    path: Path
    label: str  # path relative to its source root: hashed instead of the absolute path so moving a corpus keeps its hash
    jsonl: bool
    strict: bool  # user files must be valid UTF-8; the stdlib has a few deliberately mis-encoded test files


def _walk(root: Path, suffixes: tuple[str, ...], skip_dirs: frozenset[str] = frozenset()) -> list[str]:
    """Relative posix paths of matching files under root, sorted as strings so order never depends on the filesystem."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow directory symlinks: no cycles
        # Hidden dirs (.git, .venv) and caches are never corpus text; skipping them avoids swallowing a virtualenv.
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__" and d not in skip_dirs]
        rel_dir = Path(dirpath).relative_to(root)
        found += [(rel_dir / f).as_posix() for f in filenames if f.endswith(suffixes) and not f.startswith(".")]
    return sorted(found)


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _collect(sources: list[str] | None) -> tuple[list[_File], list[str]]:
    if sources is None:
        root = default_corpus_root()
        rels = _walk(root, (".py",), frozenset({"site-packages", "dist-packages"}))
        if not rels:
            raise NdtrainError(f"default corpus: no .py files found under {root}")
        return [_File(root / r, r, False, False) for r in rels], [str(root)]
    if not sources:
        raise NdtrainError("no sources given (pass files or folders, or none at all for the default corpus)")
    files: list[_File] = []
    roots = []
    for src in sources:
        path = Path(src).expanduser().resolve()
        roots.append(str(path))
        if path.is_dir():
            rels = _walk(path, FOLDER_SUFFIXES)
            if not rels:
                raise NdtrainError(f"{src}: no {'/'.join(FOLDER_SUFFIXES)} files found in this folder")
            files += [_File(path / r, f"{path.name}/{r}", r.endswith(".jsonl"), True) for r in rels]
        elif path.is_file():
            # An explicitly named file is read as text whatever its extension, unless it is .jsonl.
            files.append(_File(path, path.name, path.suffix == ".jsonl", True))
        else:
            raise NdtrainError(f"{src}: source not found")
    return files, roots


def _utf8_cut(data: bytes, limit: int) -> int:
    """Largest cut <= limit that does not split a UTF-8 character."""
    cut = min(limit, len(data))
    back = 0
    while 0 < cut < len(data) and back < 3 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
        back += 1
    return cut


def _decode(data: bytes, f: _File, offset: int) -> str:
    if not f.strict:
        return data.decode("utf-8", errors="replace")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NdtrainError(f"{f.path}: not valid UTF-8 text ({exc.reason} at byte {offset + exc.start})") from None


def _raw_docs(f: _File) -> Iterator[tuple[str, bytes, bool, int]]:
    """(label, raw bytes, starts_new_document, byte offset in file) pieces of one file."""
    if f.jsonl:
        with open(f.path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue  # blank lines (e.g. a trailing newline) are not records
                where = f"{f.path}:{lineno}"
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise NdtrainError(f"{where}: invalid JSON ({exc})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise NdtrainError(f'{where}: expected a JSON object with a string "text" field')
                if record["text"]:
                    yield f"{f.label}:{lineno}", record["text"].encode("utf-8", errors="replace"), True, 0
        return
    with open(f.path, "rb") as fh:
        carry, first, offset = b"", True, 0
        while True:
            block = fh.read(_PIECE_BYTES)
            data = carry + block
            if not block:
                if data:
                    yield f.label, data, first, offset
                return
            # Cut at a newline (or at least a character boundary) so every piece decodes on its own.
            cut = data.rfind(b"\n") + 1 or _utf8_cut(data, len(data) - 1)
            if cut:
                yield f.label, data[:cut], first, offset
                first = False
                offset += cut
            carry = data[cut:]


def _pieces(files: list[_File], max_bytes: int | None, stats: dict | None = None) -> Iterator[tuple[str, bool]]:
    """(text, starts_new_document) over all files, stopping after max_bytes of UTF-8 input.

    With `stats`, also fills in the source hash, document count and byte count of exactly what was fed.
    """
    hasher = hashlib.sha256()
    used = docs = 0
    for f in files:
        for label, raw, new_doc, offset in _raw_docs(f):
            if max_bytes is not None:
                if used >= max_bytes:
                    break
                if len(raw) > max_bytes - used:
                    raw = raw[: _utf8_cut(raw, max_bytes - used)]
            if not raw:
                continue
            text = _decode(raw, f, offset)
            used += len(raw)
            if new_doc:
                docs += 1
                # Length-prefixed so (label, content) boundaries are unambiguous in the hash.
                hasher.update(b"D" + struct.pack("<Q", len(label.encode())) + label.encode())
            hasher.update(b"P" + struct.pack("<Q", len(raw)) + raw)
            yield text, new_doc
        if max_bytes is not None and used >= max_bytes:
            break
    if stats is not None:
        stats.update(source_sha256=hasher.hexdigest(), num_documents=docs, num_bytes=used)


def _write_tokens(tok, pieces: Iterator[tuple[str, bool]], fh, dtype: np.dtype) -> int:
    sep = np.asarray(tok.separator_ids, dtype=dtype)
    buf: list[np.ndarray] = []
    state = {"buffered": 0, "written": 0, "started": False}

    def emit(arr: np.ndarray) -> None:
        buf.append(arr)
        state["buffered"] += len(arr)
        if state["buffered"] >= _FLUSH_TOKENS:
            flush()

    def flush() -> None:
        if buf:
            fh.write(np.concatenate(buf).tobytes())
            state["written"] += state["buffered"]
            buf.clear()
            state["buffered"] = 0

    def encode(batch: list[tuple[str, bool]]) -> None:
        for (_, new_doc), ids in zip(batch, tok.encode_batch_arrays([t for t, _ in batch])):
            if new_doc and state["started"]:
                emit(sep)  # between documents only: no trailing separator
            emit(ids.astype(dtype, copy=False))
            state["started"] = True

    batch: list[tuple[str, bool]] = []
    size = 0
    for text, new_doc in pieces:
        batch.append((text, new_doc))
        size += len(text)
        if size >= _ENCODE_BATCH_BYTES:
            encode(batch)
            batch, size = [], 0
    encode(batch)
    flush()
    return state["written"]


def prepare(
    sources: list[str] | None,
    out_dir: str | os.PathLike,
    tokenizer: str = "byte",
    vocab_size: int = 8192,
    val_fraction: float = 0.005,
    max_bytes: int | None = None,
) -> dict:
    """Tokenize `sources` (None = the Python stdlib's .py files) into out_dir; return the manifest."""
    tok = make_tokenizer(tokenizer)
    if tok is None:
        check_bpe_vocab_size(vocab_size)  # before any output is written
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):
        raise NdtrainError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise NdtrainError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    files, roots = _collect(sources)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tok is None:  # BPE: one pass to train, a second to encode
        tok = BPETokenizer.train((t for t, _ in _pieces(files, max_bytes)), vocab_size)
    dtype = dtype_for_vocab(tok.vocab_size)

    # Remove the old manifest first: between the token rename and the new manifest, no manifest
    # must describe a file it did not produce.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    tmp = out / f".{TOKENS_NAME}.{os.getpid()}.tmp"
    stats: dict = {}
    try:
        with open(tmp, "wb") as fh:
            num_tokens = _write_tokens(tok, _pieces(files, max_bytes, stats), fh, dtype)
        if stats["num_bytes"] == 0 or num_tokens == 0:
            raise NdtrainError(f"sources contain no text ({', '.join(roots)})")
        if tok.name == "bpe":
            tok.save(out)
        else:
            (out / TOKENIZER_NAME).unlink(missing_ok=True)  # a stale BPE file would contradict the manifest
        os.replace(tmp, out / TOKENS_NAME)
    finally:
        tmp.unlink(missing_ok=True)

    n_val = int(num_tokens * val_fraction)
    n_train = num_tokens - n_val
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "num_tokens": num_tokens,
        "tokens_file": TOKENS_NAME,
        "separator": "newline" if tok.name == "byte" else "<|endoftext|>",
        "default_corpus": sources is None,
        "sources": roots,
        **stats,
        "python_version": platform.python_version(),
        # Validation is the tail so train and val never share a window.
        "splits": {"train": [0, n_train], "val": [n_train, num_tokens]},
        "args": {
            "sources": None if sources is None else roots,
            "tokenizer": tokenizer,
            "vocab_size": vocab_size,
            "val_fraction": val_fraction,
            "max_bytes": max_bytes,
        },
    }
    write_json_atomic(out / MANIFEST_NAME, manifest)
    return manifest


def ensure_prepared(
    out_dir: str | os.PathLike,
    sources: list[str] | None = None,
    tokenizer: str = "byte",
    vocab_size: int = 8192,
    val_fraction: float = 0.005,
    max_bytes: int | None = None,
) -> dict:
    """Return out_dir's manifest if it is valid and was made with the same arguments; else prepare.

    A valid directory prepared with *different* arguments is an error rather than silently
    overwritten: a run resuming from a checkpoint may still depend on that data.
    """
    wanted = {
        "sources": None if sources is None else [str(Path(s).expanduser().resolve()) for s in sources],
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
    }
    if (Path(out_dir) / MANIFEST_NAME).is_file():
        try:
            manifest = read_manifest(out_dir)
        except NdtrainError:
            manifest = None  # half-written or corrupt: safe to rebuild
        if manifest is not None:
            have = manifest.get("args", {})
            keys = [k for k in wanted if k != "vocab_size" or tokenizer == "bpe"]  # byte ignores vocab_size
            diff = [f"{k}={have.get(k)!r} (wanted {wanted[k]!r})" for k in keys if have.get(k) != wanted[k]]
            if diff:
                raise NdtrainError(
                    f"{out_dir} was prepared with different settings: {', '.join(diff)}; "
                    "delete it or choose another data directory"
                )
            return manifest
    return prepare(sources, out_dir, tokenizer, vocab_size, val_fraction, max_bytes)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ndtrain prepare",
        description="Tokenize text into DIR/tokens.bin + DIR/manifest.json. With no SOURCES, uses the "
        "Python standard library's .py files as a default corpus.",
    )
    parser.add_argument("sources", nargs="*", metavar="SOURCES", help=".txt/.jsonl files or folders")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (ignored for byte)")
    parser.add_argument("--val-fraction", type=float, default=0.005, help="tail fraction held out for validation")
    parser.add_argument("--max-mb", type=float, default=None, help="stop after this many MB (10^6 bytes) of text")
    parser.add_argument("--if-absent", action="store_true",
                        help="keep an existing valid DIR prepared with the same arguments (make train uses this)")
    args = parser.parse_args(argv)
    if args.max_mb is not None and args.max_mb <= 0:
        raise NdtrainError(f"--max-mb must be positive, got {args.max_mb}")
    manifest = (ensure_prepared if args.if_absent else prepare)(
        sources=args.sources or None,
        out_dir=args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        max_bytes=None if args.max_mb is None else max(1, int(args.max_mb * 1_000_000)),
    )
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    print(
        f"prepared {manifest['num_tokens']:,} tokens ({manifest['tokenizer']}, vocab {manifest['vocab_size']}) "
        f"from {manifest['num_documents']:,} documents / {manifest['num_bytes'] / 1e6:.1f} MB "
        f"-> {args.out} (train {train[1] - train[0]:,}, val {val[1] - val[0]:,})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
