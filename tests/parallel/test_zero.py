"""The ZeRO stages hold what the paper says, between micro-batches of one step: ZeRO-1 keeps the
parameters gathered and the gradients whole (reduced once, after the last micro-batch), ZeRO-2
keeps the parameters gathered and reduces the gradients into their shard after every
micro-batch, ZeRO-3 frees the parameters and reduces after every micro-batch. (Parity of each
stage with one process is in test_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from ndtrain.parallel.launch import run_ranks
from ndtrain.parallel.verify import layout_config


def _state(trainer) -> list[bool]:
    """[are any parameters gathered, does any rank hold reduced (sharded) gradients]."""
    gathered = False
    for part in trainer.model_parts:
        for module in part.modules():
            get = getattr(module, "_get_fsdp_state", None)
            group = get()._fsdp_param_group if get is not None else None
            gathered |= bool(group is not None and group.is_unsharded)
    reduced = any(p.grad is not None for p in trainer.params)
    return [gathered, reduced]


def _holdings(cfgs) -> list[torch.Tensor]:
    from ndtrain.train.trainer import Trainer

    out = []
    for cfg in cfgs:
        trainer = Trainer(cfg, run_dir=None, log=False)
        seen = []
        loss_sum, fwd_bwd = trainer._loss_sum, trainer.forward_backward

        def spy_loss(inputs, targets):  # each micro-batch's forward starts here
            seen.append(_state(trainer))
            return loss_sum(inputs, targets)

        def spy_step(*args):  # ... and the last backward has ended when this returns
            total = fwd_bwd(*args)
            seen.append(_state(trainer))
            return total

        trainer._loss_sum, trainer.forward_backward = spy_loss, spy_step
        trainer.train_step()
        trainer.close()
        out.append(torch.tensor(seen))
    return out


EXPECTED = {  # (gathered, reduced) before micro-batch 1, before micro-batch 2, after the last backward
    "dp_shard=2,zero=1,ga=2": [[False, False], [True, False], [False, True]],
    "dp_shard=2,zero=2,ga=2": [[False, False], [True, True], [False, True]],
    "dp_shard=2,zero=3,ga=2": [[False, False], [False, True], [False, True]],
}


@pytest.mark.timeout(300)
def test_each_zero_stage_holds_what_the_paper_says(parity_base):
    specs = list(EXPECTED)
    per_rank = run_ranks(2, _holdings, [layout_config(parity_base, s) for s in specs])
    for rank in per_rank:
        for spec, seen in zip(specs, rank):
            assert seen.tolist() == EXPECTED[spec], spec
