"""GEMM time as a function of the GEMM's shape, and the GEMMs of one decoder layer.

A GEMM C[M, N] = A[M, K] B[K, N] on a GPU with S streaming multiprocessors runs in tiles of
tm x tn outputs, each SM one tile at a time:
  * tile and wave quantization: ceil(M/tm) ceil(N/tn) tiles run in ceil(tiles / S) waves; the
    useful share is (M N / (tm tn)) / (waves S). cuBLAS also has half-size tiles, which fill more
    SMs at lower efficiency per SM (sqrt of the tile's arithmetic-intensity ratio, ~0.75); the
    faster of the two is taken;
  * a short inner dimension pays a fixed cost per tile: efficiency K / (K + k0);
  * arithmetic intensity: a GEMM is never faster than moving its operands through HBM
    (bytes (M K + K N + M N) at hbm_eff of the bandwidth); small expert GEMMs hit this roof;
  * the ceiling `gemm_eff` (fp8: `fp8_gemm_eff` of the fp8 peak) is what a large, aligned GEMM
    reaches inside a training step: fitted per GPU generation (planner/constants.py).
A layer's Linear of [in, out] costs three GEMMs per micro-batch of T tokens: forward (T, out, in),
input gradient (T, in, out), weight gradient (in, out, T). fp32 GEMMs run at the rate the layout's
`fp32_matmul_precision` gives them (Hardware.peak): TF32 tensor cores, or IEEE on the CUDA cores.

CPU ranks ("this-machine") keep their calibrated model: all matmuls at peak x mm_eff.
"""

from __future__ import annotations

import math

from ndtrain.layout import Layout
from ndtrain.layout.fp8 import block_linears, converts
from ndtrain.planner.problem import Problem


def clock_share(pb: Problem) -> float:
    """The sustained SM clock under the board's power limit, as a share of the clock at its TDP
    (where `gemm_eff` and `attn_eff` were fitted or measured: 1 there and above).

    Mechanism: a compute-bound kernel on Hopper holds the board at its power limit, so a lower
    limit lowers the clock until P = s TDP + (1 - s) TDP (f / f_tdp)^n: `static_power` s does not
    scale with the clock, the dynamic part grows as f^n (`power_exponent`; CMOS P = a C V^2 f with
    V rising with f). Memory-bound kernels keep the HBM's rate. Range: a limit from 30% of the
    TDP (the lowest `nvidia-smi -pl` accepts on H100/A100 boards) to the TDP."""
    hw = pb.hw
    if not hw.power_w or hw.power_w >= hw.tdp_w:  # CPU ranks: 0
        return 1.0
    s, n = pb.k["static_power"], pb.k["power_exponent"]
    dynamic = (hw.power_w - s * hw.tdp_w) / ((1 - s) * hw.tdp_w)
    return max(0.05, dynamic) ** (1 / n)


def gemm_seconds(pb: Problem, m: float, n: float, kk: float, fp8: bool = False, count: float = 1.0,
                 fp32_matmul: str = "tf32") -> float:
    """Seconds of `count` same-shaped GEMMs (M, N, K) run as one grouped/batched call; in fp32 at
    the `fp32_matmul` rate (tf32 | ieee)."""
    if m <= 0 or n <= 0 or kk <= 0 or count <= 0:
        return 0.0
    hw, k = pb.hw, pb.k
    if fp8:
        peak = hw.peak("fp8") * k["fp8_gemm_eff"]
    else:
        peak = hw.peak("bf16" if pb.precision != "fp32" else "fp32", fp32_matmul) * k["gemm_eff"]
    peak *= clock_share(pb)
    flops = 2.0 * m * n * kk * count
    best = math.inf
    tm, tn = hw.tile
    for (a, b), eff in (((tm, tn), 1.0), ((max(16, tm // 2), max(16, tn // 2)), 0.75)):
        tiles = count * math.ceil(m / a) * math.ceil(n / b)
        waves = math.ceil(tiles / hw.sms)
        useful = count * m * n / (a * b) / (waves * hw.sms)
        best = min(best, flops / (peak * eff * useful))
    compute = best * (kk + k["gemm_k0"]) / kk
    elt = 1 if fp8 else (4 if pb.precision == "fp32" else 2)
    memory = elt * count * (m * kk + kk * n + m * n) / (hw.hbm_bw * k["hbm_eff"])
    return max(compute, memory)


def linear_passes(pb: Problem, t_tok: float, n_in: float, n_out: float, fp8: bool, count: float = 1.0,
                  fp32_matmul: str = "tf32") -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) seconds of `count` Linears [n_in, n_out] over
    `t_tok` tokens each."""
    return (gemm_seconds(pb, t_tok, n_out, n_in, fp8, count, fp32_matmul),
            gemm_seconds(pb, t_tok, n_in, n_out, fp8, count, fp32_matmul),
            gemm_seconds(pb, n_in, n_out, t_tok, fp8, count, fp32_matmul))


def _fp8(pb: Problem, name: str, n_in: int, n_out: int, t: int) -> bool:
    """Whether this Linear runs in fp8: the runtime's rule (ndtrain.layout.fp8.converts), or, for a
    stack that also runs its experts in fp8 (DeepSeek-V3), any expert Linear with aligned dims."""
    if pb.precision != "fp8":
        return False
    if ".feed_forward.shared_experts." in name or name.endswith("experts"):
        return pb.stack.fp8_experts and n_in % 16 == 0 and n_out % 16 == 0
    return converts(name, n_in, n_out, t)


def layer_matmuls(pb: Problem, lay: Layout, layer: int) -> dict:
    """Seconds per micro-batch of decoder layer `layer`'s GEMMs on one device: {"F", "dgrad",
    "wgrad"} and the fp8 cast traffic (bytes) {"cast_f", "cast_b"}. Attention and dense MLPs are
    split over tp (sequence-parallel or not, each tp rank multiplies all T tokens by its shard);
    MoE layers run replicated over tp, routed experts split over ep, each expert receiving
    T k ep / E tokens times the imbalance on the busiest rank (grouped GEMM)."""
    cfg, t = pb.cfg, lay.tp
    tok = lay.micro_batch * pb.seq / lay.cp
    out = {"F": 0.0, "dgrad": 0.0, "wgrad": 0.0, "cast_f": 0.0, "cast_b": 0.0}

    def add(name, n_in, n_out, shard, tokens=tok, count=1.0):
        i, o = (n_in / t, n_out) if shard == "in" else (n_in, n_out / t) if shard == "out" else (n_in, n_out)
        fp8 = _fp8(pb, name, n_in, n_out, t)
        f, dg, wg = linear_passes(pb, tokens, i, o, fp8, count, lay.fp32_matmul_precision)
        out["F"] += f
        out["dgrad"] += dg
        out["wgrad"] += wg
        if fp8:  # inputs and weights cast for the forward, output gradients for the backward
            out["cast_f"] += count * (tokens * i + i * o)
            out["cast_b"] += count * tokens * o

    moe = cfg.is_moe_layer(layer)
    for name, n_in, n_out in block_linears(cfg, layer):
        short = name.split(".", 2)[2]
        if short.startswith("attention."):
            kv = short in ("attention.wk", "attention.wv")
            if kv and t > cfg.n_kv_heads:  # kv heads replicated over tp (relaxed layouts only)
                add(name, n_in, n_out * t / cfg.n_kv_heads, "out")
            else:
                add(name, n_in, n_out, "in" if short == "attention.wo" else "out")
        elif moe:  # router, shared experts: replicated over tp
            add(name, n_in, n_out, None)
        else:
            add(name, n_in, n_out, "in" if short.endswith(".w2") else "out")
    if moe:
        e_local = cfg.n_experts / lay.ep
        per_expert = tok * cfg.n_active_experts * lay.ep / cfg.n_experts * pb.k["moe_imbalance"]
        fe, h = cfg.expert_ffn_dim, cfg.dim
        ups = 2 if cfg.mlp == "swiglu" else 1
        add("experts", h, fe, None, per_expert, e_local * ups)
        add("experts", fe, h, None, per_expert, e_local)
    return out


def attention_efficiency(pb: Problem, length: float) -> float:
    """What a flash kernel reaches of the peak on `length` query rows per call: `attn_eff` (the
    generation's own kernels; `attn_eff_fa2` for a stack whose kernels are FlashAttention-2-class, its
    long-sequence rate) x L / (L + attn_s0). Short calls launch fewer tiles than the GPU has SMs
    and pay a fixed prologue per call: FlashAttention-2/3's benchmarks (causal, head dim 128)
    run 512 tokens at a third to a half of their 16K rate. Under CP each rank's calls cover its
    s/cp queries (each ring step one block of them), so 131K over cp=16 runs at the 8K rate."""
    base = pb.k["attn_eff_fa2"] if pb.stack.attention_kernel == "fa2" else pb.k["attn_eff"]
    return base * length / (length + pb.k["attn_s0"])


def attention_seconds(pb: Problem, lay: Layout) -> float:
    """Forward seconds of one layer's attention core per micro-batch on one device. Flash kernels:
    the causal half (plus the diagonal 128-blocks they compute whole) at `attn_eff` of the peak;
    unfused kernels (2021): QK^T and PV as batched GEMMs over the full s x s."""
    cfg, t, b = pb.cfg, lay.tp, lay.micro_batch
    heads = cfg.n_heads / t
    s_loc = pb.seq / lay.cp
    if pb.stack.flash_attention:
        flops = 4 * b * s_loc * pb.seq * heads * cfg.head_dim / 2 * (1 + 128 / pb.seq)
        return flops / (pb.hw.peak("bf16") * attention_efficiency(pb, s_loc) * clock_share(pb))
    qk = gemm_seconds(pb, s_loc, pb.seq, cfg.head_dim, count=b * heads, fp32_matmul=lay.fp32_matmul_precision)
    pv = gemm_seconds(pb, s_loc, cfg.head_dim, pb.seq, count=b * heads, fp32_matmul=lay.fp32_matmul_precision)
    return qk + pv


def head_seconds(pb: Problem, lay: Layout) -> float:
    """Output projection per micro-batch, forward and both gradients, in bf16 (never fp8)."""
    tok = lay.micro_batch * pb.seq / lay.cp
    f, dg, wg = linear_passes(pb, tok, pb.cfg.dim, pb.cfg.vocab_size / lay.tp, False,
                              fp32_matmul=lay.fp32_matmul_precision)
    return f + dg + wg
