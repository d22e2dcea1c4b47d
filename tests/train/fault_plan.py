"""Fault injection for the chaos, preemption and self-healing tests and for drills: kill, hang or
slow a rank at a chosen step of a chosen restart attempt. Installed in each rank through the
job's hooks (src/ndtrain/train/hooks.py); tests/conftest.py points every test's runs at it:

    PYTHONPATH=tests/train NDTRAIN_JOB_HOOKS=fault_plan:hooks NDTRAIN_FAULTS=0:1:3:step ndtrain train ...
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from ndtrain.errors import NdtrainError

FAULTS_ENV = "NDTRAIN_FAULTS"
HOOKS = "fault_plan:hooks"  # the value of NDTRAIN_JOB_HOOKS that installs it


def _attempt() -> int:
    from ndtrain.train.distributed import restart_count

    return restart_count()


class FaultPlan:
    """NDTRAIN_FAULTS="attempt:rank:step:point[:delay],..." kills (SIGKILL), hangs or slows this
    rank on restart attempt `attempt` (rank `*`: any rank; one agent's environment picks a host).
    Points: `step` (`delay` seconds after step `step` starts: inside it, or in what follows if the
    step is shorter), `save` (right after the async save of step `step` starts writing), `publish`
    (rank 0, manifest written, marker not yet), `rename` (marker written, not yet renamed),
    `hang` (the step never ends: exercises the watchdog), `slow` (from step `step` on, each step
    burns `delay` s of CPU: a straggler to the busy-time comparison)."""

    POINTS = ("step", "save", "publish", "rename", "hang", "slow")

    def __init__(self, faults: list[tuple[int, str, float]], rank: int, log_path: Path | None = None):
        self.faults, self.rank, self.log_path = faults, rank, log_path
        self.timer: threading.Timer | None = None

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
            if int(parts[0]) == attempt and (parts[1] == "*" or int(parts[1]) == rank):
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

    def at_checkpoint(self, step: int, point: str) -> None:
        if any(at == step and p == point for at, p, _ in self.faults):
            self._kill(step, point)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def hooks(rank: int, log_path: Path | None = None) -> FaultPlan:
    """NDTRAIN_JOB_HOOKS=fault_plan:hooks: this rank's faults from NDTRAIN_FAULTS."""
    return FaultPlan.from_env(rank, log_path)
