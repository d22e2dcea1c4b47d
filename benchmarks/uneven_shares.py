"""Uneven batch shares on CPU: two local DDP ranks, rank 1 held to half a core by a cgroup v1 CPU
quota, the uniform split against balanced shares (docs/heterogeneous.md).

    sudo python benchmarks/uneven_shares.py --rounds 2 --steps 8

Arms, run interleaved (uniform, plan, measured, uniform, ...) so a change in the shared host's load
hits each alike; each is a fresh Gloo group of 2 forked ranks on the `tiny` model, fp32, the same
global batch, seed and data:
- uniform: equal rows (what a framework without shares does; the step waits for rank 1);
- plan: batch_shares = [1, quota], the weights a plan told each rank's speed would give;
- measured: balance = "measured" from equal rows, re-balanced by train/balance.py's Balancer after
  the warm-up steps from the ranks' measured compute time (the same decision a job takes at a
  checkpoint boundary), then timed.
Each rank is pinned to its own core, and the ranks' cgroup weighs --shares (default 10240, ten
plain processes) against the shared host's other work, so that the load does not set the pace;
the load average is recorded anyway. Each arm prints one JSON line: tokens/s over the timed steps (wall time of rank 0: every step ends
in the gradient all-reduce, so both ranks' steps take the same wall time), the rows per rank, the
per-step losses and the 1-minute load average before and after. The summary line gives the
ratios side by side with the planner's prediction: the this-machine profile's step time for each
rank's rows (as `ndtrain plan` prices it), the quota'd rank's compute and optimizer time divided
by its CPU share, the step the slower rank's (planner/hetero.py's batch-shares rule).

Needs root for the cgroup (/sys/fs/cgroup/cpu/); removes it when done, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ndtrain.config import load_config
from ndtrain.parallel.launch import run_ranks

CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def _arm(cfg, cgroup: str, warmup: int, steps: int, measured: bool) -> dict:
    import torch

    from ndtrain.train.balance import Balancer
    from ndtrain.train.trainer import Trainer

    rank = torch.distributed.get_rank()
    # Rank 1 alone is held to the quota; both ranks' group weighs --shares against the host's
    # other work, and each rank has a core of its own: the quota, not the load, sets rank 1's pace.
    (Path(cgroup) / ("slow" if rank == 1 else "fast") / "cgroup.procs").write_text(str(os.getpid()))
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    trainer = Trainer(cfg, run_dir=None, log=False)
    balancer = Balancer(trainer.state) if measured else None
    results, said = [], None
    for _ in range(warmup):
        results.append(trainer.train_step())
    if balancer is not None:
        change = balancer.at_boundary()
        said = change[1] if change else "measured: no change"
    rows = trainer.state.loader.next_batch  # the rows this rank takes from now on
    t0 = time.perf_counter()
    for _ in range(steps):
        results.append(trainer.train_step())
    wall = time.perf_counter() - t0
    batch = rows(cfg.train.global_batch)
    losses = [float(r.loss) for r in results]
    trainer.close()
    if balancer is not None:
        balancer.close()
    return {"wall_s": wall, "rows": int(batch.inputs.shape[0]), "losses": losses, "said": said}


def predict(cfg, quota: float, rows: list[int]) -> float:
    """Planner's tokens/s for `rows` per rank, rank 1 at `quota` of a core."""
    from ndtrain.layout import Layout
    from ndtrain.layout.batch_shares import micro_count
    from ndtrain.planner.problem import make_problem
    from ndtrain.planner.search import Evaluator

    m = micro_count(rows, cfg.train.micro_batch)
    gb, seq = cfg.train.global_batch, cfg.data.seq_len
    times = []
    for rank, n in enumerate(rows):
        mb = -(-n // m)
        pb = make_problem(cfg.model, seq, m * mb * len(rows), len(rows), "this-machine", precision="fp32")
        t = Evaluator(pb)(Layout(dp_replicate=len(rows), micro_batch=mb)).time
        busy = t["compute"] + t["recompute"] + t["optimizer"]
        times.append(busy / (quota if rank == 1 else 1.0) + t["exposed_comm"])
    return gb * seq / max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quota", type=float, default=0.5, help="rank 1's CPU share (cfs quota / period)")
    ap.add_argument("--data", default="data/stdlib-byte")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--shares", type=int, default=10240, help="cpu.shares of the ranks' cgroup (1024: a plain process's)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = {"model": {"preset": "tiny"}, "data": {"path": args.data, "seq_len": args.seq},
            "train": {"global_batch": args.global_batch, "micro_batch": args.global_batch, "seed": 1,
                      "sample_tokens": 0},
            "parallel": {"dp_replicate": 2, "dp_shard": 1, "compile": False, "mixed_precision": "fp32"},
            "logging": {"tensorboard": False, "progress": "off"}}
    arms = {"uniform": ({}, False), "plan": ({"batch_shares": [1.0, args.quota]}, False),
            "measured": ({"balance": "measured"}, True)}
    cgroup = CGROUP_ROOT / f"ndtrain-bench-{os.getpid()}"
    cgroup.mkdir()
    (cgroup / "fast").mkdir()
    (cgroup / "slow").mkdir()
    try:
        (cgroup / "cpu.shares").write_text(str(args.shares))
        (cgroup / "slow" / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (cgroup / "slow" / "cpu.cfs_quota_us").write_text(str(int(args.quota * PERIOD_US)))
        out: dict[str, list] = {a: [] for a in arms}
        for rnd in range(args.rounds):
            for arm, (parallel, measured) in arms.items():
                cfg = load_config(None, {**base, "parallel": {**base["parallel"], **parallel}})
                load0 = os.getloadavg()[0]
                per_rank = run_ranks(2, _arm, cfg, str(cgroup), args.warmup, args.steps, measured, timeout_s=1800.0)
                tps = args.steps * args.global_batch * args.seq / per_rank[0]["wall_s"]
                row = {"arm": arm, "round": rnd, "tokens_per_s": round(tps, 1),
                       "rows": [r["rows"] for r in per_rank], "losses": per_rank[0]["losses"],
                       "load_before": load0, "load_after": os.getloadavg()[0], "said": per_rank[0]["said"]}
                out[arm].append(row)
                print(json.dumps(row), flush=True)
    finally:  # the ranks have exited: the groups are empty
        for group in (cgroup / "fast", cgroup / "slow", cgroup):
            group.rmdir()
    cfg = load_config(None, base)
    half = args.global_batch // 2
    shares = next(r["rows"] for r in out["plan"])
    mean = {a: sum(r["tokens_per_s"] for r in rows) / len(rows) for a, rows in out.items()}
    d_loss = max(abs(a - b) for u, p in zip(out["uniform"], out["plan"]) for a, b in zip(u["losses"], p["losses"]))
    d_loss_m = max(abs(a - b) for u, p in zip(out["uniform"], out["measured"]) for a, b in zip(u["losses"], p["losses"]))
    print(json.dumps({
        "summary": True, "tokens_per_s": mean,
        "measured_ratio": {"plan/uniform": mean["plan"] / mean["uniform"],
                           "measured/uniform": mean["measured"] / mean["uniform"]},
        "per_round_ratio": [{"plan/uniform": p["tokens_per_s"] / u["tokens_per_s"],
                             "measured/uniform": m["tokens_per_s"] / u["tokens_per_s"]}
                            for u, p, m in zip(out["uniform"], out["plan"], out["measured"])],
        "predicted_tokens_per_s": {"uniform": predict(cfg, args.quota, [half, half]),
                                   "plan": predict(cfg, args.quota, shares)},
        "max_abs_loss_diff": {"plan vs uniform": d_loss, "measured vs uniform": d_loss_m},
        "measured_rows": [r["rows"] for r in out["measured"]]}), flush=True)


if __name__ == "__main__":
    main()
