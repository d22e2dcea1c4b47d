"""Where prepare's text comes from: files, folders and globs of .txt, .jsonl(.gz/.zst) and parquet,
cut into independent work units that a worker process reads and tokenizes on its own.

A unit is a whole file, a byte range of a large plain file (cut at a line start) or a parquet
row group, so any number of workers tokenize the same units and prepare concatenates their
results in unit order: the output never depends on the worker count.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ndtrain.data.walk import Skipped, expand, walk
from ndtrain.errors import NdtrainError

TEXT_SUFFIXES = (".txt", ".py", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
FOLDER_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
PIECE_BYTES = 8 << 20  # a big text document is handed on in pieces of this size so memory stays bounded
UNIT_BYTES = 32 << 20  # plain files larger than twice this are cut into ranges of about this size


@dataclass(frozen=True)
class SourceFile:
    path: str  # absolute, resolved
    kind: str  # text | jsonl | parquet
    compression: str | None  # None | gz | zst
    strict: bool  # user files must be valid UTF-8; the stdlib has a few deliberately mis-encoded test files
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Unit:
    file: int  # index into the file list
    path: str
    kind: str
    compression: str | None
    strict: bool
    text_field: str
    start: int = 0  # byte offset, or first row group
    stop: int = -1  # end offset / row group (exclusive); -1 = to the end
    first: bool = True  # the unit starts its file (a text file's single document starts here)


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def kind_of(name: str) -> tuple[str, str | None]:
    """(kind, compression) from a file name; anything unrecognised is plain text."""
    low = name.lower()
    compression = None
    for ext, comp in ((".gz", "gz"), (".zst", "zst")):
        if low.endswith(ext):
            low, compression = low[: -len(ext)], comp
    if low.endswith(".parquet") and compression is None:
        return "parquet", None
    return ("jsonl" if low.endswith(".jsonl") else "text"), compression


def _file(path: Path, strict: bool = True) -> SourceFile:
    st = path.stat()
    return SourceFile(str(path), *kind_of(path.name), strict, st.st_size, st.st_mtime_ns)


def collect(sources: list[str] | None, skipped: Skipped | None = None) -> tuple[list[SourceFile], list[str]]:
    """(files in stream order, resolved source roots). Raises before anything is written.
    `skipped` (optional) receives what the walk did not read, and the count of files read."""
    skipped = Skipped() if skipped is None else skipped
    if sources is None:
        root = default_corpus_root()
        rels = walk(root, (".py",), frozenset({"site-packages", "dist-packages"}), skipped)
        if not rels:
            raise NdtrainError(f"default corpus: no .py files found under {root}")
        files = [_file(root / r, strict=False) for r in rels]
        skipped.read = len(files)
        return files, [str(root)]
    if not sources:
        raise NdtrainError("no sources given (pass files, folders or globs, or none at all for the default corpus)")
    files: list[SourceFile] = []
    seen: set[str] = set()
    roots = []

    def add(path: Path) -> None:
        st = path.stat()
        key = (st.st_dev, st.st_ino)  # one file reached by two names (a link) is read once
        if str(path) not in seen and key not in seen:
            seen.update((str(path), key))
            files.append(_file(path))

    for src in sources:
        expanded = os.path.expanduser(src)
        if glob.has_magic(expanded):
            matches = expand(expanded, skipped)
            if not matches:
                raise NdtrainError(f"{src}: no files match this pattern")
            roots.append(os.path.abspath(expanded))
            paths = [Path(m).resolve() for m in matches]
        else:
            path = Path(expanded).resolve()
            roots.append(str(path))
            if not path.exists():
                raise NdtrainError(f"{src}: source not found")
            paths = [path]
        for path in paths:
            if path.is_dir():
                rels = walk(path, FOLDER_SUFFIXES, skipped=skipped)
                if not rels and not glob.has_magic(expanded):
                    raise NdtrainError(f"{src}: no {'/'.join(FOLDER_SUFFIXES)} files found in this folder")
                for r in rels:
                    add(path / r)
            elif path.is_file():
                add(path)  # a file named explicitly is read as text whatever its extension, unless recognised
            else:
                skipped.add("broken link(s) or not a regular file", path)
    if not files:
        raise NdtrainError(f"{', '.join(sources)}: no files found")
    skipped.read = len(files)
    return files, roots


def check_readable(files: list[SourceFile], text_field: str) -> None:
    """Cheap up-front checks: compressed formats have their library, and the first parquet file
    has the text column (every other file is checked when read)."""
    if any(f.compression == "zst" for f in files):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise NdtrainError("reading .zst files needs the `zstandard` package (pip install zstandard)") from None
    first_parquet = next((f for f in files if f.kind == "parquet"), None)
    if first_parquet is not None:
        _parquet_column(first_parquet.path, text_field)


# ---- units -----------------------------------------------------------------------------------
def _aligned(fh, offset: int, newline_only: bool) -> int:
    """First line start at or after `offset` (or, in text without newlines for 1 MB, the next
    character boundary), so each range decodes and parses on its own."""
    fh.seek(offset)
    scanned = 0
    while True:
        block = fh.read(1 << 20)
        if not block:
            return offset + scanned
        nl = block.find(b"\n")
        if nl >= 0:
            return offset + scanned + nl + 1
        if not newline_only:
            cut = 0
            while cut < len(block) and (block[cut] & 0xC0) == 0x80:
                cut += 1
            return offset + cut
        scanned += len(block)


def plan_units(files: list[SourceFile], text_field: str, unit_bytes: int | None = None) -> list[Unit]:
    unit_bytes = UNIT_BYTES if unit_bytes is None else unit_bytes
    units = []
    for i, f in enumerate(files):
        base = dict(file=i, path=f.path, kind=f.kind, compression=f.compression, strict=f.strict, text_field=text_field)
        if f.compression is None and f.kind != "parquet" and f.size > 2 * unit_bytes:
            with open(f.path, "rb") as fh:
                cuts = [0]
                while cuts[-1] + unit_bytes < f.size - unit_bytes:
                    cuts.append(_aligned(fh, cuts[-1] + unit_bytes, f.kind == "jsonl"))
            cuts.append(f.size)
            units += [Unit(**base, start=a, stop=b, first=a == 0) for a, b in zip(cuts, cuts[1:]) if b > a]
        elif f.kind == "parquet" and f.size > 2 * unit_bytes:
            import pyarrow.parquet as pq

            n = pq.ParquetFile(f.path).metadata.num_row_groups
            units += [Unit(**base, start=g, stop=g + 1, first=g == 0) for g in range(n)]
        else:
            units.append(Unit(**base))
    return units


# ---- reading a unit --------------------------------------------------------------------------
def utf8_cut(data: bytes, limit: int) -> int:
    """Largest cut <= limit that does not split a UTF-8 character."""
    cut = min(limit, len(data))
    back = 0
    while 0 < cut < len(data) and back < 3 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
        back += 1
    return cut


def _check_utf8(data: bytes, u: Unit, offset: int) -> bytes:
    if not u.strict:
        return data.decode("utf-8", errors="replace").encode("utf-8")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NdtrainError(f"{u.path}: not valid UTF-8 text ({exc.reason} at byte {offset + exc.start})") from None
    return data


def _zstd_blocks(path: str) -> Iterator[bytes]:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    obj, in_frame = dctx.decompressobj(), False
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            while chunk:
                in_frame = True
                out = obj.decompress(chunk)
                if out:
                    yield out
                # A file may hold several frames: what follows a finished one starts the next.
                chunk, obj, in_frame = (obj.unused_data, dctx.decompressobj(), False) if obj.eof else (b"", obj, True)
    # zstd's stream reader returns short data for a cut file without a word; we check the frame end.
    if in_frame:
        raise NdtrainError(f"{path}: truncated zstd file (the last frame does not end)")


def _blocks(u: Unit) -> Iterator[bytes]:
    """Decompressed blocks of the unit: its byte range of a plain file, or a whole compressed file."""
    if u.compression == "zst":
        yield from _zstd_blocks(u.path)
        return
    with (gzip.open(u.path, "rb") if u.compression == "gz" else open(u.path, "rb")) as fh:
        if u.start:
            fh.seek(u.start)
        left = None if u.stop < 0 else u.stop - u.start
        while left is None or left > 0:
            block = fh.read(PIECE_BYTES if left is None else min(PIECE_BYTES, left))
            if not block:
                return
            if left is not None:
                left -= len(block)
            yield block


def _text_pieces(u: Unit) -> Iterator[tuple[bytes, bool, bool]]:
    """(UTF-8 bytes, starts a document, ends a document): one document per text file, in pieces."""
    carry, first, offset = b"", u.first, u.start
    last_unit = u.stop < 0 or u.stop >= os.path.getsize(u.path)
    for block in _blocks(u):
        data = carry + block
        # Cut at a newline (or at least a character boundary) so every piece decodes on its own.
        cut = data.rfind(b"\n") + 1 or utf8_cut(data, len(data) - 1)
        if cut:
            yield _check_utf8(data[:cut], u, offset), first, False
            first, offset = False, offset + cut
        carry = data[cut:]
    if carry or first or last_unit:  # an empty piece that starts and ends a document is skipped
        yield _check_utf8(carry, u, offset), first, last_unit


def _line_number(u: Unit, index: int) -> int:
    if u.compression is not None or not u.start:
        return index
    with open(u.path, "rb") as fh:  # only on an error: count the lines before this range
        return index + fh.read(u.start).count(b"\n")


def _record_text(record, u: Unit, where) -> str | None:
    if not isinstance(record, dict):
        raise NdtrainError(f"{where()}: expected a JSON object, got {type(record).__name__}")
    if u.text_field not in record:
        raise NdtrainError(f'{where()}: no "{u.text_field}" field (choose the key with --text-field)')
    text = record[u.text_field]
    if text is not None and not isinstance(text, str):
        raise NdtrainError(f'{where()}: field "{u.text_field}" must be a string, got {type(text).__name__}')
    return text or None


def _jsonl_docs(u: Unit) -> Iterator[tuple[bytes, bool, bool]]:
    with io.BufferedReader(_Blocks(_blocks(u)), buffer_size=1 << 20) as stream:
        for i, line in enumerate(stream, 1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not records
            where = lambda: f"{u.path}:{_line_number(u, i)}"  # noqa: E731
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise NdtrainError(f"{where()}: invalid JSON ({exc})") from None
            text = _record_text(record, u, where)
            if text:
                yield text.encode("utf-8", errors="replace"), True, True


class _Blocks(io.RawIOBase):
    """A raw stream over an iterator of byte blocks (so a byte range reads line by line)."""

    def __init__(self, blocks: Iterator[bytes]):
        self._blocks, self._buf = blocks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            self._buf = next(self._blocks, b"")
            if not self._buf:
                return 0
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


def _parquet_column(path: str, field: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise NdtrainError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0]})") from None
    if field not in schema.names:
        raise NdtrainError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)}); choose one with --text-field")
    typ = schema.field(field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)):
        raise NdtrainError(f"{path}: column {field!r} has type {typ}, not string")
    return schema


def _parquet_docs(u: Unit) -> Iterator[tuple[bytes, bool, bool]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _parquet_column(u.path, u.text_field)
    try:
        pf = pq.ParquetFile(u.path)
        groups = None if u.stop < 0 else list(range(u.start, u.stop))
        for batch in pf.iter_batches(batch_size=4096, columns=[u.text_field], row_groups=groups):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text.encode("utf-8", errors="replace"), True, True
    except pa.ArrowException as exc:
        raise NdtrainError(f"{u.path}: cannot read parquet ({str(exc).splitlines()[0]})") from None


def read_unit(u: Unit) -> Iterator[tuple[bytes, bool, bool]]:
    """(UTF-8 bytes, starts a document, ends a document) over one unit."""
    try:
        if u.kind == "parquet":
            yield from _parquet_docs(u)
        elif u.kind == "jsonl":
            yield from _jsonl_docs(u)
        else:
            yield from _text_pieces(u)
    except (OSError, EOFError) as exc:
        # gzip raises these for truncated or corrupt data; a vanished file too.
        raise NdtrainError(f"{u.path}: cannot read ({exc})") from None
    except Exception as exc:
        if type(exc).__name__ == "ZstdError":
            raise NdtrainError(f"{u.path}: cannot read ({exc})") from None
        raise


def sample_texts(files: list[SourceFile], units: list[Unit], budget: int, proportional: bool = True) -> Iterator[str]:
    """At most `budget` bytes of text for BPE training: the text in order when the corpus is that
    small (or `proportional` is off), else the leading share of every file in proportion to its
    size, so every source is seen and memory stays bounded by the budget."""
    total = sum(f.size for f in files)
    share = {i: budget * f.size / total for i, f in enumerate(files)} if proportional and total > budget else None
    used: dict[int, int] = {}
    spent = 0
    for u in units:
        for raw, _, _ in read_unit(u):
            left = budget - spent if share is None else share[u.file] - used.get(u.file, 0)
            if left <= 0:
                break
            raw = raw[: utf8_cut(raw, int(left))] if len(raw) > left else raw
            used[u.file] = used.get(u.file, 0) + len(raw)
            spent += len(raw)
            if raw:
                yield raw.decode("utf-8")
        if share is None and spent >= budget:
            return
