"""The gradient noise scale measured during a run, and the batch `train.batch_ramp = "auto"` grows
toward with it (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", app. A).

Two gradients every accumulating step already has: the first micro-batch's (B_small sequences:
one micro-batch per rank, times the data-parallel ranks where ZeRO-2/3 reduce every micro-batch)
and the step's whole one (B_big = the global batch). With |G_B|^2 their squared norms,

    |G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S     ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

are unbiased; each is smoothed by its own EMA and B_noise = EMA(S) / EMA(|G|^2) (the ratio of
EMAs, not the EMA of the noisy ratio). Cost: one more squared-norm pass over the gradients after
the first micro-batch (the same work as the clipping norm) and its scalar in the step's existing
all-reduce. No read of its own: both norms ride in the step's device vector, and the EMAs take
each step's in order when the job loop reads them (train/step.py: read_steps), once per logging
interval and before every checkpoint save, so the checkpoint's EMAs are current.

A decision changes the batch only at a checkpoint boundary and is recorded as a ramp point
[tokens_seen, global_batch] in the checkpoint (progress.batch_points), which
train/optim.py's global_batch_at reads like a fixed ramp: exactly-once data and resume follow from that."""

from __future__ import annotations

import math

EMA_DECAY = 0.95  # ~20 steps: one step's estimate is too noisy to act on (the paper smooths too)


def unsupported(layout, diloco: bool) -> str | None:
    """Why this layout cannot read the first micro-batch's gradient (None: it can)."""
    if diloco:
        return "DiLoCo replicas step on their own gradients"
    if layout.pp > 1:
        return "pipeline schedules run the micro-batches inside the schedule"
    if layout.dp > 1 and not layout.grads_sharded_per_microbatch:
        return ("ZeRO-1 and plain replication reduce the gradient only after the last micro-batch "
                "(use parallel.zero = 2 or 3)")
    return None


def small_batch(layout, rows: int) -> int:
    """Sequences behind the gradient after the first micro-batch of `rows` rows per rank."""
    return rows * (layout.dp if layout.dp > 1 else 1)


class NoiseScale:
    """EMAs of the two unbiased estimates; `state` is what the checkpoint keeps."""

    def __init__(self, state: list[float] | None = None):
        self.g2, self.s = state if state else (0.0, 0.0)

    @property
    def state(self) -> list[float]:
        return [self.g2, self.s]

    def update(self, small_sq: float, b_small: int, big_sq: float, b_big: int) -> float | None:
        """Adds one step's norms; returns the smoothed B_noise (None before it is defined)."""
        if b_big <= b_small or not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return None
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        s = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
        first = self.g2 == 0.0 and self.s == 0.0
        self.g2 = g2 if first else EMA_DECAY * self.g2 + (1 - EMA_DECAY) * g2
        self.s = s if first else EMA_DECAY * self.s + (1 - EMA_DECAY) * s
        return self.s / self.g2 if self.g2 > 0 else None


def grow(cfg, progress, noise: float | None, current: int) -> str | None:
    """At a checkpoint boundary: double the batch (at most once a boundary, within the limits) while
    the measured noise scale is at least the doubled batch; the decision becomes a ramp point from
    the tokens seen now. Returns the line saying so, or None."""
    if noise is None or not math.isfinite(noise):
        return None
    nxt = current * 2
    if nxt > cfg.train.batch_auto_max or noise < nxt:
        return None
    progress.batch_points.append([progress.tokens_seen, nxt])
    return (f"batch_ramp auto: gradient noise scale {noise:.0f} sequences at step {progress.step} >= {nxt}: "
            f"global batch {current} -> {nxt} from {progress.tokens_seen} tokens (train.batch_auto_max "
            f"{cfg.train.batch_auto_max})")
