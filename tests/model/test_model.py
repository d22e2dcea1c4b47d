"""Model shape, counts and layout-independent initialisation."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ndtrain.layout.flops import flops_per_token
from ndtrain.model.config import PRESETS, num_params, preset
from ndtrain.model.init import init_std, init_values, materialize
from ndtrain.model.llama import apply_rope, build_model, expand_kv, rope_cos_sin


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_closed_form(name):
    cfg = preset(name)
    model = build_model(cfg, "meta")  # meta: no memory even for 405B
    counted = sum(p.numel() for p in model.parameters())
    assert counted == num_params(cfg)


def test_published_llama3_sizes():
    # Published totals: 1.24B (3.2 1B), 8.03B, 70.6B, 405.9B.
    assert round(num_params(preset("llama3-1b")) / 1e9, 2) == 1.24
    assert round(num_params(preset("llama3-8b")) / 1e9, 2) == 8.03
    assert round(num_params(preset("llama3-70b")) / 1e9, 1) == 70.6
    assert round(num_params(preset("llama3-405b")) / 1e9, 1) == 405.9
    assert num_params(preset("debug")) < 1_000_000


def _explicit_attention(q, k, v):
    """Causal attention as plain matmuls: torch's FLOP counter has no formula for the CPU flash
    kernel, and the formula's convention (full s x s scores) is exactly what this computes.
    K/V arrive with their own (fewer) heads, as every `Attention.sdpa` receives them."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def test_flops_formula_matches_counted_forward_backward():
    cfg = preset("debug")
    model = materialize(build_model(cfg), seed=0)
    for block in model.layers.values():
        block.attention.sdpa = _explicit_attention
    batch, seq = 2, 128
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(tokens).float().sum().backward()
    assert counter.get_total_flops() == flops_per_token(cfg, seq) * batch * seq


def test_init_row_slice_equals_whole():
    shape = (300, 70)  # several RNG blocks, an uneven final block
    whole = init_values("layers.0.attention.wq.weight", shape, 0.02, seed=7)
    for start, rows in [(0, 1), (13, 100), (299, 1), (150, 150)]:
        part = init_values("layers.0.attention.wq.weight", shape, 0.02, seed=7, offset=(start, 0),
                           local_shape=(rows, 70))
        assert torch.equal(part, whole[start:start + rows])
    cols = init_values("layers.0.attention.wq.weight", shape, 0.02, seed=7, offset=(40, 35), local_shape=(20, 35))
    assert torch.equal(cols, whole[40:60, 35:70])


def test_init_depends_on_seed_and_name_only():
    a = init_values("output.weight", (64, 32), 0.02, seed=1)
    assert torch.equal(a, init_values("output.weight", (64, 32), 0.02, seed=1))
    assert not torch.equal(a, init_values("output.weight", (64, 32), 0.02, seed=2))
    assert not torch.equal(a, init_values("tok_embeddings.weight", (64, 32), 0.02, seed=1))
    assert abs(float(a.std()) - 0.02) < 0.002


def test_materialized_model_is_reproducible_and_scaled():
    cfg = preset("debug")
    m1 = materialize(build_model(cfg), seed=3)
    m2 = materialize(build_model(cfg), seed=3)
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p1, p2), n
    assert torch.equal(m1.layers["0"].attention_norm.weight, torch.ones(cfg.dim))
    assert init_std("layers.1.attention.wo.weight", 4, 0.02) < init_std("layers.1.attention.wq.weight", 4, 0.02)


def test_tied_embeddings_share_storage():
    cfg = preset("debug", tie_embeddings=True)
    model = materialize(build_model(cfg), seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)


def test_rope_uses_given_positions():
    """A suffix of the sequence rotated with its global positions equals the same rows of the
    whole sequence: what sequence/context parallelism rely on."""
    x = torch.randn(1, 16, 2, 8)
    cos, sin = rope_cos_sin(torch.arange(16), 8, 10000.0)
    whole = apply_rope(x, cos, sin)
    cos_s, sin_s = rope_cos_sin(torch.arange(8, 16), 8, 10000.0)
    assert torch.allclose(apply_rope(x[:, 8:], cos_s, sin_s), whole[:, 8:], atol=1e-6)


def test_causal():
    cfg = preset("debug")
    model = materialize(build_model(cfg), seed=0)
    tokens = torch.randint(0, 256, (1, 32))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :20], b[0, :20], atol=1e-6)
    assert not torch.allclose(a[0, 20:], b[0, 20:])


def test_attention_kernel_receives_unexpanded_kv():
    """`Attention.sdpa` gets K/V with n_kv_heads (what context parallel transfers), and the
    default kernel's grouped-query expansion equals torch's own GQA attention."""
    cfg = preset("debug")
    assert cfg.n_kv_heads < cfg.n_heads
    model = materialize(build_model(cfg), seed=0)
    tokens = torch.randint(0, 256, (2, 32))
    ref = model(tokens)
    seen = []

    def spy(q, k, v):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    for block in model.layers.values():
        block.attention.sdpa = spy
    out = model(tokens)
    assert seen == [(cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)] * cfg.n_layers
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_gqa_kv_reach_sdpa_unexpanded_and_match_the_expanded_reference(monkeypatch, masked):
    """causal_sdpa hands SDPA K/V with their own h_kv heads and enable_gqa=True: no
    repeat_interleave copy (4x the K/V memory and traffic at Llama 3 8B's 32/8 heads). The same
    path runs on CPU and CUDA (the flex branch is checked in test_document_mask.py)."""
    from ndtrain.model.llama import causal_sdpa, document_causal_mask

    sdpa = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(5)
    b, h, h_kv, s, d = 2, 8, 2, 64, 16
    q = torch.randn(b, h, s, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s, d, generator=g, requires_grad=True) for _ in range(2))
    doc = torch.randint(0, 3, (b, s), generator=g).sort(1).values if masked else None
    out = causal_sdpa(q, k, v, doc)
    assert seen == [(h, h_kv, h_kv, True)]
    go = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), go)
    # The reference: K/V expanded to every query head, as before.
    ke, ve = k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)
    kw = {"attn_mask": document_causal_mask(doc)} if masked else {"is_causal": True}
    ref = sdpa(q, ke, ve, **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)  # the forward is the same sums
    # dK/dV sum the h/h_kv query heads of a group in another order: fp32 reassociation of 4
    # terms, bounded by a few ulps of the largest gradient (measured: <= 2.5e-7 of the max).
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=8 * torch.finfo(torch.float32).eps * want.abs().max(), rtol=0)


def test_gqa_expands_kv_where_no_fused_kernel_takes_them(monkeypatch):
    """Where torch's checks say no fused kernel takes grouped K/V (fp32 on a CUDA torch whose
    efficient kernel lacks GQA), K/V are expanded as before rather than left to the math kernel."""
    from ndtrain.model import doc_attention
    from ndtrain.model.llama import causal_sdpa

    sdpa = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append((k.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(doc_attention, "fused_gqa", lambda q, k: False)
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(1, 8, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g)
    out = causal_sdpa(q, k, v)
    assert seen == [(8, False)]
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True, enable_gqa=True), atol=0, rtol=0)
