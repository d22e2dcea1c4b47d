"""Bytes per collective: what the dry run's real step issued, by collective and mesh dimension,
against the planner's count of the same (planner/traffic.py), for the layouts the planner models
exactly. Each comparison is one `ndtrain dryrun --json` of the debug model (world 8 unless the
case says; a later --world wins)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Bytes are counted, not timed: the only slack is the step's few-byte all-reduces (loss, norms),
# under 0.3% of the smallest buffer compared here.
TOL = 0.01


def traffic(*args: str, hang_deadline) -> dict:
    done = subprocess.run([sys.executable, "-m", "ndtrain", "dryrun", "--config", "configs/debug.toml", "--world", "8",
                           "--train.global_batch=16", "--json", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=hang_deadline(300))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    return {(kind, dim): (row["bytes"], out["planner"]["collective_bytes"].get(kind, {}).get(dim))
            for kind, dims in out["collective_bytes"].items() for dim, row in dims.items()}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("args, compared", [
    # ZeRO-3 x TP + SP: FSDP's gathers (every unit forward, every block but the last again backward)
    # and reduce-scatters; TP's pairs per layer and pass, the embedding's and the head's
    (("--parallel.dp_shard=4", "--parallel.tp=2"),
     {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("all_gather", "tp"), ("reduce_scatter", "tp")}),
    # context parallel's ring (K/V forward, again backward, dK/dV home) and HSDP's all-reduce
    (("--parallel.dp_shard=2", "--parallel.cp=4"), {("send", "cp"), ("recv", "cp"), ("all_gather", "dp_shard_cp")}),
    (("--parallel.dp_shard=2", "--parallel.dp_replicate=4"), {("all_gather", "dp_shard"), ("all_reduce", "dp_replicate")}),
    # ZeRO-3 inside 1F1B: a stage's blocks stay gathered between backwards (8 micro-batches, 3
    # blocks a stage); the activations and their gradients over pp
    (("--world", "4", "--parallel.pp=2", "--parallel.dp_shard=2", "--model.n_layers=6", "--train.micro_batch=1"),
     {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("send", "pp"), ("recv", "pp")}),
])
def test_the_planner_counts_the_bytes_the_step_moves(args, compared, hang_deadline):
    got = traffic(*args, hang_deadline=hang_deadline)
    assert compared <= set(got), sorted(got)
    for key in compared:
        seen, priced = got[key]
        assert priced and abs(seen / priced - 1) <= TOL, f"{args} {key}: dry run {seen} B, planner {priced} B"
