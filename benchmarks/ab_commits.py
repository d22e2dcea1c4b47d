"""One change measured alone: ndtrain's trainer at two commits, side by side, in interleaved rounds.

    .venv/bin/python benchmarks/ab_commits.py --before 060d87a [--after HEAD] --rounds 4 \
        --layout "--parallel.dp_shard=2 --parallel.zero=3" [--precision fp32] [--steps 30]

Each commit is checked out once into a temporary git worktree and run through `PYTHONPATH` (the
same interpreter and packages); `--after` defaults to this working tree. Every round runs both,
the order alternating, the peers' model and batch (benchmarks/peers.py) on synthetic tokens.
Per run: median tokens/s and tokens per CPU-second of one rank after the warm-up steps, the last
loss (the two must agree where the change is not meant to alter numerics) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import ROOT, peer_train_command, synthetic_tokens, PEER_MODEL


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), rev], check=True,
                   capture_output=True)
    return into / "src"


def run(src: Path | None, a, data: Path, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    load = os.getloadavg()[0]
    cmd = peer_train_command(data, out, world=a.world, mb=a.mb, seq=a.seq, steps=a.steps, precision=a.precision,
                             extra=shlex.split(a.layout))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r and r["step"] > a.warmup]
    tokens = a.mb * a.seq
    return {"tokens_per_s": tokens * a.world / statistics.median(r["step_time_s"] for r in steps),
            "tokens_per_cpu_s": tokens / statistics.median(r["step_cpu_s"] for r in steps),
            "loss": steps[-1]["loss"], "load": (load, os.getloadavg()[0])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=None, help="a commit; default: this working tree")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layout", default="", help="ndtrain train arguments, e.g. '--parallel.dp_shard=2'")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mb", type=int, default=4)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ndtrain-ab-"))
    data = synthetic_tokens(tmp / "data", PEER_MODEL["vocab_size"])
    trees = {"before": checkout(a.before, tmp / "before"),
             "after": checkout(a.after, tmp / "after") if a.after else None}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        for i in range(a.rounds):
            for name in (("after", "before") if i % 2 == 0 else ("before", "after")):
                r = run(trees[name], a, data, tmp / f"{name}-{i}")
                results[name].append(r)
                print(f"round {i + 1} {name:6s} {r['tokens_per_s']:7,.0f} tok/s {r['tokens_per_cpu_s']:7,.0f} "
                      f"tok/CPU-s  loss {r['loss']:.6f}  load {r['load'][0]:.1f}->{r['load'][1]:.1f}", flush=True)
    finally:
        for name, src in trees.items():
            if src is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src.parent)],
                               capture_output=True)
    med = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in results.items()}
    cpu = {n: statistics.median(r["tokens_per_cpu_s"] for r in rs) for n, rs in results.items()}
    wins = sum(x["tokens_per_s"] > y["tokens_per_s"] for x, y in zip(results["after"], results["before"]))
    print(f"after / before: {med['after'] / med['before']:.3f} by median tokens/s ({med['after']:,.0f} vs "
          f"{med['before']:,.0f}), {cpu['after'] / cpu['before']:.3f} by tokens per CPU-second; after won "
          f"{wins} of {a.rounds} rounds")


if __name__ == "__main__":
    main()
