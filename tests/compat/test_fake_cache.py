"""compat/fake_cache.py: the dry run's fake mode keys and rebuilds its cache hits itself, and
torch checks every hit against a real dispatch here (its cache cross-check); a missing torch name
leaves torch's own key and output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ndtrain.compat.fake import fake_tensor_mode
from ndtrain.compat.torch import PRIVATE


def _ops(x: torch.Tensor, w: torch.Tensor) -> list:
    """Each kind of cache entry: new tensors, views (of the input's storage, at the input's offset),
    an in-place op (its argument), several outputs, a scalar argument by type, a keyword argument,
    a Size."""
    y = x @ w
    v = y.view(4, 2, 8).transpose(0, 1)
    parts = y.split(2, dim=0)
    flat = [p.view(32) for p in parts]  # alike but for their storage offsets
    y.add_(1.0)
    z = (y * 2) + (y * 2.0)
    s = torch.sum(z, dim=0, keepdim=True)
    e = torch.empty(torch.Size([3, 5]), dtype=torch.bfloat16)
    by_type = [torch.full((2,), 2), torch.full((2,), 2.0)]  # 2 == 2.0 as keys; int64 and float32
    return [y, v, *parts, *flat, z, s, e, *by_type, x.to(torch.bfloat16), x.t().contiguous()]


def _run_twice(mode) -> tuple[list, list]:
    with mode:
        x, w = torch.empty(4, 6), torch.empty(6, 16)
        return _ops(x, w), _ops(x, w)  # the second pass hits what the first cached


def _described(tensors: list) -> list:
    return [(t.shape, t.stride(), t.dtype, t.device, t.storage_offset(), t.requires_grad) for t in tensors]


def test_every_hit_matches_a_real_dispatch_and_views_share_their_storage():
    mode = fake_tensor_mode()
    assert "_prep_args_for_hash" in vars(mode) and "_output_from_cache_entry" in vars(mode)
    mode.cache_crosscheck_enabled = True  # torch recomputes each hit and compares its metadata
    hits = type(mode).cache_hits
    first, second = _run_twice(mode)
    assert type(mode).cache_hits - hits >= len(second)
    assert _described(first) == _described(second)
    y, v = second[0], second[1]
    assert v.untyped_storage() is y.untyped_storage()  # the watch tracks memory by storage
    assert second[2].untyped_storage() is y.untyped_storage()  # split: views, in a tuple


def test_the_figures_match_torchs_own_key_and_output(monkeypatch):
    quick = _described(_run_twice(fake_tensor_mode())[1])
    for key in ("fake_cache_key_args", "fake_cache_output"):
        monkeypatch.setitem(PRIVATE, key, dataclasses.replace(PRIVATE[key], attr=PRIVATE[key].attr + "_gone"))
    mode = fake_tensor_mode()
    assert "_prep_args_for_hash" not in vars(mode) and "_output_from_cache_entry" not in vars(mode)
    assert _described(_run_twice(mode)[1]) == quick


@pytest.mark.parametrize("key", ["fake_cache_key_args", "fake_cache_output"])
def test_a_changed_signature_keeps_torchs_own(monkeypatch, key):
    import ndtrain.compat.fake_cache as fake_cache

    monkeypatch.setattr(fake_cache, "_PREP" if key == "fake_cache_key_args" else "_OUTPUT", ["self", "other"])
    mode = fake_tensor_mode()
    replaced = "_prep_args_for_hash" if key == "fake_cache_key_args" else "_output_from_cache_entry"
    assert replaced not in vars(mode)
    _run_twice(mode)


def test_a_metadata_field_the_key_does_not_describe_keeps_torchs_key(monkeypatch):
    """torch's key describes a tensor by its TensorMetadata's fields: a field this key neither
    lists nor derives from the shape, strides and layout (here: one dropped from the list) could
    tell apart what this key confuses."""
    import ndtrain.compat.fake_cache as fake_cache

    assert "_prep_args_for_hash" in vars(fake_tensor_mode())
    monkeypatch.setattr(fake_cache, "DESCRIBED", tuple(f for f in fake_cache.DESCRIBED if f != "requires_grad"))
    assert "_prep_args_for_hash" not in vars(fake_tensor_mode())


def test_each_input_tensor_is_keyed_by_every_described_field():
    from ndtrain.compat.fake_cache import DESCRIBED

    mode, key = fake_tensor_mode(), []
    with mode:
        x = torch.empty(2, 3)
    mode._prep_args_for_hash(key, (x,), None, [])
    described = [k for k in key if isinstance(k, tuple)]
    assert len(described) == 1 and len(described[0]) == len(DESCRIBED)
    assert described[0][:4] == (x.dtype, (2, 3), (3, 1), x.device)
