"""The collectives FSDP issues on CPU ranks, as Gloo runs them and as ndtrain runs them, side by
side: reduce-scatter (Gloo's own, which torch runs as a clone and a full all-reduce, vs ndtrain's
all-to-all and sum, parallel/gloo_reduce_scatter.py), all-reduce, and all-gather (Gloo's own vs an
all-to-all of repeated shards, the alternative that was tried and not taken).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gloo_collectives.py [--world 2] [--reps 15]

Forked ranks, one thread each, every operation once per round in turn, the median over rounds
(the first three dropped) in ms, on rank 0; the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ndtrain.parallel.gloo_reduce_scatter import AllToAllReduceScatter
from ndtrain.parallel.launch import run_ranks

SIZES_MB = (1.0, 3.4, 8.0, 25.0)  # 3.4 MB: one decoder block of the peers' model in fp32


def _rounds(reps: int) -> dict:
    world = dist.get_world_size()
    ours = AllToAllReduceScatter()
    out = {}
    for mb in SIZES_MB:
        n = int(mb * 2**20 / 4) // world * world
        full, shard = torch.randn(n), torch.randn(n // world)
        gathered = torch.empty(n)
        ops = {
            "reduce_scatter (Gloo)": lambda: dist.reduce_scatter_single(shard, full),
            "reduce_scatter (ndtrain: all-to-all + sum)": lambda: ours(shard, full, dist.group.WORLD, dist.ReduceOp.SUM),
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather (Gloo)": lambda: dist.all_gather_single(gathered, shard),
            "all_gather (all-to-all of repeated shards)": lambda: dist.all_to_all_single(gathered, shard.repeat(world)),
        }
        times = {k: [] for k in ops}
        for _ in range(reps):
            for name, op in ops.items():
                dist.barrier()
                start = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - start)
        out[mb] = {k: 1e3 * statistics.median(v[3:]) for k, v in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    load = os.getloadavg()[0]
    result = run_ranks(a.world, _rounds, a.reps)[0]
    names = list(next(iter(result.values())))
    print(f"world {a.world}, median of {a.reps - 3} rounds, ms; load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| operation | " + " | ".join(f"{mb:g} MB" for mb in SIZES_MB) + " |")
    print("|---|" + "---|" * len(SIZES_MB))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{result[mb][name]:.2f}" for mb in SIZES_MB) + " |")


if __name__ == "__main__":
    main()
