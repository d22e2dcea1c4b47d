"""The ZeRO stages hold what the paper says, between micro-batches of one step: ZeRO-1 keeps the
parameters gathered and the gradients whole (reduced once, after the last micro-batch), ZeRO-2
keeps the parameters gathered and reduces the gradients into their shard after every
micro-batch, ZeRO-3 frees the parameters and reduces after every micro-batch. (Parity of each
stage with one process is in test_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from ndtrain.parallel.launch import run_ranks
from ndtrain.tools.verify import layout_config


def _state(trainer) -> list[bool]:
    """[are any parameters gathered, does any rank hold reduced (sharded) gradients]."""
    gathered = False
    for part in trainer.state.model_parts:
        for module in part.modules():
            get = getattr(module, "_get_fsdp_state", None)
            group = get()._fsdp_param_group if get is not None else None
            gathered |= bool(group is not None and group.is_unsharded)
    reduced = any(p.grad is not None for p in trainer.state.params)
    return [gathered, reduced]


def _holdings(cfgs) -> list[torch.Tensor]:
    from ndtrain.train import step as steps
    from ndtrain.train.trainer import Trainer

    out = []
    loss_sum, fwd_bwd = steps.loss_sum, steps.forward_backward
    for cfg in cfgs:
        trainer = Trainer(cfg, run_dir=None, log=False)
        seen = []

        def spy_loss(state, inputs, targets, *rest):  # each micro-batch's forward starts here
            seen.append(_state(trainer))
            return loss_sum(state, inputs, targets, *rest)

        def spy_step(*args):  # ... and the last backward has ended when this returns
            total = fwd_bwd(*args)
            seen.append(_state(trainer))
            return total

        steps.loss_sum, steps.forward_backward = spy_loss, spy_step  # put back below, whatever happens
        try:
            trainer.train_step()
        finally:
            steps.loss_sum, steps.forward_backward = loss_sum, fwd_bwd
        trainer.close()
        out.append(torch.tensor(seen))
    return out


EXPECTED = {  # (gathered, reduced) before micro-batch 1, before micro-batch 2, after the last backward
    "dp_shard=2,zero=1,ga=2": [[False, False], [True, False], [False, True]],
    "dp_shard=2,zero=2,ga=2": [[False, False], [True, True], [False, True]],
    "dp_shard=2,zero=3,ga=2": [[False, False], [False, True], [False, True]],
}


@pytest.mark.timeout(300)
def test_each_zero_stage_holds_what_the_paper_says(parity_base, hang_deadline):
    specs = list(EXPECTED)
    per_rank = run_ranks(2, _holdings, [layout_config(parity_base, s) for s in specs], timeout_s=hang_deadline(120))
    for rank in per_rank:
        for spec, seen in zip(specs, rank):
            assert seen.tolist() == EXPECTED[spec], spec


# ---- checkpoints: ZeRO stages and tied pipeline stages resume anywhere ----------------------

def _cfg(parity_base, spec: str, **model):
    from ndtrain.config import load_config

    base = {k: dict(v) for k, v in parity_base.items()}
    base["model"].update(n_layers=8, **model)
    base["train"].update(val_interval=0, sample_tokens=0, micro_batch=2)
    return load_config(None, {**base, "parallel": layout_config(base, spec).parallel.__dict__})


def _train(cfg, root, save: bool, steps: int = 2) -> list[float]:
    from ndtrain.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir=None, log=False)
    ck = trainer.checkpointer(root, cfg)
    if save:
        for _ in range(2):
            trainer.train_step()
        ck.save()
    else:
        ck.resume("auto")
        assert trainer.step == 2
    losses = [trainer.train_step().loss for _ in range(steps)]
    ck.finish()
    trainer.close()
    return losses


def _world2(cfgs: dict, roots: dict) -> dict:
    return {"zero1": _train(cfgs["zero1"], roots["zero"], save=True),
            "zero2": _train(cfgs["zero2"], roots["zero"], save=False),
            "tied_pp": _train(cfgs["tied_pp"], roots["tied"], save=True)}


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_zero_and_tied_pipeline_checkpoints_resume_anywhere(parity_base, tmp_path, hang_deadline):
    """Saved at ZeRO-1 (2 ranks): resumed at ZeRO-2 and in one process. Saved from a tied
    pipeline (pp=2, the weight on both ends): resumed in one process, whose tied weight is one.
    The next steps' losses equal the uninterrupted run's."""
    roots = {"zero": tmp_path / "zero", "tied": tmp_path / "tied"}
    cfgs = {"zero1": _cfg(parity_base, "dp_shard=2,zero=1"), "zero2": _cfg(parity_base, "dp_shard=2,zero=2"),
            "tied_pp": _cfg(parity_base, "pp=2", tie_embeddings=True)}
    w2 = run_ranks(2, _world2, cfgs, roots, timeout_s=hang_deadline(120))
    reference, tied_reference = w2[0]["zero1"], w2[-1]["tied_pp"]  # the pipeline's loss lives on its last rank
    # fp32 losses, ZeRO stages and one process: reduction order only (conftest's parity_base docstring).
    assert max(abs(a - b) for a, b in zip(w2[0]["zero2"], reference)) <= 1e-5
    one = _train(_cfg(parity_base, "dp_shard=1"), roots["zero"], save=False)
    assert max(abs(a - b) for a, b in zip(one, reference)) <= 1e-5, (one, reference)
    tied = _train(_cfg(parity_base, "dp_shard=1", tie_embeddings=True), roots["tied"], save=False)
    assert max(abs(a - b) for a, b in zip(tied, tied_reference)) <= 1e-5, (tied, tied_reference)
