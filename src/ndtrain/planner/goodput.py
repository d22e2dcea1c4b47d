"""Goodput under failures: optimal checkpoint interval (Young 1974, Daly 2006), the expected
fraction of wall time that trains, and a Monte-Carlo run that checks both.

Model (Daly's): failures arrive as a Poisson process with mean time between failures M for the
whole job (per-GPU MTBF / GPUs), during compute, checkpointing and restart alike. Work runs in
segments of tau, each followed by a checkpoint of C; a failure loses the segment in progress and
costs a restart of R (which a failure can itself interrupt).
"""

from __future__ import annotations

import math
import random


def young_interval(ckpt: float, mtbf: float) -> float:
    """Young's first-order optimum: sqrt(2 C M) of compute between checkpoints."""
    return math.sqrt(2 * ckpt * mtbf)


def daly_interval(ckpt: float, mtbf: float) -> float:
    """Daly's higher-order optimum (2006, eq. 37): sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C
    for C < 2M, else M."""
    if ckpt >= 2 * mtbf:
        return mtbf
    r = ckpt / (2 * mtbf)
    return math.sqrt(2 * ckpt * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - ckpt


def expected_efficiency(tau: float, ckpt: float, restart: float, mtbf: float) -> float:
    """Useful work / wall time for interval tau (Daly 2006, eq. 13, exact for Poisson failures):
    wall/work = (M/tau) e^(R/M) (e^((tau+C)/M) - 1)."""
    try:
        return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + ckpt) / mtbf))
    except OverflowError:  # restarts and segments so long that no work ever completes
        return 0.0


def simulate_failures(tau: float, ckpt: float, restart: float, mtbf: float, work: float, trials: int = 100,
                      seed: int = 0) -> dict:
    """Monte-Carlo runs of `work` seconds of training. Returns mean efficiency, its standard
    error, and mean failures per run."""
    rng = random.Random(seed)
    rate = 1.0 / mtbf
    effs, fails, walls = [], [], []
    for _ in range(trials):
        wall = done = 0.0
        n = 0
        while done < work:
            seg = min(tau, work - done)
            need = seg + (ckpt if done + seg < work else 0.0)  # no checkpoint after the last segment
            x = rng.expovariate(rate)
            if x >= need:
                wall += need
                done += seg
                continue
            wall += x
            n += 1
            while True:  # restart; a failure during it starts it over
                y = rng.expovariate(rate)
                if y >= restart:
                    wall += restart
                    break
                wall += y
                n += 1
        effs.append(work / wall)
        walls.append(wall)
        fails.append(n)
    mean = sum(effs) / trials
    var = sum((e - mean) ** 2 for e in effs) / max(1, trials - 1)
    wall_mean = sum(walls) / trials
    wall_var = sum((w - wall_mean) ** 2 for w in walls) / max(1, trials - 1)
    return {"efficiency": mean, "stderr": math.sqrt(var / trials), "failures": sum(fails) / trials,
            "wall": wall_mean, "wall_stderr": math.sqrt(wall_var / trials)}


def goodput_report(gpus: int, mtbf_gpu_hours: float, ckpt: float, restart: float, work_days: float = 30.0,
                   trials: int = 100, seed: int = 0) -> dict:
    """Everything `ndtrain goodput` prints, in seconds and fractions."""
    mtbf = mtbf_gpu_hours * 3600 / gpus
    work = work_days * 86400
    young = young_interval(ckpt, mtbf)
    daly = daly_interval(ckpt, mtbf)
    # Keep the simulation to a few million events whatever the inputs (each trial walks every
    # segment and failure of the run).
    events = work / daly + 2 * work / mtbf
    trials = max(3, min(trials, int(1e6 / events)))
    affordable = trials * events <= 3e6  # a few seconds at most; beyond, the formulas stand alone
    rows = []
    for name, tau in [("young", young), ("daly", daly)] + [(f"daly x {f:g}", daly * f) for f in (0.5, 2.0)]:
        expected = expected_efficiency(tau, ckpt, restart, mtbf)
        # below 1% goodput the run is dominated by restarts that fail again; simulating it would
        # take exponentially long and teach nothing
        sim = simulate_failures(tau, ckpt, restart, mtbf, work, trials, seed) if expected >= 0.01 and affordable else None
        rows.append({"name": name, "interval_s": tau, "expected": expected, "simulated": sim})
    return {"gpus": gpus, "mtbf_job_s": mtbf, "ckpt_s": ckpt, "restart_s": restart, "work_days": work_days,
            "failures_per_day": 86400 / mtbf, "trials": trials, "rows": rows}


def exclusion(slowdown: float, hosts: int, cost_s: float, detect_s: float = 0.0) -> dict:
    """A host whose ranks run `slowdown` slower (0.3: 30%) holds every synchronous step back by that
    much. Keeping it trains at k = 1 / (1 + slowdown) of full speed. Excluding it
    (train/resilience.py) trains at k for `detect_s` (the straggler windows before the decision),
    stops training for `cost_s` (save, re-rendezvous, reshard, warm-up: what `ndtrain report`
    measures per membership change), then trains on hosts - 1 of `hosts` at full speed, e = (H - 1) / H
    (the global batch is kept by accumulation). Excluding pays for itself once the run has
    `breakeven_s` left from the host's turn: k t = k D + e (t - D - C), so t = D + e C / (e - k).
    None: it never does (s <= 1 / (H - 1))."""
    keep = 1.0 / (1.0 + slowdown)
    shrunk = (hosts - 1) / hosts
    breakeven = detect_s + cost_s * shrunk / (shrunk - keep) if shrunk > keep else None
    return {"slowdown": slowdown, "hosts": hosts, "exclude_cost_s": cost_s, "detect_s": detect_s, "keep_speed": keep,
            "excluded_speed": shrunk, "breakeven_s": breakeven}


def price_exclusion(x: dict, gpus: int, mtbf_gpu_hours: float, ckpt: float, restart: float, work_days: float,
                    trials: int = 100, seed: int = 0) -> dict:
    """The whole job both ways, under failures: `work_days` of full-speed training left when the
    host of `exclusion` (x) turns slow. Keep: all of it at k on `gpus` GPUs. Exclude: x's detection
    at k, its stop, then the rest at e on the remaining GPUs (fewer GPUs fail less often). Each
    stretch checkpoints at Daly's interval for its own MTBF; the interval model prices its wall time
    as compute / expected efficiency, the simulator as the mean of Monte-Carlo runs (the same ones
    `simulate_failures` draws). Seconds of wall time; `saved_s` > 0 where excluding finishes sooner."""
    work = work_days * 86400
    keep, shrunk = x["keep_speed"], x["excluded_speed"]
    mtbf = mtbf_gpu_hours * 3600 / gpus
    mtbf_shrunk = mtbf * x["hosts"] / (x["hosts"] - 1)
    detect = min(x["detect_s"], work / keep)  # a job that ends before the decision never excludes
    # Keep the simulation to a few million events whatever the inputs, as goodput_report does.
    events = work / keep / daly_interval(ckpt, mtbf) + 2 * work / keep / mtbf
    trials = max(3, min(trials, int(1e6 / events)))
    affordable = trials * events <= 3e6

    def stretch(compute: float, m: float) -> tuple[float, dict | None]:
        if compute <= 0:
            return 0.0, {"wall": 0.0, "wall_stderr": 0.0}
        tau = daly_interval(ckpt, m)
        expected = expected_efficiency(tau, ckpt, restart, m)
        model = compute / expected if expected > 0 else math.inf
        sim = simulate_failures(tau, ckpt, restart, m, compute, trials, seed) if affordable and expected >= 0.01 else None
        return model, sim

    kept, kept_sim = stretch(work / keep, mtbf)
    before, before_sim = stretch(detect, mtbf)
    after, after_sim = stretch((work - keep * detect) / shrunk, mtbf_shrunk)
    excluded = before + x["exclude_cost_s"] + after

    def simulated(*parts):
        if any(p is None for p in parts):
            return None
        return {"wall": sum(p["wall"] for p in parts) + (x["exclude_cost_s"] if len(parts) > 1 else 0.0),
                "stderr": math.sqrt(sum(p["wall_stderr"] ** 2 for p in parts))}

    return {"work_days": work_days, "trials": trials, "keep_wall_s": kept, "exclude_wall_s": excluded,
            "saved_s": kept - excluded, "keep_simulated": simulated(kept_sim),
            "exclude_simulated": simulated(before_sim, after_sim)}
