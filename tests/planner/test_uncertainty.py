"""Constants with ranges, sampled worlds, intervals, robustness and the tie-break."""

import pytest

from ndtrain.model.config import preset
from ndtrain.planner import constants as C
from ndtrain.planner.problem import make_problem
from ndtrain.planner.search import search
from ndtrain.planner.uncertainty import assess, headroom, moving_parts


def test_every_constant_has_a_range_and_a_source():
    for c in C.CONSTANTS:
        assert c.low <= c.nominal <= c.high and c.low < c.high, c
        assert c.source and c.what, c
    for gen in C.GENERATIONS:
        assert set(C.TIME_CONSTANTS) <= set(C.entries(gen)), gen


def test_latin_hypercube_covers_each_range_once_per_stratum():
    base = C.resolve("hopper")
    bounds = C.ranges("hopper")
    n = 20
    worlds = C.latin_hypercube(base, bounds, n, seed=3)
    assert len(worlds) == n
    for name in ("gemm_eff", "overlap_eff", "kappa_fused"):
        lo, hi = bounds[name]
        strata = sorted(int((w[name] - lo) / (hi - lo) * n) for w in worlds)
        assert strata == list(range(n)), name
    assert all(w["fragmentation"] == base["fragmentation"] for w in worlds)  # memory is not sampled
    assert C.latin_hypercube(base, bounds, n, seed=3) == worlds  # seeded


def test_unknown_constant_override_is_an_error():
    with pytest.raises(Exception, match="unknown planner constant"):
        make_problem(preset("llama3-8b"), 4096, 64, 8, "h100", constants={"gemm_speed": 1.0})


def test_intervals_bracket_the_nominal_and_collapse_without_ranges(monkeypatch):
    pb = make_problem(preset("llama3-8b"), 8192, 128, 64, "h100")
    res = search(pb, top_k=4)
    rob = assess(pb, res, worlds=16)
    for c, times in zip(rob.candidates, rob.times):
        assert min(times) <= c.step_time <= max(times)
        lo, hi = rob.interval(c)
        assert lo < hi
    assert 0.0 <= rob.share <= 1.0
    monkeypatch.setattr(C, "ranges", lambda gen: {})  # every world is the nominal one
    flat = assess(pb, res, worlds=4)
    assert flat.chosen.layout == flat.nominal.layout and flat.share == 1.0 and not flat.overlapping
    assert flat.interval(flat.chosen) == pytest.approx((flat.chosen.step_time, flat.chosen.step_time))


@pytest.fixture(scope="module")
def llama3_405b_on_16384():
    """The 16,384-GPU Llama 3 405B problem and its top-8 search, shared: the search is the
    costliest step of these tests (several CPU-seconds on the slowest hosts) and is not mutated."""
    pb = make_problem(preset("llama3-405b"), 8192, 2048, 16384, "h100")
    return pb, search(pb, top_k=8)


def test_tie_break_prefers_fewer_moving_parts_among_overlapping(llama3_405b_on_16384):
    pb, res = llama3_405b_on_16384
    rob = assess(pb, res, worlds=32)
    chosen, nominal = rob.chosen, rob.nominal
    if chosen.layout != nominal.layout:  # a tie was broken: it must be for a reason
        assert chosen.layout in [c.layout for c, _ in rob.overlapping]
        assert (len(moving_parts(chosen)), -headroom(pb, chosen)) < (len(moving_parts(nominal)), -headroom(pb, nominal))
        assert "overlap" in rob.reason
    for c, faster in rob.overlapping:
        assert faster > 0.0  # overlapping means: faster than the nominal winner in some worlds


def test_cpu_ranks_get_no_sampled_worlds():
    pb = make_problem(preset("debug"), 64, 8, 2, "this-machine")
    assert assess(pb, search(pb, top_k=2), worlds=8) is None


def test_sampled_worlds_cost_a_tenth_of_the_search_at_16384_gpus(llama3_405b_on_16384, monkeypatch):
    """Uncertainty re-times the candidates in each sampled world instead of searching again: 32
    worlds of at most 16 candidates, each sized and timed once, a tenth of the search's own work
    (counted, not timed: CPU seconds differ several-fold between host kinds; the seconds are
    benchmarks/planner_speed.py's)."""
    import ndtrain.planner.search as search_module

    pb, res = llama3_405b_on_16384
    calls = {"memory_breakdown": 0, "step_breakdown": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    for name in calls:
        monkeypatch.setattr(search_module, name, counted(name, getattr(search_module, name)))
    rob = assess(pb, res, worlds=32)
    assert rob.worlds == 32 and 8 <= len(rob.candidates) <= 16
    # each candidate sized and timed once per world, and nothing else (no search: it sizes thousands)
    assert calls["memory_breakdown"] == calls["step_breakdown"] == 32 * len(rob.candidates)
    assert calls["memory_breakdown"] + calls["step_breakdown"] < (res.sized + res.evaluated) / 10, (calls, res.sized)


@pytest.mark.heavy
def test_sensitivity_reports_the_first_move_that_changes_the_plan():
    from ndtrain.planner.sensitivity import constants_read, first_change, scan, sensitivity

    pb = make_problem(preset("llama3-8b"), 8192, 128, 64, "h100")
    read = constants_read(pb)
    # the ndtrain stack's flash kernels are FlashAttention-2-class: attn_eff_fa2, not the generation's attn_eff
    assert {"gemm_eff", "attn_eff_fa2", "fragmentation", "overhead_gib"} <= read and "attn_eff" not in read
    assert not {"moe_imbalance", "fp8_gemm_eff", "fp8_cast_bytes"} & read  # a dense bf16 model
    rows = {r["constant"]: r for r in sensitivity(pb, names=["moe_imbalance", "fragmentation"])}
    assert not rows["moe_imbalance"]["used"] and "down" not in rows["moe_imbalance"]
    assert rows["fragmentation"]["used"]
    base = search(pb, top_k=1).top[0].layout
    # memory squeezed hard enough, the fastest layout no longer fits: a change that matters
    f, to = first_change(pb, "overhead_gib", (4.0, 16.0, 40.0), base)
    assert f is not None and to and to != base.short()
    r = scan(pb, "overhead_gib", (4.0, 16.0, 40.0), base)
    assert r["change"] == f and r["matters"] is not None and r["matters"] >= f
    # a move that changes nothing is reported as such
    r = scan(pb, "overhead_gib", (1.0,), base)
    assert r["change"] is None and r["matters"] is None


def test_model_error_folds_published_misses_into_the_interval():
    """Issue 30, item 4: the interval carries the model's own error (validation residuals of the
    plan's stack and generation), leave-one-out for a published row itself."""
    from ndtrain.planner import model_error as M

    errs, group = M.residuals("megatron-core-2024", "hopper")
    assert group == "megatron-core-2024/hopper" and len(errs) >= M.MIN_GROUP
    first = next(r[0] for r in M.RESIDUALS if r[1] == "megatron-core-2024")
    assert len(M.residuals("megatron-core-2024", "hopper", exclude=first)[0]) == len(errs) - 1
    assert M.residuals("ndtrain", "hopper")[1] == "hopper"  # no published ndtrain run: its generation's
    names = {r[0] for r in M.RESIDUALS}
    from ndtrain.planner.published import rows

    assert names == {r.name for r in rows("validation")}  # validation rows only, never the fitted ones
    import math

    # three residuals: the conformal quantiles are their extremes; twenty: inside them
    assert M.interval(1.0, [-0.2, 0.0, 0.3]) == pytest.approx((math.exp(-0.2), math.exp(0.3)))
    many = [i / 100 for i in range(-10, 10)]
    lo, hi = M.interval(2.0, many)
    assert 2.0 * math.exp(-0.10) < lo < 2.0 * math.exp(M.quantile(many, 0.1))
    assert hi > 2.0 * math.exp(M.quantile(many, 0.9))
    assert M.interval(2.0, [], [1.0, 3.0]) == pytest.approx((1.2, 2.8))  # no residuals: the constants' interval
    pb = make_problem(preset("llama3-8b"), 8192, 128, 64, "h100", stack="megatron-core-2024")
    rob = assess(pb, search(pb, top_k=2), worlds=8)
    c = rob.chosen
    assert rob.model_interval(c) == pytest.approx(M.interval(c.step_time, errs))
    assert rob.error_group == "megatron-core-2024/hopper"
