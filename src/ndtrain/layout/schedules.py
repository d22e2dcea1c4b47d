"""The pipeline schedule registry: names, how many stages a rank holds (v), how many
micro-batches a schedule accepts, where its stages live, its published bubble, the idle time the
planner charges, and the activations a rank holds at its peak.

Vocabulary: p pipeline ranks, v stages ("chunks") per rank, p*v stages in all, m micro-batches.
F forward, B full backward, I backward to the input, W backward to the weights (I + W = B: the
split the zero-bubble schedules are built on).

The micro-batch rules are the conditions torch.distributed.pipelining (2.13) checks deep inside
its constructors, or hangs on, stated up front: the runtime, the config check and the planner
all read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.errors import NdtrainError


@dataclass(frozen=True)
class Schedule:
    name: str
    kind: str  # "single" (one stage per rank) | "interleaved" (v looped stages) | "v" (two, folded)
    split_backward: bool  # runs I and W as separate passes
    paper: str

    @property
    def fixed_v(self) -> int:
        """v this schedule always runs with (0: any v >= 2)."""
        return {"single": 1, "v": 2}.get(self.kind, 0)

    def virtual_problem(self, v: int) -> str | None:
        """Why this schedule cannot run with v stages per rank, or None."""
        if self.kind == "single" and v != 1:
            return f"{self.name} runs one stage per rank: set pp_virtual_stages=1 (or use Interleaved1F1B)"
        if self.kind == "interleaved" and v < 2:
            return f"{self.name} interleaves several stages per rank: set pp_virtual_stages >= 2 (or use 1F1B)"
        if self.kind == "v" and v != 2:
            return f"{self.name} runs exactly two stages per rank in a V: set pp_virtual_stages=2"
        return None

    @property
    def forwards_first(self) -> bool:
        """Every micro-batch's forward runs before any backward (GPipe): a rank holds all m
        micro-batches' activations, the loss's logits included, at its peak."""
        return self.name == "GPipe"

    @property
    def pairs_forward_backward(self) -> bool:
        """A forward and another micro-batch's backward run as one paired action (DualPipeV), so
        one's communication (MoE all-to-all) can hide behind the other's compute."""
        return self.name == "DualPipeV"

    def min_microbatches(self, p: int) -> int:
        """The fewest micro-batches this schedule accepts (GPipe runs with 1, but does not pipeline)."""
        if self.name == "DualPipeV":
            return 2 * p
        if self.name == "GPipe":
            return 1
        if self.kind == "single":
            return p
        return 1

    def microbatch_problem(self, p: int, v: int, m: int) -> str | None:
        """Why this schedule cannot run m micro-batches on p ranks, or None."""
        if m < 1:
            return "needs at least one micro-batch"
        if m < self.min_microbatches(p):
            if self.name == "DualPipeV":
                return f"DualPipeV needs at least 2*pp={2 * p} micro-batches (one per stage), got {m}"
            return (f"{self.name} needs at least as many micro-batches as pipeline ranks ({m} < pp={p}): its "
                    f"warm-up keeps pp micro-batches in flight")
        if self.kind == "interleaved":
            rounds = max(1, m // p)
            if m % rounds:
                return (f"{self.name} runs micro-batches in rounds of pp={p}: {m} is not a multiple of "
                        f"{rounds} rounds (use a multiple of pp, or fewer than {2 * p})")
        return None

    def stage_ranks(self, p: int, v: int) -> list[int]:
        """stage index -> pipeline rank. Looped schedules deal stages round-robin (rank r holds
        r, r+p, ...); V schedules hold r and 2p-1-r, so the first and last stage share rank 0."""
        if self.kind == "v":
            return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
        return [s % p for s in range(p * v)]

    def rank_stages(self, p: int, v: int, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_ranks(p, v)) if r == rank]

    # ---- cost rules ------------------------------------------------------------------------
    def bubble_fraction(self, p: int, v: int, m: int, f: float = 1.0, b: float = 2.0, w: float = 1.0) -> float:
        """Idle fraction of a rank's step from the schedule's published bubble, for per-chunk
        costs f (forward), b (full backward) and w (its weight part; the input part is b - w)."""
        if p == 1:
            return 0.0
        i = b - w
        if self.name in ("GPipe", "1F1B", "Interleaved1F1B"):
            idle = (p - 1) * (f + b)
        elif self.name == "InterleavedZeroBubble":
            idle = (p - 1) * max(f + i - w, 0.0)
        elif self.name == "ZBVZeroBubble":
            idle = (p - 1) * max(f + i - 2 * w, 0.0)
        else:  # DualPipeV: (p-1)(F&B + B - 3W), F&B = F + B when not overlapped (as on CPU)
            idle = (p - 1) * max((f + b) + b - 3 * w, 0.0)
        return idle / (idle + v * m * (f + b))

    def bubble_time(self, p: int, v: int, f: float, b: float, w: float) -> float:
        """Idle seconds per step on the critical rank, from one micro-batch's device times through
        all of that rank's layers: F, B (backward to the input) and W (to the weights)."""
        if p == 1:
            return 0.0
        if self.name in ("GPipe", "1F1B"):
            return (p - 1) * (f + b + w)
        if self.name == "Interleaved1F1B":
            return (p - 1) * (f + b + w) / v
        if self.name == "InterleavedZeroBubble":  # ZB-H1 per chunk: W passes fill 2/3 of the bubble
            return (p - 1) * max(f + b - w, 0.0) / v
        if self.name == "ZBVZeroBubble":  # zero when F = B = W, else what W cannot fill
            return (p - 1) * max(f + b - 2 * w, 0.0)
        return (p - 1) * max(f + 2 * b - w, 0.0) / 2  # DualPipeV, in chunk times

    def in_flight(self, p: int, v: int, m: int) -> tuple[float, float]:
        """Micro-batches whose activations a rank holds at its peak, in units of one micro-batch
        through all of that rank's layers: (first pipeline rank, last pipeline rank)."""
        if p == 1:
            return 1.0, 1.0
        if self.forwards_first:
            return float(m), float(m)
        if self.name == "1F1B":
            return float(min(p, m)), 1.0
        if self.kind == "interleaved":
            # Korthikanti et al.: p(1 + (p-1)/(pv)) on the first rank; the last rank's warm-up in
            # the interleaved schedule is (v-1) p chunk-micro-batches, plus the one running.
            return p + (p - 1) / v, ((v - 1) * p + 1) / v
        if self.name == "ZBVZeroBubble":
            return float(p), float(p)  # ZB-V keeps 1F1B's peak, spread evenly over the ranks
        return p + 0.5, p + 0.5  # DualPipeV (DeepSeek-V3 Table 2): PP+1 chunk-micro-batches at v=2


DUALPIPEV = "DualPipeV"  # named for the published DeepSeek-V3 run the planner validates against

_ALL = [
    Schedule("GPipe", "single", False, "Huang et al. 2019: all forwards, then all backwards"),
    Schedule("1F1B", "single", False, "Narayanan et al. 2021 (PipeDream-Flush)"),
    Schedule("Interleaved1F1B", "interleaved", False, "Narayanan et al. 2021, interleaved stages"),
    Schedule("InterleavedZeroBubble", "interleaved", True, "Qi et al. 2024, ZB-H1 interleaved"),
    Schedule("ZBVZeroBubble", "v", True, "Qi et al. 2024, ZB-V"),
    Schedule(DUALPIPEV, "v", True, "DeepSeek-AI 2024, DualPipe folded into a V"),
]
SCHEDULES: dict[str, Schedule] = {s.name: s for s in _ALL}
NAMES = tuple(SCHEDULES)
SINGLE = tuple(s.name for s in _ALL if s.kind == "single")
INTERLEAVED = tuple(s.name for s in _ALL if s.kind == "interleaved")
V_SHAPED = tuple(s.name for s in _ALL if s.kind == "v")
SPLIT_BACKWARD = tuple(s.name for s in _ALL if s.split_backward)
# What a layout runs when it names no schedule; with v > 1 and no schedule, the interleaved one.
DEFAULT = "1F1B"
DEFAULT_INTERLEAVED = "Interleaved1F1B"


def single_stage_candidates(p: int, m: int) -> list[str]:
    """One-stage-per-rank schedules for p ranks and m micro-batches, best first: 1F1B (GPipe's
    bubble, a fraction of its activation memory) where it can run, then GPipe (whether it runs is
    problems()'s to decide)."""
    return ([DEFAULT] if m >= SCHEDULES[DEFAULT].min_microbatches(p) else []) + ["GPipe"]


def get(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise NdtrainError(f"unknown pipeline schedule {name!r} (choose from {', '.join(NAMES)})") from None


def canonical_schedule(name: str) -> str:
    """A schedule name as typed (any case, '-' or '_' ignored) -> its registry name."""
    key = name.lower().replace("-", "").replace("_", "")
    for s in NAMES:
        if s.lower() == key:
            return s
    raise NdtrainError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(NAMES)}")
