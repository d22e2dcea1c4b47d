"""Fault injection for the chaos, preemption, self-healing and end-of-run tests and for drills:
kill, hang or slow a rank at a chosen step of a chosen restart attempt, or slow it at the end of
the run; and, with NDTRAIN_SAMPLE_LOG set, a record of the sample numbers every step trained on.
Installed in each rank through the job's hooks (src/ndtrain/train/hooks.py); tests/conftest.py
points every test's runs at it, so a test that starts `ndtrain train` as a subprocess only sets
the variables:

    PYTHONPATH=tests/train NDTRAIN_JOB_HOOKS=fault_plan:hooks NDTRAIN_FAULTS=0:1:3:step ndtrain train ...
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from ndtrain.errors import NdtrainError

FAULTS_ENV = "NDTRAIN_FAULTS"
HOOKS = "fault_plan:hooks"  # the value of NDTRAIN_JOB_HOOKS that installs it
# Set (to anything): each rank appends the global sample numbers of every step it keeps to
# samples.rank<N>.jsonl beside faults.log (the exactly-once check of the self-healing tests).
SAMPLE_LOG_ENV = "NDTRAIN_SAMPLE_LOG"


def _attempt() -> int:
    from ndtrain.launch_env import restart_count

    return restart_count()


def _fired(log_path: Path | None, rank: int, step: str, point: str) -> bool:
    """Whether an earlier attempt of this run already met this fault (its line in faults.log)."""
    if log_path is None or not log_path.exists():
        return False
    tail = f" rank={rank} step={step} point={point} "
    return any(tail in line for line in log_path.read_text().splitlines())


class FaultPlan:
    """NDTRAIN_FAULTS="attempt:rank:step:point[:delay],..." kills (SIGKILL), hangs or slows this
    rank on restart attempt `attempt` (rank `*`: any rank; one agent's environment picks a host;
    attempt `*`: the first attempt that gets there, once per run, as faults.log records: a test
    whose first attempt may fail for a reason outside ndtrain still sees its fault once).
    Points: `step` (`delay` seconds after step `step` starts: inside it, or in what follows if the
    step is shorter), `save` (right after the async save of step `step` starts writing), `publish`
    (rank 0, manifest written, marker not yet), `rename` (marker written, not yet renamed),
    `hang` (the step never ends: exercises the watchdog), `slow` (from step `step` on, each step
    burns `delay` s of CPU: a straggler to the busy-time comparison). Two points come after the
    last step, whatever `step` says: `end` (the rank sleeps `delay` s once its loop is over, after
    its last collective, before the process groups' teardown: what a slow tracker flush does
    there) and `sample` (the rank sleeps `delay` s before its closing sample, which runs after the
    teardown)."""

    POINTS = ("step", "save", "publish", "rename", "hang", "slow", "end", "sample")

    def __init__(self, faults: list[tuple[int, str, float]], rank: int, log_path: Path | None = None):
        self.faults, self.rank, self.log_path = faults, rank, log_path
        self.timer: threading.Timer | None = None
        self.sample_log = bool(os.environ.get(SAMPLE_LOG_ENV)) and log_path is not None
        for _, point, delay in faults:
            if point == "sample":
                self._slow_closing_sample(delay)

    @classmethod
    def from_env(cls, rank: int, log_path: Path | None = None) -> FaultPlan:
        text = os.environ.get(FAULTS_ENV, "").strip()
        attempt = _attempt()
        faults = []
        for item in filter(None, (s.strip() for s in text.split(","))):
            parts = item.split(":")
            if len(parts) < 4 or parts[3] not in cls.POINTS:
                raise NdtrainError(f"{FAULTS_ENV}: {item!r} is not attempt:rank:step:point[:delay] "
                                   f"(points: {', '.join(cls.POINTS)})")
            if parts[0] == "*" and _fired(log_path, rank, parts[2], parts[3]):
                continue
            if parts[0] in ("*", str(attempt)) and (parts[1] == "*" or int(parts[1]) == rank):
                faults.append((int(parts[2]), parts[3], float(parts[4]) if len(parts) > 4 else 0.0))
        return cls(faults, rank, log_path)

    def _note(self, what: str, step: int, point: str) -> None:
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(f"{time.time():.6f} {what} rank={self.rank} step={step} point={point} "
                        f"attempt={_attempt()}\n")

    def _kill(self, step: int, point: str) -> None:
        self._note("kill", step, point)
        os.kill(os.getpid(), signal.SIGKILL)

    def at_step(self, step: int) -> None:
        for at, point, delay in self.faults:
            if point == "slow" and step >= at:
                end = time.thread_time() + delay  # CPU time, not a sleep: busy time counts only work
                while time.thread_time() < end:
                    pass
            if at != step:
                continue
            if point == "step":
                self.timer = threading.Timer(delay, self._kill, args=(step, point))
                self.timer.daemon = True
                self.timer.start()
            elif point == "hang":
                self._note("hang", step, point)
                time.sleep(1e9)

    def after_step(self, result) -> None:
        ids = getattr(result, "sample_ids", None)
        if not self.sample_log or ids is None:
            return
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        with open(self.log_path.parent / f"samples.rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": result.step, "world": world, "attempt": _attempt(),
                                "ids": [int(i) for i in ids]}) + "\n")

    def at_checkpoint(self, step: int, point: str) -> None:
        if any(at == step and p == point for at, p, _ in self.faults):
            self._kill(step, point)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for _, point, delay in self.faults:
            if point == "end":
                self._note("end-delay", -1, point)
                time.sleep(delay)

    def _slow_closing_sample(self, delay: float) -> None:
        """The job offers no hook point after the teardown, so the closing sample itself is
        wrapped, in this process only (command.py looks it up in job.py when it calls it). The
        note in faults.log lets a test tell a delay that happened from one that silently did not."""
        from ndtrain.train import job

        real = job.closing_sample

        def slow(cfg, summary):
            job.closing_sample = real  # once: a run in this process after this one is not slowed
            if summary.get("sample_from"):
                self._note("sample-delay", -1, "sample")
                time.sleep(delay)
            real(cfg, summary)

        job.closing_sample = slow


def hooks(rank: int, log_path: Path | None = None) -> FaultPlan:
    """NDTRAIN_JOB_HOOKS=fault_plan:hooks: this rank's faults from NDTRAIN_FAULTS."""
    return FaultPlan.from_env(rank, log_path)
