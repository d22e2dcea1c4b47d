"""`python -m ndtrain.train.agent`: torchrun's arguments passed on, its stop signals ndtrain's, and
its exit code the workers' 143 after a stop signal instead of torchrun's 1 (the run across nodes:
tests/cluster/test_preemption_across_nodes.py)."""

from __future__ import annotations

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


def test_a_run_that_ends_is_zero_and_gives_the_handlers_back(monkeypatch):
    monkeypatch.setattr(torchrun, "main", lambda args: None)
    before = signal.getsignal(signal.SIGTERM)
    assert agent.main(["--standalone"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before
