"""Planner prediction vs measured step time on this machine.

Calibrates the machine (`ndtrain calibrate`, or reuses `--profile`), then for each layout trains
the same model for a few steps with `ndtrain train --nproc W`, takes the median `step_time_s`
after warm-up from metrics.jsonl, and prints a markdown table next to
`ndtrain.planner.api.predict` for the same model, layout, sequence, batch and profile.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_vs_measured.py --quiet-cores 0.15   # calibrate + all
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_vs_measured.py --profile ~/.cache/ndtrain/hardware.json \
        --only ddp2,zero3-2 --json runs/pvm.json

Layouts run one after another (never two trainings at once), each rank with one thread. The
machine may be shared: the last column is the CPU (in cores) that other processes used during
the run, from /proc/stat less this run's own; `--quiet-cores X` waits before calibrating and
before each layout until others used under X cores over 10 s, and re-runs a layout (keeping the
least disturbed run) when they used more than 2X during it.
Model: the `tiny` preset (8 layers, dim 256, GQA 8/4 heads, ffn 768) with the byte vocabulary
(256), fp32, seq 256, global batch 8, micro-batch 2 (so pp=2 gets 4 micro-batches), on uniform
synthetic tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from common import synthetic_tokens  # noqa: E402

from ndtrain.model.config import preset  # noqa: E402
from ndtrain.planner.api import predict  # noqa: E402
from ndtrain.planner.hardware import DEFAULT_PROFILE, this_machine  # noqa: E402

PY = sys.executable
# (key, label, world, [parallel] overrides); dp_shard is explicit everywhere.
LAYOUTS = [
    ("ddp2", "DDP dp_replicate=2", 2, {"dp_replicate": 2, "dp_shard": 1}),
    ("ddp4", "DDP dp_replicate=4", 4, {"dp_replicate": 4, "dp_shard": 1}),
    ("zero3-2", "ZeRO-3 dp_shard=2", 2, {"dp_shard": 2}),
    ("zero3-4", "ZeRO-3 dp_shard=4", 4, {"dp_shard": 4}),
    ("tp2", "TP tp=2 (+SP)", 2, {"tp": 2, "dp_shard": 1}),
    ("tp4", "TP tp=4 (+SP)", 4, {"tp": 4, "dp_shard": 1}),
    ("pp2", "PP pp=2 1F1B", 2, {"pp": 2, "dp_shard": 1, "pp_schedule": "1F1B"}),
    ("pp4", "PP pp=4 1F1B", 4, {"pp": 4, "dp_shard": 1, "pp_schedule": "1F1B"}),
    ("2d", "2-D dp_shard=2 tp=2", 4, {"dp_shard": 2, "tp": 2}),
    ("3d", "3-D pp=2 dp_shard=2 tp=2", 8, {"pp": 2, "dp_shard": 2, "tp": 2, "pp_schedule": "1F1B"}),
]


def model_cfg(args):
    return preset(args.model, vocab_size=256)


def train_cmd(args, world: int, par: dict, out: Path) -> list[str]:
    flat = [f"--parallel.{k}={v}" for k, v in par.items()]
    return [PY, "-m", "ndtrain", "train", "--nproc", str(world),
            f"--model.preset={args.model}", "--model.vocab_size=256",
            f"--data.path={args.data}", f"--data.seq_len={args.seq}",
            f"--train.steps={args.steps}", f"--train.global_batch={args.global_batch}",
            f"--train.micro_batch={args.micro_batch}", "--train.val_interval=0", "--train.sample_tokens=0",
            "--logging.tensorboard=false", "--logging.progress=off", f"--train.output_dir={out}", *flat]


def busy_seconds() -> float:
    """CPU seconds all processes on the machine have used since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def ours_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_quiet(max_cores: float, window: float, deadline: float) -> float:
    """Sleep until other processes used under `max_cores` cores over the last `window` seconds
    (or until `deadline`); returns what they used in the last window."""
    while True:
        busy0 = busy_seconds()
        time.sleep(window)
        used = (busy_seconds() - busy0) / window
        if used < max_cores or time.time() > deadline:
            return used


def measure(args, key: str, world: int, par: dict) -> tuple[float, list[float], float]:
    """(median step time, the steps, other processes' CPU use in cores during the run)."""
    out = Path(args.work) / "runs" / key
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = train_cmd(args, world, par, out)
    busy0, ours0, t0 = busy_seconds(), ours_seconds(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    others = max(0.0, (busy_seconds() - busy0) - (ours_seconds() - ours0)) / (time.time() - t0)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > args.warmup]
    if not args.keep_runs:
        shutil.rmtree(out, ignore_errors=True)  # the final checkpoint is ~75 MB per run
    return statistics.median(steps), steps, others


def predicted(args, hw, world: int, par: dict):
    lay = {**par, "micro_batch": args.micro_batch, "pp_schedule": par.get("pp_schedule", "1F1B"),
           "activation_checkpoint": "none"}
    return predict(model_cfg(args), lay, args.seq, args.global_batch, hw, world=world, precision="fp32")


def calibration_lines(path: Path) -> list[str]:
    prof = json.loads(path.read_text())
    lines = [f"calibration ({path}): {prof.get('description', '')}"]
    lines += [f"  matmul {k}: {v / 1e9:.1f} GFLOP/s" for k, v in prof["matmul"].items()]
    lines.append(f"  copy bandwidth {prof['memory']['copy_bw'] / 1e9:.2f} GB/s, eager op + backward "
                 f"{prof['op_overhead_s'] * 1e6:.1f} us")
    for dtype, rates in prof.get("attention", {}).items():
        lines.append(f"  causal attention {dtype}: " + ", ".join(f"seq {s} {r / 1e9:.1f}" for s, r in rates.items())
                     + " GFLOP/s")
    if "host_s" in prof:
        lines.append(f"  host per micro-batch: {prof['host_s']['layer'] * 1e3:.2f} ms per layer + "
                     f"{prof['host_s']['head'] * 1e3:.2f} ms; grad norm + AdamW "
                     f"{prof['optimizer_s_per_param'] * 1e9:.2f} ns per parameter")
    for world, by_tp in prof.get("tp_host", {}).items():
        for t, fit in by_tp.items():
            lines.append(f"  TP tp={t} at world {world}: per layer {fit['layer']['alpha'] * 1e3:.2f} ms + "
                         f"{fit['layer']['per_byte'] * 1e9:.2f} ns/B, per micro-batch {fit['head']['alpha'] * 1e3:.2f} ms"
                         f" + {fit['head']['per_byte'] * 1e9:.2f} ns/B")
    for world, fits in prof.get("dp_in_situ", {}).items():
        lines.append(f"  FSDP/DDP in situ at world {world}: " + ", ".join(
            f"{k} alpha {f['alpha'] * 1e6:.0f} us, beta {f['beta'] / 1e9:.2f} GB/s" for k, f in fits.items()
            if k != "measured"))
    if "mm_eff" in prof:
        lines.append(f"  training GEMMs reach {prof['mm_eff']:.2f} of the square-matmul rate (mm_eff)")
    for kind, fit in prof["collectives"].items():
        lines.append(f"  {kind} (isolated): " + ", ".join(f"world {w}: alpha {f['alpha'] * 1e6:.0f} us, beta {f['beta'] / 1e9:.2f} GB/s"
                                              for w, f in fit.get("by_world", {"all": fit}).items()))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", help="reuse this hardware profile instead of running `ndtrain calibrate`")
    p.add_argument("--calibrate-out", default=str(DEFAULT_PROFILE), help="where `ndtrain calibrate` writes")
    p.add_argument("--only", default="", help="comma list of layout keys: " + ",".join(k for k, *_ in LAYOUTS))
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    p.add_argument("--work", default="/tmp/ndtrain-planner-vs-measured")
    p.add_argument("--predict-only", action="store_true", help="print the predictions, train nothing")
    p.add_argument("--json", help="also write the rows (with every measured step) here")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--keep-runs", action="store_true", help="keep each run's directory (metrics, checkpoint)")
    p.add_argument("--quiet-cores", type=float, default=0.0,
                   help="before each layout, wait until other processes use fewer cores than this over 10 s "
                        "(0 = do not wait)")
    p.add_argument("--quiet-wait-max", type=float, default=1800, help="give up waiting after this many seconds in all")
    p.add_argument("--retries", type=int, default=2,
                   help="with --quiet-cores: run a layout again (keeping the least disturbed run) when other "
                        "jobs used more than twice that during it")
    args = p.parse_args()

    started = time.time()
    if args.profile:
        profile = Path(args.profile).expanduser()
    else:
        profile = Path(args.calibrate_out).expanduser()
        if args.quiet_cores:
            wait_quiet(args.quiet_cores, 10.0, started + args.quiet_wait_max)
        subprocess.run([PY, "-m", "ndtrain", "calibrate", "--out", str(profile)], cwd=ROOT, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    hw = this_machine(profile)
    args.data = str(synthetic_tokens(Path(args.work) / "data-256", vocab=256))
    keys = [k for k in args.only.split(",") if k] or [k for k, *_ in LAYOUTS]
    unknown = set(keys) - {k for k, *_ in LAYOUTS}
    if unknown:
        p.error(f"unknown layouts {sorted(unknown)}")

    print("\n".join(calibration_lines(profile)))
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; cores {os.cpu_count()}")
    header = ("| layout | world | predicted (s) | = compute + exposed comm + bubble + other | measured (s) "
              "| measured / predicted | other jobs (cores) |")
    rows_md, rows_json = [header, "|---|---|---|---|---|---|---|"], []
    for key, label, world, par in LAYOUTS:
        if key not in keys:
            continue
        pred = predicted(args, hw, world, par)
        t = pred.time
        other = t["total"] - t["compute"] - t["exposed_comm"] - t["bubble"]
        comm = ", ".join(f"{k} {v:.3f}" for k, v in t["comm"].items() if v > 5e-4)
        parts = (f"{t['compute']:.3f} + {t['exposed_comm']:.3f}" + (f" ({comm})" if comm else "")
                 + f" + {t['bubble']:.3f} + {other:.3f}")
        if args.predict_only:
            med, steps, others = float("nan"), [], float("nan")
        else:
            tries = []
            for _ in range(1 + args.retries):
                if args.quiet_cores:
                    wait_quiet(args.quiet_cores, 10.0, started + args.quiet_wait_max)
                tries.append(measure(args, key, world, par))
                if not args.quiet_cores or tries[-1][2] < 2 * args.quiet_cores:
                    break  # other jobs stayed quiet during the run
            med, steps, others = min(tries, key=lambda x: x[2])  # the run least disturbed by other jobs
        ratio = med / pred.step_time
        rows_md.append(f"| {label} | {world} | {pred.step_time:.3f} | {parts} | {med:.3f} | {ratio:.2f} "
                       f"| {others:.2f} |")
        rows_json.append({"key": key, "label": label, "world": world, "parallel": par, "predicted": pred.step_time,
                          "time": {k: v for k, v in t.items() if k != "stage_layers"}, "measured": med,
                          "steps": steps, "ratio": ratio, "others_cores": others})
        print(rows_md[-1], flush=True)
    load = os.getloadavg()
    print(f"\nload average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; wall {time.time() - started:.0f} s\n")
    print("\n".join(rows_md))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"profile": str(profile), "rows": rows_json}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
