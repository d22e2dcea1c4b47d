"""Many shards read as one stream: the global sample stream does not depend on the shard count or
the data-parallel size, resume works mid-shard, token ids are checked, prefetch changes nothing."""

import json
import math

import numpy as np
import pytest
import torch

from ndtrain.data.loader import StatefulLoader, TokenDataset
from ndtrain.data.manifest import fingerprint, read_manifest, verify_shards
from ndtrain.data.prepare import prepare
from ndtrain.errors import NdtrainError

SEQ, SEED = 8, 99


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, text_gen):
    """The same jsonl corpus prepared with 1, 3 and 7 shards."""
    root = tmp_path_factory.mktemp("sharded")
    docs = [text_gen(300 + 37 * i, seed=i) for i in range(12)]
    (root / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs), encoding="utf-8")
    n = sum(len(d.encode()) + 1 for d in docs)
    out = {}
    for k in (1, 3, 7):
        out[k] = root / f"s{k}"
        m = prepare([str(root / "d.jsonl")], out[k], val_fraction=0.1, shard_tokens=math.ceil(n / k), workers=1)
        assert len(m["shards"]) == k and m["num_tokens"] == n
    return out


def stream(data_dir, dp, steps, gb=8, state=None):
    loaders = [StatefulLoader(TokenDataset(data_dir), SEQ, SEED, r, dp) for r in range(dp)]
    for ld in loaders:
        if state:
            ld.load_state_dict(state)
    rows = []
    for _ in range(steps):
        parts = [ld.next_batch(gb) for ld in loaders]
        rows.append((torch.cat([p.global_ids for p in parts]), torch.cat([p.inputs for p in parts]),
                     torch.cat([p.targets for p in parts])))
    return rows, loaders[0].state_dict()


def test_same_stream_for_any_shard_count_and_dp_size(sharded):
    n = TokenDataset(sharded[1]).num_samples(SEQ)
    steps = (2 * n) // 8 + 2  # past an epoch boundary
    ref, ref_state = stream(sharded[1], 1, steps)
    for k in (1, 3, 7):
        for dp in (1, 2, 4):
            got, state = stream(sharded[k], dp, steps)
            assert state == ref_state
            for a, b in zip(ref, got):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (k, dp)
    # The stream is the same data, so checkpoints taken on one sharding resume on another.
    assert len({json.dumps(fingerprint(read_manifest(sharded[k]))) for k in (1, 3, 7)}) == 1


def test_windows_cross_shard_boundaries(sharded):
    ds = TokenDataset(sharded[7])
    tokens = np.concatenate([np.fromfile(sharded[7] / s["file"], dtype=np.uint16) for s in ds.manifest["shards"]])
    train = tokens[: len(ds)].astype(np.int64)
    idx = np.arange(ds.num_samples(SEQ))
    inputs, targets = ds.windows(idx, SEQ)
    for j in idx:
        assert torch.equal(inputs[j], torch.from_numpy(train[j * SEQ: j * SEQ + SEQ]))
        assert torch.equal(targets[j], torch.from_numpy(train[j * SEQ + 1: j * SEQ + SEQ + 1]))
    starts = ds.shard_starts[1:-1]
    assert any(j * SEQ < s < j * SEQ + SEQ for j in idx for s in starts)  # some window straddles shards


def test_resume_mid_shard_at_another_dp_size(sharded):
    ref, ref_state = stream(sharded[7], 1, 30)
    first, state = stream(sharded[7], 2, 11)
    ds = TokenDataset(sharded[7])
    loader = StatefulLoader(ds, SEQ, SEED)
    loader.load_state_dict(state)
    nxt = int(loader.batch_at(state["consumed_samples"], 1).indices[0])
    shard_start = ds.shard_starts[np.searchsorted(ds.shard_starts, nxt * SEQ, side="right") - 1]
    assert nxt * SEQ > shard_start  # the next sample starts inside a shard, not at its first token
    rest, end_state = stream(sharded[7], 4, 19, state=state)
    assert end_state == ref_state
    for a, b in zip(ref, first + rest):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_prefetch_returns_the_same_batches(sharded):
    plain = StatefulLoader(TokenDataset(sharded[3]), SEQ, SEED, 1, 2)
    ahead = StatefulLoader(TokenDataset(sharded[3]), SEQ, SEED, 1, 2)
    ahead.start_prefetch(depth=3)
    try:
        for gb in (8, 8, 8, 4, 4, 8, 8, 8):  # a batch-size change misses the guess
            a, b = plain.next_batch(gb), ahead.next_batch(gb)
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.global_ids, b.global_ids)
        # Jumping the position (a checkpoint load, a skipped window) is honoured.
        for ld in (plain, ahead):
            ld.load_state_dict({**ld.state_dict(), "consumed_samples": 3})
        assert torch.equal(plain.next_batch(8).inputs, ahead.next_batch(8).inputs)
        ahead.consumed_samples = plain.consumed_samples = 40
        assert torch.equal(plain.next_batch(8).inputs, ahead.next_batch(8).inputs)
    finally:
        ahead.close()


def _corrupt(path, offset, value):
    data = np.fromfile(path, dtype=np.uint16)
    data[offset] = value
    data.tofile(path)


def test_token_ids_are_checked_at_load_and_per_batch(make_data):
    out = make_data(40_000, val_fraction=0.0)
    shard = out / "tokens-00000.bin"
    _corrupt(shard, 3, 300)  # within the sample checked at load
    with pytest.raises(NdtrainError, match=r"tokens-00000\.bin: token id 300 at offset 3 is not below the vocabulary size 256"):
        TokenDataset(out)
    _corrupt(shard, 3, 65)
    _corrupt(shard, 20_000, 999)  # past the ends checked at load: caught by the per-batch max
    loader = StatefulLoader(TokenDataset(out), 100, 0)
    with pytest.raises(NdtrainError, match=r"tokens-00000\.bin: token id 999 at offset 20,000"):
        for _ in range(loader.num_samples // 50 + 1):
            loader.next_batch(50)
    with pytest.raises(NdtrainError, match=r"tokens-00000\.bin: sha256 differs"):
        verify_shards(out)


def test_prefetch_reraises_errors_on_the_step(make_data):
    out = make_data(40_000, val_fraction=0.0)
    loader = StatefulLoader(TokenDataset(out), 100, 0)
    loader.start_prefetch(2)
    _corrupt(out / "tokens-00000.bin", 20_000, 999)
    loader._ahead.clear()
    with pytest.raises(NdtrainError, match="token id 999"):
        for _ in range(loader.num_samples // 10 + 2):
            loader.next_batch(10)
    loader.close()
