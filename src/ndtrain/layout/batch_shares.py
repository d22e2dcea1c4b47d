"""Uneven data-parallel batch shares: each data-parallel rank takes rows of the global batch in
proportion to its weight (its speed), instead of an equal slice.

Every rank runs the SAME number of micro-batches, so FSDP's per-micro-batch collectives and DDP's
final all-reduce stay in lock-step; a faster rank's micro-batches hold more rows. The step's
loss is normalised by the global token count (BatchSplit.norm_scale), so the gradient is exactly
that of the same global batch on one process, up to fp32 summation order. The loader hands
rank r the rows [sum(rows[:r]), sum(rows[:r + 1])) of each step's contiguous block of the
global stream, so every sample is still seen exactly once whatever the shares, and a resume
with other shares (or none) continues the same stream.

Pure arithmetic (no torch): the config checks, the loader, the step and the balancer share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BALANCE_MODES = ("off", "plan", "measured")


def share_rows(global_batch: int, weights: list[float]) -> list[int]:
    """Rows of each rank, proportional to `weights` and summing to `global_batch`: floors first,
    the rows left over to the largest remainders (ties to the lower rank), so equal weights give
    the equal split."""
    total = float(sum(weights))
    exact = [global_batch * w / total for w in weights]
    rows = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda r: (-(exact[r] - rows[r]), r))
    for r in order[:global_batch - sum(rows)]:
        rows[r] += 1
    return rows


def micro_count(rows: list[int], micro_batch: int) -> int:
    """Micro-batches every rank runs: as many as the largest share needs at `micro_batch` rows
    (train.micro_batch stays the most rows any rank runs at once: the memory bound)."""
    return -(-max(rows) // micro_batch)


def micro_sizes(rows: int, count: int) -> list[int]:
    """`rows` split into `count` micro-batches of near-equal size (the first ones one larger)."""
    base, extra = divmod(rows, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


@dataclass(frozen=True)
class BatchSplit:
    """One step's uneven split, as this rank sees it."""

    rows: tuple[int, ...]  # every data-parallel rank's rows this step
    rank: int  # this rank's data-parallel index
    micro_batches: int  # every rank runs this many

    @property
    def mean_rows(self) -> float:
        return sum(self.rows) / len(self.rows)

    @property
    def norm_scale(self) -> float:
        """Factor on this rank's token count that makes the normaliser the global tokens over the
        ranks FSDP/DDP average across: a rank's loss / (its tokens x mean/own rows), averaged over
        ranks, is the global token mean."""
        return self.mean_rows / self.rows[self.rank]

    def slices(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in micro_sizes(self.rows[self.rank], self.micro_batches):
            out.append((start, start + n))
            start += n
        return out


def make_split(global_batch: int, weights: list[float], rank: int, micro_batch: int) -> BatchSplit:
    rows = share_rows(global_batch, weights)
    return BatchSplit(tuple(rows), rank, micro_count(rows, micro_batch))


def shares_problem(weights: list[float], dp: int, batches: list[int], micro_batch: int) -> str | None:
    """Why `weights` cannot split these global batches over `dp` ranks (None: they can)."""
    if len(weights) != dp:
        return f"has {len(weights)} entries but the data-parallel degree is {dp} (one weight per data-parallel rank)"
    if not all(math.isfinite(w) and w > 0 for w in weights):
        return f"weights must be positive numbers, got {list(weights)}"
    for gb in batches:
        rows = share_rows(gb, weights)
        n = micro_count(rows, micro_batch)
        if min(rows) < n:
            r = rows.index(min(rows))
            return (f"{list(weights)} gives rank {r} {rows[r]} of the {gb} rows of a global batch, fewer than the "
                    f"{n} micro-batches every rank runs (rows {rows}, train.micro_batch {micro_batch}); "
                    f"even the weights out or raise train.micro_batch")
    return None


def check_shares(weights: list[float], dp: int, batches: list[int], micro_batch: int,
                 key: str = "parallel.batch_shares") -> None:
    """shares_problem as the one-line refusal naming `key` (the launcher, `config check --world`
    and the run's start all call this)."""
    why = shares_problem(weights, dp, batches, micro_batch)
    if why:
        from ndtrain.errors import ConfigError

        raise ConfigError(key, why)


def from_speeds(speeds: list[float]) -> list[float]:
    """Weights from per-rank speeds (rows per second), scaled to sum to 1 and rounded to 4
    places: stable in a checkpoint and in a printed line."""
    total = sum(speeds)
    return [round(s / total, 4) for s in speeds]


@dataclass(frozen=True)
class Rebalance:
    weights: list[float]  # the new weights
    imbalance: float  # the slowest rank's busy time per step over the mean, minus 1


def rebalance(rows: list[int], busy_s: list[float], threshold: float) -> Rebalance | None:
    """From each rank's own compute time per step (`busy_s`, never wall time: a step's collectives
    make wall time equal) at its current `rows`: new weights proportional to each rank's rows per
    busy second, when the slowest rank is busy more than `threshold` over the mean (the step
    waits for it); None when balanced enough or when a time is missing."""
    if len(rows) < 2 or not all(math.isfinite(t) and t > 0 for t in busy_s):
        return None
    mean = sum(busy_s) / len(busy_s)
    imbalance = max(busy_s) / mean - 1
    if imbalance <= threshold:
        return None
    return Rebalance(from_speeds([n / t for n, t in zip(rows, busy_s)]), imbalance)
