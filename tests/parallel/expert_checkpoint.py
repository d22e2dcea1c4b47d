"""A rank's part of the expert-parallel resume tests: train two steps, save, train two more."""

from __future__ import annotations

from pathlib import Path


def train_save_continue(base: dict, root: str, dp_shard: int) -> tuple[list[float], list[int]]:
    """Under dp_shard x ep=2: (the two losses after the save, this rank's shape of the first
    block's experts.w1 shard)."""
    from ndtrain.config import load_config
    from ndtrain.train.trainer import Trainer

    cfg = load_config(None, {**base, "parallel": {"dp_shard": dp_shard, "ep": 2}})
    trainer = Trainer(cfg, run_dir=None, log=False)
    w1 = next(p for n, p in trainer.state.model_parts[0].named_parameters() if n.endswith("experts.w1"))
    local = list(w1.to_local().shape)
    ckpt = trainer.checkpointer(Path(root), cfg)
    for _ in range(2):
        trainer.train_step()
    ckpt.save()
    after = [trainer.train_step().loss for _ in range(2)]
    ckpt.finish()
    trainer.close()
    return after, local
