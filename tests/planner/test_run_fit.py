"""planner/run_fit.py: a profile's groups scaled in the profile itself, and the fit of those
scales to measured steps (`ndtrain calibrate --from-run`). In-process and torch-free: the
runs here are priced by the time model under a hidden profile; tests/tools/test_calibrate_from_run.py
fits real runs."""

import math

import pytest

from ndtrain.layout import parse_layout
from ndtrain.model.config import preset
from ndtrain.planner import run_fit
from ndtrain.planner.hardware import COLLECTIVES, from_profile, host_probe
from ndtrain.planner.host_cache import as_profile

CFG = preset("tiny", vocab_size=256)
LAYOUTS = {"ddp": "dp_replicate=2,dp_shard=1,micro_batch=4", "zero3": "dp_shard=2,zero=3,micro_batch=4",
           "tp2": "dp_shard=1,tp=2,micro_batch=4", "pp2": "dp_shard=1,pp=2,micro_batch=2", "zero1": "dp_shard=2,zero=1,micro_batch=8"}
FIT = {"alpha": 2e-4, "beta": 0.8e9}
# A calibrated profile (what `ndtrain calibrate` writes, abridged): measured fits, host times, in-situ DP
CALIBRATED = {
    "cores": 2, "devices_per_node": 8, "matmul": {"fp32_1thread": 6e10, "bf16_1thread": 1.2e11},
    "memory": {"total_bytes": 64 * 2**30, "copy_bw": 1e10}, "attention": {"fp32": {"256": 1.2e10}},
    "collectives": {k: {**FIT, "by_world": {"2": FIT}} for k in COLLECTIVES},
    "host_s": {"layer": 2e-3, "head": 3e-3}, "op_overhead_s": 2e-5, "optimizer_s_per_param": 4e-9,
    "dp_in_situ": {"2": {"all_gather": {"alpha": 5e-4, "beta": 4e8}, "all_reduce_ddp": {"alpha": 1e-4, "beta": 1e9},
                         "measured": {"zero3": [0.1]}}},
}


def _bases():
    return {"host probe": as_profile(host_probe()), "calibrated": CALIBRATED, "defaults": {}}


def _obs(name: str, step_s: float = 1.0, peak: float | None = None) -> run_fit.Observation:
    return run_fit.Observation(label=name, cfg=CFG, layout=parse_layout(LAYOUTS[name], 2), seq=128, global_batch=8,
                               world=2, precision="fp32", step_s=step_s, peak_bytes=peak)


def _step(profile: dict, name: str) -> float:
    return run_fit.predict_run(run_fit.hardware(profile), _obs(name)).step_time


@pytest.mark.parametrize("base", ["host probe", "calibrated", "defaults"])
def test_unscaled_profile_prices_every_layout_as_its_base(base):
    # Writing the defaults out must not move a prediction: the fitted profile differs only by its knobs.
    data = _bases()[base]
    same = run_fit.scaled(data, {})
    for name in LAYOUTS:
        assert _step(same, name) == pytest.approx(_step(data, name), rel=1e-9), name


def test_each_knob_scales_its_own_terms():
    from ndtrain.planner.problem import make_problem
    from ndtrain.planner.timing import step_breakdown

    def parts(knobs, name):
        hw = run_fit.hardware(run_fit.scaled(CALIBRATED, knobs))
        return step_breakdown(make_problem(CFG, 128, 8, 2, hw, precision="fp32", strict=False),
                              parse_layout(LAYOUTS[name], 2))

    one = parts({}, "zero3")
    comm = parts({"comm": 3.0}, "zero3")
    assert comm["comm"]["dp"] == pytest.approx(3 * one["comm"]["dp"], rel=1e-6)
    assert comm["compute"] == pytest.approx(one["compute"])
    overhead = parts({"overhead": 2.0}, "zero3")
    assert overhead["optimizer"] == pytest.approx(2 * one["optimizer"])
    assert one["compute"] < overhead["compute"] < 2 * one["compute"]  # host time, not the FLOPs
    assert parts({"compute": 2.0, "overhead": 2.0}, "zero3")["compute"] == pytest.approx(2 * one["compute"], rel=1e-6)
    tp, tp3 = parts({}, "tp2"), parts({"comm": 3.0}, "tp2")
    assert tp3["comm"]["tp"] == pytest.approx(3 * tp["comm"]["tp"], rel=1e-6)


def _hidden_host(base: dict) -> dict:
    """A host unlike its profile: compute 1.7x slower, host work 2.5x, collectives 3x."""
    return run_fit.scaled(base, {"compute": 1.7, "overhead": 2.5, "comm": 3.0})


def _err(profile: dict, truth: dict, name: str) -> float:
    return abs(math.log(_step(profile, name) / _step(truth, name)))


@pytest.mark.parametrize("base", ["host probe", "calibrated"])
def test_one_run_of_a_layout_brings_the_others_closer(base):
    data = _bases()[base]
    truth = _hidden_host(data)
    for fitted_on in ("ddp", "zero3", "tp2"):
        fitted = run_fit.fit(data, [_obs(fitted_on, _step(truth, fitted_on))]).profile
        assert _err(fitted, truth, fitted_on) < 0.01  # the run it saw, to the fit's tolerance
        for other in LAYOUTS:
            assert _err(fitted, truth, other) < _err(data, truth, other), (fitted_on, other)


def test_runs_of_several_layouts_separate_the_groups():
    truth = _hidden_host(CALIBRATED)
    runs = [_obs(n, _step(truth, n)) for n in ("ddp", "zero3", "tp2", "pp2")]
    fit = run_fit.fit(CALIBRATED, runs)
    assert fit.knobs["comm"] > fit.knobs["compute"]  # the collectives are what the host is slowest at
    assert _err(fit.profile, truth, "zero1") < 0.05  # a layout no run ran
    for row in fit.rows:
        assert abs(math.log(row["after_s"] / row["measured_s"])) < abs(math.log(row["before_s"] / row["measured_s"]))


def test_a_fit_fitted_again_starts_from_its_measured_origin():
    truth = _hidden_host(CALIBRATED)
    runs = [_obs(n, _step(truth, n)) for n in ("ddp", "tp2")]
    first = run_fit.fit(CALIBRATED, runs).profile
    again = run_fit.fit(first, runs)
    assert again.profile == first  # the same runs, the same profile: no compounding
    assert first["from_runs"]["base_profile"] == CALIBRATED  # the measured calibration is kept
    assert [r["before_s"] for r in again.rows] == pytest.approx([r["after_s"] for r in again.rows])
    other = run_fit.fit(first, [_obs("zero3", _step(truth, "zero3"))]).profile
    assert other["from_runs"]["base_profile"] == CALIBRATED and "fitted to 1 run" in other["description"]


def test_memory_overhead_is_what_the_peaks_leave_above_the_model():
    hw = from_profile(CALIBRATED)
    model = run_fit.model_memory(run_fit.predict_run(hw, _obs("ddp")), hw)
    runtime = 0.7 * 2**30
    fit = run_fit.fit(CALIBRATED, [_obs("ddp", _step(CALIBRATED, "ddp"), peak=model + runtime)])
    assert fit.profile["overhead_gib"] == pytest.approx(0.7, rel=1e-6)
    after = run_fit.predict_run(run_fit.hardware(fit.profile), _obs("ddp"))
    assert after.memory["total"] == pytest.approx(model + runtime, rel=1e-6)
    assert fit.rows[0]["after_bytes"] == pytest.approx(model + runtime, rel=1e-6)


def test_gpu_profile_scales_its_constants_and_fits():
    base = {"kind": "gpu", "version": 1, "catalog": "h100", "constants": {}, "collectives": {}}
    k = run_fit.scaled(base, {"compute": 2.0, "comm": 4.0})["constants"]
    assert k["gemm_eff"] == pytest.approx(run_fit.consts.resolve("hopper")["gemm_eff"] / 2)
    assert k["alpha_inter"] == pytest.approx(4 * run_fit.consts.resolve("hopper")["alpha_inter"])
    cfg = preset("tiny")
    lay = parse_layout("dp_shard=8,zero=3,micro_batch=2", 8)
    obs = lambda s: run_fit.Observation("r", cfg, lay, 2048, 64, 8, "bf16", s)  # noqa: E731
    truth = run_fit.predict_run(run_fit.hardware(run_fit.scaled(base, {"compute": 1.3, "overhead": 1.3, "comm": 1.3})),
                            obs(1.0)).step_time
    fit = run_fit.fit(base, [obs(truth)])
    assert fit.rows[0]["after_s"] == pytest.approx(truth, rel=0.01)
    assert fit.profile["kind"] == "gpu" and fit.profile["catalog"] == "h100"
    assert all(v == pytest.approx(1.3, rel=0.1) for v in fit.knobs.values())  # one run: one shared factor
