"""`python -m ndtrain.train.agent <torchrun's arguments>`: torchrun, for a launch script that reads
its exit code (a Kubernetes pod's failure policy, a Slurm script), with the stop signals handled as
`ndtrain train --nproc` handles them (train/signals.py, LauncherSignals): the first SIGTERM,
SIGUSR1, SIGINT or SIGHUP is forwarded to the workers, which save and exit 143; later copies are
absorbed while they save; and this agent then exits 143 too (130 after Ctrl-C). Plain torchrun
raises its SignalException out of its main after the same forwarding and exits 1 with a traceback,
so the launch script cannot tell a preemption that saved from a failure.

When its workers fail for good (every restart used), it exits with their code as `ndtrain train
--nproc` does: 2 when they exited 2 (bad input only the run sees, e.g. a missing data.path), which
a launch script must not retry; plain torchrun raises its ChildFailedError and exits 1 whatever
the workers said. Its failure report is printed as torchrun prints it, without the traceback.

It also gives each restart its own rendezvous store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless
the environment says otherwise), as `ndtrain train --nproc` does: a restarted worker that reuses
the agent's shared store can be handed a stale address and never join.

Everything else is torchrun's own: its arguments, its rendezvous and restarts.
"""

from __future__ import annotations

import os
import sys

from ndtrain.launch_env import store_per_attempt
from ndtrain.train.signals import TORCHRUN_KEEPS, LauncherSignals


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from ndtrain.train.command import child_failure_code

    store_per_attempt()
    # torchrun installs its own handlers for the signals it is told to handle, over ours: it keeps
    # only those ndtrain leaves to it (an explicit --signals-to-handle later in argv wins).
    args = [f"--signals-to-handle={','.join(s.name for s in TORCHRUN_KEEPS)}", *argv]
    stops = LauncherSignals(SignalException)
    try:
        torchrun_main(args)
    except SignalException as exc:
        return LauncherSignals.exit_code(exc.sigval)
    except ChildFailedError as exc:
        print(exc, file=sys.stderr, flush=True)
        return child_failure_code(exc)
    finally:
        stops.restore()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    if code > 128:
        os._exit(code)  # its handlers still absorbing: a late copy must not turn 143 into -15
    sys.exit(code)
