"""bf16 vs fp8 training throughput and MFU of `llama3-1b` on one H100/H200-class GPU.

    .venv/bin/python benchmarks/gpu_fp8_throughput.py            # one GPU, under 5 minutes
    .venv/bin/python benchmarks/gpu_fp8_throughput.py --dry-run  # CPU, debug model: checks the script

One process builds one Trainer per mode (bf16, fp8 tensorwise, and fp8 rowwise with
--recipes tensorwise,rowwise) from the same weights on synthetic tokens (nothing downloaded),
then runs interleaved rounds: a few steps of each mode in turn, so clock and thermal drift hit
every mode alike. Blocks are torch.compile'd (as fp8 is meant to run: the casts fuse into the
neighbouring kernels) unless --no-compile. Reports tokens/s, MFU against the bf16 peak for every
mode and against the fp8 peak for fp8 modes (catalog peaks, calibrate/peak_flops.py), peak memory, and the
fp8/bf16 speed ratio. Exit 0 when every mode ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def synthetic_corpus(out: Path, vocab: int, num_tokens: int) -> Path:
    from ndtrain.data.manifest import dtype_for_vocab

    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab)
    np.random.default_rng(0).integers(0, vocab, num_tokens, dtype=dtype).tofile(out / "tokens.bin")
    n_val = num_tokens // 50
    (out / "manifest.json").write_text(json.dumps({
        "format": "ndtrain-tokens", "format_version": 1, "tokenizer": "synthetic", "vocab_size": vocab,
        "dtype": dtype.name, "num_tokens": num_tokens, "tokens_file": "tokens.bin", "separator": "none",
        "default_corpus": False, "sources": ["synthetic"], "source_sha256": f"uniform-{vocab}",
        "splits": {"train": [0, num_tokens - n_val], "val": [num_tokens - n_val, num_tokens]}}))
    return out


def job(args, data: Path, mode: str) -> dict:
    mp, _, recipe = mode.partition("-")
    return {"model": {"preset": args.preset}, "data": {"path": str(data), "seq_len": args.seq},
            "optimizer": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant", "implementation": args.optimizer},
            "parallel": {"dp_shard": 1, "mixed_precision": mp, "fp8_recipe": recipe or "tensorwise",
                         "compile": args.compile, "activation_checkpoint": args.ac},
            "train": {"global_batch": args.micro_batch, "micro_batch": args.micro_batch, "seed": 0,
                      "device": args.device, "val_interval": 0, "sample_tokens": 0},
            "logging": {"tensorboard": False, "progress": "off"}}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step (one micro-batch)")
    p.add_argument("--recipes", default="tensorwise", help="fp8 recipes to compare with bf16, comma-separated")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first (compile happens here)")
    p.add_argument("--ac", default="none", choices=["none", "selective", "full"])
    p.add_argument("--optimizer", default="fused", choices=["foreach", "fused", "for-loop"])
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, debug model, two short rounds: checks the script without a GPU")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures (for gpu_check.sh)")
    args = p.parse_args()
    if args.dry_run:
        args.preset, args.seq, args.micro_batch, args.device = "debug", 64, 2, "cpu"
        args.rounds, args.steps, args.warmup, args.compile, args.optimizer = 2, 2, 1, False, "foreach"
    elif not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs an H100/H200-class GPU (or use --dry-run)", file=sys.stderr)
        return 2

    from ndtrain.config import load_config
    from ndtrain.layout.flops import flops_per_token
    from ndtrain.model.config import PRESETS, num_params
    from ndtrain.calibrate.peak_flops import FP8, peak_flops
    from ndtrain.train.trainer import Trainer

    t_start = time.time()
    modes = ["bf16"] + [f"fp8-{r.strip()}" for r in args.recipes.split(",") if r.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="ndtrain-fp8-gpu-"))
    vocab = PRESETS[args.preset]["vocab_size"]
    data = synthetic_corpus(tmp / "data", vocab, max(2_000_000, 50 * args.seq * args.micro_batch))
    trainers = {m: Trainer(load_config(None, job(args, data, m)), run_dir=None, log=False) for m in modes}
    first = trainers["bf16"]
    device = first.state.rt.device
    cfg = first.state.cfg
    fpt = flops_per_token(cfg.model, args.seq)
    peak_bf16, src_bf16 = peak_flops(device, torch.bfloat16)
    peak_fp8, src_fp8 = peak_flops(device, FP8)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(f"{args.preset} ({num_params(cfg.model) / 1e6:,.1f}M params), seq {args.seq}, micro-batch {args.micro_batch}, "
          f"compile {args.compile}, ac {args.ac}, on {name}")
    print(f"peaks: bf16 {peak_bf16 / 1e12:.4g} TFLOP/s ({src_bf16}), fp8 {peak_fp8 / 1e12:.4g} TFLOP/s ({src_fp8}); "
          f"{fpt / 1e9:.4g} GFLOP per token (6N + attention, full s^2)")
    if trainers.get("fp8-tensorwise"):
        from ndtrain.layout.fp8 import fp8_linears

        print(f"fp8 converts {len(fp8_linears(cfg.model))} Linear layers (the head stays bf16)")

    times: dict[str, list[float]] = {m: [] for m in modes}
    peak_mem: dict[str, float] = {m: 0.0 for m in modes}
    losses: dict[str, float] = {}
    for m in modes:  # warm-up: compile, allocator, autotuning
        for _ in range(args.warmup):
            trainers[m].train_step()
    print(f"warm-up done in {time.time() - t_start:.0f} s")
    for _ in range(args.rounds):
        for m in modes:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(args.steps):
                sync(device)
                t0 = time.perf_counter()
                r = trainers[m].train_step()  # the loss is read back: the step is complete
                sync(device)
                times[m].append(time.perf_counter() - t0)
                losses[m] = r.loss
            if device.type == "cuda":
                peak_mem[m] = max(peak_mem[m], torch.cuda.max_memory_allocated(device) / 2**30)
    tokens = args.seq * args.micro_batch
    print("\n| mode | tokens/s | MFU (bf16 peak) | MFU (fp8 peak) | step ms (median) | peak mem GiB | loss |")
    print("|---|---|---|---|---|---|---|")
    tps = {}
    for m in modes:
        med = statistics.median(times[m])
        tps[m] = tokens / med
        mfu8 = f"{100 * fpt * tps[m] / peak_fp8:.1f}%" if m.startswith("fp8") else "-"
        print(f"| {m} | {tps[m]:,.0f} | {100 * fpt * tps[m] / peak_bf16:.1f}% | {mfu8} | {1000 * med:.1f} | "
              f"{peak_mem[m]:.1f} | {losses[m]:.3f} |")
    for m in modes[1:]:
        print(f"{m} / bf16 tokens/s: {tps[m] / tps['bf16']:.3f}x")
    print(f"total {time.time() - t_start:.0f} s")
    if args.json:
        print(json.dumps({"device": name, "tokens_per_s": tps, "loss": losses, "peak_mem_gib": peak_mem,
                          "mfu_bf16_peak": {m: fpt * tps[m] / peak_bf16 for m in modes}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
