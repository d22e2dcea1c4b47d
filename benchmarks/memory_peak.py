"""Peak resident memory per rank for DDP and the ZeRO stages, beside the planner's prediction.

    .venv/bin/python benchmarks/memory_peak.py [--preset tiny] [--worlds 2,4] [--steps 3]

memory_report.py counts the tensors a rank holds at one instant; this script measures what the
process actually reaches: each layout runs in fresh forked ranks, each rank resets its resident
high-water mark (/proc/self/clear_refs), notes its resident set before the Trainer is built
(Python and torch: the planner's `overhead`), trains `--steps` steps of two micro-batches, and
reports VmHWM. "added" is the peak minus that start, the part the planner's model-state,
activation, logit and buffer terms predict (its total minus `overhead`). Rank 0 and the largest
rank are both shown; the planner predicts the fullest rank.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import host_header, synthetic_tokens

LAYOUTS = {"DDP": "dp_replicate={w},ga=2", "ZeRO-1": "dp_shard={w},zero=1,ga=2", "ZeRO-2": "dp_shard={w},zero=2,ga=2",
           "ZeRO-3": "dp_shard={w},zero=3,ga=2"}
PLANNER = {"DDP": "dp_replicate={w},dp_shard=1", "ZeRO-1": "dp_shard={w},zero=1", "ZeRO-2": "dp_shard={w},zero=2",
           "ZeRO-3": "dp_shard={w},zero=3"}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(cfg, steps: int):
    import torch

    from ndtrain.train.trainer import Trainer

    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
    start = _status_kib("VmRSS")
    t = Trainer(cfg, None, log=False)
    phases = [_status_kib("VmHWM")]  # after the build, then after each step
    for _ in range(steps):
        t.train_step()
        phases.append(_status_kib("VmHWM"))
    t.close()
    return torch.tensor([start, phases[-1], *phases], dtype=torch.float64) * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0, help="override the preset's n_layers (a second size)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--phases", action="store_true", help="also print rank 0's high-water mark per phase")
    a = ap.parse_args()
    from ndtrain.config import load_config
    from ndtrain.model.config import num_params, preset
    from ndtrain.parallel.launch import run_ranks
    from ndtrain.planner.api import predict
    from ndtrain.tools.verify import layout_config

    over = {"n_layers": a.layers} if a.layers else {}
    shape = preset(a.preset, **over)
    data = synthetic_tokens(Path(tempfile.mkdtemp()) / "data", shape.vocab_size, 400_000)
    mib = 2**20
    print(f"{a.preset}{f' n_layers={a.layers}' if a.layers else ''}: Ψ = {num_params(shape):,}; seq 128, global batch 2 x world, two micro-batches per step\n")
    print(host_header() + "\n")
    print("| world | precision | layout | start (MiB) | peak rank 0 | peak max | added (max) | planner total "
          "| planner - overhead | added / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in (int(x) for x in a.worlds.split(",")):
        for mp in a.precisions.split(","):
            base = {"model": {"preset": a.preset, **over}, "data": {"path": str(data), "seq_len": 128},
                    "train": {"global_batch": 2 * w}, "parallel": {"mixed_precision": mp}}
            load_config(None, base)
            for name, spec in LAYOUTS.items():
                cfg = layout_config(base, spec.format(w=w))
                rows = [r.tolist() for r in run_ranks(w, measure, cfg, a.steps, timeout_s=600)]
                start = max(r[0] for r in rows)
                peak0, peak = rows[0][1], max(r[1] for r in rows)
                added = max(r[1] - r[0] for r in rows)
                m = predict(shape, PLANNER[name].format(w=w), 128, 2 * w, world=w, precision=mp).memory
                pred = m["total"] - m["overhead"]
                print(f"| {w} | {mp} | {name} | {start / mib:.0f} | {peak0 / mib:.0f} | {peak / mib:.0f} | "
                      f"{added / mib:.0f} | {m['total'] / mib:.0f} | {pred / mib:.0f} | {added / pred:.2f} |", flush=True)
                if a.phases:
                    print("  rank 0 high-water after build, then each step (MiB):",
                          " ".join(f"{x / mib:.0f}" for x in rows[0][2:]), flush=True)


if __name__ == "__main__":
    main()
