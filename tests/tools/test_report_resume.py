"""`ndtrain report` tells a user's resume (a new `ndtrain train` on the run, perhaps on another
number of ranks) from a failure's restart and from a self-healing change of world: the time
between a stop and the user's next command is theirs, not lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.tools.report import header_rows, membership_changes, resumes
from ndtrain.tools.run_data import membership_phases, read_run
from ndtrain.train import resilience

RESTARTS = "restarts / rollbacks / skipped steps"
RESUMED = "resumed by a new launch (ndtrain train again)"
HEALING = "membership changes (self-healing)"


def _train(step: int, t: float, **extra) -> dict:
    return {"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
            "mfu": 0.2, "step_time_s": 0.5, "tokens_seen": 100 * step, "peak_memory_mb": 500.0, "time": t, **extra}


def _rows(second: dict, end: dict | None, membership: bool = True) -> list[dict]:
    """Attempt one on 1 rank: steps 1-4, a save at 4, then `end` (None: it crashed). Attempt two
    starts 27 s after the first's last row with the start row `second`, on 2 ranks, steps 5-10."""
    rows = [{"step": 0, "event": "start", "attempt": 0, "launch": "A", "world": 1, "time": 0.0}]
    rows += [_train(s, 0.5 * s) for s in range(1, 5)]
    rows += [{"step": 4, "checkpoint_mode": "sync", "checkpoint_stall_s": 0.1, "checkpoint_total_s": 0.1, "time": 2.5}]
    if end is not None:
        rows.append({"step": 4, "event": "end", "time": 3.0, **end})
    if membership:  # what resilience.membership_change wrote before it knew a launch from a restart
        rows.append({"step": 4, "event": "membership", "old_world": 1, "world": 2, "time": 29.9,
                     "reason": "an agent left the rendezvous or died; resumed from the newest checkpoint"})
    rows.append({"step": 4, "event": "restart", "world": 2, "time": 30.0, **second})
    rows += [_train(s, 30.0 + 0.5 * (s - 4)) for s in range(5, 11)]
    return rows


def _read(tmp_path: Path, rows: list[dict]):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_run(tmp_path)


def test_a_users_resume_on_more_ranks_is_neither_a_restart_nor_self_healing(tmp_path):
    run = _read(tmp_path, _rows({"attempt": 0, "launch": "B"}, {"how": "stopped"}))
    assert run.restarts == [] and [e["step"] for e in run.resumes] == [4]
    assert membership_phases(run) == []  # nothing lost to a change the user made
    table = dict(header_rows([run], now=40.0))
    assert table[RESTARTS] == ["0 / 0 / 0"] and HEALING not in table
    assert table[RESUMED] == ["step 4 on 1 -> 2 ranks: the attempt before was stopped (a signal); 27 s from its end "
                              "to this start (the user's pause and the new start-up, not lost to a failure)"], table[RESUMED]
    assert table["world size over time"] == ["1 ranks from 0 s (step 0), 2 ranks from 30 s (step 4)"]


@pytest.mark.parametrize("second, end, kind", [
    ({"attempt": 1, "launch": "A"}, None, "restart"),  # torchrun restarted the group after a failure
    ({"attempt": 0, "launch": "A"}, {"how": "stopped"}, "restart"),  # torch elastic re-formed it (an agent joined)
    ({"attempt": 0, "launch": "B"}, None, "resume"),  # the user ran it again after a crash
    ({"attempt": 0}, None, "restart"),  # rows from before starts recorded their launch: as before
])
def test_a_restart_by_torchrun_stays_a_restart(tmp_path, second, end, kind):
    run = _read(tmp_path, _rows(second, end))
    assert run.starts[1]["kind"] == kind
    table = dict(header_rows([run], now=40.0))
    if kind == "restart":
        assert table[RESTARTS] == ["1 / 0 / 0"] and RESUMED not in table
        assert membership_changes(run).startswith("step 4: 1 -> 2 ranks (an agent left the rendezvous or died")
    else:
        assert table[RESTARTS] == ["0 / 0 / 0"] and HEALING not in table
        assert "ended without a record (a crash, or an older ndtrain)" in table[RESUMED][0]


def test_older_rows_resuming_a_finished_run_are_a_resume(tmp_path):
    """Nothing restarts a finished run on its own: a start after the last step is the user's."""
    rows = [r if r.get("step") != 4 or "loss" not in r else {**r, "last": True}
            for r in _rows({"attempt": 0}, None, membership=False)]
    run = _read(tmp_path, rows)
    assert run.restarts == [] and run.resumes[0]["after"] == "finished"
    assert "the attempt before finished" in resumes(run)


def test_no_membership_row_for_a_new_launch(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"step": 0, "event": "start", "attempt": 0, "launch": "A", "world": 1, "layout": "single"}) + "\n")
    assert resilience.membership_change(tmp_path, 2, "dp_shard=2", {"attempt": 0, "launch": "B"}) is None
    row, text = resilience.membership_change(tmp_path, 2, "dp_shard=2", {"attempt": 0, "launch": "A"})
    assert (row["old_world"], row["world"]) == (1, 2) and "membership change: world 1 -> 2" in text
    # rank 0 on an agent that joined late counts its restarts from 0: still the same launch
    assert resilience.new_launch({"attempt": 2, "launch": "A"}, {"attempt": 0, "launch": "A"}) is False
    assert resilience.new_launch({"launch": "A"}, {}) is None


@pytest.mark.timeout(180)
def test_a_run_continued_by_a_second_train_command_reports_a_resume(parity_base, tmp_path):
    from ndtrain.train.trainer import train

    def job(steps: int, **checkpoint) -> dict:
        base = {k: dict(v) for k, v in parity_base.items()}
        base["train"].update(steps=steps, val_interval=0, sample_tokens=0, output_dir=str(tmp_path / "run"))
        base["checkpoint"] = {"interval_steps": 2, **checkpoint}
        return base

    train(load_config(None, job(2)))
    train(load_config(None, job(4, resume="auto")))  # the user's second command: more steps
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ends = [r["how"] for r in rows if r.get("event") == "end"]
    launches = [r["launch"] for r in rows if r.get("event") in ("start", "restart")]
    assert ends == ["finished", "finished"] and len(set(launches)) == 2, rows
    run = read_run(tmp_path / "run")
    assert run.restarts == [] and [(e["step"], e["after"]) for e in run.resumes] == [(2, "finished")]
    assert [r["step"] for r in run.train] == [1, 2, 3, 4] and run.finished


def test_the_planner_row_is_the_last_attempts(tmp_path):
    """A run planned on 2 ranks and resumed on 1 without the planner: no prediction of the first
    world is set against the second world's steps."""
    rows = _rows({"attempt": 0, "launch": "B"}, {"how": "stopped"}, membership=False)
    rows.insert(1, {"step": 0, "event": "auto", "layout": "dp_replicate=2", "predicted_step_time": 0.1, "time": 0.1})
    run = _read(tmp_path, rows)
    assert run.auto is None and dict(header_rows([run], now=40.0))["planner (auto): predicted vs measured"] == ["not used"]
    second = next(i for i, r in enumerate(rows) if r.get("event") == "restart")
    rows.insert(second + 1, {"step": 4, "event": "auto", "layout": "single", "predicted_step_time": 0.4, "time": 30.1})
    assert _read(tmp_path, rows).auto["layout"] == "single"
