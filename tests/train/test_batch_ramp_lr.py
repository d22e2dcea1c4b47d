"""The learning rate follows train.batch_ramp by optimizer.batch_lr_rule, each step's row records
its global batch, and the report draws the ramp."""

from __future__ import annotations

import pytest
from ckpt_helpers import cfg_of, job, metrics

from ndtrain.tools.report_plots import batch_size
from ndtrain.tools.run_data import read_run
from ndtrain.train.optim import batch_lr_scale
from ndtrain.train.trainer import train

# 4 sequences of 64 tokens per step until 768 tokens (3 steps), then 16.
RAMP = dict(steps=5, global_batch=4, micro_batch=2, batch_ramp=[[768, 16]])


def test_scale_by_rule():
    assert batch_lr_scale("sqrt", 16, 4) == pytest.approx(2.0)
    assert batch_lr_scale("linear", 16, 4) == pytest.approx(4.0)
    assert batch_lr_scale("none", 16, 4) == 1.0
    assert batch_lr_scale("sqrt", 2, 8) == pytest.approx(0.5)  # a ramp may start below the base batch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rule,factor", [("sqrt", 2.0), ("none", 1.0)])
def test_ramp_scales_the_rate_and_rows_say_the_batch(parity_base, tmp_path, rule, factor):
    opt = {"schedule": "constant", "warmup_steps": 0, "lr": 1e-3, "batch_lr_rule": rule}
    train(cfg_of(job(parity_base, tmp_path / "run", train=RAMP, optimizer=opt)))
    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert [r["global_batch"] for r in rows] == [4, 4, 4, 16, 16]
    assert [r["lr"] for r in rows] == pytest.approx([1e-3] * 3 + [1e-3 * factor] * 2, rel=1e-12)
    drawn = batch_size([read_run(tmp_path / "run")], tmp_path / "batch.png")
    assert drawn is not None and drawn.stat().st_size > 0


def test_report_draws_no_ramp_for_a_fixed_batch(parity_base, tmp_path):
    train(cfg_of(job(parity_base, tmp_path / "run", train=dict(steps=2, global_batch=4, micro_batch=4))))
    assert batch_size([read_run(tmp_path / "run")], tmp_path / "batch.png") is None
    assert [r["global_batch"] for r in metrics(tmp_path / "run") if "loss" in r] == [4, 4]
