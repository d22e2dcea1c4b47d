"""A config fits the data it is pointed at (train/preflight.py fit_to_data): the model's
vocabulary rises to the corpus tokenizer's, validation shrinks to the windows the split holds
(down to a floor), each change said in one line; a key given on the command line is kept and
refused where the data cannot hold it, and nothing fits an empty split. `ndtrain prepare` says
when a split is smaller than a shipped config evaluates. On a generated corpus like a new user's:
text files, a JSONL and a Parquet file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.train.preflight import VAL_FLOOR_TOKENS, check_data, fit_to_data, val_floor

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there would their we him been has when who will more no if out so said").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ".\n"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """25 small text files, a JSONL and a Parquet file (~120 KB)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, rng = tmp_path_factory.mktemp("user-corpus"), random.Random(0)
    for i in range(25):
        (root / f"notes{i:02d}.txt").write_text("".join(_text(rng, 60) for _ in range(10)))
    (root / "chat.jsonl").write_text("".join(json.dumps({"text": _text(rng, 80)}) + "\n" for _ in range(60)))
    pq.write_table(pa.table({"text": [_text(rng, 80) for _ in range(60)]}), root / "more.parquet")
    return root


def _prepare(sources: Path, out: Path, **kwargs) -> Path:
    from ndtrain.data.prepare import prepare

    prepare([str(sources)], out, workers=1, **kwargs)
    return out


@pytest.fixture(scope="module")
def byte_corpus(sources, tmp_path_factory) -> Path:
    return _prepare(sources, tmp_path_factory.mktemp("byte") / "mine", val_fraction=0.1)


def _val_tokens(corpus: Path) -> int:
    return sum(p["val"][1] - p["val"][0] for p in json.loads((corpus / "manifest.json").read_text())["parts"])


def _config(corpus: Path, seq_len: int, **train):
    """configs/debug.toml pointed at `corpus`, as the README's example pair runs it."""
    return load_config(str(REPO / "configs" / "debug.toml"),
                       {"data": {"path": str(corpus), "seq_len": seq_len}, "train": train})


def test_validation_fits_what_the_split_holds(byte_corpus):
    seq = _val_tokens(byte_corpus) // 30  # the split holds ~30 windows; debug.toml evaluates 4 x 16
    cfg = _config(byte_corpus, seq)
    assert (cfg.train.val_batches, cfg.train.val_batch_size) == (4, 16)
    with pytest.raises(ConfigError, match=r"train\.val_batches"):
        check_data(cfg)  # as written, refused
    have = (_val_tokens(byte_corpus) - 1) // seq
    fitted, notes = fit_to_data(cfg)
    t = fitted.train
    assert (t.val_batches, t.val_batch_size) == (have // 16, 16) and t.val_batches * t.val_batch_size <= have
    assert len(notes) == 1 and f"validation 4 x 16 -> {have // 16} x 16 windows of {seq} tokens" in notes[0]
    assert f"holds {have}" in notes[0] and "\n" not in notes[0]
    check_data(fitted)  # now accepted
    assert (cfg.train.val_batches, cfg.train.val_batch_size) == (4, 16)  # the caller's config is untouched
    # fewer windows than one batch: one smaller batch
    seq = _val_tokens(byte_corpus) // 12
    fitted, notes = fit_to_data(_config(byte_corpus, seq))
    have = (_val_tokens(byte_corpus) - 1) // seq
    assert (fitted.train.val_batches, fitted.train.val_batch_size) == (1, have) and len(notes) == 1


def test_below_the_floor_or_pinned_nothing_is_fitted(byte_corpus, sources, tmp_path):
    small = _prepare(sources, tmp_path / "small-val", val_fraction=0.004)
    have = (_val_tokens(small) - 1) // 64
    assert 1 <= have < val_floor(64, 64) == VAL_FLOOR_TOKENS // 64  # some windows, fewer than the floor
    fitted, notes = fit_to_data(_config(small, 64))
    assert notes == [] and fitted.train.val_batches == 4
    with pytest.raises(ConfigError, match=rf"train\.val_batches.*validation split.*has {have}\b"):
        check_data(fitted)
    # a number given on the command line is what the user asked for: kept, and refused
    cfg = _config(byte_corpus, _val_tokens(byte_corpus) // 30, val_batches=3)
    fitted, notes = fit_to_data(cfg, {"train": {"val_batches": 3}})
    assert notes == [] and fitted.train.val_batches == 3
    with pytest.raises(ConfigError, match=r"train\.val_batches"):
        check_data(fitted)
    # no validation asked for: nothing to fit
    fitted, notes = fit_to_data(_config(byte_corpus, _val_tokens(byte_corpus) // 30, val_interval=0))
    assert notes == [] and fitted.train.val_batches == 4


def test_an_empty_split_is_refused(sources, tmp_path):
    corpus = _prepare(sources, tmp_path / "noval", val_fraction=0.0)
    assert _val_tokens(corpus) == 0
    fitted, notes = fit_to_data(_config(corpus, 64))
    assert notes == []
    with pytest.raises(ConfigError, match=r"has 0"):
        check_data(fitted)


def test_vocabulary_rises_to_the_tokenizers(sources, tmp_path):
    corpus = _prepare(sources, tmp_path / "bpe", tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    size = json.loads((corpus / "manifest.json").read_text())["vocab_size"]
    assert size > 256
    cfg = _config(corpus, 32)
    assert cfg.model.vocab_size == 256  # the debug preset's
    with pytest.raises(NdtrainError, match=r"model\.vocab_size"):
        check_data(cfg)
    fitted, notes = fit_to_data(cfg)
    assert fitted.model.vocab_size == size
    assert [n for n in notes if n.startswith(f"model.vocab_size 256 -> {size}")], notes
    check_data(fitted)
    # given on the command line: kept, and refused
    pinned = load_config(str(REPO / "configs" / "debug.toml"),
                         {"data": {"path": str(corpus), "seq_len": 32}, "model": {"vocab_size": 260}})
    fitted, notes = fit_to_data(pinned, {"model": {"vocab_size": 260}})
    assert fitted.model.vocab_size == 260 and not [n for n in notes if "vocab_size" in n]
    with pytest.raises(NdtrainError, match=r"model\.vocab_size"):
        check_data(fitted)
    # never lowered: a larger vocabulary trains as before
    big = load_config(None, {"model": {"preset": "debug", "vocab_size": 4096}, "data": {"path": str(corpus)}})
    assert fit_to_data(big)[0].model.vocab_size == 4096


def test_unreadable_data_is_left_to_check_data(tmp_path):
    cfg = load_config(None, {"data": {"path": str(tmp_path / "absent")}})
    assert fit_to_data(cfg) == (cfg, [])


def test_the_readme_pair_trains_and_says_what_it_fitted(byte_corpus, tmp_path, capsys):
    """`ndtrain train --config configs/debug.toml --data.path <corpus>`: trains (1 step here),
    with one line for the validation it fitted."""
    from ndtrain.cli import main

    seq = _val_tokens(byte_corpus) // 30
    rc = main(["train", "--config", str(REPO / "configs" / "debug.toml"), f"--data.path={byte_corpus}",
               f"--data.seq_len={seq}", "--train.steps=1", "--train.sample_tokens=0", "--parallel.compile=false",
               "--logging.tensorboard=false", "--logging.progress=off", f"--train.output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    fitted = [line for line in out.out.splitlines() if line.startswith("ndtrain train: validation 4 x 16 ->")]
    assert len(fitted) == 1, out.out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in rows)


def test_prepare_says_when_the_split_is_smaller_than_a_shipped_config(byte_corpus, sources, tmp_path):
    from ndtrain.train.preflight import small_split_note

    manifest = json.loads((byte_corpus / "manifest.json").read_text())
    note = small_split_note(manifest, REPO / "configs")
    assert note is not None and "\n" not in note and "configs/" in note and "--val-fraction" in note
    # every shipped config fits a split large enough for all of them: nothing to say
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "small.toml").write_text("[data]\nseq_len = 16\n[train]\nval_batches = 1\nval_batch_size = 2\n")
    assert small_split_note(manifest, configs) is None
    assert small_split_note(manifest, tmp_path / "no-such-dir") is None
    # an empty split: every config with validation is refused, and said so
    empty = json.loads(json.dumps(manifest))
    for part in empty["parts"]:
        part["val"] = [part["val"][1], part["val"][1]]
    note = small_split_note(empty, configs)
    assert note is not None and "refuses small.toml" in note and "val_interval=0" in note
