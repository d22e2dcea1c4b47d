"""Mixtures of prepared corpora: realised proportions, the same stream for any dp size, exact
resume, a fixed validation interleave, and refusals."""

import numpy as np
import pytest
import torch

from ndtrain.config import load_config
from ndtrain.data.manifest import fingerprint
from ndtrain.data.mixture import MIX_BLOCK, MixtureDataset, MixtureLoader, make_loader, mix_counts, open_dataset
from ndtrain.data.loader import validation_batches
from ndtrain.data.prepare import prepare
from ndtrain.errors import ConfigError, NdtrainError

SEQ, SEED = 8, 5
MIX = [["web", 0.7], ["code", 0.2], ["tiny", 0.1]]


@pytest.fixture(scope="module")
def root(tmp_path_factory, text_gen):
    """Three corpora of very different sizes whose bytes tell them apart (a, b, c)."""
    root = tmp_path_factory.mktemp("mix")
    for name, ch, n in (("web", "a", 6000), ("code", "b", 3000), ("tiny", "c", 200)):
        (root / f"{name}.txt").write_text((ch * 7 + "\n") * (n // 8))
        prepare([str(root / f"{name}.txt")], root / name, val_fraction=0.2, workers=1)
    return root


def run(root, dp, steps, gb=40, state=None):
    loaders = [MixtureLoader(MixtureDataset(str(root), MIX), SEQ, SEED, r, dp) for r in range(dp)]
    for ld in loaders:
        if state:
            ld.load_state_dict(state)
    out = []
    for _ in range(steps):
        parts = [ld.next_batch(gb) for ld in loaders]
        out.append([torch.cat([getattr(p, f) for p in parts]) for f in ("global_ids", "components", "indices", "inputs")])
    return out, loaders[0].state_dict()


def test_counts_are_exact_per_block():
    counts = mix_counts([0.7, 0.2, 0.1])
    assert counts.sum() == MIX_BLOCK and counts.tolist() == [2867, 819, 410]
    assert mix_counts([1, 1, 1]).tolist() == [1366, 1365, 1365]


def test_realised_proportions(root):
    steps, gb = 205, 40  # 8200 samples: two whole blocks and a part
    rows, _ = run(root, 1, steps, gb)
    comp = torch.cat([r[1] for r in rows]).numpy()
    inputs = torch.cat([r[3] for r in rows])
    # Every sample comes from the corpus its component names (its bytes say which).
    letters = np.array([ord("a"), ord("b"), ord("c")])
    first_letter = inputs.clone()
    first_letter[first_letter == 10] = 0
    assert np.all(first_letter.max(1).values.numpy() == letters[comp])
    share = np.bincount(comp, minlength=3) / len(comp)
    np.testing.assert_allclose(share, [0.7, 0.2, 0.1], atol=0.005)
    # Exact in every whole block.
    for b in range(2):
        block = comp[b * MIX_BLOCK:(b + 1) * MIX_BLOCK]
        assert np.bincount(block, minlength=3).tolist() == mix_counts([0.7, 0.2, 0.1]).tolist()
    # The small corpus cycles through its epochs: each epoch sees each of its windows once.
    tiny = torch.cat([r[2] for r in rows]).numpy()[comp == 2]
    n_tiny = MixtureDataset(str(root), MIX).parts[2].num_samples(SEQ)
    assert sorted(tiny[:n_tiny]) == list(range(n_tiny)) and len(tiny) > 3 * n_tiny


def test_same_stream_for_any_dp_and_exact_resume(root):
    ref, ref_state = run(root, 1, 30)
    for dp in (2, 4):
        got, state = run(root, dp, 30)
        assert state == ref_state
        assert all(torch.equal(a, b) for ra, rb in zip(ref, got) for a, b in zip(ra, rb))
    first, state = run(root, 2, 11)
    rest, end = run(root, 4, 19, state=state)
    assert end == ref_state
    assert all(torch.equal(a, b) for ra, rb in zip(ref, first + rest) for a, b in zip(ra, rb))
    other, _ = run(root, 1, 3, state={**state, "consumed_samples": 0, "seed": SEED})
    assert torch.equal(other[0][0], ref[0][0])


def test_validation_interleave_and_fingerprint(root):
    val = open_dataset(str(root), MIX, "val")
    n = val.num_samples(SEQ)
    tiny_val = val.parts[2].num_samples(SEQ)
    assert 0 < n and val.schedule.count_before(n)[2] <= tiny_val  # stops when the smallest runs out
    batches = validation_batches(val, SEQ, 4, 100)
    assert len(batches) == -(-min(n, 100) // 4)  # 100 fixed windows, or all the split has
    again = validation_batches(open_dataset(str(root), MIX, "val"), SEQ, 4, 100, 1, 2)
    assert torch.equal(again[0][0], batches[0][0][2:])
    fp = fingerprint(val.manifest)
    assert [e[:2] for e in fp["mix"]] == [["web", 0.7], ["code", 0.2], ["tiny", 0.1]]
    assert fingerprint(MixtureDataset(str(root), [["web", 0.6], ["code", 0.4]]).manifest) != fp
    assert isinstance(make_loader(open_dataset(str(root), MIX, "train"), SEQ, 0), MixtureLoader)


def test_refusals(root, text_gen, tmp_path):
    (tmp_path / "t.txt").write_text(text_gen(3000))
    prepare([str(tmp_path / "t.txt")], root / "bpe", tokenizer="bpe", vocab_size=300)
    with pytest.raises(NdtrainError, match=r"data\.mix.*component 'bpe'.*has tokenizer 'bpe'.*one tokenizer"):
        MixtureDataset(str(root), [["web", 1], ["bpe", 1]])
    with pytest.raises(NdtrainError, match=r"nope/manifest\.json: no manifest found"):
        MixtureDataset(str(root), [["web", 1], ["nope", 1]])
    with pytest.raises(NdtrainError, match="mixture component 'tiny' has .* fewer than one sample"):
        MixtureLoader(MixtureDataset(str(root), MIX), 1000, 0)
    for mix, match in [([["web", 0]], "positive weights"), ([["web"]], "pairs"), ([["a", 1], ["a", 2]], "unique"),
                       ([[3, 1]], "pairs")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, {"data": {"mix": mix}})
    assert load_config(None, ["--data.mix", '[["web", 0.7], ["code", 0.3]]']).data.mix == [["web", 0.7], ["code", 0.3]]
