"""The job loop reads the steps' values once per logging interval (train/step.py: read_steps): what
needs every step's value judges the steps late, in order, with the same outcome."""

from __future__ import annotations

import pytest
from ckpt_helpers import cfg_of, job, metrics, poison_steps

from ndtrain.train import step as step_mod
from ndtrain.train.trainer import train


@pytest.mark.timeout(120)
def test_nonfinite_steps_judged_at_the_logging_read_roll_back_the_same_window(parity_base, tmp_path, monkeypatch):
    # gb 4: step k takes samples [4(k-1), 4k). Steps 5 and 6 are poisoned; with log_interval and
    # checkpoints every 4 steps nothing reads them before step 8, where the guard judges 5-8 in
    # order: 5 skipped, 6 the second in a row -> back to step 4's checkpoint, [16, 24) skipped.
    seen: list[set[int]] = []
    poison_steps(monkeypatch, {17, 22}, seen)
    run = tmp_path / "run"
    reads = []
    real = step_mod.read_steps

    def counted(queue):
        if queue:
            reads.append([r.step for r in queue])
        return real(queue)

    monkeypatch.setattr(step_mod, "read_steps", counted)
    summary = train(cfg_of(job(parity_base, run, train={"steps": 8, "global_batch": 4, "nonfinite_skip": 2,
                                                       "log_interval": 4},
                               checkpoint={"interval_steps": 4})))
    assert summary["steps"] == 8
    events = [r for r in metrics(run) if "event" in r][1:-1]  # less each attempt's start and end rows
    assert [e["event"] for e in events] == ["nonfinite", "nonfinite", "rollback", "skip_window"]
    assert [e["step"] for e in events[:2]] == [5, 6]  # the bad steps' own numbers, judged at step 8
    assert events[2]["skip_window"] == [16, 24]
    # Read once per interval: steps 1-4, 5-8 (rolled back from 6), the replayed 5-8.
    assert reads == [[1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 8]]
    replayed = seen[-4:]
    assert sorted(i for ids in replayed for i in ids) == list(range(24, 40))
    rows = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [4, 8] and rows[-1]["loss"] == rows[-1]["loss"]


class _Event:
    """A CUDA event stand-in on a host clock: record() stamps it, synchronize() is counted."""

    now = 0.0
    syncs = 0

    def record(self):
        self.at = _Event.now

    def synchronize(self):
        _Event.syncs += 1

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1e3  # ms, as CUDA's


def test_cuda_busy_times_are_read_once_a_straggler_window():
    """The straggler monitor's CUDA clock reads its events (a sync) when the window's mean is
    taken, not at every step's end."""
    import torch.nn as nn

    from ndtrain.train.busy_time import CudaBusyTimer
    from ndtrain.train.recovery import StragglerMonitor

    class Block(nn.Module):
        seconds = 0.0  # what its forward takes on the stand-in clock

        def forward(self, x):
            _Event.now += self.seconds
            return x

    block = Block()
    timer, monitor = CudaBusyTimer([block], event=_Event), StragglerMonitor(0.2, window=3)
    _Event.syncs, full = 0, []
    for busy in (0.5, 0.25, 0.75):
        timer.start()
        _Event.now += 1.0  # outside the block (a collective's wait): not busy
        block.seconds = busy
        block(None)
        full.append(monitor.add(timer.stop(lazy=True)))
    assert _Event.syncs == 0 and full == [False, False, True]
    assert monitor.take_mean() == 0.5 and _Event.syncs == 3  # (0.5 + 0.25 + 0.75) / 3
