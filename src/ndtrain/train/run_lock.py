"""The run lock: one live run per directory.

A lock file (`.ndtrain.lock`, holding the owner's pid and host) keeps two live runs out of one
directory. It is an flock: the kernel releases it when its owner dies, however it dies, so a
lock left by a dead process is taken over (with a message) and a live one never is. On a
file system without flock (Lustre mounted without it answers ENOSYS) the lock is the file's
existence instead, created atomically (a link, which NFS and Lustre make atomic too) with the
owner's record: a record of a dead pid on this host, or of this run's own earlier attempt, is
taken over; one from another host cannot be checked for life and is refused, naming it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.launch_env import launcher_pid
from ndtrain.train.run_files import LOCK_NAME



def describe_owner(owner: dict) -> str:
    started = owner.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else ""
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}{when}"


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        owner = json.loads(data.decode() or "{}")
    except (UnicodeDecodeError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


@dataclass
class RunLock:
    path: Path
    fd: int
    previous: dict  # what the lock file held before: a dead owner's record, or {}
    also: list = field(default_factory=list)  # the locks of the other directories the run writes, held with it
    note: str = ""  # set when the file system has no flock and the lock is a lock file instead

    @classmethod
    def acquire(cls, run_dir: Path, run_id: str = "", key: str = "train.output_dir") -> RunLock:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        missing = _flock_missing(run_dir)
        if missing:
            return cls._acquire_file(run_dir, path, run_id, key, missing)
        while True:
            # O_NOFOLLOW and one link only: the lock is truncated and rewritten below, which a
            # symlink or a hard link would do to a file outside the run directory.
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENXIO):
                    raise
                raise NdtrainError(f"{path} is a symbolic link or not a regular file: the run lock is a file "
                                   f"of the run directory's own; remove it") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                os.close(fd)
                raise NdtrainError(f"{path} is not a regular file of its own (it is "
                                   f"{'linked under another name' if stat.S_ISREG(st.st_mode) else 'not a file'}): "
                                   f"the run lock is rewritten, so it must be the run directory's alone; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read(fd)
                os.close(fd)
                raise NdtrainError(f"{run_dir} is in use by a live run ({describe_owner(owner)}; lock {path}): wait for "
                                   f"it to finish or stop it, or choose another {key}") from None
            except OSError as exc:  # the directory took an flock but its files do not
                os.close(fd)
                if exc.errno not in _NO_FLOCK:
                    raise
                return cls._acquire_file(run_dir, path, run_id, key, errno.errorcode[exc.errno])
            try:  # the holder we waited for may have removed the file: then lock the new one
                same = os.fstat(fd).st_ino == os.lstat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "run_id": run_id}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(record).encode())
        return cls(path, fd, previous)

    @classmethod
    def _acquire_file(cls, run_dir: Path, path: Path, run_id: str, key: str, missing: str) -> RunLock:
        """The lock as a file that exists while the run lives: our record is written to a private
        name, then linked to the lock's name, which fails when the name exists."""
        host = socket.gethostname()
        record = {"pid": os.getpid(), "host": host, "started": time.time(), "run_id": run_id}
        mine = run_dir / f"{LOCK_NAME}.{host}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mine)  # this process's own, left by an attempt that raised
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, json.dumps(record).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        previous = {}
        try:
            for _ in range(100):  # each turn removes one dead owner's file, or another process won the race
                try:
                    os.link(mine, path)
                    break
                except FileExistsError:
                    pass
                try:
                    with open(path, "rb") as f:
                        held = os.fstat(f.fileno()).st_ino
                        owner = _read(f.fileno())
                except (FileNotFoundError, IsADirectoryError):
                    continue
                if not _file_owner_gone(owner, host, run_id):
                    where = "" if owner.get("host") == host else (
                        f"; this file system has no flock ({missing}), so a run on another host cannot be checked "
                        f"from here: if it is gone, remove {path}")
                    raise NdtrainError(f"{run_dir} is in use by a live run ({describe_owner(owner)}; lock {path}){where}; "
                                       f"wait for it to finish or stop it, or choose another {key}")
                with contextlib.suppress(FileNotFoundError):
                    if os.lstat(path).st_ino == held:  # the file judged, not one a racing process just linked
                        os.unlink(path)
                previous = owner
            else:
                raise NdtrainError(f"{run_dir}: could not create the run lock {path} (it keeps reappearing)")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(mine)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        note = (f"run lock: {run_dir} is on a file system without flock ({missing}); {path} holds this process's "
                f"pid and host instead (a dead run's lock on this host is taken over; another host's must be "
                f"removed by hand)")
        return cls(path, fd, previous, note=note)

    def release(self) -> None:
        for other in self.also:
            other.release()
        if self.fd < 0:
            return
        try:
            if os.lstat(self.path).st_ino == os.fstat(self.fd).st_ino:  # never another run's lock file
                os.unlink(self.path)  # before unlocking: a waiter then sees a new inode and retries
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)  # Lustre without -o flock; NFS without a lock daemon


def _flock_missing(directory: Path) -> str:
    """'' when `directory`'s file system takes an flock, else the error's name (ENOSYS ...)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:  # someone holds it: flock works
        return ""
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return errno.errorcode[exc.errno]
        raise
    finally:
        os.close(fd)
    return ""


def _file_owner_gone(owner: dict, host: str, run_id: str) -> bool:
    """Whether a lock file's owner can no longer be running: a dead pid on this host, this run's
    own earlier attempt (a launcher restarts a run only after all its workers stopped), or no
    readable record (a writer that died mid-write)."""
    from ndtrain.train.distributed import _alive

    pid = owner.get("pid")
    if not isinstance(pid, int):
        return True
    if run_id and owner.get("run_id") == run_id:
        return True
    return owner.get("host") == host and pid != os.getpid() and not _alive(pid)


def held_by_launcher(run_dir: Path) -> bool:
    """A worker of `ndtrain train --nproc`: its launcher holds the lock of this directory."""
    pid = launcher_pid()
    if pid is None:
        return False
    try:
        with os.fdopen(os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)) as f:
            return json.load(f).get("pid") == pid
    except (OSError, ValueError, AttributeError):
        return False
