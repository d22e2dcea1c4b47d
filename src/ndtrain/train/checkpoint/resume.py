"""Which checkpoint a resume loads: every rank takes part and gets the same answer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ndtrain.train.checkpoint import retention
from ndtrain.train.checkpoint.digest import verify_shared
from ndtrain.train.distributed import broadcast_object


def choose(spec: str, root: Path, batch: int, is_main: bool, verdicts: dict,
           info: Callable[[str], None]) -> tuple[Path | None, str | None]:
    """Every rank: the newest candidate for `spec` ("auto" or a path) that verifies, the hashing
    shared out over the ranks `batch` candidates at a time; (None, None) when no checkpoint
    ever existed (a fresh start), or (None, why) when the user's choice cannot be used or every
    checkpoint there is damaged. `verdicts` collects what was checked. Candidates that fail are
    skipped, and moved to corrupt/ (when they are in `root`) once an older one verifies: a
    resume that finds nothing usable leaves everything where it was."""
    plan = retention.resume_candidates(spec, root) if is_main else None
    candidates, error, explicit = broadcast_object(plan)
    if error:
        return None, error
    failed: list[str] = []
    for i in range(0, len(candidates), batch):
        checked = verify_shared([Path(c) for c in candidates[i:i + batch]])
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
    return None, retention.nothing_usable(root, f"{len(failed)} failed verification; {newest}")


def _set_aside(ckpt: Path, root: Path, problem: str, info: Callable[[str], None]) -> None:
    if ckpt.parent.resolve() == root.resolve():  # never rearrange another run's directory
        target = retention.move_aside(ckpt, root)
        info(f"checkpoint {ckpt} skipped: {problem}; moved to {target} (nothing deleted)")
    else:
        info(f"checkpoint {ckpt} skipped: {problem} (nothing deleted)")
