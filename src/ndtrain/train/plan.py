"""A job resolved once, before the trainer: `resolve_plan(cfg, world)` turns the config, the world
size and the machine into a `Plan`: the checked Layout the run builds, the config it trains with
(a copy; the caller's is never changed), and what the planner chose and why. `ndtrain train` and
the Python API `ndtrain.train.trainer.train(cfg)` both call it, so they build the same run.

What it decides, each only where the config leaves it open (the `*_auto` keys, on by default):
- on CPU ranks, from the host probe's cached rates: `cpu_matmul`, the precision, the dtype bf16
  attention runs in (the probe itself is measured once per host, by the process that starts the
  ranks, never by a worker: every rank then reads the same file and decides alike);
- `auto`: the planner's whole layout (degrees, ZeRO stage, schedule, v, pipeline micro-batches,
  stage split, recompute, micro-batch), for this world and machine;
- `dp_auto` (no data-parallel key given): the data-parallel flavour alone;
- `compile_auto`: whether compiling the blocks repays its cold compile within train.steps;
- `train.time_budget_s` (> 0): the steps the predicted step time fits in it, at most train.steps
  (run_length.py), before compile_auto weighs its cold compile against them.
It runs at every (re)start, so an elastic restart on fewer ranks gets a plan for the new world;
resume-anywhere checkpoints make the change of layout safe. The planner is pure and the hardware
profile a file, so every rank resolves the same plan.

Why here, in train/: resolving needs torch (which GPU this is; whether the run is on CPU) and the
host probe's measurement (host_probe.py), so it cannot sit in the torch-free planner/ or layout/;
train/ may import the planner, and both entry points live in train/ (command.py, trainer.py). It
used to be tools/auto.py, handed down six calls as a callback that only the CLI passed: the
Python API then built the static ZeRO-3 where `ndtrain train` chose DDP.

The machine: `[parallel] auto_hardware` when set (a catalog name or a profile JSON); else the GPU
model torch.cuda reports, mapped to the planner's catalog; else (CPU) the profile `ndtrain
calibrate` wrote, or the host probe's rates.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from ndtrain.config import JobConfig
from ndtrain.errors import ConfigError
from ndtrain.launch_env import given_a_rank
from ndtrain.layout import Layout
from ndtrain.parallel import dims as pdims
from ndtrain.train import plan_choices as choices


@dataclass(frozen=True)
class StepPrice:
    """The planner's price of the layout it chose."""

    step_s: float  # seconds per optimizer step: the compiled step where compile_auto turned compile on
    tokens_per_s: float
    hardware: str  # what it priced
    uncalibrated: str = ""  # '' on calibrated (or catalog) hardware; else how far off it may be


@dataclass(frozen=True)
class CompileChoice:
    """`compile_auto`'s decision and its sums (planner/compile_choice.py)."""

    compile: bool
    eager_step_s: float
    compiled_step_s: float
    compile_s: float  # the run's cold compile
    breakeven_steps: int | None  # None: compiling saves nothing
    steps: int
    description: str


@dataclass(frozen=True)
class HostChoice:
    """What the host probe chose for CPU ranks."""

    probe: str  # one line: what it measured
    cpu_matmul: str  # the Linear layers' fp32 kernel the run uses (the probe's, unless given)
    bf16_attention: str  # the dtype a bf16 model attends in: fp32 | bf16
    precision: str = ""  # the precision it chose ('' where mixed_precision was given)
    precision_speedup: float | None = None  # predicted fp32 / bf16 step time
    precision_why: str = ""


@dataclass(frozen=True)
class Plan:
    world: int
    layout: Layout  # resolved for `world` and checked by ndtrain.layout's rules
    config: JobConfig = dataclasses.field(repr=False)  # what the run trains with: the caller's + `chosen`
    chosen: tuple = ()  # ((section, key, value), ...): what the planner set over the caller's config
    explanation: str = ""  # the start-up line of a chosen layout ('' where none was chosen)
    prediction: StepPrice | None = None  # set where the planner chose the layout
    compile: CompileChoice | None = None
    host: HostChoice | None = None
    budget: str = ""  # what train.time_budget_s made of train.steps ('' without a budget)

    def as_dict(self) -> dict:
        """For plan.json and the metrics' start row (the config itself is config.toml)."""
        out = {"world": self.world, "layout": self.layout.as_dict(), "layout_text": self.layout.text(),
               "mesh": self.layout.describe(), "chosen": {f"{s}.{k}": v for s, k, v in self.chosen},
               "explanation": self.explanation, "budget": self.budget}
        for name in ("prediction", "compile", "host"):
            value = getattr(self, name)
            out[name] = dataclasses.asdict(value) if value is not None else None
        return out


def resolve_plan(cfg: JobConfig, world: int, hardware=None, *, measure_host: bool = True) -> Plan:
    """The Plan for `world` ranks on this machine (`hardware`: what to price instead, as
    `[parallel] auto_hardware` takes it). `cfg` is left as it was. `measure_host`: measure the
    host probe where this host has none cached (CPU, not in a worker, no auto_hardware)."""
    work, parts = _choose(cfg, world, hardware, measure_host)
    return Plan(world=world, layout=_checked(work, world), config=work, **parts)


def as_written(cfg: JobConfig, world: int) -> Plan:
    """The plan of the config as written, no planner: what a Trainer built without a plan trains
    (the parity tests' fixed layouts). `auto` needs the planner and is refused."""
    if cfg.parallel.auto:
        raise ConfigError("parallel.auto", "parallel.auto needs the planner: train with `ndtrain train` or "
                                           "ndtrain.train.trainer.train(cfg), or build the Trainer with "
                                           "plan=ndtrain.train.plan.resolve_plan(cfg, world)")
    return Plan(world=world, layout=_checked(cfg, world), config=cfg)


def planned_config(cfg: JobConfig, world: int, hardware=None) -> JobConfig:
    """The config resolve_plan checks, before its check: `config check` lists every problem of
    it where a run stops at the first. Never measures the host."""
    return _choose(cfg, world, hardware, measure_host=False)[0]


def _checked(cfg: JobConfig, world: int) -> Layout:
    return pdims.checked_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len, cfg.train, cfg.data)


def _choose(cfg: JobConfig, world: int, hardware, measure_host: bool) -> tuple[JobConfig, dict]:
    """A copy of cfg with every choice applied, and the Plan's other fields."""
    work = copy.deepcopy(cfg)
    chosen: dict = {}

    def apply(overrides: dict) -> None:
        for section, values in overrides.items():
            for key, value in values.items():
                value = tuple(value) if isinstance(value, list) else value
                current = getattr(getattr(work, section), key)
                if (tuple(current) if isinstance(current, list) else current) != value:
                    chosen[(section, key)] = value
                setattr(getattr(work, section), key, list(value) if isinstance(value, tuple) else value)

    on_cpu = choices.on_cpu(cfg) and not cfg.parallel.auto_hardware
    if measure_host and on_cpu and not given_a_rank():  # a launcher's workers: their launcher probed
        from ndtrain.calibrate.host_probe import ensure

        ensure()
    host = choices.host_choice(work, world, hardware) if on_cpu else None
    if host is not None:
        apply(host.pop("overrides"))
    layout = choices.layout_choice(work, world, hardware)
    prediction, explanation = None, ""
    if layout is not None:
        apply(layout["overrides"])
        prediction = StepPrice(layout["predicted_step_time"], layout["predicted_tokens_per_s"], layout["hardware"],
                               choices.uncalibrated(work, hardware))
        explanation = layout["description"] + choices.host_text(host)
    budget = ""
    if work.train.time_budget_s > 0:
        from ndtrain.train import run_length

        step_s = prediction.step_s if prediction is not None else run_length.priced_step(work, world, hardware)
        fitted = run_length.budget_choice(work, step_s)
        apply(fitted["overrides"])
        budget = fitted["description"]
    compiled = choices.compile_auto_choice(work, world, hardware) if work.parallel.compile_auto else None
    if compiled is not None:
        apply({"parallel": {"compile": compiled["compile"]}})
        compiled = CompileChoice(**{f.name: compiled[f.name] for f in dataclasses.fields(CompileChoice)})
        if compiled.compile and prediction is not None:  # the step the run will take is the compiled one
            tokens = work.train.global_batch * work.data.seq_len / compiled.compiled_step_s
            prediction = dataclasses.replace(prediction, step_s=compiled.compiled_step_s, tokens_per_s=tokens)
            explanation += f"; compiled {compiled.compiled_step_s:.3f} s/step"
    host_choice = None
    if host is not None:
        precision = host.get("precision") or {}
        host_choice = HostChoice(host["probe"], host["cpu_matmul"], host["bf16_attention"],
                                 precision.get("precision", ""), precision.get("speedup"),
                                 precision.get("description", ""))
    parts = {"chosen": tuple((s, k, v) for (s, k), v in chosen.items()), "explanation": explanation,
             "prediction": prediction, "compile": compiled, "host": host_choice, "budget": budget}
    return work, parts


__all__ = ["Plan", "StepPrice", "CompileChoice", "HostChoice", "resolve_plan", "as_written", "planned_config"]
