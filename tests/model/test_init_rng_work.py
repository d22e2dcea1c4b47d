"""Initialization's random-number work follows the shard: a tensor-parallel rank holding 1/tp of
a weight's columns draws about 1/tp of its values (it drew all of them when values were drawn in
whole rows), and every window still holds exactly the values one process holds."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ndtrain.model.init import init_values, tiling


class CountDraws(TorchDispatchMode):
    """How many random normals were drawn under it."""

    def __init__(self):
        super().__init__()
        self.drawn = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.normal_.default:
            self.drawn += args[0].numel()
        return func(*args, **(kwargs or {}))


def windows(shape: tuple[int, ...], dim: int, parts: int):
    """(offset, local_shape) of each rank's Shard(dim) window, torch's chunk sizes (the last ones
    smaller or empty)."""
    size = -(-shape[dim] // parts)
    out = []
    for rank in range(parts):
        lo, hi = min(rank * size, shape[dim]), min((rank + 1) * size, shape[dim])
        offset = [0] * len(shape)
        offset[dim] = lo
        local = list(shape)
        local[dim] = hi - lo
        out.append((tuple(offset), tuple(local)))
    return out


def draws(shape, offset, local) -> tuple[int, torch.Tensor]:
    with CountDraws() as count:
        vals = init_values("layers.0.feed_forward.w2.weight", shape, 0.02, seed=7, offset=offset, local_shape=local)
    return count.drawn, vals


# A row-parallel weight ([dim, ffn], split on its columns) and a column-parallel one (split on rows).
@pytest.mark.parametrize("shape,dim", [((256, 768), 1), ((128, 2048), 0), ((64, 192), 1), ((8, 256, 48), 1)])
def test_each_rank_draws_about_its_share_and_keeps_one_processs_values(shape, dim):
    full_draws, full = draws(shape, None, None)
    assert full_draws == full.numel()  # one process draws each value once
    for tp in (2, 4):
        per_rank = []
        for offset, local in windows(shape, dim, tp):
            drawn, vals = draws(shape, offset, local)
            index = tuple(slice(o, o + n) for o, n in zip(offset, local))
            assert torch.equal(vals, full[index])  # bit for bit what one process holds there
            per_rank.append(drawn)
        # A rank draws its share plus at most the two partly used bands of tiles at its edges;
        # all ranks together, at most one band twice per boundary between two ranks.
        block_rows, chunk_cols = tiling(shape)
        band = (chunk_cols if dim == 1 else block_rows) * (full.numel() // shape[dim])
        assert max(per_rank) <= full_draws / tp + 2 * band
        assert sum(per_rank) <= full_draws + (tp - 1) * band < tp * full_draws  # whole rows drew tp x


def test_a_wide_weight_split_on_columns_draws_one_tp_th():
    """A Llama-shaped w2 (dim 4096 x ffn 14336 in the report; here dim 256 x ffn 896 keeps it
    quick), tp = 8: each rank draws its 112 columns' tiles, not all 896 columns."""
    shape = (256, 896)
    full_draws = shape[0] * shape[1]
    for offset, local in windows(shape, 1, 8):
        drawn, vals = draws(shape, offset, local)
        assert vals.shape == local and drawn <= 2 * full_draws / 8  # was full_draws per rank


def test_vectors_and_3d_windows_on_every_dimension_match_the_whole():
    for shape in ((100,), (6, 10, 12)):
        _, full = draws(shape, None, None)
        for dim in range(len(shape)):
            for offset, local in windows(shape, dim, 3):
                _, vals = draws(shape, offset, local)
                assert torch.equal(vals, full[tuple(slice(o, o + n) for o, n in zip(offset, local))])
