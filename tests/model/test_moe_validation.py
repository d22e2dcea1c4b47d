"""Validation of a mixture-of-experts model (step.py's `validation_loss`): it runs the fixed
validation windows in batches of the training shape, the last batch padded with copies of a
window whose targets are ignored, and those padded rows are routed to experts like real ones. Two
things must still hold:

- a validation pass leaves training untouched: no routing statistics recorded (they feed the
  aux-loss-free bias update and the metrics of the next step), no bias moved, so training with
  validation after every step follows the trajectory of training without it, bit for bit (the
  training computation is the same, deterministic CPU arithmetic on the same tensors; any
  tolerance would hide a leak);
- the validation loss does not depend on the padding: the same windows in batches of another
  size give the same loss up to the rounding of summing the same token losses in other groups.

On one process, and on 2 Gloo ranks with the experts split over them (ep=2), where the padded
rows also travel through the all-to-all and a rank may hold only padded rows.
"""

from __future__ import annotations

import pytest
import torch

from ndtrain.config import load_config

# The validation set: 3 x 2 = 6 windows of 32 tokens, whatever the training batch.
VAL = {"val_batches": 3, "val_batch_size": 2}


def moe_config(corpus_dir, global_batch: int = 4, micro_batch: int = 2, parallel: dict | None = None, **model):
    """debug-moe with capacity dropping and the aux-loss-free bias: every piece of MoE state a
    validation pass could disturb is live (the bias, the drop counts, the aux-loss metric)."""
    model = {"preset": "debug-moe", "capacity_factor": 1.0, "load_balance": "aux_free",
             "aux_free_update_rate": 0.01, **model}
    return load_config(None, {"model": model, "data": {"path": str(corpus_dir), "seq_len": 32}, "parallel": parallel or {},
                              "train": {"global_batch": global_batch, "micro_batch": micro_batch, "seed": 5, **VAL},
                              "logging": {"tensorboard": False, "progress": "off"}})


def train(cfg, steps: int, validate_every_step: bool) -> dict:
    from ndtrain.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir=None, log=False)
    losses, moe_rows, val_losses = [], [], []
    for _ in range(steps):
        result = trainer.train_step()
        losses.append(result.loss)
        moe_rows.append({k: v for k, v in result.extra.items() if k.startswith("moe/")})
        if validate_every_step:
            val_losses.append(trainer.validation_loss())
            assert all(moe.stats is None for _, moe in trainer.state.moe)  # nothing counted for the next step
    biases = [moe.expert_bias.clone() for _, moe in trainer.state.moe]
    trainer.close()
    return {"losses": losses, "moe": moe_rows, "val": val_losses, "biases": biases}


def val_loss(cfg) -> float:
    from ndtrain.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir=None, log=False)
    loss = trainer.validation_loss()
    trainer.close()
    return loss


def test_moe_validation_leaves_the_training_trajectory_unchanged(corpus_dir):
    cfg = moe_config(corpus_dir)
    plain = train(cfg, 3, validate_every_step=False)
    validated = train(cfg, 3, validate_every_step=True)
    assert validated["losses"] == plain["losses"]
    assert validated["moe"] == plain["moe"]  # the logged tokens_per_expert, dropped_frac, aux_loss, ...
    assert all(torch.equal(a, b) for a, b in zip(validated["biases"], plain["biases"]))
    assert any(b.abs().max() > 0 for b in plain["biases"])  # the bias update ran: a leak would move it
    assert validated["val"][-1] < validated["val"][0]


@pytest.mark.parametrize("global_batch,micro_batch", [(4, 2), (8, 4), (3, 1)])
def test_moe_validation_loss_does_not_depend_on_padding(corpus_dir, global_batch, micro_batch):
    """The 6 windows as one unpadded batch of 6, against batches of 4 (the second padded by 2), 8
    (one batch, 2 padded rows) and 3. capacity_factor 0.5 drops assignments, so a capacity shared
    across the rows of a batch (padded ones included) would change the loss."""
    unpadded = val_loss(moe_config(corpus_dir, 6, 6, capacity_factor=0.5))
    padded = val_loss(moe_config(corpus_dir, global_batch, micro_batch, capacity_factor=0.5))
    # The loss is a sum of 192 fp32 token losses, summed in other groups (one per micro-batch):
    # reassociating n terms moves the sum by <= n x 2^-24 relative, ~1.1e-5 for n = 192. A leak
    # (padded tokens counted, or routed against real ones) moves it by far more.
    assert padded == pytest.approx(unpadded, rel=1.2e-5, abs=0.0)


def _expert_parallel_rank(corpus_dir: str) -> dict:
    ep = {"dp_shard": 2, "ep": 2}
    plain = train(moe_config(corpus_dir, parallel=ep), 3, validate_every_step=False)
    validated = train(moe_config(corpus_dir, parallel=ep), 3, validate_every_step=True)
    return {"same_trajectory": torch.tensor(validated["losses"] == plain["losses"] and validated["moe"] == plain["moe"]
                                            and all(torch.equal(a, b) for a, b in zip(validated["biases"], plain["biases"]))),
            # 8: rank 1 holds 2 windows and 2 padded rows; 4: rank 1's second batch is all padding
            "val": torch.tensor([val_loss(moe_config(corpus_dir, gb, gb // 2, ep, capacity_factor=0.5)) for gb in (8, 4)],
                                dtype=torch.float64)}


@pytest.mark.timeout(300)  # 4.5 s on the 2-core host: one world-2 launch
def test_moe_validation_under_expert_parallel(corpus_dir, hang_deadline):
    from ndtrain.parallel.launch import run_ranks

    ranks = run_ranks(2, _expert_parallel_rank, str(corpus_dir), timeout_s=hang_deadline(120))
    assert all(bool(r["same_trajectory"]) for r in ranks)
    unpadded = val_loss(moe_config(corpus_dir, 6, 6, capacity_factor=0.5))
    for r in ranks:  # every rank returns the all-reduced loss
        assert r["val"].tolist() == pytest.approx([unpadded] * 2, rel=1.2e-5, abs=0.0)
