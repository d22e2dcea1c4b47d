"""What one layer keeps for its backward under tensor parallel with selective checkpointing,
measured by the dry run (two depths, the difference per layer) against the planner's formula
(planner/memory.activation_bytes). A row-parallel matmul's partial sums are [s, b, h] on every
tp rank; the policy (parallel/activation.py) recomputes them instead of keeping tp x what
sequence parallel shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TP, SEQ, MB = 2, 256, 8


def activations(layers: int, hang_deadline) -> int:
    args = ["--world", str(TP), "--json", f"--parallel.tp={TP}", "--parallel.dp_shard=1",
            "--parallel.sequence_parallel=true", "--parallel.activation_checkpoint=selective",
            "--parallel.mixed_precision=bf16", f"--model.n_layers={layers}", f"--data.seq_len={SEQ}",
            f"--train.micro_batch={MB}", f"--train.global_batch={MB}"]
    done = subprocess.run([sys.executable, "-m", "ndtrain", "dryrun", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=hang_deadline(300))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["peak_phase"] == "backward"  # every layer's activations held, the first backward running
    return out["memory_bytes"]["activations"]


@pytest.mark.timeout(600)
def test_a_tp_sp_layer_keeps_what_the_planner_counts(hang_deadline):
    from ndtrain.config import load_config
    from ndtrain.planner.memory import activation_bytes
    from ndtrain.planner.shapes import shape_of
    from ndtrain.planner.stack import STACKS

    per_layer = (activations(4, hang_deadline) - activations(2, hang_deadline)) / 2
    shape = shape_of(load_config(None, []).model)
    planned = activation_bytes(shape, STACKS["ndtrain"], SEQ, MB, TP, True, 1, "selective", 2)
    # The partial sums of wo and w2 kept (before) would add two [s, b, h] bf16 tensors a layer.
    partial_sums = 2 * 2 * SEQ * MB * shape.dim
    assert abs(per_layer / planned - 1) <= 0.10, (per_layer, planned, partial_sums)
