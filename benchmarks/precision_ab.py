"""bf16 against fp32 for `make train`'s run (the tiny model, configs/default.toml, two ranks),
interleaved: each pass trains the same short run once per precision, alternating which goes
first, and prints tokens/s and tokens per CPU-second (what a rank's own thread did, so other
tenants of a shared host stretch it less), with the per-pass ratio. The median of the per-pass
ratios is the figure: two runs of one pass share that minute's load.

    .venv/bin/python benchmarks/precision_ab.py [--passes 3] [--steps 30] [--warmup 5]

It answers issue 29's "bf16/fp32 tokens/s of tiny" for the host it runs on; the host probe's own
verdict (docs/host-probe.md) is what `make train` uses to choose."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, host_header

NDTRAIN = [sys.executable, "-m", "ndtrain.cli"]


def one_run(out: Path, precision: str, steps: int, data: str) -> list[dict]:
    cmd = [*NDTRAIN, "train", "--config", str(ROOT / "configs/default.toml"), "--nproc", "2",
           f"--data.path={data}", f"--train.steps={steps}", "--train.val_interval=0", "--train.sample_tokens=0",
           "--checkpoint.interval_steps=0", "--logging.tensorboard=false", "--logging.progress=off",
           f"--parallel.mixed_precision={precision}", f"--train.output_dir={out}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=1800)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "tokens_per_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of each run's median")
    ap.add_argument("--data", default=str(ROOT / "data/stdlib-byte"), help="the corpus `make train` prepares")
    a = ap.parse_args()
    print(host_header(), flush=True)
    ratios, cpu_ratios = [], []
    with tempfile.TemporaryDirectory(prefix="precision-ab-") as tmp:
        for p in range(a.passes):
            got = {}
            for prec in (("fp32", "bf16") if p % 2 == 0 else ("bf16", "fp32")):
                rows = one_run(Path(tmp) / f"p{p}-{prec}", prec, a.steps, a.data)[a.warmup:]
                tok = statistics.median(r["tokens_per_s"] for r in rows)
                # tokens per CPU-second per rank: a step's tokens over its rank's thread time
                cpu = statistics.median(r["tokens_per_s"] * r["step_time_s"] / r["step_cpu_s"] for r in rows)
                got[prec] = (tok, cpu)
                print(f"pass {p} {prec:5s} {tok:8,.0f} tok/s {cpu:8,.0f} tok/CPU-s", flush=True)
            ratios.append(got["bf16"][0] / got["fp32"][0])
            cpu_ratios.append(got["bf16"][1] / got["fp32"][1])
            print(f"pass {p} bf16/fp32 {ratios[-1]:.2f}x tok/s, {cpu_ratios[-1]:.2f}x tok/CPU-s", flush=True)
    print(f"bf16 / fp32, median of {a.passes} passes: {statistics.median(ratios):.2f}x tokens/s "
          f"({' / '.join(f'{r:.2f}' for r in ratios)}), {statistics.median(cpu_ratios):.2f}x tokens/CPU-s")
    print(host_header().replace("host:", "after:", 1))


if __name__ == "__main__":
    main()
