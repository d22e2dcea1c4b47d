"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, layout-independent, atomic, async.

Saving writes DCP shards of model and optimizer state into `.step_XXXXXXXX.partial/`; each rank
hashes the shards it wrote (digest.py); rank 0 then adds `train_state.json` (step, tokens
seen, loader position, RNG, data fingerprint, resolved config, timeline), `manifest.json` (sizes
+ SHA-256, combined from the ranks' digests) and the COMPLETE marker, and renames the directory
to `step_XXXXXXXX/`. Nothing older is touched until that rename has happened; a save that fails
(a full disk) removes its partial directory and leaves the previous checkpoint published.
Retention and timelines: retention.py.

With `checkpoint.async = true` the step only pays for copying the state into RAM; a background
thread writes it through its own Gloo group (sharing the training group with a concurrent
collective breaks Gloo) and rank 0 publishes once the write completes. One save is in flight
at a time.

What is saved is a mapping of named state objects, each with state_dict()/load_state_dict()
(state.py): "model" and "optim" go through DCP (flattened optimizer keys, so any layout
loads any other's checkpoint; under DiLoCo laid out by parallel.diloco's checkpoint view),
"progress" fills train_state.json's top-level step/tokens_seen/skip_windows, every other state
(loader, rng, diloco) sits there under its own name. Besides the states, the checkpointer is told
a few plain facts: the runtime (rank, world, device), where to log, the data fingerprint, the
layout's description and data-parallel size. It knows nothing of the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ndtrain.config import to_dict
from ndtrain.errors import NdtrainError, RunError
from ndtrain.parallel.diloco import checkpoint_restore, checkpoint_view
from ndtrain.train.checkpoint.failure import state_bytes, write_failure
from ndtrain.train.checkpoint import retention, staging
from ndtrain.train.checkpoint.resume import choose
from ndtrain.train.checkpoint.digest import (collect_digests, has_digests, verify_shared, write_manifest_from,
                                       write_own_digests)
from ndtrain.train.distributed import any_rank, barrier, broadcast_object, group_active
from ndtrain.train.checkpoint.store import (FORMAT, MARKER, MODEL_KEYS, TRAIN_STATE, dcp_load, fsync_dir, list_checkpoints,
                                      model_mismatch, read_train_state, step_name, step_of, verify, write_marker)

__all__ = ["Checkpointer", "data_fingerprint"]

TENSOR_STATES = ("model", "optim")  # through DCP; every other state goes into train_state.json
FLAT_STATE = "progress"  # its fields sit at train_state.json's top level (format version 2)
# One process saving alone is intended (world 1), not a misconfiguration worth a warning per save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


def _quiet(_row: dict) -> None:
    pass


class Checkpointer:
    """`states`: named objects with state_dict()/load_state_dict(), at least "model" and
    "progress" (see the module docstring). `runtime`: rank, world_size, device, is_main. `info`:
    one line of text for the log; `record`: a metrics row. `data`: the training data's
    fingerprint, compared on resume. `layout`, `dp_size`: recorded for the resume message and
    for tools reading train_state.json."""

    def __init__(self, cfg, run_dir: Path | None, states: Mapping[str, object], *, runtime, data: dict,
                 layout: str, dp_size: int, info: Callable[[str], None] = print,
                 record: Callable[[dict], None] = _quiet):
        self.cfg = cfg
        self.states = dict(states)
        self.rt, self.data, self.layout, self.dp_size = runtime, data, layout, dp_size
        self._info, self._record_row = info, record
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"
        self.async_ = cfg.checkpoint.async_
        self.fault = lambda point, step: None  # set_fault_hook: recovery.Recovery injects faults in tests
        self.history: list[dict] = []
        self.pending: _Pending | None = None
        self.last_saved_step: int | None = None
        self.loaded_from: Path | None = None
        # Verification verdicts (None = intact) of checkpoints this process wrote or checked:
        # retention hashes none of them again but those in `written`, once.
        self.verdicts: dict[str, str | None] = {}
        # Those published here, known intact only as hashed while written: read back before the
        # next save, so retention lets an older one go only once a newer one was (retention.py).
        self.written: set[str] = set()
        self._last_bytes = 0  # the size of the last checkpoint published: what the next one needs
        # Which line of history the checkpoints continue (retention.py): new unless resumed from
        # the newest checkpoint of this directory.
        self.timeline = retention.new_timeline()
        # Created once, by every rank, before any save: the async writer's collectives must never
        # share a group with the training loop's.
        # Its timeout covers the slowest rank's whole write (a hung peer is caught by the training
        # group's timeout and the watchdog, since training goes on meanwhile).
        self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(1800.0, cfg.train.timeout_s))) \
            if self.async_ and group_active() else None
        self._stager = None
        self._staging = None  # the in-flight save's copy into host memory (CUDA: it overlaps the next step)
        if self.async_:
            # Per device (staging.py): pinned, shared and overlapped on CUDA, blocking on CPU.
            # Kept for the whole run: it reuses its RAM copies, so later saves skip allocation.
            self._stager = staging.make_stager(self.rt.device)
        if self.is_main:
            retention.clear_leftovers(self.root, self._info)  # never published; left by a killed save
            retention.finish_abandoning(self.root, self._info)  # a timeline switch a crash interrupted
        barrier()

    @property
    def is_main(self) -> bool:
        return self.rt.is_main

    @property
    def step(self) -> int:
        return self.states[FLAT_STATE].state_dict()["step"]

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.interval_steps
        return every > 0 and step % every == 0 and step < self.cfg.train.steps

    # ---- state ----------------------------------------------------------------------------
    def _diloco(self):
        state = self.states.get("diloco")
        return state.diloco if state is not None else None

    def _state(self, saved: dict | None = None) -> dict:
        """The tensors DCP saves or loads into (saved: the train_state being loaded)."""
        tensors = {k: self.states[k].state_dict() for k in TENSOR_STATES if k in self.states}
        # diloco hook: global model, outer state, per-replica inner state
        return checkpoint_view(self._diloco(), tensors, saved)

    def train_state(self) -> dict:
        json_states = {k: v.state_dict() for k, v in self.states.items() if k not in (*TENSOR_STATES, FLAT_STATE)}
        diloco = json_states.pop("diloco", None)
        return {"format": FORMAT, "version": 2, "kind": "full", **self.states[FLAT_STATE].state_dict(),
                **json_states, "data": self.data, "config": to_dict(self.cfg), "layout": self.layout,
                "world_size": self.rt.world_size, "dp_size": self.dp_size, "timeline": dict(self.timeline),
                "saved_at": time.time(), **({"diloco": diloco} if diloco else {})}

    # ---- saving ------------------------------------------------------------------------------
    def save(self, final: bool = False) -> Path:
        step = self.step
        name = step_name(step)
        if self.last_saved_step == step:
            self.wait()
            return self.root / name
        self.wait()  # one save in flight: its RAM copy and the directory names are reused
        self._verify_for_retention()
        tmp = self.root / f".{name}.partial"
        if self.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                retention.clear_partial(tmp, self.root, self._info)
            except OSError as exc:
                raise self._write_failure(exc, name) from None
        barrier()
        meta = self.train_state()
        t0 = time.perf_counter()
        state = self._state()
        rank = self.rt.rank
        if self.async_ and not final:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg,
                                    async_stager=self._stager, no_dist=not group_active())
            self._staging, future = staging.split_response(future)
            pending = _Pending(step, name, future, t0, time.perf_counter() - t0)
            if self.is_main:
                pending.publisher = threading.Thread(target=self._publish_when_written, args=(pending, tmp, meta),
                                                     name="ndtrain-ckpt-publish", daemon=True)
                pending.publisher.start()
            else:
                future.add_done_callback(lambda f: self._report_written(f, pending, tmp, rank))
            self.pending = pending
            self.last_saved_step = step
            self.fault("save", step)
            return self.root / name
        error = None
        try:
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not group_active())
            write_own_digests(tmp, rank)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = exc
        if any_rank(error is not None, self.rt.device):
            barrier()
            self._discard(tmp)
            raise self._write_failure(error, name)
        barrier()
        if self.is_main:
            try:
                self._publish(tmp, name, meta)
            except Exception as exc:  # every rank must learn it, or they wait in the next collective
                error = exc
        if any_rank(error is not None, self.rt.device):
            self._discard(tmp)
            raise self._write_failure(error, name)
        total = time.perf_counter() - t0
        self._record(step, "sync", total, total)
        self.last_saved_step = step
        return self.root / name

    def _report_written(self, future, pending: _Pending, tmp: Path, rank: int) -> None:
        """A non-zero rank's part of an async save is on disk: hash it for rank 0's manifest."""
        if future.exception() is None:
            try:
                write_own_digests(tmp, rank)
            except OSError:
                pass  # rank 0 times out waiting for these digests and reports the save as failed
        pending.done_at.append(time.perf_counter())

    def _publish_when_written(self, pending: _Pending, tmp: Path, meta: dict) -> None:
        try:
            pending.future.result()
            self._publish(tmp, pending.name, meta)
            pending.done_at.append(time.perf_counter())
        except BaseException as exc:  # reported to every rank by wait(); never published
            pending.error.append(exc)

    def _publish(self, tmp: Path, name: str, meta: dict) -> None:
        grace = 5.0
        if not has_digests(tmp, 0):  # async (the sync path hashed before its barrier)
            t0 = time.perf_counter()
            write_own_digests(tmp, 0)
            # The other ranks hash shards of about this size: wait a few times that long for
            # their digests, then hash what is missing here (a rank that died after writing).
            grace += 3 * (time.perf_counter() - t0)
        (tmp / TRAIN_STATE).write_text(json.dumps(meta, indent=1))
        world = self.rt.world_size
        self._last_bytes = write_manifest_from(tmp, collect_digests(tmp, world, grace))
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
        self.verdicts[str(target)] = None  # hashed as it was written
        self.written.add(str(target))
        self._retain()

    def _retain(self) -> None:
        retention.retain(self.root, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every,
                           self._verdict, self._info, self._read_back)

    def _read_back(self, ckpt: Path) -> bool:
        return self.verdicts.get(str(ckpt), "unknown") is None and str(ckpt) not in self.written

    def _verify_for_retention(self) -> None:
        """Every rank: what the publish's retention will ask about and nobody has checked, hashed
        now, shared over the ranks; once one fails, retention looks further back, so again."""
        while todo := broadcast_object(retention.unverified(self.root, self.cfg.checkpoint.keep_last, self.verdicts,
                                                       self.written) if self.is_main else None):
            checked = verify_shared(todo)
            self.verdicts.update(checked)
            self.written.difference_update(checked)

    def _verdict(self, ckpt: Path) -> str | None:
        key = str(ckpt)
        if key not in self.verdicts:  # not reached: _verify_for_retention checked it before the save
            self.verdicts[key] = verify(ckpt)
        return self.verdicts[key]

    # ---- failed writes -----------------------------------------------------------------------
    def _discard(self, tmp: Path) -> None:
        """Rank 0 removes a partial save that failed (it was never published)."""
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    def _write_failure(self, error: BaseException | None, name: str) -> RunError:
        return write_failure(error, name, self.root,
                             lambda: self._last_bytes or state_bytes(self._state(), self.rt.world_size))

    def _record(self, step: int, mode: str, stall_s: float, total_s: float) -> None:
        row = {"step": step, "checkpoint_mode": mode, "checkpoint_stall_s": stall_s, "checkpoint_total_s": total_s}
        self.history.append(row)
        self._record_row(row)
        self._info(f"checkpoint {step_name(step)}: {mode}, training paused {stall_s:.3f} s, "
                   f"written and published in {total_s:.2f} s")

    def wait_for_staging(self) -> None:
        """Before anything writes the saved state (the trainer calls it before its optimizer step):
        the in-flight save's copy into host memory must be complete. A no-op unless staging is
        asynchronous (CUDA); the time it blocks counts as that save's stall."""
        staging, self._staging = self._staging, None
        if staging is None:
            return
        t0 = time.perf_counter()
        # exception() waits for the copy; an error in it surfaces in wait(), with the upload's
        if staging.exception() is None and self.pending is not None:
            self.pending.stall_s += time.perf_counter() - t0

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
        failed = any_rank(error is not None, self.rt.device)
        if failed:
            if self.last_saved_step == p.step:
                self.last_saved_step = None
            self._discard(self.root / f".{p.name}.partial")
            raise self._write_failure(error, p.name)
        self._record(p.step, "async", p.stall_s, (p.done_at[0] if p.done_at else time.perf_counter()) - p.started)

    def finish(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ---- resuming ----------------------------------------------------------------------------
    def resume(self, spec: str) -> Path | None:
        batch = max(1, self.cfg.checkpoint.keep_last)  # also pre-verifies what retention will count
        path, error = choose(spec, self.root, batch, self.is_main, self.verdicts, self._info)
        if error:
            raise NdtrainError(error, all_ranks=True)
        if path is None:
            self._info(f"no checkpoint under {self.root}: starting from scratch")
            return None
        state = read_train_state(path) if self.is_main else None
        state = broadcast_object(state)
        self.timeline = retention.continue_timeline(path, self.root, state, self.is_main, self._info)
        barrier()
        self.load(path, state)
        return path

    def check_compatible(self, path: Path, state: dict) -> None:
        problem = model_mismatch(self.cfg.model, state, self.cfg.checkpoint.allow_model_change)
        if problem:
            raise NdtrainError(f"checkpoint {path} {problem}", all_ranks=True)
        if state.get("kind", "full") != "full":
            return
        saved, here = state.get("data"), self.data
        if saved and saved != here:
            diff = [k for k in here if saved.get(k) != here[k]]
            raise NdtrainError(f"checkpoint {path} was trained on different data ({', '.join(diff)} differ from "
                               f"{self.cfg.data.path}); resuming would not continue the same sample stream",
                               all_ranks=True)

    def load(self, path: Path, state: dict | None = None) -> None:
        self.wait()
        state = state or read_train_state(path)
        self.check_compatible(path, state)
        model = self.states["model"]
        if state.get("kind", "full") != "full":  # imported weights: model only, fresh optimizer and data
            sd = {"model": model.state_dict()}
            dcp_load(sd, path)
            model.load_state_dict(sd["model"])
            self.loaded_from = path
            self._info(f"initialised weights from {path} ({state.get('kind')}); step 0")
            return
        sd = self._state(saved=state)
        dcp_load(sd, path)
        sd = checkpoint_restore(self._diloco(), sd, state)  # diloco hook
        for key in TENSOR_STATES:  # the model before its optimizer
            if key in self.states:
                self.states[key].load_state_dict(sd[key])
        self.states[FLAT_STATE].load_state_dict(state)
        for key, obj in self.states.items():
            if key not in (*TENSOR_STATES, FLAT_STATE) and key in state:
                obj.load_state_dict(state[key])
        self.last_saved_step = self.step
        self.loaded_from = path
        self._info(f"resumed from {path} at step {self.step} (saved as {state.get('layout')} on "
                   f"{state.get('world_size')} ranks; now {self.layout} on {self.rt.world_size})")

    # What recovery.Recovery asks of the checkpointer (it never writes its attributes).
    def set_fault_hook(self, fault) -> None:
        """`fault(point, step)` runs at each save's save/publish/rename points (fault injection)."""
        self.fault = fault


