"""Uneven batch shares across two nodes of a cluster in a box, one node held to half a CPU by its
cgroup quota: the uniform split against balanced shares, through `ndtrain train` as a user runs it
(docs/heterogeneous.md, "Shown on CPU").

Two nodes (tests/cluster/harness.py: a network namespace, hostname, /tmp and cgroup each; needs
root), one torchrun agent per node started as examples/slurm starts them (c10d rendezvous at the
first node's name), one rank per node, DDP across the nodes (dp_replicate=2), the `tiny` preset on
the stdlib byte corpus, fp32, the same seed, data and global batch in every arm:

  uniform   equal rows per rank (what a framework without shares does: every step waits for
            the slow node)
  plan      parallel.batch_shares = [1, QUOTA]: the weights a plan told each node's speed would give
  measured  parallel.balance = "measured" from equal rows: the job re-balances at its first
            checkpoint boundary (after --warmup steps) from the ranks' measured compute time

The arms run interleaved, --rounds times. The slow node is node2 (rank 1: torch's c10d rendezvous
orders ranks by node name; the run's own metrics confirm it, below). Each node's agent and worker
are pinned to a core of their own (taskset), and each node's cgroup weighs --shares against the
host's other work, so that node2's quota, not the shared host's load, sets its pace; the load
average is recorded beside every run anyway.

Measured per run: the median step time of the steps after --warmup (from metrics.jsonl), the
tokens/s it gives, the rows each rank trained (metrics' `rank_rows`, or the arm's split), every
step's loss. The summary: the ratios to the uniform split side by side with the planner's
prediction (benchmarks/uneven_shares.py's `predict`: the this-machine profile's step time for each
rank's rows, the slow rank's compute and optimizer time divided by its CPU share), and the largest
difference in any step's loss between each arm and the uniform split.

    sudo OMP_NUM_THREADS=1 .venv/bin/python benchmarks/uneven_nodes.py --rounds 2 --json /tmp/un.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "cluster"), str(ROOT / "benchmarks"), str(ROOT / "src")]

import harness  # noqa: E402
import scenario  # noqa: E402
from common import host_header  # noqa: E402
from uneven_shares import predict  # noqa: E402


def job(args, data: Path, parallel: dict) -> dict:
    return {"model": {"preset": "tiny", "vocab_size": 256}, "data": {"path": str(data), "seq_len": args.seq},
            "train": {"steps": args.warmup + args.steps, "global_batch": args.global_batch,
                      "micro_batch": args.global_batch, "seed": 1, "val_interval": 0, "sample_tokens": 0},
            "checkpoint": {"interval_steps": args.warmup},
            "parallel": {"dp_replicate": 2, "dp_shard": 1, "compile": False, "mixed_precision": "fp32", **parallel},
            "logging": {"tensorboard": False, "progress": "off"}}


def run_arm(args, cluster, arm: str, parallel: dict, run_id: str) -> dict:
    from ndtrain.config import load_config, to_toml

    config = cluster.shared / f"{run_id}.toml"
    config.write_text(to_toml(load_config(None, job(args, cluster.shared / "data", parallel))))
    run_dir = cluster.shared / "runs" / run_id
    load0, t0 = os.getloadavg()[0], time.monotonic()
    codes, started = scenario.train_across(cluster, config, run_dir, 1, args.timeout, run_id=run_id, pin_cores=True)
    wall = time.monotonic() - t0
    if set(codes.values()) != {0}:
        raise RuntimeError(f"{arm} ({run_id}): exit codes {codes}\n{started.all_logs()}")
    rows = scenario.metric_rows(run_dir)
    steps = {r["step"]: r for r in rows if "step_time_s" in r and "event" not in r}
    timed = [r["step_time_s"] for s, r in steps.items() if s > args.warmup]
    step_s = statistics.median(timed)
    said = [ln for ln in started.log("node1").splitlines() if "balance" in ln.lower()]
    events = [r for r in rows if r.get("event") == "rebalance"]
    return {"arm": arm, "run_id": run_id, "step_s": step_s, "tokens_per_s": args.global_batch * args.seq / step_s,
            "losses": {s: r["loss"] for s, r in sorted(steps.items())}, "said": said, "events": events,
            "last_row": {k: v for k, v in steps[max(steps)].items() if k not in ("losses",)},
            "load_before": load0, "load_after": os.getloadavg()[0], "wall_s": wall}


def rows_of(args, shares: list[float]) -> list[int]:
    from ndtrain.layout.batch_shares import share_rows

    return share_rows(args.global_batch, shares)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=4, help="steps before timing; measured re-balances after them")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--quota", type=float, default=0.5, help="node2's CPU share (cfs quota / period)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--shares", type=int, default=10240, help="cpu.shares of each node's cgroup (1024: a plain process's)")
    p.add_argument("--timeout", type=float, default=1200.0, help="hang guard per run, seconds")
    p.add_argument("--json", default="")
    args = p.parse_args()
    why = harness.missing_requirements()
    if why:
        p.error(f"a cluster in a box {why}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(host_header(), flush=True)
    from ndtrain.config import load_config
    from ndtrain.data.prepare import prepare

    arms = {"uniform": {}, "plan": {"batch_shares": [1.0, args.quota]}, "measured": {"balance": "measured"}}
    out: dict[str, list] = {a: [] for a in arms}
    with harness.Cluster(2) as cluster:
        prepare(None, cluster.shared / "data", tokenizer="byte", val_fraction=0.05, max_bytes=400_000)
        for node in cluster.nodes:
            (node.cgroups["cpu"] / "cpu.shares").write_text(str(args.shares))
        cluster.nodes[1].cpu_quota(args.quota)
        for rnd in range(args.rounds):
            for arm, parallel in arms.items():
                row = run_arm(args, cluster, arm, parallel, f"{arm}-{rnd}")
                out[arm].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    base = load_config(None, job(args, Path("data"), {}))
    half = args.global_batch // 2
    plan_rows = rows_of(args, arms["plan"]["batch_shares"])
    mean = {a: statistics.mean(r["tokens_per_s"] for r in rs) for a, rs in out.items()}

    def max_diff(arm: str) -> float:
        return max(abs(a - u["losses"][s]) for u, x in zip(out["uniform"], out[arm])
                   for s, a in x["losses"].items() if s in u["losses"])

    summary = {
        "summary": True, "tokens_per_s": mean,
        "ratio": {a: mean[a] / mean["uniform"] for a in ("plan", "measured")},
        "per_round_ratio": [{a: out[a][i]["tokens_per_s"] / out["uniform"][i]["tokens_per_s"] for a in ("plan", "measured")}
                            for i in range(args.rounds)],
        "predicted_tokens_per_s": {"uniform": predict(base, args.quota, [half, half]),
                                   "plan": predict(base, args.quota, plan_rows)},
        "plan_rows": plan_rows,
        "max_abs_loss_diff": {"plan vs uniform": max_diff("plan"), "measured vs uniform": max_diff("measured")}}
    summary["predicted_ratio"] = summary["predicted_tokens_per_s"]["plan"] / summary["predicted_tokens_per_s"]["uniform"]
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": out, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
