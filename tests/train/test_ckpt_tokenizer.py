"""A BPE run's checkpoints carry its tokenizer.json (in the manifest, byte for byte the corpus's
file), so `generate` and the Hugging Face export read the checkpoint's copy: the corpus may be
moved, deleted, or replaced by another corpus at the same path. A checkpoint from before (no
tokenizer.json) still reads the corpus's; with neither, one line says so."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest

from ndtrain.errors import NdtrainError

WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "print", "class", "self", "import"]
OTHER = ["zeta", "eta", "theta", "iota"]


def _corpus(root: Path, words: list[str], name: str) -> Path:
    from ndtrain.data.prepare import prepare

    rng = random.Random(0)
    text = root / f"{name}.txt"
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)))
    prepare([str(text)], root / name, tokenizer="bpe", vocab_size=300, val_fraction=0.05)
    return root / name


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A 2-step run on a small BPE corpus, a checkpoint at each step."""
    from ndtrain.config import load_config
    from ndtrain.train.trainer import train

    root = tmp_path_factory.mktemp("bpe")
    corpus = _corpus(root, WORDS, "corpus")
    train(load_config(None, {
        "model": {"preset": "debug", "vocab_size": 512}, "data": {"path": str(corpus), "seq_len": 32},
        "train": {"global_batch": 4, "micro_batch": 4, "steps": 2, "val_interval": 0, "sample_tokens": 0,
                  "output_dir": str(root / "run")},
        "checkpoint": {"interval_steps": 1}, "logging": {"tensorboard": False, "progress": "off"}}))
    return root


def _copy(bpe_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run and of its corpus at the path the run recorded (moved aside by tests)."""
    run = tmp_path / "run"
    shutil.copytree(bpe_run / "run", run)
    return run, bpe_run / "corpus"


def test_the_checkpoint_carries_the_corpus_tokenizer_in_its_manifest(bpe_run):
    from ndtrain.train.checkpoint import TOKENIZER, list_checkpoints, verify_checkpoint

    corpus = json.loads((bpe_run / "corpus" / "manifest.json").read_text())
    for ckpt in list_checkpoints(bpe_run / "run" / "checkpoints"):
        raw = (ckpt / TOKENIZER).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == corpus["tokenizer_sha256"]
        assert json.loads((ckpt / "manifest.json").read_text())["files"][TOKENIZER]["bytes"] == len(raw)
        assert verify_checkpoint(ckpt) is None
        (ckpt / TOKENIZER).write_bytes(raw[:-1] + b" ")  # the manifest's digest covers it
        try:
            assert "tokenizer.json" in verify_checkpoint(ckpt)
        finally:
            (ckpt / TOKENIZER).write_bytes(raw)


@pytest.mark.timeout(120)
def test_generate_and_export_read_the_checkpoints_copy(bpe_run, tmp_path):
    from ndtrain.train.generate import generate_from_checkpoint
    from ndtrain.tools.interop import export

    run, corpus = _copy(bpe_run, tmp_path)
    before = generate_from_checkpoint(run, "def ", 6, temperature=0)
    shutil.move(corpus, tmp_path / "moved")
    try:
        assert generate_from_checkpoint(run, "def ", 6, temperature=0) == before  # the corpus is gone
        _corpus(bpe_run, OTHER, "corpus")  # another corpus, another tokenizer, at the recorded path
        assert generate_from_checkpoint(run, "def ", 6, temperature=0) == before
        out = export(run, "hf", tmp_path / "hf")
    finally:
        shutil.rmtree(corpus, ignore_errors=True)
        shutil.move(tmp_path / "moved", corpus)
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    from ndtrain.data.tokenizer import BPETokenizer

    ours = BPETokenizer.load(ckpt)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == ours.eos_id
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def alpha beta<|endoftext|>gamma"
    assert hf(text)["input_ids"] == ours.encode(text) and hf.eos_token_id == ours.eos_id


def _as_old(ckpt: Path) -> None:
    """What a checkpoint saved before checkpoints carried the tokenizer looks like."""
    from ndtrain.train.checkpoint import TOKENIZER, write_manifest

    (ckpt / TOKENIZER).unlink()
    write_manifest(ckpt)


@pytest.mark.timeout(120)
def test_an_old_checkpoint_reads_its_corpus_and_without_it_says_so_in_one_line(bpe_run, tmp_path):
    from ndtrain.train.generate import generate_from_checkpoint
    from ndtrain.tools.interop import export

    run, corpus = _copy(bpe_run, tmp_path)
    before = generate_from_checkpoint(run, "def ", 6, temperature=0)
    for ckpt in (run / "checkpoints").glob("step_*"):
        _as_old(ckpt)
    assert generate_from_checkpoint(run, "def ", 6, temperature=0) == before
    shutil.move(corpus, tmp_path / "moved")
    try:
        for call in (lambda: generate_from_checkpoint(run, "def ", 6), lambda: export(run, "hf", tmp_path / "hf")):
            with pytest.raises(NdtrainError) as info:
                call()
            msg = str(info.value)
            assert "\n" not in msg and "holds no tokenizer.json" in msg and str(corpus) in msg, msg
        assert not (tmp_path / "hf").exists()
        assert export(run, "safetensors", tmp_path / "w.safetensors").is_file()  # weights need no tokenizer
    finally:
        shutil.move(tmp_path / "moved", corpus)


def test_a_tokenizer_that_cannot_be_read_is_said_once_and_training_goes_on(bpe_run, tmp_path):
    from ndtrain.train.checkpoint.store import holds_only_checkpoint_files, tokenizer_to_carry

    corpus = tmp_path / "corpus"
    shutil.copytree(bpe_run / "corpus", corpus)
    said = []
    assert tokenizer_to_carry(str(corpus), [], said.append) == (corpus / "tokenizer.json").read_bytes() and not said
    (corpus / "tokenizer.json").unlink()
    assert tokenizer_to_carry(str(corpus), [], said.append) is None
    assert len(said) == 1 and "will not carry the tokenizer" in said[0] and "tokenizer.json" in said[0]
    # a killed save's partial directory holding the tokenizer is still ndtrain's own, to clear
    partial = tmp_path / ".step_00000001.partial"
    shutil.copytree(sorted((bpe_run / "run" / "checkpoints").glob("step_*"))[-1], partial)
    assert (partial / "tokenizer.json").is_file() and holds_only_checkpoint_files(partial)
