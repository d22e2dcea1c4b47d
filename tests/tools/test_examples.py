"""The launch examples parse and carry what a real cluster needs: torchrun's shutdown timeout
raised to fit the preemption grace period, Slurm's CPU binding, node-loss and log-directory
pitfalls handled, /dev/shm in every pod, the ConfigMap wired to the config path, and a global
batch that divides every world size a job can shrink or grow to."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from ndtrain.config import load_config  # noqa: E402
from ndtrain.errors import NdtrainError  # noqa: E402
from ndtrain.parallel.dims import checked_layout  # noqa: E402
from ndtrain.train.signals import EXIT_PREEMPTED  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
K8S = ROOT / "examples" / "kubernetes"
TORCHRUN_DEFAULT_SHUTDOWN_S = 30  # torch 2.13, torch/distributed/launcher/api.py
AGENT = ["python", "-m", "ndtrain.train.agent"]  # torchrun with ndtrain's exit codes (train/agent.py)


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def _check_global_batch(config_text: str, worlds: list[int], tmp_path: Path) -> None:
    path = tmp_path / "train.toml"
    path.write_text(config_text)
    cfg = load_config(str(path))
    for world in worlds:
        # raises when the batch does not split over dp ranks: the batch rule is the layout's (layout/rules.py)
        checked_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len, cfg.train)


# ---- Slurm -----------------------------------------------------------------------------------

def _sbatch() -> tuple[str, dict[str, str], list[str], dict[str, str]]:
    text = SBATCH.read_text()
    directives = {}
    for m in re.finditer(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", text, re.M):
        directives[m[1]] = m[2] or ""
    # the srun command, with its backslash continuations joined
    joined = text.replace("\\\n", " ")
    srun = shlex.split(next(line for line in joined.splitlines() if line.startswith("srun ")).rstrip("&"))
    # NAME=123 or NAME=${NAME:-123}: the numbers the script uses unless the caller overrides them
    defaults = dict(re.findall(r"^(\w+)=(?:\$\{\w+:-)?(\d+)\}?(?=\s|$)", text, re.M))
    return text, directives, srun, defaults


def test_slurm_script_is_valid_bash():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_slurm_grace_period_survives_torchrun():
    text, directives, srun, defaults = _sbatch()
    lead = int(re.fullmatch(r"B:USR1@(\d+)", directives["signal"])[1])
    assert int(defaults["GRACE_S"]) == lead
    assert _flag(srun, "--shutdown-timeout") == "$SHUTDOWN_TIMEOUT"
    shutdown = int(defaults["SHUTDOWN_TIMEOUT"])
    # Longer than torchrun's default (which would SIGKILL a worker mid-save), shorter than the
    # signal's lead so torchrun and the requeue finish before Slurm's hard kill.
    assert TORCHRUN_DEFAULT_SHUTDOWN_S * 4 <= shutdown < lead
    assert re.search(r"^trap stop_and_requeue USR1 TERM", text, re.M)
    # The trap signals the step's processes through Slurm (scancel --signal), which leaves them
    # the grace period; `kill -TERM $SRUN_PID` made srun end the step, bounded by KillWait (30 s).
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in text and not re.search(r"^\s*kill -TERM", text, re.M)
    assert "requeue" in directives


def test_slurm_cpus_node_loss_log_dir_and_rendezvous():
    text, directives, srun, _ = _sbatch()
    # srun does not inherit --cpus-per-task (Slurm >= 22.05): exported before srun runs.
    export = re.search(r"^export SRUN_CPUS_PER_TASK=\$SLURM_CPUS_PER_TASK$", text, re.M)
    assert "cpus-per-task" in directives and export and export.start() < text.index("\nsrun ")
    # A lost node keeps the job and the step alive, and torchrun may shrink.
    assert "no-kill" in directives and "--no-kill" in srun[: srun.index("ndtrain.train.agent")]
    nnodes = _flag(srun, "--nnodes")
    assert nnodes == "${MIN_NODES}:${SLURM_JOB_NUM_NODES}"
    # The log directory exists before Slurm opens --output: the documented command creates it.
    log_dir = Path(directives["output"]).parent
    usage = [line for line in text.splitlines() if "sbatch " in line and "examples/slurm/train.sbatch" in line]
    assert len(usage) == 2 and all(f"mkdir -p {log_dir} && " in line for line in usage), usage  # GPU and CPU
    # The rendezvous host is documented as a single point of failure and its loss requeues the job
    # (bounded), or the endpoint moves out of the job.
    assert "single point of failure" in text
    assert _flag(srun, "--rdzv-endpoint") == "$RDZV_ENDPOINT" and "RDZV_ENDPOINT=${RDZV_ENDPOINT:-" in text
    assert re.search(r'SLURM_RESTART_COUNT:-0}" -lt "\$MAX_REQUEUES"', text)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text and _flag(srun, "--rdzv-conf") == "last_call_timeout=2"


def _gpu_command(text: str) -> list[str]:
    """The documented GPU submission: `sbatch --nodes=N --gpus-per-node=G examples/slurm/train.sbatch`."""
    line = next(line for line in text.splitlines() if "--gpus-per-node=" in line and "sbatch " in line)
    return shlex.split(line.split("&&", 1)[1].split("#", 1)[0])


def test_slurm_global_batch_divides_every_world(tmp_path):
    text, directives, srun, _ = _sbatch()
    config = ROOT / re.search(r"CONFIG=\$\{CONFIG:-(\S+)\}", text)[1]
    command = _gpu_command(text)
    gpus = int(_flag(command, "--gpus-per-node"))
    # the script's own node count, shrunk down to one node, and the documented command's
    worlds = [n * gpus for n in range(1, int(directives["nodes"]) + 1)] + [int(_flag(command, "--nodes")) * gpus]
    _check_global_batch(config.read_text(), worlds, tmp_path)


def test_slurm_gpus_are_requested_by_the_command_and_python_is_explicit():
    text, directives, srun, _ = _sbatch()
    # A #SBATCH GPU request is refused outright by a cluster without a gpu GRES (Slurm 22.05:
    # "Invalid generic resource (gres) specification"), so it is on the documented command only.
    assert not any(k.startswith("gpu") or k == "gres" for k in directives), directives
    assert _gpu_command(text)[-1] == "examples/slurm/train.sbatch"
    assert _flag(srun, "--nproc-per-node") == "$WORKERS"
    assert "WORKERS=${WORKERS:-${SLURM_GPUS_ON_NODE:-1}}" in text
    # torchrun need not be on any node's PATH: the job's Python runs ndtrain's agent (torchrun, which
    # exits with its workers' 143 after a stop and their 2 for bad input instead of its own 1).
    launcher = srun[srun.index("--kill-on-bad-exit=0") + 1:][:3]
    assert launcher == ["$PYTHON", "-m", "ndtrain.train.agent"] and "PYTHON=${PYTHON:-python3}" in text


# The script run for real, against stand-ins: srun, scontrol and scancel log what they are asked;
# python either is the job's real one (ndtrain's own config check) or logs its arguments too.
def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _run_sbatch(tmp_path: Path, *, hang_deadline, srun_exit: int = 0, python: str | None = None, **env: str):
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir(exist_ok=True)
    _stub(bin_dir / "srun", f'echo "srun $*" >> {log}\necho "step sees OMP_NUM_THREADS=$OMP_NUM_THREADS" >> {log}\n'
                            f'exit {srun_exit}\n')
    _stub(bin_dir / "scancel", f'echo "scancel $*" >> {log}\n')
    _stub(bin_dir / "scontrol", f'[ "$1" = show ] && echo node1 && exit 0\necho "scontrol $*" >> {log}\n')
    # the stand-in python fails the check for the world named by CHECK_FAILS (with exit 2, as ndtrain does)
    _stub(bin_dir / "python3", f'echo "python3 $*" >> {log}\n'
                               '[[ " $* " == *" --world ${CHECK_FAILS:-none} "* ]] && exit 2\nexit 0\n')
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "ndtrain",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "8",
            "RUN_DIR": str(tmp_path / "run"), "HOME": os.environ.get("HOME", str(tmp_path))}
    if python:
        base["PYTHON"] = python
    proc = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env={**base, **env}, capture_output=True,
                          text=True, timeout=hang_deadline(120))
    lines = log.read_text().splitlines() if log.exists() else []
    return proc.returncode, lines, proc.stdout + proc.stderr


@pytest.mark.parametrize("env,workers,threads", [({}, 1, 8), ({"SLURM_GPUS_ON_NODE": "4"}, 4, 2),
                                                 ({"SLURM_GPUS_ON_NODE": "4", "WORKERS": "3"}, 3, 2)])
def test_slurm_workers_per_node(tmp_path, env, workers, threads, hang_deadline):
    rc, log, out = _run_sbatch(tmp_path, MIN_NODES="1", hang_deadline=hang_deadline, **env)
    assert rc == 0, out
    checks = [line for line in log if line.startswith("python3 ")]
    # every world the job may run on, one node to both, is checked before the step starts
    assert [c.split("--world ")[1].split()[0] for c in checks] == [str(workers), str(2 * workers)], log
    (srun,) = [shlex.split(line) for line in log if line.startswith("srun ")]
    assert _flag(srun, "--nproc-per-node") == str(workers) and srun[3:6] == ["python3", "-m", "ndtrain.train.agent"]
    assert log.index(checks[-1]) < next(i for i, line in enumerate(log) if line.startswith("srun ")), log
    # the node's CPUs (SLURM_CPUS_PER_TASK=8) split among its workers
    assert f"step sees OMP_NUM_THREADS={threads}" in log


# 2: bad input only the run saw (the agents pass their workers' 2 on), never requeued
@pytest.mark.parametrize("srun_exit,restarts,requeued,rc", [(0, "0", False, 0), (1, "0", True, 0), (1, "3", False, 1),
                                                            (2, "0", False, 2)])
def test_slurm_step_failure_is_requeued_a_bounded_number_of_times(tmp_path, srun_exit, restarts, requeued, rc,
                                                                  hang_deadline):
    got, log, out = _run_sbatch(tmp_path, srun_exit=srun_exit, SLURM_RESTART_COUNT=restarts, hang_deadline=hang_deadline)
    assert got == rc, out
    assert ("scontrol requeue 4242" in log) == requeued, log


def test_slurm_shrunk_world_that_does_not_fit_is_refused_before_the_step(tmp_path, hang_deadline):
    # 2 nodes x 1 worker may shrink to 1 node: a config that fails there fails the job now.
    rc, log, out = _run_sbatch(tmp_path, MIN_NODES="1", CHECK_FAILS="1", hang_deadline=hang_deadline)
    assert rc == 2 and not any(line.startswith(("srun", "scontrol")) for line in log), (log, out)
    assert "not starting, not requeueing" in out and not (tmp_path / "run").exists()


def test_slurm_bad_config_exits_2_without_a_step_or_a_requeue(tmp_path, hang_deadline):
    """A bad config is refused before any step, with ndtrain's real check: no worker starts, and
    torchrun does not retry it --max-restarts times."""
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "configs" / "debug.toml").read_text() + "no_such_key = 1\n")
    rc, log, out = _run_sbatch(tmp_path, python=sys.executable, CONFIG=str(bad), hang_deadline=hang_deadline)
    assert rc == 2, out
    assert "train.no_such_key" in out and "not starting, not requeueing" in out
    assert not any(line.startswith(("srun", "scontrol", "scancel")) for line in log), log
    assert not (tmp_path / "run").exists()


# ---- Kubernetes ------------------------------------------------------------------------------

def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "Job":
        return [doc["spec"]["template"]]
    if doc["kind"] == "PyTorchJob":
        return [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    return []


def _jobs() -> list[tuple[str, dict]]:
    return [(name, d) for name in ("indexed-job.yaml", "pytorchjob.yaml") for d in _docs(name) if _pod_templates(d)]


def _config_map() -> dict:
    (cm,) = _docs("configmap.yaml")
    assert cm["kind"] == "ConfigMap"
    return cm


def test_kubernetes_examples_cover_both_jobs():
    assert sorted(name for name, _ in _jobs()) == ["indexed-job.yaml", "pytorchjob.yaml"]


@pytest.mark.parametrize("name", ["indexed-job.yaml", "pytorchjob.yaml"])
def test_kubernetes_pods_have_shm_grace_and_the_config(name):
    cm = _config_map()
    for _, job in [j for j in _jobs() if j[0] == name]:
        for template in _pod_templates(job):
            spec = template["spec"]
            volumes = {v["name"]: v for v in spec["volumes"]}
            (container,) = spec["containers"]
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
            # The config the command reads is the ConfigMap's key, mounted where the command looks.
            config_path = _flag(container["args"], "--config")
            mount = str(Path(config_path).parent)
            assert volumes[mounts[mount]]["configMap"]["name"] == cm["metadata"]["name"]
            assert Path(config_path).name in cm["data"]
            # The agent (torchrun underneath) must give the workers time to save after SIGTERM,
            # within the pod's grace.
            assert container["command"] == AGENT
            shutdown = int(_flag(container["args"], "--shutdown-timeout"))
            assert TORCHRUN_DEFAULT_SHUTDOWN_S * 4 <= shutdown < spec["terminationGracePeriodSeconds"]
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_kubernetes_jobs_fail_on_bad_input_and_retry_a_saved_preemption():
    """Both jobs read the agent's exit codes: the workers' 2 (bad input) ends the job, 143 (a
    preemption that saved) restarts the pod. Plain torchrun exits 1 for both."""
    bad, saved = NdtrainError.exit_code, EXIT_PREEMPTED
    assert __import__("importlib").util.find_spec(AGENT[-1]) is not None
    (job,) = [d for d in _docs("indexed-job.yaml") if d["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    rules = job["spec"]["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert [r["onExitCodes"]["values"] for r in fail] == [[bad]]
    assert fail[0]["onExitCodes"]["operator"] == "In"
    assert fail[0]["onExitCodes"]["containerName"] == job["spec"]["template"]["spec"]["containers"][0]["name"]
    assert not any(saved in r.get("onExitCodes", {}).get("values", []) for r in rules)  # 143 is retried
    (pt,) = [d for d in _docs("pytorchjob.yaml") if d["kind"] == "PyTorchJob"]
    worker = pt["spec"]["pytorchReplicaSpecs"]["Worker"]
    # The training operator's ExitCode policy: 1-127 are permanent, 128-255 (signals) retried.
    assert worker["restartPolicy"] == "ExitCode" and 1 <= bad <= 127 and 128 <= saved <= 255


def test_indexed_job_states_the_version_backoff_limit_per_index_needs():
    text = (K8S / "indexed-job.yaml").read_text()
    (job,) = [d for d in _docs("indexed-job.yaml") if d["kind"] == "Job"]
    assert job["spec"]["backoffLimitPerIndex"] > 0 and job["spec"]["completionMode"] == "Indexed"
    assert re.search(r"Kubernetes 1\.29 or newer", text) and "JobBackoffLimitPerIndex" in text
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert int(_flag(args, "--nnodes").split(":")[-1]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert _flag(args, "--rdzv-endpoint").startswith(f"{job['metadata']['name']}-0.")


def test_kubernetes_global_batch_divides_every_world_the_jobs_can_run_on(tmp_path):
    config = _config_map()["data"]["train.toml"]
    worlds = set()
    for name, job in _jobs():
        args = _pod_templates(job)[0]["spec"]["containers"][0]["args"]
        gpus = int(_flag(args, "--nproc-per-node"))
        if job["kind"] == "PyTorchJob":
            lo, hi = job["spec"]["elasticPolicy"]["minReplicas"], job["spec"]["elasticPolicy"]["maxReplicas"]
        else:
            lo, hi = map(int, _flag(args, "--nnodes").split(":"))
        worlds |= {n * gpus for n in range(lo, hi + 1)}
    assert worlds == {8, 16, 24, 32}
    _check_global_batch(config, sorted(worlds), tmp_path)
    with pytest.raises(Exception, match="cannot be split evenly"):  # the check has teeth
        _check_global_batch(config.replace("global_batch = 96", "global_batch = 64"), sorted(worlds), tmp_path)
