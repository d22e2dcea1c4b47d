"""The pipeline stage partition: how many consecutive decoder layers each stage holds. The
runtime builds exactly these stages and the planner costs exactly these stages.

Modes (`[parallel] pp_split`, or explicit `layers_per_stage`):
- balanced (default): minimise the costliest stage, where a stage's cost is the larger of its
  share of the training FLOPs and its share of the parameters (FLOPs set a stage's time,
  parameters its weights, gradients and optimizer state, and a stage must fit both: a dense layer
  of an MoE model costs as much time as an MoE layer but little memory); the embedding counts on
  the first stage, the final norm and head on the last. Ties go to the evenest split. When a rank
  holds several stages (interleaved and V schedules) layers then move between stages, never
  making a stage costlier than that optimum, until the costliest rank is as light as such moves
  make it: a rank runs all its stages, so the pipeline runs at its pace.
- uniform: by layer count alone, the remainder on the middle stages.
- llama3: even, with one layer fewer on the first and last stage (Llama 3 405B: 126 layers on
  16 stages = 7 + 14 x 8 + 7).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from ndtrain.errors import NdtrainError
from ndtrain.layout.degrees import SPLITS
from ndtrain.layout.flops import MFU_ATTENTION, head_forward_flops, layer_forward_flops
from ndtrain.model.config import ModelConfig, layer_params



@dataclasses.dataclass(frozen=True)
class PartCosts:
    """Each part's share of the model's training FLOPs and of its parameters."""

    flops: tuple[float, ...]  # per layer
    params: tuple[float, ...]  # per layer
    embed_params: float  # the embedding (a lookup: no FLOPs)
    head_flops: float  # final norm, head and loss
    head_params: float

    def stage(self, start: int, stop: int, first: bool, last: bool) -> float:
        """Cost of a stage holding layers [start, stop): the larger of its two shares."""
        f = sum(self.flops[start:stop]) + (self.head_flops if last else 0.0)
        p = sum(self.params[start:stop]) + (self.embed_params if first else 0.0) + (self.head_params if last else 0.0)
        return max(f, p)


def part_costs(cfg: ModelConfig, seq_len: int) -> PartCosts:
    return _part_costs(_key(cfg), seq_len)


def _key(cfg: ModelConfig) -> tuple:
    return dataclasses.astuple(cfg)


@lru_cache(maxsize=256)
def _part_costs(key: tuple, seq_len: int) -> PartCosts:
    cfg = ModelConfig(*key)
    layer_flops = [3 * layer_forward_flops(cfg, i, seq_len, MFU_ATTENTION) for i in range(cfg.n_layers)]
    layer_par = [layer_params(cfg, i) for i in range(cfg.n_layers)]
    head_flops = 3 * head_forward_flops(cfg)
    embed_par = cfg.vocab_size * cfg.dim
    # The head's weight counts even when tied: under pp the last stage holds its own copy.
    head_par = cfg.vocab_size * cfg.dim + cfg.dim
    tf = sum(layer_flops) + head_flops
    tp = sum(layer_par) + embed_par + head_par
    return PartCosts(tuple(f / tf for f in layer_flops), tuple(p / tp for p in layer_par), embed_par / tp,
                     head_flops / tf, head_par / tp)


def partition_problem(n_layers: int, n_stages: int, mode: str = "balanced", explicit=()) -> str | None:
    """Why `n_layers` cannot be split into `n_stages` stages this way, or None."""
    if explicit:
        if len(explicit) != n_stages:
            return f"layers_per_stage has {len(explicit)} entries but there are {n_stages} stages (pp x pp_virtual_stages)"
        if sum(explicit) != n_layers or min(explicit) < 1:
            return f"layers_per_stage {list(explicit)} must be positive and sum to model.n_layers={n_layers}"
        return None
    if n_stages > n_layers:
        return f"model.n_layers={n_layers} is fewer than the {n_stages} pipeline stages (pp x pp_virtual_stages)"
    if mode not in SPLITS:
        return f"unknown pipeline split {mode!r} (choose from {', '.join(SPLITS)})"
    if mode == "llama3" and n_stages > 1 and min(_even(n_layers, n_stages, True)) < 1:
        return (f"llama3 gives the first and last of {n_stages} stages one layer fewer, which leaves them empty "
                f"with {n_layers} layers")
    return None


def stage_layer_counts(cfg: ModelConfig, n_stages: int, seq_len: int, mode: str = "balanced",
                       explicit=()) -> list[int]:
    """Layers per stage (see the module docstring). Raises NdtrainError when impossible."""
    problem = partition_problem(cfg.n_layers, n_stages, mode, explicit)
    if problem:
        raise NdtrainError(problem)
    if explicit:
        return list(explicit)
    if mode == "balanced":
        return list(_balanced(part_costs(cfg, seq_len), n_stages))
    return _even(cfg.n_layers, n_stages, mode == "llama3")


def pipeline_split(cfg: ModelConfig, seq_len: int, lay) -> list[int]:
    """Layers per stage of a pipeline layout (ndtrain.layout.Layout, pp > 1): what the runtime
    builds and the planner costs. Raises NdtrainError when impossible."""
    from ndtrain.layout import schedules as registry

    counts = stage_layer_counts(cfg, lay.stages, seq_len, lay.pp_split, lay.layers_per_stage)
    if lay.pp_split != "balanced" or lay.layers_per_stage or lay.pp_virtual_stages == 1:
        return counts
    owners = tuple(registry.get(lay.pp_schedule).stage_ranks(lay.pp, lay.pp_virtual_stages))
    return list(_rebalance(tuple(counts), part_costs(cfg, seq_len), owners, lay.pp))


class _Prefix:
    """Prefix sums of both shares, so a stage's cost is O(1)."""

    def __init__(self, c: PartCosts):
        self.c, self.n_layers = c, len(c.flops)
        self.f, self.p = [0.0], [0.0]
        for f, p in zip(c.flops, c.params):
            self.f.append(self.f[-1] + f)
            self.p.append(self.p[-1] + p)

    def cost(self, start: int, stop: int, first: bool, last: bool) -> float:
        c = self.c
        f = self.f[stop] - self.f[start] + (c.head_flops if last else 0.0)
        p = self.p[stop] - self.p[start] + (c.embed_params if first else 0.0) + (c.head_params if last else 0.0)
        return f if f > p else p


@lru_cache(maxsize=1024)
def _rebalance(counts: tuple[int, ...], costs: PartCosts, owners: tuple[int, ...], p: int) -> tuple[int, ...]:
    """Move a layer from a stage of the costliest rank to a stage of the lightest one while that
    lowers (costliest rank, sum of squared rank loads) and keeps every stage within the costliest
    stage of `counts`. (Any positive counts summing to the layers are a contiguous split; a move
    shifts the layers of the stages between the two by one.) A rank's load is the larger of its
    stages' summed FLOP and parameter shares."""
    n = len(counts)
    pre = _Prefix(costs)
    c = costs

    def evaluate(cs):
        top, start = 0.0, 0
        flops, params = [0.0] * p, [0.0] * p
        for k, cnt in enumerate(cs):
            first, last = k == 0, k == n - 1
            top = max(top, pre.cost(start, start + cnt, first, last))
            r = owners[k]
            flops[r] += pre.f[start + cnt] - pre.f[start] + (c.head_flops if last else 0.0)
            params[r] += pre.p[start + cnt] - pre.p[start] + (c.embed_params if first else 0.0) + \
                (c.head_params if last else 0.0)
            start += cnt
        loads = [max(a, b) for a, b in zip(flops, params)]
        return top, (max(loads), sum(x * x for x in loads)), loads

    by_rank = [[k for k in range(n) if owners[k] == r] for r in range(p)]
    cur = list(counts)
    top_stage, best, loads = evaluate(cur)
    bound = top_stage * (1 + 1e-12)
    for _ in range(sum(counts)):  # each accepted move strictly improves: this only caps the work
        heavy = max(range(p), key=lambda r: loads[r])
        found = None
        for light in sorted(range(p), key=lambda r: loads[r]):
            if loads[light] >= loads[heavy]:
                break
            for a in by_rank[heavy]:
                if cur[a] < 2:
                    continue
                for b in by_rank[light]:
                    cand = list(cur)
                    cand[a] -= 1
                    cand[b] += 1
                    top, sc, cand_loads = evaluate(cand)
                    if top <= bound and sc < best and (found is None or sc < found[1]):
                        found = (cand, sc, cand_loads)
            if found:
                break
        if not found:
            break
        cur, best, loads = found
    return tuple(cur)


def _even(n_layers: int, n_stages: int, llama3: bool) -> list[int]:
    total = n_layers + (2 if llama3 and n_stages > 1 else 0)
    base, extra = divmod(total, n_stages)
    counts = [base] * n_stages
    middle = list(range(1, n_stages - 1)) or list(range(n_stages))
    for k in range(extra):  # the remainder goes to the middle stages, away from embedding and head
        counts[middle[k % len(middle)]] += 1
    if total != n_layers:
        counts[0] -= 1
        counts[-1] -= 1
    return counts


@lru_cache(maxsize=1024)
def _balanced(costs: PartCosts, n: int) -> tuple[int, ...]:
    """Contiguous split into n non-empty stages minimising the costliest stage (the pipeline runs
    at the pace of its slowest stage); ties go to the evenest split (least sum of squared stage
    costs), then to the earliest cut.

    Dynamic programme over (stages, layers). A stage costlier than the uniform split's costliest
    stage cannot be in an optimal split, which bounds each stage's length (and the layers each
    stage can end at), keeping the work near O(layers^2) rather than O(stages x layers^2)."""
    pre = _Prefix(costs)
    L = pre.n_layers
    if n == 1:
        return (L,)
    bound, start = 0.0, 0
    for k, c in enumerate(_even(L, n, False)):
        bound = max(bound, pre.cost(start, start + c, k == 0, k == n - 1))
        start += c
    bound *= 1 + 1e-12
    # The longest run of layers a stage may hold under the bound (the ends only shorten it).
    longest, i = 0, 0
    for j in range(1, L + 1):
        while pre.cost(i, j, False, False) > bound:
            i += 1
        longest = max(longest, j - i)
    inf = float("inf")
    best_max = [[inf] * (L + 1) for _ in range(n)]
    best_sq = [[inf] * (L + 1) for _ in range(n)]
    cut = [[0] * (L + 1) for _ in range(n)]
    for j in range(1, min(longest, L - n + 1) + 1):
        c = pre.cost(0, j, True, False)
        if c <= bound:
            best_max[0][j], best_sq[0][j] = c, c * c
    for k in range(1, n):
        last = k == n - 1
        pm_row, ps_row = best_max[k - 1], best_sq[k - 1]
        m_row, s_row, cut_row = best_max[k], best_sq[k], cut[k]
        lo = max(k + 1, L - (n - 1 - k) * longest)
        hi = min(L - (n - 1 - k), (k + 1) * longest)
        if last:
            lo = hi = L
        for j in range(lo, hi + 1):
            bm = bs = inf
            bi = 0
            i = j - 1
            while i >= k:
                c = pre.cost(i, j, False, last)
                if c > bound:
                    break  # costs are positive: earlier starts only get costlier
                pm = pm_row[i]
                if pm != inf:
                    mx = pm if pm > c else c
                    sq = ps_row[i] + c * c
                    if mx < bm or (mx == bm and sq <= bs):  # equal: the earlier cut wins, as i falls
                        bm, bs, bi = mx, sq, i
                i -= 1
            m_row[j], s_row[j], cut_row[j] = bm, bs, bi
    counts, j = [], L
    for k in range(n - 1, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return tuple(counts[::-1])


def stage_layers(counts: list[int]) -> list[list[int]]:
    """Layer indices of each stage."""
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def rank_layer_counts(counts: list[int], stage_ranks: list[int], p: int) -> list[int]:
    """Layers each pipeline rank holds, from the per-stage counts and the stage -> rank map."""
    out = [0] * p
    for stage, rank in enumerate(stage_ranks):
        out[rank] += counts[stage]
    return out
