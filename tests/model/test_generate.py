"""The sampler's KV cache: prefill once, then one token per forward, giving the tokens (greedy
and seeded) and the logits of the no-cache path, across the window restarts past the context."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ndtrain.model.config import preset
from ndtrain.model.init import materialize
from ndtrain.model.llama import build_model
from ndtrain.train.generate import does_not_fit, memory_needed, sample

# A context of 24 so that 60 new tokens cross two window restarts (ctx/2 = 12 kept each time);
# init_std 0.2 so that the logits are far from uniform and greedy choices are not near-ties.
CTX, NEW = 24, 60


@pytest.fixture(scope="module")
def model():
    cfg = dataclasses.replace(preset("debug"), max_seq_len=CTX, init_std=0.2)  # GQA: 8 heads, 4 K/V heads
    m = materialize(build_model(cfg, "meta"), seed=7)
    return m.eval()


PROMPT = [5, 17, 99, 3, 250, 42, 7]


@pytest.mark.timeout(60)
def test_cached_greedy_matches_no_cache(model):
    cached = sample(model, PROMPT, NEW, temperature=0, cache=True)
    plain = sample(model, PROMPT, NEW, temperature=0, cache=False)
    assert len(cached) == len(PROMPT) + NEW
    assert cached == plain


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 3])
def test_cached_seeded_sampling_matches_no_cache(model, seed):
    cached = sample(model, PROMPT, NEW, temperature=0.8, top_k=40, seed=seed, cache=True)
    assert cached == sample(model, PROMPT, NEW, temperature=0.8, top_k=40, seed=seed, cache=False)
    assert cached != sample(model, PROMPT, NEW, temperature=0.8, top_k=40, seed=seed + 1, cache=True)


@pytest.mark.timeout(60)
def test_prefill_once_then_one_token_per_forward(model):
    lengths = []
    hook = model.register_forward_pre_hook(lambda _m, args: lengths.append(args[0].shape[1]))
    try:
        out = sample(model, PROMPT, NEW, temperature=0, cache=True)
    finally:
        hook.remove()
    # The prompt (7), single tokens until the window holds 24, then it restarts on its newest 12
    # (one refill forward) and fills again: 7 + 17 = 24, then 12 + 12 = 24 each round.
    assert lengths == [len(PROMPT)] + [1] * 17 + ([CTX // 2] + [1] * 12) * 3 + [CTX // 2] + [1] * 2
    assert len(out) == len(PROMPT) + NEW


@pytest.mark.timeout(60)
def test_cached_logits_match_the_full_forward(model):
    """Decode logits of every position against one causal forward of the whole sequence."""
    ids = PROMPT + list(range(10, 20))
    with torch.no_grad():
        full = model(torch.tensor([ids]))[0]
        # the sampler's cache, driven by hand: prefill the prompt, then one token at a time
        from ndtrain.train.generate import KVCache

        layers = list(model.layers.values())
        caches = [KVCache(layer.attention.sdpa, len(ids)) for layer in layers]
        for layer, c in zip(layers, caches):
            layer.attention.sdpa = c
        try:
            steps = [model(torch.tensor([PROMPT]))[0, -1]]
            for pos in range(len(PROMPT), len(ids)):
                steps.append(model(torch.tensor([[ids[pos]]]), positions=torch.tensor([pos]))[0, -1])
        finally:
            for layer, c in zip(layers, caches):
                layer.attention.sdpa = c.inner
    # fp32 with other reduction orders (one query against the cache, not the flash kernel's
    # blocks): ~1e-7 relative per op over 4 layers of 64-wide sums, on logits of size ~1-10;
    # 1e-4 absolute is two orders of magnitude above that and far below any real difference.
    torch.testing.assert_close(torch.stack(steps), full[len(PROMPT) - 1:], atol=1e-4, rtol=1e-5)


def test_a_model_too_big_for_the_device_is_named():
    why = does_not_fit(preset("llama3-70b"), torch.device("cpu"), 200)
    assert why is not None and "GiB" in why and "host memory" in why
    assert does_not_fit(preset("debug"), torch.device("cpu"), 200) is None
    # fp32 weights (4 bytes each) dominate: 70.6B parameters are ~263 GiB
    assert 260 < memory_needed(preset("llama3-70b"), 200) / 2**30 < 270


# ---- reading a run's checkpoints (issue 33, classes 9 and 15) ---------------------------------
@pytest.fixture(scope="module")
def trained(parity_base, tmp_path_factory):
    """A 2-step byte-tokenizer run with a checkpoint at each step, started with a *relative*
    data.path from its own working directory."""
    import os
    import shutil

    from ndtrain.config import load_config
    from ndtrain.train.trainer import train

    home = tmp_path_factory.mktemp("launch")
    shutil.copytree(parity_base["data"]["path"], home / "corpus")
    base = {k: dict(v) for k, v in parity_base.items()}
    base["data"]["path"] = "corpus"
    base["train"].update(steps=2, val_interval=0, sample_tokens=0, output_dir=str(home / "run"))
    base["checkpoint"] = {"interval_steps": 1, "keep_last": 2}
    old = os.getcwd()
    os.chdir(home)
    try:
        train(load_config(None, base))
    finally:
        os.chdir(old)
    return home


def _copy_run(trained, tmp_path):
    import shutil

    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.timeout(120)
def test_a_byte_checkpoint_samples_from_anywhere(trained, tmp_path, monkeypatch):
    """The run's data path was relative to where it started, and the corpus is gone now: the
    byte tokenizer needs no file, and the recorded path is absolute (for BPE)."""
    import json

    from ndtrain.train.generate import generate_from_checkpoint

    run = _copy_run(trained, tmp_path)
    state = json.loads((run / "checkpoints" / "step_00000002" / "train_state.json").read_text())
    assert state["config"]["data"]["path"] == str(trained / "corpus")
    assert not list((run / "checkpoints").glob("*/tokenizer.json"))  # nothing to carry (a BPE run's: test_ckpt_tokenizer)
    monkeypatch.chdir(tmp_path)
    out = generate_from_checkpoint(run, "def ", 5, temperature=0)
    (trained / "corpus").rename(trained / "corpus-moved")
    try:
        assert generate_from_checkpoint(run, "def ", 5, temperature=0) == out and out.startswith("def ")
    finally:
        (trained / "corpus-moved").rename(trained / "corpus")


def _racing_load(monkeypatch, on_first_load):
    """dcp_load, with `on_first_load(ckpt)` run just before its first read: what a live run
    does meanwhile."""
    from ndtrain.train import checkpoint

    real, calls = checkpoint.dcp_load, []

    def racing(state, ckpt, no_dist=False):
        calls.append(ckpt.name)
        if len(calls) == 1:
            on_first_load(ckpt)
        return real(state, ckpt, no_dist=no_dist)

    monkeypatch.setattr(checkpoint, "dcp_load", racing)  # generate.py reads it from the package
    return calls


def _retention_removes(ckpt):
    """What retention does (checkpoint/retention.py's retain): unmark by a rename, then delete."""
    import os
    import shutil

    doomed = ckpt.with_name(f".{ckpt.name}.deleting")
    os.replace(ckpt, doomed)
    shutil.rmtree(doomed)


@pytest.mark.timeout(120)
def test_a_checkpoint_removed_while_read_gives_way_to_the_newest(trained, tmp_path, monkeypatch):
    import os

    from ndtrain.train import generate

    run = _copy_run(trained, tmp_path)
    ckpts = run / "checkpoints"
    os.replace(ckpts / "step_00000002", ckpts / "later")  # not published yet when the reader starts

    def publish_and_retire(ckpt):
        os.replace(ckpts / "later", ckpts / "step_00000002")
        _retention_removes(ckpt)

    calls = _racing_load(monkeypatch, publish_and_retire)
    assert generate.generate_from_checkpoint(run, "def ", 5, temperature=0).startswith("def ")
    assert calls == ["step_00000001", "step_00000002"]
    assert generate.load_checkpoint(run)[2]["step"] == 2


@pytest.mark.timeout(120)
def test_a_named_checkpoint_removed_while_read_is_one_line_not_bad_input(trained, tmp_path, monkeypatch):
    from ndtrain.errors import NdtrainError, RunError
    from ndtrain.train.generate import generate_from_checkpoint

    run = _copy_run(trained, tmp_path)
    _racing_load(monkeypatch, _retention_removes)
    with pytest.raises(RunError, match="step_00000002: removed while it was read") as e:
        generate_from_checkpoint(run / "checkpoints" / "step_00000002", "def ", 5)
    assert e.value.exit_code == 1 and "\n" not in str(e.value)
    # A checkpoint still there but damaged is its own fault: said as before, no older one read instead.
    monkeypatch.undo()
    shard = next(p for p in sorted((run / "checkpoints" / "step_00000001").iterdir()) if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(NdtrainError, match="not usable") as e:
        generate_from_checkpoint(run, "def ", 5)
    assert not isinstance(e.value, RunError)
