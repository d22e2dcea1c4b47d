"""Host syncs of the real training step, counted: each read of a device value on the host.

On a GPU such a read (`.item()`, `.tolist()`, `float(t)`, `int(t)`, `if t`, `.cpu()`) waits
for every kernel queued before it, so the launch queue runs dry. A CPU has no queue, so the
reads are counted instead: `HostReads`, a TorchFunctionMode, sees every such call on a tensor
and counts those made by ndtrain's own lines (torch's internals read host-side scalars, such as
AdamW's step counts, which are no device syncs).

In a dry run every tensor is fake. A read of a value fake mode knows (a constant built from
host numbers) is a host value, not a sync; a read it cannot answer is a device value: the dry
run's operator watch answers it with a stand-in (dryrun_watch.STAND_IN) and lists it, and that
listing is how `HostReads(device_reads=...)` tells the two apart. Without a fake mode (a plain
CPU run in a test), every read counts.

The dry run (`--steps N`) runs what the job loop runs over one logging interval of N steps
(train.log_interval = N): N real `train_step`s, then the interval's one read of their values
(train/step.py read_steps). The step makes none itself; `host_syncs` is the total: one per interval.
Only the first step is measured (memory, FLOPs, operators, traffic); the others are counted."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

from torch.overrides import TorchFunctionMode

from ndtrain.compat.torch import find, splits_tensor

_SRC = Path(__file__).resolve().parents[1]  # the ndtrain package
# The Tensor methods (and Python protocols) that read a tensor's value on the host.
READS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__complex__", "cpu", "numpy"})


@functools.lru_cache(maxsize=None)
def _ndtrain_file(filename: str) -> str | None:
    """'ndtrain/train/step.py' for ndtrain's code other than the counting tools' (None else)."""
    path = Path(filename)
    if _SRC not in path.parents or path.name.startswith("dryrun") or path.parent.name == "compat":
        return None
    return str(path.relative_to(_SRC.parent))


def _ndtrain_line(frame) -> str | None:
    """'ndtrain/train/step.py:123' when `frame` runs ndtrain code other than the counting tools'."""
    name = _ndtrain_file(frame.f_code.co_filename)
    return None if name is None else f"{name}:{frame.f_lineno}"


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host made directly by ndtrain's lines (`where`: one
    entry per read, 'path:line'). `device_reads`, given, is a counter that grows when a read
    reached a device value (the dry run's list of stand-in answers); without it every read counts."""

    def __init__(self, device_reads: Callable[[], int] | None = None):
        super().__init__()
        self.device_reads = device_reads
        self.where: list[str] = []
        self._inside = 0  # > 0 inside a fake tensor's tolist: its per-element reads are that one read
        self._tolist = None

    def _count(self, frame, call: Callable):
        line = None if self._inside else _ndtrain_line(frame)
        if line is None:
            return call()
        before = self.device_reads() if self.device_reads else None
        self._inside += 1
        try:
            out = call()
        finally:
            self._inside -= 1
        if before is None or self.device_reads() != before:
            self.where.append(line)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in READS:
            return func(*args, **kwargs)
        return self._count(sys._getframe(1), lambda: func(*args, **kwargs))

    def __enter__(self):
        # A fake tensor's tolist is Python (an item() per element) that no torch function
        # reaches: it is wrapped while counting, so that it is one read, of its caller's line.
        fake = find("fake_tensor")
        if fake is not None and self._tolist is None:
            self._tolist = original = fake.tolist
            reads = self

            def tolist(tensor):
                return reads._count(sys._getframe(1), lambda: original(tensor))

            fake.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        if self._tolist is not None:
            find("fake_tensor").tolist, self._tolist = self._tolist, None
        return super().__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.where)


def answer_host_probes() -> None:
    """compat.torch's placement probe (run by the gradient norm under FSDP x TP) reads a small
    host tensor it builds, once per process: run now, on real tensors, it is answered before the
    fake mode, where its reads would get stand-ins and be listed as the step's."""
    strided = find("strided_shard")
    if strided is not None:
        splits_tensor(strided(0, split_factor=2))


def finish_interval(state, reads: HostReads, steps: int, step: Callable[[], object]) -> dict:
    """After the interval's first step (run under `reads`): `step()` steps - 1 more times and the
    logging read, under `reads` too; the dry run's `host_syncs` figures for the interval."""
    from ndtrain.train.step import read_steps

    with reads:
        for _ in range(steps - 1):
            step()
        read_steps(state.unread)  # the logging step's read (train/job.py), for all `steps` steps
    return {"host_syncs": reads.count, "host_sync_steps": steps, "host_syncs_per_step": reads.count / steps,
            "host_sync_lines": sorted(set(reads.where))}


def most_syncs(roles: list[dict]) -> dict:
    """`--rank all`: the host-sync figures of the role that syncs most (a pipeline's last stage
    reads what the others do not), whichever role peaks in memory."""
    keys = ("host_syncs", "host_sync_steps", "host_syncs_per_step", "host_sync_lines")
    most = max(roles, key=lambda r: r["host_syncs"])
    return {k: most[k] for k in keys} | {"host_syncs_rank": most["rank"]}


def sync_lines(out: dict) -> list[str]:
    """The report's lines on host syncs."""
    if "host_syncs" not in out:
        return []
    n = out["host_sync_steps"]
    rank = f" on rank {out['host_syncs_rank']}, the role that syncs most" if "host_syncs_rank" in out else ""
    return [f"  host syncs over {n} step(s) and one logging read (train.log_interval = {n}){rank}: "
            f"{out['host_syncs']} ({out['host_syncs_per_step']:.2f} per step)"] + [
        f"    {line}" for line in out["host_sync_lines"]]
