"""`ndtrain calibrate`: measure this machine and write the hardware profile the planner's
"this-machine" entry loads. The only planner module that imports torch.

Measured: matmul FLOP/s (fp32, bf16; 1 and 2 threads), causal attention FLOP/s, copy bandwidth,
the host time of a decoder layer (plain and DTensor tensor-parallel), and Gloo all-reduce,
all-gather, reduce-scatter, all-to-all and p2p times at several sizes for worlds 2, 4 and 8, each
rank a forked process with one thread, as the trainer runs on CPU. Each collective gets an
alpha-beta fit, t = alpha * hops(k) + bytes * share(k) / beta, with the same hops/share per
algorithm that planner/comm.py uses, so the fit plugs straight into the time model: one over all
samples, and one per world, because on a machine with fewer cores than ranks the cost of a
collective depends on how many ranks share the cores.
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


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, out: str,
                       tp_degrees: tuple = ()) -> None:
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
    for tp in tp_degrees:
        if world % tp == 0 and tp <= world:
            layer, head = _tp_host_seconds(world, tp, max(3, reps))
            if rank == 0:
                results.append(("tp_host", world, tp, [layer, head]))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _tiny_llama(layers: int):
    from ndtrain.model.config import ModelConfig
    from ndtrain.model.llama import build_model

    cfg = ModelConfig(preset="custom", dim=64, n_layers=layers, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=64)
    return build_model(cfg, "meta")


def _host_seconds(build, reps: int, tp: bool = False, sync=None) -> tuple[float, float]:
    """(per decoder layer, per micro-batch outside the layers) host seconds of a training micro-batch
    of a tiny Llama, whose compute is negligible: forward, the loss as the trainer computes it
    (vocab-parallel under TP), backward and reading the loss. The slope between 1 and 3 layers is the
    layer; the rest (embedding, head, loss) is the intercept. `build(layers)` returns a model."""
    import contextlib

    import torch
    import torch.nn.functional as F

    per_depth = {}
    for layers in (1, 3):
        model = build(layers)
        x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))

        def step():
            if tp:
                from torch.distributed.tensor.parallel import loss_parallel

                ctx = loss_parallel()
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
                loss.backward()
            float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

        step()
        times = []
        for _ in range(reps):
            if sync:
                sync()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        per_depth[layers] = statistics.median(times)
    layer = max(1e-6, (per_depth[3] - per_depth[1]) / 2)
    return layer, max(1e-6, per_depth[1] - layer)


def _tp_host_seconds(world: int, tp: int, reps: int) -> tuple[float, float]:
    """What a tensor-parallel (+SP) micro-batch costs beyond its FLOPs and bytes, as the runtime
    runs it (DTensor dispatch, the collectives at their latency), with `world` ranks busy in groups
    of `tp`: (per layer, per micro-batch for embedding, head and vocab-parallel loss)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ndtrain.model.init import materialize
    from ndtrain.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("rest", "tp"))

    def build(layers):
        model = _tiny_llama(layers)
        apply_tensor_parallel(model, mesh["tp"], True)
        materialize(model, 0, "cpu")
        return model

    return _host_seconds(build, reps, True, dist.barrier)


def measure_host_overhead(reps: int = 15) -> tuple[float, float]:
    """(per layer, per micro-batch outside the layers) host seconds of plain eager training, in
    this process."""
    import torch

    from ndtrain.model.init import materialize

    old = torch.get_num_threads()
    torch.set_num_threads(1)

    def build(layers):
        model = _tiny_llama(layers)
        materialize(model, 0, "cpu")
        return model

    try:
        return _host_seconds(build, reps)
    finally:
        torch.set_num_threads(old)


def measure_attention(dtype_name: str, seqs=(256, 1024), min_time: float = 0.15) -> dict:
    """Causal SDPA forward + backward at head dim 64, in FLOP/s as the time model counts them
    (3 x 4 b s^2 h d x 1/2: the causal half), keyed by sequence length."""
    import torch
    import torch.nn.functional as F

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = {}
    try:
        for seq in seqs:
            b, h, d = max(1, 1024 // seq), 8, 64
            q, k, v = (torch.randn(b, h, seq, d, dtype=dtype, requires_grad=True) for _ in range(3))

            def step():
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

            step()
            times, begin = [], time.perf_counter()
            while time.perf_counter() - begin < min_time or len(times) < 3:
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            rates[str(seq)] = 3 * 4 * b * seq * seq * h * d * 0.5 / statistics.median(times)
    finally:
        torch.set_num_threads(old)
    return rates


def measure_collectives(worlds=(2, 4), sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22), reps: int = 8,
                        tp_degrees: tuple = ()) -> list:
    """(kind, world, bytes, seconds) per collective and size; with tp_degrees also
    ("tp_host", world, tp, [per layer, per micro-batch]) from `_tp_host_seconds`."""
    import torch.multiprocessing as mp

    samples = []
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the forked ranks
    try:
        for world in worlds:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                mp.start_processes(_collective_worker, args=(world, _free_port(), list(sizes), reps, out, tp_degrees),
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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def calibrate(worlds=(2, 4, 8), sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22), reps: int = 8, matmul_sizes=(256, 512, 1024),
              min_time: float = 0.15, attention_seqs=(256, 1024), overhead_reps: int = 15, tp_degrees=(2, 4)) -> dict:
    start = time.perf_counter()
    matmul = {f"{d}_{t}thread": measure_matmul(d, t, matmul_sizes, min_time) for d in ("fp32", "bf16") for t in (1, 2)}
    attention = {d: measure_attention(d, attention_seqs, min_time) for d in ("fp32", "bf16")}
    samples = measure_collectives(worlds, sizes, reps, tp_degrees)
    tp_host: dict = {}
    for _, world, tp, (layer, head) in (x for x in samples if x[0] == "tp_host"):
        tp_host.setdefault(str(world), {})[str(tp)] = {"layer": layer, "head": head}
    samples = [x for x in samples if x[0] != "tp_host"]
    layer, head = measure_host_overhead(overhead_reps)
    collectives = {}
    for kind in KINDS:
        mine = [(k, n, t) for (kd, k, n, t) in samples if kd == kind]
        if mine:
            by_world = {str(w): fit_alpha_beta(kind, [x for x in mine if x[0] == w]) for w in sorted({x[0] for x in mine})}
            collectives[kind] = {**fit_alpha_beta(kind, mine), "by_world": by_world, "samples": [list(s) for s in mine]}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    devices = max(worlds)
    cores = _cores()
    return {
        "description": f"this machine ({cores} cores, calibrated {time.strftime('%Y-%m-%d')})",
        "devices_per_node": devices, "cores": cores,
        "matmul": matmul, "attention": attention,
        "memory": {"total_bytes": total, "bytes_per_device": total / devices, "copy_bw": measure_copy_bw()},
        "collectives": collectives, "op_overhead_s": measure_op_overhead(),
        "host_s": {"layer": layer, "head": head}, "tp_host_s": tp_host,
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_PROFILE), help=f"profile path (default {DEFAULT_PROFILE})")
    p.add_argument("--worlds", default="2,4,8", help="process counts for the collectives")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a few seconds)")
    args = p.parse_args(argv)
    try:
        worlds = tuple(int(w) for w in args.worlds.split(","))
    except ValueError as exc:
        raise NdtrainError(f"--worlds must be a comma list of integers, got {args.worlds!r}") from exc
    if any(w < 2 for w in worlds):
        raise NdtrainError("--worlds: each world needs at least 2 processes")
    if args.quick:
        prof = calibrate(worlds, sizes=(1 << 12, 1 << 18), reps=3, matmul_sizes=(128, 256), min_time=0.05,
                         attention_seqs=(256,), overhead_reps=3, tp_degrees=(2,))
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
    for dtype, rates in prof["attention"].items():
        print(f"  attention {dtype:<5}       " + ", ".join(f"seq {s} {r / 1e9:.1f}" for s, r in rates.items()) + " GFLOP/s")
    host = prof["host_s"]
    print(f"  host per micro-batch  {host['layer'] * 1e3:8.2f} ms per layer + {host['head'] * 1e3:.2f} ms (one process)")
    for world, by_tp in prof["tp_host_s"].items():
        print(f"  TP(+SP), world {world:<3}  " + ", ".join(
            f"tp={t}: {v['layer'] * 1e3:.2f} ms per layer + {v['head'] * 1e3:.2f} ms" for t, v in by_tp.items()))
    for kind, fit in prof["collectives"].items():
        print(f"  {kind:<14} alpha {fit['alpha'] * 1e6:8.1f} us   beta {fit['beta'] / 1e9:6.2f} GB/s   " + "   ".join(
            f"w{w}: {f['alpha'] * 1e6:.0f} us {f['beta'] / 1e9:.2f} GB/s" for w, f in fit["by_world"].items()))
    return 0
