"""How much memory this host can still give this process: the one probe that sampling
(generate.does_not_fit) and `ndtrain import` (interop.import_hf) size their work against.
Linux only; elsewhere it says nothing (None) and the callers do not refuse."""

from __future__ import annotations

from pathlib import Path


def available_bytes() -> int | None:
    """MemAvailable, or less where a cgroup (a container, a Slurm step) caps this process; None
    where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
