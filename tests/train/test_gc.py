"""Garbage collection on a schedule (train/gc_schedule.py): the automatic collector is off in the
loop, every rank collects after the same steps, and the collector is put back as found."""

from __future__ import annotations

import gc

import pytest

from ndtrain.config import load_config
from ndtrain.errors import ConfigError
from ndtrain.train import gc_schedule as gcs


@pytest.fixture
def restore_gc():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_schedule_collects_on_the_nth_steps_with_the_collector_off(restore_gc):
    calls: list[bool] = []  # whether the automatic collector was on at each collection
    sched = gcs.GcSchedule(3, collect=lambda: calls.append(gc.isenabled()))
    gc.enable()
    sched.start()
    assert not gc.isenabled() and gc.get_freeze_count() > 0  # what the job built is out of the walk
    start_calls = len(calls)
    collected_at = []
    for step in range(1, 11):
        before = len(calls)
        sched.after_step(step)
        if len(calls) > before:
            collected_at.append(step)
    assert start_calls == 1 and collected_at == [3, 6, 9]
    assert calls[0] and not any(calls[1:])  # the first, at start, before the collector goes off
    sched.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    sched.stop()  # twice (an exception after stop) is harmless
    assert gc.isenabled()


def test_zero_leaves_the_collector_alone(restore_gc):
    calls = []
    gc.enable()
    sched = gcs.GcSchedule(0, collect=lambda: calls.append(1)).start()
    for step in range(1, 5):
        sched.after_step(step)
    sched.stop()
    assert calls == [] and gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()  # a caller that had it off gets it back off
    sched = gcs.GcSchedule(2, collect=lambda: calls.append(1)).start()
    sched.stop()
    assert not gc.isenabled()


def test_the_training_loop_collects_every_gc_every_steps(parity_base, tmp_path, monkeypatch, restore_gc):
    """The job's loop (train/job.py) with gc_every = 2 over 5 steps: one collection at the start,
    then after steps 2 and 4, each with the automatic collector off; on after the run."""
    from ckpt_helpers import cfg_of, job

    from ndtrain.train.trainer import train

    seen: list[tuple[bool, int]] = []
    real = gcs.GcSchedule.__init__

    def spying_init(self, every, collect=gc.collect):
        real(self, every, collect=lambda: seen.append((gc.isenabled(), every)))

    monkeypatch.setattr(gcs.GcSchedule, "__init__", spying_init)
    gc.enable()
    train(cfg_of(job(parity_base, tmp_path / "run", train={"steps": 5, "gc_every": 2})))
    assert seen == [(True, 2), (False, 2), (False, 2)]  # start (collector still on), steps 2 and 4
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_gc_every_must_not_be_negative():
    assert load_config(None, {}).train.gc_every == 50
    with pytest.raises(ConfigError, match=r"train\.gc_every"):
        load_config(None, {"train": {"gc_every": -1}})
