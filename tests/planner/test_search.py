"""Search, single-layout evaluation, auto_layout and predict_step_time."""

import pytest

from ndtrain.errors import NdtrainError
from ndtrain.model.config import preset
from ndtrain.planner.api import auto_layout, predict, predict_step_time
from ndtrain.layout import Layout, parse_layout, problems
from ndtrain.planner.problem import make_problem
from ndtrain.planner.search import Evaluator, search
from ndtrain.planner.shapes import parse_model_shape, shape_of


def _count_calls(monkeypatch, module, names: tuple[str, ...]) -> dict[str, int]:
    """Count the calls `module` makes to its imported functions `names` (the work it does)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(module, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_search_over_16384_gpus_prunes_what_cannot_win(monkeypatch):
    """The search's speed is the work it skips, counted here rather than timed (CPU seconds differ
    several-fold between host kinds; benchmarks/planner_speed.py measures them). Of ~270,000
    layouts, the dominance rules size under a tenth, the lower bound spares full step timing for
    over half of those that fit, and per-layer costs are computed once per distinct shape."""
    import ndtrain.planner.search as search_module

    calls = _count_calls(monkeypatch, search_module, ("memory_breakdown", "step_breakdown", "busy_and_bubble",
                                                       "layer_costs"))
    pb = make_problem(preset("llama3-405b"), 8192, 2048, 16384, "h100")
    res = search(pb, top_k=3)
    # the result's counters are the calls the search made
    assert (res.sized, res.evaluated, res.bounded) == \
        (calls["memory_breakdown"], calls["step_breakdown"], calls["busy_and_bubble"])
    assert res.considered > 100_000
    assert res.sized < res.considered / 10, (res.sized, res.considered)
    assert res.evaluated < res.fitting / 2, (res.evaluated, res.fitting)
    assert res.bounded < res.considered / 4, (res.bounded, res.considered)
    assert calls["layer_costs"] < res.sized / 20, (calls["layer_costs"], res.sized)
    assert len(res.top) == 3 and all(p.fits for p in res.top)
    assert res.top[0].step_time <= res.top[1].step_time <= res.top[2].step_time
    # Meta's layout is feasible and slower than (or as fast as) the winner
    meta = search(pb, top_k=1, fixed=dict(tp=8, cp=1, pp=16, dp_shard=128, dp_replicate=1)).top[0]
    assert meta.fits and meta.step_time >= res.top[0].step_time
    assert 0.3 < meta.mfu < 0.5


def test_moe_search_uses_expert_parallelism():
    pb = make_problem(preset("mixtral-8x7b"), 4096, 256, 64, "h800")
    res = search(pb, top_k=1)
    assert res.top and res.top[0].layout.ep > 1


def test_parse_layout_and_errors():
    lay = parse_layout("tp=8,pp=16,micro_batch=1,activation_checkpoint=full,pp_schedule=interleaved1f1b,pp_virtual_stages=2", 16384)
    assert (lay.dp_shard, lay.tp, lay.pp, lay.pp_virtual_stages, lay.pp_schedule) == (128, 8, 16, 2, "Interleaved1F1B")
    assert parse_layout("pp=4,pp_schedule=ZBVZeroBubble", 8).pp_virtual_stages == 2
    with pytest.raises(NdtrainError, match="unknown key"):
        parse_layout("tp=8,foo=1", 8)
    with pytest.raises(NdtrainError, match="not divisible"):
        parse_layout("tp=3", 8)
    cfg = preset("llama3-8b")
    assert "kv-heads" in problems(Layout(dp_shard=1, tp=16), cfg, 16, 4096, 16)[0]
    assert "micro-batches" in problems(Layout(dp_shard=1, pp=8, pp_schedule="1F1B"), cfg, 8, 4096, 4)[0]
    assert not problems(Layout(dp_shard=1, pp=3), cfg, 3, 4096, 3)  # uneven stages: the runtime builds them


def test_layout_that_does_not_fit_is_reported_not_dropped():
    pb = make_problem(preset("llama3-70b"), 8192, 64, 8, "h100")
    pred = Evaluator(pb)(Layout(dp_replicate=8, dp_shard=1, micro_batch=1))
    assert not pred.fits and pred.memory["total"] > 80 * 2**30


def test_model_shape_gpt_and_moe():
    gpt = parse_model_shape("layers=24,hidden=2304,heads=24,mlp=gelu,vocab=51200")
    assert (gpt.ffn_dim, gpt.n_kv_heads, gpt.mlp) == (4 * 2304, 24, "gelu")
    moe = parse_model_shape("layers=8,hidden=1024,heads=16,kv_heads=4,ffn=4096,experts=16,active_experts=2,"
                            "shared_experts=1,expert_ffn=512,dense_layers=1")
    assert moe.is_moe and moe.n_experts == 16
    with pytest.raises(NdtrainError):
        parse_model_shape("layers=8,hidden=1000,heads=3")
    with pytest.raises(NdtrainError, match="bad item"):
        parse_model_shape("layers=8,colour=red")


def test_auto_layout_contract():
    cfg = preset("debug")
    out = auto_layout(cfg, 4, 64, 16, (1, 2, 4, 8), "h100")
    for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "micro_batch", "activation_checkpoint", "predicted_step_time"):
        assert key in out
    assert out["dp_replicate"] * out["dp_shard"] * out["tp"] * out["cp"] * out["pp"] == 4
    assert not problems(out["layout"], cfg, 4, 64, 16)  # the one validity check accepts it
    assert 16 % (out["dp_replicate"] * out["dp_shard"] * out["micro_batch"]) == 0
    assert out["predicted_step_time"] > 0
    # on this machine without a profile: conservative defaults, fp32
    local = auto_layout(cfg, 2, 64, 8, (1, 2), None)
    assert local["hardware"] == "this-machine" and local["micro_batch"] in (1, 2)
    with pytest.raises(NdtrainError, match="no layout"):
        auto_layout(preset("llama3-405b"), 8, 8192, 8, (1,), "a100-40")


def test_predict_step_time_accepts_runtime_keys():
    cfg = preset("debug")
    layout = {"dp_shard": 2, "tp": 2, "micro_batch": 2, "activation_checkpoint": "full", "sequence_parallel": True}
    t = predict_step_time(cfg, layout, 64, 8, "this-machine")
    p = predict(cfg, layout, 64, 8, "this-machine")
    assert t == p.step_time > 0 and p.layout.activation_checkpoint == "full"
    assert p.time["total"] == pytest.approx(p.time["compute"] + p.time["exposed_comm"] + p.time["bubble"]
                                            + p.time["optimizer"])
    assert predict_step_time(cfg, "pp=2,micro_batch=1", 64, 8, "h100", world=4) > 0


def test_predict_accepts_a_whole_parallel_config():
    import dataclasses

    from ndtrain.config import ParallelConfig

    d = dataclasses.asdict(ParallelConfig(dp_shard=2, tp=2))
    d["micro_batch"] = 2
    p = predict(preset("debug"), d, 64, 8, "this-machine")
    assert (p.layout.dp_shard, p.layout.tp, p.layout.micro_batch) == (2, 2, 2)


def test_pruned_search_finds_the_exhaustive_optimum():
    """Dominance rules and the bound must never drop the best layout: compare with brute force,
    which sizes and times every valid layout; the search does a small part of that work."""
    from ndtrain.layout.schedules import NAMES as SCHEDULES
    from ndtrain.planner.search import divisors
    from ndtrain.planner.stack import PLANNED_AC as AC_POLICIES

    pb = make_problem(preset("llama3-8b"), 4096, 32, 8, "a100-40")
    ev = Evaluator(pb)
    best = None
    W = 8
    for t in (1, 2, 4, 8):
        for c in divisors(W // t):
            for p in divisors(W // (t * c)):
                dp = W // (t * c * p)
                for ds in divisors(dp):
                    for z in (1, 2, 3):
                        for mb in (1, 2, 4, 8):
                            for sched in SCHEDULES:
                                for v in range(1, 9):
                                    for ac in AC_POLICIES:
                                        lay = Layout(dp_replicate=dp // ds, dp_shard=ds, tp=t, cp=c, pp=p, zero=z,
                                                     reshard_after_forward=z == 3, micro_batch=mb, pp_virtual_stages=v, activation_checkpoint=ac, sequence_parallel=t > 1,
                                                     pp_schedule=sched)
                                        if pb.why_invalid(lay) or (p == 1 and sched != "1F1B"):
                                            continue
                                        if c > 1 and 4096 // c < 256:
                                            continue
                                        pred = ev(lay, check=False)
                                        if pred.fits and (best is None or pred.step_time < best.step_time):
                                            best = pred
    res = search(pb, top_k=3)
    assert res.top[0].step_time == pytest.approx(best.step_time, rel=1e-12)
    assert 5 * res.sized < ev.sized and 5 * res.evaluated < ev.evaluated, (res.sized, res.evaluated, ev.sized)


def test_search_prices_the_pinned_fp32_matmul_precision():
    """A search (plan --fix, [parallel] auto) prices the fp32 matmul precision it is asked for; it
    used to ignore the knob and always price TF32, and its per-layer cache would have reused one
    setting's costs for the other."""
    pb = make_problem(preset("llama3-8b"), 4096, 64, 8, "h100", precision="fp32")
    fix = dict(tp=1, cp=1, pp=1, dp_shard=8, dp_replicate=1, zero=3, micro_batch=1, activation_checkpoint="full")
    tf32 = search(pb, top_k=1, fixed={**fix, "fp32_matmul_precision": "tf32"}).top[0]
    ieee = search(pb, top_k=1, fixed={**fix, "fp32_matmul_precision": "ieee"}).top[0]
    assert (tf32.layout.fp32_matmul_precision, ieee.layout.fp32_matmul_precision) == ("tf32", "ieee")
    assert ieee.step_time > 3 * tf32.step_time  # 494.5 vs 67 TFLOP/s dense on an H100 SXM
    base = Layout(fp32_matmul_precision="ieee")  # a config's setting reaches the search through base
    assert search(pb, top_k=1, fixed=fix, base=base).top[0].step_time == pytest.approx(ieee.step_time)
