"""The files a run writes in its run directory: which they are, whose they are, and how they are
written so that nothing outside the directory, and nothing the run did not create, is touched.

- `.ndtrain-run.json` (RUN_MARKER), written when a run first claims the directory (rundir.claim),
  says its run entries are a run's. In a directory without it any entry of those names is the
  user's, and the run is refused in one line; a directory that an ndtrain from before the
  marker made (one holding a checkpoint ndtrain published) is adopted. A run, and its own
  resumes and restarts, rewrite their own files freely.
- a run entry that is a symbolic link is refused, whatever it points to; files are replaced by
  rename (write_run_file) or opened with O_NOFOLLOW (open_run_log), so a link made after the
  check is replaced or refused, never written through.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import socket
import stat
import time
from pathlib import Path

from ndtrain.errors import ConfigError, NdtrainError

LOCK_NAME = ".ndtrain.lock"
RUN_MARKER = ".ndtrain-run.json"
# Every entry a run writes in its run directory, besides the lock and the marker: the one list
# the ownership and link checks go by (tests/train/test_run_files.py checks the writers use it).
RUN_FILES = ("config.toml", "plan.json", "metrics.jsonl", "trackers.json", "pipeline_trace.json", "faults.log")
RUN_DIRS = ("checkpoints", "tensorboard", "wandb", "mlruns", "resilience")
RUN_ENTRIES = RUN_FILES + RUN_DIRS
_CKPT_NAME = re.compile(r"step_\d+$")


def _marked(run_dir: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(run_dir / RUN_MARKER).st_mode)
    except OSError:
        return False


def _made_by_older_ndtrain(run_dir: Path) -> bool:
    """A run directory from before the marker: it holds a checkpoint ndtrain published (a step
    directory with its completion marker), which no user's own directory has."""
    from ndtrain.train.checkpoint import MARKER

    root = run_dir / "checkpoints"
    if root.is_symlink() or not root.is_dir():
        return False
    return any(_CKPT_NAME.match(p.name) and (p / MARKER).is_file() for p in root.iterdir())


def check_entries(run_dir: Path, entries: tuple[str, ...] = RUN_ENTRIES) -> bool:
    """Refuses (one line naming the entry) a directory where a run would write one of `entries`
    through a link or over a file no run created. Returns whether it is already a run's (marked)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    marked = _marked(run_dir)
    ours = marked or _made_by_older_ndtrain(run_dir)
    for name in (LOCK_NAME, RUN_MARKER, *entries):
        path = run_dir / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            elsewhere = "; keep checkpoints elsewhere with --checkpoint.dir" if name == "checkpoints" else ""
            raise ConfigError("train.output_dir", f"{path} is a symbolic link (to {os.readlink(path)}): a run "
                                                  f"writes its files only inside its directory, never through "
                                                  f"a link; remove the link{elsewhere}")
        if name in RUN_ENTRIES and not ours:
            raise ConfigError("train.output_dir", f"{path} exists and no ndtrain run made it (no {RUN_MARKER} "
                                                  f"in {run_dir}): a run there would write over it; choose "
                                                  f"another train.output_dir")
        if not (stat.S_ISDIR(mode) if name in RUN_DIRS else stat.S_ISREG(mode)):
            kind = "a directory" if name in RUN_DIRS else "a regular file"
            raise ConfigError("train.output_dir", f"{path} is not {kind}, which a run would write there")
    return marked


def write_run_file(path: Path, data: str | bytes) -> None:
    """Writes a run file whole by rename: whatever stands at `path` (a symlink, a hard link to
    another file) is replaced, never written through, and a reader never sees half a file."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:  # 0o666 less the umask, like any other file the user sees
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_run_log(path: Path):
    """`path` opened to append lines (line-buffered text), never through a symlink (O_NOFOLLOW).
    A file that is also linked under another name (a hard-linked snapshot of the run) is first
    given a copy of its own, so the other name keeps its bytes."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK  # NONBLOCK: a FIFO never hangs us
    for _ in range(2):
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                raise NdtrainError(f"{path} is a symbolic link or not a regular file: a run appends to its "
                                   f"own files only; remove it") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NdtrainError(f"{path} is not a regular file: a run appends to its own files only; remove it")
        if st.st_nlink == 1:
            os.set_blocking(fd, True)
            return os.fdopen(fd, "a", buffering=1)
        os.close(fd)
        src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(src, "rb") as f:
            write_run_file(path, f.read())
    raise NdtrainError(f"{path} is linked under another name and could not be given a copy of its own")


def mark(run_dir: Path, run_id: str = "") -> None:
    """Records that this directory's run entries are a run's (check_entries reads it)."""
    write_run_file(Path(run_dir) / RUN_MARKER, json.dumps(
        {"version": 1, "created": time.time(), "host": socket.gethostname(), "run_id": run_id,
         "entries": list(RUN_ENTRIES)}, indent=1) + "\n")
