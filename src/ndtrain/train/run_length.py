"""How long a run trains, and how long it has left: `[train] time_budget_s` turned into a step
count by the planner's predicted step time on this machine (plan.py applies it), the line that
says before the first step how long the run will take, and the time left on the step lines.

Why a time budget and not a fixed step count: per-core speed differs several-fold between the
hosts ndtrain meets (0.8 s/step of `make train`'s model on an Intel AMX host, ~4.4 on a first-
generation AMD EPYC), so a count that takes 2 minutes on one takes 11 on the next. The count is
fixed before the first step, from the plan, because the cosine schedule is laid over it: a
restart on the same host and world derives the same count (the planner is pure, the host probe
cached); `train.time_budget_s = 0` trains exactly `train.steps`.
"""

from __future__ import annotations

import math
from time import monotonic

from ndtrain.errors import NdtrainError


def budget_steps(budget_s: float, step_s: float, max_steps: int, min_steps: int = 1) -> int:
    """The steps that fit `budget_s` seconds at `step_s` a step: at least `min_steps`, at most
    `max_steps` (which caps the floor too)."""
    if step_s <= 0:
        return max_steps
    return max(min(min_steps, max_steps), 1, min(max_steps, math.floor(budget_s / step_s)))


def duration(seconds: float) -> str:
    """'45s', '2m10s', '1h05m': how the lines say a time."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def priced_step(cfg, world: int, hardware) -> float | None:
    """The planner's seconds per step for the layout `cfg` holds (None where it cannot price it)."""
    from ndtrain.layout import fill_degrees, from_config
    from ndtrain.planner.api import predict_step_time
    from ndtrain.train.plan_choices import planned_for

    try:
        layout = fill_degrees(from_config(cfg.parallel, cfg.train, cfg.data), world)
        return predict_step_time(cfg.model, layout.as_dict(), cfg.data.seq_len, cfg.train.global_batch,
                                 planned_for(cfg, hardware), world=world, precision=layout.mixed_precision)
    except NdtrainError:
        return None


def budget_choice(cfg, step_s: float | None) -> dict:
    """`train.time_budget_s` (> 0) as {"overrides", "description"}: the steps the planner's
    `step_s` (None: it could not price the layout) fits in the budget, at most train.steps."""
    t = cfg.train
    if step_s is None:
        return {"overrides": {}, "description": f"train.time_budget_s = {t.time_budget_s:g}: the planner cannot price "
                                                f"this layout, so the run trains train.steps = {t.steps}"}
    steps = budget_steps(t.time_budget_s, step_s, t.steps, t.time_budget_min_steps)
    fits = math.floor(t.time_budget_s / step_s) if step_s > 0 else t.steps
    cap = " (train.steps, the most it trains)" if steps == t.steps else \
        f" (train.time_budget_min_steps: the budget fits only {fits}; about {duration(steps * step_s)} here)" \
        if steps > fits else f" of at most {t.steps}"
    return {"overrides": {"train": {"steps": steps}},
            "description": f"train.time_budget_s = {t.time_budget_s:g}: {steps} steps{cap} at the predicted "
                           f"{step_s:.3f} s/step"}


def start_line(plan, done: int) -> str:
    """Before the first step: how many steps this attempt trains (`done`: the step it resumes
    from) and, where the planner priced them, about how long that takes on this machine; '' where
    the planner chose nothing and no budget was set."""
    if plan.prediction is None and not plan.budget:
        return ""
    steps = plan.config.train.steps
    what = f"training {steps - done} steps" + (f" (from step {done} to {steps})" if done else "")
    budget = f"; {plan.budget}" if plan.budget else ""
    if plan.prediction is None:
        return what + budget
    from ndtrain.train.plan_choices import UNCALIBRATED_ERROR

    step_s = plan.prediction.step_s
    note = f" (uncalibrated: {UNCALIBRATED_ERROR})" if plan.prediction.uncalibrated else ""
    return (f"{what}: about {duration((steps - done) * step_s)} at the planner's {step_s:.3f} s/step on this "
            f"machine{note}{budget}")


class TimeLeft:
    """The time left, from this attempt's measured pace: the seconds since its first logged step
    over the steps since, so validation and checkpoint pauses count too; on the first step, that
    step's own time."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.first: tuple[int, float] | None = None  # (step, time) of the first step logged

    def after(self, step: int, step_s: float) -> float:
        """Seconds left after `step` (which took `step_s`)."""
        now = monotonic()
        if self.first is None:
            self.first = (step, now)
        first_step, t0 = self.first
        pace = (now - t0) / (step - first_step) if step > first_step else step_s
        return max(0, self.total - step) * pace
