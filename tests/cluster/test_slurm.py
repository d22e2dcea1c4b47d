"""examples/slurm/train.sbatch on a real Slurm across 2 nodes of the cluster harness (slow):
slurmctld on node1, munged and slurmd on each node (tests/cluster/slurm_nodes.py), the script
submitted unchanged with `sbatch --nodes=2` from a directory on the cluster's shared one, the run
and checkpoint directories there too.

What it holds: the job COMPLETED with exit 0 and no requeue, its step ran on both nodes (one
torchrun agent each, one world of 2 across them), and every sample of the stream was trained
exactly once; with node hostnames as Debian has them (each node's own name -> 127.0.1.1) as
well as each resolving to its own address. And bad input that only the run sees (a data.path
that does not exist, which the script's config check passes) ends the job with exit 2 and is not
requeued: the agents pass their workers' 2 on, instead of torchrun's 1. And Slurm's warning
before the time limit (USR1 to the batch script) saves once, requeues the job, and the requeued
job resumes there, every sample still trained once.

Each test makes its own cluster and Slurm (a few seconds); the make_cluster fixture removes
them, daemons and job steps included, pass or fail, and fails if anything is left."""

from __future__ import annotations

import sys
import time
from pathlib import Path

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


def _write_config(s, parity_base, steps: int, data=None) -> Path:
    """The run's config on the shared directory, the corpus at `data` (default: the cluster's
    copy), the checkpoints there too, none but a stop's."""
    from ndtrain.config import load_config, to_toml

    c = s.cluster
    base = scenario.with_data(parity_base, data or c.shared / "data", steps=steps)
    base["checkpoint"] = {"dir": str(c.shared / "checkpoints"), "interval_steps": 100000}
    config = c.shared / "train.toml"
    config.write_text(to_toml(load_config(None, base)))
    return config


def _sbatch(s, config: Path) -> str:
    """The example script, submitted as its header says for CPU nodes, from a directory on the
    shared one; -> the job id."""
    from fault_plan import SAMPLE_LOG_ENV  # tests/train: each rank's samples per step

    c = s.cluster
    (c.shared / "job" / "logs").mkdir(parents=True)
    env = scenario.agents.node_env(c.nodes[0], {SAMPLE_LOG_ENV: "1", "CONFIG": str(config), "WORKERS": "1",
                                                 "PYTHON": sys.executable, "RUN_DIR": str(c.shared / "run")})
    for node in c.nodes[1:]:
        scenario.agents.node_env(node)  # the suite's cache into each node's /tmp, as for node1
    return s.submit(["--nodes=2", "--cpus-per-task=1", str(SBATCH)], env=env, cwd=c.shared / "job")


def _job_log(s, job_id: str) -> str:
    log = s.cluster.shared / "job" / "logs" / f"ndtrain-{job_id}.out"
    return log.read_text(errors="replace") if log.exists() else ""


def _ended(s, job_id: str, guard_s: float, started: float) -> tuple[dict, str]:
    """The job's fields once it ended, and its log; prints what the report quotes."""
    job = s.wait(job_id, guard_s)
    print(f"{s.cluster.hostnames} hostnames, job {job_id}: JobState={job['JobState']} ExitCode={job['ExitCode']} "
          f"Restarts={job['Restarts']} NodeList={job['NodeList']} RunTime={job['RunTime']}; "
          f"{time.monotonic() - started:.0f} s from sbatch to its end")
    return job, _job_log(s, job_id)


def _submit(s, parity_base, guard_s: float, data=None) -> tuple[str, dict, str]:
    """A job of STEPS steps, waited for: (job id, its fields once it ended, its log)."""
    started = time.monotonic()
    job_id = _sbatch(s, _write_config(s, parity_base, STEPS, data))
    return (job_id, *_ended(s, job_id, guard_s, started))


def _exactly_once(run_dir: Path, steps: int, global_batch: int) -> None:
    """Steps 1..steps each trained by one whole world, the stream's first steps x global_batch
    samples each once."""
    ran = scenario.samples_by_step(run_dir)
    assert sorted(ran) == list(range(1, steps + 1)), sorted(ran)
    ids = sorted(i for step in ran.values() for i in step)
    assert ids == list(range(steps * global_batch)), ids


@pytest.mark.parametrize("hostnames", harness.HOSTNAME_STYLES)
def test_the_example_trains_across_two_nodes_exactly_once(slurm, guard, parity_base, hostnames):
    s = slurm(hostnames)
    job_id, job, log = _submit(s, parity_base, guard(300))
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
    _exactly_once(run_dir, STEPS, parity_base["train"]["global_batch"])


def test_bad_input_only_the_run_sees_ends_the_job_with_2_and_no_requeue(slurm, guard, parity_base):
    """The config check before srun cannot see that data.path does not exist; the workers can.
    torchrun retries them (--max-restarts=3), then ndtrain's agents exit with their 2, srun
    reports it, and the script ends the job with it instead of requeueing."""
    s = slurm()
    missing = s.cluster.shared / "no-such-corpus"
    job_id, job, log = _submit(s, parity_base, guard(600), data=missing)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "2:0", "0"), log + s.all_logs()
    assert "training exited with 2" in log and "bad input (2); not requeueing" in log, log
    assert "requeueing job" not in log and f"{missing}/manifest.json" in log, log
    # both agents said 2 (srun reports the highest code of its tasks)
    assert "node1: task 0: Exited with exit code 2" in log and "node2: task 1: Exited with exit code 2" in log, log


def test_a_preemption_saves_once_requeues_and_resumes_exactly_once(slurm, guard, parity_base):
    """Slurm's warning before the time limit (`scancel --signal=USR1 --batch`, what
    --signal=B:USR1@300 sends) at step 3 or later of a long run: the script's trap has every
    process of the step get TERM, the workers save once and exit 143, the agents too, and the
    script requeues the job; the requeued job (the same id, the same run directory) resumes at the
    saved step and, given a shorter run meanwhile, ends there + 3."""
    s = slurm()
    run_dir, cp_dir = s.cluster.shared / "run", s.cluster.shared / "checkpoints"
    started = time.monotonic()
    config = _write_config(s, parity_base, 100000)
    job_id = _sbatch(s, config)
    deadline = time.monotonic() + guard(300)
    while max(scenario.step_losses(run_dir), default=0) < 3:
        state = s.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, _job_log(s, job_id) + s.all_logs()
        time.sleep(0.5)
    s.run(["scancel", "--signal=USR1", "--batch", job_id])
    signalled = time.monotonic()
    requeued = s.wait(job_id, guard(300), states=("PENDING",) + slurm_nodes.FINAL_STATES)
    log = _job_log(s, job_id)
    print(f"requeued {time.monotonic() - signalled:.0f} s after the USR1: JobState={requeued['JobState']} "
          f"Restarts={requeued['Restarts']} Reason={requeued.get('Reason')}")
    assert (requeued["JobState"], requeued["Restarts"]) == ("PENDING", "1"), log + s.all_logs()
    stop = [ln for ln in log.splitlines() if "ndtrain train: stopped by SIGTERM" in ln]
    assert len(stop) == 1 and "workers exited (143)" in log and "requeueing job" in log, log
    saved = int(stop[0].split(" at step ")[1].split(";")[0])
    assert sorted(p.name for p in cp_dir.glob("step_*")) == [f"step_{saved:08d}"], log
    # The requeued job starts once Slurm lets it (cred_expire after the requeue: its old
    # credential must expire first), and trains to saved + 3.
    _write_config(s, parity_base, saved + 3)
    job, log = _ended(s, job_id, guard(300) + slurm_nodes.CRED_EXPIRE_S, started)
    print("\n".join(ln for ln in log.splitlines() if ln.startswith("ndtrain train: stopped") or "resumed from" in ln
                    or any(w in ln for w in ("workers exited", "requeueing job", "training exited"))))
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), log + s.all_logs()
    starts = [r for r in scenario.metric_rows(run_dir) if r.get("event") in ("start", "restart")]
    assert [r["world"] for r in starts] == [2, 2] and starts[-1]["step"] == saved, starts
    _exactly_once(run_dir, saved + 3, parity_base["train"]["global_batch"])
