"""batch_ramp = "auto": the gradient noise scale estimator (McCandlish et al. 2018, app. A), its
rows, the batch it grows at checkpoint boundaries, and resume in the middle of a change."""

from __future__ import annotations

import os
import signal

import pytest
from ckpt_helpers import assert_bit_identical, cfg_of, job, metrics, weights

from ndtrain.config import layout_batches, load_config
from ndtrain.train.optim import global_batch_at
from ndtrain.errors import ConfigError
from ndtrain.train import step as step_mod
from ndtrain.train.checkpoint.state import TrainProgress
from ndtrain.train.noise_scale import NoiseScale, grow
from ndtrain.train.trainer import train


def test_estimator_recovers_the_noise_scale_from_expected_norms():
    # E|G_B|^2 = |G|^2 + tr(Sigma)/B: fed those, the estimate is exactly tr(Sigma)/|G|^2
    g2, s = 0.5, 40.0
    est = NoiseScale()
    for b_small, b_big in [(2, 16), (4, 16), (8, 64)]:
        assert est.update(g2 + s / b_small, b_small, g2 + s / b_big, b_big) == pytest.approx(s / g2, rel=1e-12)
    assert est.update(1.0, 8, 1.0, 8) is None  # one batch size: nothing to measure
    assert NoiseScale(est.state).state == est.state  # what the checkpoint keeps restores it


def test_ema_is_of_numerator_and_denominator_separately():
    est = NoiseScale()
    est.update(1 + 10 / 1, 1, 1 + 10 / 4, 4)  # |G|^2 = 1, S = 10
    got = est.update(3 + 90 / 1, 1, 3 + 90 / 4, 4)  # |G|^2 = 3, S = 90
    d = 0.95
    assert got == pytest.approx((d * 10 + (1 - d) * 90) / (d * 1 + (1 - d) * 3), rel=1e-12)


def _auto(**extra):
    return load_config(None, {"train": {"global_batch": 4, "micro_batch": 1, "batch_ramp": "auto",
                                        "batch_auto_max": 16, **extra}})


def test_grow_doubles_within_the_limit_and_records_a_point():
    cfg, p = _auto(), TrainProgress(step=10, tokens_seen=2560)
    assert grow(cfg, p, 7.9, 4) is None and p.batch_points == []  # not yet worth 8
    assert "4 -> 8" in grow(cfg, p, 100.0, 4) and p.batch_points == [[2560, 8]]
    assert global_batch_at(cfg, 2559, p.batch_points) == 4 and global_batch_at(cfg, 2560, p.batch_points) == 8
    p.tokens_seen = 5000
    assert "8 -> 16" in grow(cfg, p, 1e9, 8)
    assert grow(cfg, p, 1e9, 16) is None  # batch_auto_max
    assert layout_batches(cfg.train) == [4, 8, 16]


@pytest.mark.parametrize("value", [0, 12, 2])
def test_auto_max_must_be_the_batch_times_a_power_of_two(value):
    with pytest.raises(ConfigError, match="train.batch_auto_max"):
        _auto(batch_auto_max=value)


AUTO = dict(steps=8, global_batch=4, micro_batch=1, batch_ramp="auto", batch_auto_max=16)
CKPT = {"interval_steps": 2, "keep_last": 10}


@pytest.mark.timeout(300)
def test_auto_grows_and_resumes_mid_change_bit_identically(parity_base, tmp_path, monkeypatch):
    # The debug model's noise scale at its first steps is ~2 sequences (below any growth): scaled
    # up here so the run makes decisions; the measured norms, the rule and the resume are real.
    measured = NoiseScale.update
    monkeypatch.setattr(NoiseScale, "update", lambda self, *a: (lambda v: None if v is None else 8 * v)(measured(self, *a)))
    ref = train(cfg_of(job(parity_base, tmp_path / "ref", train=AUTO, checkpoint=CKPT)))
    rows = [r for r in metrics(tmp_path / "ref") if "loss" in r]
    assert all("grad_noise_scale" in r for r in rows)
    batches = [r["global_batch"] for r in rows]
    assert batches[:2] == [4, 4] and batches[-1] > 4, batches  
    first_change = next(i for i, b in enumerate(batches) if b != 4)  # a step right after a boundary
    assert first_change % CKPT["interval_steps"] == 0

    # stop right at the boundary that changed the batch: its checkpoint holds the decision
    original = step_mod.train_step

    def stop_at(state, batch, data_wait_s=0.0):
        result = original(state, batch, data_wait_s)
        if state.progress.step == first_change:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(step_mod, "train_step", stop_at)
        assert train(cfg_of(job(parity_base, run, train=AUTO, checkpoint=CKPT)))["preempted"]
    train(cfg_of(job(parity_base, run, train=AUTO, checkpoint={**CKPT, "resume": "auto"})))
    assert_bit_identical(weights(ref["checkpoint"]), weights(run / "checkpoints" / os.path.basename(ref["checkpoint"])))
    again = [r for r in metrics(run) if "loss" in r]
    assert [(r["step"], r["global_batch"], r["loss"]) for r in again] == [(r["step"], r["global_batch"], r["loss"]) for r in rows]


def _rank_train(cfg):
    return train(cfg)["steps"]


@pytest.mark.timeout(300)
def test_auto_at_dp2_measures_decides_and_resumes_on_one_process(parity_base, tmp_path, hang_deadline):
    """Gloo, world 2 (ZeRO-3: the first micro-batch's gradient is reduced over both ranks, so
    B_small = 2 x 1): each step logs a finite estimate, the steps before any decision train as the
    one-process run does, and a resume on one process continues the batches the checkpoint holds."""
    from ndtrain.parallel.launch import run_ranks

    one = dict(AUTO, steps=4)
    train(cfg_of(job(parity_base, tmp_path / "one", train=one, checkpoint=CKPT)))
    two = cfg_of(job(parity_base, tmp_path / "two", train=one, checkpoint=CKPT, parallel={"dp_shard": 2}))
    assert run_ranks(2, _rank_train, two, timeout_s=hang_deadline(250)) == [4, 4]
    a = [r for r in metrics(tmp_path / "one") if "loss" in r]
    b = [r for r in metrics(tmp_path / "two") if "loss" in r]
    assert [r["loss"] for r in b[:2]] == pytest.approx([r["loss"] for r in a[:2]], abs=1e-5)
    assert all(isinstance(r.get("grad_noise_scale"), float) for r in b[1:]), b
    batches = [r["global_batch"] for r in b]
    assert batches[:2] == [4, 4] and batches[2] == batches[3]  # changes only after a boundary

    train(cfg_of(job(parity_base, tmp_path / "two", train=dict(one, steps=6),
                     checkpoint={**CKPT, "resume": "auto"})))
    rows = [r for r in metrics(tmp_path / "two") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[4]["global_batch"] == batches[3]  # the recorded point, not a fresh decision
    seen = [r["tokens_seen"] for r in rows]
    assert [y - x for x, y in zip([0] + seen, seen)] == [r["global_batch"] * 64 for r in rows]


def test_layouts_without_a_first_micro_batch_gradient_are_named():
    from ndtrain.layout import Layout
    from ndtrain.train.noise_scale import unsupported

    assert unsupported(Layout(dp_shard=2, zero=3), False) is None
    assert unsupported(Layout(), False) is None
    assert "ZeRO-1" in unsupported(Layout(dp_replicate=2, zero=1), False)
    assert "pipeline" in unsupported(Layout(pp=2), False)
    assert "DiLoCo" in unsupported(Layout(), True)
