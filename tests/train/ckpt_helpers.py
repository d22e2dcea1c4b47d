"""Helpers shared by the checkpoint/recovery tests (not a test module)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ndtrain.config import load_config
from ndtrain.train.checkpoint import load_model_weights


def job(parity_base: dict, out: Path | None = None, **sections) -> dict:
    """parity_base plus per-section overrides, e.g. train={"steps": 6}."""
    base = {k: dict(v) for k, v in parity_base.items()}
    base["train"].update(val_interval=0, sample_tokens=0, log_interval=1)
    if out is not None:
        base["train"]["output_dir"] = str(out)
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return base


def cfg_of(base: dict):
    return load_config(None, {k: dict(v) for k, v in base.items()})


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_model_weights(ckpt)[0]


def assert_bit_identical(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tree(root: Path) -> dict[str, int]:
    """Every file under root with its size: 'nothing deleted or changed' is tree(before) == tree(after)."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(Path(root).rglob("*")) if p.is_file()}


def poison_steps(monkeypatch, poisoned: set[int], seen: list) -> None:
    """Steps whose batch holds a poisoned sample id get NaN gradients and loss."""
    from ndtrain.data.loader import StatefulLoader
    from ndtrain.train import step as step_mod

    original_next, original_fb = StatefulLoader.next_batch, step_mod.forward_backward

    def next_batch(self, global_batch):
        batch = original_next(self, global_batch)
        self._last_ids = set(batch.global_ids.tolist())
        return batch

    def forward_backward(state, inputs, targets, micro):
        total = original_fb(state, inputs, targets, micro)
        seen.append(state.loader._last_ids)
        if state.loader._last_ids & poisoned:
            for p in state.params:
                p.grad.mul_(float("nan"))
            return float("nan")
        return total

    monkeypatch.setattr(StatefulLoader, "next_batch", next_batch)
    monkeypatch.setattr(step_mod, "forward_backward", forward_backward)
