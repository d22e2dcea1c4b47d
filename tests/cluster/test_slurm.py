"""examples/slurm/train.sbatch on a real Slurm across 2 nodes of the cluster harness (slow):
slurmctld on node1, munged and slurmd on each node (tests/cluster/slurm_nodes.py), the script
submitted unchanged with `sbatch --nodes=2` from a directory on the cluster's shared one, the run
and checkpoint directories there too.

What it holds: the job COMPLETED with exit 0 and no requeue, its step ran on both nodes (one
torchrun agent each, one world of 2 across them), and every sample of the stream was trained
exactly once; with node hostnames as Debian has them (each node's own name -> 127.0.1.1) as
well as each resolving to its own address. And bad input that only the run sees (a data.path
that does not exist, which the script's config check passes) ends the job with exit 2 and is not
requeued: the agents pass their workers' 2 on, instead of torchrun's 1."""

from __future__ import annotations

import sys
import time

import harness
import pytest
import scenario
import slurm_nodes

SBATCH = scenario.agents.REPO / "examples" / "slurm" / "train.sbatch"
STEPS = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture
def slurm(make_cluster, guard):
    """slurm(hostnames) -> a started slurm_nodes.Slurm on a new 2-node cluster; the cluster's
    clean-up (every process of each node's cgroup, its /tmp, the shared directory) removes it."""
    why = harness.missing_requirements() or slurm_nodes.missing()
    if why:
        pytest.skip(why)

    def make(hostnames: str = "own-address") -> slurm_nodes.Slurm:
        return slurm_nodes.Slurm(make_cluster(2, hostnames), guard(60)).start()
    return make


def _submit(s, parity_base, guard_s: float, data=None) -> tuple[str, dict, float, str]:
    """The example script, as its header says to submit it on CPU nodes, with the corpus at `data`
    (default: the cluster's copy); -> (job id, the job's fields once it ended, seconds from
    submission to the end, the job's log)."""
    from fault_plan import SAMPLE_LOG_ENV  # tests/train: each rank's samples per step

    from ndtrain.config import load_config, to_toml

    c = s.cluster
    base = scenario.with_data(parity_base, data or c.shared / "data", steps=STEPS)
    base["checkpoint"] = {"dir": str(c.shared / "checkpoints"), "interval_steps": 100000}
    config = c.shared / "train.toml"
    config.write_text(to_toml(load_config(None, base)))
    job_dir = c.shared / "job"
    (job_dir / "logs").mkdir(parents=True)
    env = scenario.agents.node_env(c.nodes[0], {SAMPLE_LOG_ENV: "1", "CONFIG": str(config), "WORKERS": "1",
                                                 "PYTHON": sys.executable, "RUN_DIR": str(c.shared / "run")})
    for node in c.nodes[1:]:
        scenario.agents.node_env(node)  # the suite's cache into each node's /tmp, as for node1
    started = time.monotonic()
    job_id = s.submit(["--nodes=2", "--cpus-per-task=1", str(SBATCH)], env=env, cwd=job_dir)
    job = s.wait(job_id, guard_s)
    took = time.monotonic() - started
    log = job_dir / "logs" / f"ndtrain-{job_id}.out"
    print(f"{c.hostnames} hostnames, job {job_id}: JobState={job['JobState']} ExitCode={job['ExitCode']} Restarts={job['Restarts']} "
          f"NodeList={job['NodeList']} RunTime={job['RunTime']}; {took:.0f} s from sbatch to its end")
    return job_id, job, took, log.read_text(errors="replace") if log.exists() else ""


@pytest.mark.parametrize("hostnames", harness.HOSTNAME_STYLES)
def test_the_example_trains_across_two_nodes_exactly_once(slurm, guard, parity_base, hostnames):
    s = slurm(hostnames)
    job_id, job, took, log = _submit(s, parity_base, guard(300))
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), log + s.all_logs()
    assert job["NodeList"] == "node[1-2]" and "training exited with 0" in log, log
    if hostnames == "loopback":
        # Each node's own name is 127.0.1.1 there: the ranks took the interface reaching node1.
        for node in s.cluster.nodes:
            assert f"this host's name '{node.name}' resolves to 127.0.1.1 (loopback)" in log, log
            assert f"interface eth0 ({node.addr})" in log, log
    # The step's tasks ran on both nodes (each slurmd launched one), and they formed one world of 2.
    for node in s.cluster.nodes:
        assert f"launch task StepId={job_id}.0 " in s.log(node, "slurmd.log"), s.all_logs()
    run_dir = s.cluster.shared / "run"
    starts = [r for r in scenario.metric_rows(run_dir) if r.get("event") in ("start", "restart")]
    assert [r["world"] for r in starts] == [2], starts
    # Exactly once: steps 1..STEPS each trained by the whole world, the stream's first
    # STEPS x global_batch samples each once.
    ran = scenario.samples_by_step(run_dir)
    assert sorted(ran) == list(range(1, STEPS + 1)), sorted(ran)
    ids = sorted(i for step in ran.values() for i in step)
    assert ids == list(range(STEPS * parity_base["train"]["global_batch"])), ids


def test_bad_input_only_the_run_sees_ends_the_job_with_2_and_no_requeue(slurm, guard, parity_base):
    """The config check before srun cannot see that data.path does not exist; the workers can.
    torchrun retries them (--max-restarts=3), then ndtrain's agents exit with their 2, srun
    reports it, and the script ends the job with it instead of requeueing."""
    s = slurm()
    missing = s.cluster.shared / "no-such-corpus"
    job_id, job, took, log = _submit(s, parity_base, guard(600), data=missing)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "2:0", "0"), log + s.all_logs()
    assert "training exited with 2" in log and "bad input (2); not requeueing" in log, log
    assert "requeueing job" not in log and f"{missing}/manifest.json" in log, log
    # both agents said 2 (srun reports the highest code of its tasks)
    assert "node1: task 0: Exited with exit code 2" in log and "node2: task 1: Exited with exit code 2" in log, log
