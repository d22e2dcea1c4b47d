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


def _planned_for(cfg: JobConfig, hardware_profile=None):
    """The hardware a planning call prices: the caller's, else what auto_hardware finds."""
    return hardware_profile if hardware_profile is not None else auto_hardware(cfg)


def apply_auto_layout(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """Overwrite cfg's layout keys with the planner's best layout for `world_size` ranks on this
    machine; returns the planner's choice with its prediction, or None when auto is off. With
    only `dp_auto` on (no data-parallel key given), the planner chooses the data-parallel flavour
    alone (apply_dp_choice). Then, with `compile_auto` on, whether to compile the blocks
    (apply_compile_choice): its decision is the returned dict's "compile" entry (the only one
    when no layout was chosen)."""
    choice = _layout_choice(cfg, world_size, hardware_profile)
    compiled = apply_compile_choice(cfg, world_size, hardware_profile) if cfg.parallel.compile_auto else None
    if compiled is None:
        return choice
    if choice is None:
        return {"compile": compiled}
    if compiled["compile"]:  # the step the run will take is the compiled one
        choice["predicted_step_time"] = compiled["compiled_step_s"]
        choice["predicted_tokens_per_s"] = cfg.train.global_batch * cfg.data.seq_len / compiled["compiled_step_s"]
        choice["description"] += f"; compiled {compiled['compiled_step_s']:.3f} s/step"
    return {**choice, "compile": compiled}


def _layout_choice(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    if not cfg.parallel.auto:
        return apply_dp_choice(cfg, world_size, hardware_profile) if cfg.parallel.dp_auto else None
    from ndtrain.layout import from_config
    from ndtrain.planner.api import auto_layout

    options = sorted({1, 2, 4, 8, cfg.train.micro_batch})
    hw = _planned_for(cfg, hardware_profile)
    choice = auto_layout(cfg.model, world_size, cfg.data.seq_len, cfg.train.global_batch,
                         micro_batch_options=options, hardware_profile=hw,
                         precision=cfg.parallel.mixed_precision,
                         base=from_config(cfg.parallel, cfg.train, cfg.data))
    for section, values in choice["overrides"].items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    choice["description"] = describe(choice)
    return choice


# The [parallel] keys (and the planner's fields of the same names) the defaults' choice sets
DP_FIELDS = ("dp_replicate", "dp_shard", "zero", "reshard_after_forward")


def apply_dp_choice(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """The defaults' data-parallel flavour: the planner's fastest of DDP, HSDP and ZeRO-1/2/3 over
    the ranks tp x cp leave, every other knob (degrees, micro-batch, recompute, precision) as
    configured. For a model that fits, on few ranks, fewer collectives win (DDP here, measured in
    docs/benchmarks.md); on a large model only ZeRO-3 fits and is chosen. None (the static
    default, ZeRO-3 over every rank) where there is nothing to choose or the planner cannot price
    the layout: one rank, a pipeline (its schedule owns the reduction), a degree left at -1, a
    recompute policy the planner does not model, or no layout that fits its memory model."""
    p = cfg.parallel
    degrees = (p.tp, p.cp, p.pp, p.ep)
    if world_size <= 1 or p.pp != 1 or min(degrees) < 1 or world_size % (p.tp * p.cp) \
            or p.activation_checkpoint not in ("none", "selective", "full"):
        return None
    from ndtrain.layout import from_config
    from ndtrain.planner.api import auto_layout

    try:  # a GPU the catalog lacks, or an unreadable profile: the static default, not an error
        hw = _planned_for(cfg, hardware_profile)
        choice = auto_layout(cfg.model, world_size, cfg.data.seq_len, cfg.train.global_batch,
                             micro_batch_options=[cfg.train.micro_batch], hardware_profile=hw,
                             precision=cfg.parallel.mixed_precision, ac_options=(p.activation_checkpoint,),
                             base=from_config(p, cfg.train, cfg.data),
                             fixed={"tp": p.tp, "cp": p.cp, "pp": 1, "ep": p.ep, "mb": cfg.train.micro_batch})
    except NdtrainError:
        return None  # nothing fits the planner's memory model: the static default, as before
    for key in DP_FIELDS:
        setattr(p, key, choice[key])
    choice["description"] = "data parallel (defaults): " + describe(choice)
    return choice


def apply_compile_choice(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """`[parallel] compile_auto`: set cfg.parallel.compile to whether compiling the blocks repays
    its cold compile within train.steps on this machine (planner/compile_choice.py), for the layout
    cfg now holds; returns the decision, or None (compile left as set) where the planner cannot
    price it."""
    from ndtrain.layout import from_config, resolve
    from ndtrain.planner.api import compile_decision

    p = cfg.parallel
    try:
        hw = _planned_for(cfg, hardware_profile)
        decision = compile_decision(cfg.model, resolve(from_config(p, cfg.train, cfg.data), world_size),
                                    cfg.data.seq_len, cfg.train.global_batch, cfg.train.steps, hw,
                                    precision=p.mixed_precision)
    except NdtrainError:  # an unresolvable layout, a GPU the catalog lacks: compile as configured
        return None
    if decision is not None:
        p.compile = decision["compile"]
    return decision


def describe(choice: dict) -> str:
    return (f"{choice['layout'].short()} (as text: {choice['layout'].text()}): predicted "
            f"{choice['predicted_step_time']:.3f} s/step, {choice['predicted_tokens_per_s']:,.0f} tokens/s "
            f"on {choice['hardware']}")


def train_main(argv: list[str]) -> int:
    """`ndtrain train`: the command lives with the trainer, which gets the planner from here
    (train/ sits below the planner glue and never imports it)."""
    from ndtrain.train.command import main

    return main(argv, plan=apply_auto_layout)
