"""The price of a run whose global batch steps up by tokens seen (`[train] batch_ramp`): each
segment of the ramp trains its tokens at its own batch's step time, so the run's time is the sum
over segments and its throughput the time-weighted mean. No torch: the step time of a batch comes
from the caller (the planner's prediction for one layout)."""

from __future__ import annotations

from typing import Callable

from ndtrain.errors import NdtrainError


def parse_ramp(text: str) -> list[list[int]]:
    """`--batch-ramp` as train.batch_ramp writes it: [[tokens_seen, global_batch], ...] (JSON)."""
    import json

    try:
        ramp = json.loads(text)
        ok = isinstance(ramp, list) and all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, (int, float)) for x in r)
            and r[0] >= 0 and r[1] >= 1 and float(r[1]).is_integer() for r in ramp)
    except ValueError:
        ok = False
    if not ok:
        raise NdtrainError(f"--batch-ramp must be [[tokens_seen, global_batch], ...] as in train.batch_ramp, got {text!r}")
    return [[int(t), int(b)] for t, b in ramp]


def segments(budget: float, base_batch: int, ramp: list[list[int]]) -> list[tuple[int, float]]:
    """[(global batch, tokens trained at it)] over a budget of `budget` tokens, in order; the rule
    is the runtime's (train/optim.py: global_batch_at): the last threshold at or under the tokens seen wins."""
    points = sorted(ramp)
    start_batch = base_batch
    for t, b in points:  # thresholds at 0 replace the base batch from the first step
        if t <= 0:
            start_batch = b
    out, at, batch = [], 0.0, start_batch
    for t, b in points:
        if t <= 0:
            continue
        end = min(float(t), budget)
        if end > at:
            out.append((batch, end - at))
            at = end
        batch = b
    if budget > at:
        out.append((batch, budget - at))
    return out


def price(budget: float, base_batch: int, ramp: list[list[int]], seq: int,
          step_seconds: Callable[[int], float]) -> dict:
    """The run's seconds, steps and time-weighted tokens/s, with each segment's share.
    (Each step trains batch x seq tokens; a segment's last step may cross its threshold, which
    the runtime does too: that rounding is at most one step per segment and is ignored here.)"""
    rows, seconds, steps = [], 0.0, 0.0
    for batch, tokens in segments(budget, base_batch, ramp):
        s = step_seconds(batch)
        n = tokens / (batch * seq)
        rows.append({"global_batch": batch, "tokens": tokens, "steps": n, "step_s": s, "seconds": n * s,
                     "tokens_per_s": batch * seq / s})
        seconds += n * s
        steps += n
    return {"segments": rows, "seconds": seconds, "days": seconds / 86400, "steps": steps,
            "tokens_per_s": budget / seconds if seconds > 0 else 0.0}
