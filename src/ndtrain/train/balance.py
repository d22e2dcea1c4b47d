"""Who sets the uneven batch shares at runtime ([parallel] balance; layout/batch_shares.py does
the arithmetic), and the measured re-balancing.

- "off": parallel.batch_shares as given ([] = equal slices).
- "plan": weights from the planner's predicted step time of this run's layout on each data-parallel
  rank's GPU kind (parallel.gpus, in rank order): weight = 1 / predicted step time.
- "measured": batch_shares (or equal) to start; at each checkpoint boundary every rank's compute
  time per step since the last boundary is gathered, and when the slowest is more than
  parallel.balance_threshold over the mean the shares become each rank's rows per compute second.
  The decision is made before any save there, recorded in the checkpoint (progress.batch_shares)
  and said in one line; the global stream is consumed in whole global batches whatever the shares,
  so data stays exactly-once across the change and across a resume on either side of it.

The compute clock brackets every forward of the decoder blocks and the head while training (what
the straggler monitor brackets on CUDA, with CUDA events). On CPU it is wall time, not the
straggler monitor's thread CPU time: a rank held back by a CPU quota or by other processes uses
the same CPU seconds per row as a free one, and only its wall time shows that it is slower.
Collectives run outside the blocks (FSDP's all-gathers in its pre-forward hook, which runs before
this clock's), so a fast rank's wait for a slow one is not counted as its compute.
"""

from __future__ import annotations

import time

import torch

from ndtrain.config import layout_batches
from ndtrain.errors import ConfigError
from ndtrain.layout.batch_shares import check_shares, make_split, rebalance, share_rows, shares_problem
from ndtrain.train.optim import global_batch_at


def _pool_kinds(text: str) -> list[str]:
    """parallel.gpus in rank order: "1xh100,1xa100-80" -> ["h100", "a100-80"]."""
    from ndtrain.errors import NdtrainError
    from ndtrain.planner.hardware import get_hardware
    from ndtrain.planner.hetero import POOL_ITEM

    kinds = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = POOL_ITEM.match(item)
        if not m or int(m.group(1)) < 1:
            raise ConfigError("parallel.gpus", f"bad item {item!r}; give COUNTxKIND items such as 1xh100,1xa100-80")
        try:
            hw = get_hardware(m.group(2).lower())
        except NdtrainError as exc:
            raise ConfigError("parallel.gpus", str(exc)) from None
        kinds += [hw.name] * int(m.group(1))
    return kinds


def plan_weights(cfg, layout, dp: int) -> list[float]:
    """Weights of balance = "plan": 1 / the planner's step time of `layout` on each rank's kind."""
    from ndtrain.errors import NdtrainError
    from ndtrain.planner.problem import make_problem
    from ndtrain.planner.search import Evaluator

    kinds = _pool_kinds(cfg.parallel.gpus)
    if len(kinds) != dp:
        raise ConfigError("parallel.gpus", f"names {len(kinds)} data-parallel ranks but the data-parallel degree is {dp}")
    step = {}
    for kind in dict.fromkeys(kinds):
        try:
            pb = make_problem(cfg.model, cfg.data.seq_len, cfg.train.global_batch, layout.world, kind)
            step[kind] = Evaluator(pb)(layout).step_time
        except NdtrainError as exc:
            raise ConfigError("parallel.gpus", f"the planner cannot price this layout on {kind}: {exc}") from None
    return [round(1 / step[k] / max(1 / s for s in step.values()), 4) for k in kinds]


def initial_weights(cfg, layout, dp: int) -> list[float] | None:
    """The shares a run starts with (None: equal slices); a split that cannot work is one line
    naming the key."""
    p = cfg.parallel
    if p.balance == "plan":
        weights, key = plan_weights(cfg, layout, dp), "parallel.gpus"
    elif p.batch_shares:
        weights, key = list(p.batch_shares), "parallel.batch_shares"
    else:
        return None
    check_shares(weights, dp, layout_batches(cfg.train), layout.micro_batch, key)
    return weights


def busy_at_mean_rows(busy, loader, result):
    """A rank's busy time (seconds, or a callable reading them) as if it had trained the mean
    share's rows: with uneven shares a rank given more rows is busy longer by design, and the
    straggler monitor must not name it for that. Unchanged with equal slices."""
    if loader.shares is None or not len(result.sample_ids):
        return busy
    scale = result.extra["global_batch"] / loader.dp_size / len(result.sample_ids)
    return (lambda: busy() * scale) if callable(busy) else busy * scale


class ComputeClock:
    """Seconds spent inside `modules`' forwards while they train, summed until `take`."""

    def __init__(self, modules, device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: dict[int, object] = {}
        self._pairs: list = []
        self._seconds = 0.0
        self._hooks = [h for m in modules for h in (m.register_forward_pre_hook(self._begin),
                                                    m.register_forward_hook(self._end))]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @torch.compiler.disable
    def _begin(self, module, args) -> None:
        if module.training:
            self._open[id(module)] = self._now()

    @torch.compiler.disable
    def _end(self, module, args, output) -> None:
        start = self._open.pop(id(module), None)
        if start is None:
            return
        if self.cuda:
            self._pairs.append((start, self._now()))
        else:
            self._seconds += time.perf_counter() - start

    def take(self) -> float:
        pairs, self._pairs = self._pairs, []
        if pairs:
            pairs[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class Balancer:
    """balance = "measured" in a job: sync() before each step applies the checkpoint's shares
    (a resume, a rollback), at_boundary() decides at each checkpoint boundary."""

    def __init__(self, state):
        from ndtrain.train.metrics import compute_modules

        self.state = state
        self.clock = ComputeClock(compute_modules(state.model_parts), state.rt.device)
        self.since = state.progress.step
        self.initial = state.loader.shares[0] if state.loader.shares else None

    def sync(self) -> str | None:
        """The recorded shares onto the loader; a line when a record no longer fits this layout."""
        st = self.state
        saved = st.progress.batch_shares
        if saved is not None and len(saved) != st.dp_size:
            st.progress.batch_shares = None
            return (f"balance measured: the checkpoint's batch shares {saved} are for {len(saved)} data-parallel "
                    f"ranks, this run has {st.dp_size}: starting again from {self.initial or 'equal shares'}")
        weights = saved if saved is not None else self.initial
        if (st.loader.shares or (None,))[0] != weights:
            st.loader.set_shares(weights, st.layout.micro_batch, make_split)
            self.clock.take()
            self.since = st.progress.step
        return None

    def at_boundary(self) -> tuple[dict, str] | None:
        """Re-balance from the compute time per step since the last boundary: (the metrics row,
        the line) when the shares change, else None. A collective: every rank calls it."""
        st = self.state
        steps = max(1, st.progress.step - self.since)
        vec = torch.zeros(st.dp_size, dtype=torch.float64, device=st.rt.device)
        vec[st.dp_rank] = self.clock.take() / steps
        if torch.distributed.is_initialized():  # tp/cp ranks of one dp rank: the slowest of them
            torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.MAX)
        busy = vec.cpu().tolist()
        self.since = st.progress.step
        cfg = st.cfg
        gb = global_batch_at(cfg, st.progress.tokens_seen, st.progress.batch_points)
        old = st.loader.shares[0] if st.loader.shares else [1.0] * st.dp_size
        rows = share_rows(gb, old)
        decision = rebalance(rows, busy, cfg.parallel.balance_threshold)
        if decision is None or share_rows(gb, decision.weights) == rows:
            return None
        if shares_problem(decision.weights, st.dp_size, layout_batches(cfg.train), st.layout.micro_batch):
            return None  # so uneven that a rank would get fewer rows than micro-batches: keep the old
        st.progress.batch_shares = decision.weights
        st.loader.set_shares(decision.weights, st.layout.micro_batch, make_split)
        new = share_rows(gb, decision.weights)
        row = {"step": st.progress.step, "event": "rebalance", "rank_compute_s": busy, "rows_before": rows,
               "rows_after": new, "batch_shares": decision.weights}
        line = (f"balance measured: at step {st.progress.step} the ranks' compute per step was "
                f"{', '.join(f'{b:.3f}' for b in busy)} s (slowest {decision.imbalance + 1:.2f}x the mean, over "
                f"parallel.balance_threshold {cfg.parallel.balance_threshold}): rows of each global batch of {gb} "
                f"{rows} -> {new} (batch_shares {decision.weights})")
        return row, line

    def close(self) -> None:
        self.clock.close()
