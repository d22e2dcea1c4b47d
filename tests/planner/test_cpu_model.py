"""The "this-machine" (CPU ranks) parts of the time model: ranks sharing cores, comm that cannot
hide without a spare core, measured attention, host and TP costs, per-world collective fits.
None of them may move an accelerator's prediction."""

import dataclasses
import json

import pytest

from ndtrain.model.config import num_params, preset
from ndtrain.planner.api import predict
from ndtrain.planner.hardware import CATALOG, this_machine
from ndtrain.layout import Layout
from ndtrain.planner.problem import make_problem
from ndtrain.planner.timing import step_breakdown

FIT = {"alpha": 1e-4, "beta": 1e9}


def _profile(tmp_path, **extra):
    prof = {
        "cores": 2, "devices_per_node": 8, "matmul": {"fp32_1thread": 1e11}, "memory": {"total_bytes": 64 * 2**30, "copy_bw": 2e10},
        "collectives": {k: {**FIT, "by_world": {"2": FIT, "4": {"alpha": 1e-3, "beta": 5e8}}}
                        for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")},
        "op_overhead_s": 1e-5, **extra,
    }
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(prof))
    return this_machine(path)


def test_accelerators_carry_no_cpu_terms():
    for hw in CATALOG.values():
        assert hw.cores == 0 and not hw.attn_flops and not hw.tp_host and not hw.collectives_by_world
        assert hw.for_world(64) is hw


def test_ranks_beyond_the_cores_share_them(tmp_path):
    hw = _profile(tmp_path)
    cfg = preset("tiny", vocab_size=256)
    lay = Layout(dp_shard=4, micro_batch=2)
    shared = step_breakdown(make_problem(cfg, 256, 8, 4, hw, precision="fp32"), lay)
    alone = step_breakdown(make_problem(cfg, 256, 8, 4, dataclasses.replace(hw, cores=4), precision="fp32"), lay)
    assert shared["compute"] == pytest.approx(2 * alone["compute"])
    assert shared["optimizer"] == pytest.approx(2 * alone["optimizer"])
    for t in (shared, alone):
        assert t["total"] == pytest.approx(t["compute"] + t["exposed_comm"] + t["bubble"] + t["optimizer"])
    # a pipeline's idle ranks lend their cores: the bubble shrinks, the step never beats the critical path
    pp = Layout(dp_shard=1, pp=4, micro_batch=2)
    pb = make_problem(cfg, 256, 8, 4, hw, precision="fp32")
    full_speed = step_breakdown(make_problem(cfg, 256, 8, 4, dataclasses.replace(hw, cores=4), precision="fp32"), pp)
    t = step_breakdown(pb, pp)
    assert full_speed["total"] <= t["total"] < full_speed["total"] + full_speed["compute"] + full_speed["optimizer"]
    # fill and drain with a fraction of the ranks busy: the bubble shrinks by the ranks per core
    assert t["bubble"] == pytest.approx(full_speed["bubble"] / 2)


def test_dp_comm_hides_only_with_a_spare_core(tmp_path):
    hw = _profile(tmp_path)
    cfg = preset("tiny", vocab_size=256)
    lay = Layout(dp_replicate=2, dp_shard=1, micro_batch=2)
    busy = step_breakdown(make_problem(cfg, 256, 8, 2, hw, precision="fp32"), lay)
    spare = step_breakdown(make_problem(cfg, 256, 8, 2, dataclasses.replace(hw, cores=4), precision="fp32"), lay)
    assert busy["comm"]["dp"] > spare["comm"]["dp"]


def test_cpu_ranks_pay_one_collective_per_fsdp_unit(tmp_path):
    from ndtrain.planner.comm import collective_time

    hw = _profile(tmp_path)
    cfg = preset("tiny", vocab_size=256)
    pb = make_problem(cfg, 256, 8, 2, hw, precision="fp32")
    t = step_breakdown(pb, Layout(dp_shard=2, micro_batch=2))  # 2 micro-batches, 8 layers + the root
    params = num_params(cfg)
    one = lambda kind: 9 * collective_time(pb.hw, kind, 2, 1, 4 * params / 9)  # noqa: E731
    # ZeRO-3: everything gathered in every forward, every block but the last again in every
    # backward (the root and the last block stay gathered), a reduce-scatter after every micro-batch
    from ndtrain.planner.memory import root_params

    blocks = 1 - root_params(pb.shape, Layout(dp_shard=2), True, True) / params
    gathers = 2 * (1 + 7 / 8 * blocks)
    assert 2 < gathers < 4
    assert t["comm"]["dp"] == pytest.approx(gathers * one("all_gather") + 2 * one("reduce_scatter"), rel=1e-6)
    # ZeRO-1: parameters gathered once (the step's first forward), gradients reduced once
    t1 = step_breakdown(pb, Layout(dp_shard=2, micro_batch=2, zero=1, reshard_after_forward=False))
    assert t1["comm"]["dp"] == pytest.approx(one("all_gather") + one("reduce_scatter"), rel=1e-6)
    # ZeRO-2: as ZeRO-1, but a reduce-scatter after every micro-batch
    t2 = step_breakdown(pb, Layout(dp_shard=2, micro_batch=2, zero=2, reshard_after_forward=False))
    assert t2["comm"]["dp"] == pytest.approx(one("all_gather") + 2 * one("reduce_scatter"), rel=1e-6)


def test_collective_fits_follow_the_rank_count(tmp_path):
    hw = _profile(tmp_path)
    assert hw.for_world(2).collectives["all_gather"] == FIT
    assert hw.for_world(3).collectives["all_gather"]["alpha"] == 1e-3  # nearest measured at or above
    assert hw.for_world(16).collectives["all_gather"]["alpha"] == 1e-3  # else the largest
    assert make_problem(preset("debug"), 64, 8, 4, hw, precision="fp32").hw.collectives["p2p"]["beta"] == 5e8


def test_measured_attention_host_and_optimizer_costs_are_used(tmp_path):
    base = _profile(tmp_path)
    hw = _profile(tmp_path, attention={"fp32": {"256": 2e10, "1024": 4e10}}, host_s={"layer": 1e-3, "head": 2e-3},
                  optimizer_s_per_param=1e-8)
    assert hw.attention_rate("fp32", 128) == 2e10 and hw.attention_rate("fp32", 4096) == 4e10
    assert hw.attention_rate("fp32", 512) == pytest.approx(3e10)  # halfway in log(seq)
    assert hw.attention_rate("bf16", 512) == hw.peak("bf16")  # not measured: the matmul rate
    cfg = preset("tiny", vocab_size=256)
    slow, fast = (predict(cfg, {"dp_shard": 1, "micro_batch": 2}, 256, 8, h, world=1, precision="fp32") for h in (hw, base))
    assert slow.time["compute"] > fast.time["compute"]
    assert slow.time["optimizer"] == pytest.approx(1e-8 * 6.4e6, rel=0.05)


def test_measured_tp_cost_replaces_the_collective_model(tmp_path):
    fit = {"layer": {"alpha": 1e-2, "per_byte": 1e-8}, "head": {"alpha": 5e-2, "per_byte": 0.0}}
    hw = _profile(tmp_path, tp_host={"2": {"2": fit}, "4": {"2": fit, "4": fit}})
    assert hw.tp_cost(2, 2, "layer", 1e6) == pytest.approx(2e-2)
    assert hw.tp_cost(8, 8, "head", 0) == 5e-2  # largest measured world, nearest degree
    cfg = preset("tiny", vocab_size=256)
    p = predict(cfg, {"dp_shard": 1, "tp": 2, "micro_batch": 2}, 256, 8, hw, world=2, precision="fp32")
    act = 2 * 256 * 256 * 4
    per_mb = 8 * (1e-2 + 1e-8 * act) + 5e-2
    assert p.time["comm"]["tp"] == pytest.approx(4 * per_mb)  # 4 micro-batches


def test_unmeasured_cpu_terms_take_this_hosts_figures(tmp_path):
    """Where calibration measured nothing: the reduce-scatter costs an all-to-all (the runtime runs
    it as one on Gloo: parallel/gloo_reduce_scatter.py), TP pays the DTensor host cost measured here, and pipelines pay per stage action."""
    from ndtrain.planner.comm import collective_time
    from ndtrain.planner.hardware import UNMEASURED_PP_ACTION_S, UNMEASURED_TP_HOST

    hw = _bare(tmp_path)
    for k, n in ((2, 1e6), (4, 3e7)):
        assert collective_time(hw, "reduce_scatter", k, 1, n) == pytest.approx(collective_time(hw, "all_to_all", k, 1, n))
        assert collective_time(hw, "reduce_scatter", k, 1, n) < collective_time(hw, "all_reduce", k, 1, n)
    assert hw.tp_host == UNMEASURED_TP_HOST and hw.pp_action_s == UNMEASURED_PP_ACTION_S > 0
    # torch's DDP reducer (fp32 plain replication) leaves part of its all-reduce exposed, the share
    # fitted on this host, where FSDP2's replication blocks on all of it
    ddp, blocking = collective_time(hw, "all_reduce_ddp", 2, 1, 25e6), collective_time(hw, "all_reduce", 2, 1, 25e6)
    assert 0.4 * blocking < ddp < 0.6 * blocking
    measured = _profile(tmp_path)  # its own reduce-scatter fit stands
    assert collective_time(measured, "reduce_scatter", 2, 1, 1e6) < collective_time(measured, "all_reduce", 2, 1, 1e6)


def _bare(tmp_path):
    path = tmp_path / "bare.json"
    path.write_text(json.dumps({"cores": 2, "devices_per_node": 8}))
    return this_machine(path)


def test_pipeline_actions_cost_cpu_ranks_not_gpus(tmp_path):
    """Each extra virtual stage and a split backward add stage actions: on CPU ranks they cost
    host time (without it the planner chose an interleaved pipeline over a faster DDP here)."""
    cfg = preset("tiny", vocab_size=256)

    def pp_comm(hw, schedule, v):
        lay = {"dp_shard": 1, "pp": 2, "pp_schedule": schedule, "pp_virtual_stages": v, "micro_batch": 2}
        return predict(cfg, lay, 256, 8, hw, world=2, precision="fp32" if hw.generation == "cpu" else "bf16").time["comm"]["pp"]

    cpu = _bare(tmp_path)
    base = dataclasses.replace(cpu, pp_action_s=0.0)
    m = 4  # micro-batches per step
    assert pp_comm(cpu, "1F1B", 1) - pp_comm(base, "1F1B", 1) == pytest.approx(m * 2 * cpu.pp_action_s)
    assert pp_comm(cpu, "InterleavedZeroBubble", 3) - pp_comm(base, "InterleavedZeroBubble", 3) == \
        pytest.approx(m * 3 * 3 * cpu.pp_action_s)
    gpu = CATALOG["h100"]
    assert pp_comm(gpu, "1F1B", 1) == pp_comm(dataclasses.replace(gpu, pp_action_s=1.0), "1F1B", 1)


def _probed(tmp_path, monkeypatch, fp32: float, bf16: float, block: float):
    """this_machine() on a host with no calibration profile and a cached probe of these rates."""
    from ndtrain.planner import hardware, host_cache

    monkeypatch.setattr(hardware, "DEFAULT_PROFILE", tmp_path / "hardware.json")
    rates = {"fp32": fp32, "fp32_blas": fp32, "fp32_onednn": fp32, "bf16": bf16, "block_bf16_speedup": block,
             **{f"attn_{k}_d{d}": 2e10 for k in ("fp32", "bf16_native", "bf16_in_fp32") for d in (32, 128)}}
    decisions = {"cpu_matmul": "blas", "bf16_attention": {"32": "fp32", "128": "fp32"}}
    host_cache.write({"key": host_cache.host_key(), "rates": rates, "decisions": decisions, "attention_seq": 256},
                     tmp_path)
    return this_machine()


def test_an_uncalibrated_host_is_priced_from_its_probe(tmp_path, monkeypatch):
    """Issue 29: the uncalibrated defaults (20 GFLOP/s fp32, bf16 a quarter of it) predicted
    4.640 s/step for `make train` where an AMX host measured 0.894. With the probe cached, its
    rates price the compute, and bf16's GEMMs reach what its whole block measured over fp32."""
    cfg = preset("tiny", vocab_size=256)
    lay = {"dp_replicate": 2, "dp_shard": 1, "micro_batch": 8}
    slow = _probed(tmp_path, monkeypatch, 70e9, 150e9, 1.5)
    assert (slow.peak("fp32"), slow.peak("bf16"), slow.calibrated) == (70e9, 150e9, False)
    assert slow.cpu_mm_eff("bf16") == pytest.approx(1.5 / (150 / 70))  # the block's speed-up, not the matmul's
    fast = _probed(tmp_path, monkeypatch, 140e9, 300e9, 1.5)
    t = [predict(cfg, lay, 256, 16, h, world=2, precision="fp32").time for h in (slow, fast)]
    # twice the matmul rate: the GEMMs' time halves, attention (same rate) and host costs do not
    assert t[0]["compute"] / 2 < t[1]["compute"] < 0.8 * t[0]["compute"]
    # the precision rule's input: bf16 over fp32 predicted from the block's speed-up (1.5x here)
    # stays under it (matmuls are most, not all, of a step); an AMX host's 10x matmuls do not
    def bf16_speedup(hw):
        return (predict(cfg, lay, 256, 16, hw, world=2, precision="fp32").step_time
                / predict(cfg, lay, 256, 16, hw, world=2, precision="bf16").step_time)
    assert bf16_speedup(slow) < 1.5
    assert bf16_speedup(_probed(tmp_path, monkeypatch, 140e9, 1452e9, 4.0)) > 1.5
