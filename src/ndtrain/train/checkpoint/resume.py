"""Which checkpoint a resume loads, whether it fits this run, and which timeline follows.
Every rank takes part and gets the same answer. The rules (docs/checkpoints.md):

- `resume=auto` loads the newest checkpoint that verifies; those that fail are skipped and moved
  to corrupt/ once an older one verifies. One that finds checkpoints but none usable stops with
  one line (nothing_usable); it starts from scratch only where no checkpoint ever was.
- A checkpoint named explicitly must verify: no fallback.
- One directory, one timeline. Resuming from a checkpoint older than the newest one there
  starts a new timeline: before training, the newer checkpoints (the abandoned timeline) move to
  `abandoned-<time>/`, so `resume=auto` after a later crash continues the new timeline. The move
  is journalled (`.abandoning-from-<step>-<time>/` first), so a crash halfway is finished at the
  next start instead of leaving the old timeline's newest checkpoint to be resumed.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.train.checkpoint.digest import verify_shared
from ndtrain.train.checkpoint.retention import CORRUPT, move_to_corrupt, stamp
from ndtrain.train.checkpoint.store import MARKER, TRAIN_STATE, list_checkpoints, model_mismatch, step_of
from ndtrain.train.distributed import broadcast_object

ABANDONING = ".abandoning-from-"
_JOURNAL = re.compile(r"^\.abandoning-from-\d{8}-\d{8}-\d{6}$")  # ABANDONING + step + stamp(): only ours


def choose_checkpoint(spec: str, root: Path, batch: int, is_main: bool, verdicts: dict,
                      info: Callable[[str], None], group=None) -> tuple[Path | None, str | None]:
    """Every rank: the newest candidate for `spec` ("auto" or a path) that verifies, the hashing
    shared out over the ranks `batch` candidates at a time; (None, None) when no checkpoint
    ever existed (a fresh start), or (None, why) when the user's choice cannot be used or every
    checkpoint there is damaged. `verdicts` collects what was checked. Candidates that fail are
    skipped, and moved to corrupt/ (when they are in `root`) once an older one verifies: a
    resume that finds nothing usable leaves everything where it was. `group`: the process group
    of the collectives (None: the default one)."""
    plan = resume_candidates(spec, root) if is_main else None
    candidates, error, explicit = broadcast_object(plan, group=group)
    if error:
        return None, error
    failed: list[str] = []
    for i in range(0, len(candidates), batch):
        checked = verify_shared([Path(c) for c in candidates[i:i + batch]], group=group)
        verdicts.update(checked)
        for c in candidates[i:i + batch]:
            if checked[c] is None:
                for bad in failed if is_main else ():
                    _set_aside(Path(bad), root, verdicts[bad], info)
                return Path(c), None
            if explicit:
                return None, f"cannot resume from {c}: {checked[c]}"
            failed.append(c)
    if not failed:
        return None, None
    newest = f"{Path(failed[0]).name}: {verdicts[failed[0]]}"
    if spec != "auto":  # the user named a directory: none of it is usable
        return None, f"no intact checkpoint under {spec} ({len(failed)} failed verification; {newest})"
    # asked to resume, and this run's checkpoints exist but none is usable
    return None, nothing_usable(root, f"{len(failed)} failed verification; {newest}")


def _set_aside(ckpt: Path, root: Path, problem: str, info: Callable[[str], None]) -> None:
    if ckpt.parent.resolve() == root.resolve():  # never rearrange another run's directory
        target = move_to_corrupt(ckpt, root)
        info(f"checkpoint {ckpt} skipped: {problem}; moved to {target} (nothing deleted)")
    else:
        info(f"checkpoint {ckpt} skipped: {problem} (nothing deleted)")


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


def check_compatible(path: Path, state: dict, cfg, data: dict) -> None:
    """Refuses (on every rank) a checkpoint whose model computes something else than this run's,
    or, for a full checkpoint, one trained on other data (`data`: this run's fingerprint)."""
    problem = model_mismatch(cfg.model, state, cfg.checkpoint.allow_model_change)
    if problem:
        raise NdtrainError(f"checkpoint {path} {problem}", all_ranks=True)
    if state.get("kind", "full") != "full":
        return
    saved = state.get("data")
    if saved and saved != data:
        diff = [k for k in data if saved.get(k) != data[k]]
        raise NdtrainError(f"checkpoint {path} was trained on different data ({', '.join(diff)} differ from "
                           f"{cfg.data.path}); resuming would not continue the same sample stream", all_ranks=True)


# ---- timelines ---------------------------------------------------------------------------------

def new_timeline(parent: str | None = None) -> dict:
    return {"id": uuid.uuid4().hex[:12], "parent": parent}


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


def abandon_newer(root: Path, step: int, log) -> None:
    """Starts a new timeline at `step`: checkpoints after it move to `abandoned-<time>/`."""
    root = Path(root)
    if not any(step_of(c) > step for c in list_checkpoints(root)):
        return
    (root / f"{ABANDONING}{step:08d}-{stamp()}").mkdir()
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
