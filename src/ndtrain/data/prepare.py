"""`ndtrain prepare`: text files -> numbered token shards + one manifest, atomically.

- A new corpus is built in a hidden sibling directory and renamed into place only when complete:
  a failure leaves no directory behind, and never touches an existing one.
- Re-running on the same sources is a no-op; new sources (or new files in a source folder or
  glob) are tokenized into new shards and a new *part* with its own validation documents
  (drawn by a hash of each document: data/split.py), and the manifest is replaced atomically
  last. Old shards are never rewritten, so a job reading the old manifest keeps reading valid
  data, and a resume from an older checkpoint is refused by the data fingerprint rather than
  misread.
- Work units are tokenized by `--workers` processes and concatenated in unit order, so the
  output does not depend on the worker count.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

from ndtrain.data.encode import encode_unit, encode_units
from ndtrain.data.manifest import (FORMAT, FORMAT_VERSION, MANIFEST_NAME, TOKENIZER_NAME, dtype_for_vocab,
                                   read_manifest, write_json_atomic)
from ndtrain.data.shards import ShardWriter
from ndtrain.data.split import METHOD, SALT_NAME, val_length
from ndtrain.data.sources import (Skipped, SourceFile, check_readable, collect, default_corpus_root,
                                  plan_units, sample_texts)
from ndtrain.data.tokenizer import BPETokenizer, check_bpe_vocab_size, load_tokenizer, make_tokenizer
from ndtrain.errors import NdtrainError
from ndtrain.paths import fsync_dir

__all__ = ["prepare", "ensure_prepared", "main", "default_corpus_root"]

DEFAULT_SHARD_MB = 256.0
DEFAULT_BPE_SAMPLE_MB = 256.0
_PARALLEL_MIN_BYTES = 16 << 20
_SETTINGS = ("tokenizer", "vocab_size", "text_field", "val_fraction", "default_corpus")


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise NdtrainError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_args(tokenizer, vocab_size, val_fraction, max_bytes, workers, text_field, shard_tokens, bpe_sample_bytes):
    tok = make_tokenizer(tokenizer)
    if tok is None:
        check_bpe_vocab_size(vocab_size)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise NdtrainError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if max_bytes is not None:
        _positive_int("max_bytes", max_bytes)
    _positive_int("workers", workers)
    _positive_int("shard_tokens", shard_tokens)
    _positive_int("bpe_sample_bytes", bpe_sample_bytes)
    if not isinstance(text_field, str) or not text_field:
        raise NdtrainError(f"text_field must be a non-empty string, got {text_field!r}")
    return tok


def _existing(out: Path) -> dict | None:
    """The corpus already at `out`, None if there is none; anything else there is an error."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise NdtrainError(f"{out}: exists and is not a directory")
    if (out / MANIFEST_NAME).is_file():
        return read_manifest(out)
    if any(out.iterdir()):
        raise NdtrainError(f"{out}: exists and is not an ndtrain corpus (no {MANIFEST_NAME}); "
                           "choose a new or empty directory")
    return None


@contextlib.contextmanager
def _locked(directory: Path):
    """One prepare at a time per corpus (an flock on the directory itself: nothing left behind)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NdtrainError(f"{directory}: another `ndtrain prepare` is writing this corpus") from None
        yield
    finally:
        os.close(fd)


def _encode_part(directory: Path, tok, files: list[SourceFile], settings: dict, max_bytes, workers: int,
                 shard_tokens: int, first_shard: int, start: int) -> tuple[ShardWriter, dict, list[dict]]:
    """Tokenize `files` into new shards under `directory`; returns the writer (uncommitted), the
    part record and one record per file."""
    dtype = dtype_for_vocab(tok.vocab_size)
    units = plan_units(files, settings["text_field"])
    writer = ShardWriter(directory, dtype, tok.eos_id, shard_tokens, first_shard)
    stats = [{"num_documents": 0, "num_bytes": 0, "num_tokens": 0, "val_documents": 0, "val_tokens": 0}
             for _ in files]
    used, drawn_docs, digest = 0, 0, 0
    val_fraction = settings["val_fraction"]
    results = encode_units(units, tok, dtype, workers, val_fraction=val_fraction)
    try:
        for unit, r in zip(units, results):
            capped = max_bytes is not None and used + r.num_bytes >= max_bytes
            if capped and used + r.num_bytes > max_bytes:  # redo just this unit, cut at the cap
                r = encode_unit(unit, tok, dtype, limit=max_bytes - used, val_fraction=val_fraction)
            writer.write(r.tokens)
            writer.hold(r.val_tokens)  # the drawn validation documents end the part
            drawn_docs += len(r.val_keys)
            digest += sum(int.from_bytes(k, "big") for k in r.val_keys)  # a sum: the same in any order
            s = stats[unit.file]
            s["num_documents"] += r.num_documents
            s["num_bytes"] += r.num_bytes
            s["num_tokens"] += len(r.tokens) + len(r.val_tokens)
            s["val_documents"] += len(r.val_keys)
            s["val_tokens"] += len(r.val_tokens)
            used += r.num_bytes
            if capped:
                break
        last = next((s for s in reversed(stats) if s["num_bytes"]), None)  # the file the cap cut, if it did
        before = writer.num_tokens
        writer.end_document()  # a training document cut by the cap ends before the drawn ones begin
        train_eos, drawn = writer.num_tokens - before, writer.num_held
        writer.release()
        writer.finish()  # ... and a drawn one cut by the cap ends the part
        val_eos = writer.num_tokens - before - train_eos - drawn
        drawn += val_eos
        if last is not None:  # the closing EOS of a document cut by the cap
            last["num_tokens"] += train_eos + val_eos
            last["val_tokens"] += val_eos
    except BaseException:
        results.close()
        writer.abort()
        raise
    if writer.num_tokens == 0:
        writer.abort()
        raise NdtrainError(f"sources contain no text ({', '.join(sorted({f.path for f in files})[:3])})")
    end = start + writer.num_tokens
    n_val = val_length(writer.num_tokens, drawn, val_fraction)
    part = {"train": [start, end - n_val], "val": [end - n_val, end], "sha256": writer.part_hash.hexdigest(),
            "max_bytes": max_bytes, "val_split": _val_record(drawn_docs, digest, drawn, n_val)}
    records = [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns, **s} for f, s in zip(files, stats)]
    return writer, part, records


def _val_record(documents: int, digest: int, drawn: int, n_val: int) -> dict:
    """What a part's val range holds (the split's composition, for the manifest): the drawn
    documents, named together by the sum of their keys mod 2**256 (the same whatever the order
    of the sources, in constant memory), and what val_length moved to or from the end of the
    training documents."""
    return {"method": METHOD, "salt": SALT_NAME, "documents": documents,
            "documents_digest": f"{digest % (1 << 256):064x}", "drawn_tokens": drawn,
            "tail_tokens": max(0, n_val - drawn), "drawn_tokens_in_train": max(0, drawn - n_val)}


def _manifest(old: dict | None, tok, directory: Path, writer: ShardWriter, part: dict, records: list[dict],
              roots: list[str], settings: dict, args: dict) -> dict:
    shards = (old["shards"] if old else []) + writer.shards
    parts = (old["parts"] if old else []) + [part]
    for r in records:
        r["part"] = len(parts) - 1
    sources = (old["sources"] if old else []) + records
    tok_file = directory / TOKENIZER_NAME
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype_for_vocab(tok.vocab_size).name,
        "tokenizer_sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest() if tok.name == "bpe" else None,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in sources),
        "num_bytes": sum(s["num_bytes"] for s in sources),
        # Over the parts' hashes: names the token stream, not how it is cut into shards.
        "stream_sha256": hashlib.sha256("\n".join(p["sha256"] for p in parts).encode()).hexdigest(),
        "shards": shards,
        "parts": parts,
        "roots": roots,
        "default_corpus": settings["default_corpus"],
        "python_version": platform.python_version(),
        "settings": settings,
        "args": old["args"] if old else args,  # the first invocation's, for `--if-absent`
        "sources": sources,
    }


def _create(out: Path, tok, files, roots, settings, args, max_bytes, workers, shard_tokens, bpe_sample_bytes) -> dict:
    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.prepare-{os.getpid()}"
    tmp.mkdir()
    try:
        if tok is None:  # BPE: trained on a bounded sample, then every unit is encoded with it
            budget = min(bpe_sample_bytes, max_bytes or bpe_sample_bytes)
            in_order = max_bytes is not None and max_bytes <= bpe_sample_bytes  # exactly the capped text
            texts = sample_texts(files, plan_units(files, settings["text_field"]), budget, proportional=not in_order)
            tok = BPETokenizer.train(texts, settings["vocab_size"])
            tok.save(tmp)
        writer, part, records = _encode_part(tmp, tok, files, settings, max_bytes, workers, shard_tokens, 0, 0)
        writer.commit()
        manifest = _manifest(None, tok, tmp, writer, part, records, roots, settings, args)
        write_json_atomic(tmp / MANIFEST_NAME, manifest)
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # only an empty directory gets here (_existing refuses anything else)
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # deepest first: parents this call made, if still empty
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def _append(out: Path, old: dict, files, roots, settings, max_bytes, workers, shard_tokens) -> tuple[dict, str]:
    if old["format_version"] == 1:
        raise NdtrainError(f"{out}: holds a format-1 corpus (one tokens.bin) from an older ndtrain; it cannot "
                           "take new sources: prepare into a new directory")
    have = old["settings"]
    keys = [k for k in _SETTINGS if k != "vocab_size" or settings["tokenizer"] == "bpe"]
    diff = [f"{k}={have.get(k)!r} (wanted {settings[k]!r})" for k in keys if have.get(k) != settings[k]]
    if diff:
        raise NdtrainError(f"{out} was prepared with different settings: {', '.join(diff)}; "
                           "use the same settings to add sources, or another directory")
    if roots[: len(old["roots"])] != old["roots"]:
        raise NdtrainError(f"{out} was prepared from {' '.join(old['roots'])}: to add sources, repeat those first "
                           "(ndtrain prepare OLD... NEW... --out DIR)")
    known = {s["path"]: s for s in old["sources"]}
    new = []
    for f in files:
        k = known.get(f.path)
        if k is None:
            new.append(f)
        elif (k["size"], k["mtime_ns"]) != (f.size, f.mtime_ns):
            raise NdtrainError(f"{f.path}: changed since it was prepared into {out} (size or modification time "
                               "differ); its tokens cannot be replaced in place: prepare into a new directory")
    if not new:
        return old, "unchanged"
    with _locked(out):
        tok = load_tokenizer(out, old)
        writer, part, records = _encode_part(out, tok, new, settings, max_bytes, workers, shard_tokens,
                                             len(old["shards"]), old["num_tokens"])
        try:
            writer.commit()  # new names only: no listed shard is touched
            manifest = _manifest(old, tok, out, writer, part, records, roots, settings, None)
            write_json_atomic(out / MANIFEST_NAME, manifest)  # the single switch to the grown corpus
            fsync_dir(out)
        except BaseException:
            writer.abort()
            raise
    return manifest, "appended"


def run_prepare(sources: list[str] | None, out_dir, tokenizer="byte", vocab_size=8192, val_fraction=0.005,
                max_bytes=None, workers=None, text_field="text", shard_tokens=None,
                bpe_sample_bytes=None, skipped=None) -> tuple[dict, str]:
    """prepare(), also saying what it did: 'created', 'appended' or 'unchanged'."""
    default = workers is None
    workers = default_workers() if default else workers
    if shard_tokens is None:
        shard_tokens = int(DEFAULT_SHARD_MB * 1e6) // dtype_for_vocab(256 if tokenizer == "byte" else vocab_size).itemsize
    bpe_sample_bytes = int(DEFAULT_BPE_SAMPLE_MB * 1e6) if bpe_sample_bytes is None else bpe_sample_bytes
    tok = _check_args(tokenizer, vocab_size, val_fraction, max_bytes, workers, text_field, shard_tokens, bpe_sample_bytes)
    files, roots = collect(sources, skipped)  # skipped: what the walk did not read, for the summary
    check_readable(files, text_field)
    if default and sum(f.size for f in files) < _PARALLEL_MIN_BYTES:
        workers = 1  # starting worker processes costs more than tokenizing a small corpus
    out = Path(out_dir).expanduser().absolute()
    settings = {"tokenizer": tokenizer, "vocab_size": vocab_size if tokenizer == "bpe" else 256,
                "text_field": text_field, "val_fraction": val_fraction, "default_corpus": sources is None}
    args = {"sources": None if sources is None else roots, "tokenizer": tokenizer, "vocab_size": vocab_size,
            "val_fraction": val_fraction, "max_bytes": max_bytes}
    old = _existing(out)
    if old is not None:
        return _append(out, old, files, roots, settings, max_bytes, workers, shard_tokens)
    return _create(out, tok, files, roots, settings, args, max_bytes, workers, shard_tokens, bpe_sample_bytes), "created"


def prepare(sources: list[str] | None, out_dir: str | os.PathLike, tokenizer: str = "byte", vocab_size: int = 8192,
            val_fraction: float = 0.005, max_bytes: int | None = None, workers: int | None = None,
            text_field: str = "text", shard_tokens: int | None = None, bpe_sample_bytes: int | None = None,
            skipped=None) -> dict:
    """Tokenize `sources` (None = the Python stdlib's .py files) into out_dir; return the manifest.
    `skipped` (a sources.Skipped): filled with what the walk of the sources did not read."""
    return run_prepare(sources, out_dir, tokenizer, vocab_size, val_fraction, max_bytes, workers, text_field,
                       shard_tokens, bpe_sample_bytes, skipped)[0]


def ensure_prepared(out_dir: str | os.PathLike, sources: list[str] | None = None, tokenizer: str = "byte",
                    vocab_size: int = 8192, val_fraction: float = 0.005, max_bytes: int | None = None,
                    **kwargs) -> dict:
    """out_dir's manifest if it holds a valid corpus first prepared with the same arguments
    (nothing is re-read or appended); else prepare it. A corpus prepared with *different*
    arguments, or a damaged one, is an error, never overwritten: a run may depend on it."""
    wanted = {
        "sources": None if sources is None else collect(sources)[1],
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
    }
    if (Path(out_dir) / MANIFEST_NAME).is_file():
        manifest = read_manifest(out_dir)
        have = manifest.get("args", {})
        keys = [k for k in wanted if k != "vocab_size" or tokenizer == "bpe"]  # byte ignores vocab_size
        diff = [f"{k}={have.get(k)!r} (wanted {wanted[k]!r})" for k in keys if have.get(k) != wanted[k]]
        if diff:
            raise NdtrainError(f"{out_dir} was prepared with different settings: {', '.join(diff)}; "
                               "delete it or choose another data directory")
        return manifest
    return prepare(sources, out_dir, tokenizer, vocab_size, val_fraction, max_bytes, **kwargs)


def _val_summary(manifest: dict) -> str:
    """', N drawn documents from M files' (corpora prepared before the draw say nothing)."""
    if not any("val_split" in p for p in manifest["parts"]):
        return ""
    docs = sum(p.get("val_split", {}).get("documents", 0) for p in manifest["parts"])
    files = sum(1 for s in manifest["sources"] if s.get("val_documents"))
    return f": {docs:,} drawn documents from {files:,} files"


def main(argv: list[str], note=None) -> int:
    """`ndtrain prepare`. `note(manifest)`: a line to say on stderr after the summary (the command
    passes what the shipped configs make of the split: data/ knows no config), or None."""
    parser = argparse.ArgumentParser(
        prog="ndtrain prepare",
        description="Tokenize text into DIR/tokens-NNNNN.bin shards + DIR/manifest.json. With no SOURCES, uses "
        "the Python standard library's .py files as a default corpus. Re-running adds only new sources.",
    )
    parser.add_argument("sources", nargs="*", metavar="SOURCES",
                        help=".txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet files, folders or globs")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (ignored for byte)")
    parser.add_argument("--val-fraction", type=float, default=0.005,
                        help="fraction of the documents held out for validation (drawn by a hash of each)")
    parser.add_argument("--max-mb", type=float, default=None, help="stop after this many MB (10^6 bytes) of new text")
    parser.add_argument("--text-field", default="text", help="JSON key or parquet column holding the text")
    parser.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: the core count)")
    parser.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB, help="size of each token shard, MB")
    parser.add_argument("--bpe-sample-mb", type=float, default=DEFAULT_BPE_SAMPLE_MB,
                        help="MB of text sampled to train the BPE tokenizer")
    parser.add_argument("--if-absent", action="store_true",
                        help="keep an existing valid DIR first prepared with the same arguments (make train uses this)")
    a = parser.parse_args(argv)
    for flag, value in (("--max-mb", a.max_mb), ("--shard-mb", a.shard_mb), ("--bpe-sample-mb", a.bpe_sample_mb)):
        if value is not None and not value > 0:
            raise NdtrainError(f"{flag} must be positive, got {value}")
    if a.workers is not None and a.workers < 1:
        raise NdtrainError(f"--workers must be at least 1, got {a.workers}")
    itemsize = dtype_for_vocab(256 if a.tokenizer == "byte" else a.vocab_size).itemsize
    kwargs = dict(
        sources=a.sources or None, out_dir=a.out, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
        val_fraction=a.val_fraction, max_bytes=None if a.max_mb is None else max(1, int(a.max_mb * 1_000_000)),
        workers=a.workers, text_field=a.text_field, shard_tokens=max(1, int(a.shard_mb * 1e6) // itemsize),
        bpe_sample_bytes=max(1, int(a.bpe_sample_mb * 1e6)),
    )
    kwargs["skipped"] = skipped = Skipped()  # what the walk did not read: said in the summary line
    if a.if_absent:
        existed = (Path(a.out) / MANIFEST_NAME).is_file()
        manifest, action = ensure_prepared(**kwargs), "kept" if existed else "created"
    else:
        manifest, action = run_prepare(**kwargs)
    head = {"created": "prepared", "appended": "appended to", "unchanged": "up to date:", "kept": "kept"}[action]
    print(f"{head} {manifest['num_tokens']:,} tokens ({manifest['tokenizer']}, vocab {manifest['vocab_size']}) "
          f"from {manifest.get('num_documents', 0):,} documents / {manifest.get('num_bytes', 0) / 1e6:.1f} MB "
          f"in {len(manifest['shards'])} shard(s) -> {a.out} ({len(manifest['parts'])} part(s), "
          f"val {sum(p['val'][1] - p['val'][0] for p in manifest['parts']):,} tokens{_val_summary(manifest)})"
          + (f"; {skipped.read:,} file(s) read, {skipped.describe()}" if action != "kept" else ""))
    said = note(manifest) if note else None
    if said:  # a warning, beside the summary line on stdout
        print(said, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
