"""Every signal `ndtrain train` handles, in one place: the exit codes they end in, a worker's stop
request (SIGTERM/SIGUSR1: save at the next step boundary, then exit 143), its Ctrl-C (SIGINT:
stop now, one line, 130), the `--nproc` launcher's handlers, and `hold`, which makes a process
that is about to exit on its own absorb later copies. job.py installs the worker's, command.py
the launcher's; recovery.Recovery asks Preemption at each step boundary. No torch import at
module level: `ndtrain train` with bad input fails before that cost."""

from __future__ import annotations

import os
import signal
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_PREEMPTED = 143  # 128 + SIGTERM: the job was told to stop and saved; schedulers retry nonzero exits
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # save, then exit EXIT_PREEMPTED
TORCHRUN_KEEPS = (signal.SIGQUIT,)  # the launcher leaves these to torchrun's own handler


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # Python's rule for handlers


def hold(signals=(signal.SIGTERM,)) -> None:
    """From here on these signals do not end this process (it is about to end on its own)."""
    if _main_thread():
        for sig in signals:
            signal.signal(sig, lambda *_: None)


class Preemption:
    """SIGTERM/SIGUSR1 set a flag (a handler must not save: it could interrupt a collective).
    At the next step boundary all ranks agree, save and exit with EXIT_PREEMPTED. Later ones are
    absorbed up to the exit (Slurm signals every process, torchrun forwards its own copy: the
    default action would kill the worker mid-save); the launcher's and the scheduler's SIGKILL
    bound the grace period (docs/launch.md)."""

    SIGNALS = STOP_SIGNALS

    def __init__(self):
        self.requested = False
        self.signal_name = ""  # the first stop signal this rank received
        self.received = 0  # how many arrived (the later ones were absorbed)
        self.previous = {}
        if _main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.received += 1
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def agreed(self, group=None) -> bool:
        """Whether any rank was asked to stop: one small all-reduce on the host, over `group`
        (distributed.host_group: a Gloo group beside an accelerator's; None: the default group,
        which must then reduce on the host), so asking reads no device value."""
        from ndtrain.train.distributed import any_rank

        return any_rank(self.requested, "cpu", group)

    def close(self) -> None:
        # A stopped worker exits next, with 143: a late signal must not turn that into -15. A
        # process that goes on (trainer.train called in-process) gets its handlers back; the CLI
        # holds them itself up to its exit (command._run).
        from ndtrain.launch_env import under_launcher

        if self.requested and under_launcher():
            return hold(self.SIGNALS)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying how far the run got (for the one line the user sees)."""

    def __init__(self, step: int | None = None):
        super().__init__()
        self.step = step


class InterruptRecord:
    """Notes that this process got SIGINT, then raises KeyboardInterrupt as Python would. A
    KeyboardInterrupt raised while a collective fails can be lost inside torch; the note is
    not, so a rank whose peer stopped on Ctrl-C does not report that peer as dead."""

    def __init__(self):
        self.seen = False
        self.previous = None
        if _main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def close(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None


class LauncherSignals:
    """The `--nproc` launcher's Ctrl-C, SIGTERM, SIGUSR1 and SIGHUP. The first is raised as
    torchrun's own SignalException, so torchrun does what it always does: forwards it to the
    workers and waits for them up to its shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s),
    then SIGKILLs them. Later ones are absorbed. torchrun's handler would raise again inside that
    wait and exit with the workers still saving, and the kernel then kills them (their
    PDEATHSIG). A scheduler signals every process of a job, often more than once. SIGUSR1 is
    handled here too: torchrun leaves it alone by default, and its default action would kill this
    process and so, through PDEATHSIG, the workers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)

    def __init__(self, exception_type):
        self.exception_type = exception_type
        self.first: signal.Signals | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS} if _main_thread() else {}

    def _handle(self, signum, frame) -> None:
        if self.first is not None:
            return  # the workers are already stopping
        self.first = signal.Signals(signum)
        raise self.exception_type(f"Process {os.getpid()} got signal: {self.first}", sigval=self.first)

    def restore(self) -> None:
        if self.first is not None:  # this process exits next, with the workers' code: keep absorbing
            return
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def exit_code(sig: int) -> int:
        """What the workers exit with after the launcher forwarded `sig`: 143 after their save,
        whichever stop signal it was; 128 + the signal otherwise."""
        return EXIT_PREEMPTED if sig in STOP_SIGNALS else 128 + int(sig)
