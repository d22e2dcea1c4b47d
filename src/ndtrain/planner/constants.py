"""Every number the GPU time and memory models assume or fit, with its range and its source.

A constant belongs to a GPU generation (GEMM and attention kernel efficiency) or to every GPU
(elementwise traffic of eager and of fused kernels, which a stack picks; how well an overlap hides
its traffic; link efficiencies, latencies, allocator behaviour). None belongs to a published
run: the fitted ones were fitted on the rows docs/results/planner-validation.md lists as
"fitted", and checked on the "validation" rows they never saw (planner/published.py).

`resolve(generation)` gives the nominal values a problem uses; `ranges(...)` their ranges,
which planner/uncertainty.py samples to put an interval on every prediction.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ndtrain.errors import NdtrainError

GENERATIONS = ("ampere", "hopper", "blackwell")


@dataclass(frozen=True)
class Constant:
    name: str
    scope: str  # a GPU generation, or "all"
    nominal: float
    low: float
    high: float
    unit: str
    what: str
    source: str  # "fitted: ..." or where the assumed value and range come from


# Fitted values (published.fit_* redo each fit; tests check these are their optimum).
AMPERE_GEMM_EFF = 0.665
HOPPER_GEMM_EFF = 0.615  # refitted on the same two rows once power, launch and kernel size were priced apart
HOPPER_FP8_GEMM_EFF = 0.505  # refitted on the same row once power, launch and kernel size were priced apart
EAGER_KAPPA = 4.0

CONSTANTS: tuple[Constant, ...] = (
    # --- kernels, per GPU generation -----------------------------------------------------------
    Constant("gemm_eff", "ampere", AMPERE_GEMM_EFF, 0.62, 0.71, "of bf16 peak",
             "GEMM ceiling: what a large, wave-aligned training GEMM sustains in a training step",
             "fitted: Megatron-LM 2021 Table 1 (10 rows, A100); range: the fit's worst row, 4%, plus margin"),
    Constant("gemm_eff", "hopper", HOPPER_GEMM_EFF, 0.57, 0.66, "of bf16 peak", "GEMM ceiling (bf16)",
             "fitted: Llama 3 Table 4, the two 8K rows (H100); range: +-7%"),
    Constant("gemm_eff", "blackwell", HOPPER_GEMM_EFF, 0.50, 0.72, "of bf16 peak", "GEMM ceiling (bf16)",
             "not fitted: Hopper's value; range widened (no published Blackwell run was fitted)"),
    Constant("fp8_gemm_eff", "hopper", HOPPER_FP8_GEMM_EFF, 0.45, 0.56, "of fp8 peak",
             "fp8 GEMM ceiling: its own efficiency, not the bf16 one applied to the fp8 peak",
             "fitted: NeMo 24.07 LLAMA2-7B fp8 row (8 H100); range: +-11%"),
    Constant("fp8_gemm_eff", "blackwell", HOPPER_FP8_GEMM_EFF, 0.40, 0.65, "of fp8 peak", "fp8 GEMM ceiling",
             "not fitted: Hopper's value, range widened"),
    Constant("attn_eff", "ampere", 0.50, 0.40, 0.65, "of bf16 peak",
             "flash attention forward + backward, long sequences, head dim 128",
             "FlashAttention-2 (Dao 2023): 50-73% of peak forward, less backward, on A100"),
    Constant("attn_eff", "hopper", 0.53, 0.45, 0.65, "of bf16 peak",
             "Hopper-native flash kernels (cuDNN, FlashAttention-3, TE), forward + backward (backward at 2.5x "
             "the forward FLOPs)",
             "FlashAttention-3 (Shah et al. 2024), fig. 5-6: 60-75% of H100 peak forward, 45-55% backward, i.e. "
             "3.5 / (1/0.65 + 2.5/0.5) = 0.53 over both; FlashAttention-2-class kernels: attn_eff_fa2"),
    Constant("attn_eff", "blackwell", 0.53, 0.35, 0.70, "of bf16 peak", "flash attention forward + backward",
             "not measured: Hopper's value, range widened"),
    # Ampere-era flash kernels (FlashAttention-2, Triton's, PyTorch SDPA's flash backend) on newer
    # GPUs: written for mma.sync, they use neither Hopper's wgmma nor TMA (Stack.attention_kernel)
    Constant("attn_eff_fa2", "ampere", 0.50, 0.40, 0.65, "of bf16 peak",
             "FlashAttention-2-class kernels, forward + backward: on Ampere the generation's own kernel",
             "FlashAttention-2 (Dao 2023): the same figures as attn_eff"),
    Constant("attn_eff_fa2", "hopper", 0.32, 0.25, 0.40, "of bf16 peak",
             "FlashAttention-2-class kernels on H100, forward + backward",
             "FlashAttention-3 (Shah et al. 2024), abstract and fig. 5-6: FlashAttention-2 reaches ~35% of H100's "
             "peak forward and less backward (FA3: 75% forward)"),
    Constant("attn_eff_fa2", "blackwell", 0.32, 0.20, 0.45, "of bf16 peak",
             "FlashAttention-2-class kernels on Blackwell", "not measured: Hopper's value, range widened"),
    Constant("gemm_k0", "all", 128.0, 64.0, 256.0, "elements",
             "per-tile fixed cost in units of K: a GEMM of inner size K runs at K / (K + k0) of its ceiling",
             "assumed: prologue/epilogue of a CUTLASS/cuBLAS main loop is ~1-2 K-tiles of 64-128"),
    Constant("hbm_eff", "all", 0.85, 0.75, 0.92, "of HBM bandwidth", "what memory-bound GEMMs reach",
             "assumed: STREAM-like kernels reach 80-92% of HBM datasheet bandwidth"),
    # --- elementwise work (norms, activations, RoPE, residuals, casts): bytes moved per stored byte
    Constant("kappa_eager", "all", EAGER_KAPPA, 3.0, 5.5, "x activation bytes",
             "HBM traffic of the non-matmul kernels per byte of stored activations, forward + backward",
             "fitted: Megatron-LM 2021 Table 1 with the A100 GEMM ceiling; also used for eager PyTorch"),
    Constant("kappa_fused", "all", 2.4, 1.5, 3.5, "x activation bytes",
             "the same for stacks with fused kernels (TE, torch.compile)",
             "assumed: fusing norm+cast, bias+activation and RoPE removes about 40% of eager traffic"),
    Constant("fp8_cast_bytes", "all", 4.0, 2.0, 8.0, "bytes per element",
             "HBM traffic to scale and cast each fp8 GEMM input, weight and output gradient (amax + cast)",
             "assumed: read 2 bytes for amax, read 2 and write 1 for the cast, partly fused"),
    # --- communication ------------------------------------------------------------------------
    Constant("nvlink_eff", "all", 0.80, 0.70, 0.90, "of one NVLink direction", "collective bus bandwidth inside a node",
             "nccl-tests bus bandwidth on DGX A100/H100: ~80% of NVLink per direction"),
    Constant("nic_eff", "all", 0.85, 0.70, 0.95, "of NIC line rate", "collective bus bandwidth across nodes",
             "nccl-tests on InfiniBand/RoCE: 80-95% of line rate at large messages"),
    Constant("alpha_intra", "all", 5e-6, 3e-6, 10e-6, "s per step", "latency of one ring/tree step inside a node",
             "NCCL base latencies of a few us per step over NVLink"),
    Constant("alpha_inter", "all", 12e-6, 8e-6, 25e-6, "s per step", "latency of one step across nodes",
             "NCCL over IB/RoCE: ~8-20 us per step"),
    Constant("overlap_eff", "all", 0.75, 0.50, 0.95, "of the window",
             "share of a compute window an overlapped collective can use (TP comm overlap, async TP, DualPipe)",
             "assumed: chunked overlap leaves the first/last chunk and launch gaps exposed"),
    Constant("contention", "all", 0.08, 0.0, 0.20, "of hidden comm time",
             "compute slowdown from collectives running beside it (SMs and HBM taken by NCCL kernels)",
             "assumed: NCCL uses 8-32 SMs of 108-132 while it runs"),
    # --- power, launch, kernel size: what a GEMM sustains short of its ceiling ----------------
    Constant("static_power", "all", 0.25, 0.15, 0.35, "of TDP",
             "board power that does not scale with the SM clock (leakage, HBM, VRM losses) under a GEMM load",
             "assumed: idle-to-TDP ratios of 10-20% plus HBM and regulator losses that persist at lower clocks"),
    Constant("power_exponent", "all", 2.5, 2.0, 3.0, "P_dyn ~ f^n",
             "how dynamic power grows with the sustained clock: P = a C V^2 f with V rising with f",
             "CMOS dynamic power (Weste & Harris, CMOS VLSI Design, 5.1): n = 3 where V is proportional to f, "
             "n = 2 nearer the voltage floor"),
    Constant("launch_s", "all", 10e-6, 5e-6, 20e-6, "s per op",
             "host time per eager op (dispatch, autograd record, kernel launch): a layer waits for its host "
             "when its kernels are shorter",
             "He 2022, 'Making Deep Learning Go Brrrr From First Principles' (overhead): ~10 us per eager "
             "PyTorch op; range 5-20 us over server CPUs"),
    Constant("attn_s0", "all", 384.0, 192.0, 1024.0, "tokens",
             "flash attention at L tokens per kernel call runs at L / (L + s0) of `attn_eff` (fewer tiles "
             "than SMs and a fixed prologue per call at short L)",
             "FlashAttention-2 (Dao 2023) fig. 5 and FlashAttention-3 (Shah et al. 2024) fig. 5, causal, head "
             "dim 128: 512 tokens reach about 1/3 to 1/2 of the 16K rate"),
    # --- MoE ----------------------------------------------------------------------------------
    Constant("moe_imbalance", "all", 1.10, 1.0, 1.30, "max / mean", "tokens on the busiest expert rank",
             "assumed: auxiliary-loss or bias balancing keeps the busiest rank within ~10-30% of the mean"),
    # --- memory -------------------------------------------------------------------------------
    Constant("fragmentation", "all", 0.10, 0.05, 0.20, "of churning bytes",
             "caching-allocator slack over activations, logits and buffers",
             "assumed; with it every published layout in planner/published.py fits"),
    Constant("overhead_gib", "all", 1.5, 1.0, 3.0, "GiB", "CUDA context, NCCL buffers, cuBLAS workspaces",
             "assumed: 1-3 GiB measured outside the allocator on H100 nodes"),
)

TIME_CONSTANTS = ("gemm_eff", "fp8_gemm_eff", "attn_eff", "gemm_k0", "hbm_eff", "kappa_eager", "kappa_fused",
                  "fp8_cast_bytes",
                  "nvlink_eff", "nic_eff", "alpha_intra", "alpha_inter", "overlap_eff", "contention",
                  "moe_imbalance", "static_power", "power_exponent", "launch_s", "attn_s0", "attn_eff_fa2")
MEMORY_CONSTANTS = ("fragmentation", "overhead_gib")


def entries(generation: str) -> dict[str, Constant]:
    """The constants that apply to one GPU generation."""
    gen = "hopper" if generation not in GENERATIONS else generation
    out: dict[str, Constant] = {}
    for c in CONSTANTS:
        if c.scope in (gen, "all") and c.name not in out:
            out[c.name] = c
    if "fp8_gemm_eff" not in out:  # a generation without fp8 tensor cores: never used
        out["fp8_gemm_eff"] = Constant("fp8_gemm_eff", gen, 0.0, 0.0, 0.0, "", "no fp8 tensor cores", "")
    return out


def resolve(generation: str, overrides: dict | None = None) -> dict[str, float]:
    """Nominal values, with `overrides` ({name: value}, e.g. from a GPU calibration profile)."""
    vals = {n: c.nominal for n, c in entries(generation).items()}
    for name, value in (overrides or {}).items():
        if name not in vals:
            raise NdtrainError(f"unknown planner constant {name!r}; known: {', '.join(sorted(vals))}")
        vals[name] = float(value)
    return vals


def ranges(generation: str) -> dict[str, tuple[float, float]]:
    return {n: (c.low, c.high) for n, c in entries(generation).items() if c.high > c.low}


def latin_hypercube(base: dict[str, float], bounds: dict[str, tuple[float, float]], n: int, seed: int = 0,
                    names: tuple[str, ...] = TIME_CONSTANTS) -> list[dict[str, float]]:
    """n Latin-hypercube samples of the constants in `names` over their ranges (each range cut in
    n strata, one draw per stratum, strata shuffled independently per constant), the others at
    `base`. Latency constants are drawn log-uniformly, the rest uniformly."""
    rng = random.Random(seed)
    worlds = [dict(base) for _ in range(n)]
    for name in names:
        if name not in bounds:
            continue
        lo, hi = bounds[name]
        # a calibrated value outside the catalog's range: sample around it, same relative width
        if not lo <= base[name] <= hi:
            lo, hi = base[name] * lo / ((lo + hi) / 2), base[name] * hi / ((lo + hi) / 2)
        strata = list(range(n))
        rng.shuffle(strata)
        for world, s in zip(worlds, strata):
            u = (s + rng.random()) / n
            if name.startswith("alpha") or name == "launch_s":
                world[name] = math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
            else:
                world[name] = lo + u * (hi - lo)
    return worlds
