"""The host probe: one short measurement of this CPU's kernels, run once per host and cached
(planner/host_cache.py says where and under which key; `ndtrain calibrate` refreshes it).

It times, single-threaded as each CPU rank runs, what the model runs: a Linear's forward and
backward in fp32 through the BLAS and through oneDNN (model/linear.py's two kernels) and in bf16,
one small fp8 `torch._scaled_mm` beside bf16 at the same shape (small, and capped in time: where
fp8 is emulated one call of 256^3 took 1.1 s), and the model's causal attention forward and
backward in fp32 and in bf16 (attending in bf16, and in fp32 as bf16 runs did). A second or two
in all on a quiet host. Its figures are the planner's uncalibrated CPU model and the runtime's
MFU peak (one measurement of the same thing), and its decisions (host_cache.decide) the CPU
defaults `[parallel] cpu_matmul_auto` and `mixed_precision_auto` resolve.

The Linear rates (the peak) are the best of PEAK_RUNS short runs spread over the probe: a busy
moment of a shared host lowers some runs, not all, and a peak measured low would put a run's MFU
above 100%.
"""

from __future__ import annotations

import time

import torch

from ndtrain.compat.torch import find
from ndtrain.launch_env import local_world_size
from ndtrain.planner import host_cache
from ndtrain.planner.hardware import host_probe, probe_dir

# A linear of a small model's training shape (tokens x in -> out): the rate the planner multiplies
# by (its mm_eff stays 1 uncalibrated), not a large square matmul's, which small models never reach.
LINEAR = (1024, 512, 512)
SMALL_N = 128  # fp8 vs bf16: 4 MFLOP, ~0.14 s per call where fp8 is emulated at 0.03 GFLOP/s
# Causal attention: batch 4, seq 256 and heads x head_dim 256, at two head dims: which dtype is faster
# depends on it (here bf16 lost at 16 and 32 and won at 64 and more), so the choice is per model.
ATTENTION_SEQ, ATTENTION_HEAD_DIMS = 256, host_cache.ATTENTION_HEAD_DIMS
MIN_TIME = 0.05  # seconds per measurement (at least 3 calls); the best call is kept
FP8_CAP = 0.5  # seconds: an emulated fp8 stops after its first timed call
# The Linear rates' runs (the MFU peak's and the planner's), one before the other measurements,
# one between and one after: on a host busy with other work (a probe measured 38 GFLOP/s there)
# each kernel keeps its best run. ~0.3 s a run for the two fp32 kernels.
PEAK_RUNS = 3


def _best(fn, min_time: float = MIN_TIME, cap: float = 0.3) -> float:
    """CPU seconds of fn's fastest call after one warm-up. CPU time of this thread (one thread:
    torch runs the kernels on it), not wall time: on a host shared with other work the wall time
    of a call stretches by however long the thread waited for a core (2x and more on the 2-core
    host of docs/results/benchmarks.md with other tenants), its CPU time far less. `cap`: stop once this
    much time was spent, after one timed call: a kernel that slow (bf16 with oneDNN capped at
    AVX2 ran a linear at 2.7 GFLOP/s against fp32's 67) needs no precise figure."""
    fn()
    best, begin, calls = float("inf"), time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - begin < min_time:
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
        calls += 1
        if time.perf_counter() - begin > cap:
            break
    return best


def _alternating(fns, rounds: int = 6) -> list[float]:
    """CPU seconds of each fn's fastest call, the fns called in turn (after one warm-up round):
    where a choice rests on their ratio, a shared host's load then falls on each alike."""
    best = [float("inf")] * len(fns)
    for i in range(rounds + 1):
        for j, fn in enumerate(fns):
            start = time.thread_time()
            fn()
            if i:
                best[j] = min(best[j], time.thread_time() - start)
    return best


def _linear_step(dtype: torch.dtype, kernel: str):
    from ndtrain.model.linear import Linear

    n, k, m = LINEAR
    layer = Linear(k, m, bias=False).to(dtype)
    layer.cpu_kernel = kernel
    x = torch.randn(n, k, dtype=dtype, requires_grad=True)
    return lambda: layer(x).sum().backward()


def _linear_rates() -> tuple[float, float]:
    """fp32 FLOP/s of a Linear's forward, input and weight gradients through the BLAS and oneDNN."""
    n, k, m = LINEAR
    blas, onednn = _alternating([_linear_step(torch.float32, "blas"), _linear_step(torch.float32, "onednn")])
    return 6 * n * k * m / blas, 6 * n * k * m / onednn


def _bf16_linear_rate() -> float:
    """bf16 FLOP/s of the same Linear (bf16 always runs oneDNN: no kernel choice)."""
    n, k, m = LINEAR
    return 6 * n * k * m / _best(_linear_step(torch.bfloat16, "blas"))


def _peak_run(with_bf16: bool) -> dict:
    """One run of the Linear rates: fp32 through both kernels, and bf16 where asked."""
    rates = dict(zip(("fp32_blas", "fp32_onednn"), _linear_rates()))
    if with_bf16:
        rates["bf16"] = _bf16_linear_rate()
    return rates


def best_rates(runs: list[dict]) -> dict:
    """Each rate's best (highest) over the runs that measured it: a rate is a floor of what the
    kernel can do, so the slowest runs are the ones the host's other work slowed."""
    return {key: max(run[key] for run in runs if key in run) for run in runs for key in run}


def _small_rates() -> tuple[float, float]:
    n = SMALL_N
    a, b = torch.randn(n, n).to(torch.bfloat16), torch.randn(n, n).to(torch.bfloat16)
    bf16 = 2 * n**3 / _best(lambda: a @ b)
    scaled_mm = find("scaled_mm")  # private torch: compat.torch
    if scaled_mm is None:
        return bf16, 0.0
    fp8 = torch.float8_e4m3fn
    a8, b8 = torch.randn(n, n).to(fp8), torch.randn(n, n).to(fp8).t().contiguous().t()  # column-major b
    one = torch.ones(())
    try:
        t = _best(lambda: scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), cap=FP8_CAP)
    except (RuntimeError, NotImplementedError):  # no CPU fp8 kernel in this build
        return bf16, 0.0
    return bf16, 2 * n**3 / t


def _attention_rates(d: int) -> tuple[float, float, float]:
    """FLOP/s of causal attention forward + backward through the model's `causal_sdpa`: fp32,
    bf16 attending in bf16, bf16 attending in fp32 (alternating: the choice rests on their ratio)."""
    from ndtrain.model import llama

    b, h, s = 4, max(1, 256 // d), ATTENTION_SEQ

    def call(dtype, attend_in):
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))

        def step():
            llama.causal_sdpa(q, k, v, bf16_attends_in=attend_in).sum().backward()
        return step

    times = _alternating([call(torch.float32, "fp32"), call(torch.bfloat16, "bf16"), call(torch.bfloat16, "fp32")],
                         rounds=4)
    flops = 3 * 4 * b * s * s * h * d * 0.5  # as the time model counts it: fwd + bwd, causal half
    return tuple(flops / t for t in times)


def _block_speedup(kernel: str, attend_in: str, rounds: int = 6) -> float:
    """fp32 over bf16 seconds of one decoder block of `tiny`'s shape (make train's model),
    forward + backward on 4 x 256 tokens: what a bf16 layer gains as a whole, norms, RoPE, casts
    and attention included, which the matmul rates alone overstate (~1.6x here against 2.2x at
    the matmul). The precision default rests on it, so the two alternate (measured one after the
    other, the ratio ranged 1.3-2.0 over three probes here; alternating, 1.57-1.65)."""
    from ndtrain.model import llama
    from ndtrain.model.config import preset
    from ndtrain.model.linear import set_cpu_kernel

    cfg = preset("tiny")
    positions = torch.arange(256)
    calls = []
    for dtype in (torch.float32, torch.bfloat16):
        block = llama.Block(cfg, 0).to(dtype)
        set_cpu_kernel(block, kernel)
        llama.set_cpu_bf16_attention(block, attend_in)  # fp32 inputs never read it
        x = torch.randn(4, 256, cfg.dim, dtype=dtype, requires_grad=True)
        calls.append(lambda b=block, x=x: b(x, positions).sum().backward())
    fp32, bf16 = _alternating(calls, rounds)
    return fp32 / bf16


def measure() -> dict:
    """This host's probe: {"key", "rates" (FLOP/s), "decisions", ...}; a few seconds."""
    key = host_cache.host_key()
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(host_cache.PROBE_THREADS)
    # Without bf16 dot products a bf16 Linear takes ~1 s a call (1.6 GFLOP/s on an AVX2 host): it is
    # measured once there, and so is the bf16 block (no bf16 default rests on it on such a CPU).
    native_bf16 = any(f in key["flags"] for f in host_cache.NATIVE_BF16_FLAGS)
    try:
        runs = [_peak_run(with_bf16=True)]
        rates = {}
        rates["bf16_small"], rates["fp8_small"] = _small_rates()
        for d in ATTENTION_HEAD_DIMS:
            for kind, rate in zip(("fp32", "bf16_native", "bf16_in_fp32"), _attention_rates(d)):
                rates[f"attn_{kind}_d{d}"] = rate
            if len(runs) < PEAK_RUNS - 1:  # the middle runs between the other measurements
                runs.append(_peak_run(with_bf16=native_bf16))
        while len(runs) < PEAK_RUNS:  # the last after them
            runs.append(_peak_run(with_bf16=native_bf16))
        rates.update(best_rates(runs))
    finally:
        torch.set_num_threads(threads)
        decisions = host_cache.decide({**rates, "fp32": 0.0}, key["flags"])
        rates["fp32"] = rates["fp32_onednn" if decisions["cpu_matmul"] == "onednn" else "fp32_blas"]
        from ndtrain.model.config import preset

        head_dim = preset("tiny").head_dim
        rates["block_bf16_speedup"] = _block_speedup(decisions["cpu_matmul"],
                                                     host_cache.bf16_attention(decisions, head_dim),
                                                     rounds=6 if native_bf16 else 1)
    decisions = host_cache.decide(rates, key["flags"])
    return {"key": key, "rates": rates, "decisions": decisions, "small_n": SMALL_N, "attention_seq": ATTENTION_SEQ,
            "linear": list(LINEAR), "peak_runs": len(runs), "seconds": time.perf_counter() - start,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def ensure(refresh: bool = False) -> dict:
    """This host's probe from the cache, measured (and cached) where it never ran or `refresh`."""
    cached = None if refresh else host_probe()
    if cached is not None:
        return cached
    probe = measure()
    host_cache.write(probe, probe_dir())
    return probe


def cpu_peak(dtype: torch.dtype) -> float | None:
    """One CPU rank's matmul peak in `dtype` from the cached probe (its single-threaded rate times
    the threads this rank has, no more than its share of the cores when ranks outnumber them);
    None where the probe never ran on this host (the caller measures then)."""
    probe = host_probe()
    if probe is None:
        return None
    rate = probe["rates"]["bf16" if dtype in (torch.bfloat16, torch.float8_e4m3fn) else "fp32"]
    if dtype == torch.float8_e4m3fn:  # fp8 over bf16 at the probe's small shape
        rate *= probe["decisions"]["fp8_ratio"]
    local = local_world_size()
    return rate * min(torch.get_num_threads(), max(probe["key"]["cores"] / local, 1e-9))
