"""`python -m ndtrain.train.agent`: torchrun's arguments passed on, its stop signals ndtrain's, and
its exit code the workers' 143 after a stop signal instead of torchrun's 1 (the run across nodes:
tests/cluster/test_preemption_across_nodes.py)."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException

from ndtrain.train import agent


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_is_the_workers_code(monkeypatch, sig, code):
    seen = []

    def stopped(args):
        seen.append(args)
        try:
            signal.raise_signal(sig)  # the agent's handler raises torchrun's SignalException, as torchrun's would
        except SignalException:
            signal.raise_signal(sig)  # a scheduler's second copy while the workers save: absorbed
            raise

    monkeypatch.setattr(torchrun, "main", stopped)
    before = signal.getsignal(signal.SIGTERM)
    assert agent.main(["--nnodes=2", "-m", "ndtrain", "train"]) == code
    # torchrun handles only what ndtrain leaves to it, then the caller's arguments, in order
    assert seen == [["--signals-to-handle=SIGQUIT", "--nnodes=2", "-m", "ndtrain", "train"]]
    assert signal.getsignal(signal.SIGTERM) is not before  # still absorbing: this process exits next
    signal.signal(signal.SIGTERM, before)
    for other in (signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(other, signal.default_int_handler if other == signal.SIGINT else signal.SIG_DFL)


@pytest.mark.parametrize("user", [None, "0"])
def test_each_restart_gets_its_own_store_unless_the_user_says(monkeypatch, user):
    seen = []
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", user or "")  # teardown restores what was there
    if user is None:
        monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    monkeypatch.setattr(torchrun, "main", lambda args: seen.append(os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")))
    assert agent.main(["--standalone"]) == 0
    assert seen == [user or "1"]  # what torchrun (and the workers it starts) read


def test_a_run_that_ends_is_zero_and_gives_the_handlers_back(monkeypatch):
    monkeypatch.setattr(torchrun, "main", lambda args: None)
    before = signal.getsignal(signal.SIGTERM)
    assert agent.main(["--standalone"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def _failed(*codes):
    """torchrun's ChildFailedError for workers that ended with `codes` (one per local rank)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
                for rank, code in enumerate(codes)}

    def main(args):
        raise ChildFailedError("ndtrain", failures)
    return main


@pytest.mark.parametrize("codes, want, line", [
    ((2, -signal.SIGTERM), 2, False),  # bad input; torchrun then SIGTERMs the other worker
    ((1, 2), 2, False),                # the peer that bad input left waiting fails with 1
    ((1, -signal.SIGTERM), 1, False),  # a failed run, said by the worker
    ((-signal.SIGKILL, 1), 1, True),   # a worker killed from outside: one line names it
])
def test_a_failure_is_the_workers_code_so_bad_input_is_not_retried(monkeypatch, capsys, codes, want, line):
    """Plain torchrun raises ChildFailedError and exits 1 whatever its workers said; a launch
    script must see the workers' 2 to leave bad input alone (examples/slurm/train.sbatch)."""
    monkeypatch.setattr(torchrun, "main", _failed(*codes))
    before = signal.getsignal(signal.SIGTERM)
    assert agent.main(["--nnodes=2", "-m", "ndtrain", "train"]) == want
    err = capsys.readouterr().err
    assert "ndtrain FAILED" in err and "Traceback" not in err  # torchrun's report, without the traceback
    assert ("rank 0 was killed by SIGKILL" in err) == line, err
    assert signal.getsignal(signal.SIGTERM) is before
