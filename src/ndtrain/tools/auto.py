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

import os
import sys

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
    host = apply_host_choices(cfg, world_size, hardware_profile)
    choice = _layout_choice(cfg, world_size, hardware_profile)
    if choice is not None:
        choice["uncalibrated"] = _uncalibrated(cfg, hardware_profile)
        if host is not None:  # printed with the layout: what the host probe chose, and why
            choice["host"] = host
            choice["description"] += _host_text(host)
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


# How far an uncalibrated CPU plan's step time may be off the measured one, as seen (issue 29):
# 5.2x with the old defaults on an AMX host; with the probe's rates (CPU time, so a busy host does
# not slow them), 1.84 s predicted against 1.6 s of CPU and 3.4-4.7 s of wall time per step on the
# AMD host of docs/benchmarks.md, whose other tenants took most of its two cores.
UNCALIBRATED_ERROR = "off by up to ~2x, more on a host busy with other work"


def _uncalibrated(cfg: JobConfig, hardware_profile=None) -> str:
    """'' where the plan priced calibrated (or catalog) hardware; else what the printed
    prediction is worth, for the line that sets it beside the measured step."""
    from ndtrain.planner.api import _hardware

    try:
        hw = _hardware(_planned_for(cfg, hardware_profile))
    except NdtrainError:
        return ""
    if hw.calibrated:
        return ""
    what = "the host probe's compute rates" if "host probe" in hw.description else "default rates"
    return (f"uncalibrated: {what}, host and collective costs assumed, {UNCALIBRATED_ERROR}; "
            f"`ndtrain calibrate` measures them")


def _on_cpu(cfg: JobConfig) -> bool:
    import torch

    return cfg.train.device == "cpu" or not torch.cuda.is_available()


def plan_and_probe(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """`ndtrain train`'s planner: on CPU, the host probe first (cached: it runs once per host),
    measured in the process that launches the ranks (or the only one), never in a worker: every
    rank then reads the same file and decides alike. Workers started by another launcher
    without a cached probe keep the static defaults, all alike."""
    if _on_cpu(cfg) and "RANK" not in os.environ and not cfg.parallel.auto_hardware:
        from ndtrain.train.host_probe import ensure

        ensure()
    choice = apply_auto_layout(cfg, world_size, hardware_profile)
    from ndtrain.planner.hardware import host_probe

    probe = host_probe() if _on_cpu(cfg) and not cfg.parallel.auto_hardware else None
    if probe is None or (choice and "host" in choice):
        return choice
    # The bf16 attention kernel reaches the Trainer, which sets it on its model, with or without a
    # layout choice to print it beside.
    from ndtrain.planner.host_cache import bf16_attention

    return {**(choice or {}), "host": {"bf16_attention": bf16_attention(probe["decisions"], cfg.model.head_dim)}}


def apply_host_choices(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """CPU ranks: the defaults that depend on the host, from its cached probe (never measured
    here; see plan_and_probe): the bf16 attention dtype, `cpu_matmul` (unless given), the
    precision (unless given: bf16 where the CPU has bf16 matmuls and the planner predicts bf16
    BF16_SPEEDUP faster), and a one-line warning when fp8 runs where it is emulated. None where
    no probe is cached or the run is not on CPU."""
    from ndtrain.planner.hardware import host_probe

    probe = host_probe() if _on_cpu(cfg) and not cfg.parallel.auto_hardware else None
    if probe is None:
        return None
    from ndtrain.planner.host_cache import bf16_attention, summary

    chosen, p = probe["decisions"], cfg.parallel
    attend_in = bf16_attention(chosen, cfg.model.head_dim)  # the Trainer sets it on its model's attention
    if p.cpu_matmul_auto:
        p.cpu_matmul = chosen["cpu_matmul"]
    out = {"probe": summary(probe), "cpu_matmul": p.cpu_matmul, "bf16_attention": attend_in}
    if p.mixed_precision_auto:
        out["precision"] = _precision_choice(cfg, world_size, hardware_profile, chosen["native_bf16"])
        p.mixed_precision = out["precision"]["precision"]
    if p.mixed_precision == "fp8" and chosen["fp8_emulated"] and os.environ.get("RANK", "0") == "0" \
            and not os.environ.get(FP8_WARNED_ENV):
        os.environ[FP8_WARNED_ENV] = "1"  # once: in this process, and in the workers a launcher starts
        print(f"warning: fp8 matmuls are emulated on this CPU (torch._scaled_mm at {100 * chosen['fp8_ratio']:.2g}% of "
              f"bf16's rate, host probe): an fp8 run is far slower than bf16; mixed_precision = \"bf16\" trains "
              f"the same model at bf16's speed", file=sys.stderr, flush=True)
    return out


FP8_WARNED_ENV = "NDTRAIN_FP8_WARNED"

# bf16 by default only where the planner predicts at least this speed-up over fp32: below it the
# exactness of fp32 is worth more than the time (issue 29; docs/benchmarks.md has the figures).
BF16_SPEEDUP = 1.5


def _precision_choice(cfg: JobConfig, world_size: int, hardware_profile, native_bf16: bool) -> dict:
    """{"precision", "speedup" (predicted fp32 / bf16 step time, or None), "description"}."""
    if not native_bf16:
        return {"precision": "fp32", "speedup": None,
                "description": "precision fp32: this CPU has no bf16 matmuls (avx512_bf16 / amx_bf16)"}
    steps = {mp: _predicted_step(cfg, world_size, hardware_profile, mp) for mp in ("fp32", "bf16")}
    if None in steps.values():
        return {"precision": "fp32", "speedup": None,
                "description": "precision fp32: the planner cannot price this layout in both precisions"}
    speedup = steps["fp32"] / steps["bf16"]
    pick = "bf16" if speedup >= BF16_SPEEDUP else "fp32"
    return {"precision": pick, "speedup": speedup,
            "description": f"precision {pick}: the planner predicts bf16 {speedup:.2f}x fp32 on this host "
                           f"({steps['fp32']:.3f} vs {steps['bf16']:.3f} s/step; bf16 from {BF16_SPEEDUP}x)"}


def _predicted_step(cfg: JobConfig, world_size: int, hardware_profile, precision: str) -> float | None:
    """The step the run would take in `precision`: the layout the planner would choose for it
    (auto or the defaults' data-parallel flavour), else the configured one."""
    import copy

    from ndtrain.layout import from_config, resolve
    from ndtrain.planner.api import predict_step_time

    trial = copy.deepcopy(cfg)
    trial.parallel.mixed_precision = precision
    try:
        choice = _layout_choice(trial, world_size, hardware_profile)
        if choice is not None:
            return choice["predicted_step_time"]
        lay = resolve(from_config(trial.parallel, trial.train, trial.data), world_size)
        return predict_step_time(trial.model, lay.as_dict(), trial.data.seq_len, trial.train.global_batch,
                                 _planned_for(trial, hardware_profile), world=world_size, precision=precision)
    except NdtrainError:
        return None


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
            f"on {choice['hardware']}") + _host_text(choice.get("host"))


def _host_text(host: dict | None) -> str:
    if not host:
        return ""
    return (f"; host probe: cpu_matmul {host['cpu_matmul']}, bf16 attends in {host['bf16_attention']}"
            + (f"; {host['precision']['description']}" if "precision" in host else ""))


def train_main(argv: list[str]) -> int:
    """`ndtrain train`: the command lives with the trainer, which gets the planner from here
    (train/ sits below the planner glue and never imports it)."""
    from ndtrain.train.command import main

    return main(argv, plan=plan_and_probe)
