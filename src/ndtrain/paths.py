"""Checks on paths the user gives, before any work: a directory that can be written (or
created), a file that can be written. Probed for real (as root, access() says yes to almost
everything) and without leaving anything behind. Torch-free: the planner uses them too. Also
the one directory fsync that prepare's and the checkpoints' renames both need to be durable."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ndtrain.errors import ConfigError, NdtrainError


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it survives a power cut only after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _error(key: str):
    """A config key (section.key) is reported as a ConfigError; a flag (--out) or an argument
    name (OUT) as a plain one-line error naming it."""
    if "." in key and not key.startswith("-"):
        return lambda msg: ConfigError(key, msg)
    return lambda msg: NdtrainError(f"{key}: {msg}")


def _probe_dir(path: Path, error) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".ndtrain-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise error(f"cannot write in {path}: {exc.strerror}") from None


def check_creatable(path: Path, key: str) -> None:
    """`path` is a directory we can write, or can be created as one."""
    error = _error(key)
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise error(f"{path} exists and is not a directory")
        _probe_dir(path, error)
        return
    first_missing = path
    while not first_missing.parent.exists() and first_missing.parent != first_missing:
        first_missing = first_missing.parent
    parent = first_missing.parent
    if not parent.is_dir():
        raise error(f"cannot create {path}: {parent} is a file, not a directory")
    try:
        first_missing.mkdir()
        first_missing.rmdir()
    except OSError as exc:
        raise error(f"cannot create {path}: {exc.strerror} ({parent})") from None


def component_problem(name: str) -> str | None:
    """Why `name` cannot be one entry of a directory (None: it can). What ndtrain derives a path
    from (a run's name, a mix component's name) must keep that path inside its parent."""
    if not name:
        return "must not be empty"
    if "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        return f"must be a plain name, not a path (no '/', not '.' or '..'), got {name!r}"
    return None


def check_output_file(path: Path, key: str) -> None:
    """`path` can be written as a file: not a directory, and its directory exists or can be made."""
    path = Path(path)
    if path.is_dir():
        raise _error(key)(f"{path} is a directory; give a file name")
    check_creatable(path.parent, key)
