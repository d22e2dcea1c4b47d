"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained locally with Hugging Face `tokenizers`.

Both expose the same small surface (name, vocab_size, encode, decode, save, separator_ids) so the
rest of ndtrain never branches on which one is in use.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ndtrain.data.manifest import TOKENIZER_NAME, read_manifest
from ndtrain.errors import NdtrainError

EOT = "<|endoftext|>"


class ByteTokenizer:
    """Token id = byte value. No special tokens, so a uniform model scores exactly ln 256 nats."""

    name = "byte"
    vocab_size = 256
    # Documents are joined with a newline: the byte model needs no extra id to see a boundary.
    separator_ids: list[int] = [10]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        # Fast path for prepare: no per-byte Python objects.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> None:
        """Nothing to write: the byte tokenizer is fully described by its name in the manifest."""


def check_bpe_vocab_size(vocab_size) -> None:
    # 256 byte symbols + EOT are always present; at 257 or below BPE would learn no merges at all.
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 258:
        raise NdtrainError(f"BPE vocab_size must be at least 258 (256 bytes + {EOT} + merges), got {vocab_size!r}")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization); `<|endoftext|>` separates documents."""

    name = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        eot = tokenizer.token_to_id(EOT)
        if eot is None:
            raise NdtrainError(f"BPE tokenizer has no {EOT} token; retrain it with ndtrain prepare")
        self.eot_id = eot
        self.separator_ids = [eot]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @classmethod
    def train(cls, files_or_iterator, vocab_size: int) -> "BPETokenizer":
        """Train on a list of file paths, or on any iterable of text strings.

        A list counts as files only when every item is a path object or names an existing file;
        anything else is read as text, so a list of short strings is never mistaken for paths.
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
    def load(cls, directory: str | os.PathLike) -> "BPETokenizer":
        from tokenizers import Tokenizer

        path = Path(directory) / TOKENIZER_NAME
        if not path.is_file():
            raise NdtrainError(f"{path}: BPE tokenizer file missing (it is written beside tokens.bin by prepare)")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust side raises a bare Exception for malformed JSON
            raise NdtrainError(f"{path}: cannot load tokenizer ({exc})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch runs in Rust over several threads; far faster than one encode() per text.
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        # Keep EOT visible so decode(encode(text)) round-trips even across document boundaries.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / TOKENIZER_NAME
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._tok.save(str(tmp))
        os.replace(tmp, path)
        return path


def make_tokenizer(name: str):
    """Validate a tokenizer name early (before reading any data)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        return None  # must be trained on the corpus first
    raise NdtrainError(f"unknown tokenizer {name!r}; choose 'byte' or 'bpe'")


def load_tokenizer(data_dir: str | os.PathLike):
    """The tokenizer that produced `data_dir`, as recorded in its manifest.

    tokens.bin is not required, so a checkpoint can carry just manifest + tokenizer.json for generation.
    """
    manifest = read_manifest(data_dir, check_tokens=False)
    name = manifest["tokenizer"]
    if name == "byte":
        tok = ByteTokenizer()
    elif name == "bpe":
        tok = BPETokenizer.load(data_dir)
    else:
        raise NdtrainError(f"{Path(data_dir) / 'manifest.json'}: unknown tokenizer {name!r}")
    if tok.vocab_size != manifest["vocab_size"]:
        raise NdtrainError(
            f"{Path(data_dir)}: tokenizer has {tok.vocab_size} ids but the manifest says {manifest['vocab_size']}; "
            "tokenizer.json and tokens.bin come from different runs, prepare again"
        )
    return tok
