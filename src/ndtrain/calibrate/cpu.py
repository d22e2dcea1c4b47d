"""`ndtrain calibrate` on CPU ranks: measure this machine for the hardware profile the planner's
"this-machine" entry loads (tools/calibrate_command.py writes it).

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

import os
import time
from functools import partial

from ndtrain.calibrate.host_costs import (SHAPES, dp_host, fit_dp, fit_tp, optimizer_seconds_per_param, plain_host,
                                          tp_host, typical)
from ndtrain.calibrate.measure import measure_attention, measure_collectives
from ndtrain.planner.hardware import COLLECTIVES


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


def _in_situ(rank: int, world: int, reps: int, tp_degrees: tuple = ()) -> list:
    """On the collectives' ranks: ("tp_host", world, tp, {shape: [per layer, per micro-batch]})
    from host_costs.tp_host, and the runtime's data parallelism, ("dp_host", world, mode, ...)."""
    results = []
    for tp in tp_degrees:
        if world % tp == 0 and tp <= world:
            measured = tp_host(world, tp, max(3, 3 * reps // 2))
            if rank == 0:
                results.append(("tp_host", world, tp, measured))
    if tp_degrees:
        for mode in ("zero3", "ddp", "replicate") + (("zero3_tp",) if 2 in tp_degrees and world >= 4 else ()):
            measured = dp_host(world, mode, max(3, 3 * reps // 2))
            if rank == 0:
                results.append(("dp_host", world, mode, measured))
    return results


def attention_rates(dtype_name: str, seqs=(256, 1024), min_time: float = 0.15, bf16_attends_in: str = "fp32") -> dict:
    """Causal attention forward + backward at head dim 64 on one thread, in FLOP/s as the time
    model counts them (3 x 4 b s^2 h d x 1/2: the causal half), keyed by sequence length."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = measure_attention("cpu", dtype_name, seqs, heads=8, head_dim=64, tokens=1024, reps=3,
                                 min_time=min_time, bf16_attends_in=bf16_attends_in)
    finally:
        torch.set_num_threads(old)
    return {str(s): 3 * 4 * b * s * s * h * d * 0.5 / seconds for b, h, s, d, seconds in rows}


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
            one = typical(times)
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
        return 2 * x.numel() * 4 / typical(times)  # read + write
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
    return typical(times)


def fit_mm_eff(prof: dict, precision: str = "fp32") -> float:
    """The fraction of the square-matmul rate that training GEMMs reach: the plain decoder layer
    timed at the calibration's larger shape, less what the time model gives its attention,
    elementwise and host work, leaves the GEMMs' time (the role mm_eff plays for GPUs, where it was
    fitted on published runs). bf16 has its own: its matmuls speed up by the peak's ratio, the
    norms, RoPE, attention and casts the layer keeps in fp32 do not, and the time model's
    elementwise bytes (half of fp32's) miss them; fitted on the bf16 layer, the residual lands
    here as it does for fp32."""
    from ndtrain.calibrate.host_costs import BATCH, _config
    from ndtrain.planner.hardware import from_profile
    from ndtrain.layout import Layout
    from ndtrain.planner.problem import make_problem
    from ndtrain.planner.layer import layer_costs

    dim, seq = SHAPES[-1]
    hw = from_profile({**prof, "mm_eff": 1.0, "mm_eff_bf16": 1.0})
    pb = make_problem(_config(4, dim), seq, BATCH, 1, hw, precision=precision)
    model = layer_costs(pb, Layout(dp_shard=1, micro_batch=BATCH))["compute"]
    gemms = 3 * 2 * BATCH * seq * pb.shape.mm_params_layer / hw.peak(precision)
    measured = prof["host_s"]["measured" if precision == "fp32" else f"measured_{precision}"][f"{dim},{seq}"][0]
    return min(1.5, max(0.25, gemms / max(measured - (model - gemms), 1e-9)))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def calibrate(worlds=(2, 4, 8), sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22), reps: int = 8, matmul_sizes=(256, 512, 1024),
              min_time: float = 0.15, attention_seqs=(256, 1024), overhead_reps: int = 15, tp_degrees=(2, 4)) -> dict:
    start = time.perf_counter()
    from ndtrain.planner.host_cache import bf16_attention
    from ndtrain.calibrate.host_probe import ensure

    probe = ensure(refresh=True)  # the host probe is refreshed with the calibration, and cached with it
    matmul = {f"{d}_{t}thread": measure_matmul(d, t, matmul_sizes, min_time) for d in ("fp32", "bf16") for t in (1, 2)}
    # bf16 attention as a run on this host attends (attention_rates' head dim is 64)
    attend_in = bf16_attention(probe["decisions"], 64)
    attention = {d: attention_rates(d, attention_seqs, min_time, attend_in) for d in ("fp32", "bf16")}
    samples = measure_collectives("cpu", worlds, sizes, reps, partial(_in_situ, tp_degrees=tuple(tp_degrees)))["samples"]
    cores = _cores()
    plain = plain_host(overhead_reps)
    plain_bf16 = plain_host(overhead_reps, "bf16")
    tp_fits: dict = {}
    for _, world, tp, measured in (x for x in samples if x[0] == "tp_host"):
        share = world / cores if world > cores else 1.0
        tp_fits.setdefault(str(world), {})[str(tp)] = {**fit_tp(plain, measured, tp, share), "measured": measured}
    dp_fits: dict = {}
    replicated_at = {world: measured for _, world, mode, measured in samples if _ == "dp_host" and mode == "replicate"}
    for _, world, mode, measured in (x for x in samples if x[0] == "dp_host"):
        share = world / cores if world > cores else 1.0
        if mode == "zero3_tp":  # beyond the TP micro-batch the same ranks ran
            fits = fit_dp(tp_fits[str(world)]["2"]["measured"], measured, mode, world, 1.0)
        else:  # ZeRO-3's reduce-scatter is priced as FSDP's all-reduce measured on the same ranks
            fits = fit_dp(plain, measured, mode, world, share, replicated_at.get(world))
        dp_fits.setdefault(str(world), {}).update(fits)
        dp_fits[str(world)].setdefault("measured", {})[mode] = measured
    samples = [x for x in samples if x[0] not in ("tp_host", "dp_host")]
    layer, head = plain[f"{SHAPES[0][0]},{SHAPES[0][1]}"]
    collectives = {}
    for kind in COLLECTIVES:
        mine = [(k, n, t) for (kd, k, n, t) in samples if kd == kind]
        if mine:
            by_world = {str(w): fit_alpha_beta(kind, [x for x in mine if x[0] == w]) for w in sorted({x[0] for x in mine})}
            collectives[kind] = {**fit_alpha_beta(kind, mine), "by_world": by_world, "samples": [list(s) for s in mine]}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    devices = max(worlds)
    prof = {
        "description": f"this machine ({cores} cores, calibrated {time.strftime('%Y-%m-%d')})",
        "devices_per_node": devices, "cores": cores,
        "matmul": matmul, "attention": attention,
        "memory": {"total_bytes": total, "bytes_per_device": total / devices, "copy_bw": measure_copy_bw()},
        "collectives": collectives, "op_overhead_s": measure_op_overhead(),
        "host_s": {"layer": layer, "head": head, "measured": plain, "measured_bf16": plain_bf16},
        "tp_host": tp_fits, "dp_in_situ": dp_fits,
        "optimizer_s_per_param": optimizer_seconds_per_param(),
        "probe": {"rates": probe["rates"], "decisions": probe["decisions"]},  # for the record; its cache is read
    }
    prof["mm_eff"] = fit_mm_eff(prof)
    prof["mm_eff_bf16"] = fit_mm_eff(prof, "bf16")
    prof["seconds"] = time.perf_counter() - start
    return prof
