"""Step metrics: JSONL + experiment trackers + a progress bar, and the peak FLOP/s that MFU divides by."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from ndtrain.train.trackers import open_trackers, scalars

# Dense bf16 peak FLOP/s per device, by substring of the CUDA device name.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12,
                 "L40S": 362e12, "A10G": 125e12, "4090": 165e12}
# Dense fp8 peak FLOP/s (fp8 tensor cores, fp32 accumulation); devices without fp8 are absent.
GPU_PEAK_FP8 = {"H200": 1979e12, "H100": 1979e12, "H800": 1979e12, "B200": 4500e12, "L40S": 733e12}
FP8 = torch.float8_e4m3fn  # the dtype that asks peak_flops for the fp8 peak


def gpu_peak_flops(device: torch.device, table: dict = GPU_PEAK_BF16) -> float | None:
    name = torch.cuda.get_device_name(device)
    for key, peak in table.items():
        if key in name:
            return peak
    return None


def probe_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 512, reps: int = 8) -> float:
    """Best-of-`reps` matmul throughput of this process with its current thread count. Ranks
    probe concurrently, so on a shared host each sees its real share of the cores."""
    if dtype == FP8:  # fp8 GEMMs run through _scaled_mm (what torchao's Float8Linear calls)
        a = torch.randn(n, n).to(FP8)
        b = torch.randn(n, n).to(FP8).t().contiguous().t()  # column-major, as _scaled_mm wants
        one = torch.ones(())

        def mm():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)

        def mm():
            return a @ b
    mm()  # warm-up: first call pays for allocation and kernel selection
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mm()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device for matmuls in `dtype`, where it came from); `FP8` asks for the
    fp8 peak. A GPU missing from the catalog, and a CPU, are measured."""
    if device.type == "cuda":
        peak = gpu_peak_flops(device, GPU_PEAK_FP8 if dtype == FP8 else GPU_PEAK_BF16)
        if peak is not None:
            return peak, "catalog"
        if dtype == FP8:
            return probe_cuda_fp8(device), "measured"
    return probe_matmul_flops(dtype), "measured"


def probe_cuda_fp8(device: torch.device, n: int = 4096, reps: int = 5) -> float:
    a = torch.randn(n, n, device=device).to(FP8)
    b = torch.randn(n, n, device=device).to(FP8).t().contiguous().t()
    one = torch.ones((), device=device)
    torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class MetricsLogger:
    """Rank 0 writes metrics.jsonl (every row, stamped with wall time) and feeds the configured
    trackers their scalars; other ranks hold a logger that does nothing."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, progress: str, logging_cfg=None,
                 config: dict | None = None):
        self.enabled = enabled
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.progress = progress
        self.logging_cfg = logging_cfg
        self.config = config or {}
        self.bar = None
        self.trackers: list | None = None  # opened by start(), or by the first row
        self.file = None
        self.last_print = 0.0
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def start(self, step: int) -> None:
        """Open the trackers and the progress bar once the run knows the step it resumes from."""
        if not self.enabled or self.trackers is not None:
            return
        self.trackers = []
        if self.logging_cfg is not None:
            self.trackers = open_trackers(self.run_dir, self.logging_cfg, self.config, step)
        show = self.progress == "on" or (self.progress == "auto" and sys.stderr.isatty())
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total_steps, initial=step, dynamic_ncols=True, desc="train")

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {**row, "time": row.get("time", time.time())}
        self.file.write(json.dumps(row) + "\n")
        if self.trackers is None:
            self.start(max(0, row["step"] - 1))
        values = scalars(row) if self.trackers else None
        for tracker in self.trackers if values else ():
            tracker.log(row["step"], values)
        if "loss" in row:
            self._show(row)
        elif "val_loss" in row:
            self.info(f"step {row['step']}: validation loss {row['val_loss']:.4f}")

    def _show(self, row: dict) -> None:
        mfu = f"MFU {100 * row['mfu']:.1f}%"
        if "mfu_fp8" in row:  # fp8 runs: against both peaks, named
            mfu = f"MFU {100 * row['mfu']:.1f}% of bf16 peak, {100 * row['mfu_fp8']:.1f}% of fp8 peak"
        text = f"loss {row['loss']:.3f} | {row['tokens_per_s']:,.0f} tok/s | {mfu}"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(row["step"] - self.bar.n)
        elif time.monotonic() - self.last_print > 10 or row.get("last"):
            self.last_print = time.monotonic()
            print(f"step {row['step']} | {text} | lr {row['lr']:.2e} | grad-norm {row['grad_norm']:.3f}", flush=True)

    def info(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for tracker in self.trackers or []:
            tracker.close()
        if self.file is not None:
            self.file.close()

