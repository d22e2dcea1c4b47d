"""What one optimizer step reports, kept on the device until someone asks for it.

On a GPU every read of a device value on the host (`float(t)`, `.item()`, `.tolist()`, `if t`)
waits for every kernel queued before it: the launch queue runs dry and the next step's kernels
start late. So train_step reads nothing: its loss, gradient norm and whether its update was
applied stay in one small float64 vector on the device, and the step's StepResult holds it.
The first time any of them is asked for, every step not yet read is read together, in one
transfer (`read_steps`), and each result settles in step order (the gradient-noise-scale EMAs
update then). The job loop asks on logging steps (and before a checkpoint or a rollback), so a
run reads the device once per `train.log_interval`, not once per step. What else a step
produces on the device rides in the same read: the MoE routing statistics (appended to the
vector past WIDTH, handed to the step's `on_read`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

# The device vector's entries: the step's mean loss, its gradient norm, 1.0 when the update
# was applied (loss and norm finite) else 0.0, the first micro-batch's squared gradient norm
# (NaN when the noise scale is not measured) and the step's squared gradient norm.
# Entries past WIDTH: the step's own additions (MoE statistics), for its `on_read`.
LOSS, GRAD_NORM, APPLIED, SMALL_SQ, GRAD_SQ = range(5)
WIDTH = 5


class StepResult:
    """One step's report. `loss`, `grad_norm` and `skipped` are plain values, or, once `defer`
    hands it its device vector, read from the device the first time one is asked for."""

    def __init__(self, step: int, loss: float = math.nan, grad_norm: float = math.nan, lr: float = 0.0,
                 tokens: int = 0, seconds: float = 0.0, skipped: bool = False, extra: dict | None = None,
                 sample_ids: torch.Tensor | None = None, rows: list | None = None):
        self.step, self.lr, self.tokens, self.seconds = step, lr, tokens, seconds
        self.extra = {} if extra is None else extra
        self.sample_ids = sample_ids  # the global sample numbers this rank trained on
        self.rows = [] if rows is None else rows  # DiLoCo's outer-step rows, for metrics.jsonl
        self._values = (loss, grad_norm, skipped)
        self._device: torch.Tensor | None = None
        self._queue: list | None = None
        self._on_read: list[Callable] = []
        self._ended = 0.0  # perf_counter when the step returned (its device work may still run)

    def defer(self, values: torch.Tensor, queue: list, on_read: list[Callable] = ()) -> StepResult:
        """Holds `values` (the WIDTH-vector above and any additions, on the device) unread in
        `queue` (the state's, in step order); each `on_read(result, row)` runs when it is read,
        before any later step's."""
        self._device, self._queue, self._on_read = values, queue, list(on_read)
        queue.append(self)
        return self

    @property
    def unread(self) -> bool:
        return self._device is not None

    def finished(self, seconds: float) -> None:
        """The step's host time; a later read adds its share of the wait for the device."""
        self.seconds, self._ended = seconds, time.perf_counter()

    def override_skipped(self, skipped: bool) -> None:
        """DiLoCo: a step counts as skipped when any replica skipped it (read by then)."""
        self._values = (*self._values[:2], skipped)

    def _settle(self, row: list[float]) -> None:
        self._device = self._queue = None
        self._values = (row[LOSS], row[GRAD_NORM], row[APPLIED] == 0.0)
        on_read, self._on_read = self._on_read, []
        for callback in on_read:
            callback(self, row)

    def _get(self, i: int):
        if self._device is not None:
            read_steps(self._queue)
        return self._values[i]

    @property
    def loss(self) -> float:
        return self._get(0)

    @property
    def grad_norm(self) -> float:
        return self._get(1)

    @property
    def skipped(self) -> bool:
        return self._get(2)


def read_steps(queue: list) -> None:
    """Reads every unread step of `queue` in one device-to-host transfer and settles them in order."""
    if not queue:
        return
    pending = list(queue)
    queue.clear()
    device = pending[-1]._device.device
    vectors = [r._device for r in pending]
    flat = torch.cat(vectors).tolist()  # the one read (a step's vector may be longer: MoE)
    rows, at = [], 0
    for v in vectors:
        rows.append(flat[at:at + v.numel()])
        at += v.numel()
    # On an asynchronous device (not the CPU) unread steps returned when their work was queued,
    # not done: the read waited for the rest. Each gets an equal share, so the interval's step
    # times add up to its wall time.
    ended, wait = pending[-1]._ended, 0.0
    if ended and device.type != "cpu":
        wait = max(0.0, time.perf_counter() - ended) / len(pending)
    for result, row in zip(pending, rows):
        result.seconds += wait
        result._settle(row)
