"""Step metrics: what a step's row reports (metrics_row: its figures, the MFU against the peaks
measured in calibrate/peak_flops.py, the peak memory) and where rows go: metrics.jsonl, the
experiment trackers and a progress bar."""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ndtrain.calibrate.peak_flops import FP8, peak_flops
from ndtrain.layout.flops import flops_per_token, mfu
from ndtrain.parallel.grad_norm import all_reduce_sum
from ndtrain.train.run_length import TimeLeft, duration
from ndtrain.train.trackers import open_trackers, scalars

if TYPE_CHECKING:
    from ndtrain.train.state import TrainState
    from ndtrain.train.step import StepResult


def run_peaks(device: torch.device, dtype: torch.dtype, fp8: bool) -> tuple[float, str, float, str]:
    """(peak, source, fp8 peak, its source) that a run's MFU divides by; the fp8 peak is 0 without
    fp8. The fp8 peak is never below the bf16 one: an fp8 run's matmuls reach at least the bf16
    rate (where fp8 is slower, e.g. the emulated CPU _scaled_mm, the bf16 work outpaces it), so a
    lower "peak" would report MFU above 100%."""
    peak, source = peak_flops(device, dtype)
    if not fp8:
        return peak, source, 0.0, ""
    fp8_peak, fp8_source = peak_flops(device, FP8)
    if fp8_peak < peak:
        return peak, source, peak, f"the bf16 peak: fp8 measured {fp8_peak / 1e9:.3g} GFLOP/s, below it"
    return peak, source, fp8_peak, fp8_source


def raise_peak(peaks, flops_per_s: float) -> str | None:
    """Where a step's model FLOP/s ran above a measured peak (`peaks`: Peaks, summed
    over ranks), raise the peak to it: a measured peak is a floor of what the device does (a probe
    on a host busy with other work measures low), so MFU then divides by the fastest step seen
    instead of showing none. The line that says so the first time; None otherwise (later raises
    are quiet). A datasheet peak (catalog) is never raised: a step above it means a misidentified
    device or a wrong FLOP count, which MFU n/a keeps in view."""
    if flops_per_s <= peaks.total or peaks.source.startswith("catalog"):
        return None
    was, peaks.total = peaks.total, flops_per_s
    if peaks.fp8:  # the fp8 peak is never below the bf16 one (run_peaks)
        peaks.fp8_total = max(peaks.fp8_total, flops_per_s)
    if peaks.raised:
        return None
    peaks.raised = True
    return (f"MFU peak raised to {flops_per_s / 1e9:.1f} GFLOP/s, the rate a step ran at, from the "
            f"{was / 1e9:.1f} GFLOP/s measured (a busy host measures low); MFU now divides by the fastest step "
            f"seen (`ndtrain calibrate` probes the host again)")


@dataclass
class Peaks:
    """The run's peak FLOP/s (summed over ranks) that MFU divides by, and the model's FLOPs per
    token. fp8 runs report MFU against the bf16 peak (comparable with bf16 runs) and the fp8 peak."""

    total: float
    source: str
    fp8_total: float
    fp8_source: str
    flops_per_token: float
    fp8: bool
    raised: bool = False  # a step ran above the measured peak, which was raised to it (metrics.raise_peak)


def measure_peaks(state: TrainState) -> Peaks:
    low = state.autocast or state.layout.mixed_precision in ("bf16", "fp8")
    per_rank, source, fp8_peak, fp8_source = run_peaks(state.rt.device, torch.bfloat16 if low else torch.float32,
                                                       state.fp8)
    total, fp8_total = all_reduce_sum([per_rank, fp8_peak], state.rt.device)
    return Peaks(total, source, fp8_total, fp8_source, flops_per_token(state.cfg.model, state.cfg.data.seq_len),
                 state.fp8)


def metrics_row(r: StepResult, peaks: Peaks, tokens_seen: int, device) -> dict:
    """The step's row; a step above a measured peak raises it first (metrics.raise_peak), and the
    row that did so first carries the line saying so ("peak_raised")."""
    tps = r.tokens / r.seconds
    raised = raise_peak(peaks, peaks.flops_per_token * tps)
    return {"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens_per_s": tps,
            "mfu": mfu(peaks.flops_per_token * tps, peaks.total), "step_time_s": r.seconds,
            "tokens_seen": tokens_seen, "peak_memory_mb": peak_memory_mb(device), "skipped": r.skipped, **r.extra,
            **({"mfu_fp8": mfu(peaks.flops_per_token * tps, peaks.fp8_total)} if peaks.fp8 else {}),
            **({"peak_raised": raised} if raised else {})}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak on CUDA, so each step reports its own. On CPU nothing is reset: the only
    peak is the kernel's high-water mark of the process's resident memory (ru_maxrss). Linux can
    reset it (/proc/self/clear_refs), but /usr/bin/time and the benchmarks' RUSAGE_CHILDREN read
    that same counter, so the CPU figure stays the process's peak so far."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """The CUDA allocator's peak since reset_peak_memory; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def compute_modules(model_parts) -> list:
    """What a CUDA busy timer (train/busy_time.py) brackets: every decoder block and the head of this rank's parts."""
    found = []
    for part in model_parts:
        found += list(getattr(part, "layers", {}).values())
        if getattr(part, "output", None) is not None:
            found.append(part.output)
    return found


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
        self.time_left = TimeLeft(total_steps)
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        from ndtrain.train.run_files import open_run_log

        self.file = open_run_log(run_dir / "metrics.jsonl")  # O_NOFOLLOW: never through a link

    def start(self, step: int) -> None:
        """Open the trackers and the progress bar once the run knows the step it resumes from."""
        if not self.enabled or self.trackers is not None:
            return
        self.trackers = []
        if self.logging_cfg is not None:
            try:
                self.trackers = open_trackers(self.run_dir, self.logging_cfg, self.config, step)
            except OSError as exc:  # a full disk as a tracker creates its files
                raise self._failed(exc, Path(exc.filename) if exc.filename else self.run_dir, 0, step) from None
        show = self.progress == "on" or (self.progress == "auto" and sys.stderr.isatty())
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total_steps, initial=step, dynamic_ncols=True, desc="train")

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {**row, "time": row.get("time", time.time())}
        line = json.dumps(row) + "\n"
        try:
            self.file.write(line)
        except OSError as exc:
            raise self._failed(exc, self.run_dir / "metrics.jsonl", len(line.encode()), row["step"]) from None
        if self.trackers is None:
            self.start(max(0, row["step"] - 1))
        values = scalars(row) if self.trackers else None
        for tracker in self.trackers if values else ():
            try:
                tracker.log(row["step"], values)
            except OSError as exc:
                raise self._failed(exc, getattr(tracker, "path", self.run_dir), getattr(tracker, "pending", 0),
                                   row["step"]) from None
        if "peak_raised" in row:
            self.info(row["peak_raised"])
        if "loss" in row:
            self._show(row)
        elif "val_loss" in row:
            self.info(f"step {row['step']}: validation loss {row['val_loss']:.4f}")

    def _failed(self, exc: OSError, path: Path, needed: int, step: int):
        """One line for a metrics write that failed (a full disk, as checkpoints say it: the path,
        the bytes, what is free). What is still buffered is dropped, so closing the file at exit
        cannot fail again and print a second message."""
        import errno
        import shutil

        from ndtrain.errors import RunError

        self._drop_buffers()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = f"{shutil.disk_usage(path if path.is_dir() else path.parent).free / 1e6:,.1f} MB are free"
            except OSError:
                free = "the free space is unknown"
            need = f"need {needed:,} bytes" if needed else "could not be written"
            what = f"no space left on the device of {path} ({exc.strerror}): the metrics of step {step} {need}, {free}"
        else:
            what = f"cannot write {path}: {exc.strerror or exc}"
        return RunError(f"{what}; the run stopped at step {step} (the rows before it are kept; once there is room, "
                        f"continue with --checkpoint.resume=auto)")

    def _drop_buffers(self) -> None:
        """Discard metrics.jsonl's unwritten bytes: a failed flush keeps them, and the interpreter's
        last flush of the file would fail on them again ("Exception ignored ..."). The logger
        writes nothing more."""
        import os

        f, self.file, self.enabled = self.file, None, False
        if f is None:
            return
        try:
            fd = f.fileno()
        except (OSError, ValueError):
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)  # the file object now flushes into /dev/null and closes cleanly
        os.close(devnull)
        f.close()

    def _show(self, row: dict) -> None:
        def pct(value, peak: str) -> str:  # None: above 100% (see mfu()), so that peak is wrong
            if value is None:
                return f"n/a ({peak} peak is wrong: the run is above it)"
            return f"{100 * value:.1f}% of {peak} peak"

        mfu_text = "MFU n/a (above 100%: the peak is wrong)" if row["mfu"] is None else f"MFU {100 * row['mfu']:.1f}%"
        if "mfu_fp8" in row:  # fp8 runs: against both peaks, named
            mfu_text = f"MFU {pct(row['mfu'], 'bf16')}, {pct(row['mfu_fp8'], 'fp8')}"
        text = f"loss {row['loss']:.3f} | {row['tokens_per_s']:,.0f} tok/s | {mfu_text}"
        left = self.time_left.after(row["step"], row.get("step_time_s", 0.0))  # every row: the pace needs each
        if self.bar is not None:  # tqdm shows the count and the time left itself
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(row["step"] - self.bar.n)
        elif time.monotonic() - self.last_print > 10 or row.get("last"):
            self.last_print = time.monotonic()
            print(f"step {row['step']}/{self.total_steps} | {text} | lr {row['lr']:.2e} | grad-norm "
                  f"{row['grad_norm']:.3f} | {duration(left)} left", flush=True)

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

