"""How long a run trains and how long it has left: `[train] time_budget_s` becomes the steps the
planner's predicted step time fits in it (at most train.steps), the start-up says how long the
attempt will take, and the step lines show step/total and the time left from the measured pace.
Counted, never timed: the planner prices a given profile and the clock is the test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.train import metrics, run_length
from ndtrain.train.plan import resolve_plan
from ndtrain.train.run_length import TimeLeft, budget_choice, budget_steps, duration, start_line

ROOT = Path(__file__).resolve().parents[2]
PEERS = {"model": {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 768, "vocab_size": 2048},
         "data": {"seq_len": 256}, "train": {"global_batch": 8, "micro_batch": 4, "device": "cpu"}}


def test_budget_steps_fit_the_budget_within_the_cap():
    assert budget_steps(240, 1.718, 300) == 139  # 238.8 s
    assert budget_steps(240, 5.2, 300) == 46  # a slow host: fewer steps
    assert budget_steps(240, 0.692, 300) == 300  # a fast one: train.steps, the most
    assert budget_steps(1, 10.0, 300) == 1  # never none
    assert budget_steps(240, 0.0, 300) == 300  # an unpriced step
    assert budget_steps(240, 5.2, 300, 120) == 120  # a floor where the budget buys too few
    assert budget_steps(240, 5.2, 50, 120) == 50  # train.steps caps the floor


def test_durations_read_as_minutes_and_seconds():
    assert [duration(s) for s in (0, 45.4, 60, 130, 3599, 3720, -3)] == \
        ["0s", "45s", "1m00s", "2m10s", "59m59s", "1h02m", "0s"]


def test_the_time_left_is_the_measured_pace_times_the_steps_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(run_length, "monotonic", lambda: now[0])
    left = TimeLeft(10)
    assert left.after(1, 9.0) == 9 * 9.0  # the first step: its own time
    now[0] += 4.0
    assert left.after(2, 3.0) == 8 * 4.0  # then the pace since the first step, pauses included
    now[0] += 8.0
    assert left.after(4, 3.0) == 6 * 4.0
    assert left.after(10, 3.0) == 0


def test_the_step_lines_show_the_count_the_total_and_the_time_left(tmp_path, capsys, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(run_length, "monotonic", lambda: now[0])
    log = metrics.MetricsLogger(tmp_path / "run", True, 150, "off")
    for step in (1, 2, 40):
        now[0] = {1: 0.0, 2: 2.0, 40: 78.0}[step]
        log.last_print = 0.0  # print every row
        log.log({"step": step, "loss": 2.0, "tokens_per_s": 1000.0, "mfu": 0.4, "lr": 1e-3, "grad_norm": 1.0,
                 "step_time_s": 2.5})
    log.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/150", "step 2/150", "step 40/150"]
    assert [line.split(" | ")[-1] for line in lines] == ["6m12s left", "4m56s left", "3m40s left"]


def _profile(tmp_path) -> str:
    """A CPU profile as `ndtrain calibrate` writes it (the rest the defaults): a fixed machine."""
    path = tmp_path / "hardware.json"
    path.write_text(json.dumps({"description": "a calibrated test host"}))
    return str(path)


def _cfg(tmp_path, steps: int, budget: float = 0.0, **parallel):
    return load_config(None, {**PEERS, "train": {**PEERS["train"], "steps": steps, "time_budget_s": budget},
                              "parallel": {"auto_hardware": _profile(tmp_path), "compile": False, **parallel}})


def test_a_time_budget_trains_the_steps_the_plan_fits_in_it(tmp_path):
    plain = resolve_plan(_cfg(tmp_path, 300), 2)
    step_s = plain.prediction.step_s
    assert plain.config.train.steps == 300 and plain.budget == ""  # no budget: train.steps
    cfg = _cfg(tmp_path, 300, budget=40.5 * step_s)
    plan = resolve_plan(cfg, 2)
    assert plan.config.train.steps == 40 and ("train", "steps", 40) in plan.chosen
    assert cfg.train.steps == 300  # the caller's config stays
    assert "40 steps of at most 300" in plan.budget and f"{step_s:.3f} s/step" in plan.budget
    assert plan.as_dict()["budget"] == plan.budget  # plan.json records it
    # a machine faster than the budget needs: train.steps, the most it trains
    capped = resolve_plan(_cfg(tmp_path, 30, budget=40.5 * step_s), 2)
    assert capped.config.train.steps == 30 and "(train.steps, the most it trains)" in capped.budget
    assert not any(key == "steps" for _, key, _ in capped.chosen)
    # the same host and world derive the same count again (a restart's schedule is the same)
    assert resolve_plan(cfg, 2).config.train.steps == 40
    # before the first step: how many steps and about how long, and on a resume what is left
    assert start_line(plan, 0).startswith(f"training 40 steps: about {duration(40 * step_s)} at the planner's "
                                          f"{step_s:.3f} s/step")
    assert start_line(plan, 10).startswith(f"training 30 steps (from step 10 to 40): about {duration(30 * step_s)}")


def test_a_configured_layout_is_priced_for_the_budget(tmp_path):
    """No layout chosen (a data-parallel key given): the planner still prices the one configured."""
    auto = resolve_plan(_cfg(tmp_path, 300, budget=100.0), 2)
    given = resolve_plan(_cfg(tmp_path, 300, budget=100.0, dp_replicate=2, dp_shard=1), 2)
    assert given.prediction is None and given.layout.dp_replicate == 2
    assert given.config.train.steps == budget_steps(100.0, float(given.budget.split("predicted ")[1].split()[0]), 300)
    assert 1 <= given.config.train.steps < 300 and auto.config.train.steps < 300
    assert start_line(given, 0).startswith(f"training {given.config.train.steps} steps; train.time_budget_s = 100")


def test_make_train_fits_its_budget_on_slow_and_fast_hosts():
    """configs/default.toml (what `make train` runs): the Zen 3 host's predicted 1.759 s/step gets
    the steps that fit the budget; the Zen 1 host's 5.20 the floor, with how long it takes said;
    the AMX host's 0.692 the most it trains."""
    cfg = load_config(str(ROOT / "configs" / "default.toml"))
    budget = cfg.train.time_budget_s
    assert 0 < budget <= 300  # the README: about 5 minutes or less of training
    mid = budget_choice(cfg, 1.759)["overrides"]["train"]["steps"]
    assert mid * 1.759 <= budget < (mid + 1) * 1.759 and mid > cfg.train.time_budget_min_steps
    slow = budget_choice(cfg, 5.20)
    assert slow["overrides"]["train"]["steps"] == cfg.train.time_budget_min_steps == 120
    assert "budget fits only 46; about 10m24s here" in slow["description"]
    assert budget_choice(cfg, 0.692)["overrides"]["train"]["steps"] == cfg.train.steps


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_a_bad_budget_is_refused_naming_the_key(value):
    from ndtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.time_budget_s"):
        load_config(None, [f"--train.time_budget_s={value}"])
