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
from dataclasses import dataclass

import numpy as np

from ndtrain.data.sources import Unit, read_unit, utf8_cut
from ndtrain.data.tokenizer import tokenizer_from_spec

_BATCH_BYTES = 4 << 20  # text handed to the tokenizer at once


@dataclass
class UnitResult:
    tokens: np.ndarray
    num_documents: int
    num_bytes: int  # UTF-8 bytes of text consumed


def encode_unit(unit: Unit, tok, dtype: np.dtype, limit: int | None = None) -> UnitResult:
    """Tokens of one unit, each document followed by tok.eos_id; with `limit`, stop after that
    many bytes of text (cut at a character boundary)."""
    eos = np.asarray([tok.eos_id], dtype=dtype)
    out: list[np.ndarray] = []
    batch: list[tuple[bytes, bool]] = []
    state = {"size": 0}
    docs = used = 0

    def flush() -> None:
        if tok.name == "byte":
            arrays = [np.frombuffer(raw, dtype=np.uint8) for raw, _ in batch]
        else:
            arrays = tok.encode_batch_arrays([raw.decode("utf-8") for raw, _ in batch])
        for (_, ends), ids in zip(batch, arrays):
            out.append(ids.astype(dtype, copy=False))
            if ends:
                out.append(eos)
        batch.clear()
        state["size"] = 0

    for raw, starts, ends in read_unit(unit):
        if limit is not None:
            if used >= limit:
                break
            if len(raw) > limit - used:
                raw = raw[: utf8_cut(raw, limit - used)]
        if not raw and (starts or not ends):
            continue  # an empty document, or nothing to add
        used += len(raw)
        docs += bool(starts and raw)
        batch.append((raw, ends))
        state["size"] += len(raw)
        if state["size"] >= _BATCH_BYTES:
            flush()
    flush()
    tokens = np.concatenate(out) if out else np.zeros(0, dtype=dtype)
    return UnitResult(tokens, docs, used)


# A worker process's tokenizer, built once by the pool initializer: per-process state that lives
# exactly as long as the worker, not shared between callers.
_WORKER: dict = {}


def _init_worker(spec: tuple, dtype_name: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers, N cores
    _WORKER["tok"] = tokenizer_from_spec(spec)
    _WORKER["dtype"] = np.dtype(dtype_name)


def _encode_in_worker(unit: Unit) -> UnitResult:
    return encode_unit(unit, _WORKER["tok"], _WORKER["dtype"])


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


def encode_units(units: list[Unit], tok, dtype: np.dtype, workers: int, ahead: int = 2) -> Iterator[UnitResult]:
    """Results in unit order. The caller may stop early (a --max-mb cap): closing the generator
    cancels what is still queued."""
    if workers <= 1 or len(units) <= 1:
        with _single_threaded():
            for u in units:
                yield encode_unit(u, tok, dtype)
        return
    # spawn, not fork: the parent may hold threads (torch, the Rust tokenizer pool) that a fork
    # would copy mid-lock.
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(workers, len(units)), mp_context=ctx,
                               initializer=_init_worker, initargs=(tok.spec(), dtype.name))
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
