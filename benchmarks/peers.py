"""ndtrain beside the peers a user could pick instead, in interleaved passes, one run.

    .venv/bin/python benchmarks/peers.py [--passes 3] [--steps 20] [--precision fp32] [--only a,b]

Every run trains the same shape (torchtitan's debugmodel: dim 256, 6 layers, 16 heads, FFN 768,
vocab 2048, 6.2M parameters) on uniform random tokens, seq 256, micro-batch 4 per rank, world 2
(one thread per rank), AdamW with clipping, at one precision:

  floor           plain-PyTorch FSDP2 script (fsdp_floor.py)
  ds-zero1/3      DeepSpeed ZeRO-1 / ZeRO-3 on the floor's model (deepspeed_peer.py; the `bench`
                  extra, DS_ACCELERATOR=cpu); skipped, with one line, when DeepSpeed is absent
  nd-fsdp         ndtrain dp_shard=2, zero=3
  nd-ddp          ndtrain dp_replicate=2 (replicated: DDP)
  nd-zero1        ndtrain dp_shard=2, zero=1
  nd-default      ndtrain with no [parallel] setting: the defaults' choice
  nd-auto         ndtrain [parallel] auto = true: the planner's choice

Each pass runs every configuration once, in a rotated order. Per run: tokens/s (median step
after the warm-up steps), peak RSS of the largest process (the fullest rank), time to first step
(launch to the end of step 1), CPU-MFU (6N + attention FLOPs, ndtrain.layout.flops, against
world x the matmul peak of one thread measured at the start), tokens per CPU-second of one rank (the median step's tokens per
rank over the CPU time its process used: the work a step costs, which the shared host's load
stretches far less than the wall time) and the 1-minute load average before and after. The summary has
medians over passes and their ratios to the floor and to the best peer.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_MODEL, PY, ROOT, host_header, peer_train_command, synthetic_tokens, torchrun

PEERS = ("floor", "ds-zero1", "ds-zero3")
ND_LAYOUTS = {"nd-fsdp": ["--parallel.dp_shard=2", "--parallel.zero=3"],
              "nd-ddp": ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
              "nd-zero1": ["--parallel.dp_shard=2", "--parallel.zero=1"],
              "nd-default": [],
              "nd-auto": ["--parallel.auto=true"]}
# Runs each command in a fresh process so RUSAGE_CHILDREN is this run's alone: the largest
# descendant's peak RSS (torchrun waits for its workers, so they count).
RUSAGE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
          "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
          "sys.exit(r.returncode)")


def has_deepspeed() -> bool:
    return subprocess.run([PY, "-c", "import deepspeed"], capture_output=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0


def launch(cmd: list[str], env_extra: dict) -> tuple[str, float, float]:
    """Runs cmd; returns (stdout, launch wall-clock time, peak RSS MiB of its largest process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    start = time.time()
    proc = subprocess.run([PY, "-c", RUSAGE, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rss = [int(x.split()[1]) for x in proc.stderr.splitlines() if x.startswith("PEAK_RSS_KB")][-1] / 1024
    return proc.stdout, start, rss


def run_one(name: str, a, data: Path, tmp: Path, i: int) -> dict:
    bf16 = ["--bf16"] if a.precision == "bf16" else []
    common_args = [f"--steps={a.steps}", f"--warmup={a.warmup}", f"--mb={a.mb}", f"--seq={a.seq}", *bf16]
    if name in PEERS:
        script = "benchmarks/fsdp_floor.py" if name == "floor" else "benchmarks/deepspeed_peer.py"
        stage = [] if name == "floor" else [f"--stage={name[-1]}"]
        out, start, rss = launch(torchrun(a.world) + [script, *common_args, *stage], {"DS_ACCELERATOR": "cpu"})
        r = json.loads(out.strip().splitlines()[-1])
        return {"tokens_per_s": r["tokens_per_s"], "tokens_per_cpu_s": a.mb * a.seq / r["step_cpu_s"],
                "first_step_s": r["first_step_at"] - start, "rss_mb": rss,
                "layout": name}
    run_dir = tmp / f"{name}-{i}"
    cmd = peer_train_command(data, run_dir, world=a.world, mb=a.mb, seq=a.seq, steps=a.steps, precision=a.precision,
                             extra=ND_LAYOUTS[name])
    _, start, rss = launch(cmd, {})
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    median = statistics.median(r["step_time_s"] for r in steps if r["step"] > a.warmup)
    cpu = statistics.median(r["step_cpu_s"] for r in steps if r["step"] > a.warmup)
    layout = next((r["layout"] for r in rows if r.get("event") in ("start", "restart")), "?")
    return {"tokens_per_s": a.mb * a.seq * a.world / median, "tokens_per_cpu_s": a.mb * a.seq / cpu,
            "first_step_s": steps[0]["time"] - start,
            "rss_mb": rss, "layout": layout}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join([*PEERS, *ND_LAYOUTS]))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mb", type=int, default=4)
    a = ap.parse_args()
    names = [n for n in [*PEERS, *ND_LAYOUTS] if not a.only or n in a.only.split(",")]
    if any(n.startswith("ds-") for n in names) and not has_deepspeed():
        print("peers: DeepSpeed is not installed (pip install -e '.[bench]'); skipping ds-zero1 and ds-zero3")
        names = [n for n in names if not n.startswith("ds-")]
    from breakdown import matmul_peak
    from ndtrain.layout.flops import flops_per_token
    from ndtrain.model.config import ModelConfig

    import torch

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    peak = matmul_peak(dtype)  # one rank's thread; CPU-MFU is against world x this
    fpt = flops_per_token(ModelConfig(**PEER_MODEL), a.seq)
    print(host_header(), flush=True)
    print(f"matmul peak (1 thread, {a.precision}): {peak / 1e9:.1f} GFLOP/s; {fpt / 1e6:.2f} MFLOP/token", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="ndtrain-peers-"))
    data = synthetic_tokens(tmp / "data", PEER_MODEL["vocab_size"])
    results: dict[str, list[dict]] = {n: [] for n in names}
    print(f"world {a.world}, {a.precision}, seq {a.seq}, micro-batch {a.mb}, {a.steps} steps ({a.warmup} warm-up), "
          f"{a.passes} passes", flush=True)
    for i in range(a.passes):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate: no config always runs first
        for name in order:
            load0 = os.getloadavg()[0]
            try:
                r = run_one(name, a, data, tmp, i)
            except RuntimeError as e:  # one failed run is reported, and the passes go on
                print(f"pass {i + 1} {name:11s} FAILED: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            r["load"] = (load0, os.getloadavg()[0])
            results[name].append(r)
            print(f"pass {i + 1} {name:11s} {r['tokens_per_s']:7,.0f} tok/s  {r['tokens_per_cpu_s']:6,.0f} tok/CPU-s  first step {r['first_step_s']:5.1f} s  "
                  f"peak RSS {r['rss_mb']:5.0f} MiB  load {r['load'][0]:.1f}->{r['load'][1]:.1f}  [{r['layout']}]",
                  flush=True)
        summary(results, a, peak, fpt)  # after every pass: an interrupted run still has its table


def summary(results: dict, a, peak: float, fpt: float) -> None:
    results = {n: rs for n, rs in results.items() if rs}
    med = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in results.items()}
    cpu = {n: statistics.median(r["tokens_per_cpu_s"] for r in rs) for n, rs in results.items()}
    peers = [n for n in PEERS if n in med]
    best_peer = max(peers, key=med.get) if peers else None
    print(f"\n| run | tokens/s per pass | median | / floor | / best peer ({best_peer}) | peak RSS (MiB) | "
          "first step (s) | CPU-MFU | tokens/CPU-s per rank | CPU / floor | load (1 min) |\n" + "|---" * 11 + "|")
    for n, rs in results.items():
        per = " / ".join(f"{r['tokens_per_s']:,.0f}" for r in rs)
        floor = f"{med[n] / med['floor']:.2f}" if "floor" in med else "-"
        best = f"{med[n] / med[best_peer]:.2f}" if best_peer else "-"
        rss = statistics.median(r["rss_mb"] for r in rs)
        first = statistics.median(r["first_step_s"] for r in rs)
        loads = [x for r in rs for x in r["load"]]
        print(f"| {n} | {per} | {med[n]:,.0f} | {floor} | {best} | {rss:,.0f} | {first:.1f} | "
              f"{fpt * med[n] / (peak * a.world):.1%} | {cpu[n]:,.0f} | {cpu[n] / cpu['floor'] if 'floor' in cpu else float('nan'):.2f} | "
              f"{min(loads):.1f}-{max(loads):.1f} |")


if __name__ == "__main__":
    main()
