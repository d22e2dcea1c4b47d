"""balance = "measured" in a whole job of 2 Gloo ranks: the compute clock is replaced by one that
reports rank 1 twice as slow per row (no timing), so the job re-balances at the first checkpoint
boundary, records it (metrics row, checkpoint), keeps it on a resume, and every sample is trained
on exactly once across the change and the resume."""

from __future__ import annotations

import json

import pytest

from ndtrain.config import load_config
from ndtrain.parallel.launch import run_ranks

COST = [1.0, 2.0]  # compute seconds per row: rank 1 is half as fast


def _job(cfg, run_dir):
    import torch

    from ndtrain.train import balance, step as steps
    from ndtrain.train.trainer import train

    rank = torch.distributed.get_rank()
    seen, pending = [], []
    next_batch = steps.next_batch

    def spy(state):
        batch, wait = next_batch(state)
        seen.append(batch.global_ids.tolist())
        pending.append(len(batch.global_ids))
        return batch, wait

    class Clock:  # what rank `rank` would measure: its rows since the last boundary times its cost
        def __init__(self, *_):
            pass

        def take(self):
            total = sum(pending) * COST[rank]
            pending.clear()
            return total

        def close(self):
            pass

    steps.next_batch, clock = spy, balance.ComputeClock
    balance.ComputeClock = Clock
    try:
        cfg.train.output_dir = str(run_dir)
        train(cfg)  # steps 1-8: re-balances at step 4
        cfg.train.steps, cfg.checkpoint.resume = 12, "auto"
        train(cfg)  # resumes at step 8 with the recorded shares
    finally:
        steps.next_batch, balance.ComputeClock = next_batch, clock
    return seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_measured_balance_rebalances_records_and_resumes(parity_base, tmp_path, hang_deadline):
    base = {k: dict(v) for k, v in parity_base.items()}
    base["train"].update(global_batch=16, micro_batch=16, steps=8, val_interval=0, sample_tokens=0)
    base["data"]["seq_len"] = 32
    base["parallel"] = {"dp_replicate": 2, "dp_shard": 1, "balance": "measured", "compile": False}
    base["checkpoint"] = {"interval_steps": 4}
    cfg = load_config(None, base)
    per_rank = run_ranks(2, _job, cfg, tmp_path / "run", timeout_s=hang_deadline(600.0))
    rows = [[len(ids) for ids in rank] for rank in per_rank]
    # [8, 8] until the step-4 boundary; rows per busy second 8/8 and 8/16 -> [11, 5], kept
    # (at [11, 5] the ranks' times are 11 and 10: within the 10% threshold) and resumed.
    assert rows[0] == [8] * 4 + [11] * 8 and rows[1] == [8] * 4 + [5] * 8
    every = sorted(i for rank in per_rank for ids in rank for i in ids)
    assert every == list(range(12 * 16))  # each sample once, across the change and the resume
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    changes = [e for e in events if e.get("event") == "rebalance"]
    assert [(c["step"], c["rows_before"], c["rows_after"]) for c in changes] == [(4, [8, 8], [11, 5])]
