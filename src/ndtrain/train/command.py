"""`ndtrain train`: run in this process, under torchrun, or launch N local processes.

Exit codes: 0 done; 2 bad input (one line naming the key or path); 1 the run failed (a full
disk, a dead rank: one line); 130 interrupted (Ctrl-C); 143 stopped by SIGTERM/SIGUSR1 after
saving a checkpoint (schedulers retry nonzero exits). Which signal does what: train/signals.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from ndtrain import launch_env as launch
from ndtrain.config import load_config
from ndtrain.errors import UsageError
from ndtrain.launch_env import under_launcher as _under_launcher
from ndtrain.train.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED, STOP_SIGNALS, TORCHRUN_KEEPS, LauncherSignals, hold


def launch_local(nproc: int, max_restarts: int, argv: list[str]) -> int:
    """Start `nproc` workers through torch.distributed.run (what torchrun does), on one host.
    The workers print what went wrong themselves (one line each); this process adds one line
    only for what they cannot say, e.g. which rank was killed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    launch.store_per_attempt()  # restarted workers must not reuse a store whose address went stale
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The agent's own log (closing signals, failure tables) would bury the workers' one line.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # The stop signals are this process's (LauncherSignals); torchrun keeps the rest.
    args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            f"--signals-to-handle={','.join(s.name for s in TORCHRUN_KEEPS)}", "-m", "ndtrain", "train", *argv]
    stops = LauncherSignals(SignalException)
    try:
        torchrun_main(args)
    except SignalException as exc:  # Ctrl-C / SIGTERM / SIGUSR1 to this process: forwarded to the workers
        # What the workers exit with: 143 after their save, whichever stop signal it was.
        return LauncherSignals.exit_code(exc.sigval)
    except SystemExit as exc:  # torchrun exits via SystemExit on some paths
        return int(exc.code or 0)
    except ChildFailedError as exc:
        return child_failure_code(exc)
    finally:
        stops.restore()
    return 0


def child_failure_code(exc) -> int:
    """The exit code for torchrun's ChildFailedError `exc`: the workers' own 1, 2, 130 or 143 (a
    worker said what happened, in one line), else 1 after one line naming the rank that died."""
    failures = exc.failures
    if any(f.exitcode >= 0 for f in failures.values()):
        # Once a worker has exited, torchrun SIGTERMs the rest of the group: those are not causes.
        failures = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM}
    codes = {f.exitcode for f in failures.values()}
    if codes <= {1, 2, EXIT_INTERRUPTED, EXIT_PREEMPTED}:
        # Bad input (2), a failed run (1: disk full, a dead peer), Ctrl-C, a stop signal sent
        # to the workers themselves: a worker already said what happened, in one line. 2 first:
        # bad input fails every attempt alike, and the peers it leaves waiting fail with 1.
        return next(c for c in (2, 1, EXIT_INTERRUPTED, EXIT_PREEMPTED) if c in codes)
    rank, failure = min(((r, f) for r, f in failures.items() if f.exitcode not in (1, 2)),
                        key=lambda rf: rf[1].timestamp)
    if failure.exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-failure.exitcode}"
    else:
        how = f"exited with code {failure.exitcode}"
    print(f"ndtrain train: rank {rank} {how}, so the group stopped (no restart left; --max-restarts K restarts "
          f"it from the last checkpoint)", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain train", description="Train a model.",
                                epilog="Any --section.key=value overrides the config file.")
    p.add_argument("--config", help="TOML config (default: built-in debug defaults)")
    p.add_argument("--nproc", type=int, default=0, help="launch N local processes (torchrun)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the group after a crash or hang, up to K times, from the last checkpoint")
    args, overrides = p.parse_known_args(argv)
    if args.nproc < 0 or args.nproc > 4096:
        raise UsageError(f"--nproc must be between 1 and 4096, got {args.nproc}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    # Fails here, before any process starts and before torch is imported: a typo is answered at once.
    cfg = load_config(args.config, overrides)
    if _under_launcher():  # the sooner a worker ties its life to its launcher, the fewer orphans
        from ndtrain.train.distributed import die_with_parent  # (it also notices a launcher already gone)

        die_with_parent(launch.launcher_pid())
    from ndtrain.train.trackers import check_installed

    check_installed(cfg.logging)
    cfg = _fit_to_data(cfg, overrides)

    if args.nproc and not _under_launcher():
        return _launch(cfg, args, argv)
    return _run(cfg)


def _fit_to_data(cfg, overrides: list[str]):
    """The config fitted to its data (train/preflight.py: fit_to_data), each change said in one
    line by the process that speaks for the run: the `--nproc` launcher, or rank 0 where no
    ndtrain launcher started the ranks. Workers fit the same config to the same data alike."""
    from ndtrain.config import parse_overrides
    from ndtrain.train.preflight import fit_to_data

    fitted, notes = fit_to_data(cfg, parse_overrides(overrides))
    if launch.rank() == 0 and launch.launcher_pid() is None:
        for note in notes:
            print(f"ndtrain train: {note}", flush=True)
    return fitted


def _run(cfg) -> int:
    from ndtrain.train.job import train

    try:
        summary = train(cfg)  # resolves the plan for this world (train/plan.py), as the Python API does
    except KeyboardInterrupt as exc:  # Ctrl-C outside the loop's own handling (start-up, a failing collective)
        return _interrupted_outside_the_loop(cfg, exc)
    return _ended(cfg, summary)


def _interrupted_outside_the_loop(cfg, exc: KeyboardInterrupt) -> int:
    """Ctrl-C before the loop ran or where it cannot answer (start-up, a failing collective):
    one line with the step reached and the last checkpoint, then 130."""
    if launch.rank() == 0:
        from ndtrain.train.checkpoint import list_checkpoints
        from ndtrain.train.rundir import checkpoint_root

        step = getattr(exc, "step", None)
        found = list_checkpoints(checkpoint_root(cfg, cfg.train.output_dir or "."))
        last = f"last checkpoint {found[-1]}" if found else "no checkpoint was saved"
        print(f"ndtrain train: interrupted{f' at step {step}' if step is not None else ''}; {last}",
              file=sys.stderr, flush=True)
    if _under_launcher():
        os._exit(EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


def _ended(cfg, summary: dict) -> int:
    """How the run ended (done, interrupted, stopped by a signal, a host taken out) as the exit
    code and the one line a scheduler or a user reads; a finished run also tears its process
    groups down and samples (rank 0)."""
    rank0 = launch.rank() == 0
    ckpt = summary.get("checkpoint")
    again = f"continue with --checkpoint.resume=auto --train.output_dir={summary['run_dir']}"
    if summary.get("interrupted"):
        if rank0:
            last = f"last checkpoint {ckpt}; {again}" if ckpt and ckpt != "None" else "no checkpoint was saved"
            print(f"ndtrain train: interrupted at step {summary['steps']}; {last}", file=sys.stderr, flush=True)
        if _under_launcher():  # its peers are stopping too: skip the process group's slow teardown
            sys.stdout.flush()
            os._exit(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    if summary.get("preempted"):
        hold(STOP_SIGNALS)  # this process exits next, with 143: later stop signals are absorbed
        if rank0:
            print(f"ndtrain train: stopped by {summary.get('stop_signal') or 'a signal'} at step {summary['steps']}; "
                  f"saved {ckpt}; {again}", file=sys.stderr, flush=True)
        if _under_launcher():  # saved and published: skip the process group's slow teardown
            sys.stdout.flush()
            os._exit(EXIT_PREEMPTED)
        return EXIT_PREEMPTED  # saved and stopped on a signal: nonzero so schedulers run it again
    if summary.get("leave"):  # a host was taken out, its checkpoint saved: exit so the group re-forms
        from ndtrain.train.resilience import leave

        leave(summary["leave"], launch.rank())
    _destroy_groups()
    from ndtrain.train.job import closing_sample

    closing_sample(cfg, summary)  # rank 0's own work, now that no peer can be waiting on it
    if _under_launcher():
        # Done, its files closed and its groups torn down: a worker skips the interpreter's and
        # libtorch's exit-time destructors, where a Gloo thread still joinable now and then
        # aborted a finished rank ("terminate called without an active exception", SIGABRT: the
        # launcher then reported the run failed; seen in the DDP checkpoint test on a clean clone).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _destroy_groups() -> None:
    """After a run that ended well on every rank: tear the process groups down while the
    interpreter is whole. Left to its finalisation, Gloo's worker threads still hold tensors and
    now and then abort the process ("terminate called without an active exception", SIGABRT;
    pytorch/pytorch#190489). Only on success: a teardown while a failed peer is mid-collective
    could hang (torchtitan does the same). Every rank reaches it straight from its last
    collective: work only one rank does (rank 0's sample) comes after it, so the barrier never
    waits on it under the collective timeout. Whatever else one rank still does there (a tracker
    flushing, W&B finishing) may outlast that timeout: the run is done (every rank is past the
    final save), so a barrier that times out, or whose peer has already gone, is not a failure:
    this rank skips the teardown and exits 0. Raised, it made torchrun restart a finished run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()  # every rank is done with every group
        except Exception:  # noqa: BLE001  (a DistError, or Gloo's RuntimeError: a peer late or gone)
            return
        dist.destroy_process_group()


def _launch(cfg, args, argv: list[str]) -> int:
    """Everything that can fail is checked here, before any worker starts; then this process
    holds the run directory's lock for its workers and all their restarts."""
    from ndtrain.train import preflight, rundir
    from ndtrain.train.plan import resolve_plan

    # The plan's errors (the layout's rules, the batch rule among them) before spawning; it also
    # measures the host probe once, here, for the workers, which resolve the same plan themselves.
    resolve_plan(cfg, args.nproc)
    preflight.check_all(cfg)
    run_dir = rundir.default_run_dir(cfg)
    lock = rundir.claim(cfg, run_dir, log=lambda text: print(text, flush=True))
    try:
        # One run directory for every rank and every restart attempt.
        forwarded = list(argv)
        for flag in ("--nproc", "--max-restarts"):
            forwarded = _drop_flag(forwarded, flag)
        if not cfg.train.output_dir:
            forwarded.append(f"--train.output_dir={run_dir}")
        os.environ[launch.LAUNCHER_ENV] = str(os.getpid())  # the workers' parent and the lock's holder
        code = launch_local(args.nproc, args.max_restarts, forwarded)
    finally:
        os.environ.pop(launch.LAUNCHER_ENV, None)
        lock.release()
    if code > 128:  # stopped by a signal: exit now, its handler still absorbing. Python's own
        # finalisation puts the default handlers back, and a scheduler's next copy of the signal
        # landing then (on a quiet host the workers save and exit within the 0.2 s between two
        # rounds) killed this process with -15 instead of the workers' 143.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out
