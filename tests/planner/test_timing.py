"""Time model pieces: collective costs, pipeline bubbles, TP volume, overlap."""

import math
import re

import pytest

from ndtrain.model.config import preset
from ndtrain.planner.comm import collective_time
from ndtrain.planner.hardware import CATALOG
from ndtrain.layout import Layout
from ndtrain.planner.layer import layer_costs
from ndtrain.planner.problem import make_problem
from ndtrain.planner.timing import bubble_time, step_breakdown

H100 = CATALOG["h100"]


def test_ring_costs_inside_a_node():
    n, k = 1e9, 8
    a, bw = H100.alpha_intra, H100.intra_bw
    assert collective_time(H100, "all_reduce", k, 1, n) == pytest.approx(2 * (k - 1) * a + 2 * (k - 1) / k * n / bw)
    assert collective_time(H100, "all_gather", k, 1, n) == pytest.approx((k - 1) * a + (k - 1) / k * n / bw)
    assert collective_time(H100, "reduce_scatter", k, 1, n) == collective_time(H100, "all_gather", k, 1, n)
    assert collective_time(H100, "p2p", 2, 1, n) == pytest.approx(a + n / bw)
    assert collective_time(H100, "all_reduce", 1, 1, n) == 0.0


def test_tree_all_reduce_wins_for_small_messages_on_many_ranks():
    k, n = 4096, 1e3
    ring = 2 * (k - 1) * H100.alpha_inter
    assert collective_time(H100, "all_reduce", k, 8, n) < ring / 10
    assert collective_time(H100, "all_reduce", k, 8, n) >= 2 * math.log2(k) * H100.alpha_inter


def test_groups_across_nodes_use_the_nic_hierarchically():
    n = 1e9
    inter = collective_time(H100, "all_gather", 16, 8, n)  # one rank per node: flat over IB
    assert inter == pytest.approx(15 * H100.alpha_inter + 15 / 16 * n / H100.inter_bw)
    # 8 ranks per node on 2 nodes: IB carries 1/8 of the data per NIC, the rest rides NVLink
    hier = collective_time(H100, "all_gather", 16, 1, n)
    assert hier < inter / 4


def test_bubbles_per_schedule():
    p, m, f = 8, 32, 1.0
    one = bubble_time("1F1B", p, 1, f, f, f)
    assert one / (m * 3 * f) == pytest.approx((p - 1) / m)
    assert bubble_time("GPipe", p, 1, f, f, f) == one
    assert bubble_time("Interleaved1F1B", p, 4, f, f, f) == pytest.approx(one / 4)
    assert bubble_time("InterleavedZeroBubble", p, 1, f, f, f) == pytest.approx(one / 3)  # ZB-H1: a third
    assert bubble_time("ZBVZeroBubble", p, 2, f, f, f) == 0.0  # zero when F = B = W
    assert bubble_time("ZBVZeroBubble", p, 2, f, 2 * f, f) > 0.0
    assert bubble_time("DualPipeV", p, 2, f, f, f) == pytest.approx((p - 1) * f)
    assert bubble_time("1F1B", 1, 1, f, f, f) == 0.0


def test_tp_traffic_is_8bsh_per_layer_and_micro_batch():
    pb = make_problem(preset("llama3-8b"), 4096, 64, 8, "h100")
    lay = Layout(dp_shard=1, tp=8, micro_batch=2, activation_checkpoint="none")
    lc = layer_costs(pb, lay)
    bsh = 2 * 4096 * 4096 * 2  # bytes of one b x s x h activation
    ring = 2 * 7 / 8 * bsh / H100.intra_bw + 14 * H100.alpha_intra
    assert lc["tp"] == pytest.approx(4 * ring)  # 4 all-reduces = 8bsh(t-1)/t on the wire
    full = layer_costs(pb, Layout(dp_shard=1, tp=8, micro_batch=2, activation_checkpoint="full"))
    assert full["tp"] == pytest.approx(6 * ring)  # the recomputed forward repeats its 2


def test_recompute_adds_a_forward_and_dp_overlap_hides_gradients():
    pb = make_problem(preset("llama3-8b"), 4096, 64, 8, "h100")
    none = step_breakdown(pb, Layout(dp_shard=8, zero=1, micro_batch=1, activation_checkpoint="none"))
    full = step_breakdown(pb, Layout(dp_shard=8, zero=1, micro_batch=1, activation_checkpoint="full"))
    assert full["recompute"] > 0.2 * none["compute"]
    assert none["comm"]["dp"] < 0.05 * none["total"]  # hidden behind the last backward
    meg = make_problem(preset("llama3-8b"), 4096, 64, 8, "h100", stack="megatron-2021")
    exposed = step_breakdown(meg, Layout(dp_replicate=8, dp_shard=1, micro_batch=1, activation_checkpoint="none"))
    assert exposed["comm"]["dp"] > none["comm"]["dp"]


def test_zero3_moves_more_than_zero1():
    pb = make_problem(preset("llama3-8b"), 4096, 64, 64, "h100")
    z1 = step_breakdown(pb, Layout(dp_shard=64, zero=1, micro_batch=1))
    z3 = step_breakdown(pb, Layout(dp_shard=64, zero=3, micro_batch=1))
    assert z3["total"] >= z1["total"]


def test_fp8_prices_only_the_matmuls_the_runtime_converts():
    """layout/fp8.py's rule: block Linears in fp8 (at the fp8 ceiling, not the bf16 one applied to
    the fp8 peak), head in bf16, and nothing when the dims are not multiples of 16 (the runtime
    converts no layer; nor does the planner speed any up)."""
    lay = Layout(dp_shard=8, micro_batch=1, activation_checkpoint="none")

    def problem(cfg, precision, stack="ndtrain"):
        return make_problem(cfg, 4096, 64, 8, "h100", precision=precision, stack=stack)

    def costs(cfg, precision, stack="ndtrain"):
        return layer_costs(problem(cfg, precision, stack), lay)

    llama = preset("llama3-8b")
    k = problem(llama, "fp8").k
    speedup = costs(llama, "bf16")["W"] / costs(llama, "fp8")["W"]
    assert speedup == pytest.approx(H100.peak_fp8 * k["fp8_gemm_eff"] / (H100.peak_bf16 * k["gemm_eff"]), rel=0.03)
    assert costs(llama, "fp8")["head"] == pytest.approx(costs(llama, "bf16")["head"])
    odd = preset("llama3-8b", dim=4104, n_heads=36, n_kv_heads=6)
    assert costs(odd, "fp8")["W"] == pytest.approx(costs(odd, "bf16")["W"])
    moe = preset("deepseek-v3")  # routed and shared experts, router: bf16 in ndtrain, fp8 in DeepSeek's stack
    assert costs(moe, "bf16")["W"] / 2 < costs(moe, "fp8")["W"] < costs(moe, "bf16")["W"]
    assert costs(moe, "fp8", "deepseek-2024")["W"] < costs(moe, "fp8")["W"]


# ---- fp32 matmuls: TF32 tensor cores or IEEE CUDA cores ([parallel] fp32_matmul_precision) -------


def test_fp32_peaks_are_the_datasheets_tf32_and_ieee_rates():
    """Dense TF32 is half the dense bf16 tensor rate; IEEE fp32 runs on the CUDA cores (NVIDIA's
    A100 and H100 SXM datasheets: TF32 156 / 494.7 dense, FP32 19.5 / 67 TFLOP/s). CPU ranks have
    one calibrated fp32 rate whatever the key says (torch's CPU has no TF32)."""
    a100 = CATALOG["a100-80"]
    assert a100.peak("fp32") == a100.peak("fp32", "tf32") == pytest.approx(156e12)
    assert a100.peak("fp32", "ieee") == pytest.approx(19.5e12)
    assert H100.peak("fp32", "tf32") == pytest.approx(494.5e12)
    assert H100.peak("fp32", "ieee") == pytest.approx(67e12)
    assert H100.peak("bf16", "ieee") == H100.peak("bf16")  # the key is about fp32 alone
    cpu = make_problem(preset("debug"), 256, 8, 1, "this-machine", precision="fp32").hw
    assert cpu.peak("fp32", "ieee") == cpu.peak("fp32", "tf32") == cpu.peak_fp32


def test_fp32_step_on_a_gpu_differs_by_the_tf32_over_ieee_ratio_in_its_gemms():
    """One H100, no communication: the step is m x (layers x (GEMMs + attention + elementwise) +
    head) + optimizer, and only the GEMMs change rate. Every GEMM of Llama 3 8B at 4,096 tokens is
    compute-bound, so under IEEE each takes exactly 494.5 / 67 = 7.38x its TF32 time (same tiles,
    waves and k0, another peak), and the step grows by 6.38x the TF32 GEMM seconds: the
    tolerance is float rounding."""
    from ndtrain.planner.gemm import head_seconds, layer_matmuls

    pb = make_problem(preset("llama3-8b"), 4096, 4, 1, "h100", precision="fp32")
    tf32, ieee = (Layout(dp_shard=1, micro_batch=1, fp32_matmul_precision=s) for s in ("tf32", "ieee"))
    ratio = 494.5 / 67
    mm = {lay: layer_matmuls(pb, lay, 0) for lay in (tf32, ieee)}
    for part in ("F", "dgrad", "wgrad"):
        assert mm[ieee][part] == pytest.approx(ratio * mm[tf32][part], rel=1e-9)
    gemms = pb.cfg.n_layers * sum(mm[tf32][p] for p in ("F", "dgrad", "wgrad")) + head_seconds(pb, tf32)
    steps = {lay: step_breakdown(pb, lay)["total"] for lay in (tf32, ieee)}
    assert steps[ieee] - steps[tf32] == pytest.approx(4 * gemms * (ratio - 1), rel=1e-9)
    assert 3 < steps[ieee] / steps[tf32] < ratio  # GEMMs dominate, attention and the rest do not scale
    # bf16 never reads the key; nor do CPU ranks, priced by their calibrated fp32 rate
    bf = make_problem(preset("llama3-8b"), 4096, 4, 1, "h100", precision="bf16")
    assert step_breakdown(bf, ieee)["total"] == step_breakdown(bf, tf32)["total"]
    cpu = make_problem(preset("debug"), 256, 8, 1, "this-machine", precision="fp32")
    assert step_breakdown(cpu, ieee)["total"] == step_breakdown(cpu, tf32)["total"]


def test_ndtrain_plan_prices_and_prints_the_key(capsys):
    import json

    from ndtrain.planner.command import plan_main

    out = {}
    for setting in ("tf32", "ieee"):
        argv = ["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--precision", "fp32", "--seq", "4096",
                "--global-batch", "64", "--samples", "0", "--json",
                "--layout", f"dp_shard=8,zero=1,micro_batch=1,fp32_matmul_precision={setting}"]
        assert plan_main(argv) == 0
        out[setting] = json.loads(capsys.readouterr().out)["layouts"][0]
    assert out["tf32"]["layout"]["fp32_matmul_precision"] == "tf32"
    assert out["ieee"]["layout"]["fp32_matmul_precision"] == "ieee"
    assert "--parallel.fp32_matmul_precision=ieee" in out["ieee"]["config_check"]
    assert out["ieee"]["step_time_s"] > 3 * out["tf32"]["step_time_s"]
    assert plan_main([a for a in argv if a != "--json"]) == 0
    # the layout line of the text report (not the config line's --parallel.fp32_matmul_precision=ieee)
    assert re.search(r"(^|\s)fp32_matmul_precision=ieee\b", capsys.readouterr().out, re.M)
