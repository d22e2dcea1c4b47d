import json
import os

import numpy as np
import pytest

from ndtrain.cli import main as cli_main
from ndtrain.data import prepare as prepare_mod
from ndtrain.data import sources as sources_mod
from ndtrain.data.manifest import dtype_for_vocab, read_manifest
from ndtrain.data.prepare import ensure_prepared, main, prepare, run_prepare
from ndtrain.data.tokenizer import load_tokenizer
from ndtrain.errors import NdtrainError


EOS = b"\xff"  # the byte tokenizer's end of document


def tokens_of(out):
    m = read_manifest(out)
    return np.concatenate([np.fromfile(out / s["file"], dtype=m["dtype"]) for s in m["shards"]])


def test_txt_source_manifest_and_tokens(tmp_path):
    text = "hello wörld\nsecond line\n" * 40
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    m = prepare([str(tmp_path / "a.txt")], tmp_path / "out", val_fraction=0.25)
    raw = text.encode("utf-8")
    n = len(raw) + 1  # the document's EOS
    assert m["format_version"] == 2 and m["tokenizer"] == "byte" and m["vocab_size"] == 256 and m["eos_id"] == 255
    assert m["dtype"] == "uint16" and m["num_tokens"] == n and m["num_bytes"] == len(raw)
    assert m["num_documents"] == 1 and m["default_corpus"] is False
    assert m["roots"] == [str((tmp_path / "a.txt").resolve())]
    (src,) = m["sources"]
    assert src["path"] == m["roots"][0] and src["size"] == len(raw) and src["num_tokens"] == n
    n_val = int(n * 0.25)
    assert [(p["train"], p["val"]) for p in m["parts"]] == [([0, n - n_val], [n - n_val, n])]
    assert m["args"]["val_fraction"] == 0.25 and m["args"]["tokenizer"] == "byte"
    (shard,) = m["shards"]
    assert shard["num_tokens"] == n and shard["num_documents"] == 1 and len(shard["sha256"]) == 64
    assert len(m["stream_sha256"]) == 64 and m["python_version"].count(".") == 2
    assert bytes(tokens_of(tmp_path / "out").astype(np.uint8)) == raw + EOS
    # Nothing temporary is left behind (here or beside it); the manifest on disk is the one returned.
    assert sorted(os.listdir(tmp_path / "out")) == ["manifest.json", "tokens-00000.bin"]
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "out"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == m


def test_jsonl_documents_end_with_eos(tmp_path):
    lines = [json.dumps({"text": "first doc"}), "", json.dumps({"text": "sécond", "id": 3}), json.dumps({"text": ""})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    m = prepare([str(tmp_path / "d.jsonl")], tmp_path / "out", val_fraction=0.0)
    assert m["num_documents"] == 2  # the blank line and the empty text are skipped
    assert bytes(tokens_of(tmp_path / "out").astype(np.uint8)) == b"first doc" + EOS + "sécond".encode() + EOS
    assert load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist()) == \
        "first doc<|endoftext|>sécond<|endoftext|>"


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
    assert bytes(tokens_of(tmp_path / "out").astype(np.uint8)) == b"A\xffB\xffC\xffD\xff"
    assert m["num_documents"] == 4


def test_source_hash_tracks_content_not_location(tmp_path):
    # The same folder (same basename and files) in two places hashes the same.
    (tmp_path / "p1" / "c").mkdir(parents=True)
    (tmp_path / "p2" / "c").mkdir(parents=True)
    (tmp_path / "p1" / "c" / "f.txt").write_text("same text")
    (tmp_path / "p2" / "c" / "f.txt").write_text("same text")
    h1 = prepare([str(tmp_path / "p1" / "c")], tmp_path / "o1")["stream_sha256"]
    h2 = prepare([str(tmp_path / "p2" / "c")], tmp_path / "o2")["stream_sha256"]
    (tmp_path / "p2" / "c" / "f.txt").write_text("other text")
    h3 = prepare([str(tmp_path / "p2" / "c")], tmp_path / "o3")["stream_sha256"]
    assert h1 == h2 != h3


def test_max_bytes_caps_without_splitting_characters(tmp_path):
    (tmp_path / "a.txt").write_text("ab日本語" * 100, encoding="utf-8")
    m = prepare([str(tmp_path / "a.txt")], tmp_path / "out", max_bytes=10, val_fraction=0.0)
    assert m["num_bytes"] == 8 and m["args"]["max_bytes"] == 10  # "ab日本" = 2 + 3 + 3
    assert load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist()) == "ab日本<|endoftext|>"


def test_large_file_is_read_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_mod, "PIECE_BYTES", 7)  # force many pieces, some with no newline
    text = "line one\nx" + "é" * 20 + "\nend\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    (tmp_path / "b.txt").write_text("b", encoding="utf-8")
    m = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tmp_path / "out", val_fraction=0.0)
    assert m["num_documents"] == 2
    assert load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist()) == \
        text + "<|endoftext|>b<|endoftext|>"


def test_dtype_choice():
    assert dtype_for_vocab(256) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32


def test_default_corpus_capped(tmp_path):
    m = prepare(None, tmp_path / "out", max_bytes=200_000)
    assert m["default_corpus"] is True and m["args"]["sources"] is None
    assert m["num_bytes"] <= 200_000 and m["num_bytes"] > 190_000
    assert m["roots"] == [str(prepare_mod.default_corpus_root())]
    assert m["python_version"]
    text = load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist())
    assert "def " in text and "import " in text
    # Files past the cap are recorded too, so running the same command again is a no-op.
    assert len(m["sources"]) > sum(s["num_bytes"] > 0 for s in m["sources"])
    assert run_prepare(None, tmp_path / "out", max_bytes=200_000)[1] == "unchanged"


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: [str(p / "empty_dir")], "no .txt/.py/.md/.jsonl/.jsonl.gz/.jsonl.zst/.parquet files found"),
        (lambda p: [str(p / "nope.txt")], "source not found"),
        (lambda p: [str(p / "nomatch*.txt")], "no files match"),
        (lambda p: [str(p / "blank.txt")], "no text"),
        (lambda p: [str(p / "bad.jsonl")], r"bad\.jsonl:3: invalid JSON"),
        (lambda p: [str(p / "notext.jsonl")], r"notext\.jsonl:1: expected a JSON object"),
        (lambda p: [str(p / "nofield.jsonl")], r'nofield\.jsonl:1: no "text" field \(choose the key with --text-field\)'),
        (lambda p: [str(p / "latin1.txt")], r"latin1\.txt: not valid UTF-8 .* at byte 4"),
        (lambda p: [str(p / "cut.jsonl.gz")], r"cut\.jsonl\.gz: cannot read"),
        (lambda p: [str(p / "cut.jsonl.zst")], r"cut\.jsonl\.zst: truncated zstd file"),
        (lambda p: [str(p / "bad.parquet")], r"bad\.parquet: not a readable parquet file"),
    ],
)
def test_source_errors_leave_nothing_behind(tmp_path, setup, match):
    import gzip

    import zstandard

    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "x.bin").write_text("not text")
    (tmp_path / "blank.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": oops}\n')
    (tmp_path / "notext.jsonl").write_text('["a list"]\n')
    (tmp_path / "nofield.jsonl").write_text('{"content": "a"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\né".encode("latin-1"))
    records = ('{"text": "%s"}\n' % ("x" * 50) * 200).encode()
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(records)[:-30])
    (tmp_path / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(records)[:-30])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(NdtrainError, match=match):
        prepare(setup(tmp_path), tmp_path / "new" / "out", workers=1)
    assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary, no empty parent left


def test_failure_leaves_an_existing_corpus_untouched(tmp_path):
    (tmp_path / "a.txt").write_text("first source " * 20)
    prepare([str(tmp_path / "a.txt")], tmp_path / "out")
    before = snapshot(tmp_path / "out")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(NdtrainError, match=r'bad\.jsonl:2: field "text" must be a string'):
        prepare([str(tmp_path / "a.txt"), str(tmp_path / "bad.jsonl")], tmp_path / "out")
    assert snapshot(tmp_path / "out") == before
    # A directory that is not a corpus is never written into.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(NdtrainError, match="exists and is not an ndtrain corpus"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "other")
    assert snapshot(tmp_path / "other") == {"notes.txt": b"mine"}


def test_rerun_is_a_noop_and_new_sources_append(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("alpha " * 30)
    (tmp_path / "b.jsonl").write_text('{"text": "beta"}\n')
    src = [str(tmp_path / "src")]
    m1, action = run_prepare(src, tmp_path / "out", val_fraction=0.2, shard_tokens=64)
    assert action == "created" and len(m1["shards"]) == 3
    shards = snapshot(tmp_path / "out")
    assert run_prepare(src, tmp_path / "out", val_fraction=0.2, shard_tokens=64) == (m1, "unchanged")
    # A new file in a source folder, and a new source: both appended, the old shards untouched.
    (tmp_path / "src" / "c.txt").write_text("gamma " * 5)
    m2, action = run_prepare(src + [str(tmp_path / "b.jsonl")], tmp_path / "out", val_fraction=0.2, shard_tokens=64)
    assert action == "appended"
    assert all(snapshot(tmp_path / "out")[name] == data for name, data in shards.items() if name != "manifest.json")
    assert m2["shards"][:3] == m1["shards"] and len(m2["parts"]) == 2
    assert m2["parts"][0] == m1["parts"][0]  # old train/val ranges never move
    assert [s["path"].rsplit("/", 1)[-1] for s in m2["sources"]] == ["a.txt", "c.txt", "b.jsonl"]
    text = load_tokenizer(tmp_path / "out").decode(tokens_of(tmp_path / "out").tolist())
    assert text == "alpha " * 30 + "<|endoftext|>" + "gamma " * 5 + "<|endoftext|>beta<|endoftext|>"
    assert m2["stream_sha256"] != m1["stream_sha256"]
    # Refusals: different settings, sources not repeated, a prepared file that changed.
    with pytest.raises(NdtrainError, match="different settings: val_fraction"):
        prepare(src, tmp_path / "out", val_fraction=0.3)
    with pytest.raises(NdtrainError, match="repeat those first"):
        prepare([str(tmp_path / "b.jsonl")], tmp_path / "out", val_fraction=0.2)
    (tmp_path / "src" / "a.txt").write_text("alpha changed")
    with pytest.raises(NdtrainError, match=r"a\.txt: changed since it was prepared"):
        prepare(src + [str(tmp_path / "b.jsonl")], tmp_path / "out", val_fraction=0.2)
    assert read_manifest(tmp_path / "out") == m2


def test_argument_errors(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    a = [str(tmp_path / "a.txt")]
    for kwargs, match in [({"tokenizer": "sentencepiece"}, "unknown tokenizer 'sentencepiece'"),
                          ({"val_fraction": 1.0}, "val_fraction"), ({"max_bytes": 0}, "max_bytes"),
                          ({"workers": 0}, "workers"), ({"shard_tokens": -1}, "shard_tokens"),
                          ({"text_field": ""}, "text_field"), ({"tokenizer": "bpe", "vocab_size": 100}, "at least 258")]:
        with pytest.raises(NdtrainError, match=match):
            prepare(a, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_manifest_errors(make_data):
    out = make_data(500)
    tokens = out / "tokens-00000.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(NdtrainError, match=r"tokens-00000\.bin: size is .* truncated"):
        read_manifest(out)
    tokens.unlink()
    with pytest.raises(NdtrainError, match=r"tokens-00000\.bin: token shard missing"):
        read_manifest(out)
    good = json.loads((out / "manifest.json").read_text())
    for edit, match in [
        (lambda m: m.update(format_version=99), "format version 99"),
        (lambda m: m.update(vocab_size="256"), r"field 'vocab_size' must be an integer"),
        (lambda m: m.pop("eos_id"), r"field 'eos_id' is missing"),
        (lambda m: m.update(eos_id=256), r"field 'eos_id' must be an integer in \[0, 255\]"),
        (lambda m: m.update(dtype="uint32"), r"field 'dtype' must be uint16 for vocab_size 256"),
        (lambda m: m["shards"][0].update(file="../../etc/passwd"), r"field 'shards\[0\]\.file' must be a string matching"),
        (lambda m: m["shards"][0].update(num_tokens=-1), r"field 'shards\[0\]\.num_tokens'"),
        (lambda m: m["shards"][0].update(sha256="x"), r"field 'shards\[0\]\.sha256'"),
        (lambda m: m.update(num_tokens=m["num_tokens"] + 1), r"field 'num_tokens' must be the sum of the shards"),
        (lambda m: m["parts"][0].update(val=[0, 1]), r"field 'parts\[0\]\.val'"),
        (lambda m: m["sources"][0].update(mtime_ns=1.5), r"field 'sources\[0\]\.mtime_ns'"),
        (lambda m: m.update(parts=[]), r"field 'parts' must be a non-empty list"),
        (lambda m: m["settings"].update(val_fraction="0.1"), r"field 'settings\.val_fraction' must be a number"),
        (lambda m: m.update(default_corpus=0), r"field 'default_corpus' must be true or false"),
        (lambda m: m["parts"][0].update(max_bytes=0), r"field 'parts\[0\]\.max_bytes'"),
        (lambda m: m["parts"][0].update(train=[1, m["parts"][0]["train"][1]]), r"field 'parts\[0\]\.train' must be a range \[0, b\]"),
        (lambda m: m["parts"][0]["val"].__setitem__(1, m["num_tokens"] - 1), r"field 'parts\[0\]\.val' must be a range ending at num_tokens"),
        (lambda m: m["parts"][0].update(val_split=None), r"field 'parts\[0\]\.val_split' must be an object"),
        (lambda m: m["sources"][0].update(part=1), r"field 'sources\[0\]\.part' must be an integer in \[0, 0\]"),
        (lambda m: m.update(tokenizer_sha256="ab"), r"field 'tokenizer_sha256' must be a string matching"),
        (lambda m: m.update(roots=["a", 3]), r"field 'roots\[1\]' must be a string"),
    ]:
        m = json.loads(json.dumps(good))
        edit(m)
        (out / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(NdtrainError, match=match) as info:
            read_manifest(out, check_tokens=False)
        assert str(info.value).startswith(str(out / "manifest.json")) and "\n" not in str(info.value)
    with pytest.raises(NdtrainError, match="no manifest found"):
        read_manifest(out.parent / "elsewhere")
    # Keys the reader does not know are neither refused nor dropped: a newer prepare's records still read.
    (out / "manifest.json").write_text(json.dumps({**good, "later": 1, "shards": [{**good["shards"][0], "later": 2}]}))
    assert read_manifest(out, check_tokens=False)["shards"][0]["later"] == 2


def test_format_1_manifest(tmp_path):
    """Format 1 reads as one shard and one part; its splits must cover the stream in order."""
    good = {"format": "ndtrain-tokens", "format_version": 1, "tokenizer": "byte", "vocab_size": 256, "dtype": "uint16",
            "num_tokens": 40, "splits": {"train": [0, 36], "val": [36, 40]}}
    (tmp_path / "manifest.json").write_text(json.dumps(good))
    m = read_manifest(tmp_path, check_tokens=False)
    assert (m["shards"], m["parts"], m["eos_id"]) == ([{"file": "tokens.bin", "num_tokens": 40}],
                                                      [{"train": [0, 36], "val": [36, 40]}], None)
    for splits, match in [({"train": [1, 36], "val": [36, 40]}, r"field 'splits\.train'"),
                          ({"train": [0, 36], "val": [30, 40]}, r"field 'splits\.val' must be \[36, 40\]"),
                          ({"train": [0, 36], "val": [36, 41]}, r"field 'splits\.val'"), ({"train": [0, 36]}, r"'splits\.val' is missing")]:
        (tmp_path / "manifest.json").write_text(json.dumps({**good, "splits": splits}))
        with pytest.raises(NdtrainError, match=match) as info:
            read_manifest(tmp_path, check_tokens=False)
        assert str(info.value).startswith(str(tmp_path / "manifest.json")) and "\n" not in str(info.value)


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
    # A damaged corpus is reported, never rebuilt over: a run may depend on it.
    (tmp_path / "out" / "tokens-00000.bin").write_bytes(b"\0")
    with pytest.raises(NdtrainError, match=r"tokens-00000\.bin: size is 1 bytes"):
        ensure_prepared(tmp_path / "out", sources=src, val_fraction=0.1)
    assert (tmp_path / "out" / "tokens-00000.bin").read_bytes() == b"\0"


def test_cli(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello " * 100)
    assert main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--max-mb", "0.0001"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("prepared 101 tokens (byte, vocab 256)") and "\n" not in line
    assert read_manifest(tmp_path / "out")["args"]["max_bytes"] == 100
    assert main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--max-mb", "0.0001"]) == 0
    assert capsys.readouterr().out.startswith("up to date: 101 tokens")
    before = sorted(os.listdir(tmp_path))
    for argv, match in [
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "o2")], "source not found"),
        ([str(tmp_path / "a.txt"), "--out", str(tmp_path / "o2"), "--workers", "0"], "--workers must be at least 1"),
        ([str(tmp_path / "a.txt"), "--out", str(tmp_path / "o2"), "--workers", "two"], "invalid int value: 'two'"),
        ([str(tmp_path / "a.txt"), "--out", str(tmp_path / "o2"), "--shard-mb", "0"], "--shard-mb must be positive"),
        ([str(tmp_path / "a.txt"), "--out", str(tmp_path / "o2"), "--tokenizer", "wp"], "invalid choice: 'wp'"),
        ([str(tmp_path / "a.txt")], "the following arguments are required: --out"),
        ([str(tmp_path / "a.txt"), "--out", str(tmp_path / "a.txt")], "exists and is not a directory"),
    ]:
        assert cli_main(["prepare", *argv]) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == before
