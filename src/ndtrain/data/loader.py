"""Deterministic, resumable sampling of fixed-length windows from a prepared token file.

The design rests on one global stream of samples, independent of data parallelism:

    global sample k  ->  epoch e = k // n,  index = permutation(seed, e)[k % n]

Each step consumes a contiguous block [consumed, consumed + global_batch) of that stream and rank r
takes the r-th equal slice of it. So the loader state is a single integer (samples consumed) plus
the seed, and a run resumed at any dp_size, with any per-step batch size, sees every sample of the
stream exactly once and in the same order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ndtrain.data.manifest import TOKENS_NAME, read_manifest
from ndtrain.errors import NdtrainError


class TokenDataset:
    """One split of a prepared directory, memory-mapped (nothing is read until a window is sampled)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        if split not in ("train", "val"):
            raise NdtrainError(f"unknown split {split!r}; choose 'train' or 'val'")
        self.data_dir = Path(data_dir)
        self.split = split
        self.manifest = read_manifest(self.data_dir)
        start, end = self.manifest["splits"][split]
        self.start, self.end = start, end
        self.vocab_size = self.manifest["vocab_size"]
        path = self.data_dir / TOKENS_NAME
        if self.manifest["num_tokens"] == 0:
            self.tokens = np.zeros(0, dtype=self.manifest["dtype"])  # np.memmap refuses empty files
        else:
            full = np.memmap(path, dtype=self.manifest["dtype"], mode="r", shape=(self.manifest["num_tokens"],))
            self.tokens = full[start:end]

    def __len__(self) -> int:
        return self.end - self.start

    def num_samples(self, seq_len: int) -> int:
        """Non-overlapping windows of seq_len + 1 tokens (neighbours share one boundary token)."""
        return max(0, (len(self) - 1) // seq_len)

    def windows(self, indices: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) int64 tensors of shape [len(indices), seq_len] for the given sample indices."""
        offsets = indices.astype(np.int64)[:, None] * seq_len + np.arange(seq_len + 1, dtype=np.int64)
        chunk = torch.from_numpy(np.asarray(self.tokens[offsets], dtype=np.int64))
        # Contiguous copies: callers pin/transfer these, and strided views of one buffer would alias.
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


@dataclass
class Batch:
    inputs: torch.Tensor  # [local_batch, seq_len] int64
    targets: torch.Tensor  # inputs shifted left by one token
    global_ids: torch.Tensor  # [local_batch] position k of each sample in the global stream
    indices: torch.Tensor  # [local_batch] window index within the split (what k maps to)

    @property
    def sample_ids(self) -> torch.Tensor:
        return self.global_ids


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise NdtrainError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_rank(dp_rank, dp_size) -> tuple[int, int]:
    dp_size = _check_int("dp_size", dp_size, 1)
    dp_rank = _check_int("dp_rank", dp_rank, 0)
    if dp_rank >= dp_size:
        raise NdtrainError(f"dp_rank {dp_rank} is out of range for dp_size {dp_size}")
    return dp_rank, dp_size


def _local_batch(global_batch: int, dp_size: int) -> int:
    global_batch = _check_int("global batch size", global_batch, 1)
    if global_batch % dp_size:
        raise NdtrainError(f"global batch size {global_batch} is not divisible by the data-parallel size {dp_size}")
    return global_batch // dp_size


class StatefulLoader:
    def __init__(self, dataset: TokenDataset, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        self.dataset = dataset
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.seed = _check_int("seed", seed, 0)  # numpy seed sequences reject negatives
        self.dp_rank, self.dp_size = _check_rank(dp_rank, dp_size)
        self.num_samples = dataset.num_samples(self.seq_len)
        if self.num_samples == 0:
            raise NdtrainError(
                f"{dataset.data_dir}: the {dataset.split} split has {len(dataset):,} tokens, "
                f"fewer than one sample of seq_len + 1 = {self.seq_len + 1}"
            )
        self.consumed_samples = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        # Seeding with [seed, epoch] makes each epoch's order a pure function of both, so no RNG
        # state needs saving; only the current epoch's permutation is cached.
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def indices_for(self, global_ids: np.ndarray) -> np.ndarray:
        """Window index for each global sample number (may span epoch boundaries)."""
        epochs = global_ids // self.num_samples
        pos = global_ids % self.num_samples
        out = np.empty_like(global_ids)
        for e in np.unique(epochs):  # ascending, so the cache moves forward epoch by epoch
            mask = epochs == e
            out[mask] = self.permutation(int(e))[pos[mask]]
        return out

    def next_batch(self, global_batch: int) -> Batch:
        """This rank's share of the next `global_batch` samples; every rank advances by global_batch."""
        local = _local_batch(global_batch, self.dp_size)
        first = self.consumed_samples + self.dp_rank * local
        global_ids = np.arange(first, first + local, dtype=np.int64)
        indices = self.indices_for(global_ids)
        inputs, targets = self.dataset.windows(indices, self.seq_len)
        self.consumed_samples += int(global_batch)
        return Batch(inputs, targets, torch.from_numpy(global_ids), torch.from_numpy(indices))

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        try:
            consumed, seed, seq_len = state["consumed_samples"], state["seed"], state["seq_len"]
        except (KeyError, TypeError):
            raise NdtrainError("data loader state lacks consumed_samples/seed/seq_len; the checkpoint is incomplete") from None
        # A different seed or seq_len defines a different stream: resuming it would silently repeat
        # or skip data, so refuse.
        if seed != self.seed:
            raise NdtrainError(f"checkpoint data loader used seed {seed}, but this run uses seed {self.seed}")
        if seq_len != self.seq_len:
            raise NdtrainError(f"checkpoint data loader used seq_len {seq_len}, but this run uses seq_len {self.seq_len}")
        self.consumed_samples = _check_int("consumed_samples", consumed, 0)


def validation_batches(
    dataset_val: TokenDataset,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of (inputs, targets): the first samples of the split in order, sharded like training.

    batch_size is global. If the split holds fewer than num_batches full batches, fewer are returned
    (the same number on every rank), so a small validation split still evaluates deterministically.
    """
    seq_len = _check_int("seq_len", seq_len, 1)
    num_batches = _check_int("num_batches", num_batches, 1)
    dp_rank, dp_size = _check_rank(dp_rank, dp_size)
    local = _local_batch(batch_size, dp_size)
    available = dataset_val.num_samples(seq_len) // batch_size
    if available == 0:
        raise NdtrainError(
            f"{dataset_val.data_dir}: the {dataset_val.split} split has {dataset_val.num_samples(seq_len)} samples "
            f"of seq_len {seq_len}, fewer than one batch of {batch_size}; raise --val-fraction when preparing"
        )
    batches = []
    for b in range(min(num_batches, available)):
        first = b * batch_size + dp_rank * local
        batches.append(dataset_val.windows(np.arange(first, first + local, dtype=np.int64), seq_len))
    return batches
