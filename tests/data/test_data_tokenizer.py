import json
import math

import numpy as np
import pytest

from ndtrain.data.prepare import prepare
from ndtrain.data.tokenizer import EOT, BPETokenizer, ByteTokenizer, load_tokenizer
from ndtrain.errors import NdtrainError

SAMPLE = "def f(x):\n    return x * 2  # café 日本 🙂\n\n\ttabs and  spaces\n"


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.name == "byte" and tok.vocab_size == 256
    assert math.isclose(math.log(tok.vocab_size), 5.545, abs_tol=1e-3)
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == SAMPLE
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character decodes, never raises
    # 0xFF never occurs in UTF-8, so it can end documents without a 257th id.
    assert tok.eos_id == 255 and 255 not in tok.encode(SAMPLE + "ÿ\U0010ffff")
    assert tok.decode(tok.encode("ab") + [255] + tok.encode("é")) == f"ab{EOT}é"


@pytest.fixture(scope="module")
def bpe(text_gen):
    return BPETokenizer.train([text_gen(6000, seed=s) for s in range(3)] + [SAMPLE], vocab_size=400)


def test_bpe_train_round_trip(bpe, tmp_path, text_gen):
    assert bpe.name == "bpe" and 300 <= bpe.vocab_size <= 400
    for text in (SAMPLE, text_gen(500, seed=9), f"a{EOT}b", "unseen bytes: \x00\x7f ß"):
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert all(0 <= i < bpe.vocab_size for i in ids)
    assert len(bpe.encode(text_gen(2000))) < 2000 * 0.8  # merges actually compress
    bpe.save(tmp_path)
    again = BPETokenizer.load(tmp_path)
    assert again.encode(SAMPLE) == bpe.encode(SAMPLE) and again.vocab_size == bpe.vocab_size


def test_bpe_train_from_files_is_deterministic(tmp_path, text_gen):
    files = []
    for i in range(2):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_text(text_gen(3000, seed=i), encoding="utf-8")
    a = BPETokenizer.train(files, vocab_size=300)
    b = BPETokenizer.train([str(f) for f in files], vocab_size=300)
    assert a.encode(SAMPLE) == b.encode(SAMPLE)


def test_bpe_vocab_too_small():
    with pytest.raises(NdtrainError, match="at least 258"):
        BPETokenizer.train(["abc"], vocab_size=256)


def test_prepare_bpe_separates_documents(tmp_path, text_gen):
    docs = [text_gen(2000, seed=1), text_gen(1500, seed=2)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs), encoding="utf-8")
    m = prepare([str(tmp_path / "d.jsonl")], tmp_path / "out", tokenizer="bpe", vocab_size=350, val_fraction=0.0)
    tok = load_tokenizer(tmp_path / "out")
    assert isinstance(tok, BPETokenizer) and m["vocab_size"] == tok.vocab_size and m["dtype"] == "uint16"
    tokens = np.fromfile(tmp_path / "out" / "tokens-00000.bin", dtype=np.uint16)
    assert int((tokens == tok.eot_id).sum()) == 2 and m["eos_id"] == tok.eot_id
    assert tok.decode(tokens.tolist()) == EOT.join(docs) + EOT
    # Preparing the same directory with the byte tokenizer is refused: its shards are BPE ids.
    with pytest.raises(NdtrainError, match="different settings: tokenizer='bpe'"):
        prepare([str(tmp_path / "d.jsonl")], tmp_path / "out")
    assert isinstance(load_tokenizer(tmp_path / "out"), BPETokenizer)



def test_load_tokenizer_errors(tmp_path, text_gen):
    (tmp_path / "a.txt").write_text(text_gen(1000))
    prepare([str(tmp_path / "a.txt")], tmp_path / "out", tokenizer="bpe", vocab_size=300)
    (tmp_path / "out" / "tokenizer.json").unlink()
    with pytest.raises(NdtrainError, match=r"tokenizer\.json: BPE tokenizer file missing"):
        load_tokenizer(tmp_path / "out")
    with pytest.raises(NdtrainError, match="no manifest found"):
        load_tokenizer(tmp_path / "nowhere")


def test_tokenizer_file_is_checked_field_by_field(tmp_path, text_gen):
    (tmp_path / "a.txt").write_text(text_gen(1000))
    m = prepare([str(tmp_path / "a.txt")], tmp_path / "out", tokenizer="bpe", vocab_size=300)
    path = tmp_path / "out" / "tokenizer.json"
    good = json.loads(path.read_text())
    no_sha = {**m, "tokenizer_sha256": None}  # so each field check is reached
    for edit, match in [
        (lambda t: t["model"].update(type="WordPiece"), r"field 'model\.type' must be \"BPE\""),
        (lambda t: t["model"].update(vocab=["a"]), r"field 'model\.vocab'"),
        (lambda t: t.update(added_tokens=[]), r"field 'added_tokens' must be a list holding <\|endoftext\|>"),
        (lambda t: t.pop("model"), r"field 'model' must be an object"),
    ]:
        t = json.loads(json.dumps(good))
        edit(t)
        path.write_text(json.dumps(t))
        with pytest.raises(NdtrainError, match=match):
            load_tokenizer(tmp_path / "out", no_sha)
    path.write_text("{not json")
    with pytest.raises(NdtrainError, match=r"tokenizer\.json: not valid JSON"):
        load_tokenizer(tmp_path / "out", no_sha)
