"""One mode of the train stages of benchmarks/gpu_check.sh: bf16 training of `llama3-1b` on one GPU (world 1), tokens/s,
MFU, peak memory, and the planner's memory prediction for the same layout.

    .venv/bin/python benchmarks/gpu_throughput.py --compile on|off   # one GPU
    .venv/bin/python benchmarks/gpu_throughput.py --dry-run          # CPU, debug model: checks the script

One mode per process, so the peak memory is this mode's alone (two 1B trainers in one process
would each see the other's weights and AdamW state). Synthetic tokens, nothing downloaded.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_fp8_throughput import synthetic_corpus  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--compile", default="off", choices=["on", "off"])
    p.add_argument("--warmup", type=int, default=4, help="untimed steps (compile happens here)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    device = "cuda"
    if a.dry_run:
        a.preset, a.seq, a.micro_batch, a.warmup, a.steps, device = "debug", 64, 2, 1, 2, "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs an H100/H200-class GPU (or use --dry-run)", file=sys.stderr)
        return 2

    from ndtrain.config import load_config
    from ndtrain.layout.flops import flops_per_token
    from ndtrain.model.config import PRESETS, num_params
    from ndtrain.planner.api import predict
    from ndtrain.planner.hardware import catalog_name
    from ndtrain.calibrate.peak_flops import peak_flops
    from ndtrain.train.trainer import Trainer

    t_start = time.time()
    data = synthetic_corpus(Path(tempfile.mkdtemp(prefix="ndtrain-gpu-")) / "data", PRESETS[a.preset]["vocab_size"],
                            max(2_000_000, 50 * a.seq * a.micro_batch))
    cfg = load_config(None, {
        "model": {"preset": a.preset}, "data": {"path": str(data), "seq_len": a.seq},
        "optimizer": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant", "implementation": "fused"},
        "parallel": {"dp_shard": 1, "mixed_precision": "bf16", "compile": a.compile == "on"},
        "train": {"global_batch": a.micro_batch, "micro_batch": a.micro_batch, "device": device,
                  "val_interval": 0, "sample_tokens": 0},
        "logging": {"tensorboard": False, "progress": "off"}})
    trainer = Trainer(cfg, run_dir=None, log=False)
    dev = trainer.state.rt.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    t0 = time.time()
    for _ in range(a.warmup):
        trainer.train_step()
    sync()
    warmup_s = time.time() - t0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(a.steps):
        sync()
        t = time.perf_counter()
        r = trainer.train_step()  # reads the loss back: the step is complete
        sync()
        times.append(time.perf_counter() - t)
    # A bf16 run on one GPU: the layout the planner is asked about is dp_shard=1 with this micro-batch,
    # the hardware the catalog entry for this GPU (the dry run prices the A100 just to run the call).
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        hw = catalog_name(name, torch.cuda.get_device_properties(dev).total_memory) or "h100"
        peak_alloc = torch.cuda.max_memory_allocated(dev) / 2**30
        peak_reserved = torch.cuda.max_memory_reserved(dev) / 2**30
    else:
        name, hw, peak_alloc, peak_reserved = "CPU (dry run)", "a100-80", float("nan"), float("nan")
    pred = predict(cfg.model, f"dp_shard=1,micro_batch={a.micro_batch}", a.seq, a.micro_batch, hw, world=1, precision="bf16")
    step = statistics.median(times)
    tps = a.seq * a.micro_batch / step
    fpt = flops_per_token(cfg.model, a.seq)
    peak, src = peak_flops(dev, torch.bfloat16)
    out = {"preset": a.preset, "params_m": num_params(cfg.model) / 1e6, "device": name, "compile": a.compile,
           "seq": a.seq, "micro_batch": a.micro_batch, "step_s": step, "tokens_per_s": tps, "mfu": fpt * tps / peak,
           "peak_source": src, "peak_alloc_gib": peak_alloc, "peak_reserved_gib": peak_reserved,
           "planner_hw": hw, "planner_memory_gib": pred.memory["total"] / 2**30,
           "planner_tokens_per_s": pred.tokens_per_s, "loss": r.loss,
           "warmup_s": warmup_s, "total_s": time.time() - t_start}
    print(json.dumps(out))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
