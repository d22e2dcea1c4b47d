"""Real processes against the launcher: SIGKILL of `ndtrain train --nproc 2` leaves no worker
behind; Ctrl-C exits 130 and SIGTERM 143, each with one line; a second run in a live run's
directory is refused; a killed rank is named in one line; a plain torchrun restart continues in
its own run directory (the lock is per run, not per rank)."""

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


def _args(corpus: Path, out: Path, steps: int = 400, *more: str) -> list[str]:
    # Steps long enough (several micro-batches) that a signal lands inside training, not after it.
    return [f"--data.path={corpus}", "--data.seq_len=64", "--train.global_batch=8", "--train.micro_batch=2",
            f"--train.steps={steps}", "--train.val_interval=0", "--train.sample_tokens=0", "--train.log_interval=1",
            "--checkpoint.interval_steps=2", "--logging.tensorboard=false", "--logging.progress=off",
            "--train.timeout_s=60", f"--train.output_dir={out}", *more]


def _start(args: list[str], nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    """Like a shell: the launcher leads its own process group (the terminal's Ctrl-C goes there)."""
    cmd = [sys.executable, "-m", "ndtrain", "train", *(["--nproc", str(nproc)] if nproc else []), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _wait_for(out: Path, checkpoints: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list_checkpoints(out / "checkpoints")) >= checkpoints:
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("no checkpoint in time")


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.timeout(300)
def test_sigkill_of_the_launcher_leaves_no_worker(corpus_dir, tmp_path, hang_deadline):
    out = tmp_path / "run"
    proc = _start(_args(corpus_dir, out))
    try:
        _wait_for(out, 1, proc, hang_deadline(240))
        workers = descendants(proc.pid)
        assert len(workers) >= 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        # The kernel kills them at once (PR_SET_PDEATHSIG); the wait only stops a test they outlive.
        patience = hang_deadline(10)
        killed = time.monotonic()
        proc.wait(timeout=hang_deadline(30))
        while time.monotonic() - killed < patience and any(_running(p) for p in workers):
            time.sleep(0.05)
        alive = [p for p in workers if _running(p)]
        assert not alive, f"workers still running {patience:.0f} s after the launcher was killed: {alive}"
        # ... and nothing more is written into the run directory.
        metrics = (out / "metrics.jsonl").read_bytes()
        time.sleep(1.0)
        assert (out / "metrics.jsonl").read_bytes() == metrics
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_ctrl_c_one_line_130_and_a_second_run_is_refused(corpus_dir, tmp_path, hang_deadline):
    out = tmp_path / "run"
    proc = _start(_args(corpus_dir, out))
    try:
        _wait_for(out, 1, proc, hang_deadline(240))
        # A second run in the directory of a live one: refused, whether fresh or resuming.
        for extra in ([], ["--checkpoint.resume=auto"]):
            second = subprocess.run([sys.executable, "-m", "ndtrain", "train", *_args(corpus_dir, out, 4, *extra)],
                                    capture_output=True, text=True, timeout=hang_deadline(120))
            lines = _error_lines(second.stderr)
            assert second.returncode == 2 and len(lines) == 1, second.stderr
            assert ("in use by a live run" in lines[0] or "holds an earlier run" in lines[0]) and str(out) in lines[0]
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _, err = proc.communicate(timeout=hang_deadline(120))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = _error_lines(err)
    assert proc.returncode == 130, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "interrupted at step" in lines[0] and "last checkpoint" in lines[0] and str(out) in lines[0], lines
    for ckpt in list_checkpoints(out / "checkpoints"):
        assert verify_checkpoint(ckpt) is None


@pytest.mark.timeout(400)
def test_sigterm_saves_one_line_143_and_resume_continues(corpus_dir, tmp_path, hang_deadline):
    out = tmp_path / "run"
    proc = _start(_args(corpus_dir, out))
    try:
        _wait_for(out, 1, proc, hang_deadline(240))
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=hang_deadline(150))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = _error_lines(err)
    assert proc.returncode == 143, err
    assert len(lines) == 1 and "stopped by SIGTERM at step" in lines[0], err
    step = int(lines[0].split("at step ")[1].split(";")[0])
    saved = out / "checkpoints" / step_name(step)
    assert str(saved) in lines[0] and verify_checkpoint(saved) is None
    # Continue it, one process: the lock was released and the run picks up at that step.
    again = subprocess.run([sys.executable, "-m", "ndtrain", "train",
                            *_args(corpus_dir, out, step + 1, "--checkpoint.resume=auto")],
                           capture_output=True, text=True, timeout=hang_deadline(200),
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {saved} at step {step}" in again.stdout


@pytest.mark.timeout(300)
def test_a_killed_rank_is_named_in_one_line(corpus_dir, tmp_path, hang_deadline):
    out = tmp_path / "run"
    proc = _start(_args(corpus_dir, out, 8), env={"NDTRAIN_FAULTS": "0:1:3:step:0.0"})
    _, err = proc.communicate(timeout=hang_deadline(240))
    lines = _error_lines(err)
    assert proc.returncode == 1 and "Traceback" not in err, err
    # The surviving rank names its dead peer; the launcher names the rank it lost. One line each.
    assert len(lines) == 2, err
    assert "rank 0: rank 1 (pid" in lines[0] and "died" in lines[0], lines
    assert "rank 1 was killed by SIGKILL" in lines[1], lines
    assert verify_checkpoint(out / "checkpoints" / step_name(2)) is None


@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_plain_torchrun_restart_continues_in_its_own_run_directory(corpus_dir, tmp_path, hang_deadline):
    """No ndtrain launcher: rank 0 locks the run; the restarted rank 0 (same run id) takes the
    lock over silently and resumes; rank 1 never locks.

    Rank 0 is killed while publishing step 4's checkpoint (manifest written, marker not): step
    2's save was waited for before step 4's began, so the restart resumes from step 2. The fault
    is the first attempt's to reach that point (`*`), with a restart to spare: torchrun (not
    sharing its rendezvous store) picks the workers' MASTER_PORT by binding port 0 and releasing
    it, and under a loaded CI host another test's socket can take it before rank 0 binds it
    again; that attempt then fails before training and the next one starts from scratch."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
           "-m", "ndtrain", "train", *_args(corpus_dir, out, 5)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "NDTRAIN_FAULTS": "*:0:4:publish"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_deadline(360), env=env)
    said = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    kills = [line for line in (out / "faults.log").read_text().splitlines() if " kill " in line]
    assert len(kills) == 1 and "rank=0 step=4 point=publish" in kills[0], (kills, said)
    assert f"resumed from {out / 'checkpoints' / step_name(2)} at step 2" in proc.stdout, said
    assert "took over the lock" not in proc.stdout + proc.stderr
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == [step_name(4), step_name(5)]
    assert not (out / ".ndtrain.lock").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if "loss" in r) == 5
