"""Job hooks: the one way for a test or a drill to act inside a training process, at the points
the job offers. The chaos, preemption, self-healing and end-of-run tests use it to kill, hang or
slow a rank and to record what each step trained on (their FaultPlan is tests/train/fault_plan.py,
not shipped); nothing in ndtrain needs it.

    NDTRAIN_JOB_HOOKS="module:function"      # the module importable by every rank (PYTHONPATH)

Each rank's job calls `function(rank=rank, log_path=path)` once, before its first step (`path`:
`faults.log` in the run directory, a run file: a hook may append what it did there, None
without a run directory). It returns an object with any of:

    at_step(step)               step `step` is about to run (the watchdog armed, busy time counted)
    after_step(result)          step `result.step` is done and kept (not rolled back): its StepResult
                                (loss, grad norm, the global sample numbers this rank trained on)
    at_checkpoint(step, point)  inside the save of step `step`: "save" (the async write started),
                                "publish" (rank 0, manifest written, marker not yet), "rename"
    close()                     the loop is over (also after an error)
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from ndtrain.errors import NdtrainError

HOOKS_ENV = "NDTRAIN_JOB_HOOKS"
HOOK_LOG = "faults.log"  # the run file a hook may write (run_files.RUN_FILES)


class JobHooks:
    """The hook points, each a no-op: what a run without NDTRAIN_JOB_HOOKS calls, and what a
    hook object lacks falls back to."""

    def __init__(self, inner: object | None = None):
        self.inner = inner

    def _call(self, name: str, *args) -> None:
        fn = getattr(self.inner, name, None)
        if fn is not None:
            fn(*args)

    def at_step(self, step: int) -> None:
        self._call("at_step", step)

    def after_step(self, result) -> None:
        self._call("after_step", result)

    def at_checkpoint(self, step: int, point: str) -> None:
        self._call("at_checkpoint", step, point)

    def close(self) -> None:
        self._call("close")


def load(rank: int, run_dir: Path | None) -> JobHooks:
    """This rank's hooks from NDTRAIN_JOB_HOOKS (no-ops when unset); a bad value is one line."""
    spec = os.environ.get(HOOKS_ENV, "").strip()
    if not spec:
        return JobHooks()
    module_name, _, func_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), func_name) if func_name else None
    except (ImportError, AttributeError) as exc:
        raise NdtrainError(f"{HOOKS_ENV}={spec!r}: {exc} (module:function, the module on PYTHONPATH)") from None
    if not callable(factory):
        raise NdtrainError(f"{HOOKS_ENV}={spec!r} names no function (module:function)")
    return JobHooks(factory(rank=rank, log_path=Path(run_dir) / HOOK_LOG if run_dir is not None else None))
