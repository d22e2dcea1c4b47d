"""Keeping a run alive: restart semantics, hang watchdog, non-finite rollback, straggler report,
and graceful preemption (its signal handling: signals.py).

Everything here is per-run state owned by a `Recovery` object that job.run creates; nothing is
global. It is handed, and only asks: the checkpointer (`wait`, `resume`), the loader
(`consumed_samples`, `skip_to`) and the run's TrainProgress (`step`, `window_at`,
`add_skip_window`). Decisions that every rank must take together (roll back, stop) derive from
values that are already all-reduced (loss, grad norm) or are agreed with one small all-reduce.
"""

from __future__ import annotations

import faulthandler
import math
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain.errors import NdtrainError
from ndtrain.train import resilience
from ndtrain.train.distributed import broadcast_object, gather_objects, host_group, restart_count, run_id
from ndtrain.train.heartbeat import Heartbeat
from ndtrain.train.balance import busy_at_mean_rows
from ndtrain.train.busy_time import busy_timer
from ndtrain.train.metrics import peak_memory_mb
from ndtrain.train.signals import Preemption

EXIT_HANG = 70  # a watchdog abort: nonzero, so torchrun restarts the group
MAX_ROLLBACKS = 5  # more than this and the problem is the run, not a few batches


def resume_specs(cfg) -> list[str]:
    """What to try, in order. A torchrun restart always continues from the newest checkpoint of
    this run, falling back to the configured path (e.g. the checkpoint a fine-tune started from)."""
    spec = cfg.checkpoint.resume
    if restart_count() > 0 and spec != "auto":
        return ["auto"] + ([spec] if spec else [])
    return [spec] if spec else []


# ---- hangs ---------------------------------------------------------------------------------
class Watchdog:
    """Aborts this process when a step runs past its deadline, so a hang (a lost peer inside a
    collective that never times out, a stuck device) becomes a crash that torchrun restarts."""

    def __init__(self, deadline_s: float, rank: int, on_expire=None, diagnose=None):
        self.deadline_s = deadline_s
        self.rank = rank
        self.on_expire = on_expire or (lambda: os._exit(EXIT_HANG))
        self.diagnose = diagnose  # () -> a clause naming the rank this one waits on (heartbeat.Heartbeat.silent)
        self._armed: tuple[int, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ndtrain-watchdog", daemon=True)
        self._thread.start()

    def arm(self, step: int) -> None:
        self._armed = (step, time.monotonic())

    def disarm(self) -> None:
        self._armed = None

    def _run(self) -> None:
        poll = min(1.0, max(0.01, self.deadline_s / 10))
        while not self._stop.wait(poll):
            armed = self._armed
            if armed is not None and time.monotonic() - armed[1] > self.deadline_s:
                why = f", {self.diagnose()}" if self.diagnose is not None else ""
                print(f"ndtrain watchdog: rank {self.rank} step {armed[0]} exceeded train.step_deadline_s="
                      f"{self.deadline_s:g} s{why}; aborting so the launcher restarts from the last checkpoint. "
                      f"Stacks:", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                self._armed = None
                self.on_expire()

    def close(self) -> None:
        self._stop.set()


# ---- non-finite steps ----------------------------------------------------------------------
class NonFiniteGuard:
    """Counts consecutive non-finite steps (the trainer already skips their update). At `limit`
    it asks for a rollback and names the data window those steps consumed, so the replay from
    the checkpoint skips exactly that window."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self.bad = 0
        self.window_start: int | None = None

    def observe(self, skipped: bool, consumed_before: int, consumed_after: int) -> tuple[str, list[int] | None]:
        if not skipped:
            self.bad, self.window_start = 0, None
            return "ok", None
        if self.bad == 0:
            self.window_start = consumed_before
        self.bad += 1
        if self.bad >= self.limit:
            window = [self.window_start, consumed_after]
            self.bad, self.window_start = 0, None
            return "rollback", window
        return "skip", None


# ---- stragglers ----------------------------------------------------------------------------
class StragglerMonitor:
    """Per-rank busy time per step, compared every `window` steps. Busy time is each rank's own
    compute, never wall time (the step's collectives make wall time the same on every rank): the
    training thread's CPU time on CPU, the GPU time of its blocks from CUDA events on CUDA
    (train/busy_time.py). A rank over the median by more than `threshold` in `persist`
    consecutive windows is named."""

    def __init__(self, threshold: float, window: int, persist: int = 3):
        self.threshold, self.window, self.persist = threshold, max(1, window), persist
        self.samples: list[float] = []
        self.strikes: dict[int, int] = {}

    @classmethod
    def from_config(cls, cfg) -> StragglerMonitor:
        """K, the windows running that name a rank, is resilience.straggler_windows."""
        return cls(cfg.train.straggler_threshold, cfg.train.straggler_window, cfg.resilience.straggler_windows)

    def add(self, busy_s) -> bool:
        """`busy_s`: seconds, or a callable that reads them (a CUDA timer's events, read at the
        window's end: one sync a window, not one a step)."""
        self.samples.append(busy_s)
        return len(self.samples) >= self.window

    def take_mean(self) -> float:
        mean = sum(s() if callable(s) else s for s in self.samples) / len(self.samples)
        self.samples.clear()
        return mean

    def judge(self, per_rank: list[float]) -> list[tuple[int, float]]:
        """(rank, ratio to median) of ranks that are persistently slow as of this window."""
        median = statistics.median(per_rank)
        named = []
        for rank, value in enumerate(per_rank):
            ratio = value / median if median > 0 else 1.0
            if self.threshold > 0 and ratio > 1 + self.threshold:
                self.strikes[rank] = self.strikes.get(rank, 0) + 1
                if self.strikes[rank] >= self.persist:
                    named.append((rank, ratio))
            else:
                self.strikes.pop(rank, None)
        return named


# ---- the per-run coordinator ---------------------------------------------------------------
class Recovery:
    """The guard around each step (before_step / after_step), handed what it acts on: the
    runtime (rank, world, device), the run's TrainProgress (step, skip windows), the loader
    (consumed samples, skip_to), the checkpointer (wait, resume), the logger, the modules whose
    busy time it measures and the layout's description."""

    def __init__(self, cfg, run_dir: Path | None, *, rt, progress, loader, ckpt, logger, compute: list,
                 layout: str):
        self.cfg, self.run_dir = cfg, run_dir
        self.rt, self.progress, self.loader, self.ckpt, self.logger = rt, progress, loader, ckpt, logger
        self.layout = layout
        tc = cfg.train
        if run_dir is not None and cfg.resilience.on_failure == "exclude":
            resilience.mark_alive(run_dir, rt.rank)  # before Exclusion.start's gather: its successor's ledger
        self.heartbeat = None
        if tc.step_deadline_s > 0 and rt.world_size > 1:  # every rank alike: the attempt id is a collective
            self.heartbeat = Heartbeat.from_env(rt.rank, rt.world_size, resilience.host_id(),
                                                broadcast_object(uuid.uuid4().hex),
                                                min(1.0, max(0.05, tc.step_deadline_s / 10)))
        self.watchdog = (Watchdog(tc.step_deadline_s, rt.rank, self._hung, self.heartbeat and self.heartbeat.silent)
                         if tc.step_deadline_s > 0 else None)
        self.guard = NonFiniteGuard(tc.nonfinite_skip)
        self._unjudged: list = []  # (result, samples consumed before, after) of steps not yet read
        self.stragglers = StragglerMonitor.from_config(cfg)
        self._host_names: list[str] | None = None
        self.leave: resilience.Leave | None = None  # set when a host is taken out (resilience.py)
        self.exclusion = resilience.Exclusion.start(cfg, self.stragglers.persist)
        if self.exclusion is not None:  # a host excluded before, or failing too often, leaves before any step
            self.leave = self.exclusion.at_start(run_dir, progress.step, rt.rank, rt.world_size, self._event)
        self.preemption = Preemption()
        self.host_group = host_group(rt.device, tc.timeout_s)  # where the stop flag is agreed each step
        self.rollbacks = 0
        self._consumed_before = 0
        self.busy = busy_timer(rt.device, compute)

    def _event(self, row: dict, text: str) -> None:
        self.logger.log({"step": self.progress.step, **row})
        self.logger.info(text)

    def before_step(self) -> None:
        consumed = self.loader.consumed_samples
        while (window := self.progress.window_at(consumed)) is not None:
            start, end = window
            self.loader.skip_to(end)
            consumed = end
            self._event({"event": "skip_window", "window": [start, end]},
                        f"step {self.progress.step + 1}: skipping samples [{start}, {end}) that gave non-finite steps")
        self._consumed_before = consumed
        if self.watchdog:
            self.watchdog.arm(self.progress.step + 1)
        if self.heartbeat:
            self.heartbeat.step = self.progress.step + 1
        self.busy.start()

    def after_step(self, result, read: bool = True) -> str:
        """'ok', 'rollback' (the trainer was rolled back: continue the loop) or 'stop' (preempted).
        The non-finite guard needs each step's skip flag, a device value: it judges the steps
        since the last `read` (the job's logging steps and checkpoints; step.read_steps), in order,
        and before a leave or stop ends the loop."""
        busy = busy_at_mean_rows(self.busy.stop(lazy=True), self.loader, result)  # uneven shares: per mean share
        if self.watchdog:
            self.watchdog.disarm()
        self._unjudged.append((result, self._consumed_before, self.loader.consumed_samples))
        if read and self._judge():
            return "rollback"
        if self.stragglers.add(busy):
            self._report_stragglers(result.step)
        elif result.step == self.cfg.train.steps:  # a run shorter than its straggler window still
            self._report_memory(result.step)  # shows every rank's peak memory
        action = "leave" if self.leave is not None else "stop" if self.preemption.agreed(self.host_group) else "ok"
        return "rollback" if action != "ok" and self._judge() else action

    def _judge(self) -> bool:
        """The non-finite guard over the steps not judged yet; True when it rolled back."""
        judged, self._unjudged = self._unjudged, []
        for result, before, after in judged:
            action, window = self.guard.observe(result.skipped, before, after)
            if action != "ok":
                self._event({"event": "nonfinite", "step": result.step, "bad_loss": _num(result.loss),
                             "bad_grad_norm": _num(result.grad_norm)},
                            f"step {result.step}: non-finite loss {result.loss} or grad norm {result.grad_norm}; "
                            f"update skipped ({self.guard.bad if action == 'skip' else self.guard.limit} in a row)")
            if action == "rollback":  # the steps after it are undone with it
                self.rollback(window)
                return True
        return False

    def rollback(self, window: list[int]) -> None:
        self.rollbacks += 1
        if self.rollbacks > MAX_ROLLBACKS:
            raise NdtrainError(f"{self.rollbacks} rollbacks for non-finite steps in one run: training diverges "
                               f"beyond a few bad batches; lower optimizer.lr or check the data")
        self.ckpt.wait()  # a save still in flight may be the checkpoint to return to
        path = self.ckpt.resume("auto")
        if path is None:
            raise NdtrainError(f"{self.guard.limit} consecutive non-finite steps and no checkpoint to roll back to; "
                               f"set checkpoint.interval_steps")
        self.progress.add_skip_window(window)  # after the resume, which restored the checkpoint's windows
        self._event({"event": "rollback", "to": str(path), "skip_window": window},
                    f"rolled back to {path.name} (step {self.progress.step}); samples [{window[0]}, {window[1]}) "
                    f"will be skipped")

    def _report_stragglers(self, step: int) -> None:
        rank, world = self.rt.rank, self.rt.world_size
        mean = self.stragglers.take_mean()
        if world == 1:
            return
        # Each rank's peak memory rides along in the same all-reduce (for the report's per-rank plot).
        vec = torch.zeros(2, world, dtype=torch.float64, device=self.rt.device)
        vec[0, rank] = mean
        vec[1, rank] = peak_memory_mb(self.rt.device)
        dist.all_reduce(vec)
        per_rank, memory = vec.cpu().tolist()
        self.logger.log({"step": step, "rank_busy_s": per_rank, "rank_peak_memory_mb": memory})
        named = self.stragglers.judge(per_rank)
        hosts = self._hosts() if named else []
        for r, ratio in named:
            self._event({"event": "straggler", "rank": r, "host": hosts[r], "ratio": ratio},
                        f"straggler: rank {r} on host {hosts[r]} is {ratio:.2f}x the median busy time per step "
                        f"({per_rank[r]:.3f} s vs {statistics.median(per_rank):.3f} s) for "
                        f"{self.stragglers.strikes[r]} windows of {self.stragglers.window} steps")
        if named and self.exclusion is not None and self.leave is None:
            self.leave = self.exclusion.decide(step, named, rank, world, self.layout, self._event)

    def _hosts(self) -> list[str]:
        """Every rank's host, gathered the first time a straggler is named (every rank names the
        same ones from the same all-reduced numbers, so every rank joins the gather)."""
        if self._host_names is None:
            self._host_names = (self.exclusion.hosts if self.exclusion is not None
                                else gather_objects(resilience.host_id()))
        return self._host_names

    def _report_memory(self, step: int) -> None:
        """Every rank's peak memory, as the straggler windows' rows carry it (every rank reaches the
        run's last step, so every rank joins this all-reduce)."""
        if self.rt.world_size == 1:
            return
        vec = torch.zeros(self.rt.world_size, dtype=torch.float64, device=self.rt.device)
        vec[self.rt.rank] = peak_memory_mb(self.rt.device)
        dist.all_reduce(vec)
        self.logger.log({"step": step, "rank_peak_memory_mb": vec.cpu().tolist()})

    def _hung(self) -> None:
        if self.run_dir is not None and self.cfg.resilience.on_failure == "exclude":
            resilience.strike(self.run_dir, self.rt.rank, f"rank {self.rt.rank} hung (watchdog)")
            resilience.mark_ended(self.run_dir)
        os._exit(EXIT_HANG)

    def close(self) -> None:
        if self.run_dir is not None and self.cfg.resilience.on_failure == "exclude":
            resilience.mark_ended(self.run_dir)
        if self.watchdog:
            self.watchdog.close()
        if self.heartbeat:
            self.heartbeat.close()
        self.preemption.close()
        self.busy.close()


def _num(x: float):
    return x if math.isfinite(x) else str(x)
