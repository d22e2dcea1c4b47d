"""The training step reads device values on the host at most once per logging interval.

Each such read (`.item()`, `.tolist()`, `float(t)`, `if t`) is a sync on a GPU. The dry run
proves it on the real step at any scale (fake tensors: a read they cannot answer is a device
value); the CPU tests count the reads of a few real steps of the debug model, check the values
read late are the values read at once, and that the non-finite guard judges late steps as it
judged them one by one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ndtrain.config import load_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3  # one logging interval of three steps (CPU)
DRY_STEPS = 2  # the dry run's interval: two steps show a read per step apart from one per interval
ONE_READ = ["ndtrain/train/step.py"]  # where the interval's one read is


def _dryrun(*args: str, hang_deadline) -> dict:
    command = [sys.executable, "-m", "ndtrain", "dryrun", "--world", "4", "--train.global_batch=8",
               "--model.n_layers=1", "--steps", str(DRY_STEPS), "--json", *args]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT, timeout=hang_deadline(600))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("args, layout", [
    ((), "dp_shard=4"), (("--parallel.tp=2",), "dp_shard=2 x tp=2"),
    # the last stage, whose schedule returns the loss sum (the default suite has two already)
    pytest.param(("--parallel.pp=2", "--model.n_layers=2", "--train.micro_batch=2", "--rank", "2"),
                 "pp=2 x dp_shard=2", marks=pytest.mark.slow),
])
def test_dry_run_reads_once_per_logging_interval(args, layout, hang_deadline):
    out = _dryrun(*args, hang_deadline=hang_deadline)
    assert out["layout"] == layout
    assert out["host_sync_steps"] == DRY_STEPS
    assert out["host_syncs"] <= 1 and out["host_syncs_per_step"] <= 1 / DRY_STEPS, out["host_sync_lines"]
    # The one read is the interval's, not the step's: the step itself reads no device value.
    assert [line.split(":")[0] for line in out["host_sync_lines"]] == ONE_READ
    assert out["host_reads"] == []


def test_steps_below_one_is_refused_naming_the_flag():
    """A UsageError: the CLI prints its one line and exits 2 (test_dryrun.py's bad-input cases)."""
    from ndtrain.errors import UsageError
    from ndtrain.tools.dryrun import main

    with pytest.raises(UsageError, match=r"^--steps must be >= 1, got 0$"):
        main(["--world", "4", "--steps", "0"])


def _trainer(corpus_dir, **optimizer):
    from ndtrain.train.trainer import Trainer

    cfg = load_config(None, {"model": {"preset": "debug"}, "data": {"path": str(corpus_dir), "seq_len": 32},
                             "optimizer": {"grad_clip": 0.05, **optimizer},  # the clip acts on every step
                             "train": {"global_batch": 4, "micro_batch": 2, "seed": 3},
                             "logging": {"tensorboard": False, "progress": "off"}})
    return Trainer(cfg, run_dir=None, log=False)


def _interval(trainer, steps: int):
    """`steps` steps as the job loop runs them between logging steps, then its read, counted."""
    from ndtrain.tools.dryrun_syncs import HostReads
    from ndtrain.train import step as step_module

    state = trainer.state
    with HostReads() as reads:
        results = [step_module.train_step(state, *step_module.next_batch(state)) for _ in range(steps)]
        step_module.read_steps(state.unread)
    return reads, results


@pytest.mark.timeout(300)
def test_cpu_steps_read_once_and_late_values_equal_prompt_ones(corpus_dir):
    late, prompt = _trainer(corpus_dir), _trainer(corpus_dir)
    try:
        reads, results = _interval(late, STEPS)
        assert reads.count == 1 and reads.where[0].startswith(ONE_READ[0]), reads.where
        per_step = [prompt.train_step() for _ in range(STEPS)]  # the Trainer API reads each at once
        for a, b in zip(results, per_step):
            assert (a.loss, a.grad_norm, a.skipped) == (b.loss, b.grad_norm, b.skipped)
            assert a.grad_norm > 0.05  # clipped: the device-side clip factor was below 1
        for p, q in zip(late.state.params, prompt.state.params):
            assert torch.equal(p.detach(), q.detach())
    finally:
        late.close()
        prompt.close()


@pytest.mark.timeout(300)
def test_an_optimizer_without_a_device_skip_reads_every_step(corpus_dir):
    """foreach AdamW cannot skip an update on a device flag: its steps read at once (the counter
    sees them, so the test above could fail)."""
    trainer = _trainer(corpus_dir, implementation="foreach")
    try:
        reads, _ = _interval(trainer, STEPS)
        assert reads.count == STEPS, reads.where
    finally:
        trainer.close()


@pytest.mark.timeout(300)
def test_a_nonfinite_step_is_skipped_on_the_device(corpus_dir):
    from ndtrain.train import step as step_module

    trainer = _trainer(corpus_dir)
    try:
        trainer.train_step()
        state = trainer.state
        before = [p.detach().clone() for p in state.params]
        moments = [s["exp_avg"].clone() for s in state.optimizer.state.values()]
        original = step_module.forward_backward

        def poisoned(*args):
            total = original(*args)
            state.params[0].grad.fill_(float("nan"))
            return total

        step_module.forward_backward = poisoned
        try:
            result = step_module.train_step(state, *step_module.next_batch(state))
        finally:
            step_module.forward_backward = original
        assert result.unread  # decided without a read
        assert result.skipped and result.grad_norm != result.grad_norm
        assert all(torch.equal(a, p.detach()) for a, p in zip(before, state.params))
        assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, state.optimizer.state.values()))
        assert {int(s["step"]) for s in state.optimizer.state.values()} == {1}
        assert not trainer.train_step().skipped  # and the next step updates
        assert {int(s["step"]) for s in state.optimizer.state.values()} == {2}
    finally:
        trainer.close()


def test_rank_all_reports_the_role_that_syncs_most():
    """--rank all's figures are the worst role's by memory; its host syncs are the role's that
    syncs most (a pipeline's last stage reads what a first stage never does)."""
    from ndtrain.tools.dryrun_syncs import most_syncs, sync_lines

    def role(rank, syncs):
        return {"rank": rank, "host_syncs": syncs, "host_sync_steps": 2, "host_syncs_per_step": syncs / 2,
                "host_sync_lines": [f"ndtrain/x.py:{rank}"]}

    out = most_syncs([role(0, 1), role(4, 3), role(8, 2)])
    assert out == {**{k: v for k, v in role(4, 3).items() if k != "rank"}, "host_syncs_rank": 4}
    assert "on rank 4, the role that syncs most: 3 (1.50 per step)" in sync_lines(out)[0]
