"""Checkpoint intervals (Young, Daly), expected goodput and its Monte-Carlo check."""

import pytest

from ndtrain.planner.goodput import daly_interval, expected_efficiency, goodput_report, simulate, young_interval

MIN = 60.0


@pytest.mark.parametrize("mtbf_min, young, daly", [(24 * 60, 120.0, 117.0), (6 * 60, 60.0, 57.0), (15, 12.25, 9.1)])
def test_young_and_daly_for_a_five_minute_checkpoint(mtbf_min, young, daly):
    c, m = 5 * MIN, mtbf_min * MIN
    assert young_interval(c, m) / MIN == pytest.approx(young, rel=1e-3)
    assert daly_interval(c, m) / MIN == pytest.approx(daly, abs=0.35)


def test_daly_degenerates_to_mtbf_when_checkpoints_are_slow():
    assert daly_interval(10.0, 4.0) == 4.0


def test_simulation_matches_the_closed_form():
    c, r, m = 5 * MIN, 10 * MIN, 6 * 3600.0
    tau = daly_interval(c, m)
    sim = simulate(tau, c, r, m, work=40 * 86400, trials=30, seed=1)
    exp = expected_efficiency(tau, c, r, m)
    assert sim["efficiency"] == pytest.approx(exp, abs=4 * sim["stderr"] + 0.003)


def test_daly_interval_is_near_the_simulated_optimum():
    c, r, m = 5 * MIN, 5 * MIN, 2 * 3600.0
    tau = daly_interval(c, m)
    best = simulate(tau, c, r, m, work=20 * 86400, trials=20, seed=2)["efficiency"]
    for factor in (0.4, 2.5):
        worse = simulate(tau * factor, c, r, m, work=20 * 86400, trials=20, seed=2)["efficiency"]
        assert worse < best


def test_llama3_anchor():
    # 419 unexpected interruptions in 54 days on 16,384 GPUs: per-GPU MTBF ~ 50,700 GPU-hours.
    mtbf_gpu_h = 54 * 24 / 419 * 16384
    rep = goodput_report(16384, mtbf_gpu_h, ckpt=30.0, restart=3 * MIN, work_days=10, trials=5)
    assert rep["failures_per_day"] == pytest.approx(419 / 54, rel=1e-6)
    daly = next(r for r in rep["rows"] if r["name"] == "daly")
    assert daly["expected"] > 0.9  # >90% effective training time needs fast saves and restarts
