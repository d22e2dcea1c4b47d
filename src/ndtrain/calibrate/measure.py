"""The measurements the CPU and the GPU calibration share (calibrate/cpu.py, calibrate/gpu.py),
written once with the device as a parameter: how one call is timed, causal attention's forward and
backward, and the collectives over a group of ranks on this machine. What differs by device is
said where it differs: the clock, the backend, the dtype runs communicate in, the reduce-scatter
a run uses, which ranks pair for point-to-point, and how the ranks are started."""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from ndtrain.calibrate.host_costs import typical
from ndtrain.planner.hardware import COLLECTIVES


def seconds_per_call(fn, device: str, reps: int, warmup: int = 1, min_time: float = 0.0) -> float:
    """One call of `fn`, after `warmup` calls, over at least `reps` calls and `min_time` seconds.
    CUDA: each call between two events on the current stream (the host returns before the kernels
    end), the median. CPU: the wall clock, the lower quartile (`typical`: on a shared machine other
    jobs only ever add time)."""
    import torch

    cuda = device == "cuda"
    for _ in range(warmup):
        fn()
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < reps or time.perf_counter() - begin < min_time:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times) if cuda else typical(times)


def measure_attention(device: str, dtype_name: str, seqs, heads: int, head_dim: int, tokens: int, reps: int,
                      warmup: int = 1, min_time: float = 0.0, bf16_attends_in: str = "fp32") -> list:
    """[batch, heads, seq, head_dim, seconds] per sequence length: causal attention's forward and
    backward through the model's own `causal_sdpa` (bf16 on the CPU attends in the dtype the host
    probe chose), `tokens` per call (batch = tokens // seq, at least 1)."""
    import torch

    from ndtrain.model.llama import causal_sdpa

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    rows = []
    for seq in seqs:
        b = max(1, tokens // seq)
        q, k, v = (torch.randn(b, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(b, heads, seq, head_dim, device=device, dtype=dtype)

        def step():
            causal_sdpa(q, k, v, bf16_attends_in=bf16_attends_in).backward(grad)

        rows.append([b, heads, seq, head_dim, seconds_per_call(step, device, reps, warmup, min_time)])
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world: int, port: int, device: str, sizes: list, reps: int, out: str,
                       then=None) -> None:
    import torch
    import torch.distributed as dist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120 if cuda else 60))
    overhead = None
    if cuda:  # after a first collective NCCL's communicator and buffers exist: the memory they hold
        dist.all_reduce(torch.ones(1 << 20, device="cuda"))
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        overhead = total - free - torch.cuda.memory_reserved()
    if cuda:
        reduce_scatter = dist.reduce_scatter_tensor
    else:  # as the runtime's FSDP issues it on Gloo (Gloo's own is a full all-reduce)
        from ndtrain.parallel.gloo_reduce_scatter import AllToAllReduceScatter

        rs = AllToAllReduceScatter()

        def reduce_scatter(part, full):
            rs(part, full, dist.group.WORLD, dist.ReduceOp.SUM)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    dtype = torch.bfloat16 if cuda else torch.float32  # what a run on the device communicates
    # Point-to-point in pairs (0-1, 2-3, ...): each GPU pair has links of its own; CPU ranks share
    # the cores, so only ranks 0 and 1 talk there.
    peer = rank ^ 1 if (cuda or rank < 2) and (rank ^ 1) < world else None
    samples = []
    for n in sizes:
        elems = max(world, n // dtype.itemsize // world * world)
        full = torch.ones(elems, dtype=dtype, device=device)
        part = torch.ones(elems // world, dtype=dtype, device=device)
        received = torch.empty_like(full)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: all_gather(full, part),
            "reduce_scatter": lambda: reduce_scatter(part, full),
            "all_to_all": lambda: dist.all_to_all_single(received, full),
            "p2p": None if peer is None else (lambda: dist.send(full, peer)) if rank % 2 == 0 else
            (lambda: dist.recv(full, peer)),
        }
        for kind in COLLECTIVES:
            dist.barrier()
            if ops[kind] is not None:
                seconds = seconds_per_call(ops[kind], device, reps, warmup=3 if cuda else 1)
                if rank == 0:
                    samples.append((kind, world, elems * dtype.itemsize, seconds))
    if then is not None:  # more measurements on the same ranks (the CPU's in-situ TP and DP)
        samples += then(rank, world, reps)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"samples": samples, "overhead_bytes": overhead}))


def measure_collectives(device: str, worlds, sizes, reps: int, then=None) -> dict:
    """{"samples": [(kind, world, bytes, seconds), ...] per world, kind and size (and what `then`
    returned), "overhead_bytes": the memory NCCL holds outside the allocator on GPU 0, the most
    over the worlds (None on the CPU)}. `then(rank, world, reps)`: a list of more samples, taken
    on the same ranks after the collectives (rank 0's count). The ranks are forked on the CPU
    and spawned on CUDA (a forked child cannot use CUDA), one thread each."""
    import torch.multiprocessing as mp

    samples, overhead = [], None
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks
    try:
        for world in worlds:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                mp.start_processes(_collective_worker, args=(world, _free_port(), device, list(sizes), reps, out, then),
                                   nprocs=world, start_method="spawn" if device == "cuda" else "fork")
                got = json.loads(Path(out).read_text())
            samples += [tuple(s) for s in got["samples"]]
            if got["overhead_bytes"] is not None:
                overhead = max(overhead or 0, got["overhead_bytes"])
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return {"samples": samples, "overhead_bytes": overhead}
