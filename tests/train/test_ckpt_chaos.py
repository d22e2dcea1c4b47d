"""Real processes: `ndtrain train --nproc 2 --max-restarts K` survives ranks killed with SIGKILL
mid-step and mid-save, and a hung rank (watchdog), ending bit-identical to an uninterrupted run.
The short trial runs by default; the 20-trial chaos and the 10 kills during async saves are slow.
Each fault plan is printed with its seed: NDTRAIN_CHAOS_SEED=<seed> replays it."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import chaos
import pytest
from chaos import descendants

# The step watchdog (train.step_deadline_s) on the reference host: normal steps take ~0.1 s there,
# so 6 s is generous for a loaded 2-core machine; scaled by this host's slowdown (hang_deadline),
# so a slower host's steps are not taken for the planned hang.
DEADLINE_S = 6.0
LAUNCH_S = 600  # one chaos trial's launch, a hang guard on the reference host (scaled the same way)


@pytest.fixture(scope="module")
def reference(corpus_dir, tmp_path_factory, hang_deadline):
    return chaos.reference_weights(corpus_dir, tmp_path_factory.mktemp("chaos") / "reference", hang_deadline(LAUNCH_S))


def _seed() -> int:
    return int(os.environ.get("NDTRAIN_CHAOS_SEED", time.time_ns() % 100_000))


def _trials(corpus_dir, tmp_path, reference, n: int, pick, hang_deadline) -> list:
    seed = _seed()
    rng = random.Random(seed)
    results = []
    for i in range(n):
        faults = chaos.plan(rng, pick(rng))
        trial = chaos.run_trial(corpus_dir, tmp_path / f"trial{i}", reference, faults, hang_deadline(DEADLINE_S),
                                hang_deadline(LAUNCH_S))
        print(f"seed {seed} trial {i}: {'ok' if trial.ok else 'FAILED'} {trial.faults} {trial.seconds:.0f} s "
              f"{'; '.join(trial.problems)[:1500]}", flush=True)
        results.append((seed, trial))
    return results


@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_chaos_kill_mid_step_mid_save_and_hang(corpus_dir, tmp_path, reference, hang_deadline):
    [(seed, trial)] = _trials(corpus_dir, tmp_path, reference, 1, lambda rng: ["step", "save", "hang"], hang_deadline)
    assert trial.ok and trial.kills == 3, (seed, trial.faults, trial.problems)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_chaos_20_trials(corpus_dir, tmp_path, reference, hang_deadline):
    points = ["step", "step", "step", "save", "publish", "rename", "hang"]
    results = _trials(corpus_dir, tmp_path, reference, 20, lambda rng: [rng.choice(points) for _ in range(3)],
                      hang_deadline)
    failed = [(seed, t.faults, t.problems) for seed, t in results if not t.ok]
    print(f"chaos: {len(results) - len(failed)}/{len(results)} trials passed, "
          f"{sum(t.kills for _, t in results)} faults injected")
    assert not failed, failed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_shrink_continues_on_fewer_workers(corpus_dir, tmp_path, hang_deadline):
    """Two torchrun agents (`--nnodes 1:2`, one worker each) train with FSDP over 2; the second
    "node" is killed whole. The survivor re-rendezvouses alone, reshards the checkpoint to one
    process and finishes with the same global batch (twice the accumulation)."""
    import json
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    out.mkdir()  # resume=auto needs the run directory to exist (a first attempt that later ones continue)
    args = [a for a in chaos.train_args(corpus_dir, out, 0.0) if not a.startswith("--train.steps")]
    # FSDP named explicitly: with no data-parallel key the planner would choose DDP for this model
    args += ["--train.steps=200", "--checkpoint.resume=auto", "--parallel.dp_shard=-1"]

    # How long the first rendezvous waits for the second agent: agents start slower on a slower
    # host, so the window scales as the hang guards do.
    last_call = f"last_call_timeout={hang_deadline(2):.0f}"

    def agent(name: str, is_host: bool):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
               f"--rdzv-conf={last_call},is_host={str(is_host).lower()}", "--max-restarts=2",
               "--monitor-interval=0.5", "-m", "ndtrain", "train", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        log = open(tmp_path / f"{name}.log", "w")
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log

    def logs() -> str:
        return "".join((tmp_path / f"{n}.log").read_text() for n in ("host", "other"))

    def rows() -> list:
        path = out / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    # The host agent serves the rendezvous store: killing the other "node" must leave it alive.
    (host, host_log), (other, other_log) = agent("host", True), agent("other", False)
    try:
        deadline = time.monotonic() + hang_deadline(300)
        while time.monotonic() < deadline and "layout dp_shard=2 on 2 x cpu" not in logs():
            time.sleep(0.2)
        start = len(rows())
        while time.monotonic() < deadline:  # two checkpoints into the 2-worker phase
            if sum("checkpoint_mode" in r for r in rows()[start:]) >= 2:
                break
            time.sleep(0.1)
        killed_at = max((r["step"] for r in rows() if "loss" in r), default=0)
        for pid in [other.pid, *descendants(other.pid)]:  # the whole second node (workers run in their own session)
            os.kill(pid, signal.SIGKILL)
        host.wait(timeout=hang_deadline(400))
    finally:
        for p in (host, other):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        host_log.close()
        other_log.close()
    log = logs()
    assert host.returncode == 0, log[-3000:]
    assert "now single on 1)" in log and killed_at < 200, (killed_at, log[-3000:])
    steps = [r["step"] for r in rows() if "loss" in r]
    assert max(steps) == 200 and (out / "checkpoints" / "step_00000200" / "COMPLETE").exists()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill_during_async_save_10_times(corpus_dir, tmp_path, reference, hang_deadline):
    """Each trial kills once while an async checkpoint is being written or published; the
    restart must load the checkpoint before it and no published checkpoint may be corrupt."""
    results = _trials(corpus_dir, tmp_path, reference, 10, lambda rng: [rng.choice(["save", "publish", "rename"])],
                      hang_deadline)
    failed = [(seed, t.faults, t.problems) for seed, t in results if not t.ok]
    print(f"kill during save: {len(results) - len(failed)}/{len(results)} trials passed")
    assert not failed, failed
