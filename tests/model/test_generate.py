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
