"""Metrics that must hold on a GPU cluster, checked on CPU with fakes where only CUDA shows them:
one peak table (the planner's catalog, with the H100/H200 PCIe and NVL variants), unknown GPUs
measured on the GPU, no MFU above 100%, a peak memory per step, stragglers named by their compute
time (CUDA events) rather than by wall time, and `ndtrain calibrate` measuring NCCL's memory
before the parent process holds any CUDA memory."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from ndtrain.calibrate import peak_flops
from ndtrain.config import load_config
from ndtrain.layout.flops import mfu
from ndtrain.planner.accelerator import GiB
from ndtrain.planner.hardware import CATALOG, catalog_name
from ndtrain.train import busy_time, metrics, recovery

pytestmark = pytest.mark.timeout(120)
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


def _fake_gpu(monkeypatch, name: str, memory_gib: float = 80.0) -> None:
    props = types.SimpleNamespace(name=name, total_memory=int(memory_gib * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)


# ---- one peak table, the planner's --------------------------------------------------------
@pytest.mark.parametrize("name, memory_gib, entry", [
    ("NVIDIA H100 80GB HBM3", 79.6, "h100"),
    ("NVIDIA H100 PCIe", 79.6, "h100-pcie"),
    ("NVIDIA H100 80GB HBM2e", 79.6, "h100-pcie"),  # HBM2e: only the PCIe card carries it
    ("NVIDIA H100 NVL", 93.6, "h100-nvl"),
    ("NVIDIA H100", 93.6, "h100-nvl"),  # no form factor in the name: 94 GB is the NVL card
    ("NVIDIA H800 PCIe", 79.6, "h100-pcie"),
    ("NVIDIA H200", 140.4, "h200"),
    ("NVIDIA H200 NVL", 140.4, "h200-nvl"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40"),
    ("NVIDIA H20", 95.0, None),  # not an H200: measured, never credited with one's peak
])
def test_device_names_find_their_variant(name, memory_gib, entry):
    assert catalog_name(name, memory_gib * GiB) == entry


def test_h100_variants_carry_their_datasheet_figures():
    pcie, nvl = CATALOG["h100-pcie"], CATALOG["h100-nvl"]
    assert (pcie.peak_bf16, pcie.hbm_bw, pcie.tdp_w) == (756e12, 2.0e12, 350)
    assert (nvl.peak_bf16, nvl.hbm_bw, nvl.tdp_w) == (835e12, 3.9e12, 400)
    assert 79 * GiB < pcie.hbm_bytes < 80 * GiB and 87 * GiB < nvl.hbm_bytes < 94 * GiB
    assert (pcie.peak_fp8, nvl.peak_fp8) == (1513e12, 1671e12)  # dense fp8, half the sparse figure
    assert CATALOG["h200-nvl"].peak_bf16 == 835e12 and CATALOG["h200-nvl"].hbm_bytes == CATALOG["h200"].hbm_bytes
    assert CATALOG["h100"].peak_bf16 == 989e12


def test_mfu_peaks_come_from_the_planners_catalog(monkeypatch):
    assert not any(hasattr(peak_flops, n) for n in ("GPU_PEAK_BF16", "GPU_PEAK_FP8", "gpu_peak_flops"))
    _fake_gpu(monkeypatch, "NVIDIA H100 PCIe")
    assert peak_flops.peak_flops(CUDA, torch.bfloat16) == (756e12, "catalog h100-pcie")
    assert peak_flops.peak_flops(CUDA, peak_flops.FP8) == (1513e12, "catalog h100-pcie")
    _fake_gpu(monkeypatch, "NVIDIA H100 NVL", 93.6)
    assert peak_flops.peak_flops(CUDA, torch.bfloat16)[0] == 835e12


def test_a_gpu_missing_from_the_catalog_is_measured_on_that_gpu(monkeypatch):
    _fake_gpu(monkeypatch, "Tesla T4", 15)
    seen = []
    monkeypatch.setattr(peak_flops, "probe_matmul_flops",
                        lambda dtype, device=None, **kw: seen.append((dtype, device)) or 1e12)
    assert peak_flops.peak_flops(CUDA, torch.bfloat16) == (1e12, "measured")
    assert peak_flops.peak_flops(CUDA, peak_flops.FP8) == (1e12, "measured")
    assert [d.type for _, d in seen] == ["cuda", "cuda"]
    assert seen[1][0] == peak_flops.FP8
    # The probe itself takes the device it measures (here the CPU: a small real run).
    assert peak_flops._probe_rate(torch.device("cpu"), torch.bfloat16, n=64, reps=2) > 0


# ---- MFU never above 100% -----------------------------------------------------------------
def test_the_fp8_peak_is_never_below_the_bf16_one(monkeypatch):
    """On CPU torch._scaled_mm is emulated (~7x below bf16 here, ~50,000x on an AMX host), so a
    run whose bf16 work outpaces it printed '185.8% of fp8 peak'."""
    rates = {torch.bfloat16: 200e9, peak_flops.FP8: 30e9}
    monkeypatch.setattr(peak_flops, "probe_matmul_flops", lambda dtype, device=None, **kw: rates[dtype])
    peak, source, fp8, fp8_source = metrics.run_peaks(torch.device("cpu"), torch.bfloat16, fp8=True)
    assert (peak, fp8) == (200e9, 200e9) and "bf16" in fp8_source and source == "measured"
    rates[peak_flops.FP8] = 400e9  # fp8 tensor cores: the fp8 rate stands
    assert metrics.run_peaks(torch.device("cpu"), torch.bfloat16, fp8=True)[2] == 400e9
    assert metrics.run_peaks(torch.device("cpu"), torch.bfloat16, fp8=False)[2] == 0.0


def test_an_mfu_above_100_percent_is_not_printed(capsys):
    assert mfu(0.5e12, 1e12) == 0.5 and mfu(1.0e12, 1e12) == 1.0
    assert mfu(1.858e12, 1e12) is None  # above the peak: the peak is wrong
    log = metrics.MetricsLogger(None, False, 1, "off")
    log.enabled = True  # the progress line, without files
    row = {"step": 1, "loss": 2.0, "tokens_per_s": 10.0, "lr": 1e-3, "grad_norm": 1.0, "last": True}
    log._show({**row, "mfu": 0.3, "mfu_fp8": None})
    line = capsys.readouterr().out
    assert "30.0% of bf16 peak" in line and "fp8 peak is wrong" in line and "%" not in line.split("bf16 peak")[1]
    log._show({**row, "mfu": None})
    assert "MFU n/a" in capsys.readouterr().out


# ---- the trainer: peak memory per step, MFU rule --------------------------------------------
def test_each_step_reports_its_own_peak_memory_and_no_mfu_above_100(parity_base, monkeypatch):
    """The trainer resets the peak when a step starts and reads it after: a fake allocator (the
    CUDA path; the CPU has no resettable peak) whose first step alone peaks 256 MiB higher."""
    from ndtrain.train import step as step_module
    from ndtrain.train.trainer import Trainer

    allocator = {"peak": 0.0}
    monkeypatch.setattr(step_module, "reset_peak_memory", lambda device: allocator.update(peak=100.0))
    monkeypatch.setattr(metrics, "peak_memory_mb", lambda device: allocator["peak"])  # read by metrics_row
    trainer = Trainer(load_config(None, {**parity_base, "train": {**parity_base["train"], "steps": 2}}),
                      run_dir=None, log=False)
    plain = step_module.forward_backward

    def heavy(*args):
        allocator["peak"] += 256.0
        return plain(*args)

    try:
        monkeypatch.setattr(step_module, "forward_backward", heavy)
        first = trainer.metrics_row(trainer.train_step())
        monkeypatch.setattr(step_module, "forward_backward", plain)
        trainer.peaks.total = 1.0  # a peak far below what the run does
        second = trainer.metrics_row(trainer.train_step())
    finally:
        trainer.close()
    assert (first["peak_memory_mb"], second["peak_memory_mb"]) == (356.0, 100.0)
    # a step above the measured peak raises it to the step's rate (metrics.raise_peak): 100%, said once
    assert 0 < first["mfu"] <= 1 and second["mfu"] == pytest.approx(1.0) and "peak_raised" in second


def test_peak_memory_resets_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: calls.append(("read", d)) or 3 * 2**20)
    metrics.reset_peak_memory(CUDA)
    assert metrics.peak_memory_mb(CUDA) == 3.0
    assert calls == [("reset", CUDA), ("read", CUDA)]


# ---- stragglers: compute time, not wall time ----------------------------------------------
class Clock:
    """A fake GPU timeline: CUDA events read it when recorded."""

    def __init__(self):
        self.t = 0.0

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self, stream=None):
                self.t = clock.t

            def synchronize(self):
                pass

            def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event's
                return 1e3 * (end.t - self.t)
        return Event()


class Block(nn.Module):
    def __init__(self, clock, seconds):
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def forward(self, x):
        self.clock.t += self.seconds  # the block's kernels
        return x


def _step(clock, blocks, wait):
    """One step of one rank: each block's compute, then `wait` seconds blocked in a collective."""
    x = torch.zeros(1)
    for b in blocks:
        x = b(x)
    clock.t += wait


_STARVED = """
import os, subprocess, sys, time
from ndtrain.train.busy_time import CpuBusyTimer
cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})  # inherited: the competitor below takes turns with this thread
rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])
try:
    time.sleep(0.2)
    timer, c0 = CpuBusyTimer(), time.thread_time()
    timer.start()
    x = 0
    for i in range(3_000_000):
        x += i
    print(timer.stop(), time.thread_time() - c0)
    timer.start()
    time.sleep(0.5)
    print(timer.stop(), 0.5)
finally:
    rival.kill()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="Linux schedstat only")
def test_cpu_busy_time_counts_waiting_for_a_cpu_not_blocking(hang_deadline):
    """A rank whose CPU is shared with another process (or throttled by a cgroup quota) does the
    same work in the same CPU time but waits on the run queue for it: busy time counts that wait,
    so a node starved of CPU is named as the straggler. A thread asleep (a collective waiting on
    a slow peer) is not busy."""
    out = subprocess.run([sys.executable, "-c", _STARVED], capture_output=True, text=True,
                         timeout=hang_deadline(60), check=True).stdout.split()
    busy, cpu, slept, asleep = map(float, out)
    assert busy > 1.3 * cpu, (busy, cpu)  # two runnable threads on one CPU: about twice the CPU time
    assert slept < asleep / 2, (slept, asleep)


def test_busy_timer_selection_and_arithmetic():
    assert isinstance(busy_time.busy_timer(torch.device("cpu"), []), busy_time.CpuBusyTimer)
    clock = Clock()
    blocks = [Block(clock, 0.25), Block(clock, 0.5)]
    timer = busy_time.busy_timer(CUDA, blocks, event=clock.event)
    assert isinstance(timer, busy_time.CudaBusyTimer)
    _step(clock, blocks, wait=3.0)  # outside a timed step: not counted
    timer.start()
    _step(clock, blocks, wait=5.0)
    _step(clock, blocks, wait=5.0)  # e.g. two micro-batches, or a recompute
    assert timer.stop() == pytest.approx(1.5)  # 2 x (0.25 + 0.5); the waits are not compute
    timer.start()
    assert timer.stop() == 0.0
    timer.close()
    timer.start()
    _step(clock, blocks, wait=0.0)
    assert timer.stop() == 0.0  # closed: the hooks are gone


def test_cuda_stragglers_are_named_by_compute_not_wall_time(monkeypatch, parity_base):
    """4 ranks, rank 2's blocks 1.6x slower: the collectives make every wall time equal (what the
    monitor compared on CUDA), while the events bracket only each rank's own compute."""
    cfg = load_config(None, {**parity_base, "train": {**parity_base["train"], "straggler_window": 2}})
    busy = []
    for rank, speed in enumerate([1.0, 1.0, 1.6, 1.0]):
        clock = Clock()
        monkeypatch.setattr(torch.cuda, "Event", clock.event)
        blocks = [Block(clock, 0.1 * speed) for _ in range(4)]
        model = nn.Module()
        model.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        model.output = None
        guard = recovery.Recovery(
            cfg, None, rt=types.SimpleNamespace(rank=rank, device=CUDA, world_size=1),
            progress=types.SimpleNamespace(step=0, window_at=lambda c: None),
            loader=types.SimpleNamespace(consumed_samples=0, shares=None), ckpt=None, logger=None,
            compute=metrics.compute_modules([model]), layout="one process")
        try:
            guard.before_step()
            _step(clock, blocks, wait=0.64 - 0.4 * speed)  # every rank's step ends together
            assert guard.after_step(types.SimpleNamespace(step=1, skipped=False, loss=1.0, grad_norm=1.0)) == "ok"
        finally:
            guard.close()
        sample = guard.stragglers.samples[-1]  # a window of 2: the step is still in it,
        busy.append(sample())  # its events read when the window ends (here, now)
    assert busy == pytest.approx([0.4, 0.4, 0.64, 0.4])
    monitor = recovery.StragglerMonitor(threshold=0.25, window=1, persist=1)
    assert monitor.judge(busy) == [(2, pytest.approx(1.6))]


# ---- ndtrain calibrate on several GPUs -----------------------------------------------------
def test_calibrate_measures_nccl_memory_before_the_parent_holds_cuda_memory(monkeypatch):
    """The children's `overhead_gib` is total - free - their own reserved bytes on GPU 0, so
    whatever the parent process holds there (its context, cached blocks of the GEMM and HBM
    measurements) was counted as NCCL's. The parent must spawn them before it allocates, with
    its cache empty."""
    from ndtrain.calibrate import gpu as cal

    order = []
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=int(79.6 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    monkeypatch.setattr(cal, "_init_context", lambda: order.append("parent allocates"))
    for name in ("measure_gemm", "measure_attention", "measure_hbm"):
        monkeypatch.setattr(cal, name, lambda *a, **k: order.append("parent allocates") or {})
    monkeypatch.setattr(cal, "measure_collectives", lambda *a, **k: order.append("spawn") or
                        {"samples": [], "overhead_bytes": 3 * GiB})
    monkeypatch.setattr(cal, "measure_memory", lambda *a, **k: order.append("parent allocates") or
                        {"overhead_bytes": 1 * GiB})
    hw, measured = cal.calibrate_gpu(quick=True)
    assert order.index("spawn") < order.index("parent allocates"), order
    assert "empty_cache" in order[:order.index("spawn")], order
    assert measured["memory"]["overhead_bytes"] == 3 * GiB and hw.name == "h100"
