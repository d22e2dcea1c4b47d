"""Evaluate one layout, or enumerate every valid layout for a world size and batch and rank them
by predicted tokens/s.

The enumeration skips only what is provably no better: for fixed degrees, micro-batch and schedule,
recompute policies are tried cheapest first (none, selective, full) and the first that fits wins,
since recompute only ever adds time; larger micro-batches are skipped once even full recompute
no longer fits; GPipe is tried only where 1F1B cannot run (same bubble, more memory).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout
from ndtrain.layout.flops import MFU_ATTENTION, flops_per_token, recompute_flops_per_token
from ndtrain.layout.rules import batch_splits
from ndtrain.layout.schedules import DEFAULT, INTERLEAVED, SCHEDULES, single_stage_candidates
from ndtrain.planner.accelerator import GiB
from ndtrain.planner.layer import layer_costs
from ndtrain.planner.memory import memory_breakdown, state_bytes
from ndtrain.planner.problem import Problem, Split, stage_split
from ndtrain.planner.stack import PLANNED_AC
from ndtrain.planner.timing import busy_and_bubble, step_breakdown


@dataclass
class Prediction:
    layout: Layout
    step_time: float
    time: dict
    memory: dict
    fits: bool
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (ndtrain.layout.flops, MFU_ATTENTION convention), per GPU
    mfu: float  # against the dense bf16 peak, same convention
    hfu: float  # counting recomputed FLOPs

    def to_json(self, budget_tokens: float = 0.0, world: int = 0, tdp: float = 0.0) -> dict:
        out = {
            "layout": self.layout.as_dict(), "fits": self.fits, "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s, "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
            "hfu": self.hfu, "memory_gib": {k: v / GiB if isinstance(v, float) else v for k, v in self.memory.items()},
            "time_s": self.time,
        }
        if budget_tokens:
            seconds = budget_tokens / self.tokens_per_s
            out["days"] = seconds / 86400
            out["energy_mwh"] = world * tdp * seconds / 3.6e9
        return out


class Evaluator:
    """Evaluates layouts of one problem, caching per-layer costs shared by many layouts."""

    def __init__(self, pb: Problem):
        self.pb = pb
        self._layer: dict = {}
        self._cache: dict = {}
        peak16 = pb.hw.peak("fp32" if pb.precision == "fp32" else "bf16")
        tokens = pb.tokens_per_step
        self.model_flops = flops_per_token(pb.cfg, pb.seq, MFU_ATTENTION) * tokens
        self.recompute_flops = {ac: recompute_flops_per_token(pb.cfg, pb.seq, ac, MFU_ATTENTION, pb.stack.flash_attention)
                                * tokens for ac in PLANNED_AC}
        self.peak_total = peak16 * pb.world
        self.evaluated = 0
        self.sized = 0
        self.bounded = 0  # lower bounds computed: the search's work counts (tests and benchmarks read them)

    def layer(self, lay: Layout) -> dict:
        key = (lay.tp, lay.cp, lay.micro_batch, lay.activation_checkpoint, lay.sequence_parallel, lay.ep,
               lay.pairs_forward_backward, lay.compile, lay.fp32_matmul_precision)
        lc = self._layer.get(key)
        if lc is None:
            lc = self._layer[key] = layer_costs(self.pb, lay)
        return lc

    def split(self, lay: Layout) -> Split | None:
        """The runtime's stage partition, per pipeline rank (shared by every layout with the same
        pipeline shape)."""
        key = ("split", lay.pp, lay.pp_virtual_stages, lay.pp_schedule, lay.pp_split, lay.layers_per_stage)
        if key not in self._cache:
            self._cache[key] = stage_split(self.pb, lay)
        return self._cache[key]

    def lower_bound(self, lay: Layout) -> float:
        """Busy time plus bubble: what the step costs before memory traffic and DP/PP comm."""
        self.bounded += 1
        lc = self.layer(lay)
        split = self.split(lay)
        if split is None:
            return math.inf
        dev, bubble, _, _ = busy_and_bubble(self.pb, lay, lc, split)
        return lay.micro_batches(self.pb.global_batch) * dev + bubble

    def memory(self, lay: Layout) -> tuple[dict, dict, Split]:
        """(memory breakdown, layer costs, stage split); the cheap half of an evaluation."""
        self.sized += 1
        lc = self.layer(lay)
        split = self.split(lay)
        if split is None:
            raise NdtrainError(f"layout {lay.short()}: {self.pb.shape.layers} layers cannot split into {lay.pp} stages")
        return memory_breakdown(self.pb, lay, split), lc, split

    def finish(self, lay: Layout, mem: dict, lc: dict, split: Split) -> Prediction:
        pb = self.pb
        self.evaluated += 1
        tb = step_breakdown(pb, lay, lc, split, self._cache)
        step = tb["total"]
        mfu = self.model_flops / (step * self.peak_total)
        return Prediction(layout=lay, step_time=step, time=tb, memory=mem, fits=mem["total"] <= pb.hw.hbm_bytes,
                          tokens_per_s=pb.tokens_per_step / step, tflops_per_gpu=self.model_flops / step / pb.world / 1e12,
                          mfu=mfu, hfu=mfu * (1 + self.recompute_flops[lay.activation_checkpoint] / self.model_flops))

    def __call__(self, lay: Layout, check: bool = True) -> Prediction:
        pb = self.pb
        if check:
            why = pb.why_invalid(lay)
            if why:
                lift = " (only the ndtrain runtime refuses it: --relaxed admits it)" \
                    if pb.lifted_by_relaxed(lay) else ""
                raise NdtrainError(f"layout {lay.short()}: {why}{lift}")
        return self.finish(lay, *self.memory(lay))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchResult:
    top: list[Prediction]
    considered: int  # layouts enumerated, including those settled by a dominance rule or the bound
    evaluated: int  # layouts whose step time was computed
    fitting: int  # layouts found to fit in memory
    seconds: float
    sized: int = 0  # layouts whose memory was computed
    bounded: int = 0  # lower bounds (busy time + bubble) computed, to order meshes and prune layouts
    fastest_over_cap: Prediction | None = None
    best_by_mesh: dict = field(default_factory=dict)  # (tp, cp, pp, ep) -> fastest fitting Prediction
    # Why layouts were dropped, for an empty search to name its cause (planner/refusal.py):
    # "meshes": meshes enumerated; "rules": {config key: [count, first message, its Layout]} of
    # problems() refusals; "states": (bytes, Layout) of the smallest model states that exceeded
    # the GPU before activations (None if none did)
    refusals: dict = field(default_factory=dict)


def search(pb: Problem, top_k: int = 5, fixed: dict | None = None, mb_options: list[int] | None = None,
           ac_options: tuple[str, ...] = PLANNED_AC, schedules: tuple[str, ...] | None = None,
           zero_options: tuple[int, ...] = (1, 2, 3), max_cp: int = 32, base: Layout | None = None) -> SearchResult:
    """All valid layouts for pb.world GPUs, the top_k by tokens/s among those that fit.

    Valid means ndtrain.layout.problems() finds nothing (strict or not, as pb says): the search
    enumerates a space and keeps exactly what problems() accepts.
    fixed: {key: value} over Layout fields (tp, pp, dp_shard, ..., pp_schedule, activation_checkpoint) to pin.
    mb_options: micro-batch sizes to try (default: the powers of two up to 64 that divide the
    per-replica batch). base: the knobs the search does not vary (mixed precision, compile, CPU
    offload, stage split, ...), from the config being planned; their rules apply too."""
    fixed = dict(fixed or {})
    start = time.perf_counter()
    ev = Evaluator(pb)
    sh, hw, W = pb.shape, pb.hw, pb.world
    cap = hw.hbm_bytes
    pbytes = 4 if pb.precision == "fp32" else 2
    acs = [a for a in PLANNED_AC if a in ac_options and fixed.get("activation_checkpoint", a) == a]
    knobs = {k: getattr(base or Layout(), k) for k in ("pp_split", "layers_per_stage", "ac_every", "mixed_precision",
                                                         "cpu_offload", "compile", "cp_attention",
                                                         "fp32_matmul_precision")}
    if base is None:  # the runtime's mixed precision is the planned one (fp8: the fp8 rules apply)
        knobs["mixed_precision"] = pb.precision
    knobs.update({k: v for k, v in fixed.items() if k in knobs})  # a pinned knob is priced as pinned
    heap: list = []
    by_mesh: dict = {}
    stats = {"considered": 0, "fitting": 0, "over": None, "over_lb": math.inf, "n": 0}
    refusals: dict = {"meshes": 0, "rules": {}, "states": None, "fixed": dict(fixed)}

    def allowed(key, value):
        return key not in fixed or fixed[key] == value

    def refused(lay: Layout, why) -> None:
        entry = refusals["rules"].setdefault(getattr(why, "key", "layout"), [0, str(why), lay])
        entry[0] += 1

    def offer(pred: Prediction) -> None:
        lay = pred.layout
        mesh = (lay.tp, lay.cp, lay.pp, lay.ep)
        if mesh not in by_mesh or pred.step_time < by_mesh[mesh].step_time:
            by_mesh[mesh] = pred
        stats["n"] += 1
        item = (-pred.step_time, -stats["n"], pred)
        if len(heap) < top_k:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)

    def states_lower_bound(t, p, e, z, shard) -> float:
        dense = sh.layers / p * (sh.dense_params_layer - sh.moe_dense_params_layer) / t + \
            sh.layers / p * sh.moe_dense_params_layer
        expert = sh.layers / p * sh.expert_params_layer / e
        se = max(1, shard // e)
        return (sum(state_bytes(dense, z if shard > 1 else 0, shard, pbytes, p == 1 and z >= 2))
                + sum(state_bytes(expert, z if se > 1 else 0, se, pbytes, p == 1 and z >= 2)) + pb.overhead_bytes)

    def layout(dp, ds, t, c, p, e, z, mb, v, ac, sp, sched) -> Layout:
        return Layout(dp_replicate=dp // ds, dp_shard=ds, tp=t, cp=c, pp=p, ep=e, zero=z,
                      reshard_after_forward=z == 3, micro_batch=mb, pp_virtual_stages=v, activation_checkpoint=ac,
                      sequence_parallel=sp, pp_schedule=sched, **knobs)

    def inner(t, c, p, dp, ds, e):
        shard = ds * c
        zeros = [z for z in zero_options if allowed("zero", z)] if shard > 1 else [fixed.get("zero", 3)]
        for z in zeros:
            need = states_lower_bound(t, p, e, z, shard)
            if need > cap and (refusals["states"] is None or need < refusals["states"][0]):
                refusals["states"] = (need, layout(dp, ds, t, c, p, e, z, 1, 1, acs[0] if acs else "none",
                                                   t > 1, DEFAULT))
        zeros = [z for z in zeros if states_lower_bound(t, p, e, z, shard) <= cap]
        if not zeros:
            return
        per_replica = pb.global_batch // dp
        mbs = mb_options or [1 << i for i in range(7)]
        sp = bool(fixed.get("sequence_parallel", True)) if t > 1 else False
        for mb in mbs:
            if per_replica % mb or not allowed("micro_batch", mb):
                continue
            m = per_replica // mb
            any_fit = False
            for sched, v in _schedules(p, m, sh.layers, schedules, fixed):
                if len(heap) == top_k:
                    probe = layout(dp, ds, t, c, p, e, zeros[0], mb, v, acs[0], sp, sched)
                    if not pb.why_invalid(probe) and ev.lower_bound(probe) >= -heap[0][0]:
                        stats["considered"] += len(acs) * len(zeros)  # none of them can make the top k
                        any_fit = True  # unknown; do not stop growing the micro-batch on this evidence
                        continue
                # ZeRO stages and recompute policies only add time as they save memory: walk
                # them cheapest first and stop where a cheaper combination already fitted.
                ac_limit = len(acs)
                for z in zeros:
                    for i, ac in enumerate(acs[:ac_limit]):
                        stats["considered"] += 1
                        lay = layout(dp, ds, t, c, p, e, z, mb, v, ac, sp, sched)
                        why = pb.why_invalid(lay)
                        if why:
                            refused(lay, why)
                            continue
                        try:
                            mem, lc, split = ev.memory(lay)
                        except NdtrainError:
                            break
                        if mem["total"] > cap:
                            lb = ev.lower_bound(lay)  # remember the fastest-looking layout that was too big
                            if lb < stats["over_lb"]:
                                stats["over_lb"], stats["over"] = lb, lay
                            continue
                        stats["fitting"] += 1
                        any_fit = True
                        stats["considered"] += ac_limit - 1 - i
                        ac_limit = i
                        if len(heap) < top_k or ev.lower_bound(lay) < -heap[0][0]:
                            offer(ev.finish(lay, mem, lc, split))
                        break
                    if ac_limit == 0:
                        stats["considered"] += len(acs) * (len(zeros) - 1 - zeros.index(z))
                        break
            if not any_fit and mb > 1:
                break  # a larger micro-batch needs more memory still

    tps = [t for t in divisors(W) if t <= hw.gpus_per_node and sh.heads % t == 0
           and (sh.kv_heads % t == 0 or (not pb.strict and t % sh.kv_heads == 0)) and allowed("tp", t)]
    meshes = []
    for t in tps:
        for c in divisors(W // t):
            if not allowed("cp", c) or c > max_cp or (c > 1 and (pb.seq % (2 * c) or pb.seq // c < 256)):
                continue
            for p in divisors(W // (t * c)):
                dp = W // (t * c * p)
                if allowed("pp", p) and p <= sh.layers and batch_splits(pb.global_batch, dp):
                    meshes.append((_estimate(ev, t, c, p, dp), t, c, p, dp))
    refusals["meshes"] = len(meshes)
    # Promising meshes first, so that the top k fills early and the bound prunes the rest.
    for _, t, c, p, dp in sorted(meshes):
        for ds in divisors(dp):
            if not allowed("dp_shard", ds) or not allowed("dp_replicate", dp // ds):
                continue
            for e in (divisors(math.gcd(sh.n_experts, ds * c)) if sh.n_experts else [1]):
                if allowed("ep", e):
                    inner(t, c, p, dp, ds, e)
    top = [it[2] for it in sorted(heap, key=lambda it: (-it[0], -it[1]))]
    over = ev(stats["over"], check=False) if stats["over"] is not None else None
    over = over if over and (not top or over.step_time < top[0].step_time) else None
    return SearchResult(top=top, considered=stats["considered"], evaluated=ev.evaluated, fitting=stats["fitting"],
                        sized=ev.sized, bounded=ev.bounded, seconds=time.perf_counter() - start, fastest_over_cap=over,
                        best_by_mesh=by_mesh, refusals=refusals)


def _estimate(ev: Evaluator, t: int, c: int, p: int, dp: int) -> float:
    """Rough step time of a mesh (smallest micro-batch, no recompute, 1F1B) to order the search."""
    m = ev.pb.global_batch // dp
    sched = single_stage_candidates(p, m)[0]
    try:
        return ev.lower_bound(Layout(dp_shard=dp, tp=t, cp=c, pp=p, micro_batch=1, activation_checkpoint="none",
                                     sequence_parallel=t > 1, pp_schedule=sched))
    except NdtrainError:
        return math.inf


def _schedules(p: int, m: int, layers: int, allowed: tuple[str, ...] | None, fixed: dict):
    """(schedule, v) pairs worth costing for p pipeline ranks and m micro-batches. Their validity
    (v and micro-batch rules, enough layers for p*v stages) is problems()'s to decide."""
    if p == 1:
        yield fixed.get("pp_schedule", DEFAULT), 1
        return
    want = set(allowed) if allowed else None
    if "pp_schedule" in fixed:
        want = {fixed["pp_schedule"]}

    def ok(name):
        return want is None or name in want

    if fixed.get("pp_virtual_stages", 1) == 1:  # the first allowed: GPipe only where 1F1B cannot run or is not allowed
        single = next((name for name in single_stage_candidates(p, m) if ok(name)), None)
        if single:
            yield single, 1
    # v up to 8 when searched; a pinned v (a published layout) may be larger
    pinned = fixed.get("pp_virtual_stages", 1)
    for v in ([pinned] if pinned > 1 else range(2, min(layers // p, 8) + 1)):
        for name in INTERLEAVED:
            if ok(name):
                yield name, v
        if v == 2:
            for name in SCHEDULES:
                if SCHEDULES[name].kind == "v" and ok(name):
                    yield name, 2
