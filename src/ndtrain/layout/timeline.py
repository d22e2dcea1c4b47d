"""The ideal-timeline simulator: run each pipeline rank's actions in the order its schedule
executes them, each as soon as its inputs exist, with given costs. Torch-free; the action orders
of the multi-stage schedules come from torch's own schedule classes (parallel/pipeline_schedule.py),
the single-stage ones from `single_order` here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.layout.schedules import get


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # F | B | I | W
    mb: int


@dataclass
class Event:
    rank: int
    stage: int
    kind: str
    mb: int
    start: float
    end: float
    cpu: float = 0.0  # measured runs: the thread's CPU seconds inside [start, end]


def single_order(schedule: str, p: int, m: int, rank: int) -> list[Action]:
    """The order torch's single-stage schedules execute (their `pipeline_order` is only a drawing
    aid, and off by one for 1F1B)."""
    if get(schedule).forwards_first:
        return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]
    warmup = min(m, p - rank)
    out = [Action(rank, "F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        out.append(Action(rank, "B", bwd))
        bwd += 1
        if fwd == m:
            break
        out.append(Action(rank, "F", fwd))
        fwd += 1
    out += [Action(rank, "B", i) for i in range(bwd, m)]
    return out


def simulate(orders: dict[int, list[Action]], costs: dict[str, float], num_stages: int,
             comm: float = 0.0) -> list[Event]:
    """Run each rank's actions in order, each as soon as its inputs exist: F(s) after F(s-1),
    B/I(s) after F(s) and B/I(s+1), W(s) after I(s). `comm` is added when an input crosses ranks.
    Raises ValueError if the order deadlocks (an action waits on one that can never run)."""
    owner = {a.stage: r for r, acts in orders.items() for a in acts}
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in orders}
    pos = {r: 0 for r in orders}
    events: list[Event] = []

    def ready_at(a: Action, rank: int) -> float | None:
        deps = []
        if a.kind == "F" and a.stage > 0:
            deps.append((("F", a.stage - 1, a.mb), owner.get(a.stage - 1)))
        if a.kind in ("B", "I"):
            deps.append((("F", a.stage, a.mb), rank))
            if a.stage < num_stages - 1:
                nxt = ("B", a.stage + 1, a.mb) if ("B", a.stage + 1, a.mb) in done else ("I", a.stage + 1, a.mb)
                deps.append((nxt, owner.get(a.stage + 1)))
        if a.kind == "W":
            deps.append((("I", a.stage, a.mb), rank))
        t = 0.0
        for key, where in deps:
            if key not in done:
                return None
            t = max(t, done[key] + (comm if where != rank else 0.0))
        return t

    remaining = sum(len(a) for a in orders.values())
    while remaining:
        progressed = False
        for r, acts in orders.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                t = ready_at(a, r)
                if t is None:
                    break
                start = max(t, free[r])
                end = start + costs[a.kind]
                events.append(Event(r, a.stage, a.kind, a.mb, start, end))
                done[(a.kind, a.stage, a.mb)] = end
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[pos[r]]) for r, acts in orders.items() if pos[r] < len(acts)}
            raise ValueError(f"schedule deadlocks: ranks wait forever at {stuck}")
    return events


def idle_fractions(events: list[Event], ranks: list[int], span: float | None = None) -> dict[int, float]:
    """Per rank, the share of the step (first start to last end over all ranks) not computing."""
    if span is None:
        span = max(e.end for e in events) - min(e.start for e in events)
    busy = {r: 0.0 for r in ranks}
    for e in events:
        busy[e.rank] += e.end - e.start
    return {r: max(0.0, 1.0 - busy[r] / span) if span > 0 else 0.0 for r in ranks}


def peak_activations(orders: dict[int, list[Action]], v: int) -> dict[int, float]:
    """Per rank, the most micro-batch activations held at once, in units of one whole rank's
    share (a chunk holds 1/v of it). A micro-batch is held from its F until its B, or its W when
    the backward is split (the weight gradient still needs the layer inputs)."""
    out = {}
    for r, acts in orders.items():
        held = peak = 0
        for a in acts:
            if a.kind == "F":
                held += 1
                peak = max(peak, held)
            elif a.kind in ("B", "W"):
                held -= 1
        out[r] = peak / v
    return out
