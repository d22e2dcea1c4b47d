"""The validation split (issue 33, class 7): documents drawn by a salted hash of their own text,
whatever their position or the order of the sources, written after the part's training
documents; its composition in the manifest; the same validation windows whatever the batch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ndtrain.data.encode import encode_unit
from ndtrain.data.loader import IGNORE, TokenDataset, validation_batches, validation_windows
from ndtrain.data.manifest import read_manifest
from ndtrain.data.prepare import prepare
from ndtrain.data.sources import collect, plan_units
from ndtrain.data.split import doc_key, is_val, val_length
from ndtrain.data.tokenizer import ByteTokenizer
from ndtrain.errors import NdtrainError

EOS = ByteTokenizer.eos_id
VF = 0.1


def _docs(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "value", "data", "x", "=", "(", ")", ":", "é"]
    return [f"doc {seed}-{i}: " + " ".join(words[j] for j in rng.integers(len(words), size=int(rng.integers(20, 60))))
            for i in range(n)]


def _write(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return str(path)


def _val_docs(out) -> list[str]:
    """The documents a prepared corpus holds in its val ranges, decoded (whole documents only)."""
    val = TokenDataset(out, "val")
    tokens = val.read(np.arange(len(val))).astype(np.uint8).tobytes()
    return [d.decode("utf-8") for d in tokens.split(bytes([EOS]))[:-1]]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    a, b = _docs(300, 1), _docs(300, 2)
    return root, a, b, _write(root / "a.jsonl", a), _write(root / "b.jsonl", b)


def test_val_holds_the_documents_the_hash_draws_not_the_tail(sources):
    root, a, b, pa, pb = sources
    m = prepare([pa, pb], root / "ab", val_fraction=VF, workers=1)
    drawn = [d for d in a + b if is_val(doc_key(d.encode()), VF)]
    assert 30 < len(drawn) < 90  # ~10% of 600
    (part,) = m["parts"]
    n_val = part["val"][1] - part["val"][0]
    assert part["val_split"]["drawn_tokens"] == n_val == sum(len(d.encode()) + 1 for d in drawn)
    assert _val_docs(root / "ab") == drawn  # exactly the drawn documents, in stream order
    assert any(d in a for d in drawn)  # both sources are represented: not the tail of b.jsonl
    # The training range holds every other document, each ending with EOS.
    train = TokenDataset(root / "ab", "train")
    text = train.read(np.arange(len(train))).astype(np.uint8).tobytes()
    assert [d.decode() for d in text.split(bytes([EOS]))[:-1]] == [d for d in a + b if d not in drawn]
    # The composition, in the manifest.
    vs = part["val_split"]
    assert vs["method"] == "document-hash" and vs["documents"] == len(drawn) and vs["tail_tokens"] == 0
    by_file = {s["path"]: s for s in m["sources"]}
    assert by_file[pa]["val_documents"] == sum(d in a for d in drawn)
    assert by_file[pa]["val_documents"] + by_file[pb]["val_documents"] == len(drawn)
    assert sum(s["val_tokens"] for s in m["sources"]) == n_val


def test_the_draw_does_not_depend_on_the_order_of_the_sources(sources):
    root, _, _, pa, pb = sources
    ab = prepare([pa, pb], root / "ab2", val_fraction=VF, workers=1)
    ba = prepare([pb, pa], root / "ba", val_fraction=VF, workers=1)
    assert sorted(_val_docs(root / "ab2")) == sorted(_val_docs(root / "ba"))
    assert ab["parts"][0]["val_split"] == ba["parts"][0]["val_split"]


def test_a_part_of_few_documents_still_holds_val_fraction(tmp_path):
    # One document: nothing to draw from; val is the part's last val_fraction of tokens, as before.
    text = "x = 1\n" * 500
    (tmp_path / "one.txt").write_text(text)
    m = prepare([str(tmp_path / "one.txt")], tmp_path / "one", val_fraction=0.2)
    n = m["num_tokens"]
    assert m["parts"][0]["val"] == [n - int(n * 0.2), n]
    assert val_length(1000, 0, 0.1) == 100 and val_length(1000, 900, 0.1) == 100  # topped up / cut
    assert val_length(1000, 120, 0.1) == 120 and val_length(10, 5, 0.05) == 0  # the drawn documents / none


def test_every_document_ends_with_eos_when_the_cap_cuts_one(sources):
    root, _, _, pa, pb = sources
    for cap in (5_000, 7_777, 12_345):
        m = prepare([pa, pb], root / f"cap{cap}", val_fraction=VF, max_bytes=cap, workers=1)
        d = TokenDataset(root / f"cap{cap}", "train")
        stream = d.read(np.arange(len(d)))
        v = TokenDataset(root / f"cap{cap}", "val")
        stream = np.concatenate([stream, v.read(np.arange(len(v)))])
        assert stream[-1] == EOS and int(np.count_nonzero(stream == EOS)) == m["num_documents"]
        assert sum(s["num_tokens"] for s in m["sources"]) == m["num_tokens"] == len(stream)
        assert sum(s["val_tokens"] for s in m["sources"]) == m["parts"][0]["val_split"]["drawn_tokens"]


def test_a_document_cut_into_units_is_drawn_as_one(tmp_path):
    # A large text file is read in byte ranges (units) by different workers: each range of it
    # must go to the split its first piece draws.
    docs = {}
    for i in range(40):
        text = f"file {i}\n" + "".join(f"line {j} of {i}\n" for j in range(400))
        docs.setdefault(is_val(doc_key(text.encode()), 0.5), (i, text))
        if len(docs) == 2:
            break
    for to_val, (i, text) in docs.items():
        (tmp_path / f"{i}.txt").write_text(text)
        files, _ = collect([str(tmp_path / f"{i}.txt")])
        units = plan_units(files, "text", unit_bytes=1000)
        assert len(units) > 3
        results = [encode_unit(u, ByteTokenizer(), np.dtype(np.uint16), val_fraction=0.5) for u in units]
        held = sum(len(r.val_tokens) for r in results)
        kept = sum(len(r.tokens) for r in results)
        assert (held, kept) == ((len(text) + 1, 0) if to_val else (0, len(text) + 1))


def test_manifests_from_before_the_draw_still_read(sources, tmp_path):
    root, _, _, pa, _ = sources
    prepare([pa], tmp_path / "old", val_fraction=VF)
    path = tmp_path / "old" / "manifest.json"
    m = json.loads(path.read_text())
    del m["parts"][0]["val_split"]
    for s in m["sources"]:
        del s["val_documents"], s["val_tokens"]
    path.write_text(json.dumps(m))
    assert read_manifest(tmp_path / "old")["parts"] == m["parts"]
    assert len(TokenDataset(tmp_path / "old", "val")) == m["parts"][0]["val"][1] - m["parts"][0]["val"][0]
    m["parts"][0]["val_split"] = {"method": "document-hash", "documents": -1, "drawn_tokens": 0, "tail_tokens": 0}
    path.write_text(json.dumps(m))
    with pytest.raises(NdtrainError, match=r"parts\[0\]\.val_split\.documents"):
        read_manifest(tmp_path / "old")


# ---- the validation windows ------------------------------------------------------------------
SEQ = 8


def _rows(val, batch_size: int, num: int, dp: int = 1) -> list[tuple]:
    """The real rows (not padding) of every rank's validation batches, sorted."""
    got = []
    for r in range(dp):
        for inputs, targets in validation_batches(val, SEQ, batch_size, num, r, dp):
            assert inputs.shape == targets.shape == (batch_size // dp, SEQ)  # the training shape, padding included
            real = (targets != IGNORE).all(dim=1)
            assert bool((real | (targets == IGNORE).all(dim=1)).all())  # a row is all real or all padding
            got += [tuple(x.tolist()) + tuple(t.tolist()) for x, t in zip(inputs[real], targets[real])]
    return sorted(got)


def test_the_same_validation_windows_whatever_the_batch(sources):
    root, _, _, pa, pb = sources
    prepare([pa, pb], root / "win", val_fraction=VF, workers=1)
    val = TokenDataset(root / "win", "val")
    n = val.num_samples(SEQ)
    ref = _rows(val, 4, 20)
    assert len(ref) == 20 < n
    for batch_size, dp in ((8, 1), (6, 2), (16, 4), (1, 1), (64, 2)):
        assert _rows(val, batch_size, 20, dp) == ref, (batch_size, dp)
    windows = validation_windows(val, SEQ, 20)
    tokens = val.read(np.arange(len(val)))
    assert sorted(tuple(tokens[i * SEQ:i * SEQ + SEQ].tolist()) + tuple(tokens[i * SEQ + 1:i * SEQ + SEQ + 1].tolist())
                  for i in windows) == ref
    assert windows.max() > n // 2  # spread over the split, not its first windows
    assert set(validation_windows(val, SEQ, 5)) <= set(windows)  # a larger set holds a smaller one
    assert len(validation_windows(val, SEQ, 10**6)) == n  # all the split has
    prepare([pa], root / "noval", val_fraction=0.0)
    with pytest.raises(NdtrainError, match="fewer than one sample"):
        validation_batches(TokenDataset(root / "noval", "val"), SEQ, 4, 8)


@pytest.mark.timeout(120)
def test_validation_loss_does_not_depend_on_the_batch(parity_base):
    """Two trainers with the same weights and different global batches score the same windows."""
    from ndtrain.config import load_config
    from ndtrain.train.trainer import Trainer

    losses = []
    for gb, micro in ((8, 8), (24, 8)):
        base = {k: dict(v) for k, v in parity_base.items()}
        base["train"].update(global_batch=gb, micro_batch=micro, val_batches=2)  # 2 x 16 windows
        trainer = Trainer(load_config(None, base), run_dir=None, log=False)
        losses.append(trainer.validation_loss())
        trainer.close()
    assert math.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)
