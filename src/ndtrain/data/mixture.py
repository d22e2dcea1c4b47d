"""Mixtures of prepared corpora: `[data] mix = [["web", 0.7], ["code", 0.3]]`.

Each name is a prepared directory: `<data.path>/<name>` (or the name itself when it is an
absolute path). All components must share one tokenizer.

The mixed stream is cut into blocks of MIX_BLOCK samples. Every block holds each component's
fixed share (its weight rounded by largest remainder, so a block's proportions are exact to
1/MIX_BLOCK) in an order shuffled by (seed, block). Global sample k therefore maps, in closed form,
to (component c, c's own sample number m); m then goes through c's own epoch order like a
single corpus (loader.py's, keyed by (seed, epoch, c + 1): O(1) memory). The state stays
`consumed_samples`, any dp size sees the same stream, and resuming is exact. Each component
cycles through its epochs at its own pace (a small, heavily weighted corpus repeats more often).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ndtrain.data.loader import Batch, StatefulLoader, TokenDataset, _check_rank
from ndtrain.data.order import ORDER_KEYED, EpochOrders, _check_int
from ndtrain.data.manifest import fingerprint
from ndtrain.errors import NdtrainError

MIX_BLOCK = 4096


def mix_counts(weights: list[float]) -> np.ndarray:
    """Samples per block for each weight (largest remainder: they sum to MIX_BLOCK exactly)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * MIX_BLOCK
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: MIX_BLOCK - counts.sum()]] += 1
    return counts


class MixSchedule:
    def __init__(self, counts: np.ndarray, seed: int):
        self.counts, self.seed = counts, seed
        self._cache: tuple[int, tuple | None] = (-1, None)

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(component, rank among that component's samples in the block) per position of block b."""
        cached, value = self._cache
        if cached != b:
            comp = np.random.default_rng([self.seed, b]).permutation(np.repeat(np.arange(len(self.counts)), self.counts))
            rank = np.empty(MIX_BLOCK, dtype=np.int64)
            for c in range(len(self.counts)):
                sel = comp == c
                rank[sel] = np.arange(int(sel.sum()))
            value = (comp, rank)
            self._cache = (b, value)
        return value

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(component, the component's own sample number) for each global sample id."""
        blocks, pos = ids // MIX_BLOCK, ids % MIX_BLOCK
        comp, local = np.empty_like(ids), np.empty_like(ids)
        for b in np.unique(blocks):
            sel = blocks == b
            c, r = self.block(int(b))
            comp[sel] = c[pos[sel]]
            local[sel] = int(b) * self.counts[comp[sel]] + r[pos[sel]]
        return comp, local

    def count_before(self, k: int) -> np.ndarray:
        """How many of samples [0, k) each component supplies."""
        b, p = divmod(k, MIX_BLOCK)
        return b * self.counts + np.bincount(self.block(b)[0][:p], minlength=len(self.counts))


def mix_dirs(path: str, mix: list) -> list[tuple[str, float, Path]]:
    return [(name, float(w), Path(name) if Path(name).is_absolute() else Path(path) / name) for name, w in mix]


class MixtureDataset:
    """One split of several corpora. For validation, window j is the j-th sample of the mixed
    stream taken in order (no shuffle within components)."""

    def __init__(self, path: str, mix: list, split: str = "train"):
        self.split = split
        self.entries = mix_dirs(path, mix)
        self.parts = [TokenDataset(d, split) for _, _, d in self.entries]
        first = self.parts[0].manifest
        for (name, _, d), part in zip(self.entries[1:], self.parts[1:]):
            m = part.manifest
            for key in ("tokenizer", "vocab_size", "eos_id", "tokenizer_sha256"):
                if m.get(key) != first.get(key):
                    raise NdtrainError(f"config key 'data.mix': component {name!r} ({d}) has {key} {m.get(key)!r} but "
                                       f"{self.entries[0][0]!r} has {first.get(key)!r}; a mixture needs one tokenizer")
        self.vocab_size, self.eos_id = first["vocab_size"], first.get("eos_id")
        self.counts = mix_counts([w for _, w, _ in self.entries])
        self.schedule = MixSchedule(self.counts, seed=0)  # a fixed order: every evaluation sees the same samples
        self.manifest = {"mix": [[name, w, fingerprint(p.manifest)] for (name, w, _), p in zip(self.entries, self.parts)]}

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def describe(self) -> str:
        return "mixture " + ", ".join(f"{name}={w:g}" for name, w, _ in self.entries)

    def num_samples(self, seq_len: int) -> int:
        """Mixed samples before the first component runs out of windows."""
        have = np.asarray([p.num_samples(seq_len) for p in self.parts])
        lo, hi = 0, int(have.sum())
        while lo < hi:  # largest k whose prefix every component can supply
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if np.all(self.schedule.count_before(mid) <= have) else (lo, mid - 1)
        return lo

    def windows(self, indices: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        comp, local = self.schedule.locate(indices.astype(np.int64))
        return _gather(self.parts, comp, local, seq_len)


def _gather(parts, comp, local, seq_len):
    inputs = torch.empty((len(comp), seq_len), dtype=torch.int64)
    targets = torch.empty_like(inputs)
    for c in np.unique(comp):
        sel = torch.from_numpy(comp == c)
        inputs[sel], targets[sel] = parts[int(c)].windows(local[comp == c], seq_len)
    return inputs, targets


class MixtureLoader(StatefulLoader):
    """The StatefulLoader interface (next_batch, prefetch, state) over a mixed stream."""

    def __init__(self, dataset: MixtureDataset, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.seed = _check_int("seed", seed, 0)
        self.dp_rank, self.dp_size = _check_rank(dp_rank, dp_size)
        self.dataset = dataset
        self.sizes = [p.num_samples(self.seq_len) for p in dataset.parts]
        for (name, _, d), n, p in zip(dataset.entries, self.sizes, dataset.parts):
            if n == 0:
                raise NdtrainError(f"{d}: mixture component {name!r} has {len(p):,} {dataset.split} tokens, "
                                   f"fewer than one sample of seq_len + 1 = {self.seq_len + 1}")
        self.num_samples = sum(self.sizes)
        self.schedule = MixSchedule(dataset.counts, self.seed)
        self._orders = [EpochOrders(n) for n in self.sizes]
        self.order = ORDER_KEYED  # a loaded state may say otherwise (StatefulLoader.load_state_dict)
        self.consumed_samples = 0
        self._prefetch, self._ahead, self._depth, self._pin = None, {}, 0, False

    def _component_order(self, c: int, epoch: int):
        return self._orders[c].get(self.order, [self.seed, epoch, c + 1])

    def _samples(self, global_ids: np.ndarray) -> Batch:
        comp, local = self.schedule.locate(global_ids)
        indices = np.empty_like(local)
        for c in np.unique(comp):
            sel = comp == c
            n = self.sizes[int(c)]
            epochs, pos = local[sel] // n, local[sel] % n
            idx = np.empty_like(pos)
            for e in np.unique(epochs):
                idx[epochs == e] = self._component_order(int(c), int(e))(pos[epochs == e])
            indices[sel] = idx
        inputs, targets = _gather(self.dataset.parts, comp, indices, self.seq_len)
        return Batch(inputs, targets, torch.from_numpy(global_ids), torch.from_numpy(indices), torch.from_numpy(comp))


def open_dataset(path: str, mix: list, split: str):
    """The dataset `[data]` describes: one prepared directory, or a mixture of several."""
    return MixtureDataset(path, mix, split) if mix else TokenDataset(path, split)


def make_loader(dataset, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1) -> StatefulLoader:
    cls = MixtureLoader if isinstance(dataset, MixtureDataset) else StatefulLoader
    return cls(dataset, seq_len, seed, dp_rank, dp_size)


def first_data_dir(path: str, mix: list) -> Path:
    """Where the tokenizer lives (a mixture's components share it)."""
    return mix_dirs(path, mix)[0][2] if mix else Path(path)
