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

from ndtrain.compat.torch import dcp_metadata_allowlist, dcp_set_element
from ndtrain.errors import NdtrainError
from ndtrain.model.config import ARCHITECTURE_KEYS, FUNCTION_KEYS

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


def manifest_items(ckpt: Path) -> tuple[list[tuple[str, int, str]], str | None]:
    """The files a published checkpoint must hold, (relative path, bytes, sha256), from its
    manifest; or the reason `ckpt` is not a published checkpoint. Cheap: no file is hashed."""
    ckpt = Path(ckpt)
    if not ckpt.exists():
        return [], "it does not exist"
    if not ckpt.is_dir():
        return [], not_a_directory(ckpt)
    if not (ckpt / MARKER).is_file():
        return [], "no COMPLETE marker (an interrupted save, or not an ndtrain checkpoint)"
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        items = [(rel, meta["bytes"], meta["sha256"]) for rel, meta in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [], f"unreadable manifest: {exc}"
    for rel, size, digest in items:
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0 and isinstance(digest, str)
                and re.fullmatch(r"[0-9a-f]{64}", digest)) or ".." in Path(rel).parts or Path(rel).is_absolute():
            return [], f"unreadable manifest: bad entry for {rel!r}"
    if not any(rel == ".metadata" for rel, _, _ in items) or not any(rel == TRAIN_STATE for rel, _, _ in items):
        return [], "the manifest does not list .metadata and train_state.json"
    return items, None


def check_items(ckpt: Path, items: list[tuple[str, int, str]], check_hashes: bool = True) -> str | None:
    """None if these manifest entries match the files on disk; else the first mismatch."""
    for rel, size, digest in items:
        p = Path(ckpt) / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != size:
            return f"file {rel} has {p.stat().st_size} bytes, the manifest says {size} (truncated?)"
        if check_hashes and sha256(p) != digest:
            return f"file {rel} fails its SHA-256 checksum (corrupted)"
    return None


def verify(ckpt: Path, check_hashes: bool = True) -> str | None:
    """None if `ckpt` is a published, intact checkpoint; else the reason it is not. Hashes every
    file in this process; a process group shares that work (digest.verify_shared)."""
    items, problem = manifest_items(ckpt)
    return problem or check_items(ckpt, items, check_hashes)


def not_a_directory(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError as exc:
        return f"cannot read it: {exc.strerror}"
    if head[:1] == b"\x80" or head == b"PK":
        return ("it is a single file that looks like a pickle / torch.save archive; ndtrain never unpickles "
                "files (it could run code). Convert it to safetensors and use `ndtrain import`")
    return "it is a file, not a checkpoint directory"


def _is_int(v, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


# Field -> (check, what it must be). Absent optional fields are fine; present ones must match.
_STATE_FIELDS = {
    "step": (_is_int, "an integer >= 0"),
    "tokens_seen": (_is_int, "an integer >= 0"),
    "config": (lambda v: isinstance(v, dict) and isinstance(v.get("model", {}), dict), "a table with a model table"),
    "kind": (lambda v: v in ("full", "weights"), "'full' or 'weights'"),
    "loader": (lambda v: isinstance(v, dict) and all(_is_int(v.get(k)) for k in ("consumed_samples", "seed"))
               and _is_int(v.get("seq_len"), 1), "a table of consumed_samples, seed and seq_len integers"),
    "skip_windows": (lambda v: isinstance(v, list) and all(isinstance(w, list) and len(w) == 2 and all(map(_is_int, w))
                                                          for w in v), "a list of [start, end] integer pairs"),
    "rng": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()), "a table of strings"),
    "data": (lambda v: v is None or isinstance(v, dict), "a table"),
    "world_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "dp_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "layout": (lambda v: isinstance(v, str), "a string"),
    "saved_at": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "timeline": (lambda v: isinstance(v, dict) and isinstance(v.get("id", ""), str), "a table with an id string"),
}
_REQUIRED_STATE = {"full": ("step", "tokens_seen", "config", "loader"), "weights": ("step", "config")}


def read_train_state(ckpt: Path) -> dict:
    """train_state.json, checked field by field: a hand-edited or foreign file is refused with
    the field named, instead of failing later in the middle of a load."""
    path = Path(ckpt) / TRAIN_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise NdtrainError(f"{ckpt}: cannot read {TRAIN_STATE}: {exc}") from None
    if not isinstance(state, dict):
        raise NdtrainError(f"{path}: not a JSON object; not an ndtrain checkpoint")
    kind = state.get("kind", "full")
    if kind not in _REQUIRED_STATE:
        raise NdtrainError(f"{path}: field 'kind' must be 'full' or 'weights', got {str(kind)[:80]!r}")
    missing = [k for k in _REQUIRED_STATE[kind] if k not in state]
    if missing:
        raise NdtrainError(f"{path} lacks {', '.join(missing)}; not an ndtrain checkpoint (or an incomplete one)")
    for key, (ok, what) in _STATE_FIELDS.items():
        if key in state and not ok(state[key]):
            raise NdtrainError(f"{path}: field {key!r} must be {what}, got {str(state[key])[:80]!r}")
    return state


def checkpoint_config(ckpt: Path, state: dict):
    """The JobConfig recorded in a checkpoint, validated like any config; a bad value names the file."""
    from ndtrain.config import from_dict

    try:
        return from_dict(state["config"])
    except NdtrainError as exc:
        raise NdtrainError(f"{Path(ckpt) / TRAIN_STATE}: recorded config is invalid: {exc}") from None


# Every model key that changes what the weights compute (model/config.py keeps the one list).
MODEL_KEYS = FUNCTION_KEYS


def model_mismatch(model_cfg, state: dict, allowed=()) -> str | None:
    """How the checkpoint's recorded model differs from `model_cfg` in what the weights compute
    (every such key, named), or None. `allowed`: keys the user lets change (a fine-tune)."""
    saved = state.get("config", {}).get("model", {})
    diff = [k for k in MODEL_KEYS if k in saved and k not in allowed and saved[k] != getattr(model_cfg, k)]
    if not diff:
        return None
    said = ", ".join(f"model.{k}={saved[k]} but this run has {getattr(model_cfg, k)}" for k in diff)
    if any(k in ARCHITECTURE_KEYS for k in diff):
        return f"has {said}: it belongs to a different model shape"
    same = " ".join(f"--model.{k}={str(saved[k]).lower()}" for k in diff)
    return (f"has {said}: resuming would change the function its weights compute; pass {same} to continue "
            f"it, or --checkpoint.allow_model_change='{json.dumps(diff)}' to fine-tune with the change")


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints under `root` (marker present; integrity not checked), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / MARKER).exists()]
    return sorted(found, key=step_of)


# What ndtrain itself leaves in a checkpoints directory when killed: a save's partial directory
# and one retention was deleting. Clean-up touches these names only, and only when every entry
# is a file a checkpoint holds (DCP's shards and metadata, ndtrain's digests, state, manifest,
# marker): a user's `photos.partial/`, or a directory of that name holding anything else, stays.
_LEFTOVER = re.compile(r"^\.step_\d{8}\.(partial|deleting)$")
_CKPT_FILE = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|\.digests-rank\d{5}\.json(\.part)?|"
                        r"train_state\.json|manifest\.json|COMPLETE)$")


def holds_only_checkpoint_files(path: Path) -> bool:
    try:
        entries = list(Path(path).iterdir())
    except OSError:
        return False
    return all(_CKPT_FILE.match(e.name) and e.is_file() and not e.is_symlink() for e in entries)


def leftovers(root: Path) -> tuple[list[Path], list[Path]]:
    """(ndtrain's own leftovers under `root`, directories with a leftover's name that hold
    something else): the first may be removed, the second never."""
    root = Path(root)
    named = sorted(p for p in root.iterdir() if _LEFTOVER.match(p.name) and p.is_dir() and not p.is_symlink()) \
        if root.is_dir() else []
    ours = [p for p in named if holds_only_checkpoint_files(p)]
    return ours, [p for p in named if p not in ours]


# ---- reading without executing -------------------------------------------------------------
_DCP_CLASSES = dcp_metadata_allowlist()  # DCP's classes, private ones included: compat.torch


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"disallowed object {module}.{name}")


def read_dcp_metadata(ckpt: Path):
    """DCP's `.metadata` through the allow-list; anything else is one NdtrainError line (torch's
    own loader would log a traceback per attempt before failing)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(ckpt) / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as exc:
        raise NdtrainError(f"{path}: cannot read checkpoint metadata: {exc.strerror}") from None
    except Exception as exc:  # a hostile or damaged pickle can raise almost anything
        raise NdtrainError(f"{path}: refused to read checkpoint metadata ({type(exc).__name__}: {exc}); the file "
                           f"is corrupt or was not written by torch.distributed.checkpoint") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise NdtrainError(f"{path}: refused to read checkpoint metadata (it holds a {type(metadata).__name__}, not "
                           f"DCP Metadata); the file was not written by torch.distributed.checkpoint")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read through an allow-list instead of plain pickle
    (and read once: dcp_load checks it before DCP sees it)."""

    def __init__(self, path, metadata=None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        metadata = self._metadata if self._metadata is not None else read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_tensor_shapes(ckpt: Path, expected: dict, metadata=None, prefix: str = "model.") -> None:
    """Refuses a checkpoint whose recorded model (train_state.json) disagrees with its tensors:
    `expected` maps names to the shapes that model has."""
    stored = (metadata or read_dcp_metadata(ckpt)).state_dict_metadata
    for name, shape in expected.items():
        meta = stored.get(prefix + name)
        if meta is None:
            raise NdtrainError(f"checkpoint {ckpt}: its recorded model has {name} but no such tensor is stored; "
                               f"train_state.json and the tensors disagree")
        size = list(getattr(meta, "size", []) or [])
        if size != list(shape):
            raise NdtrainError(f"checkpoint {ckpt}: its recorded model gives {name} the shape {list(shape)} but the "
                               f"stored tensor has {size}; train_state.json and the tensors disagree")


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer hyper-parameters) are plain numbers and tuples: load them
    with weights_only=True instead of DCP's default full unpickling."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            dcp_set_element()(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state: dict, ckpt: Path, no_dist: bool = False) -> None:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    metadata = read_dcp_metadata(ckpt)  # before DCP: its loader logs tracebacks on a bad file
    model = state.get("model")
    if isinstance(model, dict):
        check_tensor_shapes(ckpt, {k: tuple(v.shape) for k, v in model.items() if hasattr(v, "shape")}, metadata)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when loading without a process group
            dcp.load(state, storage_reader=SafeReader(str(ckpt), metadata), planner=SafeLoadPlanner(), no_dist=no_dist)
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
    from ndtrain.model.llama import build_model

    ckpt = Path(ckpt)
    problem = verify(ckpt, check_hashes=check)
    if problem:
        raise NdtrainError(f"checkpoint {ckpt} is not usable: {problem}")
    state = read_train_state(ckpt)
    cfg = checkpoint_config(ckpt, state)
    model = build_model(cfg.model, "cpu")
    sd = {"model": model.state_dict()}
    dcp_load(sd, ckpt, no_dist=True)
    return {k: v.detach().clone() for k, v in sd["model"].items()}, state
