"""A node lost and back (slow): an elastic 2-node run (torchrun --nnodes=1:2, restarts allowed,
c10d rendezvous on node1) loses node2 whole (every process SIGKILLed, as on a power loss);
node1's rank stops on the lost peer, its agent restarts it, the rendezvous drops the dead agent
and the run goes on as one rank from the newest checkpoint. Then node2's agent starts again: the
running agent sees it waiting, stops its worker (SIGTERM: it saves at the step boundary) and the
two re-form as world 2 from that checkpoint. The run ends at its last step, and the lineage that
made the final weights (each step's last training) holds every sample of the stream once.

The seconds from the kill to the shrunk world's first step and from the new agent's start to the
grown world's first step are printed: the figures of docs/launch.md's checklist."""

from __future__ import annotations

import json
import time

import pytest
import scenario

STEPS = 40


def _rows(run_dir) -> list[dict]:
    return scenario.metric_rows(run_dir)


def _wait(condition, guard_s: float, what: str, agents_) -> float:
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > guard_s or agents_.procs["node1"].poll() is not None:
            raise AssertionError(f"never saw {what}\n{agents_.all_logs()}")
        time.sleep(0.2)
    return round(time.monotonic() - t0, 1)


def _starts(run_dir) -> list[dict]:
    return [r for r in _rows(run_dir) if r.get("event") in ("start", "restart")]


def _trains_as(run_dir) -> int | None:
    """The world of the newest attempt once it has trained a step (None before)."""
    rows = _rows(run_dir)
    at = max((i for i, r in enumerate(rows) if r.get("event") in ("start", "restart")), default=None)
    if at is None or not any("loss" in r for r in rows[at + 1:]):
        return None
    return rows[at]["world"]


def _lineage(run_dir, starts: list[dict]) -> dict[int, list[int]]:
    """step -> the sample numbers of its last training: the attempt that trained it last is the
    last to start before it; within each rank's file a later row is a later training."""
    last: dict[tuple[int, int, int], list[int]] = {}  # (step, world, rank) -> ids, the last row wins
    for path in run_dir.glob("samples.rank*.jsonl"):
        rank = int(path.name.split("rank")[1].split(".")[0])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            last[(row["step"], row["world"], rank)] = row["ids"]
    out = {}
    for step in sorted({s for s, _, _ in last}):
        world = [s for s in starts if s["step"] < step][-1]["world"]
        out[step] = [i for rank in range(world) for i in last[(step, world, rank)]]
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_node_killed_whole_shrinks_the_run_and_grows_it_back(make_cluster, guard, parity_base):
    from fault_plan import SAMPLE_LOG_ENV  # tests/train, on the suite's path: each rank's samples per step

    from ndtrain.config import load_config, to_toml

    c = make_cluster(2)
    n1, n2 = c.nodes
    base = scenario.with_data(parity_base, c.shared / "data")
    config = c.shared / "train.toml"
    config.write_text(to_toml(load_config(None, base)))
    run_dir = c.shared / "run"
    run_dir.mkdir()
    rdzv = (f"--rdzv-conf=last_call_timeout={guard(2):.0f},keep_alive_interval=1,keep_alive_max_attempt=3,"
            f"join_timeout={guard(300):.0f}")
    args = ["--config", str(config), f"--train.output_dir={run_dir}", "--logging.progress=off",
            f"--train.steps={STEPS}", "--checkpoint.interval_steps=3", "--checkpoint.resume=auto",
            "--train.timeout_s=60"]
    env = {SAMPLE_LOG_ENV: "1"}
    launcher = ["--monitor-interval=0.5", rdzv]
    agents = scenario.agents.start_agents(c, 1, args, nnodes="1:2", env=env, max_restarts=3, launcher_args=launcher)
    back = None
    try:
        _wait(lambda: any(r.get("step", 0) >= 5 and "loss" in r for r in _rows(run_dir)), guard(180), "step 5", agents)
        lost_at = max(r["step"] for r in _rows(run_dir) if "loss" in r)
        n2.kill_all()
        shrunk_s = _wait(lambda: _trains_as(run_dir) == 1, guard(240), "the run going on as world 1", agents)
        shrunk_step = max(r["step"] for r in _rows(run_dir) if "loss" in r)
        back = scenario.agents.start_agents(c, 1, args, nodes=[n2], nnodes="1:2", env=env, max_restarts=3,
                                            launcher_args=launcher, run_id="job1")
        agents.procs["node2-back"], agents.logs["node2-back"] = back.procs["node2"], back.logs["node2"]
        grown_s = _wait(lambda: _trains_as(run_dir) == 2 and len(_starts(run_dir)) >= 3, guard(300),
                        "the run grown back to world 2", agents)
        codes = agents.wait(guard(300))
    finally:
        agents.kill()
    logs = agents.all_logs()
    starts = _starts(run_dir)
    print(f"node2 killed after step {lost_at}; world 1 trained a step {shrunk_s} s later (by step {shrunk_step}); "
          f"node2's agent back: world 2 trained a step {grown_s} s after its start; attempts "
          f"{[(s['event'], s['step'], s['world']) for s in starts]}; exit codes {codes}")
    assert codes["node1"] == 0 and codes["node2-back"] == 0, logs
    assert [s["world"] for s in starts][:1] == [2] and 1 in [s["world"] for s in starts] and starts[-1]["world"] == 2
    assert max(r["step"] for r in _rows(run_dir) if "loss" in r) == STEPS
    lineage = _lineage(run_dir, starts)
    assert sorted(lineage) == list(range(1, STEPS + 1)), sorted(lineage)
    ids = [i for step in sorted(lineage) for i in lineage[step]]
    assert sorted(ids) == list(range(STEPS * base["train"]["global_batch"])), ids
