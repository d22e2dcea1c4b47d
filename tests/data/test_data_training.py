"""The data pipeline inside training: data wait per step in metrics, document masking and
mixtures end to end, and the checkpoint data fingerprint with shards, appends and mixtures."""

import json
import math
import statistics

import pytest

from ndtrain.config import load_config
from ndtrain.data.prepare import prepare
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.train.trainer import Trainer, train


def config(data: dict, out=None, resume: str = "", **train_kw):
    return load_config(None, {
        "model": {"preset": "debug"},
        "data": {"seq_len": 64, **data},
        "optimizer": {"lr": 1e-3, "warmup_steps": 0},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 4, "seed": 3, "val_interval": 3, "val_batches": 1,
                  "sample_tokens": 0, "output_dir": str(out) if out else "", **train_kw},
        "checkpoint": {"interval_steps": 3, "resume": resume},
        "logging": {"tensorboard": False, "progress": "off"},
    })


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, text_gen):
    root = tmp_path_factory.mktemp("train-data")
    docs = [text_gen(2000 + 91 * i, seed=i) for i in range(20)]
    (root / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    (root / "b.txt").write_text(text_gen(30_000, seed=77))
    n = sum(len(d.encode()) + 1 for d in docs)
    prepare([str(root / "a.jsonl")], root / "web", val_fraction=0.1, shard_tokens=math.ceil(n / 3))
    prepare([str(root / "a.jsonl")], root / "web7", val_fraction=0.1, shard_tokens=math.ceil(n / 7))
    prepare([str(root / "b.txt")], root / "code", val_fraction=0.1)
    return root


def test_data_wait_is_logged_and_small(corpora, tmp_path):
    summary = train(config({"path": str(corpora / "web")}, tmp_path / "run"))
    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 6 and all(r["data_wait_s"] >= 0 for r in rows)
    # Prefetching keeps the next batch ready: waiting is a small part of a step (the first step
    # builds its own batch, so it is left out).
    waits = [r["data_wait_s"] / r["step_time_s"] for r in rows[1:]]
    assert statistics.median(waits) < 0.1, waits
    assert summary["steps"] == 6 and math.isfinite(summary["val_loss"])


def test_document_mask_and_mixture_train(corpora, tmp_path):
    cfg = config({"path": str(corpora), "mix": [["web", 0.75], ["code", 0.25]], "document_mask": True}, tmp_path / "r")
    summary = train(cfg)
    assert summary["steps"] == 6 and math.isfinite(summary["val_loss"])
    losses = [r["loss"] for r in metrics(tmp_path / "r") if "loss" in r]
    assert all(math.isfinite(x) for x in losses)


def test_fingerprint_follows_the_stream_not_the_shards(corpora, tmp_path):
    run = tmp_path / "run"
    train(config({"path": str(corpora / "web")}, run, steps=3))
    # The same stream cut into 7 shards resumes.
    assert train(config({"path": str(corpora / "web7")}, run, "auto", steps=4))["steps"] == 4
    # The corpus grown by an append is other data: refused, naming what differs.
    grown = tmp_path / "grown"
    prepare([str(corpora / "a.jsonl")], grown, val_fraction=0.1)
    prepare([str(corpora / "a.jsonl"), str(corpora / "b.txt")], grown, val_fraction=0.1)
    with pytest.raises(NdtrainError, match=r"trained on different data \(stream_sha256, num_tokens, parts differ"):
        train(config({"path": str(grown)}, run, "auto", steps=5))
    # So is a mixture with other weights.
    mixrun = tmp_path / "mix"
    train(config({"path": str(corpora), "mix": [["web", 0.5], ["code", 0.5]]}, mixrun, steps=3))
    with pytest.raises(NdtrainError, match=r"different data \(mix differ"):
        train(config({"path": str(corpora), "mix": [["web", 0.6], ["code", 0.4]]}, mixrun, "auto", steps=4))


def test_document_mask_needs_document_ends(tmp_path):
    import numpy as np

    (tmp_path / "tokens.bin").write_bytes(np.arange(4000, dtype=np.uint16).__mod__(256).astype(np.uint16).tobytes())
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "ndtrain-tokens", "format_version": 1, "tokenizer": "byte", "vocab_size": 256, "dtype": "uint16",
        "num_tokens": 4000, "splits": {"train": [0, 3600], "val": [3600, 4000]}}))
    with pytest.raises(ConfigError, match="data.document_mask.*format-1 corpus"):
        Trainer(config({"path": str(tmp_path), "document_mask": True}), run_dir=None, log=False)
