"""Deterministic, layout-independent initialisation.

Every parameter value is a pure function of (seed, parameter name, global index). Values are
drawn in fixed tiles, each from a generator seeded by hash(seed, name, tile): blocks of rows
(FSDP and column-parallel TP shard rows), each cut into chunks of columns (row-parallel TP
shards columns). A rank that owns a window of a parameter - an FSDP shard, a TP shard of either
dimension, a pipeline stage - draws only the tiles that overlap it and keeps exactly the values a
single process would hold there: its random-number work follows its shard, not the whole tensor.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

# Wrappers that prefix parameter names; the canonical name drops them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_BLOCK_ELEMENTS = 1 << 16  # a block of rows holds about this many values (at least one row)
# A tile (a block's rows x a chunk of columns) holds at least this many values, so that seeding a
# generator stays a small part of drawing its values; a chunk is at least _MIN_CHUNK columns wide.
_MIN_TILE, _MIN_CHUNK = 1 << 12, 64


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def init_std(name: str, n_layers: int, base_std: float) -> float | None:
    """Standard deviation for a parameter; None means 'ones' (norm weights), 0.0 means zeros."""
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if parent.endswith("norm") and leaf == "weight":
        return None
    if name.endswith("expert_bias"):
        return 0.0
    if parent in ("wo", "w2") or name.endswith(".w2"):
        # GPT-2/Megatron scaling: residual-branch outputs shrink with depth.
        return base_std / math.sqrt(2 * n_layers)
    return base_std


def _tile_seed(seed: int, name: str, block: int, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}|{name}|{block}|{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tiling(global_shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows per block, columns per chunk) of a tensor's tiles: a function of its shape alone."""
    cols = global_shape[1] if len(global_shape) > 1 else 1
    trailing = math.prod(global_shape[2:])
    block_rows = max(1, _BLOCK_ELEMENTS // max(cols * trailing, 1))
    chunk_cols = min(cols, max(_MIN_CHUNK, -(-_MIN_TILE // (block_rows * max(trailing, 1)))))
    return block_rows, max(chunk_cols, 1)


def init_values(name: str, global_shape: tuple[int, ...], std: float | None, seed: int,
                offset: tuple[int, ...] | None = None, local_shape: tuple[int, ...] | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of `name` in the window [offset, offset + local_shape) of its global tensor."""
    global_shape = tuple(global_shape)
    offset = tuple(offset) if offset is not None else (0,) * len(global_shape)
    local_shape = tuple(local_shape) if local_shape is not None else global_shape
    if std is None:
        return torch.ones(local_shape, dtype=dtype)
    if std == 0.0 or 0 in local_shape:
        return torch.zeros(local_shape, dtype=dtype)
    shape = global_shape if len(global_shape) > 1 else (*global_shape, 1)  # a vector: one column
    local = local_shape if len(global_shape) > 1 else (*local_shape, 1)
    start = offset if len(global_shape) > 1 else (*offset, 0)
    rows_total, cols_total, trailing = shape[0], shape[1], shape[2:]
    block_rows, chunk_cols = tiling(global_shape)
    r0, r1 = start[0], start[0] + local[0]
    c0, c1 = start[1], start[1] + local[1]
    gen = torch.Generator()
    out = torch.empty((r1 - r0, c1 - c0, *trailing), dtype=torch.float32)
    scratch = torch.empty(block_rows * chunk_cols * math.prod(trailing), dtype=torch.float32)
    for block in range(r0 // block_rows, (r1 - 1) // block_rows + 1):
        b0, b1 = block * block_rows, min((block + 1) * block_rows, rows_total)
        for chunk in range(c0 // chunk_cols, (c1 - 1) // chunk_cols + 1):
            k0, k1 = chunk * chunk_cols, min((chunk + 1) * chunk_cols, cols_total)
            gen.manual_seed(_tile_seed(seed, name, block, chunk))
            # A contiguous tile: normal_ fills it in order, the same values as a tensor of its own.
            tile = scratch[: (b1 - b0) * (k1 - k0) * math.prod(trailing)].view(b1 - b0, k1 - k0, *trailing)
            tile.normal_(0.0, std, generator=gen)
            lo, hi, left, right = max(r0, b0), min(r1, b1), max(c0, k0), min(c1, k1)
            out[lo - r0: hi - r0, left - c0: right - c0].copy_(tile[lo - b0: hi - b0, left - k0: right - k0])
    for dim in range(2, len(shape)):
        out = out.narrow(dim, start[dim], local[dim])
    return out.reshape(local_shape).to(dtype).contiguous()


def _local_window(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global_shape, offset, local_shape); DTensor-aware without the model depending on it."""
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):
        from ndtrain.compat.torch import local_shape_and_offset

        local_shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
        return tuple(param.shape), tuple(offset), tuple(local_shape)
    return tuple(param.shape), (0,) * param.dim(), tuple(param.shape)


@torch.no_grad()
def materialize(model: nn.Module, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Allocate a meta-device (possibly sharded) model on `device` and fill every parameter from
    (seed, name). Tied parameters are filled once under their first name."""
    from ndtrain.compat.fake import is_fake

    model.to_empty(device=device)
    if torch.device(device).type == "cpu":
        from ndtrain.model.linear import look_up_cpu_kernels

        look_up_cpu_kernels()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    n_layers = getattr(getattr(model, "cfg", None), "n_layers", 1)
    base_std = getattr(getattr(model, "cfg", None), "init_std", 0.02)
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    seen: set[int] = set()
    for raw_name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        name = canonical_name(raw_name)
        if tied and name == "output.weight":
            # A pipeline's last stage holds its own copy of the tied weight: the embedding's values.
            name = "tok_embeddings.weight"
        local = param.to_local() if hasattr(param, "to_local") else param
        # A dry run's tensor (tools/dryrun.py): a shape with no values to fill. Checked before the
        # window: a strided shard's offsets come from reading an index tensor, one fake read per row.
        if is_fake(local):
            continue
        global_shape, offset, local_shape = _local_window(param)
        vals = init_values(name, global_shape, init_std(name, n_layers, base_std), seed, offset, local_shape)
        local.copy_(vals.to(local.dtype))
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model
