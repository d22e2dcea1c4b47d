"""A run directory belongs to one run.

- A fresh run (no `checkpoint.resume`) in a directory that holds another run's checkpoints or
  metrics is refused; `train.overwrite = true` moves the old run aside (nothing is deleted).
- `checkpoint.resume = auto` needs a run directory that exists: otherwise it could only ever
  start from scratch, which is what a mistyped directory looks like.
- A lock keeps two live runs out of one directory (run_lock.py).

One process per run holds the lock: the `--nproc` launcher (its workers, and their restarts, are
its own) or, under a plain torchrun, rank 0 (a restart attempt or a re-formed elastic group of
the same run id takes it over silently). Ranks never lock against each other.

A run writes only its own files, never through a link (run_files.py), and claim marks the
directory as a run's once it holds the lock. A run directory ndtrain derives
(runs/<name>-<time or run id>) stays a direct child of runs/ (check_derived).
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path

from ndtrain import launch_env as launch
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.paths import check_creatable, component_problem
from ndtrain.train.run_files import RUN_ENTRIES, RUN_MARKER, check_entries, mark
from ndtrain.train.run_lock import RunLock, describe_owner, held_by_launcher


# Lives here, not in run_files: it reads the trackers' and the job hooks' names, and those
# modules write through run_files (which would make an import cycle).
def written_entries(cfg) -> tuple[str, ...]:
    """The run entries this run's config writes in its directory: a user's own `wandb/` or
    `checkpoints/` there is no concern of a run that writes neither."""
    from ndtrain.train.hooks import HOOK_LOG, HOOKS_ENV
    from ndtrain.train.trackers import STATE_FILE, enabled

    trackers = enabled(cfg.logging)
    names = {"config.toml": True, "metrics.jsonl": True, "checkpoints": not cfg.checkpoint.dir,
             "tensorboard": "tensorboard" in trackers, "wandb": "wandb" in trackers,
             "mlruns": "mlflow" in trackers and not cfg.logging.mlflow_uri,
             STATE_FILE: "wandb" in trackers or "mlflow" in trackers,
             "pipeline_trace.json": cfg.logging.pipeline_trace_step > 0, HOOK_LOG: bool(os.environ.get(HOOKS_ENV)),
             "resilience": cfg.resilience.on_failure == "exclude"}  # the failure ledger (train/resilience.py)
    return tuple(name for name in RUN_ENTRIES if names.get(name))


def checkpoint_root(cfg, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


# ---- what an earlier run left ---------------------------------------------------------------
def run_traces(run_dir: Path, ckpt_root: Path) -> list[str]:
    """What in these directories belongs to a run: checkpoints (published or not) and metrics."""
    found = []
    if ckpt_root.is_dir():
        ckpts = _checkpoint_entries(ckpt_root)
        if ckpts:
            found.append(f"{len(ckpts)} checkpoint entr{'y' if len(ckpts) == 1 else 'ies'} in {ckpt_root}")
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(str(metrics))
    return found


def _checkpoint_entries(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(("step_", ".step_")) or
            p.name in ("corrupt", "abandoned") or p.name.startswith("abandoned-")]


def continues_here(spec: str, ckpt_root: Path, run_dir: Path) -> bool:
    """Does resuming from `spec` continue the run in this directory (rather than start a new one
    from elsewhere, e.g. a fine-tune from imported weights)?"""
    if spec == "auto":
        return True
    if not spec:
        return False
    path = Path(spec).resolve()
    for own in (Path(ckpt_root).resolve(), Path(run_dir).resolve()):
        if path == own or own in path.parents:
            return True
    return False


def _aside_name(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.replaced-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
    return target


def move_aside(run_dir: Path, ckpt_root: Path) -> list[Path]:
    """Moves the earlier run's files (its run entries and marker; in a checkpoint.dir elsewhere,
    its checkpoints) to `<dir>.replaced-<time>/` beside each directory; renames only, on the
    same file system, so nothing is copied or deleted. Nothing else in either is touched."""
    moved = []
    for root in dict.fromkeys([Path(run_dir), Path(ckpt_root)]):
        if not root.is_dir():
            continue
        if root == Path(run_dir):
            entries = [root / n for n in (RUN_MARKER, *RUN_ENTRIES) if os.path.lexists(root / n)]
        else:
            entries = _checkpoint_entries(root)
        if not entries:
            continue
        target = _aside_name(root)
        target.mkdir()
        for entry in entries:
            os.replace(entry, target / entry.name)
        moved.append(target)
    return moved


def check_derived(cfg, run_dir: Path) -> None:
    """A run directory ndtrain derives (no train.output_dir) is a direct child of runs/: a name
    or a launcher's run id that is a path ('../x', '/x', 'a/b') never lands it elsewhere."""
    if cfg.train.output_dir:
        return  # the user's own choice, wherever it is
    if Path(run_dir).parent == Path("runs") and component_problem(Path(run_dir).name) is None:
        return
    if component_problem(cfg.name):
        raise ConfigError("name", f"{component_problem(cfg.name)}: the run directory runs/<name>-<time> "
                                  f"would be {run_dir}, outside runs/")
    raise NdtrainError(f"TORCHELASTIC_RUN_ID={launch.run_id()!r} would put the run directory at {run_dir}, outside "
                       f"runs/: give the launcher a plain run id (no '/'), or set --train.output_dir")


def claim(cfg, run_dir: Path, restart: bool = False, run_id: str = "", log=print) -> RunLock:
    """Checks that this run may use `run_dir` and locks it. Raises NdtrainError (one line) and
    leaves the directory as it was when it may not."""
    run_dir = Path(run_dir)
    check_derived(cfg, run_dir)
    ckpt_root = checkpoint_root(cfg, run_dir)
    spec = cfg.checkpoint.resume
    if spec == "auto" and not restart and not run_dir.is_dir():
        if not cfg.train.output_dir:
            raise ConfigError("checkpoint.resume", "'auto' needs --train.output_dir=<the run to continue>: without "
                                                   "it each run gets a new directory and could only start from scratch")
        raise ConfigError("checkpoint.resume", f"'auto' but {run_dir} does not exist, so there is nothing to resume "
                                               f"(a mistyped train.output_dir?); create it first to start a run "
                                               f"that later attempts continue, or drop --checkpoint.resume")
    check_creatable(run_dir, "train.output_dir")
    if cfg.checkpoint.dir:
        check_creatable(ckpt_root, "checkpoint.dir")
    marked = check_entries(run_dir, written_entries(cfg))  # no foreign file of a run file's name, no link
    fresh = not restart and not continues_here(spec, ckpt_root, run_dir)
    traces = run_traces(run_dir, ckpt_root) if fresh else []
    if traces and not cfg.train.overwrite:  # refused before the lock: nothing is created
        raise NdtrainError(_refusal(run_dir, traces, spec))
    lock = RunLock.acquire(run_dir, run_id)
    try:
        # A checkpoint.dir is locked too: two live runs sharing one would delete each other's
        # checkpoints (retention, clean-up). One elsewhere, before anything in it is looked at.
        ckpt_key = "checkpoint.dir" if cfg.checkpoint.dir else "train.output_dir"
        inside = run_dir.resolve() in ckpt_root.resolve().parents
        if not inside and ckpt_root.resolve() != run_dir.resolve():
            lock.also.append(RunLock.acquire(ckpt_root, run_id, ckpt_key))
        for held in (lock, *lock.also):
            if held.note:
                log(held.note)
        previous = lock.previous
        same_run = bool(run_id) and previous.get("run_id") == run_id
        if previous.get("pid") and not same_run:
            log(f"took over the lock of a run that is gone ({describe_owner(previous)}): {lock.path}")
        traces = run_traces(run_dir, ckpt_root) if fresh and not same_run else []
        if traces:  # a run may have finished between the first look and the lock
            if not cfg.train.overwrite:
                raise NdtrainError(_refusal(run_dir, traces, spec))
            for target in move_aside(run_dir, ckpt_root):
                log(f"train.overwrite: moved the earlier run's files to {target} (nothing deleted)")
            marked = False  # the marker went with them
        if not marked:
            mark(run_dir, run_id)
        if inside:  # one inside the run directory after any move aside, which would take its lock along
            lock.also.append(RunLock.acquire(ckpt_root, run_id, ckpt_key))
    except BaseException:
        lock.release()
        raise
    return lock


def _refusal(run_dir: Path, traces: list[str], spec: str) -> str:
    why = f"resuming from {spec} here would start a second run" if spec else "a fresh run here would mix with it"
    return (f"{run_dir} holds an earlier run ({'; '.join(traces)}) and {why}: continue it with "
            f"--checkpoint.resume=auto, choose another --train.output_dir, or pass --train.overwrite=true "
            f"to move the old run aside (nothing is deleted)")


def default_run_dir(cfg) -> Path:
    """train.output_dir, else runs/<name>-<timestamp>."""
    if cfg.train.output_dir:
        return Path(cfg.train.output_dir)
    return Path("runs") / f"{cfg.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def launcher_run_dir(cfg) -> Path | None:
    """runs/<name>-<rdzv id> under torchrun with a run id: the same directory on every restart
    attempt (a timestamp would give each attempt a new one, with no checkpoint to resume)."""
    if cfg.train.output_dir or not launch.run_id():
        return None
    return Path("runs") / f"{cfg.name}-{launch.run_id()}"


def group_run_dir(cfg) -> Path:
    """The run directory of every rank of this group: the launcher's (stable across restarts, so
    a restarted group finds its checkpoints), else default_run_dir, rank 0's: ranks started by
    plain torchrun would each pick their own timestamp."""
    from ndtrain.train import distributed

    run_dir = launcher_run_dir(cfg) or default_run_dir(cfg)
    if distributed.env_world_size() > 1 and not cfg.train.output_dir:
        distributed.setup(cfg.train)
        run_dir = Path(distributed.broadcast_object(str(run_dir)))
    return run_dir


def claim_for_group(cfg, run_dir: Path) -> RunLock | None:
    """Before anything is built: the checks that need no model (preflight.py), then the run
    directory. Rank 0 decides, every rank learns the verdict, rank 0 holds the lock
    unless the `--nproc` launcher already does."""
    from ndtrain.train import distributed, preflight, recovery

    rt = distributed.setup(cfg.train)
    lock, error = None, None
    if rt.is_main:
        try:
            preflight.check_all(cfg)
            if not held_by_launcher(run_dir):
                lock = claim(cfg, run_dir, restart=recovery.restart_count() > 0, run_id=recovery.run_id(),
                             log=lambda text: print(text, flush=True))
        except NdtrainError as exc:
            error = (str(exc), exc.exit_code)
        except OSError as exc:  # e.g. the lock file cannot be created: one line, and no rank left waiting
            error = (f"{exc.strerror or exc}: {exc.filename or run_dir}", 1)
    error = distributed.broadcast_object(error)
    if error:
        exc = NdtrainError(error[0], all_ranks=True)
        exc.exit_code = error[1]
        raise exc
    return lock
