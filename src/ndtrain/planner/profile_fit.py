"""Fitting a GPU calibration profile: the planner's constants from what calibrate/gpu.py
measured (pure arithmetic, torch-free). Apart from planner/profile.py, which only reads profiles,
because fitting runs the GEMM model (planner/gemm.py), which sits above the hardware catalog."""

from __future__ import annotations

import math

from ndtrain.planner import constants as consts
from ndtrain.planner.gemm import gemm_seconds
from ndtrain.planner.accelerator import GiB, Hardware
from ndtrain.planner.profile import VERSION

def _gemm_model(hw: Hardware, k: dict, m, n, kk, fp8: bool) -> float:
    class _P:  # the few Problem attributes gemm_seconds reads
        precision = "bf16"

    p = _P()
    p.hw, p.k = hw, k
    return gemm_seconds(p, m, n, kk, fp8)


def fit_gemm(hw: Hardware, samples: list, base: dict) -> dict:
    """gemm_eff and gemm_k0 (bf16 samples), fp8_gemm_eff (fp8 samples): the grid point of least
    squared log error of planner/gemm.py's model against the measured seconds."""
    out = {}
    bf16 = [s for s in samples if s[3] == "bf16"]
    fp8 = [s for s in samples if s[3] == "fp8"]

    def err(k, rows, is_fp8):
        return sum(math.log(_gemm_model(hw, k, m, n, kk, is_fp8) / t) ** 2 for m, n, kk, _, t in rows)

    if bf16:
        grid = [(e / 200, k0) for e in range(60, 200) for k0 in (32.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0)]
        e, k0 = min(grid, key=lambda g: err({**base, "gemm_eff": g[0], "gemm_k0": g[1]}, bf16, False))
        out.update(gemm_eff=e, gemm_k0=k0)
    if fp8 and hw.peak_fp8:
        k = {**base, **out}
        out["fp8_gemm_eff"] = min((e / 200 for e in range(40, 200)),
                                  key=lambda e: err({**k, "fp8_gemm_eff": e}, fp8, True))
    return out


def fit_attention(hw: Hardware, samples: list) -> float | None:
    """attn_eff: causal flash attention's model FLOPs (3 x the causal forward) over seconds and the
    bf16 peak, the median over the measured shapes."""
    # the time model's count (planner/gemm.py): forward 4 b h s^2 d / 2 (1 + 128/s), backward twice that
    rates = sorted(6 * b * h * s * s * d * (1 + 128 / s) / t / hw.peak_bf16 for b, h, s, d, t in samples if t > 0)
    return rates[len(rates) // 2] if rates else None


def fit_profile(hw: Hardware, measured: dict, fit_alpha_beta) -> dict:
    """The profile JSON from raw measurements (calibrate/gpu.py's dict): fits every constant
    it can. `fit_alpha_beta(kind, [(world, bytes, seconds)])` is the CPU calibration's fit (same
    hop counts as planner/comm.py)."""
    base = consts.resolve(hw.generation)
    constants = fit_gemm(hw, measured.get("gemm", []), base)
    attn = fit_attention(hw, measured.get("attention", []))
    if attn:
        constants["attn_eff"] = attn
    copy_bw = measured.get("hbm", {}).get("copy_bw")
    if copy_bw:
        constants["hbm_eff"] = min(1.0, copy_bw / hw.hbm_bw)
    mem = measured.get("memory", {})
    if mem.get("overhead_bytes"):
        constants["overhead_gib"] = mem["overhead_bytes"] / GiB
    if mem.get("fragmentation") is not None:
        constants["fragmentation"] = max(0.0, mem["fragmentation"])
    collectives = {}
    for kind, rows in measured.get("collectives", {}).items():
        if rows:
            collectives[kind] = {**fit_alpha_beta(kind, [tuple(r) for r in rows]), "samples": rows}
    return {"kind": "gpu", "version": VERSION, "catalog": hw.name, "device_name": measured.get("device_name", ""),
            "gpus": measured.get("gpus", 1), "calibrated": measured.get("calibrated", ""), "constants": constants,
            "collectives": collectives, "gemm": measured.get("gemm", []), "attention": measured.get("attention", []),
            "hbm": measured.get("hbm", {}), "memory": mem}
