"""What stays in a checkpoints directory: retention, timelines, and checkpoints moved aside.
Run by rank 0 only; renames within the directory, never copies. The rules (README, "Checkpoints
and recovery"):

- Retention counts only checkpoints that verify: the newest `keep_last` intact ones stay, and
  every `keep_every`-th step; older ones are deleted. One that fails verification is never
  counted and never deleted: it is moved to `corrupt/` with the reason in the log. What the
  process has not checked yet is hashed before each save by all ranks, each its share
  (`unverified`), never by rank 0 alone inside a publish while the others wait in a collective.
- One directory, one timeline. Resuming from a checkpoint older than the newest one there
  starts a new timeline: before training, the newer checkpoints (the abandoned timeline) move to
  `abandoned-<time>/`, so `resume=auto` after a later crash continues the new timeline. The move
  is journalled (`.abandoning-from-<step>-<time>/` first), so a crash halfway is finished at the
  next start instead of leaving the old timeline's newest checkpoint to be resumed.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from ndtrain.train.ckpt_store import MARKER, TRAIN_STATE, list_checkpoints, step_of

CORRUPT = "corrupt"
ABANDONING = ".abandoning-from-"


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def move_aside(ckpt: Path, root: Path, folder: str = CORRUPT) -> Path:
    dest = Path(root) / folder
    dest.mkdir(exist_ok=True)
    target = dest / f"{ckpt.name}-{_stamp()}"
    n = 1
    while target.exists():
        n += 1
        target = dest / f"{ckpt.name}-{_stamp()}-{n}"
    os.replace(ckpt, target)
    return target


def clear_leftovers(root: Path) -> list[Path]:
    """Partial saves (never published) and half-deleted old checkpoints left by a killed
    process. Safe to remove: the run-directory lock says no live run writes here."""
    root = Path(root)
    stale = sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith((".partial", ".deleting"))) \
        if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def abandon_newer(root: Path, step: int, log) -> None:
    """Starts a new timeline at `step`: checkpoints after it move to `abandoned-<time>/`."""
    root = Path(root)
    if not any(step_of(c) > step for c in list_checkpoints(root)):
        return
    (root / f"{ABANDONING}{step:08d}-{_stamp()}").mkdir()
    finish_abandoning(root, log)


def finish_abandoning(root: Path, log) -> None:
    root = Path(root)
    if not root.is_dir():
        return
    for journal in sorted(root.glob(f"{ABANDONING}*")):
        rest = journal.name[len(ABANDONING):]
        step = int(rest[:8])
        for ckpt in list_checkpoints(root):
            if step_of(ckpt) > step:
                os.replace(ckpt, journal / ckpt.name)
        final = root / f"abandoned-{rest[9:]}"
        os.replace(journal, final)
        moved = sorted(p.name for p in final.iterdir())
        log(f"resumed from step {step}, so checkpoints after it ({', '.join(moved)}) belong to an abandoned "
            f"timeline: moved to {final} (nothing deleted)")


def retain(root: Path, keep_last: int, keep_every: int, verdict, log) -> None:
    """`verdict(ckpt)` is None for an intact checkpoint, else the reason (cached by the caller:
    checkpoints this process published or verified are not hashed again)."""
    root = Path(root)
    good = 0
    for ckpt in reversed(list_checkpoints(root)):
        if good < keep_last:
            problem = verdict(ckpt)
            if problem:
                target = move_aside(ckpt, root)
                log(f"checkpoint {ckpt.name} fails verification ({problem}): not counted toward keep_last; "
                    f"moved to {target}")
                continue
            good += 1
            continue
        if keep_every and step_of(ckpt) % keep_every == 0:
            continue
        doomed = ckpt.with_name(f".{ckpt.name}.deleting")  # unmarked at once: never half-deleted yet listed
        os.replace(ckpt, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def unverified(root: Path, keep_last: int, verdicts: dict) -> list[Path]:
    """The checkpoints `retain` would ask about that `verdicts` does not know: newest first, until
    keep_last are known intact or (unchecked) assumed so. The checkpointer hashes these before a
    save, every rank its share, so a publish never hashes on rank 0 alone while its peers wait."""
    todo, good = [], 0
    for ckpt in reversed(list_checkpoints(Path(root))):
        if good >= keep_last:
            break
        if str(ckpt) not in verdicts:
            todo.append(ckpt)
        if verdicts.get(str(ckpt)) is None:
            good += 1
    return todo


def new_timeline(parent: str | None = None) -> dict:
    return {"id": uuid.uuid4().hex[:12], "parent": parent}


def resume_candidates(spec: str, root: Path) -> tuple[list[str], str | None, bool]:
    """What `checkpoint.resume = spec` may load, newest first; whether it is one explicit
    checkpoint (which must verify, no fallback); or an error."""
    if spec == "auto":
        return [str(c) for c in reversed(list_checkpoints(root))], None, False
    path = Path(spec)
    if path.is_dir() and not (path / MARKER).exists() and not (path / TRAIN_STATE).exists():
        for sub in (path, path / "checkpoints"):  # a checkpoints/ or run directory: its newest good one
            found = list_checkpoints(sub)
            if found:
                return [str(c) for c in reversed(found)], None, False
        return [], f"cannot resume from {path}: it holds no checkpoint (no step_XXXXXXXX/ with a COMPLETE marker)", False
    return [str(path)], None, True


def continue_timeline(path: Path, root: Path, state: dict, is_main: bool, log) -> dict:
    """The timeline checkpoints continue after resuming from `path`: its own when it is the
    newest checkpoint of this directory; a new one otherwise, and then (rank 0) the newer
    checkpoints move to abandoned-<time>/."""
    ours = Path(path).parent.resolve() == Path(root).resolve()
    newest = ours and all(step_of(c) <= step_of(path) for c in list_checkpoints(root))
    saved = state.get("timeline") or {}
    if ours and not newest and is_main:
        abandon_newer(root, step_of(path), log)
    if newest and saved.get("id"):
        return dict(saved)
    return new_timeline(f"{Path(path).name}@{saved.get('id', '?')}")
