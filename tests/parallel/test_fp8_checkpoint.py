"""FP8 checkpoints hold the fp32 master weights and nothing of torchao: a run saved in fp8 (FSDP,
float8 all-gather weights) resumes in bf16 in one process, and a bf16 checkpoint resumes in fp8
under FSDP, with the weights bit for bit; Hugging Face export of an fp8 run is unchanged. Where fp8
matmul is emulated (conftest's fp8 probe) the model has 2 layers and 32-token sequences: what is
checked (names, dtypes, bits) does not depend on the size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ndtrain.config import load_config


def _job(parity_base: dict, layers: int, **parallel) -> dict:
    base = {k: dict(v) for k, v in parity_base.items()}
    base["train"].update(val_interval=0, sample_tokens=0)
    if layers != 4:  # the small model of a slow-fp8 host
        base["model"] = {"preset": "debug", "n_layers": layers}
        base["data"]["seq_len"] = 32
    base["parallel"] = parallel
    return base


def _resume_train_save(base: dict, load_from: str | None, save_to: str, steps: int) -> dict:
    """In this process group: resume (if asked), record the weights, train, save."""
    from ndtrain.train.trainer import Trainer

    cfg = load_config(None, base)
    trainer = Trainer(cfg, run_dir=None, log=False)
    loaded = None
    if load_from:
        trainer.checkpointer(Path(load_from), cfg).resume("auto")
        loaded = trainer.full_weights()
    losses = [trainer.train_step().loss for _ in range(steps)]
    ckpt = trainer.checkpointer(Path(save_to), cfg)
    path = ckpt.save()
    ckpt.finish()
    out = {"loaded": loaded, "saved": trainer.full_weights(), "step": trainer.step, "losses": losses,
           "path": str(path)}
    trainer.close()
    return out


@pytest.mark.timeout(300)
def test_fp8_checkpoint_resumes_in_bf16_and_back(parity_base, tmp_path, fp8_cheap_peak, hang_deadline):
    from ndtrain.parallel.launch import run_ranks
    from ndtrain.train.checkpoint import load_model_weights
    from ndtrain.tools.interop import export

    layers = 2 if fp8_cheap_peak.slow else 4
    fp8_fsdp = _job(parity_base, layers, mixed_precision="fp8", dp_shard=2)
    a = run_ranks(2, _resume_train_save, fp8_fsdp, None, str(tmp_path / "a"), 2, timeout_s=hang_deadline(120))[0]

    # fp8 (FSDP world 2) -> bf16 (one process)
    bf16 = _job(parity_base, layers, mixed_precision="bf16")
    b = _resume_train_save(bf16, str(tmp_path / "a"), str(tmp_path / "b"), 1)
    assert b["step"] == 3
    assert all(torch.equal(a["saved"][k], b["loaded"][k]) for k in a["saved"])

    # bf16 (one process) -> fp8 (FSDP world 2, weights inside torchao's float8 all-gather tensor)
    c = run_ranks(2, _resume_train_save, fp8_fsdp, str(tmp_path / "b"), str(tmp_path / "c"), 1, timeout_s=hang_deadline(120))[0]
    assert c["step"] == 4 and all(torch.equal(b["saved"][k], c["loaded"][k]) for k in b["saved"])
    assert all(abs(x) < 10 for x in c["losses"])

    # What an fp8 checkpoint holds: the same fp32 tensors, under the same names, as a bf16 one.
    fp8_weights, _ = load_model_weights(a["path"])
    bf16_weights, _ = load_model_weights(b["path"])
    assert sorted(fp8_weights) == sorted(bf16_weights)
    assert all(t.dtype == torch.float32 and type(t) is torch.Tensor for t in fp8_weights.values())
    for f in Path(a["path"]).iterdir():  # no torchao class pickled anywhere (metadata, shards)
        assert b"torchao" not in f.read_bytes(), f.name

    out = export(a["path"], "hf", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == layers
