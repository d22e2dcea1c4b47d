"""Self-healing runs: a host whose rank keeps straggling (on_straggler), or whose ranks keep
dying or hanging (on_failure, from a ledger in the run directory), is taken out of the job, and
the rest re-form without it under torchrun's elastic rendezvous (`--nnodes MIN:MAX`), re-planned
for the smaller world ([resilience] keys, docs/self-healing.md). An agent that joins later is
taken in by torch elastic itself (the workers stop on SIGTERM at a step boundary and save);
with grow_back=false a host excluded before leaves again at once.

Membership is torch elastic's, not ours. Every rank takes the decision together, at a step
boundary, from values that are already all-reduced (the straggler comparison) or from files
every rank reads after the same collective (the ledgers), so no rank can disagree. Then the job
saves, and:
- the workers of the excluded host signal their agent (SIGTERM) and exit EXIT_EXCLUDED. An agent
  that dies on a signal leaves the rendezvous open (torch.distributed.launcher.api.launch_agent
  skips its shutdown there, so that the others can re-form); one that ended on a failed worker
  would close it for everybody;
- the others exit EXIT_REFORM, a failure, so their agents restart them (one of --max-restarts);
  they re-rendezvous without the excluded agent, resolve the plan for the new world as a fresh run
  does (train/plan.py) and resume from the checkpoint just saved (resume-anywhere), the global
  batch kept through accumulation. The next attempt's first lines say old and new layout, and why.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.launch_env import agents, group_rank, local_rank, restarts_left, run_id
from ndtrain.train.run_files import open_run_log, write_run_file

EXIT_EXCLUDED = 73  # this rank's host was taken out: its agent leaves the rendezvous
EXIT_REFORM = 75  # a peer's host was taken out: the agent restarts this worker into the smaller group
HOST_ENV = "NDTRAIN_HOST_ID"  # a host's name in the policy (default: the hostname); tests run agents on one machine
AGENT_GRACE_S = 5.0  # how long an excluded worker waits for its agent's SIGTERM before exiting on its own
# When this worker's imports were done (job.py imports this module after torch, before the process
# group forms): the report splits a membership change's re-rendezvous from its reshard here.
IMPORTED_AT = time.time()


def host_id() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def process_started() -> float | None:
    """Wall time this process started (Linux /proc; None elsewhere). torchrun spawns its workers
    once the rendezvous round is complete, so for a worker this is the re-rendezvous's end."""
    try:
        stat = Path("/proc/self/stat").read_text()
        boot = next(float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime "))
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


@dataclass(frozen=True)
class Leave:
    """What this rank does once the exclusion's checkpoint is saved."""

    code: int  # EXIT_EXCLUDED or EXIT_REFORM
    reason: str  # one line: who, why, what happens next


def refusal(cfg, world: int, leaving: int, agent_count: int, restarts: int) -> str:
    """Why a host with `leaving` of the `world` ranks cannot be taken out now ('' where it can)."""
    res = cfg.resilience
    if agent_count <= 1:
        return ("it is the only agent in the rendezvous (exclusion needs several torchrun agents, "
                "--nnodes MIN:MAX with MAX > 1)")
    new_world = world - leaving
    if new_world < res.min_world:
        return f"the run would shrink to {new_world} ranks, below resilience.min_world={res.min_world}"
    if restarts < 1:
        return "the other agents have no restart left to re-form with (torchrun --max-restarts)"
    return plan_problem(cfg, new_world)


def plan_problem(cfg, world: int) -> str:
    """'' where the job resolves for `world` ranks as a fresh run would; else its first line.
    The configured degrees are checked as written; with parallel.auto the planner chooses again."""
    from ndtrain.train.plan import resolve_plan

    try:
        resolve_plan(cfg, world, measure_host=False)
    except NdtrainError as exc:
        return f"the job does not resolve for {world} ranks: {str(exc).splitlines()[0]}"
    return ""


def slowest_agent(named: list[tuple[int, float]], groups: list[int], hosts: list[str]) -> tuple[int, list[int], str]:
    """The slowest named rank's agent (group rank), every rank it holds, and its host's name."""
    rank, _ = max(named, key=lambda rr: rr[1])
    group = groups[rank]
    return group, [r for r, g in enumerate(groups) if g == group], hosts[rank]


class Exclusion:
    """The policy of one attempt: who is who (gathered once, at start) and whether an exclusion
    was already refused (said once; the strikes go on and would repeat it every window)."""

    def __init__(self, cfg, persist: int, groups: list[int], hosts: list[str], restarts: int):
        self.cfg, self.persist, self.groups, self.hosts = cfg, persist, groups, hosts
        # The fewest restarts any agent has left: agents that joined later count theirs from 0, and
        # every rank must judge "no restart left" alike.
        self.restarts = restarts
        self.refused = False

    @classmethod
    def start(cls, cfg, persist: int) -> Exclusion | None:
        """None where the policy is `log` or the run is one process. A collective otherwise: every
        rank calls it at the same point (Recovery's construction)."""
        from ndtrain.train.distributed import gather_objects, group_active

        res = cfg.resilience
        if "exclude" not in (res.on_straggler, res.on_failure) or not group_active():
            return None
        table = gather_objects((group_rank(), host_id(), restarts_left()))
        return cls(cfg, persist, [g for g, _, _ in table], [h for _, h, _ in table], min(r for _, _, r in table))

    def decide(self, step: int, named: list[tuple[int, float]], rank: int, world: int, layout: str,
               event) -> Leave | None:
        """From the all-reduced comparison: every rank decides alike. `event(row, text)` logs."""
        if self.cfg.resilience.on_straggler != "exclude":
            return None
        group, ranks, host = slowest_agent(named, self.groups, self.hosts)
        worst = max(named, key=lambda rr: rr[1])
        why = f"rank {worst[0]} ran {worst[1]:.2f}x the median busy time in {self.persist} straggler windows running"
        reason = (f"host {host} (agent {group}, ranks {ranks}) excluded at step {step}: {why} "
                  f"(resilience.on_straggler=exclude); the other {world - len(ranks)} ranks re-form from this "
                  f"step's checkpoint")
        return self._exclude(event, host, ranks, why, reason, rank, world, "logging only",
                             {"agent": group, "layout": layout})

    def at_start(self, run_dir: Path | None, step: int, rank: int, world: int, event) -> Leave | None:
        """Before the first step of an attempt: a host this run excluded before, back in the
        rendezvous with grow_back=false, or (on_failure=exclude) a host whose ranks failed or hung
        `failures` times within `failure_window_s`, leaves. Every rank reads the same files after
        the gather in `start` (every rank's ledger entry is written before it), so all decide alike."""
        res = self.cfg.resilience
        if run_dir is None:
            return None
        found = None
        if not res.grow_back:
            before = excluded_hosts(run_dir)
            back = next((h for h in self.hosts if h in before), None)
            if back is not None:
                found = back, f"host {back} was excluded earlier in this run and resilience.grow_back=false"
        if found is None and res.on_failure == "exclude":
            counts = failure_counts(run_dir, time.time() - res.failure_window_s)
            bad = next((h for h in self.hosts if counts.get(h, 0) >= res.failures), None)
            if bad is not None:
                found = bad, (f"its ranks failed or hung {counts[bad]} times within resilience.failure_window_s="
                              f"{res.failure_window_s:g} s (resilience.on_failure=exclude, failures={res.failures})")
        if found is None:
            return None
        host, why = found
        ranks = [r for r, h in enumerate(self.hosts) if h == host]
        reason = (f"host {host} (ranks {ranks}) excluded at step {step}: {why}; the other {world - len(ranks)} ranks "
                  f"re-form from this step's checkpoint")
        return self._exclude(event, host, ranks, why, reason, rank, world, "it trains with the others", {})

    def _exclude(self, event, host: str, ranks: list[int], why: str, reason: str, rank: int, world: int,
                 otherwise: str, extra: dict) -> Leave | None:
        """Both paths' last step: refused (said once) where the smaller world may not run, else the
        logged exclusion and this rank's way out (leave with its host, or re-form without it)."""
        refused = refusal(self.cfg, world, len(ranks), agents(), self.restarts)
        if refused:
            if not self.refused:
                event({"event": "exclude_refused", "host": host, "reason": why, "refused": refused},
                      f"not excluding host {host}: {why}, but {refused}; {otherwise}")
            self.refused = True
            return None
        event({"event": "exclude", "host": host, "ranks": ranks, "reason": reason, "world": world,
               "new_world": world - len(ranks), **extra, "time": time.time()}, reason)
        return Leave(EXIT_EXCLUDED if rank in ranks else EXIT_REFORM, reason)


# ---- the failure ledger: which host's ranks failed or hung, and when -------------------------
# <run dir>/resilience/alive.<host>.<local rank>.json: this worker's marker while it runs (pid,
# rank), ended on every exit through Recovery.close. A marker its successor finds neither ended
# nor alive is a worker that died without a word (SIGKILL, a segfault, the OOM killer): a strike.
# The watchdog writes its own strike ("hang") and ends its marker before it exits.
def _ledger(run_dir: Path) -> Path:
    return Path(run_dir) / "resilience"


def _marker(run_dir: Path) -> Path:
    return _ledger(run_dir) / f"alive.{host_id()}.{local_rank()}.json"


def strike(run_dir: Path, rank: int, why: str) -> None:
    """One failure of this host's ranks (one line, appended: each under the size writes keep whole)."""
    _ledger(run_dir).mkdir(parents=True, exist_ok=True)
    with open_run_log(_ledger(run_dir) / "failures.jsonl") as f:
        f.write(json.dumps({"time": time.time(), "host": host_id(), "rank": rank, "why": why}) + "\n")


def mark_alive(run_dir: Path, rank: int) -> None:
    """At a worker's start: a strike for a predecessor (this host, this local rank) that died
    without a word, then this worker's own marker."""
    from ndtrain.train.distributed import _alive

    path = _marker(run_dir)
    try:
        before = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        before = None
    if before and not before.get("ended") and not _alive(int(before.get("pid", 0))):
        strike(run_dir, int(before.get("rank", -1)), f"rank {before.get('rank')} (pid {before.get('pid')}) "
                                                     f"died without a word")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_run_file(path, json.dumps({"pid": os.getpid(), "rank": rank, "started": time.time()}))


def mark_ended(run_dir: Path) -> None:
    path = _marker(run_dir)
    try:
        row = json.loads(path.read_text())
        if row.get("pid") == os.getpid():
            write_run_file(path, json.dumps({**row, "ended": time.time()}))
    except (OSError, json.JSONDecodeError):
        pass


def _rows(path: Path) -> list[dict]:
    """The JSON rows of a .jsonl file; none if it is unreadable, a torn or bad line skipped (a
    killed writer can leave one)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict)]


def failure_counts(run_dir: Path, since: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in _rows(_ledger(run_dir) / "failures.jsonl"):
        if row.get("time", 0) >= since:
            counts[row.get("host")] = counts.get(row.get("host"), 0) + 1
    return counts


def excluded_hosts(run_dir: Path) -> set[str]:
    """Every host an `exclude` event of this run's metrics.jsonl names."""
    out = set()
    for row in _rows(Path(run_dir) / "metrics.jsonl"):
        if row.get("event") == "exclude" and row.get("host"):
            out.add(row["host"])
    return out


def leave(decision: Leave, rank: int) -> None:
    """Exit for a membership change (never returns). The excluded host's local rank 0 signals
    its agent first, so that the agent leaves the rendezvous instead of restarting its workers."""
    from ndtrain.train.signals import hold

    hold()  # the agent's own SIGTERM (forwarded to its workers) must not turn the code into -15
    if decision.code == EXIT_EXCLUDED or rank == 0:
        print(f"ndtrain train: rank {rank}: {decision.reason}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if decision.code == EXIT_EXCLUDED and local_rank() == 0:
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(AGENT_GRACE_S)  # the agent stops its workers now; this exit is the fallback
    os._exit(decision.code)


def launch_id() -> str:
    """Who launched this attempt: torchrun's run id (the same for its restarts and re-rendezvous;
    `--standalone` draws a new one per launch), else a fresh id (a process with no agent is
    never restarted in place: each is a launch of its own). Each start row records it."""
    return run_id() or f"process-{uuid.uuid4().hex[:12]}"


def new_launch(previous: dict, start: dict) -> bool | None:
    """Whether the start row `start` began a new launch (a user's new `ndtrain train`, not torchrun
    restarting or re-forming the group) after the attempt whose start row is `previous`: True,
    False, or None when the rows cannot tell (written before starts recorded their launch).
    The restart count cannot tell: each agent keeps its own, and after a re-formation rank 0 may
    be on an agent that joined late and counts from 0."""
    if "launch" in previous and "launch" in start:
        return previous["launch"] != start["launch"]
    return None


def membership_change(run_dir: Path, world: int, layout: str, start: dict | None = None) -> tuple[dict, str] | None:
    """At an attempt's start: the metrics row and log line of a change of world since the
    previous attempt (its start row), with the reason: the host it excluded, else that an agent
    joined (torch elastic stops the workers with SIGTERM, they finish the step and save) or left.
    None when there was none, or when `start` (this attempt's start row) is a new launch: a
    user who resumes on another number of ranks changed the world on purpose."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    last_start, last_exclude = None, None
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if row.get("event") in ("start", "restart"):
            last_start, last_exclude = row, None
        elif row.get("event") == "exclude":
            last_exclude = row
    if last_start is None or (last_exclude is None and last_start.get("world") == world):
        return None
    if start is not None and new_launch(last_start, start):
        return None
    old = last_start.get("world")
    if last_exclude is not None:
        reason = last_exclude.get("reason")
    elif isinstance(old, int) and world > old:
        reason = f"{world - old} more rank(s) joined the rendezvous; the previous attempt saved at a step boundary"
    else:
        reason = "an agent left the rendezvous or died; resumed from the newest checkpoint"
    row = {"event": "membership", "old_world": old, "world": world, "old_layout": last_start.get("layout"),
           "layout": layout, "reason": reason, "excluded_host": (last_exclude or {}).get("host"),
           # the report's phases of the change (tools/run_data.py): this worker's start, its imports done
           "worker_started": process_started(), "imported": IMPORTED_AT}
    text = f"membership change: world {old} -> {world}, layout {row['old_layout']} -> {layout} ({reason})"
    return row, text
