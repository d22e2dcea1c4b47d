"""Tokenizing work units, inline or in `--workers N` processes.

Each worker reads and tokenizes whole units (sources.py) with the `tokenizers` batch encoder
running single-threaded, so N workers use N cores; results come back in unit order through a
bounded window of pending units, so memory stays a few units per worker however large the corpus.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from ndtrain.data.sources import Unit, read_unit, utf8_cut
from ndtrain.data.split import KEY_BYTES, doc_key, is_val
from ndtrain.data.tokenizer import tokenizer_from_spec

_BATCH_BYTES = 4 << 20  # text handed to the tokenizer at once


@dataclass
class UnitResult:
    tokens: np.ndarray  # the training documents' tokens
    num_documents: int
    num_bytes: int  # UTF-8 bytes of text consumed
    val_tokens: np.ndarray | None = None  # the documents split.py draws for validation
    val_keys: list[bytes] = field(default_factory=list)  # one split.doc_key per validation document started here


def _text_head(unit: Unit) -> bytes:
    """The first KEY_BYTES of a text file's document (its text, in the pieces any unit reads),
    whatever range of the file `unit` covers: every range of a large file draws the same key."""
    head = b""
    with contextlib.closing(read_unit(replace(unit, start=0, stop=-1, first=True))) as pieces:
        for raw, _, _ in pieces:
            head += raw
            if len(head) >= KEY_BYTES:
                break
    return head[:KEY_BYTES]


def _draw_key(unit: Unit, raw: bytes, starts: bool, ends: bool) -> bytes:
    """split.doc_key of the document `raw` starts (or, for a range of a text file, continues)."""
    if unit.kind != "text" or (starts and (ends or len(raw) >= KEY_BYTES)):
        return doc_key(raw)  # the whole document, or at least its first KEY_BYTES
    return doc_key(_text_head(unit))


def encode_unit(unit: Unit, tok, dtype: np.dtype, limit: int | None = None, val_fraction: float = 0.0) -> UnitResult:
    """Tokens of one unit, each document followed by tok.eos_id; with `limit`, stop after that
    many bytes of text (cut at a character boundary). Documents split.py draws for validation
    (by their own text, so the same whatever unit or order they come in) go to val_tokens."""
    eos = np.asarray([tok.eos_id], dtype=dtype)
    out: dict[bool, list[np.ndarray]] = {False: [], True: []}
    batch: list[tuple[bytes, bool, bool]] = []
    keys: list[bytes] = []
    state = {"size": 0}
    docs = used = 0
    val = None  # the current document is a validation document

    def flush() -> None:
        if tok.name == "byte":
            arrays = [np.frombuffer(raw, dtype=np.uint8) for raw, _, _ in batch]
        else:
            arrays = tok.encode_batch_arrays([raw.decode("utf-8") for raw, _, _ in batch])
        for (_, ends, to_val), ids in zip(batch, arrays):
            out[to_val].append(ids.astype(dtype, copy=False))
            if ends:
                out[to_val].append(eos)
        batch.clear()
        state["size"] = 0

    for raw, starts, ends in read_unit(unit):
        if val_fraction and (starts or val is None):  # drawn from the uncut text: a --max-mb cap changes no draw
            key = _draw_key(unit, raw, starts, ends)
            val = is_val(key, val_fraction)
        if limit is not None:
            if used >= limit:
                break
            if len(raw) > limit - used:
                raw = raw[: utf8_cut(raw, limit - used)]
        if not raw and (starts or not ends):
            continue  # an empty document, or nothing to add
        used += len(raw)
        docs += bool(starts and raw)
        if val and starts:
            keys.append(key)
        batch.append((raw, ends, bool(val)))
        state["size"] += len(raw)
        if state["size"] >= _BATCH_BYTES:
            flush()
    flush()
    tokens, val_tokens = (np.concatenate(out[v]) if out[v] else np.zeros(0, dtype=dtype) for v in (False, True))
    return UnitResult(tokens, docs, used, val_tokens, keys)


# A worker process's tokenizer, built once by the pool initializer: per-process state that lives
# exactly as long as the worker, not shared between callers.
_WORKER: dict = {}


def _init_worker(spec: tuple, dtype_name: str, val_fraction: float = 0.0) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers, N cores
    _WORKER["tok"] = tokenizer_from_spec(spec)
    _WORKER["dtype"] = np.dtype(dtype_name)
    _WORKER["val_fraction"] = val_fraction


def _encode_in_worker(unit: Unit) -> UnitResult:
    return encode_unit(unit, _WORKER["tok"], _WORKER["dtype"], val_fraction=_WORKER["val_fraction"])


@contextlib.contextmanager
def _single_threaded():
    # `--workers 1` means one core: the Rust batch encoder would otherwise use every core.
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def encode_units(units: list[Unit], tok, dtype: np.dtype, workers: int, ahead: int = 2,
                 val_fraction: float = 0.0) -> Iterator[UnitResult]:
    """Results in unit order. The caller may stop early (a --max-mb cap): closing the generator
    cancels what is still queued."""
    if workers <= 1 or len(units) <= 1:
        with _single_threaded():
            for u in units:
                yield encode_unit(u, tok, dtype, val_fraction=val_fraction)
        return
    # spawn, not fork: the parent may hold threads (torch, the Rust tokenizer pool) that a fork
    # would copy mid-lock.
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(workers, len(units)), mp_context=ctx,
                               initializer=_init_worker, initargs=(tok.spec(), dtype.name, val_fraction))
    pending = []
    try:
        it = iter(units)
        for u in it:
            pending.append(pool.submit(_encode_in_worker, u))
            if len(pending) >= workers * ahead:
                break
        while pending:
            result = pending.pop(0).result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(_encode_in_worker, nxt))
            yield result
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
