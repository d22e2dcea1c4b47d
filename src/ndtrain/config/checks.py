"""The job config's own checks: every key that needs no process group and no world size, and the
layout rules a world size cannot change. `config check --world N` (and the trainer, before any
process group exists) run the rest of the layout's rules for a given world.

Reads a JobConfig by its attributes and imports nothing of config/__init__.py, which calls it."""

from __future__ import annotations

from ndtrain.errors import ConfigError
from ndtrain.model.config import ARCHITECTURE_KEYS, FUNCTION_KEYS
from ndtrain.paths import component_problem

SWITCHABLE = tuple(k for k in FUNCTION_KEYS if k not in ARCHITECTURE_KEYS)  # checkpoint.allow_model_change

TRACKERS = ("tensorboard", "wandb", "mlflow")  # where [logging] trackers may send the metrics


def _mix_problem(mix: list) -> str | None:
    for entry in mix:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[0]
                and isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool) and entry[1] > 0):
            return f'must be a list of [name, weight] pairs with positive weights, e.g. [["web", 0.7], ["code", 0.3]]; got {entry!r}'
    names = [e[0] for e in mix]
    if len(set(names)) != len(names):
        return f"names must be unique, got {names}"
    for name in names:  # each is read from <data.path>/<name>: never from outside data.path
        if component_problem(name):
            return f"component names {component_problem(name)}"
    return None


def check_job_config(cfg) -> None:
    """Checks that need no process group and no world size. Types and vocabularies (the Literal
    annotations of config/__init__.py and layout/degrees.py) were checked as the values were read. `config check --world N` (and the
    trainer, before any process group exists) run the layout's rules for a given world."""
    for key, msg in cfg.model.validate():
        raise ConfigError(key, msg)
    d, o, t, p, c = cfg.data, cfg.optimizer, cfg.train, cfg.parallel, cfg.checkpoint
    checks = [
        # runs/<name>-<time> is the run directory when train.output_dir is not given
        ("name", component_problem(cfg.name) is None, component_problem(cfg.name) or ""),
        ("data.seq_len", d.seq_len > 0, f"must be positive, got {d.seq_len}"),
        ("data.seq_len", d.seq_len <= cfg.model.max_seq_len, f"{d.seq_len} exceeds model.max_seq_len {cfg.model.max_seq_len}"),
        ("data.max_mb", d.max_mb > 0, f"must be positive, got {d.max_mb}"),
        ("data.prefetch", d.prefetch >= 0, f"must be >= 0 (0 disables prefetching), got {d.prefetch}"),
        ("data.mix", _mix_problem(d.mix) is None, _mix_problem(d.mix) or ""),
        ("optimizer.lr", o.lr > 0, f"must be positive, got {o.lr}"),
        ("optimizer.min_lr_ratio", 0 <= o.min_lr_ratio <= 1, f"must be in [0, 1], got {o.min_lr_ratio}"),
        ("optimizer.warmup_steps", o.warmup_steps >= 0, f"must be >= 0, got {o.warmup_steps}"),
        ("optimizer.betas", len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"must be two numbers in [0, 1), got {o.betas}"),
        ("optimizer.eps", o.eps > 0, f"must be positive, got {o.eps}"),
        ("optimizer.weight_decay", o.weight_decay >= 0, f"must be >= 0, got {o.weight_decay}"),
        ("optimizer.grad_clip", o.grad_clip >= 0, f"must be >= 0 (0 disables), got {o.grad_clip}"),
        ("train.steps", t.steps > 0, f"must be positive, got {t.steps}"),
        ("train.seed", t.seed >= 0, f"must be >= 0, got {t.seed}"),
        ("train.sample_tokens", t.sample_tokens >= 0, f"must be >= 0 (0 disables the sample), got {t.sample_tokens}"),
        ("train.sample_prompt", t.sample_tokens == 0 or t.sample_prompt != "", "must not be empty when sample_tokens > 0"),
        ("data.vocab_size", d.vocab_size >= 1, f"must be positive, got {d.vocab_size}"),
        ("train.global_batch", t.global_batch > 0, f"must be positive, got {t.global_batch}"),
        ("train.micro_batch", t.micro_batch > 0, f"must be positive, got {t.micro_batch}"),
        ("train.val_interval", t.val_interval >= 0, f"must be >= 0, got {t.val_interval}"),
        ("train.val_batches", t.val_batches >= 0, f"must be >= 0, got {t.val_batches}"),
        ("train.val_batch_size", t.val_batch_size > 0, f"must be positive, got {t.val_batch_size}"),
        ("train.log_interval", t.log_interval > 0, f"must be positive, got {t.log_interval}"),
        ("train.timeout_s", t.timeout_s > 0, f"must be positive, got {t.timeout_s}"),
        ("train.time_budget_s", 0 <= t.time_budget_s < float("inf"), f"must be a finite number >= 0 (0 trains exactly train.steps), got {t.time_budget_s}"),
        ("train.time_budget_min_steps", t.time_budget_min_steps >= 1, f"must be >= 1 (train.steps caps it), got {t.time_budget_min_steps}"),
        ("train.gc_every", t.gc_every >= 0, f"must be >= 0 (0 leaves Python's automatic garbage collection on), got {t.gc_every}"),
        ("train.step_deadline_s", t.step_deadline_s >= 0, f"must be >= 0 (0 disables the watchdog), got {t.step_deadline_s}"),
        ("train.nonfinite_skip", t.nonfinite_skip >= 1, f"must be >= 1, got {t.nonfinite_skip}"),
        ("train.straggler_threshold", t.straggler_threshold >= 0, f"must be >= 0 (0 disables), got {t.straggler_threshold}"),
        ("train.straggler_window", t.straggler_window >= 1, f"must be >= 1, got {t.straggler_window}"),
        ("train.batch_ramp", t.batch_ramp == "auto" or all(len(r) == 2 and r[0] >= 0 and r[1] > 0 for r in t.batch_ramp), "must be a list of [tokens_seen, global_batch] pairs, or \"auto\""),
        ("train.batch_auto_max", t.batch_ramp != "auto" or (t.batch_auto_max >= t.global_batch > 0 and (t.batch_auto_max // t.global_batch) & (t.batch_auto_max // t.global_batch - 1) == 0 and t.batch_auto_max % t.global_batch == 0),
         f"must be train.global_batch ({t.global_batch}) times a power of two with batch_ramp = \"auto\", got {t.batch_auto_max}"),
        ("checkpoint.interval_steps", c.interval_steps >= 0, f"must be >= 0, got {c.interval_steps}"),
        ("checkpoint.keep_last", c.keep_last >= 1, f"must be >= 1 (the newest checkpoint is always kept), got {c.keep_last}"),
        ("checkpoint.keep_every", c.keep_every >= 0, f"must be >= 0, got {c.keep_every}"),
        ("checkpoint.allow_model_change", all(k in SWITCHABLE for k in c.allow_model_change),
         f"may list only {', '.join(SWITCHABLE)} (the others change which tensors exist), got {c.allow_model_change}"),
        ("logging.trackers", all(t in TRACKERS for t in cfg.logging.trackers), f"must name trackers among {', '.join(TRACKERS)}, got {cfg.logging.trackers}"),
        ("logging.trackers", len(set(cfg.logging.trackers)) == len(cfg.logging.trackers), f"names a tracker twice: {cfg.logging.trackers}"),
        ("logging.pipeline_trace_step", cfg.logging.pipeline_trace_step >= 0, f"must be >= 0 (0 = never), got {cfg.logging.pipeline_trace_step}"),
        ("resilience.straggler_windows", cfg.resilience.straggler_windows >= 1, f"must be >= 1, got {cfg.resilience.straggler_windows}"),
        ("resilience.on_straggler", cfg.resilience.on_straggler == "log" or t.straggler_threshold > 0, "exclude needs train.straggler_threshold > 0 (0 turns straggler detection off)"),
        ("resilience.failures", cfg.resilience.failures >= 1, f"must be >= 1, got {cfg.resilience.failures}"),
        ("resilience.failure_window_s", cfg.resilience.failure_window_s > 0, f"must be positive, got {cfg.resilience.failure_window_s}"),
        ("resilience.min_world", cfg.resilience.min_world >= 1, f"must be >= 1, got {cfg.resilience.min_world}"),
        # The outer optimizer is no part of the layout (layout/diloco.py checks the sync keys).
        ("parallel.diloco_outer_lr", p.diloco_outer_lr > 0, f"must be positive, got {p.diloco_outer_lr}"),
        ("parallel.diloco_outer_momentum", 0 <= p.diloco_outer_momentum < 1, f"must be in [0, 1), got {p.diloco_outer_momentum}"),
        ("parallel.auto", not (p.auto and p.replicate_sync == "diloco"),
         "the planner does not choose DiLoCo replicas; set the degrees yourself (dp_replicate >= 2) with auto=false"),
        *_share_checks(p, t),
    ]
    for key, ok, msg in checks:
        if not ok:
            raise ConfigError(key, msg)
    # The layout: every rule a world size cannot change (ndtrain.layout.problems(), world unknown).
    # With the world, `config check --world N` and `train` run the rest.
    from ndtrain.layout import from_config, problems

    found = problems(from_config(p, t, d), cfg.model, None, d.seq_len, layout_batches(t))
    if found:
        raise ConfigError(found[0].key, str(found[0]))


def _share_checks(p, t) -> list:
    """Uneven batch shares and who balances them (layout/batch_shares.py); the checks that need
    the data-parallel degree run when the run starts (train/balance.py)."""
    uneven = bool(p.batch_shares) or p.balance != "off"
    key = "parallel.batch_shares" if p.batch_shares else "parallel.balance"
    return [
        ("parallel.batch_shares", all(0 < w < float("inf") for w in p.batch_shares),
         f"must be positive weights, one per data-parallel rank, got {p.batch_shares}"),
        ("parallel.balance_threshold", 0 < p.balance_threshold < float("inf"),
         f"must be a positive fraction (0.1: re-balance when the slowest rank is 10% over the mean), got {p.balance_threshold}"),
        ("parallel.gpus", p.balance == "plan" or not p.gpus, "is read only with balance = \"plan\""),
        ("parallel.gpus", p.balance != "plan" or p.gpus, "balance = \"plan\" needs the GPU kind of each data-parallel "
         "rank, e.g. gpus = \"1xh100,1xa100-80\""),
        ("parallel.batch_shares", p.balance != "plan" or not p.batch_shares,
         "balance = \"plan\" sets the shares from parallel.gpus; give one or the other"),
        (key, not uneven or p.pp == 1, "uneven shares need pp = 1 (a pipeline schedule runs equal micro-batches)"),
        (key, not uneven or p.replicate_sync != "diloco", "uneven shares and DiLoCo replicas do not mix (each replica "
         "normalises its own loss)"),
        (key, not uneven or t.batch_ramp != "auto", "uneven shares and batch_ramp = \"auto\" do not mix (the noise "
         "scale reads equal first micro-batches)"),
    ]


def auto_batches(train) -> list[int]:
    """The batches `batch_ramp = "auto"` may choose: global_batch doubled up to batch_auto_max."""
    out, b = [], train.global_batch
    while b <= train.batch_auto_max:
        out.append(b)
        b *= 2
    return out


def layout_batches(train) -> list[int]:
    """Every global batch (sequences) a run uses: the batch first, then each stage of its ramp."""
    if train.batch_ramp == "auto":
        return auto_batches(train) or [train.global_batch]
    out = [train.global_batch]
    for _, b in sorted(train.batch_ramp):
        if b > 0 and b not in out:
            out.append(b)
    return out
