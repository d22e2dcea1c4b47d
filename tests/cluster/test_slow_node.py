"""A slow node (slow): node2's processes get a quarter of the CPU a process of this host gets now (a
cgroup CPU quota), while a 2-node run trains. The straggler monitor compares each rank's busy time per
step (its training thread's CPU time plus its wait for a CPU: a throttled node does the same work
in the same CPU time, so CPU time alone would not see it) and names rank 1 on host node2, never
rank 0; then the policy: with resilience.on_straggler=log (the default) the run goes on to the
end as it was, with exclude node2 is taken out and node1 finishes alone.

The quota is a fraction of the share of one CPU a busy process gets on this host at the test's
start (measured): on a loaded shared host a fixed fraction of a CPU may be more than a process
gets anyway, and would slow nothing. A quarter, not a half: this small model's rank spends much of
its step blocked in Gloo, so it needs well under one CPU, and at half of one (on a quiet host,
share 0.99) node2's busy time per step matched node1's in most windows (0.046 / 0.046 s): such a
node is not slower, and is rightly not named. A quota binds only a node that needs more."""

from __future__ import annotations

import pytest
import scenario

STEPS = 18
WINDOW = 3
# With two ranks the median is their mean: a rank is over it by more than t only when it is
# (1 + t) / (1 - t) times the other, 1.67x at the default 0.25; the host's own load moves both
# ranks' busy times from window to window, so the test names the slow rank at 0.1 (1.22x).
THRESHOLD = 0.1
QUOTA = 0.25  # of the share of a CPU measured at the start


def _share_of_a_cpu() -> float:
    """The fraction of the time a busy thread of this host runs now (its CPU time over its CPU time
    plus its wait for a CPU), from a fixed amount of work."""
    import time

    from ndtrain.train.busy_time import thread_demand_s

    d0, c0 = thread_demand_s(), time.thread_time()
    x = 0
    for i in range(3_000_000):
        x += i
    return min(1.0, (time.thread_time() - c0) / max(1e-9, thread_demand_s() - d0))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("policy", ["log", "exclude"])
def test_a_node_at_a_quarter_of_the_cpu_is_named_the_straggler_with_its_host(make_cluster, guard, parity_base, policy):
    """log: named, and the run goes on as it was. exclude (an elastic job, --nnodes=1:2 with
    restarts): node2 is taken out at the step it is named, and node1 finishes alone."""
    from ndtrain.config import load_config, to_toml

    c = make_cluster(2)
    share = _share_of_a_cpu()
    c.nodes[1].cpu_quota(QUOTA * share)
    base = scenario.with_data(parity_base, c.shared / "data")
    config = c.shared / "train.toml"
    config.write_text(to_toml(load_config(None, base)))
    run_dir = c.shared / "run"
    args = ["--config", str(config), f"--train.output_dir={run_dir}", "--logging.progress=off",
            f"--train.steps={STEPS}", f"--train.straggler_window={WINDOW}", "--resilience.straggler_windows=2",
            f"--train.straggler_threshold={THRESHOLD}",
            f"--resilience.on_straggler={policy}", "--resilience.min_world=1"]
    elastic = {}
    if policy == "exclude":
        elastic = {"nnodes": "1:2", "max_restarts": 3, "launcher_args": [
            "--monitor-interval=0.5", f"--rdzv-conf=last_call_timeout={guard(2):.0f},keep_alive_interval=1,"
                                      f"keep_alive_max_attempt=3,join_timeout={guard(300):.0f}"]}
    started = scenario.agents.start_agents(c, 1, args, **elastic)
    try:
        codes = started.wait(guard(300))
    finally:
        started.kill()
    rows = scenario.metric_rows(run_dir)
    busy = [(r["step"], [round(b, 3) for b in r["rank_busy_s"]]) for r in rows if "rank_busy_s" in r]
    named = [r for r in rows if r.get("event") == "straggler"]
    excluded = [(r["step"], r["host"], r["ranks"]) for r in rows if r.get("event") == "exclude"]
    print(f"{policy}: share of a CPU measured {share:.2f}, node2 quota {QUOTA * share:.2f} of a CPU; busy s/step per "
          f"window (rank 0, rank 1): {busy}; named: {[(r['step'], r['rank'], r['host'], round(r['ratio'], 2)) for r in named]}; "
          f"excluded: {excluded}; exit codes {codes}")
    # Two windows running name a rank: every later window names it again while it stays slow.
    assert named and {(r["rank"], r["host"]) for r in named} == {(1, "node2")}, (busy, named, started.all_logs())
    lines = [ln for ln in started.log("node1").splitlines() if "straggler: rank" in ln]
    assert lines and all("straggler: rank 1 on host node2 is " in ln for ln in lines), started.all_logs()
    assert max(r["step"] for r in rows if "loss" in r) == STEPS
    if policy == "log":
        assert codes == {"node1": 0, "node2": 0}, started.all_logs()
        assert len(busy) == STEPS // WINDOW and not excluded, (busy, excluded)
    else:
        assert codes["node1"] == 0 and codes["node2"] != 0, started.all_logs()  # its agent left on the signal
        assert excluded == [(named[0]["step"], "node2", [1])], excluded
        starts = [r["world"] for r in rows if r.get("event") in ("start", "restart")]
        assert starts == [2, 1], starts
