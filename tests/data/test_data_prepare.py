import json
import os

import numpy as np
import pytest

from ndtrain.cli import main as cli_main
from ndtrain.data import prepare as prepare_mod
from ndtrain.data.manifest import dtype_for_vocab, read_manifest
from ndtrain.data.prepare import ensure_prepared, main, prepare
from ndtrain.data.tokenizer import load_tokenizer
from ndtrain.errors import NdtrainError


def tokens_of(out):
    m = read_manifest(out)
    return np.fromfile(out / "tokens.bin", dtype=m["dtype"])


def test_txt_source_manifest_and_tokens(tmp_path):
    text = "hello wörld\nsecond line\n" * 40
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    m = prepare([str(tmp_path / "a.txt")], tmp_path / "out", val_fraction=0.25)
    raw = text.encode("utf-8")
    assert m["format_version"] == 1 and m["tokenizer"] == "byte" and m["vocab_size"] == 256
    assert m["dtype"] == "uint16" and m["num_tokens"] == len(raw) and m["num_bytes"] == len(raw)
    assert m["num_documents"] == 1 and m["default_corpus"] is False
    assert m["sources"] == [str((tmp_path / "a.txt").resolve())]
    n_val = int(len(raw) * 0.25)
    assert m["splits"] == {"train": [0, len(raw) - n_val], "val": [len(raw) - n_val, len(raw)]}
    assert m["args"]["val_fraction"] == 0.25 and m["args"]["tokenizer"] == "byte"
    assert len(m["source_sha256"]) == 64 and m["python_version"].count(".") == 2
    assert bytes(tokens_of(tmp_path / "out").astype(np.uint8)) == raw
    # Nothing temporary is left behind; the manifest on disk is the one returned.
    assert sorted(os.listdir(tmp_path / "out")) == ["manifest.json", "tokens.bin"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == m


def test_jsonl_documents_joined_by_newline(tmp_path):
    lines = [json.dumps({"text": "first doc"}), "", json.dumps({"text": "sécond", "id": 3}), json.dumps({"text": ""})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    m = prepare([str(tmp_path / "d.jsonl")], tmp_path / "out", val_fraction=0.0)
    assert m["num_documents"] == 2  # the blank line and the empty text are skipped
    assert load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist()) == "first doc\nsécond"


def test_folder_recursive_sorted_and_filtered(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "b.md").write_text("B")
    (root / "a.txt").write_text("A")
    (root / "sub" / "c.py").write_text("C")
    (root / "sub" / "d.jsonl").write_text('{"text": "D"}\n')
    (root / "ignored.bin").write_text("X")
    (root / ".hidden" / "e.txt").write_text("E")
    m = prepare([str(root)], tmp_path / "out", val_fraction=0.0)
    assert bytes(tokens_of(tmp_path / "out").astype(np.uint8)) == b"A\nB\nC\nD"
    assert m["num_documents"] == 4


def test_source_hash_tracks_content_not_location(tmp_path):
    # The same folder (same basename and files) in two places hashes the same.
    (tmp_path / "p1" / "c").mkdir(parents=True)
    (tmp_path / "p2" / "c").mkdir(parents=True)
    (tmp_path / "p1" / "c" / "f.txt").write_text("same text")
    (tmp_path / "p2" / "c" / "f.txt").write_text("same text")
    h1 = prepare([str(tmp_path / "p1" / "c")], tmp_path / "o1")["source_sha256"]
    h2 = prepare([str(tmp_path / "p2" / "c")], tmp_path / "o2")["source_sha256"]
    (tmp_path / "p2" / "c" / "f.txt").write_text("other text")
    h3 = prepare([str(tmp_path / "p2" / "c")], tmp_path / "o3")["source_sha256"]
    assert h1 == h2 != h3


def test_max_bytes_caps_without_splitting_characters(tmp_path):
    (tmp_path / "a.txt").write_text("ab日本語" * 100, encoding="utf-8")
    m = prepare([str(tmp_path / "a.txt")], tmp_path / "out", max_bytes=10, val_fraction=0.0)
    assert m["num_bytes"] == 8 and m["args"]["max_bytes"] == 10  # "ab日本" = 2 + 3 + 3
    assert load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist()) == "ab日本"


def test_large_file_is_read_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "_PIECE_BYTES", 7)  # force many pieces, some with no newline
    text = "line one\nx" + "é" * 20 + "\nend\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    (tmp_path / "b.txt").write_text("b", encoding="utf-8")
    m = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tmp_path / "out", val_fraction=0.0)
    assert m["num_documents"] == 2
    assert load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist()) == text + "\nb"


def test_dtype_choice():
    assert dtype_for_vocab(256) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32


def test_default_corpus_capped(tmp_path):
    m = prepare(None, tmp_path / "out", max_bytes=200_000)
    assert m["default_corpus"] is True and m["args"]["sources"] is None
    assert m["num_bytes"] <= 200_000 and m["num_bytes"] > 190_000
    assert m["sources"] == [str(prepare_mod.default_corpus_root())]
    assert m["python_version"]
    text = load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist())
    assert "def " in text and "import " in text


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: [str(p / "empty_dir")], "no .txt/.jsonl/.py/.md files found"),
        (lambda p: [str(p / "nope.txt")], "source not found"),
        (lambda p: [str(p / "blank.txt")], "no text"),
        (lambda p: [str(p / "bad.jsonl")], r"bad\.jsonl:3: invalid JSON"),
        (lambda p: [str(p / "notext.jsonl")], r"notext\.jsonl:1: expected a JSON object"),
        (lambda p: [str(p / "latin1.txt")], r"latin1\.txt: not valid UTF-8 .* at byte 4"),
    ],
)
def test_source_errors(tmp_path, setup, match):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "x.bin").write_text("not text")
    (tmp_path / "blank.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": oops}\n')
    (tmp_path / "notext.jsonl").write_text('["a list"]\n')
    (tmp_path / "latin1.txt").write_bytes("caf\né".encode("latin-1"))
    with pytest.raises(NdtrainError, match=match):
        prepare(setup(tmp_path), tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob(".*.tmp"))


def test_argument_errors(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    with pytest.raises(NdtrainError, match="unknown tokenizer 'sentencepiece'"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", tokenizer="sentencepiece")
    with pytest.raises(NdtrainError, match="val_fraction"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", val_fraction=1.0)
    with pytest.raises(NdtrainError, match="max_bytes"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", max_bytes=0)


def test_manifest_errors(make_data):
    out = make_data(500)
    tokens = out / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(NdtrainError, match=r"tokens\.bin: size is .* truncated"):
        read_manifest(out)
    tokens.unlink()
    with pytest.raises(NdtrainError, match=r"tokens\.bin: token file missing"):
        read_manifest(out)
    m = json.loads((out / "manifest.json").read_text())
    m["format_version"] = 99
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(NdtrainError, match="format version 99"):
        read_manifest(out)
    with pytest.raises(NdtrainError, match="no manifest found"):
        read_manifest(out.parent / "elsewhere")


def test_ensure_prepared(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text " * 50)
    src = [str(tmp_path / "a.txt")]
    m1 = ensure_prepared(tmp_path / "out", sources=src, val_fraction=0.1)
    calls = []
    monkeypatch.setattr(prepare_mod, "prepare", lambda *a, **kw: calls.append(a) or {})
    assert ensure_prepared(tmp_path / "out", sources=src, val_fraction=0.1) == m1 and not calls
    with pytest.raises(NdtrainError, match="prepared with different settings: val_fraction"):
        ensure_prepared(tmp_path / "out", sources=src, val_fraction=0.2)
    monkeypatch.undo()
    # A corrupt directory is rebuilt.
    (tmp_path / "out" / "tokens.bin").write_bytes(b"\0")
    assert ensure_prepared(tmp_path / "out", sources=src, val_fraction=0.1) == m1


def test_cli(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello " * 100)
    assert main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--max-mb", "0.0001"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("prepared 100 tokens (byte, vocab 256)") and "\n" not in line
    assert read_manifest(tmp_path / "out")["args"]["max_bytes"] == 100
    assert cli_main(["prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")]) == 2
    assert "source not found" in capsys.readouterr().err
