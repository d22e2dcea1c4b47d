"""FSDP's shards of expert-parallel weights when a rank's local experts do not divide over the
expert shard group (parallel/expert.py expert_shard_dim): split along the experts' input
dimension, not padded along the expert dimension; the same training and the same checkpoints."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from expert_checkpoint import train_save_continue

from ndtrain.parallel.expert import expert_shard_dim

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5  # fp32 parity, as tests/parallel/test_expert_parallel.py


def test_expert_shard_dim():
    assert expert_shard_dim((4, 64, 32), 2) == 0  # the local experts divide: whole experts per rank
    assert expert_shard_dim((1, 4096, 14336), 8) == 1  # one expert over 8 ranks
    assert expert_shard_dim((3, 64, 32), 2) == 1
    assert expert_shard_dim((3, 5, 32), 2) == 0  # neither divides: FSDP's padding along dim 0


@pytest.mark.timeout(300)
def test_one_local_expert_is_split_over_its_shards(hang_deadline):
    """debug-moe (8 experts) at dp_shard=16 x ep=8: one local expert per rank over an expert
    shard group of 2. Rank 0 holds half of it; before, FSDP split the expert dimension (1 row)
    into 2 chunks of 1 row and rank 0 held the whole expert (the same bytes as padding on rank 8)."""
    from ndtrain.config import load_config
    from ndtrain.model.llama import build_model

    world, ep = 16, 8
    args = ["--world", str(world), "--rank", "0", "--json", "--model.preset=debug-moe", f"--parallel.dp_shard={world}",
            f"--parallel.ep={ep}", "--parallel.mixed_precision=bf16", f"--train.global_batch={world}"]
    done = subprocess.run([sys.executable, "-m", "ndtrain", "dryrun", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=hang_deadline(300))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    expected = 0
    for name, p in build_model(load_config(None, ["--model.preset=debug-moe"]).model, "meta").named_parameters():
        if ".experts.w" in name:  # the routed experts: an eighth over ep, half of that over ep_shard
            assert p.shape[0] == ep and (p.numel() * 4) % world == 0
            expected += p.numel() * 4 // world
        else:  # FSDP over dp_shard: ceil(d0 / world) rows (fp32 shards)
            expected += math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * 4
    assert out["memory_bytes"]["parameters"] == expected


def _moe_base(parity_base) -> dict:
    base = {k: dict(v) for k, v in parity_base.items()}
    # 6 experts over ep=2: 3 local experts, which do not divide over an expert shard group of 2
    base["model"] = {"preset": "debug-moe", "n_experts": 6}
    base["train"].update(val_interval=0, sample_tokens=0)
    return base


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_experts_split_on_their_input_dim_train_as_one_process(parity_base):
    from ndtrain.tools.verify import verify

    layouts = ["dp_shard=4,ep=2"]
    _, results = verify(_moe_base(parity_base), layouts, steps=3, tol_loss=TOL, tol_weight=TOL)
    assert [r.layout for r in results] == layouts
    r = results[0]
    assert r.d_loss <= TOL and r.d_weight <= TOL, f"Δloss {r.d_loss:.2e} Δweight {r.d_weight:.2e}"


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_experts_split_on_their_input_dim_resume_in_one_process(parity_base, tmp_path, hang_deadline):
    """Saved from dp_shard=4 x ep=2 (3 local experts split on dim 1 over 2 ranks), resumed in
    one process: DCP saves the global tensors, whatever dimension FSDP split."""
    from ndtrain.config import load_config
    from ndtrain.parallel.launch import run_ranks
    from ndtrain.train.trainer import Trainer

    base = _moe_base(parity_base)
    reference, local = run_ranks(4, train_save_continue, base, str(tmp_path), 4, timeout_s=hang_deadline(120))[0]
    dim = load_config(None, base).model.dim
    assert local[:2] == [3, dim // 2]  # this rank's shard: 3 experts, half the input dimension
    cfg = load_config(None, base)
    trainer = Trainer(cfg, run_dir=None, log=False)
    ckpt = trainer.checkpointer(tmp_path, cfg)
    ckpt.resume("auto")
    assert trainer.step == 2
    resumed = [trainer.train_step().loss for _ in range(2)]
    ckpt.finish()
    trainer.close()
    assert max(abs(a - b) for a, b in zip(resumed, reference)) <= TOL
