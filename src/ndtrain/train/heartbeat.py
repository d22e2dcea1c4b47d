"""Who stopped answering, for the watchdog's line. A rank whose step runs past its deadline is
usually waiting on a peer inside a collective; its own stack says only that it waits. Each rank
beats in the group's store (MASTER_ADDR:MASTER_PORT, the TCPStore that formed the group) from a
thread of its own, with the step it is in; the rank whose deadline passed reads every rank's
beat count twice, a few beats apart, and names the ranks whose count did not move (a frozen or
lost process or node) or that are behind in steps (a rank stuck before the collective), each
with its host. A store that does not answer names its own host: it lives on rank 0's node.

The beats are one small store request per rank per interval, from a daemon thread; nothing here
touches the process group, so it cannot hang the training thread.
"""

from __future__ import annotations

import threading
from datetime import timedelta

from ndtrain.launch_env import master_addr, master_port

STORE_PREFIX = "ndtrain-heartbeat"


def _client(host: str, port: int, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Heartbeat:
    """Beats for `rank` every `interval_s` in the store at host:port, under this attempt's own
    key prefix (`attempt`: a restart's ranks must not read their predecessors' counts)."""

    def __init__(self, rank: int, world: int, host: str, port: int, hostname: str, attempt: str,
                 interval_s: float = 1.0, timeout_s: float = 5.0):
        self.rank, self.world, self.host, self.port = rank, world, host, port
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.prefix = f"{STORE_PREFIX}/{attempt}"
        self.step = 0  # set by the training thread; the beat thread publishes it
        self._stop = threading.Event()
        self._store = _client(host, port, timeout_s)
        self._store.set(f"{self.prefix}/host/{rank}", hostname)
        self._thread = threading.Thread(target=self._run, name="ndtrain-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, rank: int, world: int, hostname: str, attempt: str, interval_s: float) -> Heartbeat | None:
        """None for one process, or where the launcher named no store (the group formed otherwise)."""
        if world <= 1:
            return None
        host, port = master_addr(), master_port()
        if not host or port is None:
            return None
        try:
            return cls(rank, world, host, port, hostname, attempt, interval_s)
        except (RuntimeError, ValueError, OSError):  # no store to beat in: the watchdog's line says less
            return None

    def _run(self) -> None:
        published = None
        while not self._stop.wait(self.interval_s):
            try:
                if self.step != published:
                    published = self.step
                    self._store.set(f"{self.prefix}/step/{self.rank}", str(published))
                self._store.add(f"{self.prefix}/beat/{self.rank}", 1)
            except (RuntimeError, ValueError, OSError):
                continue  # the store's node is gone or cut off: the next beat tries again

    def silent(self, beats: int = 3) -> str:
        """One clause naming who stopped answering, read from a client of its own (the beat thread's
        may be stuck in a request): waits `beats` intervals between two reads of every count. A
        frozen store's kernel still accepts the connection and the client then waits without end,
        whatever its timeout: the reads run in a thread of their own, given a bounded time."""
        found: list[str] = []
        reader = threading.Thread(target=lambda: found.append(self._read(beats)), name="ndtrain-heartbeat-read",
                                  daemon=True)
        reader.start()
        reader.join(beats * self.interval_s + 2 * self.timeout_s)
        if found and found[0]:
            return found[0]
        return (f"the group's store at {self.host}:{self.port} does not answer either: rank 0's node "
                f"({self.host}) stopped answering")

    def _read(self, beats: int) -> str:
        """The clause, or '' where the store refused or timed out."""
        try:
            store = _client(self.host, self.port, self.timeout_s)
            first = self._counts(store)
            self._stop.wait(beats * self.interval_s)
            second = self._counts(store)
            steps = [int(self._get(store, f"step/{r}", "0")) for r in range(self.world)]
            hosts = [self._get(store, f"host/{r}", "?") for r in range(self.world)]
        except (RuntimeError, ValueError, OSError):
            return ""
        mine = steps[self.rank]
        quiet = [r for r in range(self.world) if r != self.rank and second[r] == first[r]]
        if quiet:
            who = ", ".join(f"rank {r} on host {hosts[r]}" for r in quiet)
            return f"waiting on {who}, which stopped answering (no heartbeat in {beats * self.interval_s:g} s)"
        behind = [r for r in range(self.world) if steps[r] < mine]
        if behind:
            who = ", ".join(f"rank {r} on host {hosts[r]} (step {steps[r]})" for r in behind)
            return f"every rank answers; behind this rank's step {mine}: {who}"
        return f"every rank answers and is in step {mine}: the hang is inside the step itself"

    def _counts(self, store) -> list[int]:
        return [store.add(f"{self.prefix}/beat/{r}", 0) for r in range(self.world)]

    def _get(self, store, key: str, default: str) -> str:
        full = f"{self.prefix}/{key}"
        return store.get(full).decode() if store.check([full]) else default

    def close(self) -> None:
        self._stop.set()
