"""The epoch order is a keyed bijection computed per position (data/order.py KeyedPermutation):
a permutation for every n, a pure function of (seed, epoch), memory independent of the corpus
size; and a loader state written before it (no "order") resumes with the order it started with."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from ndtrain.data.loader import StatefulLoader, TokenDataset
from ndtrain.data.order import ORDER_KEYED, ORDER_PERMUTATION, KeyedPermutation
from ndtrain.errors import NdtrainError

SEQ = 8
SEED = 1234


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 255, 256, 257, 1000, 4097])
def test_every_n_gets_a_permutation(n):
    for key in ([SEED, 0], [SEED, 1], [7, 3, 2]):
        order = KeyedPermutation(n, key)(np.arange(n))
        assert sorted(order.tolist()) == list(range(n)), (n, key)


def test_the_order_is_a_pure_function_of_its_key():
    n, pos = 10_007, np.arange(10_007)
    a = KeyedPermutation(n, [SEED, 4])(pos)
    assert np.array_equal(a, KeyedPermutation(n, [SEED, 4])(pos))  # deterministic
    assert np.array_equal(a[[5, 77, 9000]], KeyedPermutation(n, [SEED, 4])(np.array([5, 77, 9000])))  # per position
    for other in ([SEED, 5], [SEED + 1, 4]):  # another epoch, another seed: another order
        b = KeyedPermutation(n, other)(pos)
        assert np.mean(a == b) < 0.01, other
    # A shuffle, not a shift: about one fixed point expected, positions and windows uncorrelated.
    assert np.sum(a == pos) < 10 and abs(np.corrcoef(a, pos)[0, 1]) < 0.05
    with pytest.raises(IndexError):
        KeyedPermutation(n, [SEED, 4])(np.array([n]))


class _Synthetic:
    """A split of `tokens` tokens that holds none: windows are made up from their indices."""

    split = "train"

    def __init__(self, tokens: int):
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens

    def num_samples(self, seq_len: int) -> int:
        return (self.tokens - 1) // seq_len

    def describe(self) -> str:
        return "synthetic"

    def windows(self, indices: np.ndarray, seq_len: int):
        rows = torch.from_numpy(indices.astype(np.int64))[:, None].expand(-1, seq_len).contiguous()
        return rows, rows.clone()


def _peak_bytes(samples: int, order: int) -> int:
    """tracemalloc's peak while a loader over `samples` samples builds four batches of 64 in the
    middle of epoch 3 (numpy's allocations are traced)."""
    tracemalloc.start()
    try:
        loader = StatefulLoader(_Synthetic(samples * SEQ + 1), SEQ, SEED)
        loader.order = order
        loader.skip_to(3 * samples + samples // 2)
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(4):
            batch = loader.next_batch(64)
            assert batch.indices.min() >= 0 and batch.indices.max() < samples
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_loader_memory_does_not_grow_with_the_corpus():
    """10^10 samples (a 15T-token corpus at seq 1500): the keyed order needs what 10^4 do. The
    whole-epoch permutation (the order of older checkpoints) needs 8 bytes a sample: measured at
    10^4 and 10^6 to show the growth the keyed order removes (10^10 would need 80 GB)."""
    _peak_bytes(100, ORDER_KEYED)  # first use: lazy imports and caches, not the order's memory
    keyed_small, keyed_huge = _peak_bytes(10**4, ORDER_KEYED), _peak_bytes(10**10, ORDER_KEYED)
    assert keyed_huge < 64 * 1024, keyed_huge  # a few batches' worth of arrays, nothing per sample
    assert keyed_huge < 2 * keyed_small + 4096, (keyed_small, keyed_huge)
    whole_small, whole_big = _peak_bytes(10**4, ORDER_PERMUTATION), _peak_bytes(10**6, ORDER_PERMUTATION)
    assert whole_big > 8 * 10**6 > keyed_huge * 100, (whole_small, whole_big)


@pytest.fixture
def data(make_data):
    return make_data(2200, val_fraction=0.1)  # 249 samples of 8: a few dozen steps cross epochs


def _stream(data_dir, dp_size, batches, state=None):
    """Global sample ids and window indices, in stream order, with the final state."""
    loaders = [StatefulLoader(TokenDataset(data_dir), SEQ, SEED, r, dp_size) for r in range(dp_size)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    ids, idx = [], []
    for gb in batches:
        parts = [ld.next_batch(gb) for ld in loaders]
        ids += [p.global_ids for p in parts]
        idx += [p.indices for p in parts]
    return torch.cat(ids), torch.cat(idx), loaders[0].state_dict()


def test_resume_mid_epoch_on_another_dp_size_sees_each_sample_once(data):
    n = TokenDataset(data).num_samples(SEQ)
    batches = [8] * ((2 * n) // 8)  # two epochs, minus a little
    ref_ids, ref_idx, _ = _stream(data, 1, batches)
    first_ids, first_idx, state = _stream(data, 4, batches[:11])  # 88 samples: mid epoch 0
    assert state["order"] == ORDER_KEYED
    rest_ids, rest_idx, _ = _stream(data, 2, batches[11:], state)
    ids, idx = torch.cat([first_ids, rest_ids]), torch.cat([first_idx, rest_idx])
    assert torch.equal(ids, ref_ids) and torch.equal(idx, ref_idx)
    assert sorted(idx[:n].tolist()) == list(range(n))  # epoch 0: every window once


def test_an_old_loader_state_resumes_with_the_old_order(data):
    """A state from before the keyed order (no "order") continues numpy's whole-epoch
    permutation, the stream that run started with, and its checkpoints keep saying so."""
    n = TokenDataset(data).num_samples(SEQ)
    old_state = {"consumed_samples": 40, "seed": SEED, "seq_len": SEQ}
    _, idx, state = _stream(data, 2, [8] * 60, old_state)
    old_order = np.concatenate([np.random.default_rng([SEED, e]).permutation(n) for e in range(3)])
    assert np.array_equal(idx.numpy(), old_order[40:40 + 480])
    assert state["order"] == ORDER_PERMUTATION
    _, new_idx, _ = _stream(data, 2, [8] * 60, {**old_state, "order": ORDER_KEYED})
    assert not torch.equal(new_idx, idx)
    with pytest.raises(NdtrainError, match="order 3"):
        StatefulLoader(TokenDataset(data), SEQ, SEED).load_state_dict({**old_state, "order": 3})


def test_a_loaded_state_drops_batches_prefetched_in_the_other_order(data):
    loader = StatefulLoader(TokenDataset(data), SEQ, SEED)
    loader.start_prefetch(depth=2)
    try:
        loader.next_batch(8)  # prefetches the batches at 8 and 16, in the keyed order
        loader.load_state_dict({"consumed_samples": 8, "seed": SEED, "seq_len": SEQ})
        got = loader.next_batch(8).indices.numpy()
    finally:
        loader.close()
    n = TokenDataset(data).num_samples(SEQ)
    assert np.array_equal(got, np.random.default_rng([SEED, 0]).permutation(n)[8:16])


def test_a_mixture_keeps_its_order_too(tmp_path):
    """Each mixture component goes through its own epoch order: keyed for a new run, numpy's
    permutation for a state written before the keyed order."""
    from ndtrain.data.mixture import MixtureDataset, MixtureLoader
    from ndtrain.data.prepare import prepare

    for name, ch in (("web", "a"), ("code", "b")):
        (tmp_path / f"{name}.txt").write_text((ch * 7 + "\n") * 300)
        prepare([str(tmp_path / f"{name}.txt")], tmp_path / name, val_fraction=0.2, workers=1)
    mix = [["web", 0.5], ["code", 0.5]]

    def stream(state):
        loader = MixtureLoader(MixtureDataset(str(tmp_path), mix), SEQ, SEED)
        if state is not None:
            loader.load_state_dict(state)
        batches = [loader.next_batch(16) for _ in range(30)]
        return torch.cat([b.components for b in batches]), torch.cat([b.indices for b in batches]), loader

    comp, idx, loader = stream(None)
    sizes = loader.sizes
    for c in (0, 1):  # component c's first epoch: its keyed order, every window once
        mine = idx[comp == c][:sizes[c]].numpy()
        assert np.array_equal(mine, KeyedPermutation(sizes[c], [SEED, 0, c + 1])(np.arange(len(mine))))
    old_comp, old_idx, _ = stream({"consumed_samples": 0, "seed": SEED, "seq_len": SEQ})
    assert torch.equal(old_comp, comp)  # the blocks' interleave does not depend on the order
    for c in (0, 1):
        mine = old_idx[old_comp == c][:sizes[c]].numpy()
        assert np.array_equal(mine, np.random.default_rng([SEED, 0, c + 1]).permutation(sizes[c])[:len(mine)])
