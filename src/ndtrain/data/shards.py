"""Writing token shards: numbered files of at most `shard_tokens` tokens each, hashed as written,
kept under temporary names until `commit`, and removed by `abort`.

A shard is never modified once committed: appending sources starts new shards, so a job that has
the old manifest open keeps reading exactly the bytes it was told about.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ndtrain.data.manifest import shard_name


class ShardWriter:
    def __init__(self, directory: Path, dtype: np.dtype, eos_id: int, shard_tokens: int, first_index: int = 0):
        self.directory = Path(directory)
        self.dtype, self.eos_id, self.shard_tokens = np.dtype(dtype), eos_id, shard_tokens
        self.next_index = first_index
        self.shards: list[dict] = []
        self.part_hash = hashlib.sha256()  # the part's tokens in order, whatever the shard cuts
        self.num_tokens = 0
        self._tmp: list[tuple[Path, Path]] = []  # (temporary, final)
        self._committed: list[Path] = []
        self._fh = None
        self._last = None
        self._held = None  # (path, file): tokens held back to end the stream (the drawn validation documents)
        self.num_held = 0

    def _open(self) -> None:
        final = self.directory / shard_name(self.next_index)
        tmp = self.directory / f".{final.name}.{os.getpid()}.tmp"
        self._tmp.append((tmp, final))
        self._fh = open(tmp, "wb")
        self._hash, self._n, self._docs = hashlib.sha256(), 0, 0
        self.next_index += 1

    def _close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        self.shards.append({"file": self._tmp[-1][1].name, "num_tokens": self._n, "num_documents": self._docs,
                            "sha256": self._hash.hexdigest()})

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
        if len(tokens):
            self._last = int(tokens[-1])
        while len(tokens):
            if self._fh is None:
                self._open()
            chunk, tokens = tokens[: self.shard_tokens - self._n], tokens[self.shard_tokens - self._n:]
            data = chunk.tobytes()
            self._fh.write(data)
            self._hash.update(data)
            self.part_hash.update(data)
            self._n += len(chunk)
            self._docs += int(np.count_nonzero(chunk == self.eos_id))
            self.num_tokens += len(chunk)
            if self._n >= self.shard_tokens:
                self._close()

    def end_document(self) -> None:
        """A document cut by --max-mb still ends with EOS."""
        if self.num_tokens and self._last != self.eos_id:
            self.write(np.asarray([self.eos_id]))

    def hold(self, tokens: np.ndarray) -> None:
        """Keep tokens aside (in a temporary file: memory stays bounded) for `release`, which
        writes them after everything else: the validation documents end their part."""
        tokens = np.asarray(tokens, dtype=self.dtype)
        if not len(tokens):
            return
        if self._held is None:
            path = self.directory / f".held.{os.getpid()}.tmp"
            self._held = (path, open(path, "w+b"))
        self._held[1].write(tokens.tobytes())
        self.num_held += len(tokens)

    def release(self) -> None:
        if self._held is None:
            return
        path, fh = self._held
        fh.seek(0)
        while chunk := fh.read(self.dtype.itemsize << 22):
            self.write(np.frombuffer(chunk, dtype=self.dtype))
        fh.close()
        path.unlink()
        self._held = None

    def finish(self) -> None:
        """Close the last shard; a document cut by --max-mb still ends with EOS."""
        self.end_document()
        if self._fh is not None:
            self._close()

    def commit(self) -> None:
        for tmp, final in self._tmp:
            os.replace(tmp, final)  # over an unreferenced leftover of a killed append, never a listed shard
            self._committed.append(final)
        self._tmp = []

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._held is not None:
            self._held[1].close()
            self._held[0].unlink(missing_ok=True)
            self._held = None
        for tmp, _ in self._tmp:
            tmp.unlink(missing_ok=True)
        for final in self._committed:  # renamed but never listed in a manifest
            final.unlink(missing_ok=True)
