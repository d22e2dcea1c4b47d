"""Training across nodes of a cluster in a box (tests/cluster/harness.py), each node its own
network, hostname, hosts file and /tmp, one torchrun agent per node with c10d rendezvous at the
first node's hostname (examples/slurm/train.sbatch's way): the loss equals one process's within
the layout-parity tolerance, for both ways a cluster's hosts file names a node.

- `loopback`: each node's own name resolves to 127.0.1.1 (Debian's default), the others' to their
  addresses. Gloo would advertise 127.0.1.1 to its peers and the group would not form (or hang);
  ndtrain picks the interface that reaches MASTER_ADDR and says so in one line per node.
- `own-address`: every name resolves to the node's address, as on a well-kept cluster; nothing
  needs choosing, and nothing is said.

The default suite runs one spawn (loopback names, FSDP over 2 nodes); the other layouts are slow:
DDP and PP across 2 nodes x 1 rank, HSDP (replicas across nodes, shards within), TP within a node
and FSDP over 2 nodes x 2 ranks."""

from __future__ import annotations

import pytest
import scenario

STEPS = 3


def _parity(make_cluster, guard, parity_base, hostnames: str, spec: str, nproc: int):
    cluster = make_cluster(2, hostnames)
    base = scenario.with_data(parity_base, cluster.shared / "data")
    config = scenario.write_config(cluster, base, spec)
    ref = scenario.reference_losses(base, STEPS)
    run_dir = cluster.shared / "run"
    codes, started = scenario.train_across(cluster, config, run_dir, nproc, guard(60),
                                           extra=[f"--train.steps={STEPS}"])
    logs = started.all_logs()
    assert codes == {"node1": 0, "node2": 0}, logs
    got = scenario.step_losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), logs
    tol = scenario.parity_tolerance()
    worst = max(abs(got[s + 1] - ref[s]) for s in range(STEPS))
    assert worst <= tol, f"{spec} on 2 nodes x {nproc}: max |Δloss| {worst:.2e} > {tol} ({got} vs {ref})"
    chose = [n for n in ("node1", "node2") if "ranks here use interface eth0" in started.log(n)]
    return chose, started


@pytest.mark.timeout(900)
def test_loopback_hostnames_fsdp_across_two_nodes_matches_one_process(make_cluster, guard, parity_base):
    chose, started = _parity(make_cluster, guard, parity_base, "loopback", "dp_shard=2", nproc=1)
    assert chose == ["node1", "node2"], started.all_logs()  # one line per node, each naming the interface


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("spec", ["dp_replicate=2", "pp=2"])
def test_own_address_hostnames_two_nodes_one_rank_each(make_cluster, guard, parity_base, spec):
    chose, started = _parity(make_cluster, guard, parity_base, "own-address", spec, nproc=1)
    assert chose == [], started.all_logs()  # a name that resolves to the node's address needs nothing


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("spec", ["dp_replicate=2,dp_shard=2", "dp_shard=2,tp=2", "dp_shard=4"])
def test_two_nodes_two_ranks_each(make_cluster, guard, parity_base, spec):
    # dp_replicate is the mesh's outer dimension: ranks 0,1 (node1) and 2,3 (node2) are the two
    # replicas; tp is the inner one, so a TP pair never leaves its node.
    _parity(make_cluster, guard, parity_base, "loopback", spec, nproc=2)
