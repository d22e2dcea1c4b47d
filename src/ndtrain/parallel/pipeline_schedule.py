"""Pipeline schedules without a process group: their rules, their action order, an ideal-time
simulator and the published bubble formulas.

Everything here is pure Python except `action_orders`, which asks torch.distributed.pipelining for
the order its multi-stage schedules run (through stand-in stages, no process group), so that the
simulated and drawn timelines are the ones torch executes. Validation (`pipeline_problem`) never
imports torch, so `ndtrain plan` and config checks stay cheap.

Vocabulary: p pipeline ranks, v stages ("chunks") per rank, p*v stages in all, m micro-batches.
Actions: F forward, B full backward, I backward to the input, W backward to the weights (I and W
are the split the zero-bubble schedules are built on).
"""

from __future__ import annotations

from dataclasses import dataclass

SINGLE = ("GPipe", "1F1B")  # one stage per rank
INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble")  # v looped stages per rank
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank, folded into a V
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # run I and W separately
SCHEDULES = SINGLE + INTERLEAVED + V_SHAPED


def virtual_problem(schedule: str, v: int) -> str | None:
    """Why `schedule` cannot run with v stages per rank, or None."""
    if schedule in SINGLE and v != 1:
        return f"{schedule} runs one stage per rank: set pp_virtual_stages=1 (or use Interleaved1F1B)"
    if schedule in INTERLEAVED and v < 2:
        return f"{schedule} interleaves several stages per rank: set pp_virtual_stages >= 2 (or use 1F1B)"
    if schedule in V_SHAPED and v != 2:
        return f"{schedule} runs exactly two stages per rank in a V: set pp_virtual_stages=2"
    return None


def min_microbatches(schedule: str, p: int) -> int:
    """The fewest micro-batches `schedule` accepts (GPipe runs with 1, but does not pipeline)."""
    if schedule == "DualPipeV":
        return 2 * p
    if schedule == "GPipe":
        return 1
    return p


def microbatch_problem(schedule: str, p: int, v: int, m: int) -> str | None:
    """Why `schedule` cannot run m micro-batches on p ranks, or None. These are the conditions the
    torch schedules check deep inside their constructors (or hang on), stated up front."""
    if m < 1:
        return "needs at least one micro-batch"
    if schedule == "1F1B" and m < p:
        return (f"1F1B needs at least as many micro-batches as pipeline ranks ({m} < pp={p}): its warm-up "
                f"keeps pp micro-batches in flight")
    if schedule == "DualPipeV" and m < 2 * p:
        return f"DualPipeV needs at least 2*pp={2 * p} micro-batches (one per stage), got {m}"
    if schedule in INTERLEAVED:
        rounds = max(1, m // p)
        if m % rounds:
            return (f"{schedule} runs micro-batches in rounds of pp={p}: {m} is not a multiple of "
                    f"{rounds} rounds (use a multiple of pp, or fewer than {2 * p})")
    return None


def microbatch_count(pp_microbatches: int, local_rows: int, micro_batch: int) -> int:
    """Micro-batches per step: `[parallel] pp_microbatches`, else one per micro-batch of the
    accumulation (this rank's rows / micro_batch, rounded up)."""
    if pp_microbatches > 0:
        return pp_microbatches
    return max(1, -(-local_rows // micro_batch))


def pipeline_problem(dims, par, model, train=None) -> tuple[str, str] | None:
    """(config key, problem) for a pipeline layout that cannot run, or None. Checked before any
    process group exists; `train` (the [train] section) enables the micro-batch checks."""
    p, v, sched = dims.pp, par.pp_virtual_stages, par.pp_schedule
    if sched not in SCHEDULES:
        return "parallel.pp_schedule", f"unknown schedule {sched!r} (choose from {', '.join(SCHEDULES)})"
    problem = virtual_problem(sched, v)
    if problem:
        return "parallel.pp_virtual_stages", problem
    if par.compile and sched in SPLIT_BACKWARD:
        return "parallel.compile", (f"{sched} runs the backward in separate input and weight passes, which "
                                    f"compiled blocks do not support; set compile=false or use 1F1B/Interleaved1F1B")
    if par.activation_checkpoint == "selective" and sched in SPLIT_BACKWARD:
        return "parallel.activation_checkpoint", (f"{sched} runs the backward in separate input and weight "
                                                  f"passes, and selective checkpointing allows one backward per "
                                                  f"region; use activation_checkpoint=full or a 1F1B schedule")
    if getattr(par, "pp_split", "balanced") == "llama3" and not par.layers_per_stage:
        if (model.n_layers + 2) // (p * v) < 2:
            return "parallel.pp_split", (f"llama3 gives the first and last of {p * v} stages one layer fewer, "
                                         f"which leaves them empty with {model.n_layers} layers")
    if train is None:
        return None
    key = "parallel.pp_microbatches" if par.pp_microbatches else "train.micro_batch"
    for gb in sorted({train.global_batch, *(b for _, b in train.batch_ramp)}):
        if gb % dims.dp:
            return "train.global_batch", f"global batch {gb} is not divisible by the data-parallel size {dims.dp}"
        rows = gb // dims.dp
        m = microbatch_count(par.pp_microbatches, rows, train.micro_batch)
        where = f"global batch {gb} gives each data-parallel rank {rows} sequences"
        if m > rows:
            return key, f"{m} pipeline micro-batches, but {where}"
        if rows % m:
            return key, (f"{where}, which do not split into {m} equal pipeline micro-batches "
                         f"(stages exchange fixed-shape activations)")
        problem = microbatch_problem(sched, p, v, m)
        if problem:
            hint = "" if par.pp_microbatches else " (set train.micro_batch smaller or parallel.pp_microbatches)"
            return key, f"{where} in {m} micro-batches: {problem}{hint}"
    return None


def stage_ranks(schedule: str, p: int, v: int) -> list[int]:
    """stage index -> pipeline rank. Looped schedules deal stages round-robin (rank r holds
    r, r+p, ...); V schedules hold r and 2p-1-r, so the first and last stage share rank 0."""
    if schedule in V_SHAPED:
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]


def rank_stages(schedule: str, p: int, v: int, rank: int) -> list[int]:
    return [s for s, r in enumerate(stage_ranks(schedule, p, v)) if r == rank]


# ---- published bubble formulas -------------------------------------------------------------

def theoretical_bubble(schedule: str, p: int, v: int, m: int, f: float = 1.0, b: float = 2.0,
                       w: float = 1.0) -> float:
    """Idle fraction of a rank's step, from each schedule's published bubble, for per-stage-chunk
    costs f (forward), b (full backward) and w (its weight part; the input part is b - w).

    GPipe / 1F1B (Huang 2019; Narayanan 2021): (p-1)/(m+p-1).
    Interleaved 1F1B (Narayanan 2021): (p-1)/(v*m+p-1).
    Interleaved zero bubble, ZB-H1 (Qi 2024): idle (p-1)(F+I-W) per chunk, W fills the rest.
    ZB-V (Qi 2024): idle (p-1)(F+I-2W), zero when F = I = W.
    DualPipeV (DeepSeek-V3, Table 2, with PP = 2p stages): idle (p-1)(F&B + B - 3W), where F&B = F + B
    when the forward and backward of two micro-batches are not overlapped (as on CPU)."""
    if p == 1:
        return 0.0
    i = b - w
    useful = v * m * (f + b)
    if schedule in SINGLE:
        idle = (p - 1) * (f + b)
    elif schedule == "Interleaved1F1B":
        idle = (p - 1) * (f + b)
    elif schedule == "InterleavedZeroBubble":
        idle = (p - 1) * max(f + i - w, 0.0)
    elif schedule == "ZBVZeroBubble":
        idle = (p - 1) * max(f + i - 2 * w, 0.0)
    elif schedule == "DualPipeV":
        idle = (p - 1) * max((f + b) + b - 3 * w, 0.0)
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return idle / (idle + useful)


# ---- action orders -------------------------------------------------------------------------

@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # F | B | I | W
    mb: int


def _single_order(schedule: str, p: int, m: int, rank: int) -> list[Action]:
    """The order torch's single-stage schedules execute (their `pipeline_order` is only a drawing
    aid, and off by one for 1F1B)."""
    if schedule == "GPipe":
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
        return {r: _single_order(schedule, p, m, r) for r in range(p)}
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


# ---- ideal-time simulation -----------------------------------------------------------------

@dataclass
class Event:
    rank: int
    stage: int
    kind: str
    mb: int
    start: float
    end: float
    cpu: float = 0.0  # measured runs: the thread's CPU seconds inside [start, end]


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
