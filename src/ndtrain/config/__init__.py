"""Typed job configuration: a dataclass per section, loaded from TOML with `--section.key=value`
overrides. Each section's values are checked against its annotations by pydantic (strict), then
by config/checks.py and the layout's rules, so a bad value fails with one message naming its key;
the resolved config is written back with tomli_w. [parallel]'s layout keys are not declared here:
they are ndtrain.layout.Layout's fields. `ndtrain config show` and `config check` live in
tools/config_check.py."""

from __future__ import annotations

import codecs
import dataclasses
import functools
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ndtrain.config.checks import TRACKERS, check_job_config, layout_batches
from ndtrain.errors import ConfigError, NdtrainError, pydantic_problem
from ndtrain.layout.degrees import reshard_default, section_fields
from ndtrain.model.config import PRESETS, ModelConfig

__all__ = ["DataConfig", "OptimizerConfig", "ParallelConfig", "TrainConfig", "CheckpointConfig", "LoggingConfig",
           "ResilienceConfig", "JobConfig", "SECTIONS", "TRACKERS", "DP_CHOICE_KEYS", "load_config", "check_job_config",
           "layout_batches", "parse_value", "parse_overrides", "to_dict", "to_toml", "from_dict"]


@dataclass
class DataConfig:
    path: str = "data/stdlib-byte"  # prepared directory (token shards + manifest.json); with mix, their parent
    sources: list[str] = field(default_factory=list)  # empty = the Python standard library
    tokenizer: Literal["byte", "bpe"] = "byte"
    vocab_size: int = 8192  # for bpe
    max_mb: float = 16.0  # cap on the default corpus, in MB of text
    seq_len: int = 256
    # Attention stays inside each document of a packed sequence; RoPE positions restart per document.
    document_mask: bool = False
    # [[name, weight], ...]: sample from several prepared corpora <path>/<name> in these proportions.
    mix: list = field(default_factory=list)
    prefetch: int = 2  # batches built ahead on a background thread (0 = off)


@dataclass
class OptimizerConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    schedule: Literal["cosine", "constant"] = "cosine"
    # The schedule of a resume that finds train.steps changed, said in one line there: stretch,
    # keep, decay or restart (train/optim.py EXTEND says what each does; docs/checkpoints.md).
    extend: Literal["stretch", "keep", "decay", "restart"] = "stretch"
    # The learning rate where train.batch_ramp changes the global batch: lr (tuned at
    # train.global_batch) times (batch / global_batch) ** 0.5 (sqrt), ** 1 (linear) or 1 (none);
    # train/optim.py batch_lr_scale; docs/batch-size.md. "none" by default: a run (or a checkpoint)
    # with a batch_ramp from before this key keeps the rates it trained at.
    batch_lr_rule: Literal["sqrt", "linear", "none"] = "none"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    # fused: one kernel per parameter group (CPU and CUDA, plain and DTensor parameters); on the
    # CPU it halved the optimizer's time against foreach (benchmarks/breakdown.py), same update
    # to rounding (~1e-7 per step).
    implementation: Literal["foreach", "fused", "for-loop"] = "fused"


# The layout's keys of [parallel], generated from ndtrain.layout's one field list (Layout: type,
# default and config key of each; the renamed few keep their config names here).
_LayoutKeys = dataclasses.make_dataclass("_LayoutKeys", section_fields("parallel"), namespace={"__module__": __name__})


@dataclass
class ParallelConfig(_LayoutKeys):
    """[parallel]: the layout (every key of ndtrain.layout.Layout that lives here, under its config
    name: dp_shard, sequence_parallel, pp_schedule, ...) and the keys below, which say who chooses
    it and the outer optimizer's, which are no part of a layout."""

    # Unless `mixed_precision` is given, `ndtrain train` on CPU ranks trains in bf16 where the host
    # has bf16 matmuls in hardware and the planner, from the host probe's rates, predicts bf16 at
    # least 1.5x faster than fp32 (train/plan_choices.py; the planner's start-up line says why).
    mixed_precision_auto: bool = True
    # Unless `compile` is given, `ndtrain train` turns it on when the planner predicts it repays its
    # cold compile within train.steps (planner/compile_choice.py; the start-up log gives the sums).
    compile_auto: bool = True
    # Unless `cpu_matmul` is given, `ndtrain train` takes the host probe's choice: oneDNN only
    # where its fp32 linears measured faster than the BLAS on this host (planner/host_cache.py).
    cpu_matmul_auto: bool = True
    auto: bool = False  # let the planner choose the whole layout for this world size
    # With no data-parallel key given (DP_CHOICE_KEYS), `ndtrain train` lets the planner choose
    # the data-parallel flavour - DDP, HSDP or ZeRO-1/2/3 - over the ranks tp x cp leave, for this
    # model, micro-batch and machine; every other knob stays as set. load_config turns it off
    # when one of those keys is given (unless dp_auto is too); false keeps the static default
    # (ZeRO-3 over every rank).
    dp_auto: bool = True
    # What auto plans for: "" = this machine (the GPU model from torch.cuda, mapped to the
    # planner's catalog; the calibrated profile on CPU), a catalog name (h100, a100-80, ...) or a
    # hardware profile JSON written by `ndtrain calibrate`.
    auto_hardware: str = ""
    # DiLoCo's outer SGD (replicate_sync = "diloco"): lr 1 without momentum averages the replicas
    # every H steps. The paper's lr 0.7, Nesterov 0.9 suits long rounds (H ~ 500); at H <= 32 here
    # it lost 25-40% (docs/results/benchmarks.md). Checked in check_job_config(), not by the layout
    # rules.
    diloco_outer_lr: float = 1.0
    diloco_outer_momentum: float = 0.0  # Nesterov momentum
    # Uneven data-parallel shares (layout/batch_shares.py; docs/heterogeneous.md): one weight per
    # data-parallel rank, its rows of every global batch in proportion ([] = equal slices). Every
    # rank runs the same number of micro-batches, of at most train.micro_batch rows.
    batch_shares: list[float] = field(default_factory=list)
    # Who sets the shares: "off" (batch_shares as given), "plan" (the planner's per-kind speeds of
    # `gpus`), "measured" (each rank's measured compute time, re-balanced at checkpoint
    # boundaries when the slowest rank's busy time is more than balance_threshold over the mean).
    balance: Literal["off", "plan", "measured"] = "off"
    balance_threshold: float = 0.1
    # balance = "plan": the GPU kind of each data-parallel rank in rank order, as `ndtrain plan
    # --gpus` spells a pool: "1xh100,1xa100-80" (counts are data-parallel ranks, summing to dp).
    gpus: str = ""


@dataclass
class TrainConfig:
    steps: int = 200
    # > 0: train the steps the planner predicts fit in this many seconds on this machine, at most
    # `steps` (train/run_length.py; docs/launch.md); 0: exactly `steps`.
    time_budget_s: float = 0.0
    # The fewest steps a time budget may cut the run to: below it a model learns too little to be
    # worth the wait, so a slow host trains this many and says how long that takes.
    time_budget_min_steps: int = 1
    global_batch: int = 32  # sequences per optimizer step, across all data-parallel ranks
    micro_batch: int = 8  # sequences per rank per forward/backward
    # [[tokens_seen, global_batch], ...], or "auto": the batch doubles from global_batch toward the
    # measured gradient noise scale at checkpoint boundaries, up to batch_auto_max (docs/batch-size.md).
    batch_ramp: list[list[int]] | Literal["auto"] = field(default_factory=list)
    batch_auto_max: int = 0  # "auto"'s largest global batch: global_batch times a power of two
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    autocast_bf16: bool = False
    output_dir: str = ""  # default runs/<config-name>-<timestamp>
    # A fresh run in a directory that holds another run's checkpoints or metrics is refused;
    # true moves the old run aside (to <output_dir>.replaced-<time>/) instead. Nothing is deleted.
    overwrite: bool = False
    val_interval: int = 50
    val_batches: int = 4
    # Sequences per validation batch, across ranks: validation evaluates val_batches x
    # val_batch_size fixed windows whatever global_batch and the layout (docs/data.md).
    val_batch_size: int = 16
    log_interval: int = 1
    timeout_s: float = 300.0  # collective timeout
    step_deadline_s: float = 0.0  # watchdog: abort a rank whose step exceeds this (0 = off)
    # Every rank runs Python's garbage collector after each gc_every-th step, none in between
    # (train/gc_schedule.py); 0 leaves the automatic collector on.
    gc_every: int = 50
    nonfinite_skip: int = 3  # consecutive non-finite steps tolerated before rolling back
    straggler_threshold: float = 0.25  # name a rank this much slower than the median (0 = off)
    straggler_window: int = 20  # steps per straggler comparison (resilience.straggler_windows in a row name a rank)
    sample_prompt: str = "def "
    sample_tokens: int = 200


@dataclass
class CheckpointConfig:
    interval_steps: int = 0  # 0 = only at the end
    async_: bool = False  # TOML key "async"
    keep_last: int = 2
    keep_every: int = 0
    resume: str = ""  # "" (never), "auto", or a path
    dir: str = ""  # default <output_dir>/checkpoints
    # Model keys a resume may find changed (a fine-tune, e.g. ["rope_theta"]); any other change
    # to what the weights compute is refused (model/config.py's FUNCTION_KEYS).
    allow_model_change: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    # Where rank 0 sends the scalar metrics besides metrics.jsonl (always written). wandb runs
    # offline and mlflow into a file store under the run directory unless told otherwise.
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    tensorboard: bool = True  # false drops "tensorboard" from trackers (the key predates trackers)
    progress: Literal["auto", "on", "off"] = "auto"  # auto: only on a TTY
    project: str = "ndtrain"  # W&B project and MLflow experiment name
    wandb_mode: Literal["offline", "online"] = "offline"
    mlflow_uri: str = ""  # "" = file store <run dir>/mlruns; or a tracking server / database URI
    # pp > 1: time every rank's F/B/W actions during this step and keep the timeline in the run
    # directory (pipeline_trace.json) for `ndtrain report`'s Gantt chart; 0 = never.
    pipeline_trace_step: int = 3


ExclusionPolicy = Literal["log", "exclude"]


@dataclass
class ResilienceConfig:
    # What a run does about a rank that keeps straggling or a host that keeps failing
    # (docs/self-healing.md). log: name it (as always); exclude: save, take that rank's host out
    # of torchrun's elastic rendezvous and let the others re-form, re-planned for their world.
    on_straggler: ExclusionPolicy = "log"
    straggler_windows: int = 3  # K: slow in this many train.straggler_window windows running
    # The same for a host whose ranks failed (died without a word) or hung (train.step_deadline_s)
    # `failures` times within `failure_window_s`: exclude takes it out at the start of the next attempt.
    on_failure: ExclusionPolicy = "log"
    failures: int = 3
    failure_window_s: float = 3600.0
    min_world: int = 1  # no exclusion leaves fewer ranks than this
    # true: an agent that joins the rendezvous again (an excluded host back, or a new one) is taken
    # in: torch elastic stops the workers with SIGTERM, they finish the step and save, and the run
    # re-plans for the larger world. false: a host this run excluded is excluded again at once.
    grow_back: bool = True


@dataclass
class JobConfig:
    name: str = "debug"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)


SECTIONS = [f.name for f in dataclasses.fields(JobConfig) if f.name != "name"]
_RENAMED = {"async": "async_"}  # TOML keys that are Python keywords


def _field_key(key: str) -> str:
    return _RENAMED.get(key, key)


def _toml_key(key: str) -> str:
    return {v: k for k, v in _RENAMED.items()}.get(key, key)


@functools.cache
def _validator(cls):
    """pydantic's strict validator of a section's keys, from the dataclass's own annotations:
    bools are true/false, ints are not bools or floats, floats are finite (ints widen), strings
    are strings, lists hold their element type, Literal keys one of their values."""
    from pydantic import TypeAdapter
    from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only from Python 3.12

    hints = typing.get_type_hints(cls, include_extras=True)
    keys = TypedDict(f"{cls.__name__}Keys", {f.name: hints[f.name] for f in dataclasses.fields(cls)}, total=False)
    keys.__pydantic_config__ = {"strict": True, "allow_inf_nan": False}
    return TypeAdapter(keys)


def _apply(obj, section: str, values: dict):
    names = {f.name for f in dataclasses.fields(obj)}
    given = {}
    for key, value in values.items():
        if _field_key(key) not in names:
            known = ", ".join(sorted(_toml_key(n) for n in names))
            raise ConfigError(f"{section}.{key}", f"unknown key (known keys in [{section}]: {known})")
        given[_field_key(key)] = value
    from pydantic import ValidationError

    try:
        checked = _validator(type(obj)).validate_python(given)
    except ValidationError as exc:  # the first error, as one line naming its key
        name, what, value = pydantic_problem(exc)
        head = name.split("[")[0]
        if exc.errors()[0]["type"] == "literal_error":  # the vocabulary as the layout rules spell it
            what = f"one of {', '.join(typing.get_args(typing.get_type_hints(type(obj))[head]))}"
        raise ConfigError(f"{section}.{_toml_key(head)}{name[len(head):]}", f"must be {what}, got {value!r}") from None
    for key, value in checked.items():
        setattr(obj, key, value)


def parse_value(text: str):
    """A command-line value is parsed as TOML when it is valid TOML, else taken as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, dict]:
    """`--section.key=value` or `--section.key value` -> {section: {key: value}}."""
    out: dict[str, dict] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise NdtrainError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        if "=" in arg:
            dotted, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(arg[2:], "override has no value")
            dotted, text = arg[2:], args[i + 1]
            i += 2
        section, key = dotted.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(dotted, f"unknown section [{section}] (sections: {', '.join(SECTIONS)})")
        out.setdefault(section, {})[key] = parse_value(text)
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in extra.items():
        if isinstance(values, dict):
            if not isinstance(merged.setdefault(section, {}), dict):
                raise ConfigError(section, f"must be a table, got {merged[section]!r}")
            merged[section].update(values)
        else:
            merged[section] = values
    return merged


ZERO2_CHANGED = ("zero = 2 now means ZeRO-2 in the paper's sense (gradients and optimizer state sharded, parameters "
                 "replicated); it used to mean zero = 3 keeping gathered parameters until backward. Say which you "
                 "want: add reshard_after_forward = false to keep zero = 2 (ZeRO-2), or set zero = 3 with "
                 "reshard_after_forward = false (the old behaviour)")


def _zero_meaning(raw: dict, translate: bool) -> None:
    """`zero = 2` changed meaning: a config that sets it without `reshard_after_forward` was
    written for the old one, and must not silently train differently. A user's file or override
    is refused with the choice spelt out; a stored config (a checkpoint's, translate=True) is read
    with the meaning it was written with."""
    par = raw.get("parallel")
    if not isinstance(par, dict) or par.get("zero") != 2 or "reshard_after_forward" in par:
        return
    if not translate:
        raise ConfigError("parallel.zero", ZERO2_CHANGED)
    par.update(zero=3, reshard_after_forward=False)


def read_config_text(path: Path) -> str:
    """A config file's text: UTF-8, or what a byte-order mark says (PowerShell's `>` writes UTF-16
    with one, Notepad wrote UTF-8 with one); anything else is one line naming the file."""
    data = path.read_bytes()
    boms = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
    encoding = next((enc for bom, enc in boms if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise NdtrainError(f"{path}: not {encoding.upper().replace('-SIG', '')} text (byte {exc.start}); save the "
                           f"config as UTF-8") from None


# Keys that choose the data-parallel flavour: any one given turns [parallel] dp_auto off.
DP_CHOICE_KEYS = ("dp_replicate", "dp_shard", "zero", "reshard_after_forward", "replicate_sync", "auto")
# Each planner choice ("<x>_auto") and the keys whose explicit value makes it: the user (or a
# stored config) said, so the planner does not choose, unless the flag itself is given too.
AUTO_FLAGS = {"dp_auto": DP_CHOICE_KEYS, "compile_auto": ("compile",), "mixed_precision_auto": ("mixed_precision",),
              "cpu_matmul_auto": ("cpu_matmul",)}


def load_config(path: str | None = None, overrides: list[str] | dict | None = None,
                stored: bool = False) -> JobConfig:
    """The job config from a TOML file and overrides, validated. stored=True reads a config
    written by ndtrain itself (a checkpoint's), whose keys may predate a change of meaning."""
    raw: dict = {}
    name = "debug"
    if path:
        p = Path(path)
        if not p.is_file():
            raise NdtrainError(f"config file not found: {path}")
        try:
            raw = tomllib.loads(read_config_text(p))
        except tomllib.TOMLDecodeError as exc:
            raise NdtrainError(f"{path}: not valid TOML: {exc}") from None
        name = p.stem
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    raw = _merge(raw, overrides or {})
    _zero_meaning(raw, translate=stored)
    cfg = JobConfig(name=raw.pop("name", name) if isinstance(raw.get("name"), str) else name)
    raw.pop("name", None)
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(section, f"unknown section (sections: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(section, "must be a table")
        if section == "model":
            values = dict(values)
            preset_name = values.pop("preset", "debug")
            if preset_name not in PRESETS:
                raise ConfigError("model.preset", f"unknown preset {preset_name!r} (presets: {', '.join(PRESETS)})")
            cfg.model = ModelConfig(preset=preset_name, **PRESETS[preset_name])
        _apply(getattr(cfg, section), section, values)
    given = raw.get("parallel") if isinstance(raw.get("parallel"), dict) else {}
    for flag, keys in AUTO_FLAGS.items():
        if flag not in given and any(key in given for key in keys):
            setattr(cfg.parallel, flag, False)
    if "reshard_after_forward" not in given:  # the knob follows the stage (layout/degrees.py)
        cfg.parallel.reshard_after_forward = reshard_default(cfg.parallel.zero)
    check_job_config(cfg)
    return cfg


def to_dict(cfg: JobConfig) -> dict:
    out = {"name": cfg.name}
    for section in SECTIONS:
        out[section] = {_toml_key(k): v for k, v in dataclasses.asdict(getattr(cfg, section)).items()}
    return out


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (what a run directory's config.toml holds); it loads back as is."""
    import tomli_w

    return tomli_w.dumps(to_dict(cfg))


def from_dict(d: dict) -> JobConfig:
    """Rebuild a JobConfig from `to_dict` output (e.g. the config stored in a checkpoint)."""
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    return load_config(None, d, stored=True)
