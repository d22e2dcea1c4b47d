"""Python's garbage collector on a schedule: every rank collects on the same steps.

Left automatic, the cyclic collector runs whenever a rank's allocation count crosses a
threshold, so each rank pauses at a different step; in a synchronous job every collective then
waits for whichever rank is collecting, and at a thousand ranks some rank collects on almost
every step. With `train.gc_every = N` the loop turns the automatic collector off, and every
rank runs one full collection after each N-th step (the step number is the same everywhere,
so no communication is needed): the pauses line up, and the job pays for one rank's pause
every N steps instead of the slowest of all ranks' on most steps.

A full collection (generation 2), not a young one: with the automatic collector off, nothing
else ever collects the oldest generation, so cycles that outlived one collection would stay
until the process ends. What the job built before the loop (model, optimizer, modules,
imports) is moved out of the collector's sight with gc.freeze(), so a full collection walks
only what the loop has allocated since and costs about what a young one does
(docs/launch.md, "Garbage collection", has the pauses measured on the tiny model:
benchmarks/gc_pause.py).

`gc_every = 0` leaves the collector as it was. On exit the collector is put back as found:
enabled if it was, and the frozen objects returned to the oldest generation.
"""

from __future__ import annotations

import gc


class GcSchedule:
    """`start()` before the loop, `after_step(step)` after each step, `stop()` however the loop
    ends. `collect` is gc.collect (a parameter so tests count the calls)."""

    def __init__(self, every: int, collect=gc.collect):
        self.every, self._collect = int(every), collect
        self._was_enabled, self._active = gc.isenabled(), False

    def start(self) -> "GcSchedule":
        self._was_enabled = gc.isenabled()
        if self.every > 0:
            self._collect()  # start from a clean heap, so what is frozen next is live state only
            gc.freeze()
            gc.disable()
            self._active = True
        return self

    def after_step(self, step: int) -> None:
        if self._active and step % self.every == 0:
            self._collect()

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
