"""`[parallel] auto = true`: the planner lays out the run for the world size it finds.

It runs at every (re)start, before the mesh exists, so an elastic restart on fewer ranks gets a
layout planned for the new world; resume-anywhere checkpoints make the change of layout safe.
Every rank computes the same answer (the planner is pure, the hardware profile is a file).
"""

from __future__ import annotations

from ndtrain.config import JobConfig

_PARALLEL_KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "zero", "sequence_parallel", "pp_schedule",
                  "pp_virtual_stages", "activation_checkpoint", "pp_microbatches")


def apply_auto_layout(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """Overwrite cfg.parallel's degrees (and train.micro_batch) with the planner's best layout;
    returns the planner's choice with its prediction, or None when auto is off."""
    if not cfg.parallel.auto:
        return None
    from ndtrain.planner.api import auto_layout

    options = sorted({1, 2, 4, 8, cfg.train.micro_batch})
    choice = auto_layout(cfg.model, world_size, cfg.data.seq_len, cfg.train.global_batch,
                         micro_batch_options=options, hardware_profile=hardware_profile,
                         precision=cfg.parallel.mixed_precision)
    for key in _PARALLEL_KEYS:
        if key in choice:
            setattr(cfg.parallel, key, choice[key])
    if cfg.parallel.pp == 1:
        cfg.parallel.pp_virtual_stages = 1
    cfg.train.micro_batch = int(choice["micro_batch"])
    return choice


def describe(choice: dict) -> str:
    degrees = " ".join(f"{k}={choice[k]}" for k in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep") if choice[k] > 1)
    return (f"{degrees or 'single'} mb={choice['micro_batch']} ac={choice['activation_checkpoint']}"
            f"{' ' + choice['pp_schedule'] if choice['pp'] > 1 else ''}: predicted "
            f"{choice['predicted_step_time']:.3f} s/step, {choice['predicted_tokens_per_s']:,.0f} tokens/s "
            f"on {choice['hardware']}")
