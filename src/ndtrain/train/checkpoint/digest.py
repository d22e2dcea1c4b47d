"""Who hashes what, so that publishing and verifying a checkpoint scale with the number of ranks,
and no save reads back what it wrote.

Publish: every rank's shard files (DCP names them `__<rank>_<n>.distcp`) are hashed as DCP
writes them (HashingWriter: the bytes pass through SHA-256 on their way to the file, so nothing
is read back); each rank leaves its digests in `.digests-rankNNNNN.json` inside the partial
directory; rank 0 adds the digests of `.metadata` (hashed as written too) and of
`train_state.json` and `tokenizer.json` (hashed from the bytes it writes), reads the digest
files, writes `manifest.json` from them and removes them (a rank that died after writing is
hashed by rank 0, so its checkpoint is still published). Files alone carry the digests: no
collective, so an async save's background threads never share a process group with anyone.

Verify (on resume): rank 0 reads the manifests and the DCP metadata (cheap) and broadcasts the
file lists; the files are split over the ranks by size, each rank hashes its share, and one
all_gather_object combines the verdicts. Every rank ends with the same answer. The same walk
without the hashing (`check_hashes=False`: each file there, with its manifest size) is how a
save confirms the checkpoint before it (retention.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from ndtrain.errors import NdtrainError
from ndtrain.train.distributed import broadcast_object, gather_objects, group_active
from ndtrain.train.checkpoint.reader import read_dcp_metadata
from ndtrain.train.checkpoint.store import MANIFEST, MARKER, check_items, manifest_items, sha256

DIGESTS = ".digests-rank"


def _digest_path(tmp: Path, rank: int) -> Path:
    return Path(tmp) / f"{DIGESTS}{rank:05d}.json"


def has_digests(tmp: Path, rank: int) -> bool:
    return _digest_path(tmp, rank).exists()


def own_files(tmp: Path, rank: int) -> list[Path]:
    return sorted(Path(tmp).glob(f"__{rank}_*.distcp"))


class _HashingStream:
    """A file opened for writing whose bytes also go through SHA-256. Valid only while the
    writes are sequential from the start: a seek (nothing in DCP's writer does one) voids it,
    and the file is then hashed by reading it like any file nobody hashed."""

    def __init__(self, f):
        self._f, self._h, self.size, self.sequential = f, hashlib.sha256(), 0, True

    def write(self, data) -> int:
        n = self._f.write(data)
        view = memoryview(data).cast("B")
        self._h.update(view[:n])
        self.size += n
        return n

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.write(chunk)

    def seek(self, *args):
        self.sequential = False
        return self._f.seek(*args)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def __getattr__(self, name):  # tell, fileno, flush, close, ...: the file's own
        return getattr(self._f, name)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, with every file it writes hashed on the way: `digests` maps
    each file's name to its size and SHA-256 (a rename, as of `.metadata.tmp`, carries it)."""

    def __init__(self):
        super().__init__()
        self.digests: dict[str, dict] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        self.digests.pop(Path(path).name, None)
        with super().create_stream(path, mode) as f:
            stream = _HashingStream(f)
            yield stream
        if stream.sequential:
            self.digests[Path(path).name] = {"bytes": stream.size, "sha256": stream.hexdigest()}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        entry = self.digests.pop(Path(path).name, None)
        if entry is not None:
            self.digests[Path(new_path).name] = entry


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter, hashing what it writes (`digests`); one per save."""

    def __init__(self, path):
        super().__init__(path)
        self.fs = _HashingFileSystem()

    @property
    def digests(self) -> dict[str, dict]:
        return self.fs.digests


def _entry(path: Path, written: dict) -> dict:
    """A file's manifest entry: its digest as written when that covers the file as it is on disk
    (same size), else read and hashed now."""
    size = path.stat().st_size
    known = written.get(path.name)
    if known is not None and known["bytes"] == size:
        return dict(known)
    return {"bytes": size, "sha256": sha256(path)}


def bytes_entry(data: bytes) -> dict:
    """The manifest entry of a file written from `data`."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_own_digests(tmp: Path, rank: int, written: dict | None = None) -> None:
    """This rank's shard files' digests (as written when `written` has them); the digest file
    appears whole (temporary name, rename)."""
    tmp = Path(tmp)
    entries = {p.name: _entry(p, written or {}) for p in own_files(tmp, rank)}
    target = _digest_path(tmp, rank)
    part = target.with_name(target.name + ".part")
    part.write_text(json.dumps({"rank": rank, "files": entries}))
    os.replace(part, target)


def collect_digests(tmp: Path, world: int, grace_s: float, written: dict | None = None) -> dict:
    """Rank 0: every rank's digests, then removes the digest files. A rank whose digests have not
    appeared within grace_s (it died after writing, or is slow) has its shards hashed here: its
    files are complete (DCP's save finished on every rank before this is called), so the
    checkpoint is still published, only later. Files no rank claimed are taken from `written`
    (rank 0's own, hashed as written) or hashed here."""
    tmp = Path(tmp)
    deadline = time.monotonic() + grace_s
    paths = [_digest_path(tmp, r) for r in range(world)]
    pause = 0.005
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(0.1, pause * 2)
    entries: dict = {}
    for p in paths:
        if p.exists():
            entries.update(json.loads(p.read_text())["files"])
            p.unlink()
    for p in sorted(tmp.iterdir()):
        if p.is_file() and p.name not in entries and p.name not in (MANIFEST, MARKER) \
                and not p.name.startswith(DIGESTS):
            entries[p.name] = _entry(p, written or {})
    return entries


def write_manifest_from(tmp: Path, entries: dict) -> int:
    """manifest.json from combined digests; returns the checkpoint's total bytes."""
    (Path(tmp) / MANIFEST).write_text(json.dumps({"version": 1, "files": dict(sorted(entries.items()))}, indent=1))
    return sum(e["bytes"] for e in entries.values())


# ---- verifying, shared out -------------------------------------------------------------------
def shares(items: list, world: int) -> list[list]:
    """Split (key, size) work items over `world` ranks, largest first to the least loaded: the
    same split on every rank, each share within one file of the mean."""
    load = [0] * world
    out: list[list] = [[] for _ in range(world)]
    for item in sorted(items, key=lambda it: (-it[1], str(it[0]))):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(item)
        load[r] += item[1]
    return out


def _structure(ckpt: Path, deep: bool) -> tuple[list, str | None]:
    items, problem = manifest_items(ckpt)
    if problem is None and deep:
        try:
            read_dcp_metadata(ckpt)  # a hostile .metadata is refused here, before any load
        except NdtrainError as exc:
            problem = str(exc)
    return items, problem


def verify_shared(ckpts: list[Path], check_hashes: bool = True, group=None) -> dict[str, str | None]:
    """{str(ckpt): None if intact else the reason}, the same on every rank. Collective when a
    process group is up (every rank must call it with the same list, on `group`: None for the
    default one); else all work is local. `check_hashes=False` reads no file but the manifests:
    each file must be there with its manifest size."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if group_active() else (0, 1)
    structure = broadcast_object({str(c): _structure(Path(c), check_hashes) for c in ckpts} if rank == 0 else None,
                                 group=group)
    work = [((key, tuple(item)), item[1] if check_hashes else 1) for key, (items, problem) in structure.items()
            if problem is None for item in items]
    mine = shares(work, world)[rank]
    found: dict[str, str] = {}
    for (key, item), _ in mine:
        if key not in found:
            problem = check_items(Path(key), [item], check_hashes)
            if problem:
                found[key] = problem
    gathered = gather_objects(found, group=group)
    verdicts = {key: problem for key, (_, problem) in structure.items()}
    for part in gathered:
        for key, problem in part.items():
            verdicts[key] = verdicts[key] or problem
    return verdicts
