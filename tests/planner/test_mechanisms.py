"""Each mechanism of the GPU time and memory models, by its limiting cases and the direction it
moves things (docs/planner.md, "Mechanisms")."""

import dataclasses

import pytest

from ndtrain.layout import Layout
from ndtrain.model.config import preset
from ndtrain.planner.comm import collective_time
from ndtrain.planner.gemm import gemm_seconds
from ndtrain.planner.hardware import CATALOG
from ndtrain.planner.layer import layer_costs
from ndtrain.planner.memory import activation_bytes
from ndtrain.planner.problem import make_problem
from ndtrain.planner.search import Evaluator
from ndtrain.planner.timing import step_breakdown

H100 = CATALOG["h100"]


def pb(model="llama3-8b", seq=4096, batch=64, world=8, gpu="h100", **kw):
    return make_problem(preset(model), seq, batch, world, gpu, **kw)


def per_flop(p, m, n, k, **kw):
    return gemm_seconds(p, m, n, k, **kw) / (2 * m * n * k)


# ---- GEMM shape -------------------------------------------------------------------------------


def test_large_aligned_gemm_reaches_the_ceiling():
    p = pb()
    tm, tn = H100.tile
    m, n, k = tm * H100.sms, tn * 64, 16384  # exactly 64 full waves
    ideal = 2 * m * n * k / (H100.peak_bf16 * p.k["gemm_eff"])
    assert gemm_seconds(p, m, n, k) == pytest.approx(ideal * (k + p.k["gemm_k0"]) / k, rel=1e-9)


def test_wave_quantization_one_tile_past_a_full_wave():
    p = pb()
    tm, tn = H100.tile
    full = per_flop(p, tm * H100.sms, tn, 8192)  # exactly one wave of tiles
    over = per_flop(p, tm * (H100.sms + 1), tn, 8192)  # one tile more: a second, nearly empty wave
    assert over > 1.3 * full


def test_short_inner_dimension_costs_more_per_flop():
    p = pb()
    times = [per_flop(p, 8192, 8192, k) for k in (128, 512, 2048, 8192)]
    assert times == sorted(times, reverse=True)


def test_skinny_gemm_is_bound_by_memory():
    p = pb()
    m, n, k = 16, 8192, 8192
    bytes_moved = 2 * (m * k + k * n + m * n)
    assert gemm_seconds(p, m, n, k) == pytest.approx(bytes_moved / (H100.hbm_bw * p.k["hbm_eff"]))


def test_small_hidden_size_is_priced_below_a_large_one():
    small = pb("llama3-8b", world=8)
    cfg = preset("llama3-8b", dim=1024, n_heads=8, n_kv_heads=8, ffn_dim=3584)
    tiny = make_problem(cfg, 4096, 64, 8, "h100")
    lay = Layout(dp_shard=1, tp=8, micro_batch=1)

    def rate(problem):
        c = layer_costs(problem, lay)
        flops = 6 * 4096 * problem.shape.mm_params_layer / 8
        return flops / (c["W"] * 3)

    assert rate(tiny) < 0.8 * rate(small)


# ---- overlap, as each stack has it -----------------------------------------------------------


def test_tp_overlap_hides_tp_traffic_up_to_its_window():
    lay = Layout(dp_shard=1, tp=8, micro_batch=1)
    plain = layer_costs(pb(stack="ndtrain"), lay)["tp"]
    mcore = pb(stack="megatron-core-2024")
    hidden = layer_costs(mcore, lay)["tp"]
    assert hidden < plain
    none = layer_costs(mcore.with_constants({"overlap_eff": 0.0}), lay)["tp"]
    assert none == pytest.approx(plain)
    assert layer_costs(mcore.with_constants({"overlap_eff": 0.95}), lay)["tp"] <= hidden


def test_contention_makes_hidden_traffic_cost_compute():
    lay = Layout(dp_shard=1, tp=8, micro_batch=1)
    mcore = pb(stack="megatron-core-2024")
    free = layer_costs(mcore.with_constants({"contention": 0.0}), lay)
    costly = layer_costs(mcore.with_constants({"contention": 0.2}), lay)
    assert costly["compute"] > free["compute"] and costly["tp"] == free["tp"]


def test_pipeline_sends_exposed_without_overlap():
    lay = Layout(dp_shard=1, pp=4, micro_batch=1, pp_schedule="1F1B")
    ours = step_breakdown(pb(world=4), lay)["comm"]["pp"]
    blocking = step_breakdown(pb(world=4, stack="megatron-2021"), lay)["comm"]["pp"]
    assert blocking > 2 * ours


def test_data_parallel_overlap_per_stack():
    lay = Layout(dp_replicate=8, dp_shard=1, micro_batch=1)
    hidden = step_breakdown(pb(), lay)
    exposed = step_breakdown(pb(stack="megatron-2021"), lay)
    assert hidden["comm"]["dp"] < 0.2 * exposed["comm"]["dp"]


def test_cp_ring_hides_behind_attention_allgather_does_not():
    lay = Layout(dp_shard=4, cp=2, micro_batch=1)
    long = pb(seq=32768, batch=8)
    assert layer_costs(long, lay)["cp"] == 0.0  # each hop is shorter than the block it feeds
    gathered = layer_costs(long, dataclasses.replace(lay, cp_attention="allgather"))["cp"]
    assert gathered > 0.0
    assert layer_costs(pb(seq=32768, batch=8, stack="llama3-2024"), lay)["cp"] > 0.0


def test_expert_all_to_all_hidden_only_where_the_stack_pairs_micro_batches():
    lay = Layout(dp_shard=16, pp=4, ep=16, micro_batch=1, pp_schedule="DualPipeV", pp_virtual_stages=2)
    ours = pb("deepseek-v3", world=64, batch=64, precision="fp8")
    deepseek = pb("deepseek-v3", world=64, batch=64, precision="fp8", stack="deepseek-2024")
    one = dataclasses.replace(lay, pp_schedule="1F1B", pp_virtual_stages=1)
    assert layer_costs(ours, lay)["ep"] == pytest.approx(layer_costs(ours, one)["ep"])  # torch's DualPipeV: in turn
    assert layer_costs(deepseek, lay)["ep"] < layer_costs(deepseek, one)["ep"]


# ---- the network as built ------------------------------------------------------------------


def test_latency_grows_with_ranks_and_tree_wins_small_all_reduce():
    small = 1e4
    times = [collective_time(H100, "all_gather", k, 8, small) for k in (2, 16, 128, 1024)]
    assert times == sorted(times)
    assert times[-1] >= 1023 * H100.alpha_inter * 0.5
    ring = 2 * 4095 * H100.alpha_inter
    assert collective_time(H100, "all_reduce", 4096, 8, small) < ring / 10


def test_oversubscription_above_the_pod():
    n = 1e9
    pods = dataclasses.replace(H100, pod_gpus=1024, oversubscription=7.0)
    # a ring with few nodes per pod (here 2: stride 512) shares the uplinks; with many it does not
    sparse = collective_time(H100, "all_gather", 4, 512, n)
    assert collective_time(pods, "all_gather", 4, 512, n) > 2 * sparse
    dense = collective_time(H100, "all_gather", 2048, 8, n)
    assert collective_time(pods, "all_gather", 2048, 8, n) == pytest.approx(dense)
    assert collective_time(dataclasses.replace(pods, oversubscription=1.0), "all_gather", 4, 512, n) == pytest.approx(sparse)
    # all-to-all: every GPU sends its cross-pod share at once
    assert collective_time(pods, "all_to_all", 2048, 1, n) > 3 * collective_time(H100, "all_to_all", 2048, 1, n)
    inside = collective_time(pods, "all_gather", 64, 8, n)  # 512 GPUs: inside one pod
    assert inside == pytest.approx(collective_time(H100, "all_gather", 64, 8, n))
    # a pipeline boundary crossing pods shares the uplinks; inside a pod it does not
    assert collective_time(pods, "p2p", 2, 1024, 1e8) > collective_time(pods, "p2p", 2, 8, 1e8)


def test_meta_rank_order_keeps_the_pipeline_inside_a_pod():
    lay = Layout(dp_shard=128, tp=8, pp=16, micro_batch=1, pp_schedule="1F1B")
    net = {"pod_gpus": 3072, "oversubscription": 7.0}
    ours = make_problem(preset("llama3-405b"), 8192, 2048, 16384, "h100", network=net)
    meta = make_problem(preset("llama3-405b"), 8192, 2048, 16384, "h100", network=net, stack="llama3-2024")
    assert step_breakdown(meta, lay)["comm"]["pp"] < step_breakdown(ours, lay)["comm"]["pp"]


# ---- fp8 ---------------------------------------------------------------------------------------


def test_fp8_scaling_overhead_is_paid():
    lay = Layout(dp_shard=8, micro_batch=1)
    p = pb(precision="fp8")
    free = layer_costs(p.with_constants({"fp8_cast_bytes": 0.0}), lay)
    assert layer_costs(p, lay)["F"] > free["F"]
    assert layer_costs(p.with_constants({"fp8_cast_bytes": 8.0}), lay)["F"] > layer_costs(p, lay)["F"]


def test_fp8_activations_kept_in_fp8_only_by_stacks_that_do():
    sh, seq = pb().shape, 4096
    from ndtrain.planner.stack import STACKS

    te = STACKS["megatron-core-2024"]
    assert activation_bytes(sh, te, seq, 1, fp8=True) < activation_bytes(sh, te, seq, 1)
    lay = Layout(dp_shard=8, micro_batch=1)
    ours_bf16 = Evaluator(pb())(lay, check=False).memory["activations"]
    ours_fp8 = Evaluator(pb(precision="fp8"))(lay, check=False).memory["activations"]
    assert ours_fp8 == pytest.approx(ours_bf16)  # torchao keeps the bf16 input


# ---- MoE ---------------------------------------------------------------------------------------


def test_moe_imbalance_slows_experts_and_all_to_all():
    lay = Layout(dp_shard=16, ep=16, micro_batch=1)
    p = pb("mixtral-8x7b", world=16, batch=16)
    even = layer_costs(p.with_constants({"moe_imbalance": 1.0}), lay)
    skew = layer_costs(p.with_constants({"moe_imbalance": 1.3}), lay)
    assert skew["W"] > even["W"] and skew["ep"] > even["ep"]


def test_fewer_tokens_per_expert_cost_more_per_flop():
    lay = Layout(dp_shard=8, ep=8, micro_batch=1)
    few = preset("mixtral-8x7b", n_experts=64, n_active_experts=2, expert_ffn_dim=14336 // 8)
    many = preset("mixtral-8x7b", n_experts=8, n_active_experts=2, expert_ffn_dim=14336 // 8)
    w_few = layer_costs(make_problem(few, 1024, 8, 8, "h100"), lay)["W"]
    w_many = layer_costs(make_problem(many, 1024, 8, 8, "h100"), lay)["W"]
    assert w_few > 1.1 * w_many  # same FLOPs, 8x fewer tokens per expert GEMM


def test_all_to_all_across_nodes_costs_more_and_node_limit_helps():
    n = 1e8
    assert collective_time(H100, "all_to_all", 64, 1, n) > collective_time(H100, "all_to_all", 8, 1, n)
    lay = Layout(dp_shard=64, ep=64, micro_batch=1)
    base = dict(model="deepseek-v3", world=64, batch=64, precision="fp8")
    limited = layer_costs(pb(**base, stack="deepseek-2024"), lay)["ep"]
    unlimited = layer_costs(pb(**base, stack="megatron-core-2024"), lay)["ep"]
    assert limited < unlimited


# ---- long context ------------------------------------------------------------------------------


def test_causal_attention_is_half_the_unfused_square():
    lay = Layout(dp_shard=8, micro_batch=1)
    flash = layer_costs(pb(seq=32768, batch=8), lay)
    short = layer_costs(pb(seq=4096, batch=64), lay)
    # attention per token grows with the sequence: the long layer costs more per token
    assert flash["compute"] / 32768 > short["compute"] / 4096


# ---- memory ------------------------------------------------------------------------------------


def test_fragmentation_constant_moves_memory():
    lay = Layout(dp_shard=8, micro_batch=1)
    p = pb()
    lo = Evaluator(p.with_constants({"fragmentation": 0.05}))(lay, check=False).memory["total"]
    hi = Evaluator(p.with_constants({"fragmentation": 0.20}))(lay, check=False).memory["total"]
    assert hi > lo


# ---- issue 30: power, HBM variants, launches, the loss, FSDP copies, long context, recompute ------


def test_power_limit_lowers_the_clock_of_compute_bound_kernels_only():
    from ndtrain.planner.gemm import clock_share

    full, capped = pb(), pb(power_w=500)
    assert clock_share(full) == 1.0 and clock_share(pb(power_w=700)) == 1.0  # at the TDP: as fitted
    share = clock_share(capped)
    # P = s TDP + (1 - s) TDP (f/f0)^n at the nominal s = 0.25, n = 2.5
    assert share == pytest.approx(((500 - 0.25 * 700) / (0.75 * 700)) ** (1 / 2.5))
    lo = clock_share(capped.with_constants({"static_power": 0.35, "power_exponent": 2.0}))
    hi = clock_share(capped.with_constants({"static_power": 0.15, "power_exponent": 3.0}))
    assert 0.7 < lo < share < hi < 0.9
    big = (8192, 8192, 8192)
    assert gemm_seconds(capped, *big) == pytest.approx(gemm_seconds(full, *big) / share)
    skinny = (4, 16384, 8192)  # bound by HBM: the clock does not matter
    assert gemm_seconds(capped, *skinny) == pytest.approx(gemm_seconds(full, *skinny))
    with pytest.raises(Exception, match="power-limit"):
        pb(power_w=100)


def test_hbm2e_variant_prices_memory_bound_work_at_its_bandwidth():
    lay = Layout(dp_shard=8, micro_batch=2)
    h80, h96 = pb(seq=8192, batch=16), pb(seq=8192, batch=16, gpu="h100-96")
    assert CATALOG["h100-96"].hbm_bw == 2.4e12 and CATALOG["h100-96"].peak_bf16 == H100.peak_bf16
    a = activation_bytes(h80.shape, h80.stack, 8192, 2)
    kappa = h80.k["kappa_eager"]
    # the GEMMs of this layer are compute-bound, so F differs by its elementwise third only
    extra = kappa * a / 3 * (1 / 2.4e12 - 1 / 3.35e12)
    assert layer_costs(h96, lay)["F"] - layer_costs(h80, lay)["F"] == pytest.approx(extra, rel=1e-6)
    assert Evaluator(h96)(lay, check=False).memory["total"] == Evaluator(h80)(lay, check=False).memory["total"]


def test_eager_launches_bound_small_layers_and_fused_kernels_launch_fewer():
    from ndtrain.planner.layer import OPS_EAGER, OPS_FUSED

    small = make_problem(preset("llama3-8b", dim=256, n_heads=4, n_kv_heads=4, ffn_dim=768, n_layers=4), 256, 8, 8,
                         "h100")
    lay = Layout(dp_shard=8, micro_batch=1)
    lc = layer_costs(small, lay)
    assert lc["launch"] > 0 and lc["F"] == pytest.approx(OPS_EAGER * small.k["launch_s"])
    fused = layer_costs(small, dataclasses.replace(lay, compile=True))
    assert fused["F"] == pytest.approx(OPS_FUSED * small.k["launch_s"])
    assert layer_costs(pb(seq=8192, batch=16), Layout(dp_shard=8, micro_batch=2))["launch"] == 0.0  # 8B: kernels are longer


def test_loss_over_a_128k_vocabulary_eager_and_fused():
    from ndtrain.planner.gemm import head_seconds
    from ndtrain.planner.layer import LOSS_BYTES_EAGER, LOSS_BYTES_FUSED, head_cost

    lay = Layout(dp_shard=8, micro_batch=2)
    eager, fused = pb(seq=8192, batch=16), pb(seq=8192, batch=16, stack="megatron-core-2024")
    logits = 2 * 8192 * 128256
    assert head_cost(eager, lay) - head_seconds(eager, lay) == pytest.approx(LOSS_BYTES_EAGER * logits / H100.hbm_bw)
    assert head_cost(fused, lay) - head_seconds(fused, lay) == pytest.approx(LOSS_BYTES_FUSED * logits / H100.hbm_bw)
    # its memory: the fp32 log-softmax kept, the dense NLL gradient and the log-softmax gradient
    # (fp32) live together in its backward (12 B/logit, as the dry run holds them)
    assert Evaluator(eager)(lay, check=False).memory["logits"] == pytest.approx(logits * 12)


def test_fsdp2_copies_cost_hbm_time_per_gather_and_reduce():
    from ndtrain.planner.stack import STACKS
    from ndtrain.planner.timing import fsdp_copy_seconds

    lay = Layout(dp_shard=8, zero=3, micro_batch=1)
    ours = pb(seq=8192, batch=16)
    flat = make_problem(preset("llama3-8b"), 8192, 16, 8, "h100", stack=dataclasses.replace(STACKS["ndtrain"],
                                                                                              fsdp_copies=False))
    from ndtrain.planner.memory import device_params, root_params

    params = 1e9
    # per micro-batch: a whole gather for the forward, the blocks but the last (31 of 32) for the
    # backward (the root, embedding and head, stays gathered), one reduce
    dense, _ = device_params(ours.shape, lay, 32, True, True)
    gathers = 1 + 31 / 32 * (1 - root_params(ours.shape, lay, True, True) / dense)
    per_mb = (gathers * 2 * 2 * params + (2 + 4) * params) / (H100.hbm_bw * ours.k["hbm_eff"])
    assert fsdp_copy_seconds(ours, lay, params, 2, 32) == pytest.approx(2 * per_mb)
    assert fsdp_copy_seconds(flat, lay, params, 2, 32) == 0.0
    diff = step_breakdown(ours, lay)["total"] - step_breakdown(flat, lay)["total"]
    assert diff > 0.01 * step_breakdown(flat, lay)["total"]


def test_fsdp_traffic_exposed_at_small_local_batch_hidden_at_large():
    lay = Layout(dp_shard=128, zero=3, micro_batch=1)
    small = step_breakdown(pb(seq=1024, batch=128, world=128), lay)
    large = step_breakdown(pb(seq=8192, batch=128, world=128), lay)
    assert small["comm"]["dp"] / small["total"] > 2 * large["comm"]["dp"] / large["total"]


def test_long_context_kernel_efficiency_and_ring_merges():
    from ndtrain.planner.gemm import attention_efficiency

    p = pb(seq=131072, batch=8, world=64)
    eff = [attention_efficiency(p, n) for n in (512, 2048, 8192, 131072)]
    assert eff == sorted(eff) and eff[0] < 0.6 * eff[-1] and eff[-1] < p.k["attn_eff"]
    lay = Layout(dp_shard=4, cp=16, micro_batch=1)
    ring = layer_costs(p, lay)
    gathered = layer_costs(p, dataclasses.replace(lay, cp_attention="allgather"))
    q = 131072 / 16 * p.shape.heads * p.shape.head_dim
    assert ring["cp_merge"] == pytest.approx(15 * (12 + 16) * q / H100.hbm_bw) and gathered["cp_merge"] == 0.0


def test_selective_recompute_as_each_stack_recomputes():
    lay = Layout(dp_shard=8, micro_batch=1, activation_checkpoint="selective")
    ours = pb(seq=8192, batch=16)
    a = activation_bytes(ours.shape, ours.stack, 8192, 1)
    # ndtrain's policy keeps every matmul and attention output: the whole forward elementwise work again
    assert layer_costs(ours, lay)["recompute"] == pytest.approx(ours.k["kappa_eager"] * a / H100.hbm_bw / 3)
    # Megatron's keeps all but the scores, which flash attention never stores: nothing to recompute
    assert layer_costs(pb(seq=8192, batch=16, stack="megatron-core-2024"), lay)["recompute"] == 0.0
    full = layer_costs(ours, dataclasses.replace(lay, activation_checkpoint="full"))
    assert full["recompute"] > 10 * layer_costs(ours, lay)["recompute"]
