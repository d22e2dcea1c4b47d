"""The launch environment, read in one place: the variables a launcher gives each worker (torchrun,
or `ndtrain train --nproc`, which runs torchrun's agent), checked here (`launch_env`: each
variable's form, and whether together they can form a group), and the few facts the rest of
ndtrain asks of them. Torch-free: the command line reads it before torch.

    WORLD_SIZE RANK LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT   env:// rendezvous (checked)
    GROUP_RANK GROUP_WORLD_SIZE                                          this worker's agent, the agents
    TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS   the job and its restarts

    NDTRAIN_RUN_LOCK_PID                                                 the `ndtrain train --nproc` launcher's pid

The last is ndtrain's own launcher's, set for its workers (the run lock's holder). One variable is
set, not read, for torchrun's agent (`store_per_attempt`): TORCH_DISABLE_SHARE_RDZV_TCP_STORE. ndtrain's other
variables are settings, not the launch, and sit beside what reads them: NDTRAIN_DEBUG (cli.py: a
traceback instead of the one line), NDTRAIN_HOST_ID (resilience.py: a host's name in the exclusion
policy), NDTRAIN_JOB_HOOKS (hooks.py) and NDTRAIN_FP8_WARNED (plan_choices.py: a warning said once
across a launcher and its workers)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ndtrain.errors import UsageError

_LAUNCH_INTS = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "MASTER_PORT": 1}
LAUNCHER_ENV = "NDTRAIN_RUN_LOCK_PID"  # set by `ndtrain train --nproc` for its workers: the lock's holder


def _env(environ: Mapping | None) -> Mapping:
    return os.environ if environ is None else environ


_HOW = ("torchrun sets it; to train in one process unset WORLD_SIZE, RANK, LOCAL_RANK and MASTER_*, "
        "or start the ranks with torchrun or `ndtrain train --nproc N`")


def _int(name: str, environ=None) -> int | None:
    """One of the launcher's integers as given (None: unset), or one line naming it."""
    text = _env(environ).get(name)
    if text is None or (text.strip() == "" and name != "WORLD_SIZE"):
        return None
    low = _LAUNCH_INTS[name]
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low or (name == "MASTER_PORT" and value > 65535):
        want = "a port number (1-65535)" if name == "MASTER_PORT" else f"an integer >= {low}"
        raise UsageError(f"environment variable {name}={text!r} must be {want} ({_HOW})")
    return value


def launch_env(environ=None) -> dict[str, int]:
    """The launcher's variables (torchrun's, or whoever sets them for env:// rendezvous), checked:
    each an integer in range, RANK below WORLD_SIZE, LOCAL_RANK below LOCAL_WORLD_SIZE, and with
    WORLD_SIZE > 1 the RANK, MASTER_ADDR and MASTER_PORT that forming the group needs. A variable
    that is wrong, or left over in a shell without a launcher, is one line naming it (exit 2), not
    torch's traceback or a wait for peers that never come. Returns the integers (defaults for
    those unset: one process)."""
    env = _env(environ)
    out = {name: value for name in _LAUNCH_INTS if (value := _int(name, env)) is not None}
    world = out.setdefault("WORLD_SIZE", 1)
    rank = out.setdefault("RANK", 0)
    if rank >= world:
        raise UsageError(f"environment variable RANK={rank} must be below WORLD_SIZE={world} ({_HOW})")
    if out.get("LOCAL_RANK", 0) >= out.get("LOCAL_WORLD_SIZE", out.get("LOCAL_RANK", 0) + 1):
        raise UsageError(f"environment variable LOCAL_RANK={out['LOCAL_RANK']} must be below "
                         f"LOCAL_WORLD_SIZE={out['LOCAL_WORLD_SIZE']} ({_HOW})")
    if world > 1:
        for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if not (env.get(name) or "").strip():
                raise UsageError(f"environment variable WORLD_SIZE={world} is set but {name} is not: the ranks "
                                 f"cannot form a group ({_HOW})")
    out.setdefault("LOCAL_RANK", 0)
    return out


# One variable each, in the form launch_env checks (a malformed one is its one line); the checks
# between variables are launch_env's, for forming a group: an `--nproc` launcher's own shell may
# hold a stray WORLD_SIZE that its workers never see.
def rank(environ=None) -> int:
    """This process's global rank (0 without a launcher)."""
    return _int("RANK", environ) or 0


def world_size(environ=None) -> int:
    """How many ranks the job has (1 without a launcher)."""
    return _int("WORLD_SIZE", environ) or 1


def local_rank(environ=None) -> int:
    """This process's rank on its host (0 without a launcher)."""
    return _int("LOCAL_RANK", environ) or 0


def local_world_size(environ=None) -> int:
    """How many ranks share this host (1 without a launcher)."""
    return _int("LOCAL_WORLD_SIZE", environ) or 1


def master_addr(environ=None) -> str:
    """Where the ranks meet (MASTER_ADDR; '' when unset)."""
    return (_env(environ).get("MASTER_ADDR") or "").strip()


def master_port(environ=None) -> int | None:
    """The port they meet on (MASTER_PORT; None when unset)."""
    return _int("MASTER_PORT", environ)


def given_a_rank(environ=None) -> bool:
    """Whoever started this process gave it a rank (torchrun, or a hand-set env:// rendezvous)."""
    return "RANK" in _env(environ)


def under_launcher(environ=None) -> bool:
    """This process is a worker that torchrun (or `ndtrain train --nproc`) started."""
    env = _env(environ)
    return "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env


def _count(name: str, default: int, environ=None) -> int:
    return int(_env(environ).get(name, str(default)) or default)


def group_rank(environ=None) -> int:
    """This worker's agent in the current rendezvous round (torchrun's GROUP_RANK)."""
    return _count("GROUP_RANK", 0, environ)


def agents(environ=None) -> int:
    """The agents (hosts) of the current rendezvous round (torchrun's GROUP_WORLD_SIZE)."""
    return _count("GROUP_WORLD_SIZE", 1, environ)


def restart_count(environ=None) -> int:
    """Which restart of the workers this is (0: the first attempt)."""
    return _count("TORCHELASTIC_RESTART_COUNT", 0, environ)


def restarts_left(environ=None) -> int:
    """Restarts this worker's agent still has (torchrun sets TORCHELASTIC_MAX_RESTARTS for its workers)."""
    return _count("TORCHELASTIC_MAX_RESTARTS", 0, environ) - restart_count(environ)


def launcher_pid(environ=None) -> int | None:
    """The pid of the `ndtrain train --nproc` launcher that started this worker (None: none did)."""
    text = (_env(environ).get(LAUNCHER_ENV) or "").strip()
    return int(text) if text.isdigit() else None


def run_id(environ=None) -> str:
    """torchrun's id of this job ('' when none): the same for every restart attempt."""
    rid = _env(environ).get("TORCHELASTIC_RUN_ID", "")
    return "" if rid == "none" else rid


def store_per_attempt() -> None:
    """A rendezvous store per restart attempt for the workers a torchrun agent in this process
    starts, unless the user set it: torch 2.13 shares the agent's store with them by default, and
    a restarted worker that reuses it can be handed a stale address and never join."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
