"""The on-disk checkpoint format: what a published checkpoint is and how it is checked.

A checkpoint is a directory `step_XXXXXXXX/` holding DCP shards (`*.distcp` plus `.metadata`),
`train_state.json`, the run's `tokenizer.json` when it has one (BPE; the byte tokenizer needs no
file), `manifest.json` (size and SHA-256 of every other file) and the `COMPLETE` marker, written
last. Reading its tensors (through allow-lists, never plain pickle): reader.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ndtrain.data.manifest import TOKENIZER_NAME as TOKENIZER
from ndtrain.errors import NdtrainError
from ndtrain.paths import fsync_dir
from ndtrain.model.config import ARCHITECTURE_KEYS, FUNCTION_KEYS

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
CHECKPOINT_FORMAT = "ndtrain-checkpoint"
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


def write_manifest(ckpt: Path) -> None:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER))
    entries = {str(p.relative_to(ckpt)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}
    (ckpt / MANIFEST).write_text(json.dumps({"version": 1, "files": entries}, indent=1))


def tokenizer_to_carry(data_path: str, mix: list, info) -> bytes | None:
    """The bytes of the run's tokenizer.json, read once when the run starts, checked against its
    corpus manifest; every checkpoint then carries them, so sampling and export do not depend on
    the corpus staying where it was. None for the byte tokenizer (no file), or when the file
    cannot be read: training does not need it, so that is said in one line, not refused."""
    from ndtrain.data.mixture import first_data_dir
    from ndtrain.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(first_data_dir(data_path, mix)).file_bytes
    except (NdtrainError, OSError) as exc:
        info(f"checkpoints will not carry the tokenizer: {exc}")
        return None


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


def verify_checkpoint(ckpt: Path, check_hashes: bool = True) -> str | None:
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


def model_mismatch(model_cfg, state: dict, allowed=()) -> str | None:
    """How the checkpoint's recorded model differs from `model_cfg` in what the weights compute
    (every such key, named), or None. `allowed`: keys the user lets change (a fine-tune)."""
    saved = state.get("config", {}).get("model", {})
    diff = [k for k in FUNCTION_KEYS if k in saved and k not in allowed and saved[k] != getattr(model_cfg, k)]
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
# is a file a checkpoint holds (DCP's shards and metadata, ndtrain's digests, state, tokenizer,
# manifest, marker): a user's `photos.partial/`, or a directory of that name holding anything
# else, stays.
_LEFTOVER = re.compile(r"^\.step_\d{8}\.(partial|deleting)$")
_CKPT_FILE = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|\.digests-rank\d{5}\.json(\.part)?|"
                        rf"train_state\.json|{re.escape(TOKENIZER)}|manifest\.json|COMPLETE)$")


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
