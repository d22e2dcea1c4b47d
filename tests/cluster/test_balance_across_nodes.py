"""Balancing a slower node (slow): node2's processes held to half a CPU by its cgroup quota, DDP
over 2 nodes x 1 rank, `parallel.balance = "measured"`. At the first checkpoint boundary the job
moves rows of each global batch from node2's rank to node1's, from the ranks' measured compute
time; the losses stay those of the uniform split (the same global batch, token-normalized), and
every sample of the stream is trained exactly once across the change.

The model is compute-bound here (the `tiny` preset, 24 x 128 tokens a step: ~0.4 s of compute per
rank and step on a free core), so a quota of half a core makes node2's compute about twice
node1's; each node runs on a core of its own and weighs ten plain processes against the host's
other work (as benchmarks/uneven_nodes.py, which measures the speed-up), so the host's load does
not hide it. The test asserts the direction of the change, never a time."""

from __future__ import annotations

import pytest
import scenario

STEPS, BOUNDARY = 8, 4
ROWS = 24


def _train(c, base: dict, name: str, balance: str, guard):
    from fault_plan import SAMPLE_LOG_ENV  # tests/train, on the suite's path: each rank's samples per step

    from ndtrain.config import load_config, to_toml

    raw = {**base, "parallel": {**base["parallel"], "balance": balance}}
    config = c.shared / f"{name}.toml"
    config.write_text(to_toml(load_config(None, raw)))
    run_dir = c.shared / name
    codes, started = scenario.train_across(c, config, run_dir, 1, guard(300), run_id=name,
                                           env={SAMPLE_LOG_ENV: "1"}, pin_cores=True)
    assert codes == {"node1": 0, "node2": 0}, started.all_logs()
    return run_dir, started


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_node_at_half_a_cpu_is_given_fewer_rows_with_the_same_losses_and_each_sample_once(
        make_cluster, guard, parity_base):
    c = make_cluster(2)
    for node in c.nodes:
        (node.cgroups["cpu"] / "cpu.shares").write_text("10240")
    c.nodes[1].cpu_quota(0.5)
    base = scenario.with_data(parity_base, c.shared / "data", steps=STEPS, global_batch=ROWS, micro_batch=ROWS)
    base["model"] = {"preset": "tiny", "vocab_size": 256}
    base["data"]["seq_len"] = 128
    base["checkpoint"] = {"interval_steps": BOUNDARY}
    base["parallel"] = {"dp_replicate": 2, "dp_shard": 1, "compile": False, "mixed_precision": "fp32"}

    uniform_dir, _ = _train(c, base, "uniform", "off", guard)
    measured_dir, started = _train(c, base, "measured", "measured", guard)
    logs = started.all_logs()

    changes = [r for r in scenario.metric_rows(measured_dir) if r.get("event") == "rebalance"]
    print(f"re-balanced: {[(r['step'], r['rank_compute_s'], r['rows_before'], r['rows_after']) for r in changes]}")
    assert changes and changes[0]["step"] == BOUNDARY, logs
    after = changes[0]["rows_after"]
    # node2 is rank 1 (c10d orders ranks by node name), the slower one: it gives rows to rank 0.
    assert changes[0]["rows_before"] == [ROWS // 2] * 2 and after[1] < ROWS // 2 < after[0] and sum(after) == ROWS, changes
    assert f"balance measured: at step {BOUNDARY} " in started.log("node1"), logs

    # Each step's rows as the sample logs saw them, and every sample once.
    ran = scenario.samples_by_step(measured_dir)
    assert sorted(ran) == list(range(1, STEPS + 1)), sorted(ran)
    ids = [i for step in sorted(ran) for i in ran[step]]
    assert sorted(ids) == list(range(STEPS * ROWS)), ids

    # The same global batch, token-normalized: the uniform split's losses.
    want, got = scenario.step_losses(uniform_dir), scenario.step_losses(measured_dir)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (want, got)
    tol = scenario.parity_tolerance()
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= tol, f"max |Δloss| {worst:.2e} > {tol}: {got} vs {want}"
