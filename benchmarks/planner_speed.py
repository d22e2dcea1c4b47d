"""The planner's search at 16,384 GPUs, timed: CPU and wall seconds, layouts per CPU-second.

    .venv/bin/python benchmarks/planner_speed.py [--runs 3] [--worlds 32]

Llama 3 405B, 8K sequences, 2,048 of them a step, on 16,384 H100 (full bisection): `search(pb,
top_k=8)` and then `assess(pb, res, worlds)` (the sampled worlds of `plan`'s intervals), each
run in this one process. The tests count the same search's work instead (tests/planner/
test_search.py, test_uncertainty.py); seconds belong here, beside the host they ran on: per-core
speed differs several-fold between the CPUs ndtrain meets. CPU time (`time.process_time`) is
this process's alone, so a loaded host shows in wall time and the load average, not in it.
"""

from __future__ import annotations

import argparse
import os
import time

from common import host_header

from ndtrain.model.config import preset
from ndtrain.planner.problem import make_problem
from ndtrain.planner.search import search
from ndtrain.planner.uncertainty import assess


def one_run(worlds: int) -> dict:
    pb = make_problem(preset("llama3-405b"), 8192, 2048, 16384, "h100")
    cpu, wall = time.process_time(), time.perf_counter()
    res = search(pb, top_k=8)
    search_cpu, search_wall = time.process_time() - cpu, time.perf_counter() - wall
    cpu = time.process_time()
    rob = assess(pb, res, worlds=worlds)
    return {"considered": res.considered, "bounded": res.bounded, "sized": res.sized, "timed": res.evaluated,
            "search_cpu": search_cpu, "search_wall": search_wall, "assess_cpu": time.process_time() - cpu,
            "candidates": len(rob.candidates), "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worlds", type=int, default=32)
    a = ap.parse_args()
    print(host_header())
    print(f"\n| run | layouts considered | lower bounds | sized | timed | search CPU s | search wall s "
          f"| layouts/CPU-s | + {a.worlds} worlds CPU s | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i in range(a.runs):
        r = one_run(a.worlds)
        print(f"| {i + 1} | {r['considered']:,} | {r['bounded']:,} | {r['sized']:,} | {r['timed']:,} "
              f"| {r['search_cpu']:.2f} | {r['search_wall']:.2f} | {r['considered'] / r['search_cpu']:,.0f} "
              f"| {r['assess_cpu']:.2f} | {r['load']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
