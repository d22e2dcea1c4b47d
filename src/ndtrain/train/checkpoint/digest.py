"""Who hashes what, so that publishing and verifying a checkpoint scale with the number of ranks.

Publish: every rank hashes the shard files it wrote (DCP names them `__<rank>_<n>.distcp`) and
leaves the digests in `.digests-rankNNNNN.json` inside the partial directory; rank 0 hashes only
`.metadata` and `train_state.json`, reads the digest files, writes `manifest.json` from them and
removes them (a rank that died after writing is hashed by rank 0, so its checkpoint is still
published). Files alone carry the digests: no collective, so an async save's background
threads never share a process group with anyone.

Verify (on resume): rank 0 reads the manifests and the DCP metadata (cheap) and broadcasts the
file lists; the files are split over the ranks by size, each rank hashes its share, and one
all_gather_object combines the verdicts. Every rank ends with the same answer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

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


def write_own_digests(tmp: Path, rank: int) -> None:
    """Hashes this rank's shard files; the digest file appears whole (temporary name, rename)."""
    tmp = Path(tmp)
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in own_files(tmp, rank)}
    target = _digest_path(tmp, rank)
    part = target.with_name(target.name + ".part")
    part.write_text(json.dumps({"rank": rank, "files": entries}))
    os.replace(part, target)


def collect_digests(tmp: Path, world: int, grace_s: float) -> dict:
    """Rank 0: every rank's digests, then removes the digest files. A rank whose digests have not
    appeared within grace_s (it died after writing, or is slow) has its shards hashed here: its
    files are complete (DCP's save finished on every rank before this is called), so the
    checkpoint is still published, only later. Files no rank claimed are hashed here too."""
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
            entries[p.name] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
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


def _structure(ckpt: Path) -> tuple[list, str | None]:
    items, problem = manifest_items(ckpt)
    if problem is None:
        try:
            read_dcp_metadata(ckpt)  # a hostile .metadata is refused here, before any load
        except NdtrainError as exc:
            problem = str(exc)
    return items, problem


def verify_shared(ckpts: list[Path]) -> dict[str, str | None]:
    """{str(ckpt): None if intact else the reason}, the same on every rank. Collective when a
    process group is up (every rank must call it with the same list); else all work is local."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if group_active() else (0, 1)
    structure = broadcast_object({str(c): _structure(Path(c)) for c in ckpts} if rank == 0 else None)
    work = [((key, tuple(item)), item[1]) for key, (items, problem) in structure.items() if problem is None
            for item in items]
    mine = shares(work, world)[rank]
    found: dict[str, str] = {}
    for (key, item), _ in mine:
        if key not in found:
            problem = check_items(Path(key), [item])
            if problem:
                found[key] = problem
    gathered = gather_objects(found)
    verdicts = {key: problem for key, (_, problem) in structure.items()}
    for part in gathered:
        for key, problem in part.items():
            verdicts[key] = verdicts[key] or problem
    return verdicts

