"""Faults of a node while a 2-node run trains (slow): a cut link shorter than the collective
timeout, one that outlasts it, and a frozen node. Each test prints the seconds from the fault
to each node's exit (the figures of docs/launch.md's checklist come from these runs).

A node killed whole and back: test_node_lost_and_back.py; a slow node: test_slow_node.py; a
preemption: test_preemption_across_nodes.py. Not here yet: rate-limited links against the
planner (the harness has the fault)."""

from __future__ import annotations

import time

import pytest
import scenario


def _start(c, parity_base, extra: list[str], run_id: str = "job1"):
    from ndtrain.config import load_config, to_toml

    base = scenario.with_data(parity_base, c.shared / "data")
    config = c.shared / "train.toml"
    config.write_text(to_toml(load_config(None, base)))
    run_dir = c.shared / "run"
    args = ["--config", str(config), f"--train.output_dir={run_dir}", "--logging.progress=off", *extra]
    return scenario.agents.start_agents(c, 1, args, run_id=run_id), run_dir


def _last_step(run_dir) -> int:
    return max((r.get("step", 0) for r in scenario.metric_rows(run_dir) if "loss" in r), default=0)


def _until_step(run_dir, step: int, agents_, guard_s: float) -> None:
    deadline = time.monotonic() + guard_s
    while _last_step(run_dir) < step:
        if time.monotonic() > deadline or any(p.poll() is not None for p in agents_.procs.values()):
            raise AssertionError(f"never reached step {step}\n{agents_.all_logs()}")
        time.sleep(0.2)


def _exit_times(agents_, since: float, guard_s: float) -> dict:
    deadline = time.monotonic() + guard_s
    out = {}
    while len(out) < len(agents_.procs) and time.monotonic() < deadline:
        for name, p in agents_.procs.items():
            if name not in out and p.poll() is not None:
                out[name] = (p.returncode, round(time.monotonic() - since, 1))
        time.sleep(0.1)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_cut_link_shorter_than_the_timeout_is_ridden_out(make_cluster, guard, parity_base):
    c = make_cluster(2)
    steps = 12
    started, run_dir = _start(c, parity_base, [f"--train.steps={steps}", "--train.timeout_s=120"])
    try:
        _until_step(run_dir, 3, started, guard(120))
        c.nodes[1].link(False)
        time.sleep(3.0)  # the fault's length, not a condition: TCP retransmits across it
        c.nodes[1].link(True)
        codes = started.wait(guard(120))
    finally:
        started.kill()
    assert codes == {"node1": 0, "node2": 0}, started.all_logs()
    assert _last_step(run_dir) == steps


def _until_said(agents_, name: str, text: str, guard_s: float) -> float | None:
    """Seconds until `text` appears in node `name`'s log (None if the guard ran out)."""
    t0 = time.monotonic()
    while text not in agents_.log(name):
        if time.monotonic() - t0 > guard_s:
            return None
        time.sleep(0.2)
    return round(time.monotonic() - t0, 1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_cut_link_longer_than_the_timeout_ends_both_sides_with_a_line(make_cluster, guard, parity_base):
    """Both workers stop with a line naming a lost peer, bounded by train.timeout_s. The cut-off
    node's torchrun agent is not: it goes on trying to reach the rendezvous store through the cut
    link (930 s once here), torchrun's own timeouts; the test stops waiting for it."""
    c = make_cluster(2)
    timeout_s = 30
    started, run_dir = _start(c, parity_base, ["--train.steps=100000", f"--train.timeout_s={timeout_s}"])
    try:
        _until_step(run_dir, 3, started, guard(120))
        c.nodes[1].link(False)
        node1 = _exit_times(type(started)(procs={"node1": started.procs["node1"]}, logs={}), time.monotonic(),
                            guard(timeout_s + 60))
        node2_said = _until_said(started, "node2", "lost a peer", guard(timeout_s + 60))
    finally:
        started.kill()
    print(f"link cut at step {_last_step(run_dir)}; node1 agent exit (code, s after the cut): {node1}; "
          f"node2's worker said so (s after node1's exit): {node2_said}")
    assert node1.get("node1", (0,))[0] != 0 and node2_said is not None, started.all_logs()
    assert "ndtrain train: error: rank 0:" in started.log("node1"), started.all_logs()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_frozen_node_is_named_within_the_step_deadline(make_cluster, guard, parity_base):
    c = make_cluster(2)
    deadline_s = 20
    started, run_dir = _start(c, parity_base, ["--train.steps=100000", f"--train.step_deadline_s={deadline_s}",
                                               "--train.timeout_s=300"])
    try:
        _until_step(run_dir, 3, started, guard(120))
        c.nodes[1].freeze()
        frozen = time.monotonic()
        exits = _exit_times(type(started)(procs={"node1": started.procs["node1"]}, logs={}), frozen,
                            guard(deadline_s + 60))
        c.nodes[1].thaw()
    finally:
        c.nodes[1].thaw()
        started.kill()
    print(f"node2 frozen at step {_last_step(run_dir)}; node1 exit (code, s after the freeze): {exits}")
    assert "node1" in exits and exits["node1"][0] != 0, started.all_logs()
    # The watchdog's one line comes from the rank that waited (rank 0, on node1); the frozen node
    # can say nothing, so the line names it: its rank stopped beating in the group's store.
    said = [ln for ln in started.log("node1").splitlines() if ln.startswith("ndtrain watchdog: rank 0 ")]
    assert len(said) == 1 and f"exceeded train.step_deadline_s={deadline_s}" in said[0], started.all_logs()
    print(said[0])
    assert "waiting on rank 1 on host node2, which stopped answering" in said[0], said[0]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_frozen_rendezvous_node_is_named_by_the_other(make_cluster, guard, parity_base):
    """node1 holds rank 0 and the group's store: frozen, nobody can read a heartbeat. Rank 1's
    watchdog still fires (its reads of the store are bounded: a frozen process's kernel accepts
    the connection and never answers) and names node1. node2's agent is not waited for: its
    rendezvous store is on node1 too (torchrun's own wait, as with a cut link)."""
    c = make_cluster(2)
    deadline_s = 20
    started, run_dir = _start(c, parity_base, ["--train.steps=100000", f"--train.step_deadline_s={deadline_s}",
                                               "--train.timeout_s=300"])
    try:
        _until_step(run_dir, 3, started, guard(120))
        c.nodes[0].freeze()
        said_s = _until_said(started, "node2", "ndtrain watchdog: rank 1 ", guard(deadline_s + 60))
    finally:
        c.nodes[0].thaw()
        started.kill()
    said = [ln for ln in started.log("node2").splitlines() if ln.startswith("ndtrain watchdog: rank 1 ")]
    print(f"node1 frozen; node2's watchdog line {said_s} s after the freeze: {said}")
    assert said_s is not None and len(said) == 1, started.all_logs()
    assert f"exceeded train.step_deadline_s={deadline_s} s, the group's store at node1:" in said[0], said[0]
    assert "rank 0's node (node1) stopped answering" in said[0], said[0]
