"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, layout-independent, atomic.

A checkpoint is a directory `step_XXXXXXXX/` holding DCP shards of model and optimizer state,
`train_state.json` (step, tokens seen, loader position, resolved config) and `manifest.json`
(sizes and SHA-256 of every file). It is written as `.step_XXXXXXXX.partial/` and published by
writing the COMPLETE marker and renaming, so a reader never sees a half-written checkpoint and
the previous one is untouched until the new one is published. Non-tensor state is JSON, never
pickle, so loading a checkpoint cannot execute code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ndtrain.config import to_dict
from ndtrain.errors import NdtrainError

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(ckpt: Path) -> None:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER))
    entries = {str(p.relative_to(ckpt)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (ckpt / MANIFEST).write_text(json.dumps({"version": 1, "files": entries}, indent=1))


def verify(ckpt: Path, check_hashes: bool = True) -> str | None:
    """None if `ckpt` is a published, intact checkpoint; else the reason it is not."""
    if not (ckpt / MARKER).is_file():
        return "no COMPLETE marker (an interrupted save)"
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"unreadable manifest: {exc}"
    for rel, meta in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != meta["bytes"]:
            return f"file {rel} has {p.stat().st_size} bytes, manifest says {meta['bytes']}"
        if check_hashes and _sha256(p) != meta["sha256"]:
            return f"file {rel} fails its checksum"
    return None


def read_train_state(ckpt: Path) -> dict:
    try:
        return json.loads((Path(ckpt) / TRAIN_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise NdtrainError(f"{ckpt}: cannot read {TRAIN_STATE}: {exc}") from None


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / MARKER).exists())


class Checkpointer:
    def __init__(self, cfg, run_dir: Path, trainer):
        self.cfg = cfg
        self.trainer = trainer
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.interval_steps
        return every > 0 and step % every == 0 and step < self.cfg.train.steps

    def _module(self):
        parts = self.trainer.model_parts
        if len(parts) != 1:
            raise NotImplementedError("checkpointing several model parts per rank (virtual pipeline stages)")
        return parts[0]

    def _state(self) -> dict:
        t = self.trainer
        model_sd, optim_sd = get_state_dict(self._module(), t.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, final: bool = False) -> Path | None:
        t = self.trainer
        name = f"step_{t.step:08d}"
        target = self.root / name
        if (target / MARKER).exists():
            return target  # this step is already published (e.g. interval save == final step)
        tmp = self.root / f".{name}.partial"
        if t.rt.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # a leftover of an interrupted save: never a published checkpoint
            tmp.mkdir()
        _barrier()
        dcp.save(self._state(), checkpoint_id=str(tmp))
        if t.rt.is_main:
            state = {"step": t.step, "tokens_seen": t.tokens_seen, "loader": t.loader.state_dict(),
                     "config": to_dict(self.cfg), "layout": t.dims.describe(), "world_size": t.rt.world_size}
            (tmp / TRAIN_STATE).write_text(json.dumps(state, indent=1))
            write_manifest(tmp)
            with open(tmp / MARKER, "w") as f:
                f.write(name + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            self._retain()
        _barrier()
        return target

    def _retain(self) -> None:
        keep_last, keep_every = self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every
        published = list_checkpoints(self.root)
        for ckpt in published[:-keep_last]:
            step = int(ckpt.name.split("_")[1])
            if keep_every and step % keep_every == 0:
                continue
            shutil.rmtree(ckpt)

    def latest_good(self) -> Path | None:
        for ckpt in reversed(list_checkpoints(self.root)):
            problem = verify(ckpt)
            if problem is None:
                return ckpt
            self.trainer.logger.info(f"checkpoint {ckpt} skipped: {problem}")
        return None

    def resume(self, spec: str) -> None:
        if spec == "auto":
            path = self.latest_good()
            if path is None:
                self.trainer.logger.info(f"no checkpoint under {self.root}: starting from scratch")
                return
        else:
            path = Path(spec)
            problem = verify(path)
            if problem is not None:
                raise NdtrainError(f"cannot resume from {path}: {problem}")
        self.load(path)

    def load(self, path: Path) -> None:
        t = self.trainer
        state = read_train_state(path)
        saved_model = state.get("config", {}).get("model", {})
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "n_experts"):
            if key in saved_model and saved_model[key] != getattr(self.cfg.model, key):
                raise NdtrainError(f"checkpoint {path} has model.{key}={saved_model[key]} but this run has "
                                   f"{getattr(self.cfg.model, key)}: it belongs to a different model shape")
        sd = self._state()
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(self._module(), t.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        t.step = state["step"]
        t.tokens_seen = state["tokens_seen"]
        t.loader.load_state_dict(state["loader"])
        t.logger.info(f"resumed from {path} at step {t.step} (saved as {state.get('layout')} on "
                      f"{state.get('world_size')} ranks)")

    def finish(self) -> None:
        pass
