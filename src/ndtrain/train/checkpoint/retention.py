"""What stays in a checkpoints directory: retention, clean-up, and checkpoints moved aside.
Deleting and moving is rank 0's alone, by renames within the directory, never copies; checking
what retention will count is every rank's (Retention.check_before_save). The rules
(docs/checkpoints.md, "Retention and timelines" and the sections after it):

- Retention counts only checkpoints that verify: the newest `keep_last` intact ones stay, and
  every `keep_every`-th step; older ones are deleted. One that fails verification is never
  counted and never deleted: it is moved to `corrupt/` with the reason in the log. What the
  process has not checked yet is hashed before each save by all ranks, each its share
  (`unverified`), never by rank 0 alone inside a publish while the others wait in a collective.
- Retention also keeps the newest checkpoint read back intact (hashed again after it was
  published, before the next save) while none of the kept ones has been: with keep_last = 1
  the newest and the one before it stay, so one damaged file never leaves nothing to resume.
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
from ndtrain.train.checkpoint.store import holds_only_checkpoint_files, leftovers, list_checkpoints, step_of, verify
from ndtrain.train.distributed import broadcast_object

CORRUPT = "corrupt"


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def move_aside(ckpt: Path, root: Path, folder: str = CORRUPT) -> Path:
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
    target = move_aside(tmp, root)
    log(f"{tmp} was in the way of a save and holds files no checkpoint has: moved it to {target} (nothing deleted)")


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


class Retention:
    """Retention of the checkpoints under `root`, with what this process knows of them.

    `verdicts`: None (intact) or the reason, for every checkpoint this process wrote or checked;
    retention hashes none of them again but those in `written`: published here, known intact
    only as hashed while written, so read back before the next save (retention lets an older
    one go only once a newer one was)."""

    def __init__(self, root: Path, keep_last: int, keep_every: int, log: Callable[[str], None]):
        self.root, self.keep_last, self.keep_every, self.log = Path(root), keep_last, keep_every, log
        self.verdicts: dict[str, str | None] = {}
        self.written: set[str] = set()

    def check_before_save(self, is_main: bool) -> None:
        """Every rank: what the publish's retention will ask about and nobody has checked, hashed
        now, shared over the ranks; once one fails, retention looks further back, so again."""
        while todo := broadcast_object(unverified(self.root, self.keep_last, self.verdicts, self.written)
                                       if is_main else None):
            checked = verify_shared(todo)
            self.verdicts.update(checked)
            self.written.difference_update(checked)

    def published(self, ckpt: Path) -> None:
        self.verdicts[str(ckpt)] = None  # hashed as it was written
        self.written.add(str(ckpt))

    def apply(self) -> None:
        """Rank 0, after a publish."""
        retain(self.root, self.keep_last, self.keep_every, self._verdict, self.log, self._read_back)

    def _read_back(self, ckpt: Path) -> bool:
        return self.verdicts.get(str(ckpt), "unknown") is None and str(ckpt) not in self.written

    def _verdict(self, ckpt: Path) -> str | None:
        key = str(ckpt)
        if key not in self.verdicts:  # not reached: check_before_save checked it before the save
            self.verdicts[key] = verify(ckpt)
        return self.verdicts[key]
