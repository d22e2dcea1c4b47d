"""`[parallel] auto = true`: the planner lays out the run for the world size and the machine it
finds. Glue between the planner and the trainer, so it sits in tools/: the `ndtrain train` command
hands `apply_auto_layout` down to the trainer as its `plan`.

It runs at every (re)start, before the mesh exists, so an elastic restart on fewer ranks gets a
layout planned for the new world; resume-anywhere checkpoints make the change of layout safe.
Every rank computes the same answer (the planner is pure, the hardware profile is a file).

The machine: `[parallel] auto_hardware` when set (a catalog name or a profile JSON); else the GPU
model torch.cuda reports, mapped to the planner's catalog; else (CPU) the profile `ndtrain
calibrate` wrote. The planner's whole choice reaches the runtime: degrees, ZeRO stage,
schedule, v, pipeline micro-batches, stage split, recompute and the micro-batch.
"""

from __future__ import annotations

from ndtrain.config import JobConfig
from ndtrain.errors import NdtrainError


def auto_hardware(cfg: JobConfig):
    """What to plan for: a catalog name, a profile path, or None (the calibrated CPU profile)."""
    if cfg.parallel.auto_hardware:
        return cfg.parallel.auto_hardware
    import torch

    if cfg.train.device != "cpu" and torch.cuda.is_available():
        from ndtrain.planner.hardware import CATALOG, catalog_name

        name = torch.cuda.get_device_name(0)
        found = catalog_name(name, torch.cuda.get_device_properties(0).total_memory)
        if found is None:
            raise NdtrainError(f"[parallel] auto: the GPU {name!r} is not in the planner's catalog; set "
                               f"parallel.auto_hardware to the closest of {', '.join(CATALOG)} (or a profile JSON)")
        return found
    return None


def apply_auto_layout(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """Overwrite cfg's layout keys with the planner's best layout for `world_size` ranks on this
    machine; returns the planner's choice with its prediction, or None when auto is off."""
    if not cfg.parallel.auto:
        return None
    from ndtrain.layout import from_config
    from ndtrain.planner.api import auto_layout

    options = sorted({1, 2, 4, 8, cfg.train.micro_batch})
    hw = hardware_profile if hardware_profile is not None else auto_hardware(cfg)
    choice = auto_layout(cfg.model, world_size, cfg.data.seq_len, cfg.train.global_batch,
                         micro_batch_options=options, hardware_profile=hw,
                         precision=cfg.parallel.mixed_precision,
                         base=from_config(cfg.parallel, cfg.train, cfg.data))
    for section, values in choice["overrides"].items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    choice["description"] = describe(choice)
    return choice


def describe(choice: dict) -> str:
    return (f"{choice['layout'].short()} (as text: {choice['layout'].text()}): predicted "
            f"{choice['predicted_step_time']:.3f} s/step, {choice['predicted_tokens_per_s']:,.0f} tokens/s "
            f"on {choice['hardware']}")


def train_main(argv: list[str]) -> int:
    """`ndtrain train`: the command lives with the trainer, which gets the planner from here
    (train/ sits below the planner glue and never imports it)."""
    from ndtrain.train.command import main

    return main(argv, plan=apply_auto_layout)
