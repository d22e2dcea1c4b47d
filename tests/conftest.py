"""Fixtures shared by every test package: a small real corpus and the parity-test base config."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """~400 KB of the Python standard library, byte-tokenized: real text, prepared once."""
    from ndtrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("corpus") / "stdlib-byte"
    prepare(None, out, tokenizer="byte", val_fraction=0.05, max_bytes=400_000)
    return out


@pytest.fixture(scope="session")
def parity_base(corpus_dir):
    """Config overrides (a dict of sections) for layout parity: debug model, 8 sequences of 64.

    AdamW's first steps move each weight by ~lr * g/(|g| + eps); for gradients that are sums
    with heavy cancellation, reduction-order noise flips that ratio. eps=1e-6 and lr=1e-3 bound
    the effect of a ~1e-9 gradient difference to ~1e-6, so 1e-5 is a real fp32 tolerance."""
    return {
        "model": {"preset": "debug"},
        "data": {"path": str(corpus_dir), "seq_len": 64},
        "optimizer": {"lr": 1e-3, "eps": 1e-6, "warmup_steps": 0, "schedule": "constant"},
        "train": {"global_batch": 8, "micro_batch": 8, "seed": 1234},
        "logging": {"tensorboard": False, "progress": "off"},
    }
