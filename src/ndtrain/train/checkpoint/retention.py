"""What stays in a checkpoints directory: retention, clean-up, and checkpoints moved aside.
Deleting and moving is rank 0's alone, by renames within the directory, never copies; checking
what retention will count is every rank's (Retention.check_before_save). The rules
(docs/checkpoints.md, "Retention and timelines" and the sections after it):

- Retention counts only checkpoints that verify: the newest `keep_last` intact ones stay, and
  every `keep_every`-th step; older ones are deleted. One that fails verification is never
  counted and never deleted: it is moved to `corrupt/` with the reason in the log. A checkpoint
  the process has never checked (an older timeline's, after resuming from an explicit path) is
  hashed before the next save by all ranks, each its share (`unverified`), never by rank 0 alone
  inside a publish while the others wait in a collective.
- One this process published was hashed as it was written (digest.py), so it is not read again:
  before the next save it is confirmed on disk, every file there with the size its digest was
  taken of (a stat per file, no read). Retention keeps the newest confirmed checkpoint while
  none of the kept ones is: with keep_last = 1 the newest and the one before it stay, so a
  checkpoint whose files did not all land never leaves nothing to resume. A save thus reads no
  checkpoint data whatever its size; the full hash check of what was written runs on resume.
- Clean-up and retention touch only ndtrain's own names (store.leftovers): a user's
  `photos.partial/` in a checkpoints directory stays.

Which checkpoint a resume loads, and the timelines that follow from it: resume.py.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ndtrain.train.checkpoint.digest import verify_shared
from ndtrain.train.checkpoint.store import (holds_only_checkpoint_files, leftovers, list_checkpoints, step_of,
                                            verify_checkpoint)
from ndtrain.train.distributed import broadcast_object

CORRUPT = "corrupt"


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def move_to_corrupt(ckpt: Path, root: Path, folder: str = CORRUPT) -> Path:
    dest = Path(root) / folder
    dest.mkdir(exist_ok=True)
    target = dest / f"{ckpt.name}-{stamp()}"
    n = 1
    while target.exists():
        n += 1
        target = dest / f"{ckpt.name}-{stamp()}-{n}"
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
    target = move_to_corrupt(tmp, root)
    log(f"{tmp} was in the way of a save and holds files no checkpoint has: moved it to {target} (nothing deleted)")


def retain(root: Path, keep_last: int, keep_every: int, verdict, log, confirmed=lambda ckpt: True) -> None:
    """`verdict(ckpt)` is None for an intact checkpoint, else the reason (cached by the caller:
    checkpoints this process published or verified are not hashed again). `confirmed(ckpt)`:
    whether it was found intact on disk after it was published (one only hashed as it was
    written is not yet): while none of the kept ones was, the newest one that was stays too, so
    a run never holds nothing but checkpoints nobody has confirmed (keep_last = 1 and its only
    one damaged)."""
    root = Path(root)
    good, held = 0, False  # held: a kept checkpoint is confirmed
    for ckpt in reversed(list_checkpoints(root)):
        if good < keep_last:
            problem = verdict(ckpt)
            if problem:
                target = move_to_corrupt(ckpt, root)
                log(f"checkpoint {ckpt.name} fails verification ({problem}): not counted toward keep_last; "
                    f"moved to {target}")
                continue
            good += 1
            held = held or confirmed(ckpt)
            continue
        if keep_every and step_of(ckpt) % keep_every == 0:
            held = held or confirmed(ckpt)
            continue
        if not held and confirmed(ckpt):
            held = True  # kept beyond keep_last until a newer one is confirmed
            continue
        doomed = ckpt.with_name(f".{ckpt.name}.deleting")  # unmarked at once: never half-deleted yet listed
        os.replace(ckpt, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def unverified(root: Path, keep_last: int, verdicts: dict, written=frozenset()) -> list[Path]:
    """The checkpoints `retain` would ask about that `verdicts` does not know, or knows only as
    hashed while this process wrote them (`written`: confirmed on disk now, so the next publish
    may let an older one go): newest first, until keep_last are known intact or (unchecked)
    assumed so. The checkpointer checks these before a save, every rank its share, so a publish
    never checks on rank 0 alone while its peers wait."""
    todo, good = [], 0
    for ckpt in reversed(list_checkpoints(Path(root))):
        if good >= keep_last:
            break
        if str(ckpt) not in verdicts or str(ckpt) in written:
            todo.append(ckpt)
        if verdicts.get(str(ckpt)) is None:
            good += 1
    return todo


class Retention:
    """Retention of the checkpoints under `root`, with what this process knows of them.

    `verdicts`: None (intact) or the reason, for every checkpoint this process wrote or checked;
    retention hashes none of them again. Those in `written` (published here, known intact as
    hashed while written) are confirmed on disk by their sizes before the next save (retention
    lets an older one go only once a newer one was). `group`: the process group of these checks'
    collectives (the checkpointer's, whose timeout is sized for file I/O)."""

    def __init__(self, root: Path, keep_last: int, keep_every: int, log: Callable[[str], None], group=None):
        self.root, self.keep_last, self.keep_every, self.log = Path(root), keep_last, keep_every, log
        self.group = group
        self.verdicts: dict[str, str | None] = {}
        self.written: set[str] = set()

    def check_before_save(self, is_main: bool) -> None:
        """Every rank: what the publish's retention will ask about and nobody has checked, shared
        over the ranks: this process's own checkpoints by their files' sizes, any other by their
        hashes; once one fails, retention looks further back, so again."""
        while todo := broadcast_object(self._to_check() if is_main else None, group=self.group):
            ours = [Path(c) for c, written in todo if written]  # the same lists on every rank
            others = [Path(c) for c, written in todo if not written]
            checked = verify_shared(ours, check_hashes=False, group=self.group) if ours else {}
            checked.update(verify_shared(others, group=self.group) if others else {})
            self.verdicts.update(checked)
            self.written.difference_update(checked)

    def _to_check(self) -> list[tuple[str, bool]]:
        """Rank 0 (it alone publishes, so it alone knows what was written): (checkpoint, written
        here) for each one to check."""
        return [(str(c), str(c) in self.written)
                for c in unverified(self.root, self.keep_last, self.verdicts, self.written)]

    def published(self, ckpt: Path) -> None:
        self.verdicts[str(ckpt)] = None  # hashed as it was written
        self.written.add(str(ckpt))

    def apply(self) -> None:
        """Rank 0, after a publish."""
        retain(self.root, self.keep_last, self.keep_every, self._verdict, self.log, self._confirmed)

    def _confirmed(self, ckpt: Path) -> bool:
        return self.verdicts.get(str(ckpt), "unknown") is None and str(ckpt) not in self.written

    def _verdict(self, ckpt: Path) -> str | None:
        key = str(ckpt)
        if key not in self.verdicts:  # not reached: check_before_save checked it before the save
            self.verdicts[key] = verify_checkpoint(ckpt)
        return self.verdicts[key]
