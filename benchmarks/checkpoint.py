"""Checkpoint cost: sync save time vs the training stall of an async save, and restart-to-first-
step time after a rank is killed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint.py --preset small --saves 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint.py --restart-only --preset debug

Part 1 runs in two forked ranks (FSDP dp_shard=2). Each round does one sync save and one async
save side by side, from the same trained state; the async stall is what the training loop
waits for (state dict + copy into RAM), and its write goes on while the next steps run.
Part 2 launches `ndtrain train --nproc 2 --max-restarts 1`, kills rank 1 (SIGKILL) in a step
after a checkpoint, and measures from the kill to the first step of the restarted group.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _base(preset: str, data: str, seq: int) -> dict:
    return {"model": {"preset": preset}, "data": {"path": data, "seq_len": seq},
            "train": {"global_batch": 2, "micro_batch": 1, "steps": 1000, "val_interval": 0, "sample_tokens": 0},
            "parallel": {"dp_shard": 2}, "logging": {"tensorboard": False, "progress": "off"}}


def _save_rounds(base: dict, root: str, saves: int, steps_between: int) -> list[dict]:
    import torch.distributed as dist

    from ndtrain.config import load_config
    from ndtrain.train.checkpoint import Checkpointer
    from ndtrain.train.trainer import Trainer

    sync_cfg = load_config(None, {**base, "checkpoint": {"async": False, "keep_last": 1}})
    async_cfg = load_config(None, {**base, "checkpoint": {"async": True, "keep_last": 1}})
    trainer = Trainer(sync_cfg, run_dir=None, log=False)
    trainer.train_step()  # optimizer state exists from here on
    sync_ck = Checkpointer(sync_cfg, Path(root) / "sync", trainer)
    async_ck = Checkpointer(async_cfg, Path(root) / "async", trainer)
    rows = []
    for _ in range(saves):
        dist.barrier()
        t0 = time.perf_counter()
        sync_ck.save()
        sync_s = time.perf_counter() - t0
        step_times = []
        for _ in range(steps_between):
            step_times.append(trainer.train_step().seconds)
        dist.barrier()
        async_ck.save()
        stall_s = async_ck.pending.stall_s
        overlapped = []
        for _ in range(steps_between):
            overlapped.append(trainer.train_step().seconds)
        async_ck.wait()
        total_s = async_ck.history[-1]["checkpoint_total_s"]
        rows.append({"sync_s": sync_s, "stall_s": stall_s, "async_total_s": total_s,
                     "step_s": statistics.median(step_times), "step_during_write_s": statistics.median(overlapped)})
    async_ck.finish()
    size = sum(p.stat().st_size for p in (Path(root) / "async" / "checkpoints").rglob("*") if p.is_file())
    for r in rows:
        r["bytes"] = size
    return rows


def bench_saves(args) -> None:
    from ndtrain.parallel.launch import run_ranks

    with tempfile.TemporaryDirectory(prefix="ndtrain-ckpt-bench-") as root:
        per_rank = run_ranks(2, _save_rounds, _base(args.preset, args.data, args.seq_len), root, args.saves,
                             args.steps_between, timeout_s=1800)
    rows = per_rank[0]
    print(f"\n{args.preset} preset, world 2 (FSDP dp_shard=2), checkpoint {rows[0]['bytes'] / 2**20:.0f} MiB "
          f"(model + AdamW state)")
    print("round  sync save (s)  async stall (s)  stall/sync  async write+publish (s)  step (s)  step during write (s)")
    for i, r in enumerate(rows):
        print(f"{i:>5}  {r['sync_s']:>13.2f}  {r['stall_s']:>15.3f}  {r['stall_s'] / r['sync_s']:>10.1%}  "
              f"{r['async_total_s']:>23.2f}  {r['step_s']:>8.2f}  {r['step_during_write_s']:>21.2f}")
    steady = rows[1:] or rows
    print(f"median stall/sync over rounds {1 if len(rows) > 1 else 0}..{len(rows) - 1}: "
          f"{statistics.median(r['stall_s'] / r['sync_s'] for r in steady):.1%}")


def bench_restart(args) -> None:
    with tempfile.TemporaryDirectory(prefix="ndtrain-restart-bench-") as tmp:
        results = []
        for trial in range(args.restarts):
            out = Path(tmp) / f"run{trial}"
            kill_step = 3
            env = {**os.environ, "OMP_NUM_THREADS": "1", "NDTRAIN_FAULTS": f"0:1:{kill_step}:step:0.0"}
            cmd = [sys.executable, "-m", "ndtrain", "train", "--nproc", "2", "--max-restarts", "1",
                   f"--model.preset={args.preset}", f"--data.path={args.data}", f"--data.seq_len={args.seq_len}",
                   "--train.steps=4", "--train.global_batch=2", "--train.micro_batch=1", "--train.val_interval=0",
                   "--train.sample_tokens=0", "--checkpoint.interval_steps=2", "--logging.tensorboard=false",
                   "--logging.progress=off", f"--train.output_dir={out}"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            killed = float((out / "faults.log").read_text().split()[0])
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            first = min(r["time"] for r in rows if "loss" in r and r.get("time", 0) > killed)
            step_s = next(r["step_time_s"] for r in rows if r.get("time") == first)
            results.append((first - killed - step_s, first - killed))
            print(f"trial {trial}: kill -> restarted group starts its first step {first - killed - step_s:.1f} s, "
                  f"-> that step done {first - killed:.1f} s")
        print(f"{args.preset}: restart to first step (start / done), median "
              f"{statistics.median(r[0] for r in results):.1f} s / {statistics.median(r[1] for r in results):.1f} s "
              f"over {len(results)} kills")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--data", default=str(ROOT / "data" / "stdlib-byte"))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--steps-between", type=int, default=2)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--restart-only", action="store_true")
    p.add_argument("--saves-only", action="store_true")
    a = p.parse_args()
    if not a.restart_only:
        bench_saves(a)
    if not a.saves_only:
        bench_restart(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
