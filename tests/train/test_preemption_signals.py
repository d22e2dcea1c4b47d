"""Slurm-style preemption of `ndtrain train --nproc 2`: every process of the job gets SIGTERM,
twice, 0.2 s apart (Slurm signals each process of the step, the launcher forwards its own copy,
and a scheduler may repeat itself). The run must save exactly one checkpoint, exit 143 with one
line, and a resume from that checkpoint must continue exactly as an uninterrupted run does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chaos import descendants

from ndtrain.train.checkpoint import list_checkpoints, step_name, verify_checkpoint

STOP_AT = 5  # the step at which the job is told to stop (or the first one after it)


def _args(corpus: Path, out: Path, steps: int, *more: str) -> list[str]:
    # Four micro-batches a step: a step lasts long enough that both signals land inside the run,
    # and no interval checkpoint: the only checkpoint there can be is the preemption's. A constant
    # learning rate: runs of different lengths then take the same steps.
    return [f"--data.path={corpus}", "--data.seq_len=64", "--train.global_batch=8", "--train.micro_batch=2",
            f"--train.steps={steps}", "--train.val_interval=0", "--train.sample_tokens=0", "--train.log_interval=1",
            "--checkpoint.interval_steps=0", "--logging.tensorboard=false", "--logging.progress=off",
            "--optimizer.schedule=constant", "--train.timeout_s=60", f"--train.output_dir={out}", *more]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ndtrain", "train", "--nproc", "2", *args]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _last_step(out: Path) -> int:
    try:
        return max(_losses(out), default=0)
    except (OSError, ValueError):  # not there yet, or a row half written
        return 0


def _signal_every_process(launcher: int, workers: list[int], sig: int) -> None:
    """What Slurm does to a job step: the signal reaches every process, not just the launcher
    (torchrun starts each worker in a session of its own, so the launcher's group is not enough)."""
    for group in [launcher, *workers]:
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            pass


@pytest.mark.slow  # three world-2 launches: ~40-60 s on a 2-core machine
@pytest.mark.timeout(600)
def test_two_sigterms_save_once_exit_143_and_resume_exactly(corpus_dir, tmp_path, hang_deadline):
    out, ref = tmp_path / "run", tmp_path / "reference"
    proc = subprocess.Popen(_cmd(*_args(corpus_dir, out, 400)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=_env())
    try:
        deadline = time.monotonic() + hang_deadline(300)
        while _last_step(out) < STOP_AT:
            assert proc.poll() is None, f"exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the run did not reach step 5 in time"
            time.sleep(0.05)
        workers = descendants(proc.pid)
        assert len(workers) >= 2, workers
        _signal_every_process(proc.pid, workers, signal.SIGTERM)
        time.sleep(0.2)
        _signal_every_process(proc.pid, workers, signal.SIGTERM)
        _, err = proc.communicate(timeout=hang_deadline(200))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip()]
    root = out / "checkpoints"
    left = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    assert proc.returncode == 143, (proc.returncode, left, err[-3000:])
    assert len(lines) == 1 and "stopped by SIGTERM at step" in lines[0], (left, err[-3000:])
    published = list_checkpoints(root)
    assert len(published) == 1 and len(left) == 1, left  # nothing half written beside it
    step = int(lines[0].split("at step ")[1].split(";")[0])
    assert step >= STOP_AT and published[0] == root / step_name(step) and verify_checkpoint(published[0]) is None

    # Continue from it for two more steps, and run the same steps uninterrupted: the same world,
    # layout and data order, so resuming is exact only if the checkpoint holds the whole state
    # (weights, optimizer, data position, RNG): equal losses, not close ones.
    more = step + 2
    again = subprocess.run(_cmd(*_args(corpus_dir, out, more, "--checkpoint.resume=auto")),
                           capture_output=True, text=True, timeout=hang_deadline(200), env=_env())
    assert again.returncode == 0, again.stderr[-3000:]
    whole = subprocess.run(_cmd(*_args(corpus_dir, ref, more)), capture_output=True, text=True,
                           timeout=hang_deadline(200), env=_env())
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed, reference = _losses(out), _losses(ref)
    assert [resumed[s] for s in range(1, more + 1)] == [reference[s] for s in range(1, more + 1)]


# ---- the same, one process at a time (the default suite) ---------------------------------------
def _python(timeout_s: float, code: str, worker: bool = True) -> subprocess.CompletedProcess:
    """In a process of its own (a launcher's worker: LOCAL_RANK set): before the fix a second
    SIGTERM kills the process it lands in."""
    env = {**_env(), "LOCAL_RANK": "0"} if worker else _env()
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)


@pytest.mark.timeout(60)
def test_a_worker_absorbs_repeated_stop_signals_up_to_its_exit(hang_deadline):
    done = _python(hang_deadline(50), """
import os, signal, time
from ndtrain.train.signals import Preemption

def deliver(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # Python runs a handler between bytecodes: let it

stop = Preemption()
for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1):  # Slurm's, torchrun's forwarded copy, another
    deliver(sig)
stop.close()  # the save is done; the exit with 143 follows
deliver(signal.SIGTERM)
deliver(signal.SIGUSR1)
print(stop.requested, stop.signal_name, stop.received)
""")
    assert done.returncode == 0 and done.stdout.split() == ["True", "SIGTERM", "3"], (done.returncode, done.stderr)


@pytest.mark.timeout(60)
def test_a_worker_not_stopped_gets_its_previous_handlers_back(hang_deadline):
    done = _python(hang_deadline(50), """
import signal
from ndtrain.train.signals import Preemption

stop = Preemption()
stop.close()
print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)
""")
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stderr


@pytest.mark.timeout(60)
def test_the_launcher_raises_its_first_stop_signal_and_absorbs_the_rest(hang_deadline):
    """The first becomes torchrun's SignalException (it forwards the signal to the workers and
    waits for them); another one raised inside that wait would make torchrun give up on them."""
    done = _python(hang_deadline(50), """
import os, signal, time
from ndtrain.train.signals import LauncherSignals

class Stop(Exception):  # stands in for torchrun's SignalException(msg, sigval=...)
    def __init__(self, msg, sigval):
        super().__init__(msg)
        self.sigval = sigval

def deliver(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)

stops = LauncherSignals(Stop)
try:
    deliver(signal.SIGUSR1)
    first = None
except Stop as exc:
    first = exc.sigval.name
for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
    deliver(sig)
stops.restore()  # the launcher returns the workers' 143 next: still absorbing
deliver(signal.SIGTERM)
print(first)
""")
    assert done.returncode == 0 and done.stdout.split() == ["SIGUSR1"], (done.returncode, done.stderr)


# ---- the Slurm example's stop path, against stand-ins for srun, scancel and scontrol -----------
SBATCH = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _sbatch_until(tmp_path: Path, log: Path, ready: str, nodes: dict, act, hang_deadline) -> tuple[int, str]:
    """Runs the batch script with tmp_path/bin's stubs first on PATH and `nodes`' SLURM_*
    variables; once `ready` is in the stubs' log, `act(proc)`; then its exit code and output."""
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NAME": "ndtrain", "RUN_DIR": str(tmp_path / "run"), **nodes}
    proc = subprocess.Popen(["bash", str(SBATCH)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + hang_deadline(30)
        while not (log.exists() and ready in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        act(proc)
        out, _ = proc.communicate(timeout=hang_deadline(30))
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


@pytest.mark.skipif(sys.platform != "linux", reason="bash and /proc")
@pytest.mark.timeout(60)
def test_the_sbatch_trap_signals_the_step_once_and_waits_for_its_save(tmp_path, hang_deadline):
    """The time-limit warning (USR1) and then a preemption (TERM) reach the batch script 0.2 s
    apart. It must deliver TERM to the step through `scancel --signal` (a signal, not srun's
    termination, which SIGKILLs after KillWait), once, and requeue only after srun exited."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    # srun: a step that takes 1 s to save after its TERM, then exits 143 as the workers do.
    _stub(bin_dir / "srun", f'echo $$ > {tmp_path}/srun.pid\ntrap \'sleep 1; echo saved >> {log}; exit 143\' TERM\n'
                            f'echo started >> {log}\nwhile :; do sleep 0.05; done\n')
    _stub(bin_dir / "scancel", f'echo "scancel $*" >> {log}\nkill -TERM "$(cat {tmp_path}/srun.pid)"\n')
    _stub(bin_dir / "scontrol", f'[ "$1" = show ] && echo node1 && exit 0\necho "scontrol $*" >> {log}\n')
    _stub(bin_dir / "python3", "exit 0\n")  # the config check before srun: passes
    def usr1_then_term(proc):
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)

    nodes = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "8"}
    code, out = _sbatch_until(tmp_path, log, "started", nodes, usr1_then_term, hang_deadline)
    assert code == 0, out
    assert log.read_text().splitlines() == ["started", "scancel --signal=TERM 4242", "saved", "scontrol requeue 4242"], out


@pytest.mark.skipif(sys.platform != "linux", reason="bash")
@pytest.mark.timeout(60)
def test_the_sbatch_trap_requeues_a_stop_that_comes_before_the_step(tmp_path, hang_deadline):
    """A stop signal while the script still checks the config (no step yet) is answered once the
    check is done: the job is requeued and no step is started."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    _stub(bin_dir / "srun", f'echo started >> {log}\n')
    _stub(bin_dir / "scancel", f'echo "scancel $*" >> {log}\n')
    _stub(bin_dir / "scontrol", f'[ "$1" = show ] && echo node1 && exit 0\necho "scontrol $*" >> {log}\n')
    # the check runs until the test has signalled the script
    _stub(bin_dir / "python3", f'echo check >> {log}\nwhile [ ! -e {tmp_path}/signalled ]; do sleep 0.05; done\n')
    def usr1(proc):
        proc.send_signal(signal.SIGUSR1)
        (tmp_path / "signalled").touch()

    nodes = {"SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1", "SLURM_CPUS_PER_TASK": "2"}
    code, out = _sbatch_until(tmp_path, log, "check", nodes, usr1, hang_deadline)
    assert code == 0, out
    assert log.read_text().splitlines() == ["check", "scancel --signal=TERM 4242", "scontrol requeue 4242"], out


@pytest.mark.skipif(sys.platform != "linux", reason="bash and /proc")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("step_exit, requeued", [(143, True), (2, False)])
def test_the_sbatch_trap_requeues_a_saved_stop_and_never_bad_input(tmp_path, hang_deadline, step_exit, requeued):
    """srun runs ndtrain's agent, which exits with its workers' code: 143 after a saved stop
    (requeued), 2 when they refused their input while the stop was on its way (a missing
    data.path: it would fail again, so the job ends with 2)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    _stub(bin_dir / "srun", f'echo $$ > {tmp_path}/srun.pid\ntrap \'exit {step_exit}\' TERM\n'
                            f'echo started >> {log}\nwhile :; do sleep 0.05; done\n')
    _stub(bin_dir / "scancel", f'echo "scancel $*" >> {log}\nkill -TERM "$(cat {tmp_path}/srun.pid)"\n')
    _stub(bin_dir / "scontrol", f'[ "$1" = show ] && echo node1 && exit 0\necho "scontrol $*" >> {log}\n')
    _stub(bin_dir / "python3", "exit 0\n")
    nodes = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "8"}
    code, out = _sbatch_until(tmp_path, log, "started", nodes, lambda proc: proc.send_signal(signal.SIGUSR1),
                              hang_deadline)
    assert code == (0 if requeued else 2), out
    assert f"workers exited ({step_exit})" in out, out
    assert ("scontrol requeue 4242" in log.read_text().splitlines()) == requeued, log.read_text()
