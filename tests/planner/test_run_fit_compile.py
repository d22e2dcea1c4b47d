"""A profile fitted to runs (`ndtrain calibrate --from-run`) prices compile only from what was
measured: runs that did not compile leave it unmeasured (compile_auto off, saying why), compiled
runs beside eager ones of their layout measure its cold compile and saving, and a measured
`ndtrain calibrate` profile keeps the pricing it had."""

import dataclasses

import pytest

from ndtrain.layout import parse_layout
from ndtrain.model.config import preset
from ndtrain.planner import run_fit
from ndtrain.planner.compile_choice import compile_choice
from ndtrain.planner.hardware import UNMEASURED_CPU_COMPILE, host_probe
from ndtrain.planner.host_cache import as_profile
from ndtrain.planner.problem import make_problem

CFG = preset("tiny", vocab_size=256)
DDP = parse_layout("dp_replicate=2,dp_shard=1,micro_batch=4", 2)
COMPILED = dataclasses.replace(DDP, compile=True)
CALIBRATED = {"cores": 2, "matmul": {"fp32_1thread": 6e10, "bf16_1thread": 1.2e11},
              "memory": {"total_bytes": 64 * 2**30, "copy_bw": 1e10}, "host_s": {"layer": 2e-3, "head": 3e-3}}
LONG_RUN = 10**9  # steps: any priced saving repays its compile


def _obs(lay, step_s: float, first_step_s: float | None = None, label: str = "ddp") -> run_fit.Observation:
    return run_fit.Observation(label=label, cfg=CFG, layout=lay, seq=128, global_batch=8, world=2,
                               precision="fp32", step_s=step_s, first_step_s=first_step_s)


def _choice(profile: dict, lay=DDP) -> dict | None:
    pb = make_problem(CFG, 128, 8, 2, run_fit.hardware(profile), precision="fp32")
    return compile_choice(pb, lay, LONG_RUN)


def _step(profile: dict, lay) -> float:
    return run_fit.predict_run(run_fit.hardware(profile), _obs(lay, 1.0)).step_time


@pytest.mark.parametrize("base", ["host probe", "defaults"])
def test_a_fit_to_eager_runs_leaves_compile_unmeasured(base):
    data = {"host probe": as_profile(host_probe()), "defaults": {}}[base]
    assert _choice(data) is None  # uncalibrated: compile not priced, no decision
    fitted = run_fit.fit(data, [_obs(DDP, 1.0)]).profile
    assert "compile" in fitted["unmeasured"] and "compile_s" not in fitted
    d = _choice(fitted)
    # Before the fix the fitted profile counted as calibrated and priced the unmeasured defaults:
    # compile on, repaid after a few hundred steps.
    assert not d["compile"] and d["compile_s"] == 0 and d["breakeven_steps"] is None
    assert d["description"].startswith("torch.compile off: compile not measured")
    # a compiled run priced on it is priced as eager: the profile claims no saving
    assert _step(fitted, COMPILED) == pytest.approx(_step(fitted, DDP))


def test_a_fit_over_a_measured_calibration_keeps_its_compile_pricing():
    before = _choice(CALIBRATED)
    fitted = run_fit.fit(CALIBRATED, [_obs(DDP, _step(CALIBRATED, DDP))]).profile
    after = _choice(fitted)
    assert "unmeasured" not in fitted
    assert after["compile_s"] == before["compile_s"] == UNMEASURED_CPU_COMPILE["compile_s"]
    assert after["compile"] and after["breakeven_steps"] == pytest.approx(before["breakeven_steps"], rel=0.01)


@pytest.mark.parametrize("base", ["host probe", "calibrated"])
def test_compiled_runs_beside_eager_ones_measure_compile(base):
    data = {"host probe": as_profile(host_probe()), "calibrated": CALIBRATED}[base]
    truth = {**run_fit.scaled(data, {"compute": 2.0, "overhead": 2.0, "comm": 2.0}),
             "compile_s": 30.0, "compile_saving": {"fp32": 0.25}}
    truth.pop("unmeasured", None)
    eager, compiled = _step(truth, DDP), _step(truth, COMPILED)
    assert compiled < eager
    warmup = 0.4  # a first step's own cost, compiled or not
    runs = [_obs(DDP, eager, eager + warmup), _obs(COMPILED, compiled, compiled + warmup + 30.0, "ddp-compiled")]
    fitted = run_fit.fit(data, runs).profile
    assert "unmeasured" not in fitted
    assert fitted["compile_s"] == pytest.approx(30.0, rel=1e-6)
    assert fitted["compile_saving"]["fp32"] == pytest.approx(0.25, abs=0.01)
    assert fitted["compile_measured_by"] == ["ddp-compiled"]
    assert _step(fitted, COMPILED) == pytest.approx(compiled, rel=0.02)
    d = _choice(fitted)
    assert d["compile"] and d["compile_s"] == pytest.approx(30.0, rel=1e-6)


def test_a_compiled_run_without_an_eager_twin_measures_no_compile():
    data = as_profile(host_probe())
    fitted = run_fit.fit(data, [_obs(COMPILED, 1.0, 20.0, "compiled")]).profile
    assert "compile" in fitted["unmeasured"] and not _choice(fitted)["compile"]
