"""Pipeline schedules on the torch side: the action order each schedule executes, taken from
torch.distributed.pipelining's own schedule classes (built over stand-in stages, no process
group), and the ideal timeline of it, so that simulated and drawn timelines are the ones torch
executes.

The rules themselves (names, v and micro-batch rules, stage placement, bubble formulas, the
simulator) are ndtrain.layout's; this module re-exports them for the pipeline code.
"""

from __future__ import annotations

from ndtrain.layout import schedules as _reg
from ndtrain.layout.degrees import microbatch_count  # noqa: F401
from ndtrain.layout.schedules import INTERLEAVED, NAMES, SINGLE, SPLIT_BACKWARD, V_SHAPED  # noqa: F401
from ndtrain.layout.timeline import Action, Event, idle_fractions, peak_activations, simulate, single_order


def virtual_problem(schedule: str, v: int) -> str | None:
    return _reg.get(schedule).virtual_problem(v)


def min_microbatches(schedule: str, p: int) -> int:
    return _reg.get(schedule).min_microbatches(p)


def microbatch_problem(schedule: str, p: int, v: int, m: int) -> str | None:
    return _reg.get(schedule).microbatch_problem(p, v, m)


def stage_ranks(schedule: str, p: int, v: int) -> list[int]:
    return _reg.get(schedule).stage_ranks(p, v)


def rank_stages(schedule: str, p: int, v: int, rank: int) -> list[int]:
    return _reg.get(schedule).rank_stages(p, v, rank)


def theoretical_bubble(schedule: str, p: int, v: int, m: int, f: float = 1.0, b: float = 2.0,
                       w: float = 1.0) -> float:
    """Idle fraction of a rank's step from the schedule's published bubble (see the registry)."""
    return _reg.get(schedule).bubble_fraction(p, v, m, f, b, w)


class _StandIn:
    """Just enough of a PipelineStage for a schedule to compute its order: no process group."""

    def __init__(self, index: int, num_stages: int, p: int):
        from torch import nn

        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, p, 0
        self.submod = nn.Identity()
        self.stage_index_to_group_rank: dict[int, int] = {}

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def action_orders(schedule: str, p: int, v: int, m: int) -> dict[int, list[Action]]:
    """rank -> compute actions in execution order, as torch.distributed.pipelining runs them."""
    for problem in (virtual_problem(schedule, v), microbatch_problem(schedule, p, v, m)):
        if problem:
            raise ValueError(problem)
    if schedule in SINGLE:
        return {r: single_order(schedule, p, m, r) for r in range(p)}
    from torch.distributed.pipelining.schedules import get_schedule_class

    stages = [_StandIn(s, p * v, p) for s in rank_stages(schedule, p, v, 0)]
    sched = get_schedule_class(schedule)(stages, m, loss_fn=lambda out, target: out, scale_grads=False)
    orders = {}
    for rank, actions in sched.pipeline_order.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):  # DualPipeV pairs an F and a B; CPU runs them in turn
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    flat.append(Action(sub.stage_index, kind, sub.microbatch_index))
        orders[rank] = flat
    return orders


def simulate_schedule(schedule: str, p: int, v: int, m: int, f: float = 1.0, b: float = 2.0,
                      w: float = 1.0, comm: float = 0.0) -> dict:
    """Ideal timeline of `schedule`; what `pipeline-report --simulate` draws. f, b, w are one
    micro-batch's costs through all of a rank's layers, so a chunk costs 1/v of them and
    makespans compare across schedules."""
    orders = action_orders(schedule, p, v, m)
    costs = {"F": f / v, "B": b / v, "I": (b - w) / v, "W": w / v}
    events = simulate(orders, costs, p * v, comm)
    idle = idle_fractions(events, list(range(p)))
    return {"schedule": schedule, "p": p, "v": v, "m": m, "events": events, "idle": idle,
            "makespan": max(e.end for e in events), "theory": theoretical_bubble(schedule, p, v, m, f, b, w),
            "peak_activations": peak_activations(orders, v)}
