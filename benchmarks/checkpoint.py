"""Checkpoint cost: sync save time vs the training stall of an async save, restart-to-first-
step time after a rank is killed, and publish/verify time vs the number of ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint.py --preset small --saves 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint.py --restart-only --preset debug
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint.py --publish-verify --total-mb 256 --per-rank-mb 32

Part 3 (--publish-verify) forks 1, 2, 4 and 8 ranks. Each writes its shard file (the bytes DCP
would write: total/world each for a fixed checkpoint, or a fixed size each as the model grows
with the world), then the checkpoint is published and verified the old way (rank 0 hashes every
file) and the new way (each rank hashes its own shards, rank 0 combines the digests; verification
shared out by size), interleaved, several repetitions; medians are printed with the load average.

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
    from ndtrain.train.trainer import Trainer

    sync_cfg = load_config(None, {**base, "checkpoint": {"async": False, "keep_last": 1}})
    async_cfg = load_config(None, {**base, "checkpoint": {"async": True, "keep_last": 1}})
    trainer = Trainer(sync_cfg, run_dir=None, log=False)
    trainer.train_step()  # optimizer state exists from here on
    sync_ck = trainer.checkpointer(Path(root) / "sync", sync_cfg)
    async_ck = trainer.checkpointer(Path(root) / "async", async_cfg)
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
            # The kill comes from the tests' fault plan (tests/train/fault_plan.py), installed by the job hook.
            fault_plan_dir = str(Path(__file__).resolve().parents[1] / "tests" / "train")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "NDTRAIN_FAULTS": f"0:1:{kill_step}:step:0.0",
                   "NDTRAIN_JOB_HOOKS": "fault_plan:hooks",
                   "PYTHONPATH": os.pathsep.join(filter(None, [fault_plan_dir, os.environ.get("PYTHONPATH")]))}
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


def _publish_verify_rank(root: str, per_rank: int, reps: int) -> list[dict]:
    import pickle
    import shutil

    import numpy as np
    import torch.distributed as dist
    from torch.distributed.checkpoint.metadata import Metadata

    from ndtrain.train.checkpoint.digest import collect_digests, verify_shared, write_manifest_from, write_own_digests
    from ndtrain.train.checkpoint import verify_checkpoint, write_manifest, write_marker

    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(rank)
    rows = []
    for rep in range(-1, reps):  # repetition -1 warms up (imports, allocator) and is not kept
        for mode in (("before", "after") if rep % 2 == 0 else ("after", "before")):  # interleaved
            tmp = Path(root) / f"rep{rep}-{mode}" / ".step_00000001.partial"
            if rank == 0:
                tmp.mkdir(parents=True)
                (tmp / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
                (tmp / "train_state.json").write_text("{}" + " " * 10_000)
            dist.barrier()
            (tmp / f"__{rank}_0.distcp").write_bytes(rng.bytes(per_rank))
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            if mode == "before":
                if rank == 0:
                    write_manifest(tmp)  # the old publish: rank 0 hashes every shard
            else:
                write_own_digests(tmp, rank)
                dist.barrier()
                if rank == 0:
                    write_manifest_from(tmp, collect_digests(tmp, world, 600))
            publish_cpu = time.thread_time() - c0
            dist.barrier()
            publish_s = time.perf_counter() - t0
            if rank == 0:
                write_marker(tmp, "step_00000001")
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            if mode == "before":
                ok = verify_checkpoint(tmp) is None if rank == 0 else True  # the old resume: rank 0 hashes all
            else:
                ok = verify_shared([tmp])[str(tmp)] is None
            verify_cpu = time.thread_time() - c0
            dist.barrier()
            verify_s = time.perf_counter() - t0
            if rep >= 0:
                rows.append({"mode": mode, "publish_s": publish_s, "verify_s": verify_s, "publish_cpu": publish_cpu,
                             "verify_cpu": verify_cpu, "ok": ok})
            if rank == 0:
                shutil.rmtree(tmp.parent)
            dist.barrier()
    return rows


def bench_publish_verify(args) -> None:
    import statistics

    from ndtrain.parallel.launch import run_ranks

    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} cores")
    for label, per_rank_of in (("fixed checkpoint", lambda w: args.total_mb * 2**20 // w),
                               ("fixed shard per rank", lambda w: args.per_rank_mb * 2**20)):
        print(f"\n{label}: median of {args.reps} interleaved repetitions, seconds. cpu = busiest rank's CPU "
              f"time (its critical path when every rank has its own core); wall = barrier to barrier here, "
              f"{os.cpu_count()} cores shared by all ranks")
        print("| ranks | total MiB | publish cpu before | after | verify cpu before | after "
              "| publish wall before | after | verify wall before | after |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for world in worlds:
            with tempfile.TemporaryDirectory(prefix="ndtrain-pv-", dir=args.tmp) as root:
                per_rank = run_ranks(world, _publish_verify_rank, root, per_rank_of(world), args.reps,
                                     timeout_s=1800)
            rows = [r for ranks in zip(*per_rank) for r in ranks]
            assert all(r["ok"] for r in rows), "a benchmark checkpoint did not verify"

            def med(mode, key):
                # per repetition, the slowest (busiest) rank; then the median over repetitions
                spans = [max(r[key] for r in rep if r["mode"] == mode) for rep in zip(*per_rank)
                         if any(r["mode"] == mode for r in rep)]
                return statistics.median(spans)

            cells = [med(m, k) for k in ("publish_cpu", "verify_cpu", "publish_s", "verify_s")
                     for m in ("before", "after")]
            print(f"| {world} | {world * per_rank_of(world) / 2**20:.0f} | " + " | ".join(f"{c:.2f}" for c in cells)
                  + " |", flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


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
    p.add_argument("--publish-verify", action="store_true", help="only part 3: publish/verify time vs ranks")
    p.add_argument("--worlds", default="1,2,4,8")
    p.add_argument("--total-mb", type=int, default=256, help="part 3: the fixed checkpoint's size")
    p.add_argument("--per-rank-mb", type=int, default=32, help="part 3: each rank's shard when the model grows")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tmp", default=None, help="part 3: where the shards are written (default: the system temp)")
    a = p.parse_args()
    if a.publish_verify:
        bench_publish_verify(a)
        return 0
    if not a.restart_only:
        bench_saves(a)
    if not a.saves_only:
        bench_restart(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
