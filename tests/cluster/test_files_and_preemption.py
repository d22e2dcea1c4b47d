"""Files where clusters keep them, and a preemption across nodes (slow: three multi-node runs).

The run directory and `checkpoint.dir` are on the shared directory; each node's /tmp is its own.
A first run saves every 2 steps and keeps the last 2, validates, and samples at the end (rank 0);
`ndtrain report` reads the run from the other node. A second run resumes it; while it trains, a
second launch into the same run directory from the other node is refused by the run lock; then
every process of every node gets SIGTERM (what `scancel --signal=TERM` does): one checkpoint,
the stop line, no traceback. A third run resumes that checkpoint on one node instead of two."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import scenario

NDTRAIN = [sys.executable, "-m", "ndtrain", "train"]


def _steps(cp_dir):
    return sorted(int(p.name.split("_")[1]) for p in cp_dir.glob("step_*") if p.is_dir())


def _wait_for(condition, guard_s: float, what: str, agents_) -> None:
    deadline = time.monotonic() + guard_s
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in agents_.procs.values()):
            raise AssertionError(f"never saw {what}\n{agents_.all_logs()}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_shared_run_dir_checkpoints_lock_report_sample_then_preempt_and_resume_on_fewer_nodes(
        make_cluster, guard, parity_base):
    from ndtrain.config import load_config, to_toml

    c = make_cluster(2, "own-address")
    n1, n2 = c.nodes
    base = scenario.with_data(parity_base, c.shared / "data", val_interval=2, val_batches=1, sample_tokens=16)
    config = c.shared / "train.toml"  # no layout: the planner picks one for each world
    config.write_text(to_toml(load_config(None, base)))
    run_dir, cp_dir = c.shared / "run", c.shared / "checkpoints"
    ckpt = [f"--checkpoint.dir={cp_dir}", "--checkpoint.interval_steps=2", "--checkpoint.keep_last=2"]

    # 1. Four steps on 2 nodes: checkpoints, retention, validation, the closing sample.
    codes, first = scenario.train_across(c, config, run_dir, 1, guard(90), extra=["--train.steps=4", *ckpt])
    assert codes == {"node1": 0, "node2": 0}, first.all_logs()
    assert _steps(cp_dir) == [2, 4]  # keep_last=2 of 2, 4
    assert not (run_dir / "checkpoints").exists()  # checkpoint.dir, not the run directory's default
    rows = scenario.metric_rows(run_dir)
    assert any("val_loss" in r for r in rows) and rows[0]["world"] == 2
    assert "---- sample ----" in first.log("node1") and "---- sample ----" not in first.log("node2")
    assert not list(n1.tmp.glob("**/metrics.jsonl")) and not list(n2.tmp.glob("**/metrics.jsonl"))
    report = n2.run([sys.executable, "-m", "ndtrain", "report", str(run_dir), "--out", str(c.shared / "r.html")],
                    timeout=guard(60))
    assert report.returncode == 0 and (c.shared / "r.html").stat().st_size > 0, report.stdout + report.stderr

    # 2. Resumed, long: a second launch into the same directory is refused; then SIGTERM everywhere.
    second = scenario.agents.start_agents(
        c, 1, ["--config", str(config), f"--train.output_dir={run_dir}", "--logging.progress=off",
               "--train.steps=100000", "--checkpoint.resume=auto", *ckpt], run_id="job2")
    try:
        _wait_for(lambda: max((r.get("step", 0) for r in scenario.metric_rows(run_dir) if "loss" in r), default=0) >= 6,
                  guard(120), "the resumed run reach step 6", second)
        intruder = n2.run([*NDTRAIN, "--config", str(config), f"--train.output_dir={run_dir}",
                           "--checkpoint.resume=auto", "--logging.progress=off", *ckpt], timeout=guard(60),
                          env=scenario.agents.node_env(n2))
        said = intruder.stderr.strip().splitlines()
        assert intruder.returncode == 2 and "Traceback" not in intruder.stderr, intruder.stderr
        assert "in use by a live run" in said[-1] and "on host node1" in said[-1], said[-1]  # rank 0's node holds it
        before = set(_steps(cp_dir))
        for node in c.nodes:
            for pid in node.pids():
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        codes = second.wait(guard(120))
    finally:
        second.kill()
    logs = second.all_logs()
    assert None not in codes.values(), logs
    stop = [ln for ln in second.log("node1").splitlines() if "stopped by SIGTERM" in ln]
    assert len(stop) == 1, logs
    saved = int(stop[0].split(" at step ")[1].split(";")[0])
    assert saved >= 6 and saved == max(_steps(cp_dir)) and saved >= max(before), logs
    # torchrun prints its own SignalException traceback (plain torchrun does on every stop); the
    # workers print none: no frame of ndtrain's in any log.
    assert "ndtrain/" not in "".join(ln for ln in logs.splitlines(True) if ln.lstrip().startswith("File ")), logs

    # 3. Resumed on one node (world 1 instead of 2) from the preemption's checkpoint.
    codes, third = scenario.train_across(c, config, run_dir, 1, guard(90), nodes=[n1], run_id="job3",
                                         extra=[f"--train.steps={saved + 2}", "--checkpoint.resume=auto", *ckpt])
    assert codes == {"node1": 0}, third.all_logs()
    starts = [r for r in scenario.metric_rows(run_dir) if r.get("event") in ("start", "restart")]
    said = f"{[(r.get('launch'), r.get('world'), r.get('resumed_from')) for r in starts]}\n{third.all_logs()}"
    assert starts[-1]["world"] == 1 and str(saved) in json.dumps(starts[-1]["resumed_from"]), said
    assert max(_steps(cp_dir)) == saved + 2
