"""Each rank's busy time, the straggler monitor's input: the compute a rank did in a step, never
its wall time (which waiting for the slowest peer in a collective makes the same on every rank)."""

from __future__ import annotations

import threading
import time

import torch


def thread_demand_s() -> float:
    """Seconds the calling thread has run or waited to run: its CPU time plus its run-queue wait
    (Linux /proc/.../schedstat; the CPU time alone where that file is missing). A thread blocked in
    a collective is neither; a thread whose node is throttled (a cgroup CPU quota) or whose cores
    other work takes waits on the run queue: CPU time alone cannot see that node as slow, since
    the work costs the same CPU time however long it waits for it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            ran_ns, waited_ns = f.read().split()[:2]
        return (int(ran_ns) + int(waited_ns)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


class CpuBusyTimer:
    """The training thread's demand for a CPU (thread_demand_s): time blocked in a collective
    waiting for a slow peer is not counted, so the slow rank stands out though every rank's wall
    time is the same, whether it is slow from more work or from less CPU."""

    def start(self) -> None:
        self._t0 = thread_demand_s()

    def stop(self, lazy: bool = False) -> float:
        return thread_demand_s() - self._t0  # the CPU's clock: read at once, lazy or not

    def close(self) -> None:
        pass


class CudaBusyTimer:
    """GPU time of each rank's own compute, from CUDA events recorded on the current stream around
    every forward of `modules` (the decoder blocks and the head).
    A step's wall time, and the GPU time from its start to its end, include waiting for the
    slowest peer in the step's collectives and so are the same on every rank; inside a block the
    stream runs only that rank's kernels (FSDP2's pre-forward hook, prepended to ours, has already
    made the stream wait for its all-gather before the start event). Collectives inside a block
    (TP, CP's ring, EP's all-to-alls) are timed with it. The step itself never waits for the
    device (train/step.py: read_steps), so reading the events is a sync: `stop(lazy=True)` leaves it
    to the caller, who reads a whole straggler window's steps at once."""

    def __init__(self, modules, event=None):
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._pairs: list | None = None  # None: not timing (outside a step, e.g. validation)
        self._open: dict[int, object] = {}
        self._hooks = []
        # Host-side bookkeeping that compiled blocks must run eagerly around their graph. Wrapped
        # here, not by a decorator at import: torch.compiler.disable imports torch._dynamo, ~3 s of
        # CPU in every process that imports this module, though only a CUDA run builds this timer.
        eager = torch.compiler.disable
        for m in modules:
            self._hooks.append(m.register_forward_pre_hook(eager(self._begin)))
            self._hooks.append(m.register_forward_hook(eager(self._end)))

    def _begin(self, module, args) -> None:
        if self._pairs is not None:
            self._open[id(module)] = ev = self._event()
            ev.record()

    def _end(self, module, args, output) -> None:
        start = self._open.pop(id(module), None)
        if self._pairs is not None and start is not None:
            end = self._event()
            end.record()
            self._pairs.append((start, end))

    def start(self) -> None:
        self._pairs, self._open = [], {}

    def stop(self, lazy: bool = False):
        """The step's busy seconds; `lazy`: a callable that reads them when called."""
        pairs, self._pairs = self._pairs or [], None

        def busy() -> float:
            if pairs:
                pairs[-1][1].synchronize()  # the host waits for the step's last block
            return sum(a.elapsed_time(b) for a, b in pairs) / 1e3  # elapsed_time is in ms

        return busy if lazy else busy()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._pairs = [], None


def busy_timer(device: torch.device, modules, event=None):
    """The straggler monitor's clock for `device`: compute time, never wall time."""
    return CudaBusyTimer(modules, event) if device.type == "cuda" else CpuBusyTimer()
