"""`ndtrain generate`: sample text from a checkpoint (train/generate.py samples; the trainer's
closing sample uses it too). Every argument and the checkpoint path are checked before torch is
imported."""

from __future__ import annotations

import argparse
import math

from ndtrain.errors import UsageError
from ndtrain.train.generate import generate_from_checkpoint, resolve_checkpoint, sample_device


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain generate", description="Sample text from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints/ or run directory")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda or cuda:N")
    a = p.parse_args(argv)
    if not 0 <= a.tokens <= 1_000_000:
        raise UsageError(f"--tokens must be between 0 and 1000000, got {a.tokens}")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), got {a.temperature}")
    if a.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = no limit), got {a.top_k}")
    if a.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {a.seed}")
    if not a.prompt:
        raise UsageError("--prompt must not be empty (the model needs at least one token to continue)")
    resolve_checkpoint(a.checkpoint)  # a mistyped path is refused before torch is imported
    try:
        device = sample_device(a.device)
    except RuntimeError:
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {a.device!r}") from None
    print(generate_from_checkpoint(a.checkpoint, a.prompt, a.tokens, a.temperature, a.top_k, a.seed, device))
    return 0
