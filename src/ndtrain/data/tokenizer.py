"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained locally with Hugging Face `tokenizers`.

Both expose the same small surface (name, vocab_size, eos_id, encode, decode, encode_docs, save,
file_bytes)
so the rest of ndtrain never branches on which one is in use.

Every document ends with an end-of-sequence token `eos_id`. The byte tokenizer needs no extra id
for it: byte 0xFF can never occur in UTF-8 text, so id 255 marks a document's end while the
vocabulary stays 256 (a uniform model still scores exactly ln 256 nats, and any text encodes
and decodes as before). BPE uses its `<|endoftext|>` special token.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ndtrain.data.manifest import TOKENIZER_NAME, read_manifest
from ndtrain.errors import NdtrainError

EOT = "<|endoftext|>"


class ByteTokenizer:
    """Token id = byte value; 255 (never a UTF-8 byte) ends a document."""

    name = "byte"
    vocab_size = 256
    eos_id = 0xFF
    file_bytes = None  # no file describes it: its name does

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        # Fast path for prepare: no per-byte Python objects.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # A document end shows as EOT, as with BPE; each document decodes on its own so a
        # boundary never merges two halves of a character.
        parts = bytes(int(i) for i in ids).split(b"\xff")
        return EOT.join(p.decode("utf-8", errors="replace") for p in parts)

    def save(self, directory: str | os.PathLike) -> None:
        """Nothing to write: the byte tokenizer is fully described by its name in the manifest."""

    def spec(self) -> tuple:
        return ("byte",)


def check_bpe_vocab_size(vocab_size) -> None:
    # 256 byte symbols + EOT are always present; at 257 or below BPE would learn no merges at all.
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 258:
        raise NdtrainError(f"BPE vocab_size must be at least 258 (256 bytes + {EOT} + merges), got {vocab_size!r}")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization); `<|endoftext|>` ends each document.

    A literal "<|endoftext|>" inside a document's text also encodes to that token (how
    `tokenizers` treats special tokens), so it counts as a document end there too."""

    name = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        eot = tokenizer.token_to_id(EOT)
        if eot is None:
            raise NdtrainError(f"BPE tokenizer has no {EOT} token; retrain it with ndtrain prepare")
        self.eos_id = self.eot_id = eot
        # The tokenizer.json it was loaded from, byte for byte (load() sets it): what a checkpoint
        # carries, so its copy has the sha256 the corpus manifest records.
        self.file_bytes: bytes | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @classmethod
    def train(cls, files_or_iterator, vocab_size: int) -> "BPETokenizer":
        """Train on a list of file paths, or on any iterable of text strings.

        A list counts as files only when every item is a path object or names an existing file;
        anything else is read as text, so a list of short strings is never mistaken for paths.
        Memory grows with the distinct pre-tokens seen, so prepare feeds a bounded sample.
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        check_bpe_vocab_size(vocab_size)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            # Seeding all 256 byte symbols guarantees any input is encodable, even bytes unseen in training.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        if isinstance(files_or_iterator, (list, tuple)) and files_or_iterator and all(
            isinstance(f, os.PathLike) or (isinstance(f, str) and os.path.isfile(f)) for f in files_or_iterator
        ):
            tok.train([os.fspath(f) for f in files_or_iterator], trainer)
        else:
            tok.train_from_iterator(files_or_iterator, trainer)
        return cls(tok)

    @classmethod
    def from_str(cls, text: str, where: str = "tokenizer") -> "BPETokenizer":
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_str(text))
        except NdtrainError:
            raise
        except Exception as exc:  # the Rust side raises a bare Exception for malformed JSON
            raise NdtrainError(f"{where}: cannot load tokenizer ({str(exc).splitlines()[0]})") from None

    @classmethod
    def load(cls, directory: str | os.PathLike, sha256: str | None = None) -> "BPETokenizer":
        path = Path(directory) / TOKENIZER_NAME
        if not path.is_file():
            raise NdtrainError(f"{path}: BPE tokenizer file missing (it is written beside the token shards by prepare)")
        raw = path.read_bytes()
        if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
            raise NdtrainError(f"{path}: sha256 differs from the manifest's tokenizer_sha256; "
                               "the tokenizer does not belong to these token shards")
        check_tokenizer_json(path, raw)
        tok = cls.from_str(raw.decode("utf-8"), str(path))
        tok.file_bytes = raw
        return tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch runs in Rust (over threads unless TOKENIZERS_PARALLELISM=false).
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        # Keep EOT visible so decode(encode(text)) round-trips even across document boundaries.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_str(self) -> str:
        return self._tok.to_str()

    def save(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / TOKENIZER_NAME
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._tok.save(str(tmp))
        os.replace(tmp, path)
        return path

    def spec(self) -> tuple:
        return ("bpe", self.to_str())


def check_tokenizer_json(path: Path, raw: bytes) -> None:
    """Field checks before handing the file to the Rust loader, whose errors name no field."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NdtrainError(f"{path}: not valid JSON ({exc})") from None
    model = obj.get("model") if isinstance(obj, dict) else None
    checks = [
        ("model", isinstance(model, dict), "an object"),
        ("model.type", isinstance(model, dict) and model.get("type") == "BPE", '"BPE"'),
        ("model.vocab", isinstance(model, dict) and isinstance(model.get("vocab"), dict)
         and all(isinstance(v, int) and not isinstance(v, bool) for v in model["vocab"].values()), "an object of integer ids"),
        ("model.merges", isinstance(model, dict) and isinstance(model.get("merges"), list), "a list"),
        ("added_tokens", isinstance(obj, dict) and isinstance(obj.get("added_tokens"), list)
         and any(isinstance(t, dict) and t.get("content") == EOT for t in obj["added_tokens"]), f"a list holding {EOT}"),
    ]
    for field, ok, what in checks:
        if not ok:
            raise NdtrainError(f"{path}: field '{field}' must be {what}")


def tokenizer_from_spec(spec: tuple):
    """Rebuild a tokenizer in a worker process from `tok.spec()` (plain strings pickle cheaply)."""
    return ByteTokenizer() if spec[0] == "byte" else BPETokenizer.from_str(spec[1])


def make_tokenizer(name: str):
    """Validate a tokenizer name early (before reading any data)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        return None  # must be trained on the corpus first
    raise NdtrainError(f"unknown tokenizer {name!r}; choose 'byte' or 'bpe'")


def load_tokenizer(data_dir: str | os.PathLike, manifest: dict | None = None):
    """The tokenizer that produced `data_dir`, as recorded in its manifest, checked against it.

    The token shards are not required, so a checkpoint can carry just manifest + tokenizer.json.
    """
    if manifest is None:
        manifest = read_manifest(data_dir, check_tokens=False)
    name = manifest["tokenizer"]
    where = Path(data_dir) / "manifest.json"
    if name == "byte":
        tok = ByteTokenizer()
    elif name == "bpe":
        tok = BPETokenizer.load(data_dir, manifest.get("tokenizer_sha256"))
    else:
        raise NdtrainError(f"{where}: unknown tokenizer {name!r}")
    if tok.vocab_size != manifest["vocab_size"]:
        raise NdtrainError(
            f"{Path(data_dir)}: tokenizer has {tok.vocab_size} ids but the manifest says {manifest['vocab_size']}; "
            "tokenizer.json and the token shards come from different runs, prepare again"
        )
    if manifest.get("eos_id") is not None and manifest["eos_id"] != tok.eos_id:
        raise NdtrainError(f"{where}: field 'eos_id' is {manifest['eos_id']} but the tokenizer's end token is {tok.eos_id}")
    return tok
