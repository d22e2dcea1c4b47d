"""Where one ndtrain training step goes, and CPU-MFU against this CPU's measured matmul peak.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/breakdown.py [--layouts dp_shard=2,dp_replicate=2] [--steps 4]

The peers' shape (common.PEER_MODEL), seq 256, micro-batch 4 per rank, fp32 by default, world 2
on forked Gloo ranks (1 thread each). After warm-up steps, torch.profiler records `--steps`
steps on rank 0; every op's self CPU time on the training thread is put in one bucket:
matmul (mm/addmm/bmm), attention (SDPA kernels), optimizer (inside Optimizer.step), communication
(collectives, their waits and FSDP's copy-in/out around them), data (the loader), elementwise
(every other op), and Python (the step's wall time not spent inside any op). Tokens per
CPU-second (per rank) is the work a step costs, which the host's load stretches far less than
the wall time. CPU-MFU is the
model's FLOPs (ndtrain.layout.flops, 6N + attention) over the step time, against the matmul
peak measured here on the same thread count (a 512^3 matmul, best of a few).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from common import PEER_MODEL, synthetic_tokens  # noqa: E402

BUCKETS = ("matmul", "attention", "elementwise", "optimizer", "communication", "data", "python")
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_addmm_activation", "aten::baddbmm",
          "mkldnn::_linear_pointwise")  # the oneDNN fp32 linears (model/linear.py)
COMM = ("c10d", "gloo", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "broadcast", "FSDP::",
        "fsdp::", "_wait_tensor", "record_param_comms", "aten::_foreach_copy", "aten::split_with_sizes_copy")


def matmul_peak(dtype: torch.dtype, n: int = 512, reps: int = 40) -> float:
    """Best of many short matmuls: on a shared host the best one is the least disturbed."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def bucket_of(ev, ancestors: list[str]) -> str:
    if any(a.startswith("Optimizer.step") or a.startswith("Optimizer.zero_grad") for a in ancestors):
        return "optimizer"
    if any(a.startswith("ndtrain.data") for a in ancestors):
        return "data"
    names = [ev.name, *ancestors]
    if any(any(c in n for c in COMM) for n in names):
        return "communication"
    if any("scaled_dot_product" in n or "flash_attention" in n for n in names):
        return "attention"
    if ev.name in MATMUL:
        return "matmul"
    return "elementwise"


def profile_rank(overrides: list[str], warmup: int, steps: int, peaks: dict, top: int = 0) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from ndtrain.config import load_config
    from ndtrain.train.trainer import Trainer

    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, run_dir=None, log=False)
    next_batch = trainer.state.loader.next_batch

    def traced(*a, **k):
        with record_function("ndtrain.data.next_batch"):
            return next_batch(*a, **k)

    trainer.state.loader.next_batch = traced
    for _ in range(warmup):
        trainer.train_step()
    tid = None
    walls, cpus = [], []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("ndtrain.step"):
                c0 = time.process_time()  # here, not the trainer's step_cpu_s: older trainers lack it
                walls.append(trainer.train_step().seconds)
                cpus.append(time.process_time() - c0)
    events = prof.events()
    steps_ev = [e for e in events if e.name == "ndtrain.step"]
    tid = steps_ev[0].thread
    totals = dict.fromkeys(BUCKETS, 0.0)
    by_op: dict = {}
    for ev in events:
        if ev.thread != tid or ev.name == "ndtrain.step":
            continue
        ancestors, p = [], ev.cpu_parent
        while p is not None:
            ancestors.append(p.name)
            p = p.cpu_parent
        if ev.name.startswith("ndtrain.data") or ev.name.startswith("Optimizer.") or "FSDP::" in ev.name:
            # record_function scopes: their children carry the time; the scope's own self time
            # (Python between its ops) still belongs to the scope's bucket.
            pass
        b = bucket_of(ev, ancestors)
        totals[b] += ev.self_cpu_time_total / 1e6
        key = f"{b}: {ev.name} < {ancestors[0] if ancestors else ''}"
        by_op[key] = by_op.get(key, 0.0) + ev.self_cpu_time_total / 1e6 / steps
    wall = sum(walls)
    totals["python"] = max(0.0, wall - sum(totals.values()))
    from ndtrain.layout.flops import flops_per_token

    tokens = cfg.train.global_batch * cfg.data.seq_len * len(walls)
    flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    world = torch.distributed.get_world_size()
    step = wall / len(walls)
    result = {"layout": trainer.state.layout.describe(), "step_s": step, "tokens_per_s": tokens / wall,
              "tokens_per_cpu_s": tokens / world / sum(cpus),
              "mfu": flops / wall / (peaks["peak"] * world), "per_step_s": {k: v / len(walls) for k, v in totals.items()},
              "top_ops": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:top])}
    trainer.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="dp_shard=2;dp_replicate=2,dp_shard=1;dp_shard=2,zero=1")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=0, help="also print the N ops with the most self time")
    ap.add_argument("--extra", default="", help="more overrides, space-separated (e.g. --parallel.compile=true)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    peak32, peak16 = matmul_peak(torch.float32), matmul_peak(torch.bfloat16)
    print(f"matmul peak, 1 thread, 512^3: fp32 {peak32 / 1e9:.1f} GFLOP/s, bf16 {peak16 / 1e9:.1f} GFLOP/s "
          f"(bf16/fp32 {peak16 / peak32:.2f}x); load average {os.getloadavg()[0]:.2f}", flush=True)
    peaks = {"peak": peak16 if a.precision == "bf16" else peak32}
    tmp = Path(tempfile.mkdtemp(prefix="ndtrain-breakdown-"))
    data = synthetic_tokens(tmp / "data", PEER_MODEL["vocab_size"])
    from ndtrain.parallel.launch import run_ranks

    print("\n| layout | tokens/s | tokens/CPU-s per rank | CPU-MFU | " + " | ".join(BUCKETS) + " | load |\n" + "|---" * (5 + len(BUCKETS)) + "|")
    for spec in a.layouts.split(";"):
        items = dict(kv.split("=") for kv in spec.split(","))
        overrides = [f"--model.{k}={v}" for k, v in PEER_MODEL.items()] + [
            f"--data.path={data}", "--data.seq_len=256", "--train.global_batch=8", "--train.micro_batch=4",
            "--train.steps=1000", "--optimizer.warmup_steps=0", f"--parallel.mixed_precision={a.precision}",
            *[f"--parallel.{k}={v}" for k, v in items.items()], *a.extra.split()]
        load = os.getloadavg()[0]
        r = run_ranks(2, profile_rank, overrides, a.warmup, a.steps, peaks, a.top, timeout_s=600)[0]
        ps = r["per_step_s"]
        print(f"| {spec} | {r['tokens_per_s']:,.0f} | {r['tokens_per_cpu_s']:,.0f} | {r['mfu']:.1%} | "
              + " | ".join(f"{ps[k] * 1e3:.0f} ms ({ps[k] / r['step_s']:.0%})" for k in BUCKETS)
              + f" | {load:.1f} |", flush=True)
        for op, sec in r["top_ops"].items():
            print(f"    {sec * 1e3:8.1f} ms  {op}")


if __name__ == "__main__":
    main()
