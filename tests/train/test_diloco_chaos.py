"""The checkpoint suite's chaos kill test (tests/train/chaos.py) with DiLoCo on: 2 replicas,
streaming (2 fragments of H=4, each all-reduce applied one step late), Nesterov momentum. Ranks
are SIGKILLed mid-step and mid-save and hung; the final weights must be bit-identical to an
uninterrupted DiLoCo run. Saves every 2 steps land mid-round, some with a fragment in flight."""

from __future__ import annotations

import random

import chaos
import pytest

DILOCO_ARGS = ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--parallel.replicate_sync=diloco",
               "--parallel.diloco_inner_steps=4", "--parallel.diloco_fragments=2",
               "--parallel.diloco_overlap_steps=1", "--parallel.diloco_outer_momentum=0.9"]
DEADLINE_S = 6.0


@pytest.fixture()
def diloco_chaos(monkeypatch):
    base = chaos.train_args
    monkeypatch.setattr(chaos, "train_args", lambda *a, **k: base(*a, **k) + DILOCO_ARGS)
    return chaos


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_kill_with_diloco(corpus_dir, tmp_path, diloco_chaos):
    reference = diloco_chaos.reference_weights(corpus_dir, tmp_path / "reference")
    seed = random.randrange(100_000)
    faults = diloco_chaos.plan(random.Random(seed), ["step", "save", "hang"])
    trial = diloco_chaos.run_trial(corpus_dir, tmp_path / "trial", reference, faults, DEADLINE_S)
    print(f"seed {seed}: {trial.faults} {trial.seconds:.0f} s {trial.problems}")
    assert trial.ok and trial.kills == 3, (seed, trial.faults, trial.problems)
