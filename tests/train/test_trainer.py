"""Single-process trainer: exact accumulation, learning, LR schedule, sampling, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ndtrain.config import OptimizerConfig, load_config
from ndtrain.train.optim import global_batch_at
from ndtrain.tools.verify import run_steps
from ndtrain.train.optim import lr_at
from ndtrain.train.step import split_micro
from ndtrain.train.trainer import train


def _cfg(parity_base, **train):
    base = {k: dict(v) for k, v in parity_base.items()}
    base["train"].update(train)
    return load_config(None, base)


def test_grad_accumulation_is_token_exact(parity_base):
    """4 micro-batches of 1 sequence == 1 micro-batch of 4 (and 3 uneven: 2+2... via 3)."""
    one = run_steps(_cfg(parity_base, global_batch=4, micro_batch=4), steps=3)
    four = run_steps(_cfg(parity_base, global_batch=4, micro_batch=1), steps=3)
    uneven = run_steps(_cfg(parity_base, global_batch=4, micro_batch=3), steps=3)  # 3 + 1
    for other in (four, uneven):
        # fp32, accumulated micro-batches vs one batch: reduction order only (conftest's parity_base docstring).
        assert torch.allclose(one["losses"], other["losses"], rtol=0, atol=1e-5)
        for name, w in one["weights"].items():
            assert (w - other["weights"][name]).abs().max() <= 1e-5, name
    assert one["losses"][0] > one["losses"][-1]


def test_build_and_train_step_are_what_the_trainer_runs(parity_base):
    """The pieces the job uses (build.py, step.py), driven by hand, take the Trainer's steps: the
    same losses, the state's progress advanced, the step's samples reported."""
    from ndtrain.train import step
    from ndtrain.train.build import build
    from ndtrain.train.plan import as_written
    from ndtrain.train.trainer import Trainer

    cfg = _cfg(parity_base, global_batch=4, micro_batch=2)
    plan = as_written(cfg, 1)
    state = build(plan.config, plan.layout)
    try:
        results = [step.train_step(state, *step.next_batch(state)) for _ in range(2)]
    finally:
        step.close(state)
    trainer = Trainer(cfg, log=False)
    try:
        reference = [trainer.train_step() for _ in range(2)]
    finally:
        trainer.close()
    assert [r.loss for r in results] == [r.loss for r in reference]
    assert [r.step for r in results] == [1, 2] and state.progress.step == 2
    assert state.progress.tokens_seen == 2 * 4 * cfg.data.seq_len
    assert not any(r.skipped for r in results) and results[0].sample_ids.tolist() == [0, 1, 2, 3]


def test_lr_schedule():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)


def test_batch_helpers():
    cfg = load_config(None, {"train": {"global_batch": 8, "batch_ramp": [[0, 4], [1000, 16]]}})
    assert global_batch_at(cfg, 0) == 4 and global_batch_at(cfg, 999) == 4 and global_batch_at(cfg, 1000) == 16
    assert split_micro(7, 3) == [(0, 3), (3, 6), (6, 7)]


def test_training_learns_checkpoints_and_samples(parity_base, tmp_path, hang_deadline):
    base = {k: dict(v) for k, v in parity_base.items()}
    base["optimizer"] = {"lr": 3e-3, "warmup_steps": 5}
    base["train"].update(steps=40, global_batch=16, micro_batch=8, val_interval=20, val_batches=2,
                         output_dir=str(tmp_path / "run"), sample_tokens=20)
    base["data"]["seq_len"] = 128
    summary = train(load_config(None, base))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    assert len(train_rows) == 40 and {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(train_rows[0])
    assert train_rows[0]["loss"] > 5.0  # ~ln(256) at init
    assert val_rows[-1]["val_loss"] < 3.6, val_rows  # byte-level, 40 steps of a 230k model
    assert (tmp_path / "run" / "config.toml").exists()
    assert (tmp_path / "run" / "checkpoints" / "step_00000040" / "COMPLETE").exists()
    assert summary["sample"].startswith("def ") and len(summary["sample"]) > 4
    out = subprocess.run([sys.executable, "-m", "ndtrain", "generate", "--checkpoint", str(tmp_path / "run"),
                          "--prompt", "import ", "--tokens", "10"], capture_output=True, text=True, timeout=hang_deadline(120))
    assert out.returncode == 0 and out.stdout.startswith("import "), out.stderr


def test_train_cli_rejects_bad_layout_before_starting(corpus_dir, tmp_path, hang_deadline):
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "train", "--nproc", "3", "--parallel.tp=2",
                           f"--data.path={corpus_dir}", f"--train.output_dir={tmp_path / 'r'}"],
                          capture_output=True, text=True, timeout=hang_deadline(120))
    assert proc.returncode == 2
    assert "world size 3" in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert not (tmp_path / "r").exists()


def test_missing_data_is_a_clear_error(tmp_path, hang_deadline):
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "train", f"--data.path={tmp_path / 'none'}",
                           f"--train.output_dir={tmp_path / 'r'}"], capture_output=True, text=True, timeout=hang_deadline(120))
    assert proc.returncode == 2 and "ndtrain prepare" in proc.stderr
