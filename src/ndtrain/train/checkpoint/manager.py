"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, layout-independent, atomic, async.

Saving writes DCP shards of model and optimizer state into `.step_XXXXXXXX.partial/`; each rank
hashes the shards as it writes them (digest.py: nothing is read back); rank 0 then adds
`train_state.json` (step, tokens seen, loader position, RNG, data fingerprint, resolved config,
timeline), the run's
`tokenizer.json` (BPE), `manifest.json` (sizes + SHA-256, combined from the ranks' digests) and
the COMPLETE marker, and renames the directory
to `step_XXXXXXXX/`. Nothing older is touched until that rename has happened; a save that fails
(a full disk) removes its partial directory, leaves the previous checkpoint published, and
says so in one line (failure.py). Retention: retention.py; which checkpoint a resume loads,
and timelines: resume.py.

Every collective around checkpoint files (a save's, sync or async, the checks before it, a
resume's verification and load) runs on the checkpointer's own Gloo group, created once, whose
timeout is sized for file I/O (CKPT_TIMEOUT_S): ranks finish writing or reading at different
times, and that skew must not meet the training group's timeout, sized for a step's compute.

With `checkpoint.async = true` the step only pays for copying the state into RAM; a background
thread writes it through that group (sharing the training group with a concurrent collective
breaks Gloo) and rank 0 publishes once the write completes. One save is in flight at a time.

What is saved is a mapping of named state objects, each with state_dict()/load_state_dict(),
mapped onto the files by state.py. Besides the states, the checkpointer is told
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
from ndtrain.train.checkpoint import staging
from ndtrain.train.checkpoint.digest import (HashingWriter, bytes_entry, collect_digests, has_digests,
                                             write_manifest_from, write_own_digests)
from ndtrain.train.checkpoint.failure import write_failure
from ndtrain.train.checkpoint.reader import dcp_load
from ndtrain.train.checkpoint.resume import (check_compatible, choose_checkpoint, continue_timeline, finish_abandoning,
                                             new_timeline)
from ndtrain.train.checkpoint.retention import Retention, clear_leftovers, clear_partial
from ndtrain.train.checkpoint.state import FLAT_STATE, checkpoint_bytes, json_states, load_states, tensor_state
from ndtrain.train.checkpoint.store import (CHECKPOINT_FORMAT, TOKENIZER, TRAIN_STATE, fsync_dir, read_train_state,
                                            step_name, tokenizer_to_carry, write_marker)
from ndtrain.train.distributed import any_rank, barrier, broadcast_object, group_active

__all__ = ["Checkpointer", "data_fingerprint"]

# The checkpointer's group's timeout: at least the slowest rank's whole write or read of its share
# (a 70B checkpoint is ~0.85 TB over a shared file system), or train.timeout_s if that is longer.
# A rank hung in training meanwhile is caught by the training group's timeout and the watchdog.
CKPT_TIMEOUT_S = 1800.0

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
    written: dict = field(default_factory=dict)  # file name -> size and SHA-256, as DCP wrote it here
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
        # Created once, by every rank, before any save: see the module docstring.
        self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(CKPT_TIMEOUT_S, cfg.train.timeout_s))) \
            if group_active() else None
        self.retention = Retention(self.root, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every, info, self.pg)
        self._last_bytes = 0  # the size of the last checkpoint published: what the next one needs
        # Rank 0 publishes, so it alone reads the tokenizer file every checkpoint carries (store.py).
        self.tokenizer = tokenizer_to_carry(cfg.data.path, cfg.data.mix, info) if runtime.is_main else None
        # Which line of history the checkpoints continue (resume.py): new unless resumed from the
        # newest checkpoint of this directory.
        self.timeline = new_timeline()
        self._stager = None
        self._staging = None  # the in-flight save's copy into host memory (CUDA: it overlaps the next step)
        if self.async_:
            # Per device (staging.py): pinned, shared and overlapped on CUDA, blocking on CPU.
            # Kept for the whole run: it reuses its RAM copies, so later saves skip allocation.
            self._stager = staging.make_stager(self.rt.device)
        if self.is_main:
            clear_leftovers(self.root, self._info)  # never published; left by a killed save
            finish_abandoning(self.root, self._info)  # a timeline switch a crash interrupted
        barrier(self.pg)

    def _any_rank(self, flag: bool) -> bool:
        return any_rank(flag, "cpu", group=self.pg)  # Gloo reduces on the CPU

    @property
    def is_main(self) -> bool:
        return self.rt.is_main

    @property
    def step(self) -> int:
        return self.states[FLAT_STATE].state_dict()["step"]

    @property
    def verdicts(self) -> dict[str, str | None]:
        """None (intact) or the reason, for each checkpoint this process wrote or checked."""
        return self.retention.verdicts

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.interval_steps
        return every > 0 and step % every == 0 and step < self.cfg.train.steps

    def train_state(self) -> dict:
        """train_state.json of a save now: the states it holds and the run's facts."""
        named = json_states(self.states)
        diloco = named.pop("diloco", None)
        return {"format": CHECKPOINT_FORMAT, "version": 2, "kind": "full", **self.states[FLAT_STATE].state_dict(),
                **named, "data": self.data, "config": to_dict(self.cfg), "layout": self.layout,
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
        self.retention.check_before_save(self.is_main)
        tmp = self.root / f".{name}.partial"
        if self.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                clear_partial(tmp, self.root, self._info)
            except OSError as exc:
                raise self._write_failure(exc, name) from None
        barrier(self.pg)
        meta = self.train_state()
        t0 = time.perf_counter()
        state = tensor_state(self.states)
        rank = self.rt.rank
        writer = HashingWriter(str(tmp))
        if self.async_ and not final:
            future = dcp.async_save(state, checkpoint_id=str(tmp), storage_writer=writer, process_group=self.pg,
                                    async_stager=self._stager, no_dist=not group_active())
            self._staging, future = staging.split_response(future)
            pending = _Pending(step, name, future, t0, time.perf_counter() - t0, written=writer.digests)
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
            dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer, process_group=self.pg,
                     no_dist=not group_active())
            write_own_digests(tmp, rank, writer.digests)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = exc
        if self._any_rank(error is not None):
            barrier(self.pg)
            self._discard(tmp)
            raise self._write_failure(error, name)
        barrier(self.pg)
        if self.is_main:
            try:
                self._publish(tmp, name, meta, writer.digests)
            except Exception as exc:  # every rank must learn it, or they wait in the next collective
                error = exc
        if self._any_rank(error is not None):
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
                write_own_digests(tmp, rank, pending.written)
            except OSError:
                pass  # rank 0 times out waiting for these digests and reports the save as failed
        pending.done_at.append(time.perf_counter())

    def _publish_when_written(self, pending: _Pending, tmp: Path, meta: dict) -> None:
        try:
            pending.future.result()
            self._publish(tmp, pending.name, meta, pending.written)
            pending.done_at.append(time.perf_counter())
        except BaseException as exc:  # reported to every rank by wait(); never published
            pending.error.append(exc)

    def _publish(self, tmp: Path, name: str, meta: dict, written: dict) -> None:
        """Rank 0. `written`: what DCP wrote here (rank 0's shards, `.metadata`), hashed as written."""
        if not has_digests(tmp, 0):  # async (the sync path wrote them before its barrier)
            write_own_digests(tmp, 0, written)
        known = dict(written)
        state_json = json.dumps(meta, indent=1).encode()
        (tmp / TRAIN_STATE).write_bytes(state_json)
        known[TRAIN_STATE] = bytes_entry(state_json)
        if self.tokenizer is not None:  # hashed into the manifest with train_state.json, below
            (tmp / TOKENIZER).write_bytes(self.tokenizer)
            known[TOKENIZER] = bytes_entry(self.tokenizer)
        # The other ranks' digests come from memory too; a rank whose digests are missing after
        # this grace (it died after writing) has its shards hashed here.
        grace = 5.0
        self._last_bytes = write_manifest_from(tmp, collect_digests(tmp, self.rt.world_size, grace, known))
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
        self.retention.published(target)
        self.retention.apply()

    # ---- failed writes -----------------------------------------------------------------------
    def _discard(self, tmp: Path) -> None:
        """Rank 0 removes a partial save that failed (it was never published)."""
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    def _write_failure(self, error: BaseException | None, name: str) -> RunError:
        return write_failure(error, name, self.root, lambda: self._last_bytes
                             or checkpoint_bytes(tensor_state(self.states), self.rt.world_size))

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
        failed = self._any_rank(error is not None)  # the ranks' writes end apart: the I/O group's timeout
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
        path, error = choose_checkpoint(spec, self.root, batch, self.is_main, self.verdicts, self._info, self.pg)
        if error:
            raise NdtrainError(error, all_ranks=True)
        if path is None:
            self._info(f"no checkpoint under {self.root}: starting from scratch")
            return None
        state = read_train_state(path) if self.is_main else None
        state = broadcast_object(state, group=self.pg)
        self.timeline = continue_timeline(path, self.root, state, self.is_main, self._info)
        barrier(self.pg)
        self.load(path, state)
        return path

    def load(self, path: Path, state: dict | None = None) -> None:
        self.wait()
        state = state or read_train_state(path)
        check_compatible(path, state, self.cfg, self.data)
        model = self.states["model"]
        if state.get("kind", "full") != "full":  # imported weights: model only, fresh optimizer and data
            sd = {"model": model.state_dict()}
            dcp_load(sd, path, process_group=self.pg)
            model.load_state_dict(sd["model"])
            self.loaded_from = path
            self._info(f"initialised weights from {path} ({state.get('kind')}); step 0")
            return
        sd = tensor_state(self.states, saved=state)
        dcp_load(sd, path, process_group=self.pg)
        load_states(self.states, sd, state)
        self.last_saved_step = self.step
        self.loaded_from = path
        self._info(f"resumed from {path} at step {self.step} (saved as {state.get('layout')} on "
                   f"{state.get('world_size')} ranks; now {self.layout} on {self.rt.world_size})")

    # What recovery.Recovery asks of the checkpointer (it never writes its attributes).
    def set_fault_hook(self, fault) -> None:
        """`fault(point, step)` runs at each save's save/publish/rename points (fault injection)."""
        self.fault = fault
