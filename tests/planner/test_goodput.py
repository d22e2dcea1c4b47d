"""Checkpoint intervals (Young, Daly), expected goodput and its Monte-Carlo check."""

import pytest

from ndtrain.planner.goodput import (daly_interval, expected_efficiency, goodput_report, simulate_failures,
                                    young_interval)

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
    sim = simulate_failures(tau, c, r, m, work=40 * 86400, trials=30, seed=1)
    exp = expected_efficiency(tau, c, r, m)
    assert sim["efficiency"] == pytest.approx(exp, abs=4 * sim["stderr"] + 0.003)


def test_daly_interval_is_near_the_simulated_optimum():
    c, r, m = 5 * MIN, 5 * MIN, 2 * 3600.0
    tau = daly_interval(c, m)
    best = simulate_failures(tau, c, r, m, work=20 * 86400, trials=20, seed=2)["efficiency"]
    for factor in (0.4, 2.5):
        worse = simulate_failures(tau * factor, c, r, m, work=20 * 86400, trials=20, seed=2)["efficiency"]
        assert worse < best


def test_llama3_anchor():
    # 419 unexpected interruptions in 54 days on 16,384 GPUs: per-GPU MTBF ~ 50,700 GPU-hours.
    mtbf_gpu_h = 54 * 24 / 419 * 16384
    rep = goodput_report(16384, mtbf_gpu_h, ckpt=30.0, restart=3 * MIN, work_days=10, trials=5)
    assert rep["failures_per_day"] == pytest.approx(419 / 54, rel=1e-6)
    daly = next(r for r in rep["rows"] if r["name"] == "daly")
    assert daly["expected"] > 0.9  # >90% effective training time needs fast saves and restarts


def test_pricing_an_exclusion_over_the_job_without_failures_is_known_by_hand():
    from ndtrain.planner.goodput import exclusion, price_exclusion

    day = 86400.0
    # Failures so rare that none is drawn and Daly's interval outlasts the job: the interval model
    # and the simulator both reduce to compute time / speed.
    never = dict(gpus=8, mtbf_gpu_hours=1e12, ckpt=60.0, restart=0.0, work_days=1.0, trials=5)
    j = price_exclusion(exclusion(0.3, 8, 36.0), **never)  # 30% slow of 8: excluding wins
    assert j["keep_wall_s"] == pytest.approx(1.3 * day, rel=1e-5)
    assert j["exclude_wall_s"] == pytest.approx(36.0 + day * 8 / 7, rel=1e-5)
    assert j["saved_s"] == pytest.approx(day * (1.3 - 8 / 7) - 36.0, rel=1e-4)
    assert j["keep_simulated"]["wall"] == pytest.approx(1.3 * day) and j["keep_simulated"]["stderr"] < 1e-6
    assert j["exclude_simulated"]["wall"] == pytest.approx(36.0 + day * 8 / 7)
    # 600 s of detection at the slow pace first: that much less work is left for the smaller world.
    j = price_exclusion(exclusion(0.3, 8, 36.0, detect_s=600.0), **never)
    assert j["exclude_wall_s"] == pytest.approx(600.0 + 36.0 + (day - 600.0 / 1.3) * 8 / 7, rel=1e-5)
    # 10% slow of 8 costs less than losing one host in eight: keeping it wins, by this much.
    j = price_exclusion(exclusion(0.1, 8, 36.0), **never)
    assert j["saved_s"] == pytest.approx(day * (1.1 - 8 / 7) - 36.0, rel=1e-4) and j["saved_s"] < 0


def test_exclusion_breakeven_counts_the_detection_at_the_slow_pace():
    from ndtrain.planner.goodput import exclusion

    x = exclusion(0.3, 8, 36.0, detect_s=600.0)
    t = x["breakeven_s"]  # from the host's turn: the same work either way by then
    assert t / 1.3 == pytest.approx(600.0 / 1.3 + (t - 600.0 - 36.0) * 0.875)


def test_priced_exclusion_under_failures_matches_its_simulation():
    from ndtrain.planner.goodput import exclusion, price_exclusion

    # 64 GPUs, a job MTBF of 6 h; excluding one host of 8 also makes failures rarer (56 GPUs).
    j = price_exclusion(exclusion(0.3, 8, 5 * MIN, detect_s=10 * MIN), gpus=64, mtbf_gpu_hours=6 * 64, ckpt=2 * MIN,
                        restart=5 * MIN, work_days=3.0, trials=30, seed=3)
    for side in ("keep", "exclude"):
        sim = j[f"{side}_simulated"]
        assert sim["wall"] == pytest.approx(j[f"{side}_wall_s"], abs=4 * sim["stderr"] + 0.003 * sim["wall"]), side
    assert j["saved_s"] > 0
