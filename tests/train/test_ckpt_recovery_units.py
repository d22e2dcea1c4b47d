"""Recovery building blocks in isolation: watchdog, non-finite guard, straggler judgement, restart
semantics, fault-plan parsing, the job hooks that install it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import fault_plan
import pytest
import torch
from ckpt_helpers import cfg_of, job

from ndtrain.errors import NdtrainError
from ndtrain.train import hooks, recovery, rundir


def test_watchdog_fires_only_for_a_step_past_its_deadline(hang_deadline):
    # The deadline is the behaviour under test, so it stays short; it scales with the host's
    # measured slowdown so a healthy 0.05 s step keeps its 4x margin on a slow or loaded host.
    deadline = hang_deadline(0.2)
    fired = threading.Event()
    dog = recovery.Watchdog(deadline, rank=0, on_expire=fired.set)
    try:
        for step in range(3):  # fast steps: never fires
            dog.arm(step)
            time.sleep(0.05)
            dog.disarm()
        time.sleep(2 * deadline)  # disarmed (e.g. a long checkpoint or validation): never fires
        assert not fired.is_set()
        dog.arm(4)
        assert fired.wait(hang_deadline(2.0))  # only stops a hung test: 10x the deadline
    finally:
        dog.close()


def test_nonfinite_guard_counts_consecutive_steps_and_names_the_window():
    g = recovery.NonFiniteGuard(limit=3)
    assert g.observe(True, 0, 8) == ("skip", None)
    assert g.observe(False, 8, 16) == ("ok", None)  # a good step resets the count
    assert g.observe(True, 16, 24) == ("skip", None)
    assert g.observe(True, 24, 32) == ("skip", None)
    assert g.observe(True, 32, 40) == ("rollback", [16, 40])
    assert g.observe(True, 40, 48) == ("skip", None)  # counting starts afresh after a rollback


def test_straggler_needs_persistence_and_threshold():
    m = recovery.StragglerMonitor(threshold=0.25, window=2, persist=3)
    assert m.judge([1.0, 1.0, 1.0, 1.6]) == []
    assert m.judge([1.0, 1.0, 1.0, 1.6]) == []
    assert m.judge([1.0, 1.0, 1.0, 1.1]) == []  # recovered: strikes reset
    for _ in range(2):
        assert m.judge([1.0, 1.0, 1.0, 1.6]) == []
    [(rank, ratio)] = m.judge([1.0, 1.0, 1.0, 1.6])
    assert rank == 3 and ratio == pytest.approx(1.6)
    assert not m.add(0.1) and m.add(0.3) and m.take_mean() == pytest.approx(0.2)


def test_restart_semantics(monkeypatch, parity_base):
    cfg = cfg_of(job(parity_base))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert recovery.resume_specs(cfg) == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert recovery.resume_specs(cfg) == ["auto"]
    cfg.checkpoint.resume = "/pretrained/step_00000000"
    assert recovery.resume_specs(cfg) == ["auto", "/pretrained/step_00000000"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert rundir.launcher_run_dir(cfg) == Path("runs") / "debug-job42"
    cfg.train.output_dir = "/out"
    assert rundir.launcher_run_dir(cfg) is None


def test_fault_plan_selects_this_attempt_and_rank(monkeypatch):
    monkeypatch.setenv(fault_plan.FAULTS_ENV, "0:1:5:step:0.01,1:1:7:save,1:0:9:hang")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault_plan.FaultPlan.from_env(rank=1).faults == [(7, "save", 0.0)]
    assert fault_plan.FaultPlan.from_env(rank=0).faults == [(9, "hang", 0.0)]
    monkeypatch.setenv(fault_plan.FAULTS_ENV, "0:1:5:explode")
    with pytest.raises(NdtrainError, match="attempt:rank:step:point"):
        fault_plan.FaultPlan.from_env(rank=0)


def test_a_fault_of_any_attempt_fires_once_per_run(monkeypatch, tmp_path):
    log = tmp_path / hooks.HOOK_LOG
    monkeypatch.setenv(fault_plan.FAULTS_ENV, "*:0:4:publish,1:0:6:step")
    for attempt in ("0", "2"):  # not met yet: whichever attempt gets there has it
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        assert fault_plan.FaultPlan.from_env(rank=0, log_path=log).faults == [(4, "publish", 0.0)]
    fault_plan.FaultPlan([], rank=0, log_path=log)._note("kill", 4, "publish")  # attempt 2 met it
    assert fault_plan.FaultPlan.from_env(rank=0, log_path=log).faults == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault_plan.FaultPlan.from_env(rank=0, log_path=log).faults == [(6, "step", 0.0)]
    assert fault_plan.FaultPlan.from_env(rank=1, log_path=log).faults == []  # rank 0's fault only


def test_job_hooks_call_the_named_function_and_refuse_a_bad_one_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(hooks.HOOKS_ENV, fault_plan.HOOKS)
    monkeypatch.setenv(fault_plan.FAULTS_ENV, "0:0:3:hang")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    loaded = hooks.load(rank=0, run_dir=tmp_path)
    assert loaded.inner.faults == [(3, "hang", 0.0)] and loaded.inner.log_path == tmp_path / hooks.HOOK_LOG
    loaded.at_step(2)  # not its step: returns at once
    loaded.at_checkpoint(2, "save")
    loaded.close()
    for bad in ("no_such_module_here:hooks", "fault_plan:no_such_function", "fault_plan"):
        monkeypatch.setenv(hooks.HOOKS_ENV, bad)
        with pytest.raises(NdtrainError, match=hooks.HOOKS_ENV) as err:
            hooks.load(0, None)
        assert "\n" not in str(err.value)
    monkeypatch.delenv(hooks.HOOKS_ENV)
    assert hooks.load(0, tmp_path).inner is None  # no hooks: every point is a no-op


def test_the_fault_plan_records_each_kept_step_and_slows_the_end_through_the_job_hooks(monkeypatch, parity_base,
                                                                                    tmp_path):
    """What the self-healing and end-of-run tests rely on, in one short run in this process: the
    samples of every step through the `after_step` hook point, and the `end` and `sample` points
    (zero seconds here) each passed once, the closing sample restored after its one delay."""
    from ndtrain.train import job as jobs
    from ndtrain.train.trainer import train

    monkeypatch.setenv(hooks.HOOKS_ENV, fault_plan.HOOKS)
    monkeypatch.setenv(fault_plan.SAMPLE_LOG_ENV, "1")
    monkeypatch.setenv(fault_plan.FAULTS_ENV, "0:0:0:end:0,0:0:0:sample:0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    real = jobs.closing_sample
    run = tmp_path / "run"
    summary = train(cfg_of(job(parity_base, run, train={"steps": 3, "sample_tokens": 4})))
    assert jobs.closing_sample is real and "sample" in summary
    rows = [json.loads(line) for line in (run / "samples.rank0.jsonl").read_text().splitlines()]
    per_step = parity_base["train"]["global_batch"]
    assert [(r["step"], r["world"], r["attempt"], len(r["ids"])) for r in rows] == [(s, 1, 0, per_step) for s in (1, 2, 3)]
    assert len({i for r in rows for i in r["ids"]}) == 3 * per_step  # each sample once
    notes = [line.split()[1] for line in (run / hooks.HOOK_LOG).read_text().splitlines()]
    assert notes == ["end-delay", "sample-delay"], notes


def test_the_stop_flag_is_agreed_on_the_host_beside_an_accelerator(monkeypatch):
    """On CUDA the default group is NCCL: a stop flag reduced there is a device value read back
    each step (a GPU sync). It is reduced on the host instead, over a Gloo group of its own; on
    CPU the default group already is one, and none is made."""
    from ndtrain.train import distributed, signals

    calls = []
    monkeypatch.setattr(distributed, "group_active", lambda: True)
    monkeypatch.setattr(distributed.dist, "new_group", lambda **kw: calls.append(("new_group", kw)) or "gloo-group")

    def all_reduce(t, op=None, group=None):
        calls.append(("all_reduce", t.device.type, group))
        t.fill_(1.0)  # a peer was asked to stop

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    assert distributed.host_group(torch.device("cpu"), 60) is None and calls == []
    group = distributed.host_group(torch.device("cuda", 0), 60)  # only the device's type is read
    assert group == "gloo-group" and calls[0][1]["backend"] == "gloo"
    stop = signals.Preemption()
    try:
        assert stop.agreed(group) is True and calls[-1] == ("all_reduce", "cpu", "gloo-group")
        assert stop.agreed(None) is True and calls[-1] == ("all_reduce", "cpu", None)
    finally:
        stop.close()
