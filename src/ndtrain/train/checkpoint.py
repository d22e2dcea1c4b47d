"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, layout-independent, atomic, async.

Saving writes DCP shards of model and optimizer state into `.step_XXXXXXXX.partial/`; rank 0
then adds `train_state.json` (step, tokens seen, loader position, RNG, data fingerprint,
resolved config), `manifest.json` (sizes + SHA-256) and the COMPLETE marker, and renames the
directory to `step_XXXXXXXX/`. Nothing older is touched until that rename has happened.

With `checkpoint.async = true` the step only pays for copying the state into RAM; a background
thread writes it through its own Gloo group (sharing the training group with a concurrent
collective breaks Gloo) and rank 0 publishes once the write completes. One save is in flight
at a time.

Model and optimizer state go through get_state_dict/set_state_dict with flattened optimizer
keys, so any layout (FSDP, TP, pipeline stages, one process) loads any other's checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from ndtrain.config import to_dict
from ndtrain.errors import NdtrainError
from ndtrain.train.ckpt_store import (FORMAT, MARKER, TRAIN_STATE, dcp_load, fsync_dir, list_checkpoints, partials,
                                      read_train_state, step_name, step_of, verify, write_manifest, write_marker)

__all__ = ["Checkpointer", "list_checkpoints", "read_train_state", "verify", "MARKER"]

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# One process saving alone is intended (world 1), not a misconfiguration worth a warning per save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
MODEL_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "n_experts", "expert_ffn_dim",
              "n_shared_experts", "moe_dense_layers", "tie_embeddings")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _broadcast(obj):
    if not _dist():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def data_fingerprint(manifest: dict) -> dict:
    # Defined with the manifest (shard-count independent; mixtures list their components).
    from ndtrain.data.manifest import fingerprint

    return fingerprint(manifest)


@dataclass
class _Pending:
    step: int
    name: str
    future: object
    started: float
    stall_s: float
    publisher: threading.Thread | None = None
    error: list = field(default_factory=list)
    done_at: list = field(default_factory=list)  # when this rank's part was written (and published, on rank 0)


class Checkpointer:
    def __init__(self, cfg, run_dir: Path, trainer):
        self.cfg = cfg
        self.trainer = trainer
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"
        self.async_ = cfg.checkpoint.async_
        self.fault = lambda point, step: None  # set_fault_hook: recovery.Recovery injects faults in tests
        self.skip_windows: list[list[int]] = []  # data windows dropped after non-finite rollbacks
        self.history: list[dict] = []
        self.pending: _Pending | None = None
        self.last_saved_step: int | None = None
        self.loaded_from: Path | None = None
        # Created once, by every rank, before any save: the async writer's collectives must never
        # share a group with the training loop's.
        # Its timeout covers the slowest rank's whole write (a hung peer is caught by the training
        # group's timeout and the watchdog, since training goes on meanwhile).
        self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(1800.0, cfg.train.timeout_s))) \
            if self.async_ and _dist() else None
        self._stager = None
        if self.async_:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Kept for the whole run: it reuses its RAM copies, so later saves skip allocation.
            self._stager = DefaultStager(StagingOptions(False, False, False, False))
        if self.is_main:
            for stale in partials(self.root):  # never published; left by a killed save
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()

    @property
    def is_main(self) -> bool:
        return self.trainer.rt.is_main

    def _info(self, text: str) -> None:
        self.trainer.logger.info(text)

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.interval_steps
        return every > 0 and step % every == 0 and step < self.cfg.train.steps

    # ---- state -------------------------------------------------------------------------------
    def _module(self) -> nn.Module:
        parts = self.trainer.model_parts
        if len(parts) == 1:
            return parts[0]
        from ndtrain.parallel.pipeline import merged_view  # virtual stages: one view, canonical names

        return merged_view(parts)

    def _optimizers(self) -> list:
        opt = self.trainer.optimizer
        return list(opt) if isinstance(opt, (list, tuple)) else [opt]

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self._module(), self._optimizers(), options=OPTIONS)
        if self.cfg.parallel.mixed_precision == "fp8":  # the fp32 masters, not torchao's wrapper
            from ndtrain.parallel.float8 import plain_state

            model_sd, optim_sd = plain_state(model_sd), plain_state(optim_sd)
        return {"model": model_sd, "optim": optim_sd}

    def train_state(self) -> dict:
        t = self.trainer
        return {"format": FORMAT, "version": 2, "kind": "full", "step": t.step, "tokens_seen": t.tokens_seen,
                "loader": t.loader.state_dict(), "skip_windows": [list(w) for w in self.skip_windows],
                "rng": {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()},
                "data": data_fingerprint(t.train_set.manifest), "config": to_dict(self.cfg),
                "layout": t.dims.describe(), "world_size": t.rt.world_size, "dp_size": t.dp_size,
                "saved_at": time.time()}

    # ---- saving ------------------------------------------------------------------------------
    def save(self, final: bool = False) -> Path:
        t = self.trainer
        name = step_name(t.step)
        if self.last_saved_step == t.step:
            self.wait()
            return self.root / name
        self.wait()  # one save in flight: its RAM copy and the directory names are reused
        tmp = self.root / f".{name}.partial"
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        _barrier()
        meta = self.train_state()
        t0 = time.perf_counter()
        state = self._state()
        if self.async_ and not final:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg,
                                    async_stager=self._stager, no_dist=not _dist())
            pending = _Pending(t.step, name, future, t0, time.perf_counter() - t0)
            if self.is_main:
                pending.publisher = threading.Thread(target=self._publish_when_written, args=(pending, tmp, meta),
                                                     name="ndtrain-ckpt-publish", daemon=True)
                pending.publisher.start()
            else:
                future.add_done_callback(lambda _f: pending.done_at.append(time.perf_counter()))
            self.pending = pending
            self.last_saved_step = t.step
            self.fault("save", t.step)
            return self.root / name
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _dist())
        if self.is_main:
            self._publish(tmp, name, meta)
        _barrier()
        total = time.perf_counter() - t0
        self._record(t.step, "sync", total, total)
        self.last_saved_step = t.step
        return self.root / name

    def _publish_when_written(self, pending: _Pending, tmp: Path, meta: dict) -> None:
        try:
            pending.future.result()
            self._publish(tmp, pending.name, meta)
            pending.done_at.append(time.perf_counter())
        except BaseException as exc:  # reported to every rank by wait(); never published
            pending.error.append(exc)

    def _publish(self, tmp: Path, name: str, meta: dict) -> None:
        (tmp / TRAIN_STATE).write_text(json.dumps(meta, indent=1))
        write_manifest(tmp)
        self.fault("publish", meta["step"])
        write_marker(tmp, name)
        self.fault("rename", meta["step"])
        target = self.root / name
        if target.exists():
            # Another timeline reached this step (a rollback, or a resume from an older path):
            # keep the old directory aside rather than deleting anything.
            aside = self.root / f"{name}.replaced-{int(time.time() * 1000)}"
            os.replace(target, aside)
            self._info(f"checkpoint {target} existed from an earlier attempt; moved it to {aside.name}")
        os.replace(tmp, target)
        fsync_dir(self.root)
        self._retain()

    def _retain(self) -> None:
        keep_last, keep_every = self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every
        for ckpt in list_checkpoints(self.root)[:-keep_last]:
            if keep_every and step_of(ckpt) % keep_every == 0:
                continue
            shutil.rmtree(ckpt, ignore_errors=True)

    def _record(self, step: int, mode: str, stall_s: float, total_s: float) -> None:
        row = {"step": step, "checkpoint_mode": mode, "checkpoint_stall_s": stall_s, "checkpoint_total_s": total_s}
        self.history.append(row)
        self.trainer.logger.log(row)
        self._info(f"checkpoint {step_name(step)}: {mode}, training paused {stall_s:.3f} s, "
                   f"written and published in {total_s:.2f} s")

    def wait(self) -> None:
        """Block until the save in flight is written and published; every rank learns whether it
        failed (a rank that saw an error would otherwise leave its peers in a collective)."""
        p, self.pending = self.pending, None
        if p is None:
            return
        error = None
        try:
            p.future.result()
        except BaseException as exc:
            error = exc
        if p.publisher is not None:
            p.publisher.join()
            error = error or (p.error[0] if p.error else None)
        failed = _any_rank(error is not None, self.trainer.rt.device)
        if failed:
            if self.last_saved_step == p.step:
                self.last_saved_step = None
            raise NdtrainError(f"checkpoint {p.name} could not be written: {error or 'failed on another rank'}")
        self._record(p.step, "async", p.stall_s, (p.done_at[0] if p.done_at else time.perf_counter()) - p.started)

    def finish(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ---- resuming ----------------------------------------------------------------------------
    def latest_good(self, root: Path | None = None) -> Path | None:
        for ckpt in reversed(list_checkpoints(root or self.root)):
            problem = verify(ckpt)
            if problem is None:
                return ckpt
            self._info(f"checkpoint {ckpt} skipped: {problem}; trying the previous one (nothing deleted)")
        return None

    def _choose(self, spec: str) -> tuple[Path | None, str | None]:
        """Rank 0 picks (every rank must load the same directory); returns (path, error)."""
        if spec == "auto":
            return self.latest_good(), None
        path = Path(spec)
        if path.is_dir() and not (path / MARKER).exists() and not (path / TRAIN_STATE).exists():
            for root in (path, path / "checkpoints"):  # a checkpoints/ or run directory: its newest good one
                if list_checkpoints(root):
                    found = self.latest_good(root)
                    return (found, None) if found else (None, f"no intact checkpoint under {root}")
        problem = verify(path)
        return (path, None) if problem is None else (None, f"cannot resume from {path}: {problem}")

    def resume(self, spec: str) -> Path | None:
        path, error = self._choose(spec) if self.is_main else (None, None)
        path, error = _broadcast((str(path) if path else None, error))
        if error:
            raise NdtrainError(error)
        if path is None:
            self._info(f"no checkpoint under {self.root}: starting from scratch")
            return None
        self.load(Path(path))
        return Path(path)

    def check_compatible(self, path: Path, state: dict) -> None:
        saved_model = state.get("config", {}).get("model", {})
        for key in MODEL_KEYS:
            if key in saved_model and saved_model[key] != getattr(self.cfg.model, key):
                raise NdtrainError(f"checkpoint {path} has model.{key}={saved_model[key]} but this run has "
                                   f"{getattr(self.cfg.model, key)}: it belongs to a different model shape")
        if state.get("kind", "full") != "full":
            return
        saved, here = state.get("data"), data_fingerprint(self.trainer.train_set.manifest)
        if saved and saved != here:
            diff = [k for k in here if saved.get(k) != here[k]]
            raise NdtrainError(f"checkpoint {path} was trained on different data ({', '.join(diff)} differ from "
                               f"{self.cfg.data.path}); resuming would not continue the same sample stream")

    def load(self, path: Path) -> None:
        t = self.trainer
        self.wait()
        state = read_train_state(path)
        self.check_compatible(path, state)
        module = self._module()
        if state.get("kind", "full") != "full":  # imported weights: model only, fresh optimizer and data
            sd = {"model": get_model_state_dict(module, options=OPTIONS)}
            dcp_load(sd, path)
            set_model_state_dict(module, sd["model"])
            self.loaded_from = path
            self._info(f"initialised weights from {path} ({state.get('kind')}); step 0")
            return
        sd = self._state()
        dcp_load(sd, path)
        set_state_dict(module, self._optimizers(), model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=OPTIONS)
        t.step = state["step"]
        t.tokens_seen = state["tokens_seen"]
        t.loader.load_state_dict(state["loader"])
        self.skip_windows = [list(w) for w in state.get("skip_windows", [])]
        rng = state.get("rng", {}).get("torch")
        if rng:
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))
        self.last_saved_step = t.step
        self.loaded_from = path
        self._info(f"resumed from {path} at step {t.step} (saved as {state.get('layout')} on "
                   f"{state.get('world_size')} ranks; now {t.dims.describe()} on {t.rt.world_size})")

    # What recovery.Recovery asks of the checkpointer (it never writes its attributes).
    def set_fault_hook(self, fault) -> None:
        """`fault(point, step)` runs at each save's save/publish/rename points (fault injection)."""
        self.fault = fault

    def add_skip_window(self, window: list[int]) -> None:
        """A data window [start, end) of samples to skip from now on; saved with every checkpoint."""
        self.skip_windows.append(list(window))


def _any_rank(flag: bool, device) -> bool:
    if not _dist():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
