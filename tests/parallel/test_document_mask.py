"""Document masking: a packed sequence with block-causal attention and per-document RoPE positions
gives the loss and gradients of running each document alone, in one process and under cp=2 and
tp=2 (one world-2 launch); the block kernels with masks; config rules."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import load_config
from ndtrain.data.packing import document_ids, document_positions
from ndtrain.errors import ConfigError
from ndtrain.model.init import canonical_name, materialize
from ndtrain.model.llama import build_model, causal_sdpa
from ndtrain.parallel.ring_attention import block_backward, block_forward

SEQ, EOS, SEED = 64, 255, 7
DOC_LENGTHS = [[9, 1, 30, 24], [40, 24], [64]]  # per row; each document ends with EOS (the last row's is cut)
TOL = dict(atol=1e-5, rtol=1e-5)


def packed_batch():
    g = torch.Generator().manual_seed(SEED)
    inputs = torch.randint(0, EOS, (len(DOC_LENGTHS), SEQ), generator=g)
    for row, lengths in enumerate(DOC_LENGTHS):
        end = 0
        for n in lengths:
            end += n
            if end < SEQ or len(lengths) > 1:
                inputs[row, end - 1] = EOS
    targets = torch.randint(0, 256, inputs.shape, generator=g)
    return inputs, targets


def debug_model():
    cfg = load_config(None, {"model": {"preset": "debug"}}).model
    return materialize(build_model(cfg, "meta"), SEED, "cpu")


def grads_of(model, scale=1.0) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[canonical_name(name)] = g.detach().clone() * scale
    return out


def each_document_alone(inputs, targets):
    """Loss sum and gradients of every document run as its own sequence (positions from 0)."""
    model = debug_model()
    total = 0.0
    for row, lengths in enumerate(DOC_LENGTHS):
        start = 0
        for n in lengths:
            logits = model(inputs[row: row + 1, start: start + n])
            loss = F.cross_entropy(logits.flatten(0, 1), targets[row, start: start + n], reduction="sum")
            loss.backward()
            total += float(loss.detach())
            start += n
    return total, grads_of(model)


def test_document_ids_and_positions():
    inputs, _ = packed_batch()
    doc, pos = document_ids(inputs, EOS), document_positions(document_ids(inputs, EOS))
    assert doc[0, :9].eq(0).all() and doc[0, 9] == 1 and doc[0, 10:40].eq(2).all() and doc[0, 40:].eq(3).all()
    assert pos[0, :9].tolist() == list(range(9)) and pos[0, 9] == 0 and pos[0, 10:40].tolist() == list(range(30))
    assert doc[2].eq(0).all() and pos[2].tolist() == list(range(SEQ))


def test_packed_and_masked_equals_each_document_alone():
    inputs, targets = packed_batch()
    ref_loss, ref_grads = each_document_alone(inputs, targets)
    model = debug_model()
    doc = document_ids(inputs, EOS)
    logits = model(inputs, positions=document_positions(doc), doc_ids=doc)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    torch.testing.assert_close(float(loss.detach()), ref_loss, **TOL)
    got = grads_of(model)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name], g, **TOL, msg=name)
    # Without the mask the packed sequence is a different computation (the test can fail).
    plain = debug_model()(inputs)
    assert not torch.allclose(plain, logits.detach(), atol=1e-3)


# torch warns once per process about eager flex: whichever test runs it first sees the warning.
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")  # eager flex: CUDA compiles it
def test_flex_attention_path_matches_the_dense_mask():
    from ndtrain.model.doc_attention import flex_document_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 4, SEQ, 16, generator=g) for _ in range(3))
    doc = document_ids(packed_batch()[0], EOS)
    with torch.no_grad():
        torch.testing.assert_close(flex_document_attention(q, k, v, doc, compiled=False), causal_sdpa(q, k, v, doc), **TOL)
        # Grouped K/V (2 heads for 4 queries) go in as they are (enable_gqa).
        kg, vg = k[:, ::2], v[:, ::2]
        torch.testing.assert_close(flex_document_attention(q, kg, vg, doc, compiled=False),
                                   causal_sdpa(q, kg, vg, doc), **TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_block_kernels_with_a_mask(causal):
    """Fused and portable block kernels agree with a reference, rows with no visible key included."""
    g = torch.Generator().manual_seed(3)
    q, go = torch.randn(2, 3, 24, 8, generator=g), torch.randn(2, 3, 24, 8, generator=g)
    k, v = torch.randn(2, 3, 24, 8, generator=g), torch.randn(2, 3, 24, 8, generator=g)
    # Queries from documents 0..3, keys from 1..2 only: queries of 0 and 3 see nothing here.
    dq, dk = torch.randint(0, 4, (2, 24), generator=g).sort(1).values, torch.randint(1, 3, (2, 24), generator=g).sort(1).values
    mask = (dq[:, :, None] == dk[:, None, :])[:, None]
    if causal:
        mask = mask & torch.ones(24, 24, dtype=torch.bool).tril()
    empty = ~mask.any(-1)
    assert empty.any()  # some query sees nothing in this block
    scale = 0.3
    out_f, lse_f = block_forward(q, k, v, causal, scale, fused=True, mask=mask)
    out_p, lse_p = block_forward(q, k, v, causal, scale, fused=False, rows=10, mask=mask)
    torch.testing.assert_close(out_p, out_f, **TOL)
    torch.testing.assert_close(lse_p, lse_f, **TOL)
    assert torch.isinf(lse_f[empty.expand_as(lse_f)]).all() and out_f[empty.expand_as(lse_f)].eq(0).all()
    full = ~empty.expand_as(lse_f)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty[..., None], scale=scale)
    torch.testing.assert_close(out_f[full], ref[full], **TOL)
    # Backward with a finite (global) lse, as the ring calls it.
    lse = torch.where(torch.isinf(lse_f), torch.zeros_like(lse_f), lse_f)
    for a, b in zip(block_backward(go, q, k, v, out_f, lse, causal, scale, fused=True, mask=mask),
                    block_backward(go, q, k, v, out_f, lse, causal, scale, fused=False, rows=10, mask=mask)):
        torch.testing.assert_close(a.float(), b.float(), **TOL)


def test_document_mask_config_rules():
    with pytest.raises(ConfigError) as err:
        from ndtrain.parallel import dims as pdims

        cfg = load_config(None, {"data": {"document_mask": True}, "model": {"tie_embeddings": False},
                                 "parallel": {"pp": 2, "dp_shard": 1}, "train": {"global_batch": 8, "micro_batch": 4}})
        pdims.checked_layout(cfg.parallel, 2, cfg.model, cfg.data.seq_len, cfg.train, cfg.data)
    assert err.value.key == "data.document_mask"
    with pytest.raises(ConfigError, match="data.document_mask.*must be true or false"):
        load_config(None, {"data": {"document_mask": "yes"}})


# ---- cp=2 and tp=2 in one world-2 launch ---------------------------------------------------
def _rank(layouts, inputs, targets):
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    from ndtrain.parallel import dims as pdims
    from ndtrain.parallel.compose import parallelize
    from ndtrain.parallel.context import shard_sequence

    out = []
    for layout in layouts:
        cfg = load_config(None, {"model": {"preset": "debug"}, "data": {"seq_len": SEQ, "document_mask": True},
                                 "parallel": {"dp_shard": 1, **layout}})
        dims = pdims.checked_layout(cfg.parallel, 2, cfg.model, SEQ, data=cfg.data)
        mesh = pdims.build_mesh(dims, "cpu")
        model = materialize(parallelize(build_model(cfg.model, "meta"), dims, mesh), SEED, "cpu")
        cp_rank = mesh["cp"].get_local_rank()

        def shard(t):
            return shard_sequence(t, dims.cp, cp_rank)

        doc = document_ids(inputs, EOS)
        with loss_parallel() if dims.tp > 1 else contextlib.nullcontext():
            logits = model(shard(inputs), positions=shard(document_positions(doc)), doc_ids=shard(doc))
            loss = F.cross_entropy(logits.flatten(0, 1), shard(targets).flatten(), reduction="sum")
            loss.backward()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        value = value.detach().reshape(1)
        if dims.cp > 1:  # cp ranks hold disjoint tokens; FSDP averaged their gradients
            dist.all_reduce(value, group=mesh["cp"].get_group())
        out.append({"loss": float(value), "grads": grads_of(model, scale=dims.cp)})
    return out


@pytest.mark.timeout(240)
def test_cp2_and_tp2_masked_equal_each_document_alone(hang_deadline):
    from ndtrain.parallel.launch import run_ranks

    inputs, targets = packed_batch()
    ref_loss, ref_grads = each_document_alone(inputs, targets)
    layouts = [{"cp": 2}, {"cp": 2, "cp_attention": "allgather"}, {"tp": 2}]
    per_rank = run_ranks(2, _rank, layouts, inputs, targets, timeout_s=hang_deadline(120))
    for i, layout in enumerate(layouts):
        for rank_out in per_rank:
            got = rank_out[i]
            torch.testing.assert_close(got["loss"], ref_loss, **TOL, msg=str(layout))
            for name, g in ref_grads.items():
                torch.testing.assert_close(got["grads"][name], g, **TOL, msg=f"{layout} {name}")


@pytest.mark.timeout(300)
def test_trainer_with_document_mask_matches_one_process_under_cp_and_tp(parity_base, tmp_path):
    """The trainer's own path (document ids and positions cut like the tokens) on short documents."""
    import json

    from ndtrain.data.loader import StatefulLoader, TokenDataset
    from ndtrain.data.prepare import prepare
    from ndtrain.tools.verify import format_table, verify

    words = ["def", "return", "self", "value", "é", "日本", "x", "=", "(", ")", "\n"]
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[j] for j in torch.randint(0, len(words), (2 + (7 * i) % 9,), generator=g).tolist())
            for i in range(600)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    prepare([str(tmp_path / "d.jsonl")], tmp_path / "short", val_fraction=0.05)
    first = StatefulLoader(TokenDataset(tmp_path / "short"), 64, 1234).next_batch(8).inputs
    assert (first == EOS).sum(1).min() >= 1  # every row packs several documents
    base = {**parity_base, "data": {"path": str(tmp_path / "short"), "seq_len": 64, "document_mask": True}}
    _, results = verify(base, ["cp=2", "tp=2"], steps=2, tol_loss=1e-5, tol_weight=1e-5)
    assert all(r.passed for r in results), format_table(results, 1e-5, 1e-5)


# ---- the CUDA path (flex attention), made reachable on CPU ----------------------------------
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")  # eager flex: CUDA compiles it
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_flex_path_builds_one_block_mask_per_micro_batch(monkeypatch, ac):
    """The 4-layer debug model through the CUDA branch (flex attention, eager on CPU), with
    activation checkpointing: one `create_block_mask` per micro-batch, not one per layer and
    again per recompute; K/V reach flex with their own heads (enable_gqa, no expanded copy);
    loss and gradients equal each document run alone."""
    import torch.nn.attention.flex_attention as fa

    from ndtrain.model import doc_attention
    from ndtrain.parallel.activation import apply_activation_checkpointing

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)  # torch: "no flex backward on CPU"
    monkeypatch.setattr(doc_attention, "uses_flex", lambda device: True)  # the branch CUDA takes
    kernel_saw = []

    def eager_flex(q, k, v, **kwargs):  # in place of the compiled kernel (compiled=False)
        kernel_saw.append((q.shape[1], k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return fa.flex_attention(q, k, v, **kwargs)

    monkeypatch.setattr(doc_attention, "_compiled_flex", lambda: eager_flex)
    monkeypatch.setattr(doc_attention, "_compiled_block_mask", lambda: fa.create_block_mask)  # eager, counted
    built = []
    create = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(a[1:]) or create(*a, **k))

    inputs, targets = packed_batch()
    ref_loss, ref_grads = each_document_alone(inputs, targets)
    model = debug_model()
    apply_activation_checkpointing(model, ac)
    total = 0.0
    micro_batches = [slice(0, 2), slice(2, 3)]
    for rows in micro_batches:
        doc = document_ids(inputs[rows], EOS)
        logits = model(inputs[rows], positions=document_positions(doc), doc_ids=doc)
        loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten(), reduction="sum")
        loss.backward()
        total += float(loss.detach())
    assert len(built) == len(micro_batches), built
    cfg = model.cfg
    assert kernel_saw and set(kernel_saw) == {(cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads, True)}, set(kernel_saw)
    torch.testing.assert_close(total, ref_loss, **TOL)
    got = grads_of(model)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name], g, **TOL, msg=name)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")  # eager flex: CUDA compiles it
def test_other_kernels_get_plain_ids(monkeypatch):
    """A kernel swapped in for the default (context parallel's; here a spy) gets the plain
    document ids on the flex branch too: with no default kernel left no block mask is built, and
    beside a default one (the mask is built once for it) Block.forward hands the spy the ids."""
    import torch.nn.attention.flex_attention as fa

    from ndtrain.model import doc_attention

    monkeypatch.setattr(doc_attention, "uses_flex", lambda device: True)
    monkeypatch.setattr(doc_attention, "_compiled_flex", lambda: fa.flex_attention)
    monkeypatch.setattr(doc_attention, "_compiled_block_mask", lambda: fa.create_block_mask)  # eager, counted
    built, create = [], fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(1) or create(*a, **k))
    got = []

    def kernel(q, k, v, doc_ids=None):
        got.append(type(doc_ids))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    inputs, _ = packed_batch()
    doc = document_ids(inputs, EOS)
    for keep_default in (0, 1):
        model = debug_model()
        for i, block in enumerate(model.layers.values()):
            if i >= keep_default:
                block.attention.sdpa = kernel
        built.clear(), got.clear()
        with torch.no_grad():  # flex backward is refused on CPU; the arguments are what counts
            model(inputs, positions=document_positions(doc), doc_ids=doc)
        assert got == [torch.Tensor] * (len(model.layers) - keep_default)
        assert len(built) == keep_default


@pytest.mark.slow  # a cold inductor compile of flex attention: ~70 s on a loaded 2-core host
@pytest.mark.timeout(600)
def test_compiled_blocks_take_the_document_mask_without_recompiling(monkeypatch):
    """Blocks compiled as `compile = true` does, on the flex branch (forward only: flex has no CPU
    backward): each micro-batch brings a new DocumentMask (new ids, new mask_mod closure, built
    by the compiled create_block_mask that CUDA uses), and dynamo still runs one graph for every
    layer and micro-batch (and one for the mask builder), with no graph break, and the dense
    path's numbers."""
    from torch._dynamo.utils import counters

    from ndtrain.model import doc_attention

    inputs, _ = packed_batch()
    reference = debug_model()
    model = debug_model()
    for block in model.layers.values():
        block.compile()
    monkeypatch.setattr(doc_attention, "uses_flex", lambda device: True)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for rows in (slice(0, 2), slice(1, 3), slice(0, 2)):
            doc = document_ids(inputs[rows], EOS)
            got = model(inputs[rows], positions=document_positions(doc), doc_ids=doc)
            with monkeypatch.context() as m:
                m.setattr(doc_attention, "uses_flex", lambda device: False)
                want = reference(inputs[rows], positions=document_positions(doc), doc_ids=doc)
            torch.testing.assert_close(got, want, **TOL)
    # Two graphs, each compiled once for 3 micro-batches (x 4 layers): the block, the mask builder.
    assert counters["frames"]["total"] == counters["stats"]["unique_graphs"] == 2, dict(counters)
    assert not counters["graph_break"], dict(counters)
