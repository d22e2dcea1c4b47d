"""Each input format gives the same token stream; units and workers never change the output."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from ndtrain.data import sources as sources_mod
from ndtrain.data.manifest import read_manifest
from ndtrain.data.prepare import prepare
from ndtrain.data.tokenizer import EOT, load_tokenizer
from ndtrain.errors import NdtrainError

DOCS = ["first document\nwith two lines", "sécond — ünïcode 日本 🙂", "third"]
EXPECTED = EOT.join(DOCS) + EOT


def tokens_of(out):
    m = read_manifest(out)
    return np.concatenate([np.fromfile(out / s["file"], dtype=m["dtype"]) for s in m["shards"]])


def decoded(out):
    return load_tokenizer(out).decode(tokens_of(out).tolist())


def jsonl_bytes(docs, field="text"):
    return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def write_parquet(path, docs, field="text", row_group_size=None):
    table = pa.table({"id": list(range(len(docs))), field: docs})
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_record_formats(tmp_path, fmt):
    path = tmp_path / f"docs.{fmt}"
    if fmt == "parquet":
        write_parquet(path, DOCS)
    else:
        data = jsonl_bytes(DOCS)
        path.write_bytes({"jsonl": data, "jsonl.gz": gzip.compress(data),
                          "jsonl.zst": zstandard.ZstdCompressor().compress(data)}[fmt])
    m = prepare([str(path)], tmp_path / "out", val_fraction=0.0, workers=1)
    assert decoded(tmp_path / "out") == EXPECTED
    assert m["num_documents"] == 3 and m["shards"][0]["num_documents"] == 3


def test_txt_files_folders_and_globs(tmp_path):
    for i, d in enumerate(DOCS):
        (tmp_path / "dir" / f"d{i}").mkdir(parents=True)
        (tmp_path / "dir" / f"d{i}" / f"{i}.txt").write_text(d, encoding="utf-8")
    prepare([str(tmp_path / "dir")], tmp_path / "folder", val_fraction=0.0)
    prepare([str(tmp_path / "dir" / "**" / "*.txt")], tmp_path / "glob", val_fraction=0.0)
    prepare([str(tmp_path / "dir" / "d0" / "0.txt"), str(tmp_path / "dir" / "d[12]")], tmp_path / "mixed",
            val_fraction=0.0)
    for out in ("folder", "glob", "mixed"):
        assert decoded(tmp_path / out) == EXPECTED, out


def test_text_field_and_nulls(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(DOCS, field="content") + b'{"content": null}\n')
    write_parquet(tmp_path / "b.parquet", [*DOCS, None, ""], field="content")
    for name in ("a.jsonl", "b.parquet"):
        m = prepare([str(tmp_path / name)], tmp_path / f"out-{name}", val_fraction=0.0, text_field="content")
        assert decoded(tmp_path / f"out-{name}") == EXPECTED and m["num_documents"] == 3  # null/empty skipped
    with pytest.raises(NdtrainError, match=r"b\.parquet: no column 'text' \(columns: id, content\)"):
        prepare([str(tmp_path / "b.parquet")], tmp_path / "x")
    write_parquet(tmp_path / "c.parquet", DOCS)
    with pytest.raises(NdtrainError, match=r"c\.parquet: column 'id' has type int64, not string"):
        prepare([str(tmp_path / "c.parquet")], tmp_path / "x", text_field="id")
    assert not (tmp_path / "x").exists()


@pytest.fixture
def big_sources(tmp_path, monkeypatch, text_gen):
    """Sources big enough (for a shrunken unit size) to be cut into many units."""
    monkeypatch.setattr(sources_mod, "UNIT_BYTES", 2000)
    docs = [text_gen(150 + 13 * i, seed=i) for i in range(60)]
    write_parquet(tmp_path / "a.parquet", docs[:30], row_group_size=4)
    (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(docs[30:]))
    (tmp_path / "c.txt").write_text(text_gen(9000, seed=99), encoding="utf-8")
    return tmp_path, docs


def test_units_and_workers_do_not_change_the_output(big_sources):
    root, docs = big_sources
    srcs = [str(root / n) for n in ("a.parquet", "b.jsonl", "c.txt")]
    units = sources_mod.plan_units(sources_mod.collect(srcs)[0], "text")
    assert len(units) > 10 and {u.kind for u in units} == {"parquet", "jsonl", "text"}
    m1 = prepare(srcs, root / "w1", workers=1, shard_tokens=5000)
    m2 = prepare(srcs, root / "w2", workers=2, shard_tokens=5000)
    assert m1["shards"] == m2["shards"] and m1["stream_sha256"] == m2["stream_sha256"]
    text = (root / "c.txt").read_text(encoding="utf-8")
    assert decoded(root / "w2") == EOT.join(docs + [text]) + EOT
    assert m2["num_documents"] == 61


def test_max_bytes_cut_is_the_same_with_workers(big_sources):
    root, _ = big_sources
    srcs = [str(root / n) for n in ("a.parquet", "b.jsonl", "c.txt")]
    cut = 7_777
    outs = [prepare(srcs, root / f"cap{w}", workers=w, max_bytes=cut) for w in (1, 2)]
    assert outs[0]["stream_sha256"] == outs[1]["stream_sha256"] and outs[0]["num_bytes"] == cut


def test_bpe_trains_on_a_bounded_sample(big_sources):
    root, docs = big_sources
    srcs = [str(root / n) for n in ("a.parquet", "b.jsonl")]
    m = prepare(srcs, root / "bpe", tokenizer="bpe", vocab_size=300, bpe_sample_bytes=3000, workers=2)
    tok = load_tokenizer(root / "bpe")
    assert m["eos_id"] == tok.eos_id and len(m["tokenizer_sha256"]) == 64
    assert tok.decode(tokens_of(root / "bpe").tolist()) == EOT.join(docs) + EOT
    files = sources_mod.collect(srcs)[0]
    sample = list(sources_mod.sample_texts(files, sources_mod.plan_units(files, "text"), 3000))
    sizes = sum(len(t.encode()) for t in sample)
    assert 2900 <= sizes <= 3000  # bounded, and drawn from both files
    (root / "bpe" / "tokenizer.json").write_text('{"model": {"type": "WordPiece"}}')
    with pytest.raises(NdtrainError, match=r"tokenizer\.json: sha256 differs"):
        load_tokenizer(root / "bpe")
