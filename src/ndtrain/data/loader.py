"""Deterministic, resumable sampling of fixed-length windows from a prepared corpus.

The design rests on one global stream of samples, independent of data parallelism and of how
the corpus is cut into shards:

    global sample k  ->  epoch e = k // n,  window = order(seed, e)(k % n)

order(seed, e) is a keyed bijection of [0, n) (data/order.py KeyedPermutation: a Feistel
network, cycle-walked into [0, n)), computed for each position on its own: no rank ever holds an epoch's order, so the
loader's memory is the same for a thousand samples or 10^10. Checkpoints written before it
(their loader state has no "order") continue the order they started with, a whole-epoch
numpy permutation (ORDER_PERMUTATION), so a resumed run never changes its stream mid-way.

A split is the concatenation of its parts' token ranges (manifest.py), read across shard
boundaries as one stream, so window j names the same tokens whatever the shard count. Each step
consumes a contiguous block [consumed, consumed + global_batch) of the stream and rank r takes
the r-th equal slice of it, or, with uneven batch shares (set_shares; layout/batch_shares.py),
the r-th of slices sized by the shares. So the loader state is one integer (samples consumed) plus the seed,
and a run resumed at any dp_size, with any per-step batch size, sees every sample of the stream
exactly once and in the same order.

A batch is a pure function of (consumed, global_batch, rank), which is what makes prefetching
safe: a background thread builds the batch the next step will most likely ask for, and a step
that asks for anything else (a checkpoint load, a skipped window, a batch-size ramp) simply
builds its own.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ndtrain.data.manifest import read_manifest, split_ranges
from ndtrain.data.order import ORDER_KEYED, ORDER_PERMUTATION, EpochOrders, _check_int
from ndtrain.errors import NdtrainError

_LOAD_CHECK_TOKENS = 4096  # ids checked at each end of every shard when a dataset opens

class TokenDataset:
    """One split of a prepared directory; shards are memory-mapped on first use."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        if split not in ("train", "val"):
            raise NdtrainError(f"unknown split {split!r}; choose 'train' or 'val'")
        self.data_dir = Path(data_dir)
        self.split = split
        self.manifest = read_manifest(self.data_dir)
        self.vocab_size = self.manifest["vocab_size"]
        self.eos_id = self.manifest.get("eos_id")
        self.dtype = np.dtype(self.manifest["dtype"])
        shards = self.manifest["shards"]
        self.shard_paths = [self.data_dir / s["file"] for s in shards]
        self.shard_starts = np.cumsum([0] + [s["num_tokens"] for s in shards])  # global offset of each shard
        ranges = split_ranges(self.manifest, split)
        self.range_starts = np.asarray([a for a, _ in ranges], dtype=np.int64)  # global offsets
        self.range_offsets = np.cumsum([0] + [b - a for a, b in ranges])  # split offsets
        self._maps: dict[int, np.ndarray] = {}
        self._check_sample()

    def __len__(self) -> int:
        return int(self.range_offsets[-1])

    def _shard(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is None:
            n = int(self.shard_starts[i + 1] - self.shard_starts[i])
            # np.memmap refuses empty files; an empty shard is never indexed anyway.
            m = np.memmap(self.shard_paths[i], dtype=self.dtype, mode="r", shape=(n,)) if n else np.zeros(0, self.dtype)
            self._maps[i] = m
        return m

    def _bad_token(self, shard: int, offset: int, value: int):
        raise NdtrainError(f"{self.shard_paths[shard]}: token id {value} at offset {offset:,} is not below the "
                           f"vocabulary size {self.vocab_size}; the shard is corrupt or from another tokenizer, prepare again")

    def _check_sample(self) -> None:
        """Cheap check at open: both ends of every shard hold ids below the vocabulary size."""
        for i in range(len(self.shard_paths)):
            m = self._shard(i)
            for lo in (0, max(0, len(m) - _LOAD_CHECK_TOKENS)):
                part = np.asarray(m[lo:lo + _LOAD_CHECK_TOKENS])
                if len(part) and int(part.max()) >= self.vocab_size:
                    j = int(np.argmax(part >= self.vocab_size))
                    self._bad_token(i, lo + j, int(part[j]))

    def read(self, offsets: np.ndarray) -> np.ndarray:
        """int64 tokens at the given split offsets (any shape)."""
        flat = offsets.reshape(-1).astype(np.int64)
        if len(flat) and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"split offset out of range [0, {len(self)})")
        r = np.searchsorted(self.range_offsets, flat, side="right") - 1
        glob = self.range_starts[r] + (flat - self.range_offsets[r])
        shard = np.searchsorted(self.shard_starts, glob, side="right") - 1
        local = glob - self.shard_starts[shard]
        out = np.empty(len(flat), dtype=np.int64)
        for s in np.unique(shard):  # almost always one or two shards per batch
            sel = shard == s
            out[sel] = self._shard(int(s))[local[sel]]
        # Every batch: one max over the tokens read catches a corrupt shard before the embedding does.
        if len(out) and int(out.max()) >= self.vocab_size:
            j = int(np.argmax(out >= self.vocab_size))
            self._bad_token(int(shard[j]), int(local[j]), int(out[j]))
        return out.reshape(offsets.shape)

    def num_samples(self, seq_len: int) -> int:
        """Non-overlapping windows of seq_len + 1 tokens (neighbours share one boundary token)."""
        return max(0, (len(self) - 1) // seq_len)

    def windows(self, indices: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) int64 tensors of shape [len(indices), seq_len] for the given window indices."""
        offsets = indices.astype(np.int64)[:, None] * seq_len + np.arange(seq_len + 1, dtype=np.int64)
        chunk = torch.from_numpy(self.read(offsets))
        # Contiguous copies: callers pin/transfer these, and strided views of one buffer would alias.
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def describe(self) -> str:
        return str(self.data_dir)


@dataclass
class Batch:
    inputs: torch.Tensor  # [local_batch, seq_len] int64
    targets: torch.Tensor  # inputs shifted left by one token
    global_ids: torch.Tensor  # [local_batch] position k of each sample in the global stream
    indices: torch.Tensor  # [local_batch] window index within the split (of its component, for a mixture)
    components: torch.Tensor | None = None  # [local_batch] mixture component of each sample
    split: object | None = None  # the step's uneven split, a layout.batch_shares.BatchSplit (None: equal slices)

    def pin_memory(self) -> "Batch":
        self.inputs, self.targets = self.inputs.pin_memory(), self.targets.pin_memory()
        return self


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
    # set_shares' (weights per dp rank, micro_batch), None: equal slices (a class default: MixtureLoader too)
    shares: tuple[list[float], int] | None = None
    # set_shares' splitter: (global_batch, weights, dp_rank, micro_batch) -> a split with `.rows`
    # per rank. Passed in (train/ passes layout.batch_shares.make_split): data/ sits below layout/.
    _splitter = None

    def __init__(self, dataset, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        self.dataset = dataset
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.seed = _check_int("seed", seed, 0)  # numpy seed sequences reject negatives
        self.dp_rank, self.dp_size = _check_rank(dp_rank, dp_size)
        self.num_samples = dataset.num_samples(self.seq_len)
        if self.num_samples == 0:
            raise NdtrainError(
                f"{dataset.describe()}: the {dataset.split} split has {len(dataset):,} tokens, "
                f"fewer than one sample of seq_len + 1 = {self.seq_len + 1}"
            )
        self.consumed_samples = 0
        self.order = ORDER_KEYED  # a loaded state may say otherwise (load_state_dict)
        self._orders = EpochOrders(self.num_samples)
        self._prefetch: ThreadPoolExecutor | None = None
        self._ahead: dict[tuple[int, int], object] = {}
        self._depth, self._pin = 0, False

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def epoch_order(self, epoch: int):
        """Position -> window of `epoch`, for arrays of positions. Keyed by [seed, epoch], so each
        epoch's order is a pure function of both and no RNG state needs saving; only the current
        epoch's is cached."""
        return self._orders.get(self.order, [self.seed, epoch])

    def indices_for(self, global_ids: np.ndarray) -> np.ndarray:
        """Window index for each global sample number (may span epoch boundaries)."""
        epochs = global_ids // self.num_samples
        pos = global_ids % self.num_samples
        out = np.empty_like(global_ids)
        for e in np.unique(epochs):  # ascending, so the cache moves forward epoch by epoch
            mask = epochs == e
            out[mask] = self.epoch_order(int(e))(pos[mask])
        return out

    def _samples(self, global_ids: np.ndarray) -> Batch:
        indices = self.indices_for(global_ids)
        inputs, targets = self.dataset.windows(indices, self.seq_len)
        return Batch(inputs, targets, torch.from_numpy(global_ids), torch.from_numpy(indices))

    def set_shares(self, weights: list[float] | None, micro_batch: int = 1, splitter=None) -> None:
        """Uneven shares from the next batch on: rank r's rows of each global batch in proportion to
        weights[r], in micro-batches of at most `micro_batch` rows on the largest share (None:
        equal slices). Batches prefetched under the old shares are dropped."""
        new = None if weights is None else (list(weights), int(micro_batch))
        if new is not None and splitter is None:
            raise NdtrainError("uneven batch shares need a splitter (layout.batch_shares.make_split)")
        if new != self.shares:
            self._drop_ahead()
        self.shares, self._splitter = new, splitter

    def _drop_ahead(self) -> None:
        for f in self._ahead.values():
            f.cancel()
        self._ahead.clear()

    def batch_at(self, consumed: int, global_batch: int) -> Batch:
        """This rank's share of samples [consumed, consumed + global_batch): a pure function."""
        shares = self.shares  # one read: the prefetch thread builds with the shares it started with
        if shares is None:
            local = _local_batch(global_batch, self.dp_size)
            first = consumed + self.dp_rank * local
            return self._samples(np.arange(first, first + local, dtype=np.int64))
        split = self._splitter(_check_int("global batch size", global_batch, 1), shares[0], self.dp_rank, shares[1])
        first = consumed + sum(split.rows[:self.dp_rank])
        batch = self._samples(np.arange(first, first + split.rows[self.dp_rank], dtype=np.int64))
        batch.split = split
        return batch

    def _build(self, consumed: int, global_batch: int) -> Batch:
        batch = self.batch_at(consumed, global_batch)
        return batch.pin_memory() if self._pin else batch

    def next_batch(self, global_batch: int) -> Batch:
        """This rank's share of the next `global_batch` samples; every rank advances by global_batch."""
        key = (self.consumed_samples, int(global_batch))
        future = self._ahead.pop(key, None)
        batch = future.result() if future is not None else self._build(*key)
        self.consumed_samples += int(global_batch)
        if self._prefetch is not None:
            # Most steps ask for the same batch size again; guesses for a path not taken are dropped.
            wanted = [(self.consumed_samples + i * key[1], key[1]) for i in range(self._depth)]
            old, self._ahead = self._ahead, {}
            for k in wanted:
                self._ahead[k] = old.pop(k, None) or self._prefetch.submit(self._build, *k)
            for f in old.values():
                f.cancel()
        return batch

    def start_prefetch(self, depth: int = 2, pin_memory: bool = False) -> None:
        """Build the next `depth` batches on a background thread (pinned for a fast copy to a GPU)."""
        self._depth, self._pin = _check_int("prefetch depth", depth, 0), pin_memory
        if depth and self._prefetch is None:
            self._prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ndtrain-prefetch")

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True, cancel_futures=True)
            self._prefetch = None
        self._ahead.clear()

    def skip_to(self, consumed: int) -> None:
        """Continue from sample `consumed` (ahead of the position: a skipped window). Batches
        prefetched for the old position are keyed by it and simply never asked for."""
        self.consumed_samples = _check_int("consumed_samples", consumed, self.consumed_samples)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "seq_len": self.seq_len,
                "order": self.order}

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
        order = state.get("order", ORDER_PERMUTATION)  # a state without it predates the keyed order
        if order not in (ORDER_PERMUTATION, ORDER_KEYED):
            raise NdtrainError(f"checkpoint data loader has order {order!r}; this ndtrain knows orders "
                               f"{ORDER_PERMUTATION} and {ORDER_KEYED} (a newer ndtrain wrote it)")
        if order != self.order:
            self._drop_ahead()  # prefetched in the other order
        self.order = order
        self.consumed_samples = _check_int("consumed_samples", consumed, 0)


IGNORE = -100  # F.cross_entropy's ignore_index: a padding row of the last validation batch adds no loss and no token
_VAL_ORDER_SEED = 0  # one fixed order of the validation windows for every run


def validation_windows(dataset_val, seq_len: int, num_samples: int) -> np.ndarray:
    """The validation set: `num_samples` windows of the split (all it has, if fewer), the first of
    one fixed permutation, so they spread over the whole split. They depend on nothing of the run
    (seed, batch size, layout), so runs compare, and a larger set holds a smaller one."""
    seq_len = _check_int("seq_len", seq_len, 1)
    num_samples = _check_int("validation samples", num_samples, 1)
    n = dataset_val.num_samples(seq_len)
    if n == 0:
        raise NdtrainError(f"{dataset_val.describe()}: the {dataset_val.split} split has {len(dataset_val):,} tokens, "
                           f"fewer than one sample of seq_len + 1 = {seq_len + 1}; raise --val-fraction when preparing")
    return np.sort(np.random.default_rng(_VAL_ORDER_SEED).permutation(n)[:num_samples])


def validation_batches(
    dataset_val,
    seq_len: int,
    batch_size: int,
    num_samples: int,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the validation set (validation_windows) as a fixed list of (inputs,
    targets), in batches of `batch_size` (global) sequences sharded like training. The last batch
    is filled up with rows whose targets are IGNORE, so every batch has the training shape and
    the set evaluated is the same whatever the batch size or the number of ranks."""
    dp_rank, dp_size = _check_rank(dp_rank, dp_size)
    local = _local_batch(batch_size, dp_size)
    windows = validation_windows(dataset_val, seq_len, num_samples)
    batches = []
    for first in range(0, len(windows), batch_size):
        mine = windows[first + dp_rank * local: first + (dp_rank + 1) * local]
        pad = local - len(mine)
        inputs, targets = dataset_val.windows(np.concatenate([mine, np.full(pad, windows[0])]), seq_len)
        targets[len(mine):] = IGNORE
        batches.append((inputs, targets))
    return batches
