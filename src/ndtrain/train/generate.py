"""Sampling text from a checkpoint, in one process, whatever layout saved it."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ndtrain.data.mixture import first_data_dir
from ndtrain.data.tokenizer import load_tokenizer
from ndtrain.errors import NdtrainError, UsageError
from ndtrain.model.llama import Transformer, build_model
from ndtrain.train.ckpt_store import list_checkpoints


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory, a `checkpoints/` directory or a run directory."""
    from ndtrain.train.ckpt_store import not_a_directory

    path = Path(path)
    if not path.exists():
        raise NdtrainError(f"{path}: no such checkpoint, checkpoints/ or run directory")
    if not path.is_dir():
        raise NdtrainError(f"{path}: {not_a_directory(path)}")
    if (path / "train_state.json").exists():
        return path
    for root in (path, path / "checkpoints"):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise NdtrainError(f"no checkpoint found at {path} (no step_XXXXXXXX/ with a COMPLETE marker, nor checkpoints/)")


def load_model(path: str | Path) -> tuple[Transformer, object]:
    from ndtrain.train.ckpt_store import checkpoint_config, load_model_weights

    ckpt = resolve_checkpoint(path)
    weights, state = load_model_weights(ckpt)  # verified, shapes checked, nothing unpickled
    cfg = checkpoint_config(ckpt, state)
    model = build_model(cfg.model, "cpu")
    model.load_state_dict(weights)
    model.eval()
    return model, cfg


@torch.no_grad()
def sample(model: Transformer, tokens: list[int], n: int, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0, stop_id: int | None = None) -> list[int]:
    """Up to n new tokens; stops after `stop_id` (the end of a document)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([tokens], dtype=torch.long)
    ctx = model.cfg.max_seq_len
    for _ in range(n):
        logits = model(ids[:, -ctx:])[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        if nxt == stop_id:
            break
    return ids[0].tolist()


def generate_from_checkpoint(path, prompt: str, n: int, temperature: float = 0.8, top_k: int = 40,
                             seed: int = 0) -> str:
    model, cfg = load_model(path)
    tok = load_tokenizer(first_data_dir(cfg.data.path, cfg.data.mix))
    out = sample(model, tok.encode(prompt), n, temperature, top_k, seed, getattr(tok, "eos_id", None))
    return tok.decode(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain generate", description="Sample text from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints/ or run directory")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
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
    print(generate_from_checkpoint(a.checkpoint, a.prompt, a.tokens, a.temperature, a.top_k, a.seed))
    return 0
