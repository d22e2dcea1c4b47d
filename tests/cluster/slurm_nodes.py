"""A real Slurm on a harness.Cluster: munged and slurmd on every node, slurmctld on node1, each
started as a process of its node (in the node's cgroup and namespaces, so the cluster's clean-up
kills them and every job step with them). Debian's slurm-wlm 22.05, CPU only, no cgroup plugins
(proctrack/linuxproc, task/none), no accounting database.

Where things are: slurm.conf and the cluster's one munge key on the shared directory (every node
reads the same); each node's munge socket, daemons' state, spool, pid and log files under the
node's own /tmp (private to it, so the same paths in slurm.conf mean per-node files; from the host
they are under `node.tmp / "slurm"`). The ports are Slurm's defaults: each node has its own network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "srun", "sinfo")
LOCAL = "/tmp/slurm"  # on each node: its own (the node's private /tmp)
SOCKET = f"{LOCAL}/munge.socket"
CRED_EXPIRE_S = 30
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED")


def missing() -> str:
    """Why Slurm cannot run here, or "" when it can."""
    for tool in DAEMONS + CLIENTS:
        if shutil.which(tool) is None:
            return f"needs `{tool}` (apt-get install -y slurm-wlm munge)"
    return ""


def slurm_conf(cluster, cpus: int) -> str:
    first = cluster.nodes[0]
    lines = [
        "ClusterName=ndtc",
        f"SlurmctldHost={first.name}({first.addr})",
        # cred_expire: a requeued job waits this long before it may start again (its revoked
        # credential must expire first; 120 s by default, "Job credential revoked" if released
        # sooner). Long enough for a step to launch on a loaded host, short for a test.
        "AuthType=auth/munge", f"AuthInfo=socket={SOCKET},cred_expire={CRED_EXPIRE_S}", "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={LOCAL}/state", f"SlurmdSpoolDir={LOCAL}/spool",
        f"SlurmctldPidFile={LOCAL}/slurmctld.pid", f"SlurmdPidFile={LOCAL}/slurmd.pid",
        f"SlurmctldLogFile={LOCAL}/slurmctld.log", f"SlurmdLogFile={LOCAL}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/linear",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none", "ReturnToService=2", "MailProg=/bin/true",
        # the nodes share this machine's CPUs: each says it has them all, as configured, not probed
        "SlurmdParameters=config_overrides",
        # a finished job stays in scontrol's view long enough for the test to read its state
        "MinJobAge=3600",
        "SlurmdTimeout=60", "SlurmctldTimeout=60", "KillWait=30",
    ]
    lines += [f"NodeName={n.name} NodeAddr={n.addr} CPUs={cpus} State=UNKNOWN" for n in cluster.nodes]
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


class Slurm:
    """`Slurm(cluster, guard_s).start()`: the daemons up and every node idle; `submit`, `job`, `wait`.
    `guard_s` bounds each wait for a daemon and each Slurm command (a hang guard, never a result)."""

    def __init__(self, cluster, guard_s: float, cpus: int | None = None):
        self.cluster = cluster
        self.guard_s = guard_s
        self.dir = cluster.shared / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.key = self.dir / "munge.key"
        self.cpus = cpus or os.cpu_count() or 1
        self.daemons: list[subprocess.Popen] = []

    def env(self, extra: dict | None = None) -> dict:
        """What a command on a node needs beyond its environment: the cluster's slurm.conf."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}

    def log(self, node, name: str) -> str:
        path = node.tmp / "slurm" / name
        return path.read_text(errors="replace") if path.exists() else ""

    def all_logs(self) -> str:
        return "\n".join(f"---- {n.name} {name} ----\n{self.log(n, name)[-3000:]}"
                         for n in self.cluster.nodes for name in ("munged.log", "slurmd.log", "slurmctld.log")
                         if self.log(n, name))

    def _daemon(self, node, argv: list[str]) -> None:
        self.daemons.append(node.popen(argv, env=self.env(), log=node.tmp / "slurm" / f"{Path(argv[0]).name}.out"))

    def start(self) -> "Slurm":
        self.dir.mkdir()
        self.conf.write_text(slurm_conf(self.cluster, self.cpus))
        subprocess.run(["mungekey", "--create", f"--keyfile={self.key}"], check=True, capture_output=True)
        self.key.chmod(0o400)
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        for node in self.cluster.nodes:
            for d in ("", "state", "spool"):
                (node.tmp / "slurm" / d).mkdir(mode=0o755, exist_ok=True)
            # slurmd loads its cgroup plugin even with proctrack/linuxproc and task/none, and
            # refuses to start without a cgroup filesystem at /sys/fs/cgroup, which the node's own
            # /sys (ip netns exec mounts one) lacks. An empty v1 root is enough for it to start;
            # the node's processes stay in the node's cgroups.
            got = node.run(["mount", "-t", "tmpfs", "-o", "mode=755", "ndtc-cgroup", "/sys/fs/cgroup"])
            if got.returncode != 0:
                raise RuntimeError(f"{node.name}: mount /sys/fs/cgroup: {got.stderr.strip()}")
            # --force: the key is root's on a directory others may read (the shared one), which
            # munged otherwise refuses
            self._daemon(node, ["munged", "--foreground", "--force", f"--socket={SOCKET}", f"--key-file={self.key}",
                                f"--pid-file={LOCAL}/munged.pid", f"--log-file={LOCAL}/munged.log",
                                f"--seed-file={LOCAL}/munged.seed"])
        self._until(lambda: all((n.tmp / "slurm" / "munge.socket").exists() for n in self.cluster.nodes),
                    "munged's socket on every node")
        self._daemon(self.cluster.nodes[0], ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        for node in self.cluster.nodes:
            self._daemon(node, ["slurmd", "-D", "-c", "-N", node.name, "-f", str(self.conf)])
        self._until(self._all_idle, "every node idle in sinfo")
        return self

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return sorted(states) == [n.name for n in self.cluster.nodes] and set(states.values()) == {"idle"}

    def _until(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.guard_s
        while not ready():
            dead = [p.args for p in self.daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm: no {what} after {self.guard_s:g} s (daemons exited: {dead})\n"
                                   f"{self.all_logs()}")
            time.sleep(0.2)

    def run(self, argv: list[str], env: dict | None = None, cwd: str | Path = "/",
            check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm command on node1 (the login node too, here)."""
        proc = subprocess.run(self.cluster.nodes[0].command(argv, cwd), env=self.env(env), capture_output=True,
                              text=True, timeout=self.guard_s)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def submit(self, argv: list[str], env: dict, cwd: Path) -> str:
        """`sbatch --parsable ARGV` from `cwd` with `env` (exported to the job, as sbatch does) -> job id."""
        return self.run(["sbatch", "--parsable", *argv], env=env, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of the job (JobState, ExitCode, Restarts, NodeList, RunTime...)."""
        out = self.run(["scontrol", "-o", "show", "job", job_id]).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait(self, job_id: str, guard_s: float, states=FINAL_STATES) -> dict[str, str]:
        """The job's fields once it is in one of `states`; a hang guard, never a result."""
        deadline = time.monotonic() + guard_s
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} still {fields.get('JobState')} after {guard_s:g} s\n"
                                   f"{self.all_logs()}")
            time.sleep(0.5)
