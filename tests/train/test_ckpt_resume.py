"""Single-process resume semantics: bit-identical continuation (async saves, batch ramp,
accumulation, preemption signal), non-finite skip + rollback that drops the bad data window."""

from __future__ import annotations

import os
import signal

import pytest
from ckpt_helpers import assert_bit_identical, cfg_of, job, metrics, poison_steps, weights

from ndtrain.errors import NdtrainError
from ndtrain.train import step as step_mod
from ndtrain.train.checkpoint import list_checkpoints, step_name
from ndtrain.train.trainer import train

# 4 sequences of 64 tokens per step until 768 tokens (3 steps), then 8: the ramp crosses the
# interruption point; micro_batch 2 makes every step accumulate.
RAMP = dict(steps=6, global_batch=4, micro_batch=2, batch_ramp=[[768, 8]])


def _preempt_after(monkeypatch, step: int):
    """SIGTERM to ourselves right after optimizer step `step`: the run saves and stops there."""
    original = step_mod.train_step

    def train_step(state, batch, data_wait_s=0.0):
        result = original(state, batch, data_wait_s)
        if state.progress.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(step_mod, "train_step", train_step)


@pytest.mark.timeout(120)
def test_preempted_and_resumed_run_is_bit_identical(parity_base, tmp_path, monkeypatch):
    opt = {"schedule": "cosine", "warmup_steps": 2}
    ref = train(cfg_of(job(parity_base, tmp_path / "ref", train=RAMP, optimizer=opt)))

    run = tmp_path / "run"
    ckpt = {"interval_steps": 2, "async": True, "keep_last": 5}
    with monkeypatch.context() as m:
        _preempt_after(m, 3)
        first = train(cfg_of(job(parity_base, run, train=RAMP, optimizer=opt, checkpoint=ckpt)))
    assert first["preempted"] and first["steps"] == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == [step_name(2), step_name(3)]
    second = train(cfg_of(job(parity_base, run, train=RAMP, optimizer=opt,
                              checkpoint={**ckpt, "resume": "auto"})))
    assert second["steps"] == 6 and not second["preempted"]
    assert_bit_identical(weights(ref["checkpoint"]), weights(second["checkpoint"]))

    rows = [r for r in metrics(run) if "loss" in r]
    ref_rows = [r for r in metrics(tmp_path / "ref") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
    assert [r["tokens_seen"] for r in rows] == [256, 512, 768, 1280, 1792, 2304]  # ramp crossed at 768
    saves = [r for r in metrics(run) if "checkpoint_stall_s" in r]
    assert {r["checkpoint_mode"] for r in saves} == {"async", "sync"}


@pytest.mark.timeout(120)
def test_nonfinite_steps_roll_back_and_skip_the_window(parity_base, tmp_path, monkeypatch):
    # gb 4: step k consumes samples [4(k-1), 4k). Poison steps 5 and 6 -> with nonfinite_skip=2
    # the run rolls back to step 4 and never trains on samples 16..23 again.
    seen: list[set[int]] = []
    poison_steps(monkeypatch, {17, 22}, seen)
    run = tmp_path / "run"
    summary = train(cfg_of(job(parity_base, run, train={"steps": 8, "global_batch": 4, "nonfinite_skip": 2},
                               checkpoint={"interval_steps": 2})))
    assert summary["steps"] == 8
    events = [r for r in metrics(run) if "event" in r]
    # each attempt's first and last rows (for `ndtrain report`)
    assert events[0]["event"] == "start" and (events[-1]["event"], events[-1]["how"]) == ("end", "finished")
    events = events[1:-1]
    assert [e["event"] for e in events] == ["nonfinite", "nonfinite", "rollback", "skip_window"]
    assert events[2]["skip_window"] == [16, 24]
    trained = [ids for ids in seen if not ids & {17, 22}]
    flat = sorted(i for ids in trained for i in ids)
    # Replayed steps 5..8 after the rollback take samples 24..39; nothing is trained twice
    # except the replay of the rolled-back steps, and the bad window never again.
    assert flat == sorted(list(range(0, 16)) + list(range(24, 40)))
    assert all(not (ids & set(range(16, 24))) for ids in seen[len(seen) - 4:])
    final = [r for r in metrics(run) if "loss" in r][-1]
    assert final["step"] == 8 and final["loss"] == final["loss"]  # finite at the end


@pytest.mark.timeout(60)
def test_nonfinite_without_checkpoint_is_a_clear_error(parity_base, tmp_path, monkeypatch):
    poison_steps(monkeypatch, set(range(0, 1000)), [])
    with pytest.raises(NdtrainError, match="no checkpoint to roll back to"):
        train(cfg_of(job(parity_base, tmp_path / "run", train={"steps": 4, "nonfinite_skip": 2})))
