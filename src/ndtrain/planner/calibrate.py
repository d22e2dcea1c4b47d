"""`ndtrain calibrate`: measure this machine and write the hardware profile the planner's
"this-machine" entry loads. The only planner module that imports torch.

Measured: matmul FLOP/s (fp32, bf16; 1 and 2 threads), copy bandwidth, and Gloo all-reduce,
all-gather, reduce-scatter, all-to-all and p2p times at several sizes for worlds 2 and 4, each rank
a forked process with one thread, as the trainer runs on CPU. Each collective gets an alpha-beta
fit over all its samples: t = alpha * hops(k) + bytes * share(k) / beta, with the same hops/share
per algorithm that planner/comm.py uses, so the fit plugs straight into the time model.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.planner.hardware import DEFAULT_PROFILE

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def _hops_share(kind: str, k: int) -> tuple[float, float]:
    if kind == "p2p":
        return 1.0, 1.0
    if kind == "all_reduce":
        return 2.0 * (k - 1), 2.0 * (k - 1) / k
    return float(k - 1), (k - 1) / k


def fit_alpha_beta(kind: str, samples: list[tuple[int, float, float]]) -> dict:
    """Least squares of t = alpha * hops + (bytes * share) * (1/beta) over (world, bytes, seconds)."""
    rows = [(*_hops_share(kind, k), n, t) for k, n, t in samples]
    sxx = sum(h * h for h, _, _, _ in rows)
    syy = sum((s * n) ** 2 for _, s, n, _ in rows)
    sxy = sum(h * s * n for h, s, n, _ in rows)
    sxt = sum(h * t for h, _, _, t in rows)
    syt = sum(s * n * t for _, s, n, t in rows)
    det = sxx * syy - sxy * sxy
    alpha, inv_beta = ((syy * sxt - sxy * syt) / det, (sxx * syt - sxy * sxt) / det) if det else (0.0, 0.0)
    if alpha <= 0 or inv_beta <= 0:  # noise on a busy machine: fall back to one-parameter fits
        inv_beta = max(syt / syy, 1e-12) if syy else 1e-9
        alpha = max(1e-7, sum(t - s * n * inv_beta for h, s, n, t in rows) / max(1.0, sum(h for h, _, _, _ in rows)))
    return {"alpha": alpha, "beta": 1.0 / inv_beta}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    results = []
    for n in sizes:
        elems = max(world, n // 4 // world * world)
        full = torch.ones(elems)
        part = torch.ones(elems // world)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: ag(full, part),
            "reduce_scatter": lambda: rs(part, full),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
            "p2p": (lambda: dist.send(full, 1)) if rank == 0 else (lambda: dist.recv(full, 0)) if rank == 1 else None,
        }
        for kind in KINDS:
            op = ops[kind]
            dist.barrier()
            if op is not None:
                op()  # warm-up: connections, buffers
                times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    op()
                    times.append(time.perf_counter() - start)
                if rank == 0:  # the median shrugs off other jobs on a shared machine
                    results.append((kind, world, elems * 4, statistics.median(times)))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def measure_collectives(worlds=(2, 4), sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22), reps: int = 8) -> list:
    import torch.multiprocessing as mp

    samples = []
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the forked ranks
    try:
        for world in worlds:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                mp.start_processes(_collective_worker, args=(world, _free_port(), list(sizes), reps, out),
                                   nprocs=world, start_method="fork")
                samples += [tuple(r) for r in json.loads(Path(out).read_text())]
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return samples


def measure_matmul(dtype_name: str, threads: int, sizes=(256, 512, 1024), min_time: float = 0.15) -> float:
    """Best FLOP/s over square matmuls of the given sizes."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = 0.0
    try:
        for n in sizes:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            a @ b
            times, begin = [], time.perf_counter()
            while time.perf_counter() - begin < min_time or len(times) < 3:
                start = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - start)
            one = statistics.median(times)
            best = max(best, 2 * n**3 / one)
            if one > min_time / 3:  # larger sizes would only take longer
                break
    finally:
        torch.set_num_threads(old)
    return best


def measure_copy_bw(mbytes: int = 64, min_time: float = 0.2) -> float:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(mbytes * (1 << 20) // 4)
        y = torch.empty_like(x)
        y.copy_(x)
        times, begin = [], time.perf_counter()
        while time.perf_counter() - begin < min_time or len(times) < 3:
            start = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - start)
        return 2 * x.numel() * 4 / statistics.median(times)  # read + write
    finally:
        torch.set_num_threads(old)


def measure_op_overhead(chain: int = 200, reps: int = 15) -> float:
    """Median host time of one tiny forward op plus its backward under autograd: the per-op floor
    that a small model's step pays on CPU."""
    import torch

    x = torch.ones(4, requires_grad=True)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()
        times.append((time.perf_counter() - start) / chain)
    return statistics.median(times)


def calibrate(worlds=(2, 4), sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22), reps: int = 8, matmul_sizes=(256, 512, 1024),
              min_time: float = 0.15) -> dict:
    start = time.perf_counter()
    matmul = {f"{d}_{t}thread": measure_matmul(d, t, matmul_sizes, min_time) for d in ("fp32", "bf16") for t in (1, 2)}
    samples = measure_collectives(worlds, sizes, reps)
    collectives = {}
    for kind in KINDS:
        mine = [(k, n, t) for (kd, k, n, t) in samples if kd == kind]
        if mine:
            collectives[kind] = {**fit_alpha_beta(kind, mine), "samples": [list(s) for s in mine]}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    devices = max(worlds)
    return {
        "description": f"this machine ({os.cpu_count()} cores, calibrated {time.strftime('%Y-%m-%d')})",
        "devices_per_node": devices, "cores": os.cpu_count(),
        "matmul": matmul,
        "memory": {"total_bytes": total, "bytes_per_device": total / devices, "copy_bw": measure_copy_bw()},
        "collectives": collectives, "op_overhead_s": measure_op_overhead(), "seconds": time.perf_counter() - start,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_PROFILE), help=f"profile path (default {DEFAULT_PROFILE})")
    p.add_argument("--worlds", default="2,4", help="process counts for the collectives")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a few seconds)")
    args = p.parse_args(argv)
    try:
        worlds = tuple(int(w) for w in args.worlds.split(","))
    except ValueError as exc:
        raise NdtrainError(f"--worlds must be a comma list of integers, got {args.worlds!r}") from exc
    if any(w < 2 for w in worlds):
        raise NdtrainError("--worlds: each world needs at least 2 processes")
    if args.quick:
        prof = calibrate(worlds, sizes=(1 << 12, 1 << 18), reps=3, matmul_sizes=(128, 256), min_time=0.05)
    else:
        prof = calibrate(worlds)
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1))
    print(f"wrote {out} ({prof['seconds']:.1f} s)")
    for name, flops in prof["matmul"].items():
        print(f"  matmul {name:<12} {flops / 1e9:8.1f} GFLOP/s")
    print(f"  copy bandwidth        {prof['memory']['copy_bw'] / 1e9:8.2f} GB/s")
    print(f"  eager op overhead     {prof['op_overhead_s'] * 1e6:8.1f} us")
    for kind, fit in prof["collectives"].items():
        print(f"  {kind:<14} alpha {fit['alpha'] * 1e6:8.1f} us   beta {fit['beta'] / 1e9:6.2f} GB/s")
    return 0
