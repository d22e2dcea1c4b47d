"""Plans for a pool of mixed GPU kinds (`ndtrain plan --gpus 64xh100,64xa100`).

Three ways to use a pool, each priced with the same per-kind time and memory models as a
homogeneous plan (planner/search.py's Evaluator on a Problem of that kind):

- **uniform**: every rank gets the same share of the batch and the same layers, so the step
  waits for the slowest kind and every rank must fit the smallest memory;
- **batch shares**: the same mesh on every kind, one data-parallel replica per model-parallel
  group, each kind's replicas running the same number of micro-batches with a micro-batch sized
  to its speed (equal micro-batch counts keep FSDP's per-micro-batch collectives in step; the
  loss is token-normalized, so the gradient is that of the whole batch);
- **stage shares**: pipelines whose stages span the kinds, each kind's stages holding layers in
  inverse proportion to its per-layer time (uneven `layers_per_stage`);

and, as the baseline, the best **homogeneous subset** (the fastest plan on one kind alone).

Approximations, stated where they are made: a mixed layout's data-parallel traffic is priced on
each kind's own links (the slower of them bounds the step, since the step is the slowest kind's);
a stage-share pipeline is priced as the slower kind's plan of the same uneven split with its
compute and bubble rescaled to the mixed stage times; its memory check is per kind, on that
kind's worst stage as if every stage were its (conservative for the kind with fewer layers).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout
from ndtrain.layout.schedules import DEFAULT
from ndtrain.planner.hardware import CATALOG, get_hardware
from ndtrain.planner.problem import Problem, make_problem, stage_split
from ndtrain.planner.search import Evaluator, Prediction, search

POOL_ITEM = re.compile(r"^\s*(\d+)\s*[xX*]\s*([A-Za-z0-9_.-]+)\s*$")
CANDIDATES_PER_KIND = 12  # meshes taken from each kind's own search as mixed candidates


def parse_pool(text: str) -> list[tuple[str, int]]:
    """`64xh100,64xa100` -> [("h100", 64), ("a100-80", 64)]; one line naming the item otherwise."""
    pool: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in str(text).split(","))):
        m = POOL_ITEM.match(item)
        if not m:
            raise NdtrainError(f"--gpus: bad item {item!r}; give a count, or COUNTxKIND items such as 64xh100,64xa100")
        count, name = int(m.group(1)), m.group(2).lower()
        if count < 1:
            raise NdtrainError(f"--gpus: {item!r} needs a positive count")
        hw = get_hardware(name)  # raises naming the kind and the catalog
        if hw.generation == "cpu":
            raise NdtrainError(f"--gpus: {item!r}: a mixed pool is planned from catalog GPUs ({', '.join(CATALOG)})")
        pool[hw.name] = pool.get(hw.name, 0) + count
    if not pool:
        raise NdtrainError("--gpus: empty pool")
    return sorted(pool.items(), key=lambda kv: -get_hardware(kv[0]).peak_bf16)


@dataclass
class MixedPlan:
    kind: str  # "batch_shares", "stage_shares", "uniform" or "subset"
    layout: Layout
    step_time: float
    tokens_per_s: float
    shares: dict  # per GPU kind: what it holds (micro-batch, layers per stage, GPUs used)
    memory_gib: dict  # per GPU kind: peak GiB on its fullest device
    fits: bool

    def to_json(self) -> dict:
        return {"kind": self.kind, "layout": self.layout.as_dict(), "layout_text": self.layout.text(),
                "step_time_s": self.step_time, "tokens_per_s": self.tokens_per_s, "shares": self.shares,
                "memory_gib": self.memory_gib, "fits": self.fits}


class Pool:
    """Per-kind problems of one model, sequence and batch over a mixed pool."""

    def __init__(self, pool: list[tuple[str, int]], make):
        self.kinds = [name for name, _ in pool]
        self.counts = dict(pool)
        self.world = sum(self.counts.values())
        self._make = make  # (hardware, world, global_batch) -> Problem
        self._evals: dict = {}

    def problem(self, kind: str, world: int | None = None, batch: int | None = None) -> Problem:
        return self._evaluator(kind, world or self.world, batch)[0]

    def _evaluator(self, kind: str, world: int, batch: int | None):
        key = (kind, world, batch)
        if key not in self._evals:
            pb = self._make(kind, world, batch)
            self._evals[key] = (pb, Evaluator(pb))
        return self._evals[key]

    def predict(self, kind: str, lay: Layout, batch: int | None = None) -> Prediction | None:
        """`lay` on `kind` as if the whole pool were that kind (None: not a valid layout there)."""
        pb, ev = self._evaluator(kind, self.world, batch)
        try:
            return ev(lay)
        except NdtrainError:
            return None


def _gib(pred: Prediction) -> float:
    return pred.memory["total"] / 2**30


def uniform(pool: Pool, lay: Layout) -> MixedPlan | None:
    preds = {k: pool.predict(k, lay) for k in pool.kinds}
    if any(p is None for p in preds.values()):
        return None
    step = max(p.step_time for p in preds.values())
    pb = pool.problem(pool.kinds[0])
    return MixedPlan("uniform", lay, step, pb.tokens_per_step / step,
                     {k: {"gpus": pool.counts[k], "micro_batch": lay.micro_batch} for k in pool.kinds},
                     {k: _gib(p) for k, p in preds.items()},
                     all(p.fits for p in preds.values()))


def batch_shares(pool: Pool, lay: Layout) -> MixedPlan | None:
    """The same mesh on every kind; each kind's replicas take micro-batches sized to its speed."""
    group = lay.tp * lay.cp * lay.pp
    if any(n % group for n in pool.counts.values()) or len(pool.kinds) != 2:
        return None
    pb = pool.problem(pool.kinds[0])
    replicas = {k: pool.counts[k] // group for k in pool.kinds}
    total_r = sum(replicas.values())
    fast, slow = pool.kinds
    best = None
    for m in (d for d in range(1, pb.global_batch + 1) if pb.global_batch % d == 0):
        per_round = pb.global_batch // m  # sequences per micro-batch round, summed over every replica
        if per_round < total_r:
            break
        # the fast kind's share from its speed-proportional value outward: a few candidates each
        for mb_fast in range(1, (per_round - replicas[slow]) // replicas[fast] + 1):
            rest = per_round - replicas[fast] * mb_fast
            if rest < replicas[slow] or rest % replicas[slow] or rest // replicas[slow] > mb_fast:
                continue
            mb_slow = rest // replicas[slow]
            preds = {}
            for kind, mb in ((fast, mb_fast), (slow, mb_slow)):
                # as if every replica were this kind with this share: the same m micro-batches
                preds[kind] = pool.predict(kind, dataclasses.replace(lay, micro_batch=mb), batch=m * mb * total_r)
            if any(p is None or not p.fits for p in preds.values()):
                continue
            step = max(p.step_time for p in preds.values())
            if best is None or step < best.step_time:
                layout = dataclasses.replace(lay, micro_batch=mb_fast)
                best = MixedPlan("batch_shares", layout, step, pb.tokens_per_step / step,
                                 {fast: {"gpus": pool.counts[fast], "micro_batch": mb_fast, "micro_batches": m},
                                  slow: {"gpus": pool.counts[slow], "micro_batch": mb_slow, "micro_batches": m}},
                                 {k: _gib(p) for k, p in preds.items()}, True)
    return best


def _balanced_counts(layers: int, per_layer: list[float]) -> list[int] | None:
    """Layers per stage in inverse proportion to each stage's per-layer time, summing to `layers`."""
    if layers < len(per_layer):
        return None
    inv = [1 / c for c in per_layer]
    raw = [layers * x / sum(inv) for x in inv]
    counts = [max(1, math.floor(r)) for r in raw]
    while sum(counts) < layers:  # the next layer goes where it adds the least stage time
        i = min(range(len(counts)), key=lambda s: (counts[s] + 1) * per_layer[s])
        counts[i] += 1
    while sum(counts) > layers:
        i = max((s for s in range(len(counts)) if counts[s] > 1), key=lambda s: counts[s] * per_layer[s])
        counts[i] -= 1
    return counts


def stage_shares(pool: Pool, lay: Layout) -> MixedPlan | None:
    """Pipelines over both kinds: the fast kind's stages first, each kind's stages holding layers
    in inverse proportion to its per-layer time."""
    if lay.pp < 2 or lay.pp_virtual_stages != 1 or len(pool.kinds) != 2:
        return None
    fast, slow = pool.kinds
    stages = {k: lay.pp * pool.counts[k] // pool.world for k in pool.kinds}
    if any(s < 1 or s * pool.world != lay.pp * pool.counts[k] for k, s in stages.items()):
        return None
    pbs = {k: pool.problem(k) for k in pool.kinds}
    evs = {k: pool._evaluator(k, pool.world, None)[1] for k in pool.kinds}
    lc = {k: evs[k].layer(lay) for k in pool.kinds}
    per_layer = {k: lc[k]["F"] + lc[k]["B"] + lc[k]["W"] for k in pool.kinds}
    owner = [fast] * stages[fast] + [slow] * stages[slow]
    counts = _balanced_counts(pbs[fast].cfg.n_layers, [per_layer[k] for k in owner])
    if counts is None:
        return None
    mixed = dataclasses.replace(lay, layers_per_stage=tuple(counts))
    preds = {k: pool.predict(k, mixed) for k in pool.kinds}
    if any(p is None for p in preds.values()):
        return None
    # the mixed critical device: each stage at its own kind's speed, the head on the last stage
    work = stage_split(pbs[slow], mixed).work
    dev_mixed = max(w * per_layer[owner[s]] + (lc[owner[s]]["head"] if s == len(owner) - 1 else 0.0)
                    for s, w in enumerate(work))
    tb = preds[slow].time
    m = tb["micro_batches"]
    dev_slow = max(max(w * per_layer[slow] for w in work[:-1]) if len(work) > 1 else 0.0,
                   work[-1] * per_layer[slow] + lc[slow]["head"])
    scale = dev_mixed / dev_slow
    total = tb["total"] - (m * dev_slow + tb["bubble"]) + scale * (m * dev_slow + tb["bubble"])
    pb = pbs[fast]
    fits = all(p.fits for p in preds.values())
    return MixedPlan("stage_shares", mixed, total, pb.tokens_per_step / total,
                     {k: {"gpus": pool.counts[k], "stages": stages[k],
                          "layers_per_stage": [c for c, o in zip(counts, owner) if o == k]} for k in pool.kinds},
                     {k: _gib(p) for k, p in preds.items()}, fits)


def best_subset(pool: Pool) -> MixedPlan | None:
    best = None
    for kind in pool.kinds:
        pb = pool.problem(kind, world=pool.counts[kind])
        res = search(pb, top_k=1)
        if res.top:
            p = res.top[0]
            if best is None or p.tokens_per_s > best.tokens_per_s:
                best = MixedPlan("subset", p.layout, p.step_time, p.tokens_per_s,
                                 {kind: {"gpus": pool.counts[kind],
                                         "micro_batch": p.layout.micro_batch}}, {kind: _gib(p)}, p.fits)
    return best


def _variants(layouts) -> list[Layout]:
    """Each candidate mesh with every recompute policy and, where it shards, ZeRO-3: a larger share
    of the batch on the fast kind needs memory a homogeneous plan did not."""
    out: dict = {}
    for base in layouts:
        # stage shares need one stage per pipeline rank: the plain schedule beside the chosen one
        pipes = (base, dataclasses.replace(base, pp_schedule=DEFAULT, pp_virtual_stages=1)) if base.pp > 1 else (base,)
        for lay in pipes:
            for zero in sorted({lay.zero, 3} if lay.shard_degree > 1 else {lay.zero}):
                for ac in ("none", "selective", "full"):
                    out.setdefault(dataclasses.replace(lay, zero=zero, reshard_after_forward=zero == 3,
                                                       activation_checkpoint=ac), None)
    return list(out)


def plan_pool(pool_spec: list[tuple[str, int]], make, top: int = 3) -> dict:
    """Every way to use the pool, ranked: {"layouts": [MixedPlan...], "uniform": MixedPlan|None,
    "best_subset": MixedPlan|None, "candidates": n}. `make(kind, world, batch)` builds the
    Problem for one kind (the caller's model, sequence, precision and stack)."""
    pool = Pool(pool_spec, make)
    if len(pool.kinds) > 2:
        raise NdtrainError("--gpus: a mixed pool of more than two GPU kinds is not planned yet; give two")
    candidates: dict = {}
    for kind in pool.kinds:
        res = search(pool.problem(kind), top_k=CANDIDATES_PER_KIND)
        for pred in [*res.top, *res.best_by_mesh.values()]:
            candidates.setdefault(pred.layout, None)
    uni = [u for u in (uniform(pool, lay) for lay in candidates) if u and u.fits]
    mixed = []
    if len(pool.kinds) == 2:
        for lay in _variants(candidates):
            for plan in (batch_shares(pool, lay), stage_shares(pool, lay)):
                if plan and plan.fits:
                    mixed.append(plan)
    best_uniform = min(uni, key=lambda p: p.step_time) if uni else None
    ranked, seen = [], set()
    for plan in sorted([*mixed, *uni], key=lambda p: p.step_time):
        key = (plan.kind, plan.layout, repr(plan.shares))
        if key not in seen:
            seen.add(key)
            ranked.append(plan)
    return {"layouts": ranked[:max(1, top)], "uniform": best_uniform, "best_subset": best_subset(pool),
            "candidates": len(candidates), "world": pool.world}


def pool_text(result: dict, pool_spec: list[tuple[str, int]]) -> str:
    lines = [f"mixed pool: {' + '.join(f'{n} x {k}' for k, n in pool_spec)} "
             f"({result['world']} GPUs; {result['candidates']} meshes tried)"]
    listed = [*result["layouts"], *(p for p in (result["uniform"], result["best_subset"]) if p)]
    w = max(40, *(len(p.layout.short()) for p in listed)) if listed else 40  # one column for every layout
    for i, p in enumerate(result["layouts"]):
        shares = "; ".join(f"{k}: " + ", ".join(f"{a}={v}" for a, v in s.items()) for k, s in p.shares.items())
        lines.append(f"{i + 1}. {p.kind:<12} {p.layout.short():<{w}} {p.tokens_per_s:>12,.0f} tokens/s  "
                     f"step {p.step_time:.3f} s  [{shares}]")
    for name, key in (("uniform split", "uniform"), ("best subset", "best_subset")):
        p = result[key]
        lines.append(f"{name:<15} " + (f"{p.layout.short():<{w}} {p.tokens_per_s:>12,.0f} tokens/s"
                                      + (f" ({next(iter(p.shares))} only)" if key == "best_subset" else "")
                                      if p else "none fits"))
    best = result["layouts"][0] if result["layouts"] else None
    for name, key in (("uniform split", "uniform"), ("best subset", "best_subset")):
        if best and result[key]:
            lines.append(f"best mixed vs {name}: {best.tokens_per_s / result[key].tokens_per_s:.2f}x")
    sub = result["best_subset"]
    if sub and (not best or sub.tokens_per_s > best.tokens_per_s):
        lines.append(f"the {next(iter(sub.shares))} GPUs alone are faster than any mixed layout found: "
                     "run on them and give the others another job")
    return "\n".join(lines)
