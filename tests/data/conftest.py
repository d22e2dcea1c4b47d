"""Shared helpers: tiny synthetic corpora, so every data test runs in milliseconds."""

from __future__ import annotations

import numpy as np
import pytest

from ndtrain.data.prepare import prepare


def synthetic_text(num_chars: int, seed: int = 0) -> str:
    """Deterministic pseudo-text with words, newlines and a few multi-byte characters."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "value", "the", "data", "loader", "é", "日本", "x", "=", "(", ")", ":"]
    out, size = [], 0
    while size < num_chars:
        w = words[rng.integers(len(words))] + ("\n" if rng.random() < 0.1 else " ")
        out.append(w)
        size += len(w)
    return "".join(out)[:num_chars]


@pytest.fixture
def make_data(tmp_path):
    """make_data(num_chars, val_fraction=..., name=...) -> a prepared byte-tokenized directory."""

    def _make(num_chars: int = 2000, val_fraction: float = 0.1, name: str = "data", **kwargs):
        src = tmp_path / f"{name}.txt"
        src.write_text(synthetic_text(num_chars), encoding="utf-8")
        out = tmp_path / name
        prepare([str(src)], out, val_fraction=val_fraction, **kwargs)
        return out

    return _make


@pytest.fixture(scope="session")
def text_gen():
    """The synthetic_text function, as a fixture so test modules need not import conftest."""
    return synthetic_text
