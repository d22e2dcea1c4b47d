"""DiLoCo checkpoints: a run stopped mid-round (a fragment's outer all-reduce still in flight)
resumes bit-identically; a different number of replicas, a per-step-sync checkpoint and a
per-step-sync resume follow their rules; a changed schedule is refused in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from ckpt_helpers import assert_bit_identical, job, metrics, weights

from ndtrain.parallel.launch import run_ranks
from ndtrain.train.checkpoint import list_checkpoints

STREAMING = {"replicate_sync": "diloco", "dp_replicate": 2, "dp_shard": -1, "diloco_inner_steps": 4,
             "diloco_fragments": 2, "diloco_overlap_steps": 1, "diloco_outer_momentum": 0.9}


def _train(base: dict, preempt_at: int | None = None):
    """train() on every rank; with `preempt_at`, every rank signals itself after that step."""
    from ndtrain.config import load_config
    from ndtrain.train import step as steps, trainer as tm

    if preempt_at is not None:
        original = steps.train_step

        def train_step(state, batch, data_wait_s=0.0):
            result = original(state, batch, data_wait_s)
            if state.progress.step == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return result

        steps.train_step = train_step  # a forked rank: the parent's module is untouched
    return tm.train(load_config(None, {k: dict(v) for k, v in base.items()}))


@pytest.mark.timeout(300)
def test_preempted_mid_round_resumes_bit_identical(parity_base, tmp_path, hang_deadline):
    par = {"parallel": STREAMING, "train": {"steps": 7}}
    ref = run_ranks(2, _train, job(parity_base, tmp_path / "ref", **par), timeout_s=hang_deadline(120))[0]
    run = tmp_path / "run"
    # Step 2 sends fragment 0 and applies it at step 3: the save at 2 holds it in flight.
    first = run_ranks(2, _train, job(parity_base, run, **par), 2, timeout_s=hang_deadline(120))[0]
    assert first["preempted"] and first["steps"] == 2
    second = run_ranks(2, _train, job(parity_base, run, **par, checkpoint={"resume": "auto"}), timeout_s=hang_deadline(120))[0]
    assert second["steps"] == 7 and not second["preempted"]
    assert_bit_identical(weights(ref["checkpoint"]), weights(second["checkpoint"]))
    losses = [r["loss"] for r in metrics(run) if "loss" in r]
    assert losses == [r["loss"] for r in metrics(tmp_path / "ref") if "loss" in r]
    outer = [(r["step"], r["fragment"]) for r in metrics(run) if "outer_step" in r]
    assert outer == [(3, 0), (5, 1), (7, 0), (7, 0), (7, 1)]


def _save(jobs: list) -> list[dict]:
    """Rank fn: per (config, root, steps): train, save, return this rank's live weights."""
    from ndtrain.config import load_config
    from ndtrain.train.trainer import Trainer

    out = []
    for base, root, steps in jobs:
        cfg = load_config(None, base)
        t = Trainer(cfg, None, log=False)
        ck = t.checkpointer(root, cfg)
        for _ in range(steps):
            t.train_step()
        ck.save()
        out.append({"weights": t.full_weights()})
    return out


def _load(jobs: list) -> list[dict]:
    """Rank fn: per (config, root): build the layout, load the newest checkpoint; this rank's live
    weights and DiLoCo state, or the error."""
    from ndtrain.config import load_config
    from ndtrain.errors import NdtrainError
    from ndtrain.train.trainer import Trainer

    results = []
    for base, root in jobs:
        cfg = load_config(None, base)
        t = Trainer(cfg, None, log=False)
        ck = t.checkpointer(root, cfg)
        try:
            ck.resume("auto")  # the newest checkpoint that verifies, as a resumed run picks it
        except NdtrainError as exc:
            results.append({"error": str(exc)})
            continue
        out = {"weights": t.full_weights(), "step": t.step, "replica": t.state.diloco.replica if t.state.diloco else None}
        if t.state.diloco:
            local = [tr.param.to_local() if hasattr(tr.param, "to_local") else tr.param for tr in t.state.diloco.tracked]
            out["synced_is_live"] = all(torch.equal(s, p) for s, p in zip(t.state.diloco.synced, local))
            out["synced"] = {tr.name: s.clone() for tr, s in zip(t.state.diloco.tracked, t.state.diloco.synced)}
        results.append(out)
    return results


def _cfg(parity_base: dict, parallel: dict) -> dict:
    base = job(parity_base)
    base["parallel"] = dict(parallel)
    return base


DILOCO4 = {"replicate_sync": "diloco", "dp_replicate": 2, "dp_shard": 1, "diloco_inner_steps": 4}


@pytest.mark.timeout(300)
def test_resume_rules_across_replica_counts_and_sync_modes(parity_base, tmp_path, hang_deadline):
    """Saved mid-round (step 3 of H=4, replicas apart) by 2 replicas; loaded by 4 replicas
    (replica r takes replica r mod 2), by a per-step-sync run (θ_sync and replica 0's optimizer),
    and refused with one line by a run with another H. A per-step-sync checkpoint starts DiLoCo
    (θ_sync = its weights)."""
    dl, st = str(tmp_path / "diloco"), str(tmp_path / "step")
    saved = run_ranks(2, _save, [(_cfg(parity_base, DILOCO4), dl, 3), (_cfg(parity_base, {"dp_shard": 2}), st, 2)], timeout_s=hang_deadline(120))
    live = [rank[0]["weights"] for rank in saved]
    assert live[0]["output.weight"].ne(live[1]["output.weight"]).any()  # the replicas are apart
    global_model = weights(list_checkpoints(tmp_path / "diloco" / "checkpoints")[-1])
    plain = weights(list_checkpoints(tmp_path / "step" / "checkpoints")[-1])

    loads = [(_cfg(parity_base, {**DILOCO4, "dp_replicate": 4}), dl), (_cfg(parity_base, {"dp_shard": 4}), dl),
             (_cfg(parity_base, {**DILOCO4, "diloco_inner_steps": 2, "dp_shard": 2}), dl),
             (_cfg(parity_base, {**DILOCO4, "dp_shard": 2}), st)]
    got = run_ranks(4, _load, loads, timeout_s=hang_deadline(120))
    for rank in got:
        four, step_sync, other_h, from_step = rank
        assert four["step"] == 3
        assert_bit_identical(four["weights"], live[four["replica"] % 2])
        assert_bit_identical(four["synced"], {k: global_model[k] for k in four["synced"]})
        assert_bit_identical(step_sync["weights"], global_model)
        assert "parallel.diloco_inner_steps=4" in other_h["error"] and "\n" not in other_h["error"]
        assert from_step["synced_is_live"] and from_step["step"] == 2
        assert_bit_identical(from_step["weights"], plain)


def test_diloco_without_replicas_is_one_line_exit_2(corpus_dir, tmp_path, hang_deadline):
    before = sorted(p.name for p in corpus_dir.iterdir())
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "train", "--parallel.replicate_sync=diloco",
                           "--model.preset=debug", f"--data.path={corpus_dir}", f"--train.output_dir={tmp_path / 'r'}"],
                          capture_output=True, text=True, timeout=hang_deadline(120), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.replicate_sync" in lines[0] and "Traceback" not in proc.stderr
    assert sorted(p.name for p in corpus_dir.iterdir()) == before
