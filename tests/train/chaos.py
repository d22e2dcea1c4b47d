"""Chaos trials: `ndtrain train --nproc 2 --max-restarts K` with ranks killed (SIGKILL) or hung at
random steps and inside async checkpoint writes; the final weights must be bit-identical to an
uninterrupted run, every kill must have happened, every published checkpoint must verify, and a
resume after a kill during a save must load the checkpoint before it.

Used by tests/train/test_ckpt_chaos.py, and runnable alone:
    OMP_NUM_THREADS=1 .venv/bin/python tests/train/chaos.py --trials 20 --data data/stdlib-byte
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

STEPS, INTERVAL = 12, 2


def train_args(data: Path, out: Path, deadline_s: float) -> list[str]:
    # A hung rank is the step watchdog's to find: the collective timeout stays well above its
    # deadline (which tests scale with the host's speed), or the peer's collective would fail first.
    collective_s = max(60.0, 10 * deadline_s)
    return ["--model.preset=debug", f"--data.path={data}", "--data.seq_len=64", f"--train.steps={STEPS}",
            "--train.global_batch=8", "--train.micro_batch=4", "--train.val_interval=0", "--train.sample_tokens=0",
            "--train.log_interval=1", f"--train.step_deadline_s={deadline_s}", f"--train.timeout_s={collective_s:.0f}",
            f"--checkpoint.interval_steps={INTERVAL}", "--checkpoint.async=true", "--checkpoint.keep_last=2",
            "--logging.tensorboard=false", "--logging.progress=off", f"--train.output_dir={out}"]


def launch(data: Path, out: Path, faults: str = "", restarts: int = 0, deadline_s: float = 0.0,
           timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NDTRAIN_FAULTS": faults}
    cmd = [sys.executable, "-m", "ndtrain", "train", "--nproc", "2", "--max-restarts", str(restarts),
           *train_args(data, out, deadline_s)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def final_weights(out: Path) -> dict:
    from ndtrain.train.checkpoint import load_model_weights, step_name

    return load_model_weights(out / "checkpoints" / step_name(STEPS))[0]


def plan(rng: random.Random, points: list[str]) -> list[tuple[int, int, int, str, float]]:
    """One fault per restart attempt, at `points` in order: (attempt, rank, step, point, delay).
    Steps strictly increase, so each attempt reaches its fault after resuming from the previous
    one's last checkpoint; `delay` places a `step` kill at a random moment inside the step
    (forward, backward, optimizer or a collective)."""
    faults, step = [], 0
    for attempt, point in enumerate(points):
        if point in ("save", "publish", "rename"):
            options = [s for s in range(step + 1, STEPS) if s % INTERVAL == 0]
        else:  # not the last step: a kill timed after it could miss a process that already exited
            options = list(range(step + 1, STEPS))
        left = len(points) - attempt - 1
        options = options[: max(1, len(options) - 2 * left)]  # leave room for the later faults
        if not options:
            break
        step = rng.choice(options)
        rank = 0 if point in ("publish", "rename") else rng.randrange(2)
        faults.append((attempt, rank, step, point, round(rng.uniform(0.0, 0.08), 3) if point == "step" else 0.0))
    return faults


@dataclass
class Trial:
    faults: list
    ok: bool = False
    problems: list = field(default_factory=list)
    kills: int = 0
    seconds: float = 0.0


def run_trial(data: Path, out: Path, reference: dict, faults: list, deadline_s: float, timeout: float = 600) -> Trial:
    import torch

    from ndtrain.train.checkpoint import list_checkpoints, verify_checkpoint

    trial = Trial(faults)
    text = ",".join(f"{a}:{r}:{s}:{p}:{d}" for a, r, s, p, d in faults)
    t0 = time.perf_counter()
    proc = launch(data, out, text, restarts=len(faults) + 1, deadline_s=deadline_s, timeout=timeout)
    trial.seconds = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        trial.problems.append(f"exit {proc.returncode}: {log[-3000:]}")
        return trial
    happened = (out / "faults.log").read_text().splitlines() if (out / "faults.log").exists() else []
    trial.kills = len(happened)
    expected = len(faults)
    if trial.kills != expected:
        trial.problems.append(f"{trial.kills} faults happened, {expected} planned: {happened}")
    hangs = sum(p == "hang" for _, _, _, p, _ in faults)
    if hangs and "exceeded train.step_deadline_s" not in log:
        trial.problems.append("a rank hung but no watchdog fired")
    # One line per restart, in order: the checkpoint it resumed from (-1: none yet).
    resumed = [int(step) if step else -1 for step, _ in
               re.findall(r"resumed from \S*step_(\d+) at step|(no checkpoint under)", log)]
    if len(resumed) != expected:
        trial.problems.append(f"{len(resumed)} restarts logged, {expected} expected")
    for a, _, s, p, _ in faults:
        if p in ("save", "publish", "rename") and (len(resumed) <= a or resumed[a] >= s):
            trial.problems.append(f"after a kill while saving step {s}, the restart resumed from {resumed[a:a + 1]}")
    for ckpt in list_checkpoints(out / "checkpoints"):
        problem = verify_checkpoint(ckpt)
        if problem:
            trial.problems.append(f"published checkpoint {ckpt.name} is corrupt: {problem}")
    got = final_weights(out)
    differ = [k for k in reference if not torch.equal(reference[k], got[k])]
    if differ:
        trial.problems.append(f"{len(differ)} tensors differ from the uninterrupted run, e.g. {differ[:2]}")
    trial.ok = not trial.problems
    return trial


def reference_weights(data: Path, out: Path, timeout: float = 600) -> dict:
    proc = launch(data, out, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    return final_weights(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--kills", type=int, default=3, help="faults per trial")
    p.add_argument("--points", default="step,step,save,publish,rename", help="fault points to draw from "
                   "(add 'hang' with --deadline)")
    p.add_argument("--data", default="data/stdlib-byte")
    p.add_argument("--work", default="/tmp/ndtrain-chaos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=0.0, help="train.step_deadline_s (needed for 'hang')")
    a = p.parse_args()
    work = Path(a.work)
    ref = reference_weights(Path(a.data), work / "reference")
    rng = random.Random(a.seed)
    passed = 0
    for i in range(a.trials):
        faults = plan(rng, [rng.choice(a.points.split(",")) for _ in range(a.kills)])
        t = run_trial(Path(a.data), work / f"trial{i}", ref, faults, a.deadline)
        passed += t.ok
        print(f"trial {i}: {'ok' if t.ok else 'FAILED'} {t.kills} faults {faults} {t.seconds:.0f} s "
              f"{'; '.join(t.problems)[:2000]}", flush=True)
    print(f"{passed}/{a.trials} trials passed")
    return 0 if passed == a.trials else 1


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


if __name__ == "__main__":
    sys.exit(main())
