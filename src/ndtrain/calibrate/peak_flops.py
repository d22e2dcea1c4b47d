"""The peak FLOP/s a run's MFU divides by: a CUDA device's datasheet peak from the planner's
catalog, else a matmul measured on the device itself (a CPU's from the cached host probe first)."""

from __future__ import annotations

import time

import torch

from ndtrain.compat.torch import require
from ndtrain.planner.hardware import CATALOG, catalog_name

FP8 = torch.float8_e4m3fn  # the dtype that asks peak_flops for the fp8 peak


def _probe_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """Best-of-`reps` FLOP/s of an n x n x n matmul in `dtype` on `device` (fp8 through
    torch._scaled_mm, what torchao's Float8Linear calls). One path for CPU and CUDA: on CUDA each
    timing waits for the kernel (synchronize), on CPU that wait is a no-op."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if dtype == FP8:
        a = torch.randn(n, n, device=device).to(FP8)
        b = torch.randn(n, n, device=device).to(FP8).t().contiguous().t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        scaled_mm = require("scaled_mm")  # private torch: compat.torch; looked up outside the timing

        def mm():
            return scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)

        def mm():
            return a @ b
    mm()  # warm-up: first call pays for allocation and kernel selection
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mm()
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def probe_matmul_flops(dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> float:
    """Matmul throughput of this process on `device` (default the CPU). A CPU probe runs with the
    process's thread count: ranks probe concurrently, so on a shared host each sees its share of
    the cores. A GPU probe needs a shape that fills the chip (8192: ~1.4 ms at 790 TFLOP/s).
    On CPU the cached host probe's figures come first (calibrate/host_probe.py): the same the planner's
    uncalibrated model uses, so MFU and the plan divide by one measurement; measured here only
    where the probe never ran on this host."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        return _probe_rate(device, dtype, n=8192, reps=5)
    from ndtrain.calibrate.host_probe import cpu_peak

    peak = cpu_peak(dtype)
    if peak is not None:
        return peak
    if dtype == FP8:  # emulated on some CPUs (0.03 GFLOP/s on an AMX host: ~9 s per 512^3 call)
        return _probe_rate(device, dtype, n=128, reps=3)
    return _probe_rate(device, dtype, n=512, reps=8)


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device for matmuls in `dtype`, where it came from); `FP8` asks for the
    fp8 peak. A CUDA device is looked up in the planner's catalog (the one table of datasheet
    peaks, matched by name and memory to its variant); one missing there, and a CPU, are measured
    on the device itself. On CUDA a non-fp8 run is measured against the bf16 peak, as MFU
    conventionally is (an fp32 run on tensor cores runs TF32 or slower). A CPU's is the host
    probe's (probe_matmul_flops)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = catalog_name(props.name, props.total_memory)
        peak = 0.0 if name is None else (CATALOG[name].peak_fp8 if dtype == FP8 else CATALOG[name].peak_bf16)
        if peak:
            return peak, f"catalog {name}"
        return probe_matmul_flops(FP8 if dtype == FP8 else torch.bfloat16, device), "measured"
    return probe_matmul_flops(dtype, device), "measured"
