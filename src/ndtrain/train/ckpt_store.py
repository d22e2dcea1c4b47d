"""The on-disk checkpoint format: what a published checkpoint is, how it is checked, and how
its tensors are read without running code from the files.

A checkpoint is a directory `step_XXXXXXXX/` holding DCP shards (`*.distcp` plus `.metadata`),
`train_state.json`, `manifest.json` (size and SHA-256 of every other file) and the `COMPLETE`
marker, written last. DCP stores its `.metadata` and small non-tensor values with pickle; both
are read here through allow-lists (a restricted unpickler, `torch.load(weights_only=True)`), so a
tampered or foreign file is rejected instead of executed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from ndtrain.errors import NdtrainError

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
FORMAT = "ndtrain-checkpoint"
_NAME = re.compile(r"^step_(\d{8})$")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(ckpt: Path) -> int:
    m = _NAME.match(Path(ckpt).name)
    return int(m.group(1)) if m else -1


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt: Path) -> None:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER))
    entries = {str(p.relative_to(ckpt)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}
    (ckpt / MANIFEST).write_text(json.dumps({"version": 1, "files": entries}, indent=1))


def write_marker(ckpt: Path, text: str) -> None:
    with open(ckpt / MARKER, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def verify(ckpt: Path, check_hashes: bool = True) -> str | None:
    """None if `ckpt` is a published, intact checkpoint; else the reason it is not."""
    ckpt = Path(ckpt)
    if not ckpt.exists():
        return "it does not exist"
    if not ckpt.is_dir():
        return _not_a_directory(ckpt)
    if not (ckpt / MARKER).is_file():
        return "no COMPLETE marker (an interrupted save, or not an ndtrain checkpoint)"
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        items = [(rel, int(meta["bytes"]), str(meta["sha256"])) for rel, meta in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable manifest: {exc}"
    if not any(rel == ".metadata" for rel, _, _ in items) or not any(rel == TRAIN_STATE for rel, _, _ in items):
        return "the manifest does not list .metadata and train_state.json"
    for rel, size, digest in items:
        p = ckpt / rel
        if ".." in Path(rel).parts or not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != size:
            return f"file {rel} has {p.stat().st_size} bytes, the manifest says {size} (truncated?)"
        if check_hashes and sha256(p) != digest:
            return f"file {rel} fails its SHA-256 checksum (corrupted)"
    return None


def _not_a_directory(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] == b"\x80" or head == b"PK":
        return ("it is a single file that looks like a pickle / torch.save archive; ndtrain never unpickles "
                "files (it could run code). Convert it to safetensors and use `ndtrain import`")
    return "it is a file, not a checkpoint directory"


def read_train_state(ckpt: Path) -> dict:
    try:
        state = json.loads((Path(ckpt) / TRAIN_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise NdtrainError(f"{ckpt}: cannot read {TRAIN_STATE}: {exc}") from None
    if not isinstance(state, dict) or "step" not in state or "config" not in state:
        raise NdtrainError(f"{ckpt}: {TRAIN_STATE} lacks step/config; not an ndtrain checkpoint")
    return state


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints under `root` (marker present; integrity not checked), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / MARKER).exists()]
    return sorted(found, key=step_of)


def partials(root: Path) -> list[Path]:
    root = Path(root)
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(".partial")) if root.is_dir() else []


# ---- reading without executing -------------------------------------------------------------
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"disallowed object {module}.{name}")


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read through an allow-list instead of plain pickle."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise NdtrainError(f"{path}: refused to read checkpoint metadata ({exc}); the file is corrupt "
                               f"or was not written by torch.distributed.checkpoint") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer hyper-parameters) are plain numbers and tuples: load them
    with weights_only=True instead of DCP's default full unpickling."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state: dict, ckpt: Path, no_dist: bool = False) -> None:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when loading without a process group
            dcp.load(state, storage_reader=SafeReader(str(ckpt)), planner=SafeLoadPlanner(), no_dist=no_dist)
    except NdtrainError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps per-rank failures: keep one line
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        ours = next((line for line in lines if "refused to read checkpoint metadata" in line), None)
        if ours:
            start = ours.find(str(Path(ckpt)))
            raise NdtrainError(ours[max(start, 0):].split("; rank local")[0]) from None
        detail = next((line for line in lines if "Error" in line or "mismatch" in line.lower()),
                      lines[0] if lines else "")
        raise NdtrainError(f"cannot load {ckpt}: {type(exc).__name__}: {detail[:300]}") from None


def load_model_weights(ckpt: Path, check: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Consolidated model weights of a checkpoint, in this process (no process group), whatever
    layout saved it; plus its train_state."""
    from ndtrain.config import from_dict
    from ndtrain.model.llama import build_model

    ckpt = Path(ckpt)
    problem = verify(ckpt, check_hashes=check)
    if problem:
        raise NdtrainError(f"checkpoint {ckpt} is not usable: {problem}")
    state = read_train_state(ckpt)
    cfg = from_dict(state["config"])
    model = build_model(cfg.model, "cpu")
    sd = {"model": model.state_dict()}
    dcp_load(sd, ckpt, no_dist=True)
    return {k: v.detach().clone() for k, v in sd["model"].items()}, state
