"""What stays in a checkpoints directory: retention, timelines, and checkpoints moved aside.
Run by rank 0 only; renames within the directory, never copies. The rules (docs/checkpoints.md,
"Retention and timelines" and the sections after it):

- Retention counts only checkpoints that verify: the newest `keep_last` intact ones stay, and
  every `keep_every`-th step; older ones are deleted. One that fails verification is never
  counted and never deleted: it is moved to `corrupt/` with the reason in the log. What the
  process has not checked yet is hashed before each save by all ranks, each its share
  (`unverified`), never by rank 0 alone inside a publish while the others wait in a collective.
- Retention also keeps the newest checkpoint read back intact (hashed again after it was
  published, before the next save) while none of the kept ones has been: with keep_last = 1
  the newest and the one before it stay, so one damaged file never leaves nothing to resume.
- `resume=auto` that finds checkpoints but none usable stops with one line (nothing_usable);
  it starts from scratch only where no checkpoint ever was.
- Clean-up and retention touch only ndtrain's own names (store.leftovers): a user's
  `photos.partial/` in a checkpoints directory stays.
- One directory, one timeline. Resuming from a checkpoint older than the newest one there
  starts a new timeline: before training, the newer checkpoints (the abandoned timeline) move to
  `abandoned-<time>/`, so `resume=auto` after a later crash continues the new timeline. The move
  is journalled (`.abandoning-from-<step>-<time>/` first), so a crash halfway is finished at the
  next start instead of leaving the old timeline's newest checkpoint to be resumed.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from pathlib import Path

from ndtrain.train.checkpoint.store import (MARKER, TRAIN_STATE, holds_only_checkpoint_files, leftovers, list_checkpoints,
                                      step_of)

CORRUPT = "corrupt"
ABANDONING = ".abandoning-from-"
_JOURNAL = re.compile(r"^\.abandoning-from-\d{8}-\d{8}-\d{6}$")  # ABANDONING + step + _stamp(): only ours


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


def clear_leftovers(root: Path, log=print) -> list[Path]:
    """Partial saves (never published) and half-deleted old checkpoints left by a killed
    process: ndtrain's own names holding only checkpoint files (store.leftovers). Safe to
    remove: the lock of this checkpoints directory says no live run writes here."""
    stale, foreign = leftovers(root)
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    for p in foreign:
        log(f"left {p} alone: it has the name of an unfinished ndtrain save but holds files no checkpoint has")
    return stale


def clear_partial(tmp: Path, root: Path, log) -> None:
    """Makes room for a save's partial directory: ndtrain's own is removed, anything else there
    (it holds files no checkpoint has) is moved aside under corrupt/, never deleted."""
    if not os.path.lexists(tmp):
        return
    if tmp.is_dir() and not tmp.is_symlink() and holds_only_checkpoint_files(tmp):
        shutil.rmtree(tmp)
        return
    target = move_aside(tmp, root)
    log(f"{tmp} was in the way of a save and holds files no checkpoint has: moved it to {target} (nothing deleted)")


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
    for journal in sorted(p for p in root.iterdir() if _JOURNAL.match(p.name) and p.is_dir()):
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


def retain(root: Path, keep_last: int, keep_every: int, verdict, log, read_back=lambda ckpt: True) -> None:
    """`verdict(ckpt)` is None for an intact checkpoint, else the reason (cached by the caller:
    checkpoints this process published or verified are not hashed again). `read_back(ckpt)`:
    whether it was read back from disk and found intact (one only hashed as it was written is
    not): while none of the kept ones was, the newest one that was stays too, so a run never
    holds nothing but checkpoints nobody has read back (keep_last = 1 and its only one corrupt)."""
    root = Path(root)
    good, confirmed = 0, False
    for ckpt in reversed(list_checkpoints(root)):
        if good < keep_last:
            problem = verdict(ckpt)
            if problem:
                target = move_aside(ckpt, root)
                log(f"checkpoint {ckpt.name} fails verification ({problem}): not counted toward keep_last; "
                    f"moved to {target}")
                continue
            good += 1
            confirmed = confirmed or read_back(ckpt)
            continue
        if keep_every and step_of(ckpt) % keep_every == 0:
            confirmed = confirmed or read_back(ckpt)
            continue
        if not confirmed and read_back(ckpt):
            confirmed = True  # kept beyond keep_last until a newer one is read back intact
            continue
        doomed = ckpt.with_name(f".{ckpt.name}.deleting")  # unmarked at once: never half-deleted yet listed
        os.replace(ckpt, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def unverified(root: Path, keep_last: int, verdicts: dict, written=frozenset()) -> list[Path]:
    """The checkpoints `retain` would ask about that `verdicts` does not know, or knows only as
    hashed while this process wrote them (`written`: read back now, so the next publish may
    let an older one go): newest first, until keep_last are known intact or (unchecked)
    assumed so. The checkpointer hashes these before a save, every rank its share, so a publish
    never hashes on rank 0 alone while its peers wait."""
    todo, good = [], 0
    for ckpt in reversed(list_checkpoints(Path(root))):
        if good >= keep_last:
            break
        if str(ckpt) not in verdicts or str(ckpt) in written:
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
        found = [str(c) for c in reversed(list_checkpoints(root))]
        aside = Path(root) / CORRUPT
        if not found and aside.is_dir() and any(p.name.startswith("step_") for p in aside.iterdir()):
            # every checkpoint there was has been set aside as damaged (by an earlier attempt)
            return [], nothing_usable(root, f"what there was failed verification and is in {aside}"), False
        return found, None, False
    path = Path(spec)
    if path.is_dir() and not (path / MARKER).exists() and not (path / TRAIN_STATE).exists():
        for sub in (path, path / "checkpoints"):  # a checkpoints/ or run directory: its newest good one
            found = list_checkpoints(sub)
            if found:
                return [str(c) for c in reversed(found)], None, False
        return [], f"cannot resume from {path}: it holds no checkpoint (no step_XXXXXXXX/ with a COMPLETE marker)", False
    return [str(path)], None, True


def nothing_usable(root: Path, why: str) -> str:
    """A resume that finds checkpoints but none usable stops: starting at step 0 would append a
    second history to the run (metrics.jsonl) and report success for what was not asked."""
    return (f"no usable checkpoint under {root} to resume from ({why}); nothing was trained. "
            f"To start over at step 0, drop --checkpoint.resume and pass --train.overwrite=true (the old run "
            f"moves aside, nothing is deleted), or resume from a checkpoint you name with --checkpoint.resume=<path>")


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
