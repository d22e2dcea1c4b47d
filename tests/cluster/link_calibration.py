"""`ndtrain calibrate --links` across the nodes of a harness.Cluster: one torchrun agent per node,
rendezvous at the first node's hostname, as training starts (agents.py). Shared by
tests/cluster/test_slow_links.py and benchmarks/slow_links.py."""

from __future__ import annotations

import json
from pathlib import Path

import agents


def calibrate_links(cluster, nproc: int, profile: Path, guard_s: float, quick: bool = False,
                    run_id: str = "links") -> tuple[dict, agents.Agents]:
    """(exit codes by node, the agents) of `calibrate --links --out profile` on every node."""
    argv = agents.torchrun_argv(len(cluster.nodes), nproc, f"{cluster.nodes[0].name}:{agents.RDZV_PORT}", run_id, [])
    argv = argv[:argv.index("-m")] + ["-m", "ndtrain", "calibrate", "--links", "--out", str(profile),
                                      *(["--quick"] if quick else [])]
    started = agents.Agents()
    for node in cluster.nodes:
        log = cluster.base / f"{node.name}-{run_id}.log"
        started.logs[node.name] = log
        started.procs[node.name] = node.popen(argv, env=agents.node_env(node), log=log, cwd=str(agents.REPO))
    return started.wait(guard_s), started


def links_section(profile: Path) -> dict:
    return json.loads(Path(profile).read_text()).get("links", {})
