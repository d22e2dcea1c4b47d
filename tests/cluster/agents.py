"""One torchrun agent per node of a harness.Cluster, started the way a user's launch script starts
them (examples/slurm/train.sbatch: the first node's hostname as the c10d rendezvous endpoint, one
job id, `-m ndtrain train ...`), and waited on with a hang guard."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RDZV_PORT = 29400


def node_env(node, extra: dict | None = None) -> dict:
    """This process's environment for a process on `node`: the suite's settings (threads, the
    fault-plan hook, the reference host probe) with the cache in the node's own /tmp, since the
    suite's is in this host's /tmp, which no node sees."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "TORCHELASTIC_", "MASTER_", "GLOO_", "NCCL_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache and Path(cache).is_dir() and not (node.tmp / "cache").exists():
        shutil.copytree(cache, node.tmp / "cache")
    env.update({"XDG_CACHE_HOME": "/tmp/cache", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                # as the Slurm example sets it: restarted workers get a store of their own
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    env.update(extra or {})
    return env


def torchrun_argv(nnodes: int | str, nproc: int, endpoint: str, run_id: str, train_args: list[str],
                  max_restarts: int = 0, launcher_args: list[str] | None = None) -> list[str]:
    return [str(VENV_BIN / "torchrun"), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", *(launcher_args or []), "-m", "ndtrain", "train", *train_args]


@dataclass
class Agents:
    procs: dict = field(default_factory=dict)  # node name -> Popen
    logs: dict = field(default_factory=dict)   # node name -> Path

    def wait(self, guard_s: float) -> dict[str, int]:
        """Every agent's exit code; an agent still running after `guard_s` (a hang guard, never a
        correctness condition) is killed and reported as None."""
        deadline = time.monotonic() + guard_s
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        if any(c is None for c in codes.values()):
            self.kill()
        return codes

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace") if self.logs[name].exists() else ""

    def all_logs(self) -> str:
        return "\n".join(f"---- {n} ----\n{self.log(n)[-4000:]}" for n in self.logs)


def start_agents(cluster, nproc: int, train_args: list[str], run_id: str = "job1", nodes=None,
                 nnodes: int | str | None = None, env: dict | None = None, max_restarts: int = 0,
                 launcher_args: list[str] | None = None, pin_cores: bool = False) -> Agents:
    """torchrun on each of `nodes` (default: all), rendezvous at the first node's hostname.
    pin_cores: node i's agent and workers run on core i only (taskset), so a node's CPU quota, not
    the other nodes' processes, sets its pace."""
    nodes = list(nodes or cluster.nodes)
    endpoint = f"{cluster.nodes[0].name}:{RDZV_PORT}"
    argv = torchrun_argv(nnodes or len(nodes), nproc, endpoint, run_id, train_args, max_restarts, launcher_args)
    agents = Agents()
    for i, node in enumerate(nodes):
        log = cluster.base / f"{node.name}-{run_id}.log"
        agents.logs[node.name] = log
        pinned = ["taskset", "-c", str(i % os.cpu_count())] if pin_cores else []
        agents.procs[node.name] = node.popen([*pinned, *argv], env=node_env(node, env), log=log, cwd=str(REPO))
    return agents
