"""The planner's choices behind a Plan (plan.py assembles them): the host probe's CPU defaults, the
layout (`auto`, or `dp_auto`'s data-parallel flavour alone) and `compile_auto`. Each reads a
config and returns what it would set, as {section: {key: value}} overrides; none changes the
config it is given (plan.py applies them, in this order, to its own copy)."""

from __future__ import annotations

import copy
import os
import sys

from ndtrain.config import JobConfig
from ndtrain.errors import NdtrainError
from ndtrain.launch_env import rank


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


def planned_for(cfg: JobConfig, hardware_profile=None):
    """The hardware a planning call prices: the caller's, else what auto_hardware finds."""
    return hardware_profile if hardware_profile is not None else auto_hardware(cfg)


def on_cpu(cfg: JobConfig) -> bool:
    import torch

    return cfg.train.device == "cpu" or not torch.cuda.is_available()


# How far an uncalibrated CPU plan's step time may be off the measured one, as measured:
# 5.2x with the old defaults on an AMX host; with the probe's rates (CPU time, so a busy host does
# not slow them), 1.84 s predicted against 1.6 s of CPU and 3.4-4.7 s of wall time per step on the
# AMD host of docs/results/benchmarks.md, whose other tenants took most of its two cores.
UNCALIBRATED_ERROR = "off by up to ~2x, more on a host busy with other work"


def uncalibrated(cfg: JobConfig, hardware_profile=None) -> str:
    """'' where the plan priced calibrated (or catalog) hardware; else what the printed
    prediction is worth, for the line that sets it beside the measured step."""
    from ndtrain.planner.api import _hardware

    try:
        hw = _hardware(planned_for(cfg, hardware_profile))
    except NdtrainError:
        return ""
    if hw.calibrated:
        return ""
    what = "the host probe's compute rates" if "host probe" in hw.description else "default rates"
    return (f"uncalibrated: {what}, host and collective costs assumed, {UNCALIBRATED_ERROR}; "
            f"`ndtrain calibrate` measures them")


# ---- the host probe's CPU defaults -----------------------------------------------------------

FP8_WARNED_ENV = "NDTRAIN_FP8_WARNED"

# bf16 by default only where the planner predicts at least this speed-up over fp32: below it the
# exactness of fp32 is worth more than the time (docs/results/benchmarks.md has the figures).
BF16_SPEEDUP = 1.5


def host_choice(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """CPU ranks: the defaults that depend on the host, from its cached probe (never measured
    here; plan.py measures it in the launching process): the bf16 attention dtype, `cpu_matmul`
    (unless given), the precision (unless given: bf16 where the CPU has bf16 matmuls and the
    planner predicts bf16 BF16_SPEEDUP faster), and a one-line warning when fp8 runs where it is
    emulated. {"probe", "cpu_matmul", "bf16_attention", "precision"?, "overrides"}; None where no
    probe is cached."""
    from ndtrain.planner.hardware import host_probe

    probe = host_probe()
    if probe is None:
        return None
    from ndtrain.planner.host_cache import bf16_attention, summary

    found, p = probe["decisions"], cfg.parallel
    matmul = found["cpu_matmul"] if p.cpu_matmul_auto else p.cpu_matmul
    out = {"probe": summary(probe), "cpu_matmul": matmul, "bf16_attention": bf16_attention(found, cfg.model.head_dim),
           "overrides": {"parallel": {"cpu_matmul": matmul}}}
    precision = p.mixed_precision
    if p.mixed_precision_auto:
        out["precision"] = _precision_choice(cfg, world_size, hardware_profile, found["native_bf16"], matmul)
        precision = out["precision"]["precision"]
        out["overrides"]["parallel"]["mixed_precision"] = precision
    if precision == "fp8" and found["fp8_emulated"] and rank() == 0 \
            and not os.environ.get(FP8_WARNED_ENV):
        os.environ[FP8_WARNED_ENV] = "1"  # once: in this process, and in the workers a launcher starts
        print(f"warning: fp8 matmuls are emulated on this CPU (torch._scaled_mm at {100 * found['fp8_ratio']:.2g}% of "
              f"bf16's rate, host probe): an fp8 run is far slower than bf16; mixed_precision = \"bf16\" trains "
              f"the same model at bf16's speed", file=sys.stderr, flush=True)
    return out


def _precision_choice(cfg: JobConfig, world_size: int, hardware_profile, native_bf16: bool, matmul: str) -> dict:
    """{"precision", "speedup" (predicted fp32 / bf16 step time, or None), "description"}."""
    if not native_bf16:
        return {"precision": "fp32", "speedup": None,
                "description": "precision fp32: this CPU has no bf16 matmuls (avx512_bf16 / amx_bf16)"}
    steps = {mp: _predicted_step(cfg, world_size, hardware_profile, mp, matmul) for mp in ("fp32", "bf16")}
    if None in steps.values():
        return {"precision": "fp32", "speedup": None,
                "description": "precision fp32: the planner cannot price this layout in both precisions"}
    speedup = steps["fp32"] / steps["bf16"]
    pick = "bf16" if speedup >= BF16_SPEEDUP else "fp32"
    return {"precision": pick, "speedup": speedup,
            "description": f"precision {pick}: the planner predicts bf16 {speedup:.2f}x fp32 on this host "
                           f"({steps['fp32']:.3f} vs {steps['bf16']:.3f} s/step; bf16 from {BF16_SPEEDUP}x)"}


def _predicted_step(cfg: JobConfig, world_size: int, hardware_profile, precision: str, matmul: str) -> float | None:
    """The step the run would take in `precision`: the layout the planner would choose for it
    (auto or the defaults' data-parallel flavour), else the configured one."""
    from ndtrain.layout import fill_degrees, from_config
    from ndtrain.planner.api import predict_step_time

    trial = copy.deepcopy(cfg)
    trial.parallel.mixed_precision, trial.parallel.cpu_matmul = precision, matmul
    try:
        choice = layout_choice(trial, world_size, hardware_profile)
        if choice is not None:
            return choice["predicted_step_time"]
        lay = fill_degrees(from_config(trial.parallel, trial.train, trial.data), world_size)
        return predict_step_time(trial.model, lay.as_dict(), trial.data.seq_len, trial.train.global_batch,
                                 planned_for(trial, hardware_profile), world=world_size, precision=precision)
    except NdtrainError:
        return None


def host_text(host: dict | None) -> str:
    if not host:
        return ""
    return (f"; host probe: cpu_matmul {host['cpu_matmul']}, bf16 attends in {host['bf16_attention']}"
            + (f"; {host['precision']['description']}" if "precision" in host else ""))


# ---- the layout ------------------------------------------------------------------------------

def layout_choice(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """`auto`: the planner's best layout for `world_size` ranks on this machine; else, with
    `dp_auto`, the data-parallel flavour alone (dp_choice). The planner's dict with "overrides"
    and a one-line "description"; None where nothing is chosen."""
    if not cfg.parallel.auto:
        return dp_choice(cfg, world_size, hardware_profile) if cfg.parallel.dp_auto else None
    from ndtrain.layout import from_config
    from ndtrain.planner.api import auto_layout

    options = sorted({1, 2, 4, 8, cfg.train.micro_batch})
    choice = auto_layout(cfg.model, world_size, cfg.data.seq_len, cfg.train.global_batch,
                         micro_batch_options=options, hardware_profile=planned_for(cfg, hardware_profile),
                         precision=cfg.parallel.mixed_precision,
                         base=from_config(cfg.parallel, cfg.train, cfg.data))
    return {**choice, "description": choice_text(choice)}


# The [parallel] keys (and the planner's fields of the same names) the defaults' choice sets
DP_FIELDS = ("dp_replicate", "dp_shard", "zero", "reshard_after_forward")


def dp_choice(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """The defaults' data-parallel flavour: the planner's fastest of DDP, HSDP and ZeRO-1/2/3 over
    the ranks tp x cp leave, every other knob (degrees, micro-batch, recompute, precision) as
    configured. For a model that fits, on few ranks, fewer collectives win (DDP here, measured in
    docs/results/benchmarks.md); on a large model only ZeRO-3 fits and is chosen. None (the static
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
        hw = planned_for(cfg, hardware_profile)
        choice = auto_layout(cfg.model, world_size, cfg.data.seq_len, cfg.train.global_batch,
                             micro_batch_options=[cfg.train.micro_batch], hardware_profile=hw,
                             precision=cfg.parallel.mixed_precision, ac_options=(p.activation_checkpoint,),
                             base=from_config(p, cfg.train, cfg.data),
                             fixed={"tp": p.tp, "cp": p.cp, "pp": 1, "ep": p.ep, "micro_batch": cfg.train.micro_batch})
    except NdtrainError:
        return None  # nothing fits the planner's memory model: the static default, as before
    return {**choice, "overrides": {"parallel": {key: choice[key] for key in DP_FIELDS}},
            "description": "data parallel (defaults): " + choice_text(choice)}


def choice_text(choice: dict) -> str:
    return (f"{choice['layout'].short()} (as text: {choice['layout'].text()}): predicted "
            f"{choice['predicted_step_time']:.3f} s/step, {choice['predicted_tokens_per_s']:,.0f} tokens/s "
            f"on {choice['hardware']}")


# ---- compile_auto ----------------------------------------------------------------------------

def compile_auto_choice(cfg: JobConfig, world_size: int, hardware_profile=None) -> dict | None:
    """`[parallel] compile_auto`: whether compiling the blocks repays its cold compile within
    train.steps on this machine (planner/compile_choice.py), for the layout cfg holds; the
    decision, or None (compile left as set) where the planner cannot price it."""
    from ndtrain.layout import fill_degrees, from_config
    from ndtrain.planner.api import compile_decision

    try:
        hw = planned_for(cfg, hardware_profile)
        lay = fill_degrees(from_config(cfg.parallel, cfg.train, cfg.data), world_size)
        return compile_decision(cfg.model, lay, cfg.data.seq_len, cfg.train.global_batch, cfg.train.steps, hw,
                                precision=lay.mixed_precision)
    except NdtrainError:  # an unresolvable layout, a GPU the catalog lacks: compile as configured
        return None
