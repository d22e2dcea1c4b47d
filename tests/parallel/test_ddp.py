"""Plain replication runs on torch's DDP reducer (Layout.on_ddp_reducer), invisibly:
the same parameter names, gradients all-reduced once per step, and every other layout on FSDP2.
Its numerics are in the parity matrix (test_parity.py: dp_replicate=2 with ga=2, activation_checkpoint=full, bf16)."""

from __future__ import annotations

import pytest

from ndtrain.layout import Layout
from ndtrain.model.config import preset
from ndtrain.parallel.launch import run_ranks


def _model(name: str = "debug"):
    from ndtrain.model.llama import build_model

    return build_model(preset(name), "meta")


@pytest.mark.parametrize("degrees,ddp", [
    ({"dp_replicate": 2}, True),
    ({"dp_replicate": 2, "mixed_precision": "bf16"}, False),  # FSDP's bf16 blocks beat DDP under autocast
    ({"dp_replicate": 2, "mixed_precision": "fp8"}, False),  # FSDP's float8 path
    ({"dp_replicate": 2, "cpu_offload": True}, False),  # FSDP's CPU offload policy
    ({"dp_replicate": 2, "dp_shard": 2}, False),  # HSDP
    ({"dp_shard": 2}, False),
    ({"dp_replicate": 2, "tp": 2}, False),
    ({"dp_replicate": 2, "replicate_sync": "diloco"}, False),  # FSDP inside each replica
])
def test_which_layouts_run_on_ddp(degrees, ddp):
    assert Layout(**degrees).on_ddp_reducer(_model().cfg.is_moe) is ddp


def test_moe_models_keep_fsdp():
    """A step may route no token to an expert; DDP's reducer would wait for its gradient."""
    assert not Layout(dp_replicate=2).on_ddp_reducer(_model("debug-moe").cfg.is_moe)


def _build_and_step():
    import torch
    import torch.nn.functional as F
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import FSDPModule

    from ndtrain.model.init import materialize
    from ndtrain.parallel.compose import parallelize
    from ndtrain.parallel.data_parallel import accumulation
    from ndtrain.parallel.dims import build_mesh

    dims = Layout(dp_replicate=2)
    model = parallelize(_model(), dims, build_mesh(dims, "cpu"))
    materialize(model, 0, "cpu")
    names = list(model.state_dict())
    rank = torch.distributed.get_rank()
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
    syncs = []
    for last in (False, True):  # two micro-batches: reduce on the last only
        accumulation([model], dims, last)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        syncs.append(replicate.state(model)._ddp.require_backward_grad_sync)
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"names": names, "registry": sorted(_get_registry(model) or {}), "fsdp": isinstance(model, FSDPModule),
            "syncs": syncs, "grads": grads}


@pytest.mark.timeout(120)
def test_ddp_keeps_names_and_reduces_on_the_last_micro_batch(hang_deadline):
    ranks = run_ranks(2, _build_and_step, timeout_s=hang_deadline(120))
    plain = list(_model().state_dict())
    for r in ranks:
        assert r["names"] == plain  # checkpoints and HF export see the model's own names
        assert r["registry"] == ["replicate"] and not r["fsdp"]
        assert r["syncs"] == [False, True]
    # Each rank saw other tokens; after the all-reduce both hold the same (averaged) gradients.
    assert ranks[0]["grads"].abs().sum() > 0
    assert (ranks[0]["grads"] - ranks[1]["grads"]).abs().max() == 0


def _train(corpus, out, steps: int, *args, hang_deadline) -> dict:
    """`ndtrain train` on 2 ranks; the loss of every step it ran."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ndtrain", "train", "--nproc", "2", "--model.preset=debug", f"--data.path={corpus}",
           "--data.seq_len=64", "--train.global_batch=8", "--train.micro_batch=4", "--train.val_interval=0",
           "--train.sample_tokens=0", "--logging.tensorboard=false", "--logging.progress=off",
           f"--train.steps={steps}", "--checkpoint.interval_steps=3", "--checkpoint.keep_last=4", f"--train.output_dir={out}", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_deadline(240),
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "step_time_s" in row}


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_checkpoints_cross_between_the_ddp_reducer_and_zero3(corpus_dir, tmp_path, hang_deadline):
    """Resume anywhere holds across the two runtime paths: DDP (the reducer) -> ZeRO-3 -> DDP
    continues with the losses of the uninterrupted DDP run."""
    ddp, zero3 = ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"], ["--parallel.dp_shard=2", "--parallel.zero=3"]
    ref = _train(corpus_dir, tmp_path / "ref", 8, *ddp, hang_deadline=hang_deadline)
    mid = _train(corpus_dir, tmp_path / "z3", 6, *zero3,
                 f"--checkpoint.resume={tmp_path / 'ref' / 'checkpoints' / 'step_00000003'}", hang_deadline=hang_deadline)
    end = _train(corpus_dir, tmp_path / "back", 8, *ddp,
                 f"--checkpoint.resume={tmp_path / 'z3' / 'checkpoints' / 'step_00000006'}", hang_deadline=hang_deadline)
    assert sorted(mid) == [4, 5, 6] and sorted(end) == [7, 8]
    for step, loss in {**mid, **end}.items():
        assert loss == pytest.approx(ref[step], abs=1e-5), step  # fp32 reduction order (conftest's parity_base)
