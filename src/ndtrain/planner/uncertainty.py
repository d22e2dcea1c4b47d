"""How sure a plan is: every prediction with an interval, and how robust the winner is.

Each constant of the time model has a range (planner/constants.py). A *world* is one draw of all
of them (Latin hypercube over the ranges). The search runs once, at the nominal constants; its
top candidates and the best layout of every other mesh are then re-timed in each sampled world
(re-searching every world would cost the search x worlds and change little: a layout far from
the top at nominal values does not win in a world within the ranges; the candidates are the
ones that can).

Per candidate: the 10th-90th percentile of its step time over the worlds (its interval). Per
world: the best candidate. The winner's robustness is the share of worlds in which it is within
2% of that world's best.

Choosing between near-equals: a candidate *overlaps* the nominal winner when the paired interval
of their ratio (step time over the winner's, world by world) reaches below 1, i.e. it is the
faster of the two in at least 10% of the worlds. Among the winner and the candidates that overlap
it, the planner prefers fewer moving parts (parallel dimensions, interleaved/V schedules, ZeRO-3,
recomputation), then more memory headroom, and says so under `--explain`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.planner import constants as consts
from ndtrain.planner import model_error
from ndtrain.planner.accelerator import GiB
from ndtrain.planner.problem import Problem
from ndtrain.planner.search import Evaluator, Prediction, SearchResult

WITHIN = 0.02  # "within 2% of the best"


def moving_parts(p: Prediction) -> list[str]:
    """What makes a layout harder to run: its parallel dimensions beyond data sharding, an
    interleaved or V schedule, ZeRO-3, recomputation."""
    lay = p.layout
    parts = [d for d in ("tp", "cp", "pp", "ep", "dp_replicate") if getattr(lay, d) > 1]
    if lay.pp > 1 and lay.pp_virtual_stages > 1:
        parts.append(lay.pp_schedule)
    if lay.effective_zero == 3:
        parts.append("zero=3")
    if lay.activation_checkpoint != "none":
        parts.append(f"activation_checkpoint={lay.activation_checkpoint}")
    return parts


def headroom(pb: Problem, p: Prediction) -> float:
    return pb.hw.hbm_bytes - p.memory["total"]


@dataclass
class Robustness:
    worlds: int
    candidates: list[Prediction]  # nominal predictions, fastest first
    times: list[list[float]]  # [candidate][world] step seconds
    chosen: Prediction
    nominal: Prediction  # the nominal winner
    share: float  # worlds in which `chosen` is within 2% of the best candidate
    overlapping: list[tuple[Prediction, float]] = field(default_factory=list)  # (candidate, share faster)
    reason: str = ""
    # the model's own error on published runs like this plan (planner/model_error.py): log
    # residuals of throughput, and the group they come from
    errors: list[float] = field(default_factory=list)
    error_group: str = "none"

    def interval(self, p: Prediction) -> tuple[float, float]:
        """10th-90th percentile of the step time of `p` over the sampled worlds (constants only)."""
        i = self._index(p)
        lo, hi = model_error.QUANTILES
        return model_error.quantile(self.times[i], lo), model_error.quantile(self.times[i], hi)

    def model_interval(self, p: Prediction) -> tuple[float, float]:
        """The 80% interval of the step time of `p` with the model's own error: its nominal step
        at the split-conformal quantiles of the residuals of published runs of its stack and GPU
        generation (model_error.interval); the constants' interval where there are none."""
        return model_error.interval(p.step_time, self.errors, self.times[self._index(p)])

    def share_within(self, p: Prediction) -> float:
        i = self._index(p)
        best = [min(col) for col in zip(*self.times)]
        return sum(t <= (1 + WITHIN) * b for t, b in zip(self.times[i], best)) / self.worlds

    def _index(self, p: Prediction) -> int:
        for i, c in enumerate(self.candidates):
            if c.layout == p.layout:
                return i
        raise KeyError(p.layout.short())

    def ranked(self, top: list[Prediction]) -> list[Prediction]:
        """`top` with the chosen layout first, the rest in their nominal order."""
        return [self.chosen] + [p for p in top if p.layout != self.chosen.layout]


def candidates_of(res: SearchResult, limit: int = 16) -> list[Prediction]:
    """The search's top layouts and the best layout of every other mesh, fastest first."""
    seen, out = set(), []
    pool = list(res.top) + sorted(res.best_by_mesh.values(), key=lambda p: p.step_time)
    for p in sorted(pool, key=lambda p: p.step_time):
        key = p.layout
        if key not in seen and p.fits:
            seen.add(key)
            out.append(p)
    return out[:limit]


def assess(pb: Problem, res: SearchResult, worlds: int = 32, seed: int = 0, limit: int = 16,
           exclude: str | None = None) -> Robustness | None:
    """Re-time the search's candidates in `worlds` sampled worlds; None for CPU ranks (their
    constants are measured, not ranged) or when nothing fits."""
    cands = candidates_of(res, limit)
    if not cands or not pb.gpu or worlds < 2:
        return None
    draws = consts.latin_hypercube(pb.k, consts.ranges(pb.hw.generation), worlds, seed)
    times = [[0.0] * worlds for _ in cands]
    for w, values in enumerate(draws):
        ev = Evaluator(pb.with_constants(values))
        for i, c in enumerate(cands):
            times[i][w] = ev(c.layout, check=False).step_time
    rob = Robustness(worlds=worlds, candidates=cands, times=times, chosen=cands[0], nominal=cands[0], share=0.0)
    # the model's own error on published runs of this stack and generation (`exclude`: a published
    # row left out of its own interval)
    rob.errors, rob.error_group = model_error.residuals(pb.stack.name, pb.hw.generation, exclude)
    _choose(pb, rob)
    rob.share = rob.share_within(rob.chosen)
    return rob


def _choose(pb: Problem, rob: Robustness) -> None:
    win = rob.nominal
    wt = rob.times[0]
    for c, ct in zip(rob.candidates[1:], rob.times[1:]):
        ratios = [a / b for a, b in zip(ct, wt)]
        faster = sum(r < 1 for r in ratios) / len(ratios)
        if model_error.quantile(ratios, model_error.QUANTILES[0]) < 1.0:
            rob.overlapping.append((c, faster))

    def key(p):
        return (len(moving_parts(p)), -round(headroom(pb, p) / GiB))

    best = min([win] + [c for c, _ in rob.overlapping], key=key)
    if best.layout != win.layout:
        rob.chosen = best
        fewer = len(moving_parts(win)) - len(moving_parts(best))
        more = (headroom(pb, best) - headroom(pb, win)) / GiB
        why = []
        if fewer > 0:
            why.append(f"{fewer} fewer moving part{'s' if fewer > 1 else ''} "
                       f"({', '.join(moving_parts(best)) or 'none'} vs {', '.join(moving_parts(win))})")
        if abs(more) >= 0.05:
            why.append(f"{more:+.1f} GiB memory headroom")
        faster = dict((id(c), f) for c, f in rob.overlapping)[id(best)]
        rob.reason = (f"preferred over the nominal fastest, {win.layout.short()} "
                      f"({(best.step_time / win.step_time - 1):+.2%} at nominal constants): their intervals "
                      f"overlap (it is the faster in {faster:.0%} of sampled worlds) and it has " + " and ".join(why))
