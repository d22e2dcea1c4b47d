"""Helpers shared by the benchmark scripts (not imported by ndtrain itself)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# The CPU flags that change which kernels run (AVX-512 paths, native bf16, AMX tiles, fp16).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def host_header() -> str:
    """One line naming where a benchmark ran: CPU model and its kernel-relevant flags (what lscpu
    reads from /proc/cpuinfo), cores, the torch build, the date and the load average. A ratio
    measured on one host kind says nothing about another (an AMX host runs bf16 ~10x fp32)."""
    import datetime
    import platform

    import torch

    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    have = ",".join(f for f in KERNEL_FLAGS if f in flags) or "no AVX2, AVX-512 or AMX"
    build = f"torch {torch.__version__}" + (" (oneDNN)" if torch.backends.mkldnn.is_available() else "")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"host: {model} [{have}], {os.cpu_count()} cores; {build}; {when}; load average {load}"


# torchtitan's "debugmodel" shape, the one shared/notes/peers-on-cpu.md measured every peer on.
PEER_MODEL = dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=768, vocab_size=2048, rope_theta=5e5)


def synthetic_tokens(out_dir: Path, vocab: int, num_tokens: int = 2_000_000, seed: int = 0) -> Path:
    """Uniform random tokens in ndtrain's prepared-data format (what the floor draws on the fly)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "manifest.json").exists():
        return out_dir
    tokens = np.random.default_rng(seed).integers(0, vocab, num_tokens, dtype=np.uint16)
    tokens.tofile(out_dir / "tokens.bin")
    n_val = num_tokens // 50
    manifest = {"format": "ndtrain-tokens", "format_version": 1, "tokenizer": "synthetic", "vocab_size": vocab,
                "dtype": "uint16", "num_tokens": num_tokens, "tokens_file": "tokens.bin", "separator": "none",
                "default_corpus": False, "sources": ["synthetic"], "source_sha256": f"uniform-{vocab}-{seed}",
                "splits": {"train": [0, num_tokens - n_val], "val": [num_tokens - n_val, num_tokens]}}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out_dir


def model_overrides(shape: dict) -> list[str]:
    return [f"--model.{k}={v}" for k, v in shape.items()]


def peer_train_command(data: Path, out_dir: Path, *, world: int, mb: int, seq: int, steps: int,
                       precision: str, extra: list[str]) -> list[str]:
    """`ndtrain train` of the peers' run: their model and batch, AdamW as they set it, no
    validation, samples, checkpoints or TensorBoard; `extra` picks the layout."""
    return [PY, "-m", "ndtrain", "train", f"--nproc={world}", *model_overrides(PEER_MODEL), f"--data.path={data}",
            f"--data.seq_len={seq}", f"--train.global_batch={mb * world}", f"--train.micro_batch={mb}",
            f"--train.steps={steps}", "--train.val_interval=0", "--train.sample_tokens=0", "--optimizer.lr=1e-3",
            "--optimizer.warmup_steps=0", "--optimizer.weight_decay=0.1", f"--train.output_dir={out_dir}",
            "--logging.tensorboard=false", "--logging.progress=off", "--checkpoint.interval_steps=0",
            f"--parallel.mixed_precision={precision}", *extra]


def run(cmd: list[str], env_extra: dict | None = None, timeout: int = 900) -> str:
    env = {**os.environ, **(env_extra or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def ndtrain_step_time(run_dir: Path, warmup: int) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]
    return statistics.median(steps)


def torchrun(world: int) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
