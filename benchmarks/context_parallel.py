"""Context parallel: tokens/s and peak activation memory per rank vs sequence length, cp = 1, 2, 4.

Each (seq_len, cp) point trains a few steps of one sequence per step (global batch 1) on the
prepared corpus; cp ranks are forked Gloo processes, one thread each. Activation memory is the
bytes autograd saves for backward (train/activation_meter.py), per rank; throughput uses the
fastest of the measured steps after one warm-up step (the least disturbed by other processes
on a shared host). Read the ratios: this host has 2 cores, so cp=1 uses one, cp=2 both, and
cp=4 oversubscribes them 2x.

    python benchmarks/context_parallel.py --seq 2048 4096 8192 --out docs/benchmarks_context.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from ndtrain.config import load_config  # noqa: E402


def job(data: str, seq: int, cp: int, mode: str, model: dict):
    return load_config(None, {
        "model": {**model, "max_seq_len": max(seq, 2048)},
        "data": {"path": data, "seq_len": seq},
        "optimizer": {"warmup_steps": 0, "schedule": "constant"},
        "train": {"global_batch": 1, "micro_batch": 1, "seed": 0},
        "parallel": {"cp": cp, "dp_shard": 1, "cp_attention": mode},
        "logging": {"tensorboard": False, "progress": "off"}})


def measure(cfg, steps: int) -> dict:
    from ndtrain.train.activation_meter import SavedActivationMeter
    from ndtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(cfg, run_dir=None, log=False)
    times, cpu, peak = [], [], 0
    for i in range(steps + 1):
        with SavedActivationMeter() as meter:
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train_step()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
        peak = max(peak, meter.peak_bytes)
        if i:  # the first step warms up allocators and kernels
            times.append(dt)
            cpu.append(dc)
    return {"step_s": min(times), "cpu_s": min(cpu), "peak": peak}


def point(data: str, seq: int, cp: int, mode: str, model: dict, steps: int) -> dict:
    cfg = job(data, seq, cp, mode, model)
    if cp == 1:
        return measure(cfg, steps)
    from ndtrain.parallel.launch import run_ranks

    per_rank = run_ranks(cp, measure, cfg, steps, timeout_s=600)
    # A step ends when the slowest rank ends; memory is reported for the fullest rank; CPU time
    # (all threads, Gloo's included) is summed over ranks: the work cp costs, whatever the load.
    return {"step_s": max(r["step_s"] for r in per_rank), "peak": max(r["peak"] for r in per_rank),
            "cpu_s": sum(r["cpu_s"] for r in per_rank)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["ring", "allgather"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--data", default="data/stdlib-byte")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if not (Path(args.data) / "manifest.json").exists():
        print(f"{args.data} is not prepared; run `ndtrain prepare --out {args.data} --max-mb 16 --if-absent`")
        return 2
    model = {"preset": "debug", "dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 4,
             "ffn_dim": 3 * args.dim}
    rows = []
    for seq in args.seq:
        base = None
        for cp in args.cp:
            for mode in (["ring"] if cp == 1 else args.modes):
                r = point(args.data, seq, cp, mode, model, args.steps)
                base = base or r
                row = (seq, cp, mode if cp > 1 else "-", seq / r["step_s"], r["peak"] / 2**20,
                       base["peak"] / r["peak"], base["step_s"] / r["step_s"], r["cpu_s"] / base["cpu_s"])
                rows.append(row)
                print("seq {:>6}  cp {}  {:>9}  {:>8.0f} tok/s  {:>8.1f} MiB/rank  mem 1/{:.2f}  speed x{:.2f}  "
                      "cpu x{:.2f}".format(*row), flush=True)
    cmd = "python benchmarks/context_parallel.py " + " ".join(argv)
    table = ["| seq_len | cp | attention | tokens/s | peak activations / rank (MiB) | memory vs cp=1 | "
             "speed vs cp=1 | CPU-seconds vs cp=1 |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    table += ["| {} | {} | {} | {:.0f} | {:.1f} | 1/{:.2f} | {:.2f}x | {:.2f}x |".format(*r) for r in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        Path(args.out).write_text(
            f"Model: debug preset with dim={args.dim}, n_layers={args.layers}, 8 heads (4 kv-heads), "
            f"fp32; one sequence per step; torch {torch.__version__}, {os.cpu_count()} CPU cores, Gloo, "
            f"one thread per rank; load average {os.getloadavg()[0]:.1f} when it finished.\n\n"
            f"Command: `{cmd}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
