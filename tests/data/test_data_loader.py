import json

import numpy as np
import pytest
import torch

from ndtrain.data.loader import IGNORE, StatefulLoader, TokenDataset, validation_batches, validation_windows
from ndtrain.data.order import ORDER_KEYED, KeyedPermutation
from ndtrain.errors import NdtrainError

SEQ = 8
SEED = 1234


@pytest.fixture
def data(make_data):
    # ~2000 train tokens -> 249 samples of 8, so a few dozen steps cross several epochs.
    return make_data(2200, val_fraction=0.1)


def run(data_dir, dp_size, batches, state=None, seed=SEED):
    """Per step, the ranks' shares concatenated in rank order: (global_ids, indices, inputs, targets)."""
    loaders = [StatefulLoader(TokenDataset(data_dir), SEQ, seed, r, dp_size) for r in range(dp_size)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    steps = []
    for gb in batches:
        parts = [ld.next_batch(gb) for ld in loaders]
        steps.append(tuple(torch.cat([getattr(p, f) for p in parts]) for f in ("global_ids", "indices", "inputs", "targets")))
    states = {json.dumps(ld.state_dict()) for ld in loaders}
    assert len(states) == 1  # every rank agrees on the state
    return steps, json.loads(states.pop())


def flat(steps, field):
    i = ("global_ids", "indices", "inputs", "targets").index(field)
    return torch.cat([s[i] for s in steps])


def test_same_global_stream_for_any_dp_size(data):
    n = TokenDataset(data).num_samples(SEQ)
    batches = [8] * ((3 * n) // 8 + 1)  # > 3 epochs, so epoch boundaries fall inside batches
    ref, ref_state = run(data, 1, batches)
    for dp in (2, 4):
        got, state = run(data, dp, batches)
        assert state == ref_state
        for a, b in zip(ref, got):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
    ids = flat(ref, "global_ids")
    assert torch.equal(ids, torch.arange(len(ids)))
    idx = flat(ref, "indices").numpy()
    # Exactly once per epoch, and a different order in each epoch.
    for e in range(3):
        assert sorted(idx[e * n : (e + 1) * n]) == list(range(n))
    assert not np.array_equal(idx[:n], idx[n : 2 * n])
    perm = KeyedPermutation(n, [SEED, 1])(np.arange(n))  # the epoch's order: keyed by (seed, epoch)
    assert np.array_equal(idx[n : 2 * n], perm)


def test_resume_continues_stream_at_any_dp_size(data):
    batches = [8] * 40
    ref, ref_state = run(data, 1, batches)
    for dp_before, dp_after in ((2, 2), (2, 4), (4, 1), (1, 2)):
        first, state = run(data, dp_before, batches[:13])
        assert state == {"consumed_samples": 13 * 8, "seed": SEED, "seq_len": SEQ, "order": ORDER_KEYED}
        rest, end_state = run(data, dp_after, batches[13:], state=state)
        assert end_state == ref_state
        for field in ("global_ids", "inputs", "targets"):
            assert torch.equal(flat(first + rest, field), flat(ref, field))


def test_varying_global_batch_keeps_stream_contiguous(data):
    ref, _ = run(data, 1, [1] * 100)
    varied = [4, 8, 12, 4, 16, 8, 4, 16, 12, 16]  # sums to 100; all divisible by dp 4
    for dp in (1, 4):
        got, state = run(data, dp, varied)
        assert state["consumed_samples"] == 100
        assert [len(s[0]) for s in got] == varied
        for field in ("global_ids", "inputs"):
            assert torch.equal(flat(got, field), flat(ref, field))


def test_windows_are_shifted_slices_of_the_token_stream(data):
    ds = TokenDataset(data)
    batch = StatefulLoader(ds, SEQ, SEED).next_batch(16)
    assert batch.inputs.shape == batch.targets.shape == (16, SEQ)
    assert batch.inputs.dtype == batch.targets.dtype == torch.int64
    assert batch.inputs.is_contiguous() and batch.targets.is_contiguous()
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    tokens = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in sorted(data.glob("tokens-*.bin"))])
    for row, j in enumerate(batch.indices.tolist()):
        window = torch.from_numpy(tokens[j * SEQ : j * SEQ + SEQ + 1].astype(np.int64))
        assert torch.equal(batch.inputs[row], window[:-1]) and torch.equal(batch.targets[row], window[1:])


def test_splits_do_not_overlap(data):
    train, val = TokenDataset(data, "train"), TokenDataset(data, "val")
    m = train.manifest
    assert len(train) + len(val) == m["num_tokens"]
    (part,) = m["parts"]
    assert part["train"] == [0, len(train)] and part["val"] == [len(train), m["num_tokens"]]
    # The last training window ends inside the train split.
    assert (train.num_samples(SEQ) - 1) * SEQ + SEQ + 1 <= len(train)


def test_validation_batches(data):
    val = TokenDataset(data, "val")
    ref = validation_batches(val, SEQ, 4, 12)  # 12 fixed windows in 3 batches of 4
    assert len(ref) == 3 and ref[0][0].shape == (4, SEQ)
    tokens = val.read(np.arange(len(val)))
    first = int(validation_windows(val, SEQ, 12)[1])
    assert torch.equal(ref[0][0][1], torch.from_numpy(tokens[first * SEQ:(first + 1) * SEQ]))
    shards = [validation_batches(val, SEQ, 4, 12, r, 2) for r in range(2)]
    for b in range(3):
        assert torch.equal(torch.cat([shards[0][b][0], shards[1][b][0]]), ref[b][0])
        assert torch.equal(torch.cat([shards[0][b][1], shards[1][b][1]]), ref[b][1])
    n = val.num_samples(SEQ)
    assert len(validation_batches(val, SEQ, 4, 10_000)) == -(-n // 4)  # capped to what the split holds
    (inputs, targets), = validation_batches(val, SEQ, n + 1, 10_000)  # one batch, its last row padding
    assert inputs.shape == (n + 1, SEQ) and bool((targets[-1] == IGNORE).all()) and not (targets[:-1] == IGNORE).any()


def test_loader_errors(data):
    ds = TokenDataset(data)
    loader = StatefulLoader(ds, SEQ, SEED, 0, 4)
    with pytest.raises(NdtrainError, match="not divisible by the data-parallel size 4"):
        loader.next_batch(6)
    with pytest.raises(NdtrainError, match="seed 99"):
        loader.load_state_dict({"consumed_samples": 8, "seed": 99, "seq_len": SEQ})
    with pytest.raises(NdtrainError, match="seq_len 16"):
        loader.load_state_dict({"consumed_samples": 8, "seed": SEED, "seq_len": 16})
    with pytest.raises(NdtrainError, match="lacks"):
        loader.load_state_dict({"seed": SEED})
    with pytest.raises(NdtrainError, match="dp_rank 4 is out of range"):
        StatefulLoader(ds, SEQ, SEED, 4, 4)
    with pytest.raises(NdtrainError, match="fewer than one sample"):
        StatefulLoader(ds, 10_000, SEED)
    with pytest.raises(NdtrainError, match="unknown split"):
        TokenDataset(data, "test")


def test_dataset_validates_files(data):
    tokens = data / "tokens-00000.bin"
    tokens.write_bytes(tokens.read_bytes()[:100])
    with pytest.raises(NdtrainError, match=r"tokens-00000\.bin: size is 100 bytes"):
        TokenDataset(data)
    tokens.unlink()
    with pytest.raises(NdtrainError, match=r"tokens-00000\.bin: token shard missing"):
        TokenDataset(data)


def test_reads_uint32_tokens(tmp_path):
    # A large-vocabulary file: written by hand since training a >65536 BPE would be slow.
    ids = np.arange(70_000, 70_000 + 41, dtype=np.uint32)
    ids.tofile(tmp_path / "tokens.bin")
    manifest = {
        "format": "ndtrain-tokens",
        "format_version": 1,
        "tokenizer": "bpe",
        "vocab_size": 100_000,
        "dtype": "uint32",
        "num_tokens": 41,
        "splits": {"train": [0, 41], "val": [41, 41]},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    batch = StatefulLoader(TokenDataset(tmp_path), SEQ, SEED).next_batch(5)
    assert sorted(batch.indices.tolist()) == [0, 1, 2, 3, 4]
    assert torch.equal(batch.targets - batch.inputs, torch.ones(5, SEQ, dtype=torch.int64))
    assert int(batch.inputs.min()) == 70_000
