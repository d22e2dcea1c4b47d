"""A preemption across nodes (slow): SIGTERM to every process of every node (what
`scancel --signal=TERM` does: the torchrun agents and their workers), then a resume on another
number of nodes (2 nodes x 1 rank -> 1 node x 2 ranks).

What it holds: one checkpoint, at the step the stop was agreed (no periodic one exists); every
worker exits 143; the stop line once, from rank 0; the resume continues at that step on one node,
and every sample of the global stream is trained exactly once across both launches.

What a launch script sees is torchrun's own exit code, not its workers': torchrun answers its
SIGTERM by forwarding it, waiting for the workers (--shutdown-timeout), then raising its
SignalException out of its main, so it exits 1 after printing that traceback. ndtrain's agent
(`python -m ndtrain.train.agent`, torchrun's arguments) exits 143 there instead. The workers' codes
are read here through a wrapper (`sh` ignoring the stop signals, recording the worker's code),
since torchrun reports none of them on that path."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import scenario

WRAPPER = """#!/bin/sh
# Records the worker's exit code for the test; ignores the stop signals itself (the worker sets
# its own handlers), so that the worker, not this shell, answers them.
trap '' TERM USR1
"$NDTRAIN_TEST_PYTHON" -m ndtrain train "$@"
code=$?
echo "$code" > "$NDTRAIN_TEST_EXITS/rank$RANK.attempt$TORCHELASTIC_RESTART_COUNT"
exit "$code"
"""


def _steps(cp_dir):
    return sorted(int(p.name.split("_")[1]) for p in cp_dir.glob("step_*") if p.is_dir())


def _last_step(run_dir) -> int:
    return max((r.get("step", 0) for r in scenario.metric_rows(run_dir) if "loss" in r), default=0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("launcher", ["torchrun", "ndtrain.train.agent"])
def test_sigterm_on_every_node_saves_once_exits_143_and_resumes_on_one_node(make_cluster, guard, parity_base,
                                                                              launcher):
    from fault_plan import SAMPLE_LOG_ENV  # tests/train, on the suite's path: each rank's samples per step

    from ndtrain.config import load_config, to_toml

    c = make_cluster(2)
    n1, _ = c.nodes
    base = scenario.with_data(parity_base, c.shared / "data")
    config = c.shared / "train.toml"
    config.write_text(to_toml(load_config(None, base)))
    run_dir, cp_dir, exits = c.shared / "run", c.shared / "checkpoints", c.shared / "exits"
    exits.mkdir()
    wrapper = c.shared / "worker.sh"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    env = {SAMPLE_LOG_ENV: "1", "NDTRAIN_TEST_PYTHON": sys.executable, "NDTRAIN_TEST_EXITS": str(exits)}
    ckpt = [f"--checkpoint.dir={cp_dir}", "--checkpoint.interval_steps=100000", "--checkpoint.resume=auto"]
    args = ["--config", str(config), f"--train.output_dir={run_dir}", "--logging.progress=off", *ckpt]
    run_dir.mkdir()  # resume=auto continues a run directory that exists

    # 1. Two nodes x one rank, a long run; at step 3 or later SIGTERM to every process of both nodes.
    argv = scenario.agents.torchrun_argv(2, 1, f"{n1.name}:{scenario.agents.RDZV_PORT}", "job1",
                                         [*args, "--train.steps=100000"])
    argv = argv[:argv.index("-m")] + ["--no-python", str(wrapper), *args, "--train.steps=100000"]
    if launcher != "torchrun":
        argv = [sys.executable, "-m", launcher, *argv[1:]]
    first = scenario.agents.Agents()
    for node in c.nodes:
        first.logs[node.name] = c.base / f"{node.name}-job1.log"
        first.procs[node.name] = node.popen(argv, env=scenario.agents.node_env(node, env), log=first.logs[node.name],
                                            cwd=str(scenario.agents.REPO))
    try:
        deadline = time.monotonic() + guard(120)
        while _last_step(run_dir) < 3:
            if time.monotonic() > deadline or any(p.poll() is not None for p in first.procs.values()):
                raise AssertionError(f"never reached step 3\n{first.all_logs()}")
            time.sleep(0.2)
        signalled = 0
        for node in c.nodes:
            for pid in node.pids():
                try:
                    os.kill(pid, signal.SIGTERM)
                    signalled += 1
                except ProcessLookupError:
                    pass
        stopped = time.monotonic()
        agent_codes = first.wait(guard(120))
        took = round(time.monotonic() - stopped, 1)
    finally:
        first.kill()
    logs = first.all_logs()
    worker_codes = {p.name: int(p.read_text()) for p in sorted(exits.iterdir())}
    stop = [ln for ln in logs.splitlines() if "ndtrain train: stopped by SIGTERM" in ln]
    print(f"{launcher}: SIGTERM to {signalled} processes at step >= 3; agents' exit codes {agent_codes}, workers' "
          f"{worker_codes}, all exited {took} s after the signal; checkpoints {_steps(cp_dir)}")
    assert worker_codes == {"rank0.attempt0": 143, "rank1.attempt0": 143}, logs
    # torchrun's own code: its SignalException, raised out of its main (torch 2.13), is exit 1;
    # ndtrain's agent says what its workers did.
    want = 1 if launcher == "torchrun" else 143
    assert agent_codes == {"node1": want, "node2": want}, logs
    assert len(stop) == 1 and stop[0] in first.log("node1"), logs  # rank 0 says it, once
    saved = int(stop[0].split(" at step ")[1].split(";")[0])
    assert _steps(cp_dir) == [saved] and saved == _last_step(run_dir) >= 3, (saved, _steps(cp_dir), logs)

    # 2. One node x two ranks continues at the saved step, to saved + 3.
    codes, second = scenario.train_across(c, config, run_dir, 2, guard(120), nodes=[n1], run_id="job2",
                                          env=env, extra=[*ckpt, f"--train.steps={saved + 3}"])
    assert codes == {"node1": 0}, second.all_logs()
    starts = [r for r in scenario.metric_rows(run_dir) if r.get("event") in ("start", "restart")]
    assert [s["world"] for s in starts] == [2, 2] and starts[-1]["step"] == saved, starts
    assert f"step_{saved:08d}" in json.dumps(starts[-1].get("resumed_from")), starts[-1]
    # Exactly once: steps 1..saved+3 each trained by one whole world, the stream's first
    # (saved + 3) x global_batch samples each once.
    ran = scenario.samples_by_step(run_dir)
    assert sorted(ran) == list(range(1, saved + 4)), sorted(ran)
    ids = [i for step in sorted(ran) for i in ran[step]]
    assert sorted(ids) == list(range((saved + 3) * base["train"]["global_batch"])), ids
