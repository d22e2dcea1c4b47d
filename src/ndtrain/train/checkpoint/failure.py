"""What a failed checkpoint write tells the user: one line with the path, the bytes it needed
(and the bytes free) for a full disk, the cause otherwise, and which checkpoint is still the
newest published one."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from ndtrain.errors import RunError
from ndtrain.train.checkpoint.store import list_checkpoints


def write_failure(error: BaseException | None, name: str, root: Path, needed_bytes) -> RunError:
    """One line with the path, the bytes it needed (and the bytes free), and which checkpoint is
    still the newest published one. `needed_bytes()` is called only for a full disk (estimating
    it may walk the state)."""
    root = Path(root)
    cause = os_error(error)
    kept = list_checkpoints(root)
    safe = f"{kept[-1]} is still the newest published checkpoint" if kept else "no checkpoint was published"
    if cause is not None and cause.errno == errno.ENOSPC or "No space left" in str(error):
        needed = needed_bytes()
        free = shutil.disk_usage(_existing(root)).free
        what = (f"no space left on the device of {root}: checkpoint {name} needs about "
                f"{needed / 1e6:,.1f} MB ({needed:,} bytes), {free / 1e6:,.1f} MB are free")
    elif cause is not None:
        what = f"cannot write checkpoint {name}: {cause.strerror or cause}: {cause.filename or root}"
    else:
        first = next((ln.strip() for ln in str(error or "failed on another rank").splitlines() if ln.strip()), "")
        what = f"checkpoint {name} could not be written to {root}: {first[:200]}"
    return RunError(f"{what}; the partial checkpoint was removed and {safe}", all_ranks=True)


def os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind a failed write, wherever DCP wrapped it (its CheckpointException keeps
    each rank's exception in `failures`)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def _existing(path: Path) -> Path:
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path
