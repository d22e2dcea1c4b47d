"""Measured pipeline bubble vs the published formulas.

For each (schedule, m) it trains a few steps of a pipeline layout on local Gloo ranks with every
stage action timed, and prints the mean idle fraction of the ranks next to (p-1)/(m+p-1) for
1F1B and (p-1)/(v*m+p-1) for Interleaved1F1B, plus the ideal bubble of torch's action order for
the measured F/B costs. The first step (metadata inference, p2p warm-up) is not counted.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_bubble.py --pp 4 --ms 4,8,16 \
        --control-ms 10 --gantt docs/pipeline_gantt.png --gantt-of Interleaved1F1B:8

The model is sized so that one micro-batch's compute (milliseconds) dwarfs a Gloo p2p message
(~0.1 ms on one host); the vocabulary is the byte tokenizer's, so the head costs little and
the stages are balanced.

`--control-ms X` adds a control for hosts with fewer cores than ranks: the model shrinks to
dim 64 and seq 64, and every decoder block also sleeps X ms in forward and 2X ms in backward
(through an autograd function), so the stage time is dominated by work that does not compete
for a core. Schedules, stages, Gloo p2p and autograd are the real ones; only the contention is
taken out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ndtrain.config import load_config
from ndtrain.parallel import pipeline_schedule as ps
from ndtrain.tools.pipeline_report import draw_gantt, measured_panel, summarize, timed_actions


def config(args, schedule: str, v: int, m: int, control: bool = False):
    dim, seq = (64, 64) if control else (args.dim, args.seq)
    return load_config(None, {
        "model": {"preset": "debug", "dim": dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 4,
                  "ffn_dim": 3 * dim, "vocab_size": 256},
        "data": {"path": args.data, "seq_len": seq},
        "parallel": {"pp": args.pp, "dp_shard": 1, "pp_schedule": schedule, "pp_virtual_stages": v},
        "train": {"global_batch": m * args.rows, "micro_batch": args.rows, "timeout_s": 600.0},
        "logging": {"tensorboard": False, "progress": "off"},
    })


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        time.sleep(seconds)
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


def add_block_sleep(ms: float):
    """Patch the decoder block in this process (forked ranks inherit it); returns the undo."""
    from ndtrain.model import llama

    forward = llama.Block.forward

    def slow_forward(self, x, positions):
        return _Sleep.apply(forward(self, x, positions), ms / 1000.0)

    llama.Block.forward = slow_forward

    def undo():
        llama.Block.forward = forward

    return undo


def _pingpong(numel: int, iters: int) -> float:
    import torch.distributed as dist

    t = torch.zeros(numel)
    peer = 1 - dist.get_rank()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / 2  # median one-way


def p2p_latency(numel: int, iters: int = 200) -> float:
    """Median one-way Gloo send/recv time between two local ranks for `numel` fp32 values."""
    from ndtrain.parallel.launch import run_ranks

    return run_ranks(2, _pingpong, numel, iters)[0]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--ms", default="4,8,16", help="micro-batch counts")
    p.add_argument("--schedules", default="1F1B,Interleaved1F1B")
    p.add_argument("--v", type=int, default=2, help="stages per rank for interleaved schedules")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--data", default="data/stdlib-byte")
    p.add_argument("--gantt", help="PNG of one run's last step per mode (the first run, or --gantt-of)")
    p.add_argument("--gantt-of", default="", help="schedule:m whose timeline to draw, e.g. Interleaved1F1B:8")
    p.add_argument("--json", help="write every summary here")
    p.add_argument("--control-ms", type=float, default=0.0,
                   help="also run the control: each block sleeps this long in forward (2x in backward)")
    args = p.parse_args(argv)
    act = args.rows * args.seq * args.dim
    print(f"Gloo p2p one-way, median: {p2p_latency(1) * 1e3:.3f} ms (4 bytes), "
          f"{p2p_latency(act) * 1e3:.3f} ms (one activation, {act * 4 / 1e6:.2f} MB)", flush=True)
    modes = [("real compute", 0.0)] + ([(f"control: blocks sleep {args.control_ms:g} ms", args.control_ms)]
                                       if args.control_ms else [])
    results, panels = {}, []
    for title, sleep_ms in modes:
        undo = add_block_sleep(sleep_ms) if sleep_ms else None
        try:
            rows, drawn = run_grid(args, title, sleep_ms > 0)
        finally:
            if undo:
                undo()
        results[title] = rows
        print_table(title, rows, sleep_ms > 0)
        if drawn:
            per_rank, s = drawn
            panel = measured_panel(per_rank, s, len(per_rank[0]["traces"]) - 1)
            panel["title"] = f"{title} - {panel['title']}"
            panels.append(panel)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.gantt and panels:
        print(f"wrote {draw_gantt(panels, args.gantt)}")
    return 0


def run_grid(args, title: str, control: bool):
    rows, drawn = [], None
    for schedule in args.schedules.split(","):
        v = args.v if schedule in ps.INTERLEAVED + ps.V_SHAPED else 1
        for m in (int(x) for x in args.ms.split(",")):
            per_rank = timed_actions(config(args, schedule, v, m, control), args.pp, args.steps)
            s = summarize(per_rank, schedule, args.pp, v)
            formula = (args.pp - 1) / (v * m + args.pp - 1)
            rows.append({**{k: s[k] for k in ("schedule", "p", "v", "m", "mean_idle", "theory", "ideal", "step_s",
                                              "core_wait", "hop_s")},
                         "idle_by_rank": s["idle"], "formula": formula,
                         "costs_ms": {k: c * 1e3 for k, c in s["costs"].items()}})
            print(f"[{title}] {schedule:<16} p={args.pp} v={v} m={m:<3} measured {s['mean_idle']:6.1%}  "
                  f"formula {formula:6.1%}  step {s['step_s'] * 1e3:7.1f} ms  F {s['costs']['f'] * 1e3:.1f} ms "
                  f"B {s['costs']['b'] * 1e3:.1f} ms  core wait {s['core_wait']:.0%}  hop {s['hop_s'] * 1e3:.2f} ms",
                  flush=True)
            if args.gantt_of == f"{schedule}:{m}" or (not args.gantt_of and drawn is None):
                drawn = (per_rank, s)
    return rows, drawn


def print_table(title: str, rows: list[dict], sleeping: bool) -> None:
    print(f"\n{title}\n")
    print("| schedule | p | v | m | measured idle (mean of ranks) | published bubble | ratio | "
          "ideal for measured costs | per-hop delay explaining the gap | compute waiting for a core | step (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        wait = "n/a (sleep)" if sleeping else f"{r['core_wait']:.0%}"
        print(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['mean_idle']:.1%} | {r['formula']:.1%} | "
              f"{r['mean_idle'] / r['formula']:.2f} | {r['ideal']:.1%} | {r['hop_s'] * 1e3:.2f} ms | {wait} | "
              f"{r['step_s'] * 1e3:.0f} |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
