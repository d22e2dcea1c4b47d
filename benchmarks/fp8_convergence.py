"""FP8 convergence: the `tiny` preset on the default corpus, trained N steps in bf16 and in fp8
from the same initial weights on the same batches; validation losses side by side.

    make data   # the default corpus, data/stdlib-byte
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/fp8_convergence.py

The two runs are launched together as `ndtrain train` processes (one process each, one thread
each), so they share the machine's load alike; the load average is recorded. The pass mark is
the issue's: the fp8 run's final validation loss within 3% of bf16's. On CPU fp8 GEMMs run
through torch._scaled_mm's reference kernel, several times slower than bf16 matmuls: this is a
numerics check, not a speed one (see gpu_fp8_throughput.py for speed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(mp: str, args, out: Path) -> list[str]:
    return [sys.executable, "-m", "ndtrain", "train", "--config", "configs/default.toml",
            f"--data.path={args.data}", f"--data.seq_len={args.seq}", "--parallel.dp_shard=1",
            f"--parallel.mixed_precision={mp}", f"--parallel.fp8_recipe={args.recipe}",
            f"--train.steps={args.steps}", f"--train.global_batch={args.batch}", f"--train.micro_batch={args.batch}",
            f"--train.val_interval={args.val_interval}", f"--train.val_batches={args.val_batches}",
            "--train.sample_tokens=0", "--checkpoint.interval_steps=0", "--logging.tensorboard=false",
            "--logging.progress=off", f"--train.output_dir={out}"]


def read(run_dir: Path) -> tuple[dict[int, float], list[dict]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}, [r for r in rows if "loss" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global batch in sequences (one process)")
    p.add_argument("--val-interval", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    p.add_argument("--data", default="data/stdlib-byte")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    if not (ROOT / args.data / "manifest.json").exists() and not Path(args.data, "manifest.json").exists():
        print(f"no prepared corpus at {args.data}: run `make data` first", file=sys.stderr)
        return 2
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ndtrain-fp8-conv-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load0 = os.getloadavg()
    t0 = time.time()
    procs = {mp: subprocess.Popen(command(mp, args, root / mp), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for mp in ("bf16", "fp8")}
    for mp, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode:
            print(f"{mp} run failed:\n{err[-2000:]}", file=sys.stderr)
            return 1
    wall = time.time() - t0
    load1 = os.getloadavg()
    val = {mp: read(root / mp)[0] for mp in procs}
    steps = {mp: read(root / mp)[1] for mp in procs}
    print(f"tiny preset, default corpus ({args.data}), seq {args.seq}, global batch {args.batch}, "
          f"{args.steps} steps, fp8 recipe {args.recipe}; one process each, run side by side")
    print(f"wall {wall:.0f} s; load average {load0[0]:.1f} before, {load1[0]:.1f} after\n")
    print("| step | bf16 val loss | fp8 val loss | fp8 / bf16 |")
    print("|---|---|---|---|")
    for step in sorted(val["bf16"]):
        a, b = val["bf16"][step], val["fp8"].get(step, float("nan"))
        print(f"| {step} | {a:.4f} | {b:.4f} | {b / a:.4f} |")
    median = {mp: sorted(r["step_time_s"] for r in rows)[len(rows) // 2] for mp, rows in steps.items()}
    print(f"\nmedian step time: bf16 {median['bf16']:.2f} s, fp8 {median['fp8']:.2f} s (CPU; not a speed result)")
    last = max(val["bf16"])
    ratio = val["fp8"][last] / val["bf16"][last]
    ok = abs(ratio - 1) <= 0.03
    print(f"final validation loss: fp8 / bf16 = {ratio:.4f} ({(ratio - 1) * 100:+.2f}%): "
          f"{'within' if ok else 'OUTSIDE'} 3%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
